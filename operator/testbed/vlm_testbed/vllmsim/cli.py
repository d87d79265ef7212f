"""`python -m vlm_testbed.vllmsim <model> [vLLM serve flags...]`: starts the stand-in."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from . import startup
from .args import parse_serve_args
from .engine import Simulator
from .handler import Handler
from .loglines import plugin_line


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
    request = env.get("VLM_RESTART_REQUEST_FILE", "").strip()
    if request and plugin_line("", "", 0, env) is not None:  # the plugin's, where it is there
        startup.watch_restart_request(sim, request)
    fixed = env.get("VLM_SIM_STARTUP_SECONDS")
    if fixed:  # a fixed start, as before the start model
        load_s = float(fixed)
        time.sleep(load_s)
    else:
        load_s = startup.boot(sim, env)
    Handler.sim = sim
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as exc:
        sim.log("ERROR", "launcher.py:120", f"Failed to bind {args.host}:{args.port}: {exc}")
        sys.exit(1)
    server.daemon_threads = True
    sim.server = server
    sim.startup_logs_after_load(load_s, weights_line=bool(fixed))
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
