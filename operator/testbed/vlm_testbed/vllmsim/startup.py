"""How the stand-in starts, as vLLM does: weights from HF_HOME (fetched from the hub when
missing), loaded, the model compiled unless vLLM's compile cache has it, the engine
initialised; and the in-place restart request it acts on.

Published figures the defaults reproduce (../shared/notes/facts.md): a vLLM pod's cold start
110 s, 52 s with the weights already on the node (llm-d-autoscaling issue 1433); a full model
reload (weights and compile cache present) about 48 s (vLLM blog, sleep mode, A100). The split
between phases is not published; ours is an assumption that adds up to those totals:
- fetch 58 s (110 - 52): WEIGHTS_BYTES (16 GB, a 7-8B model in bf16) at HUB_BYTES_PER_S;
- load 20 s (the weights from local disk into the GPU);
- compile 4 s, skipped on a compile-cache hit (52 - 48);
- init 28 s (profiling, KV cache, CUDA graph capture, the API server).
So: nothing cached 110 s; weights cached 52 s; weights and compile cache 48 s.

Where things live, as in vLLM: weights under $HF_HOME/hub/models--<org>--<name>/ (HF_HOME
defaults to $HOME/.cache/huggingface; a local model path is read in place, never fetched); the
compile cache under $VLLM_CACHE_ROOT (default $HOME/.cache/vllm)/torch_compile_cache/<key>, the
key from the vLLM version and the model. The weights file is written sparse (its size is the
modelled size, it costs no disk) over the fetch time, as `blobs/<name>.incomplete` renamed when
done, so a fetch cut short is fetched again.

Env: VLM_SIM_TIME_SCALE (1: the figures above; 0: every phase takes no time), and per phase
VLM_SIM_WEIGHTS_BYTES, VLM_SIM_HUB_BYTES_PER_S, VLM_SIM_LOAD_SECONDS, VLM_SIM_COMPILE_SECONDS,
VLM_SIM_INIT_SECONDS (before scaling). VLM_SIM_STARTUP_SECONDS, where set, replaces the whole
model with that fixed engine start (no files read or written), as before the model existed.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Simulator

WEIGHTS_BYTES = 16e9
FETCH_S = 58.0
LOAD_S = 20.0
COMPILE_S = 4.0
INIT_S = 28.0


@dataclass(frozen=True)
class StartCosts:
    """Each phase's figure (unscaled) and the scale applied to every time."""

    weights_bytes: float = WEIGHTS_BYTES
    hub_bytes_per_s: float = WEIGHTS_BYTES / FETCH_S
    load_s: float = LOAD_S
    compile_s: float = COMPILE_S
    init_s: float = INIT_S
    scale: float = 1.0

    @classmethod
    def from_env(cls, env: dict[str, str]) -> StartCosts:
        def num(key: str, default: float) -> float:
            raw = env.get(key)
            try:
                value = float(raw) if raw not in (None, "") else default
            except ValueError:
                raise ValueError(f"{key}={raw!r}: not a number") from None
            if value < 0:
                raise ValueError(f"{key}={raw!r}: must not be negative")
            return value

        weights = num("VLM_SIM_WEIGHTS_BYTES", WEIGHTS_BYTES)
        return cls(weights, num("VLM_SIM_HUB_BYTES_PER_S", weights / FETCH_S) or 1.0,
                   num("VLM_SIM_LOAD_SECONDS", LOAD_S), num("VLM_SIM_COMPILE_SECONDS", COMPILE_S),
                   num("VLM_SIM_INIT_SECONDS", INIT_S), num("VLM_SIM_TIME_SCALE", 1.0))


def phases(costs: StartCosts, weights_present: bool, compiled: bool) -> dict[str, float]:
    """Seconds each start phase takes, given what is cached."""
    return {"fetch": 0.0 if weights_present else
            costs.weights_bytes / costs.hub_bytes_per_s * costs.scale,
            "load": costs.load_s * costs.scale,
            "compile": 0.0 if compiled else costs.compile_s * costs.scale,
            "init": costs.init_s * costs.scale}


def hf_home(env: dict[str, str]) -> Path:
    return Path(env.get("HF_HOME") or Path(env.get("HOME") or "/root") / ".cache/huggingface")


def cache_root(env: dict[str, str]) -> Path:
    return Path(env.get("VLLM_CACHE_ROOT") or Path(env.get("HOME") or "/root") / ".cache/vllm")


def weights_path(env: dict[str, str], model: str) -> Path:
    """The weights file of a hub model under HF_HOME (huggingface_hub's cache layout)."""
    return (hf_home(env) / "hub" / ("models--" + model.replace("/", "--")) / "snapshots"
            / "main" / "model.safetensors")


def compile_dir(env: dict[str, str], version: str, model: str) -> Path:
    key = hashlib.sha256(f"vllm={version} model={model}".encode()).hexdigest()[:10]
    return cache_root(env) / "torch_compile_cache" / key / "rank_0_0" / "backbone"


def local_model(model: str) -> bool:
    return model.startswith(("/", ".")) or os.path.isdir(model)


def fetch(target: Path, size: int, seconds: float) -> None:
    """Write the weights file as a download would: growing over `seconds` (sparse), then
    renamed into place."""
    blob = target.parent.parent.parent / "blobs" / (target.name + ".incomplete")
    blob.parent.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    steps = max(1, min(100, int(seconds * 10)))
    with open(blob, "wb") as out:
        for i in range(1, steps + 1):
            out.truncate(size * i // steps)
            out.flush()
            if seconds:
                time.sleep(seconds / steps)
    os.replace(blob, target)


def boot(sim: Simulator, env: dict[str, str]) -> float:
    """Run the start phases, logging as vLLM does; returns the engine init time it logs."""
    costs = StartCosts.from_env(env)
    model, version = sim.args.model, sim.version
    eng = "Worker"
    weights = None if local_model(model) else weights_path(env, model)
    size = int(costs.weights_bytes)
    present = weights is None or (weights.is_file() and weights.stat().st_size == size)
    compiled_at = compile_dir(env, version, model)
    compiled = (compiled_at / "model").is_file()
    plan = phases(costs, present, compiled)
    sim.log("INFO", "cpu_model_runner.py:68", f"Starting to load model {model}...", eng)
    if weights is not None and not present:
        started = time.perf_counter()
        fetch(weights, size, plan["fetch"])
        sim.log("INFO", "weight_utils.py:473", "Time spent downloading weights for "
                f"{model}: {time.perf_counter() - started:.6f} seconds", eng)
    time.sleep(plan["load"])
    sim.log("INFO", "default_loader.py:501", f"Loading weights took {plan['load']:.2f} seconds",
            eng)
    sim.log("INFO", "backends.py:548", f"Using cache directory: {compiled_at} for vLLM's "
            "torch.compile", eng)
    if compiled:
        sim.log("INFO", "backends.py:215", "Directly load the compiled graph(s) for dynamic "
                "shape from the cache, took 0.00 s", eng)
    else:
        time.sleep(plan["compile"])
        compiled_at.mkdir(parents=True, exist_ok=True)
        (compiled_at / "model").write_text(f"vllm={version} model={model}\n")
        sim.log("INFO", "backends.py:232", "Compiling a graph for dynamic shape takes "
                f"{plan['compile']:.2f} s", eng)
    sim.log("INFO", "monitor.py:48", f"torch.compile takes {plan['compile']:.2f} s in total", eng)
    time.sleep(plan["init"])
    return plan["init"]


def watch_restart_request(sim: Simulator, path: str) -> None:
    """The plugin's in-place restart (vllm_tokenizer_pool.restart, whose Watch this uses): poll
    `path` (a downwardAPI file with the pod's restart-request annotation) every second from the
    API server's side, so it works while the engine hangs; when it holds a request other than
    the one present at this process's start, log the plugin's line and exit 0 at once so the
    kubelet restarts the container in place. The request seen at start is never acted on."""
    from vllm_tokenizer_pool import restart

    watch = restart.Watch(path)

    def loop() -> None:
        while True:
            time.sleep(restart.POLL_S)
            value = watch.check()
            if value is not None:
                sim.log("WARNING", "restart.py:84", f"vlm-restart-request "
                        f"{value[:restart.REQUEST_MAX_BYTES]}: exiting for an in-place "
                        "container restart")
                os._exit(0)

    threading.Thread(target=loop, daemon=True, name="vlm-restart-request").start()
