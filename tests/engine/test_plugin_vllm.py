"""The vLLM plugin against real vLLM code, one venv per vLLM version (hack/test-engine-vllm.sh).

Each scenario runs plugin_probe.py in a fresh interpreter (patches are per process): vLLM's own
plugin loader finds our entry point, then vLLM's own factories build the input processor,
renderer and multimodal processor for a tiny local LLaVA, and the probe reports which tokenizer
objects they hold. Skipped where vLLM is not installed (the main dev venv).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_tokenizer_pool import plugin

HERE = Path(__file__).parent
HEADER = r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[plugin\.py:\d+\] "
ACTIVE = re.compile(
    HEADER + r"vlm-tokenizer-pool active: vllm=(\S+) pool_size=(\d+) patched=(\S+)$"
)
INACTIVE = re.compile(HEADER + r"vlm-tokenizer-pool inactive: vllm=(\S+) reason=(.+)$")
# the engine heartbeat's line (docs/contributing.md)
BEAT = re.compile(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[heartbeat\.py:\d+\] vlm-engine-heartbeat "
                  r"every=0\.5 steps=(\d+) in_flight=(\d+) step_s=(\d+\.\d) "
                  r"step_tokens=(\d+) running=(\d+) waiting=(\d+)$")
ENV_POOL_SIZE = 3  # what the env var asks for (used before 0.19 only)


# ---------------------------------------------------------------- pure decisions (any venv)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.17.1", (0, 17, 1)),
        ("0.17.1+cpu", (0, 17, 1)),
        ("0.21.0rc1.dev3+g1234abc", (0, 21, 0)),
        ("v0.33", (0, 33, 0)),
        ("dev", None),
        ("", None),
    ],
)
def test_parse_version(text, expected):
    assert plugin.parse_version(text) == expected


def test_plan_per_version_range():
    assert plugin.plan_for((0, 10, 2)) is None
    assert plugin.plan_for((0, 34, 0)) is None
    assert plugin.plan_for((1, 0, 0)) is None
    old = plugin.plan_for((0, 11, 0))
    assert [h.target for h in old.ctor_hooks] == [
        "vllm.multimodal.processing.InputProcessingContext.__init__",
        "vllm.inputs.preprocess.InputPreprocessor.__init__",
    ]
    assert (
        plugin.plan_for((0, 16, 0)).ctor_hooks[1].target == "vllm.renderers.hf.HfRenderer.__init__"
    )
    assert plugin.plan_for((0, 18, 1)).ctor_hooks[1].target == (
        "vllm.renderers.base.BaseRenderer.__init__"
    )
    assert not plugin.plan_for((0, 18, 1)).size_from_model_config
    assert plugin.plan_for((0, 19, 0)).size_from_model_config
    for v in ((0, 21, 0), (0, 23, 0), (0, 28, 1), (0, 29, 0), (0, 33, 0)):
        plan = plugin.plan_for(v)
        # every renderer (HfRenderer, DeepSeek, Kimi, Cohere...) subclasses BaseRenderer
        assert [h.target for h in plan.ctor_hooks] == ["vllm.renderers.base.BaseRenderer.__init__"]
        assert plan.replace_thread_pool and plan.size_from_model_config
        assert plan.mm_executor == (v >= (0, 29, 0))


def test_pool_size_rule():
    """One copy per thread that can use the tokenizer: N renderer threads, the event loop, and
    from 0.29 the multimodal executor; before 0.19 the env var."""

    class MC:
        renderer_num_workers = 3

    def size(version, model_config=MC()):  # noqa: B008
        return plugin.pool_size_for(model_config, plugin.plan_for(version), lambda: 7)

    assert size((0, 18, 1)) == 7
    assert size((0, 19, 0)) == size((0, 20, 2)) == size((0, 21, 0)) == size((0, 28, 0)) == 4
    assert size((0, 29, 0)) == size((0, 33, 0)) == 5
    assert size((0, 33, 0), object()) == 7


def test_hold_deadline_follows_vllm_render_timeout(monkeypatch):
    monkeypatch.delenv("VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", raising=False)
    assert plugin.hold_deadline_s() == 30.0
    for raw, want in (("120", 120.0), ("0.5", 0.5), ("0", 30.0), ("-1", 30.0), ("x", 30.0)):
        monkeypatch.setenv("VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", raw)
        assert plugin.hold_deadline_s() == want, raw


def test_startup_lines_follow_the_contract():
    line = plugin.active_line("0.20.2", 4, ["a.B.__init__", "c.D.__init__"])
    assert (
        line
        == "vlm-tokenizer-pool active: vllm=0.20.2 pool_size=4 patched=a.B.__init__,c.D.__init__"
    )
    assert plugin.inactive_line("0.99.0", "bad\n  thing") == (
        "vlm-tokenizer-pool inactive: vllm=0.99.0 reason=bad thing"
    )


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def lines(monkeypatch):
    """A new per-process plugin state; the (level, message) of every line it logs."""
    state = plugin._State()
    state.version, state.targets = "0.33.0", ["a.B.__init__"]
    monkeypatch.setattr(plugin, "_state", state)
    # the plugin formats its lines with vllm.logger, whose import reconfigures logging and
    # clears the handlers of loggers under "vllm": import it before adding ours
    with contextlib.suppress(ImportError):
        import vllm.logger  # noqa: F401
    handler = _Lines()
    plugin.logger.addHandler(handler)
    yield handler.lines
    plugin.logger.removeHandler(handler)


def _hooked(attr_value, hook_attr="tokenizer"):
    """Construct an object through the plugin's constructor wrapper (0.33's plan sizes)."""
    from vllm_tokenizer_pool import pool

    class Holder:
        def __init__(self):
            if attr_value is not plugin._MISSING:
                self.tokenizer = attr_value

    hook = plugin.CtorHook("m", "Holder", hook_attr)
    Holder.__init__ = plugin._ctor_wrapper(
        pool, Holder.__init__, hook, plugin.plan_for((0, 33, 0)), lambda: 3
    )
    return Holder()


def test_active_only_once_a_tokenizer_is_pooled(lines):
    transformers = pytest.importorskip("transformers")
    from vllm_tokenizer_pool import is_thread_safe
    from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer

    assert lines == []  # registering alone logs nothing
    holder = _hooked(build_fast_tokenizer(8000))
    assert is_thread_safe(holder.tokenizer)
    assert isinstance(holder.tokenizer, transformers.PreTrainedTokenizerFast)
    assert lines == [
        ("INFO", "vlm-tokenizer-pool active: vllm=0.33.0 pool_size=3 patched=a.B.__init__")
    ]


@pytest.mark.parametrize("configured", [True, False], ids=["vllm-configured", "before-vllm"])
def test_active_is_a_warning_where_vllm_logs_no_info(lines, monkeypatch, configured):
    """VLLM_LOGGING_LEVEL=WARNING drops INFO lines: the `active` line then comes at WARNING,
    or a patched pod would look unpatched. Before vLLM configured its logging the plugin reads
    the level from the environment, as vLLM will."""
    pytest.importorskip("transformers")
    from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer

    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.level, vllm_logger.handlers[:]
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "warning")
    if configured:  # what vLLM's dictConfig leaves: a handler and the level on "vllm"
        vllm_logger.handlers = [logging.NullHandler()]
        vllm_logger.setLevel(logging.WARNING)
    else:
        vllm_logger.handlers = []
    try:
        _hooked(build_fast_tokenizer(8000))
    finally:
        vllm_logger.setLevel(saved[0])
        vllm_logger.handlers = saved[1]
    assert lines == [
        ("WARNING", "vlm-tokenizer-pool active: vllm=0.33.0 pool_size=3 patched=a.B.__init__")
    ]


def test_a_tokenizer_that_cannot_be_pooled_logs_inactive_even_after_active(lines):
    pytest.importorskip("transformers")
    from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer

    _hooked(build_fast_tokenizer(8000))
    shim = object()  # e.g. a Mistral tokenizer: not an HF fast tokenizer
    assert _hooked(shim).tokenizer is shim
    _hooked(object())  # the same reason again: logged once
    assert [level for level, _ in lines] == ["INFO", "WARNING"]
    assert lines[1][1] == (
        "vlm-tokenizer-pool inactive: vllm=0.33.0 reason=object in Holder is not an HF fast "
        "tokenizer: not pooled"
    )


def test_a_hook_whose_attribute_vanished_logs_inactive(lines):
    _hooked(plugin._MISSING)
    _hooked(None)  # skip_tokenizer_init: nothing to pool, nothing to say
    assert lines == [(
        "WARNING",
        "vlm-tokenizer-pool inactive: vllm=0.33.0 reason=m.Holder.__init__ set no attribute "
        "'tokenizer'",
    )]


# ---------------------------------------------------------------- real vLLM (per-version venv)

vllm_only = pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode != 0,
    reason="vLLM is not installed in this interpreter (run hack/test-engine-vllm.sh)",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import vllm_tiny_model

    return vllm_tiny_model.write_llava(tmp_path_factory.mktemp("llava"))


def _probe(
    model_dir: Path, *extra: str, pool_size: str = str(ENV_POOL_SIZE), env: dict | None = None
) -> tuple[dict, list[str]]:
    env = dict(env or os.environ, VLM_TOKENIZER_POOL_SIZE=pool_size, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "plugin_probe.py"), str(model_dir), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(lines[-60:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), lines


def _version(report: dict) -> tuple[int, int, int]:
    return plugin.parse_version(report["version"])


def _expected_size(report: dict, workers: int) -> int:
    version = _version(report)
    if version < (0, 19, 0):
        return ENV_POOL_SIZE
    return workers + (2 if version >= (0, 29, 0) else 1)


@pytest.fixture(scope="module", params=[1, 3], ids=["renderer_workers=1", "renderer_workers=3"])
def probe(request, model_dir):
    """(report, log lines, renderer_num_workers); workers=3 only where vLLM has it (0.19+)."""
    import vllm

    workers = request.param
    if workers > 1 and plugin.parse_version(vllm.__version__) < (0, 19, 0):
        pytest.skip("--renderer-num-workers exists from vLLM 0.19")
    return (*_probe(model_dir, "--renderer-workers", str(workers)), workers)


@vllm_only
def test_startup_line_logged_once_with_contract_format(probe):
    report, lines, workers = probe
    active = [m for m in map(ACTIVE.search, lines) if m]
    assert len(active) == 1, lines
    assert not [line for line in lines if "vlm-tokenizer-pool inactive" in line]
    _, version, size, patched = active[0].groups()
    assert version == report["version"]
    assert int(size) == _expected_size(report, workers)
    expected = {h.target for h in plugin.plan_for(_version(report)).ctor_hooks}
    if _version(report) >= (0, 21, 0):
        expected.add("vllm.tokenizers.hf.maybe_make_thread_pool")
    assert expected <= set(patched.split(","))
    ours = {k for k, v in report["targets"].items() if v["ours"]}
    assert set(patched.split(",")) <= ours


@vllm_only
def test_prompt_and_multimodal_tokenizers_are_pooled_with_the_right_size(probe):
    report, _, workers = probe
    size = _expected_size(report, workers)
    for role in [report["prompt"], *report["mm"], report["hf_processor"]]:
        assert role["pooled"], role
        assert role["size"] == size, role
        assert role["encodes_like_plain"], role
    assert report["hf_processor"]["id"] == report["mm"][0]["id"]
    assert report["hf_processor_call_ok"]


@vllm_only
def test_multimodal_tokenizer_sharing_matches_the_version(probe):
    """0.18 - 0.20 give the multimodal processor its own deep copy; the others share one object."""
    report, _, workers = probe
    mm_ids = {m["id"] for m in report["mm"]}
    if (0, 20, 0) <= _version(report) < (0, 21, 0) and workers == 1:
        assert len(mm_ids) == 2  # 0.20's second, read-only processor has its own copy too
    if (0, 18, 0) <= _version(report) < (0, 21, 0):
        assert report["prompt"]["id"] not in mm_ids
    else:
        assert mm_ids == {report["prompt"]["id"]}


@vllm_only
def test_register_again_is_a_no_op(probe):
    report, _, _ = probe
    assert report["second_register_noop"]


@vllm_only
def test_pooled_tokenizer_survives_pickling(probe):
    """vLLM 0.21 - 0.23's own pool unpickles to None; ours gives a pooled tokenizer back."""
    report, _, _ = probe
    assert report["pickled"] is not None
    assert report["pickled"]["pooled"]
    assert report["pickled"]["size"] == report["prompt"]["size"]
    assert report["pickled"]["encodes_like_plain"]


@pytest.fixture(scope="module", params=["auto", "deepseek_v32", "fastokens"])
def concurrency(request, model_dir):
    """The renderer's own executors hammered with mixed truncation (0.21+): HfRenderer ("auto"),
    DeepseekV32Renderer (a BaseRenderer subclass that loads a standard HF tokenizer) and, on
    0.33, HfRenderer with VLLM_USE_FASTOKENS=1 (the Rust tokenizer swapped for fastokens' shim;
    the package is in the vllm-0.33.0 env)."""
    import vllm

    version = plugin.parse_version(vllm.__version__)
    if version < (0, 21, 0):
        pytest.skip("the renderer executors are tested from 0.21 (vLLM's own pool)")
    mode, env = request.param, dict(os.environ)
    if mode == "fastokens":
        if version < (0, 33, 0):
            pytest.skip("fastokens is installed in the vllm-0.33.0 env")
        mode, env["VLLM_USE_FASTOKENS"] = "auto", "1"
    report, _ = _probe(model_dir, "--renderer-workers", "2", "--concurrency",
                       "--tokenizer-mode", mode, env=env)
    return report, request.param


@vllm_only
def test_renderer_executors_never_fail_and_copies_stay_bounded(concurrency):
    report, mode = concurrency
    assert report["renderer"] == {
        "auto": "HfRenderer", "deepseek_v32": "DeepseekV32Renderer", "fastokens": "HfRenderer"
    }[mode]
    # fastokens replaces the Rust tokenizer with its shim: pooled all the same
    assert (report["backend"] != "Tokenizer") == (mode == "fastokens")
    assert report["calls"] == 2000
    assert report["errors"] == []
    assert report["wrong"] == 0
    assert report["pool"]["size"] == _expected_size(report, 2)
    assert report["live_tokenizers_growth"] == 0  # no copy made on demand


@vllm_only
def test_an_event_loop_call_completes_while_every_renderer_thread_holds_a_copy(concurrency):
    report, _ = concurrency
    threads = 2 + (1 if _version(report) >= (0, 29, 0) else 0)  # + the multimodal executor
    assert report["held_by_renderer_threads"] == threads
    assert report["free_while_held"] == 1  # the event loop's copy
    assert report["renderer_threads_still_holding"]
    assert report["loop_decode_ok"]


@vllm_only
def test_harness_breaks_a_base_renderer_tokenizer_without_the_plugin(model_dir):
    """Without the plugin, DeepseekV32Renderer's tokenizer is shared unprotected: the same load
    fails ("Already borrowed", tokenizers <= 0.22) or returns wrong results (>= 0.23)."""
    import vllm

    if plugin.parse_version(vllm.__version__) < (0, 21, 0):
        pytest.skip("DeepseekV32Renderer exists from 0.21")
    env = dict(os.environ, VLLM_PLUGINS="none")
    report, _ = _probe(model_dir, "--renderer-workers", "2", "--concurrency", "--tokenizer-mode",
                       "deepseek_v32", "--no-plugin", env=env)
    assert report["pool"] is None
    assert report["errors"] or report["wrong"], report


@vllm_only
def test_vllm_thread_pool_function_is_replaced_everywhere_on_0_21_plus(probe):
    report, _, _ = probe
    if _version(report) < (0, 21, 0):
        pytest.skip("vLLM < 0.21 has no maybe_make_thread_pool")
    holders = {k: v for k, v in report["targets"].items() if k.endswith(".maybe_make_thread_pool")}
    assert {"vllm.tokenizers.hf", "vllm.tokenizers", "vllm.renderers.hf"} <= {
        k.rsplit(".", 1)[0] for k in holders
    }
    assert all(v["ours"] for v in holders.values()), holders
    assert len({v["id"] for v in holders.values()}) == 1  # every module holds the same function


@vllm_only
@pytest.mark.parametrize("fake", ["0.99.0", "0.10.2", "not-a-version"])
def test_unknown_version_logs_inactive_and_patches_nothing(model_dir, fake):
    report, lines = _probe(model_dir, "--fake-version", fake)
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert inactive[0].group(1) == "WARNING"
    assert inactive[0].group(2) == fake
    assert not [line for line in lines if "vlm-tokenizer-pool active" in line]
    assert report["second_register_noop"]
    assert not [k for k, v in report["targets"].items() if v["ours"]]


@vllm_only
def test_failed_patch_logs_inactive_and_leaves_vllm_unpatched(model_dir):
    """Claiming 0.21 on an older vLLM: the plan's target (maybe_make_thread_pool) is missing."""
    import vllm

    if plugin.parse_version(vllm.__version__) >= (0, 21, 0):
        pytest.skip("on 0.21+ the targets of every plan exist")
    report, lines = _probe(model_dir, "--fake-version", "0.21.0")
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert inactive[0].group(1) == "WARNING"
    assert inactive[0].group(3).startswith("patch failed: "), inactive[0].group(3)
    assert not [line for line in lines if "vlm-tokenizer-pool active" in line]
    ours = [k for k, v in report["targets"].items() if v["ours"]]
    # the engine heartbeat does not depend on the pool's plan: it is there all the same
    assert ours == ["vllm.v1.core.sched.scheduler.Scheduler.__init__"], ours


@vllm_only
def test_invalid_pool_size_env_logs_inactive_before_0_19(model_dir):
    """Where the env var sizes the pool, a bad value leaves the tokenizer unpatched with a
    warning."""
    import vllm

    if plugin.parse_version(vllm.__version__) >= (0, 19, 0):
        pytest.skip("0.19+ sizes the pool by renderer_num_workers; the env var is not read")
    report, lines = _probe(model_dir, "--fake-version", vllm.__version__, pool_size="0")
    inactive = [m for m in map(INACTIVE.search, lines) if m]
    assert len(inactive) == 1, lines
    assert "VLM_TOKENIZER_POOL_SIZE" in inactive[0].group(3)
    ours = [k for k, v in report["targets"].items() if v["ours"]]
    # the pool's targets stay vLLM's own; the engine heartbeat does not read the pool's size
    assert ours == ["vllm.v1.core.sched.scheduler.Scheduler.__init__"], ours


@vllm_only
def test_engine_heartbeat_reports_a_real_scheduler_step_loop(model_dir):
    """vLLM's own scheduler, one 40-token prompt: a step held 1.2 s (the forward pass), then a
    1-token decode step held as long: the heartbeat (every 0.5 s) shows each step in flight
    with its tokens and age, then completed."""
    env = dict(os.environ, VLM_ENGINE_HEARTBEAT_SECONDS="0.5")
    report, lines = _probe(model_dir, "--heartbeat", "1.2", env=env)
    assert report["hooked"] and report["instrumented"], report
    assert report["scheduled"] == [40, 1]
    assert report["targets"]["vllm.v1.core.sched.scheduler.Scheduler.__init__"]["ours"]
    beats = [tuple(int(float(x)) if "." in x else int(x) for x in m.groups())
             for m in map(BEAT.search, lines) if m]
    assert [line for line in lines if "vlm-engine-heartbeat" in line and not BEAT.search(line)
            ] == []
    # (steps, in_flight, step_s, step_tokens, running, waiting)
    prefill = [b for b in beats if b[:2] == (0, 1)]
    assert prefill and {b[3] for b in prefill} == {40} and {b[4:] for b in prefill} == {(1, 0)}
    decode = [b for b in beats if b[:2] == (1, 1)]
    assert decode and {b[3] for b in decode} == {1}
    assert beats[-1][:4] == (2, 0, 0, 0), beats
    steps = [b[0] for b in beats]
    assert steps == sorted(steps)


@vllm_only
def test_engine_heartbeat_off_by_env_hooks_nothing(model_dir):
    env = dict(os.environ, VLM_ENGINE_HEARTBEAT_SECONDS="0")
    report, lines = _probe(model_dir, "--heartbeat", "0.6", env=env)
    assert not report["hooked"] and not report["instrumented"]
    assert not [line for line in lines if "vlm-engine-heartbeat" in line]


_LOG_THROUGH_VLLM = """
import vllm.logger as vl
vl._configure_vllm_root_logger()
vl.set_vllm_process_name("APIServer")
vl.init_logger("vllm.vlm_tokenizer_pool").warning("hello")
"""


@vllm_only
def test_the_stand_in_writes_the_logging_prefix_where_vllm_does():
    """vLLM's own logger with VLLM_LOGGING_PREFIX against the vLLM stand-in's line (what the
    node simulator's pods write, which the operator's e2e tests read)."""
    import vllm.logger

    from vlm_testbed import vllmsim

    if not hasattr(vllm.logger, "set_vllm_process_name"):
        pytest.skip("this vLLM writes the process tag outside its logger's format")
    env = dict(os.environ, VLLM_LOGGING_PREFIX="[v] ", NO_COLOR="1")
    real = subprocess.run([sys.executable, "-c", _LOG_THROUGH_VLLM], capture_output=True,
                          text=True, env=env, timeout=300, check=True).stdout.splitlines()[-1]
    ours = vllmsim.vllm_line("APIServer", 7, "WARNING", "x.py:1", "hello", prefix="[v] ",
                             version=plugin.installed_vllm_version())
    shape = re.compile(r"pid=\d+\) (\w+) \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\] ")
    assert real.startswith("[v] (APIServer pid=")
    assert shape.sub("pid=N) LEVEL T [F] ", real) == shape.sub("pid=N) LEVEL T [F] ", ours)
