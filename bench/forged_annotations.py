"""What forged annotations on a tenant's own VLMDeployment cost the shared operator.

Part 1, forged in-flight records: 2,800 records (240 KB, as a tenant can write them) on one
VLMDeployment with one pod; the Remediator's round runs once a second for 10 s over the unit
tests' in-memory Kube (tests/unit/fakes.py: no apiserver, so API calls are counted, not timed).
We count the in-flight threads (peak), the API calls, the process's CPU seconds and the records
left. Run for this tree and, side by side, for an older tree given with `--baseline DIR` (its
`operator/` directory, e.g. `git archive <commit> operator | tar -x -C DIR`, named with
`--baseline-name`), each in a process of its own:

    PYTHONPATH=operator .venv/bin/python bench/forged_annotations.py \
        --baseline /tmp/b07fd8b/operator --baseline-name "b07fd8b (a thread per record)"

Part 2, reading annotation text (api/annotation_json.read): best of 5 per hostile shape, each
256 KiB at most (the apiserver's limit for all of an object's annotations), and the in-flight
reader on the same text again (its cache).

Writes bench/results/forged-annotations.json and forged-annotations.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
RECORDS, SECONDS = 2800, 10


def forged_text() -> str:
    return json.dumps({f"forged-{i:05d}": {"action": "Replace", "pod": f"p{i}", "incident": 1,
                                           "since": 1, "replicas": 1}
                       for i in range(RECORDS)}, separators=(",", ":"))


def forged_rounds() -> dict:
    """Part 1 in this process (run as `--part1`, with the tree under test on sys.path)."""
    import threading

    sys.path.insert(0, str(ROOT / "tests"))
    from unit.fakes import FakeKube
    from vlm_operator.api.names import IN_FLIGHT
    from vlm_operator.podreads import reader
    from vlm_operator.remediation.remediator import Remediator

    reader.requests_in_flight = lambda ip, *a, **kw: 0.0
    raw = forged_text()
    kube = FakeKube()
    kube.add_vlmd("ml", "att")["metadata"]["annotations"][IN_FLIGHT] = raw
    kube.add_pod("ml", "att-0", owner="att")
    rem = Remediator(kube, lambda ns, name: None)
    cpu, peak = time.process_time(), 0
    for _ in range(SECONDS):
        rem.round(kube.get_vlmd("ml", "att"), kube.list_pods("ml", "x=y"))
        peak = max(peak, sum(1 for t in threading.enumerate()
                             if t.name.startswith("in-flight")))
        time.sleep(1)
    cpu = time.process_time() - cpu
    rem.stop()
    left = kube.vlmds[("ml", "att")]["metadata"]["annotations"].get(IN_FLIGHT)
    return {"annotation_bytes": len(raw), "peak_threads": peak, "api_calls": len(kube.calls),
            "cpu_s": round(cpu, 2), "records_left": len(json.loads(left)) if left else 0}


def part1(operator_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(operator_dir), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "--part1"], env=env, capture_output=True,
                         text=True, check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def best_ms(fn, runs: int = 5) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return round(best * 1e3, 2)


def part2() -> list[dict]:
    from vlm_operator.api import annotation_json
    from vlm_operator.api.names import IN_FLIGHT
    from vlm_operator.remediation.incidents import read_in_flight

    raw = forged_text()
    shapes = {
        f"{RECORDS:,} forged in-flight records": raw,
        "`[` x 200,000": "[" * 200_000,
        "`[]` in one array, 87,000 of them": "[" + "[]," * 87_000 + "[]]",
        "131,000 numbers in one array": "[" + "1," * 131_000 + "1]",
        "52,000 strings in one array": json.dumps(["a"] * 52_000),
        "`\\\"` x 131,000 after a quote": '"' + '\\"' * 131_000,
        "valid, 900 deep": "[" * 900 + "]" * 900,
    }
    rows = []
    for name, text in shapes.items():
        value = annotation_json.read(text)
        rows.append({"shape": name, "chars": len(text),
                     "readable": value is not annotation_json.UNREADABLE,
                     "read_ms": best_ms(lambda t=text: annotation_json.read(t))})
    read_in_flight({IN_FLIGHT: raw})
    rows.append({"shape": f"{RECORDS:,} forged records again (read_in_flight's cache; a copy "
                          "of the text each time, as each round's body is)", "chars": len(raw),
                 "readable": True,
                 "read_ms": best_ms(lambda: read_in_flight({IN_FLIGHT: "" + raw[:-1] + "}"}))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part1", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", type=Path, help="an older tree's operator/ directory")
    parser.add_argument("--baseline-name", default="baseline", help="its name in the results")
    args = parser.parse_args()
    if args.part1:
        print(json.dumps(forged_rounds()))
        return
    trees = {"this tree": ROOT / "operator"}
    if args.baseline:
        trees[args.baseline_name] = args.baseline
    result = {"bench": "forged-annotations", "machine": machine(),
              "rounds": {name: part1(path) for name, path in trees.items()},
              "reads": part2()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "forged-annotations.json").write_text(json.dumps(result, indent=2) + "\n")
    m = result["machine"]
    lines = ["# forged annotations", "",
             f"Part 1: {RECORDS:,} forged in-flight records on one VLMDeployment, the "
             f"remediator's round once a second for {SECONDS} s over the in-memory Kube of the "
             "unit tests (calls counted, not timed).", "",
             "| tree | annotation bytes | peak in-flight threads | API calls | CPU s | "
             "records left |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['annotation_bytes']} | {r['peak_threads']} | {r['api_calls']} | "
              f"{r['cpu_s']} | {r['records_left']} |" for name, r in result["rounds"].items()]
    lines += ["", "Part 2: `annotation_json.read`, best of 5.", "",
              "| text | characters | readable | ms |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['shape']} | {r['chars']} | {r['readable']} | {r['read_ms']} |"
              for r in result["reads"]]
    lines += ["", f"Python {m['python']}, {m['platform']}, {m['cores']} CPUs ({m['cpu']}), load "
              f"average {m['load_avg'][0]:.1f} (a machine shared with other work: CPU figures "
              f"are high), commit {m['commit']}, {m['time']}."]
    (RESULTS / "forged-annotations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
