"""Faults of the simulated server: injected at start or by POST /sim/fault (engine death, hangs,
stalls, long prefills and steps, hostile log lines), and its shutdown."""

from __future__ import annotations

import os
import sys
import threading
import time

from .args import FAULTS, HOSTILE_PATHS
from .loglines import (
    engine_dead_lines,
    engine_proc_name,
    gpu_fault_lines,
    retry_warning,
    vllm_line,
)


class SimulatorFaults:
    """Simulator's faults, mixed into it: the state and output (emit, log) they use are its."""

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
            after, gpu_error = float(spec.get("after", 0)), spec.get("gpu_error")
            # at once: dead before this returns, so a fault given at start is dead before the
            # server answers its first probe (a container that never becomes Ready)
            if after > 0 or self._engine_dies(gpu_error):
                threading.Thread(target=self._die, daemon=True,
                                 args=(after, int(spec.get("exit_code", 0)),
                                       float(spec.get("exit_delay", 5)), gpu_error)).start()
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
        elif kind == "log_flood":
            threading.Thread(target=self._flood, daemon=True,
                             args=(float(spec.get("rate", 50_000)),
                                   float(spec.get("seconds", 60)))).start()
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

    def _flood(self, rate: float, seconds: float) -> None:
        """`rate` ordinary INFO lines a second from the API server process for `seconds`,
        written every 0.1 s in one batch; a batch written late is made up in the next, so the
        count follows the clock while the pipe keeps up. Then one line saying how many."""
        prefix = self.env.get("VLLM_LOGGING_PREFIX", "")
        start = time.monotonic()
        sent = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = min(int(rate * elapsed) - sent, int(rate))  # at most a second behind
            if due > 0:
                self.emit_many([vllm_line("APIServer", self.pid, "INFO", "logger.py:1",
                                          f"flood {n}", prefix=prefix, version=self.version)
                                for n in range(sent, sent + due)])
                sent += due
            time.sleep(0.1)
        self.emit(f"log_flood: {sent} lines in {time.monotonic() - start:.1f} s",
                  sys.stderr)

    def _retry_loop(self, gen: int, rate: float, count: int | None, attempt: int) -> None:
        emitted = 0
        prefix = self.env.get("VLLM_LOGGING_PREFIX", "")
        while gen == self.retry_gen and (count is None or emitted < int(count)):
            self.emit(retry_warning(self.version, self.pid, attempt, prefix=prefix))
            emitted += 1
            time.sleep(1.0 / rate)

    def _engine_dies(self, gpu_error: str | None) -> bool:
        """The engine dies now (False: it was dead already): with gpu_error (a CUDA fault's
        text), its engine core logs the fault first; then the API server's engine-death lines,
        and /health answers 503 from here on."""
        if self.dead:
            return False
        self.dead = True
        prefix = self.env.get("VLLM_LOGGING_PREFIX", "")
        lines = gpu_fault_lines(self.version, self.pid, str(gpu_error)[:200],
                                prefix=prefix) if gpu_error else []
        for line in lines + engine_dead_lines(self.version, self.pid, prefix=prefix):
            self.emit(line)
        return True

    def _die(self, after: float, exit_code: int, exit_delay: float,
             gpu_error: str | None = None) -> None:
        """The engine dies after `after` s (where it has not yet: _engine_dies), then vLLM
        exits exit_delay s later with exit_code, unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH."""
        time.sleep(after)
        if after > 0 and not self._engine_dies(gpu_error):
            return
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
