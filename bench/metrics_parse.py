"""What parsing the /metrics page a pod serves can cost the operator: reader.parse_metrics now
against the parser of main (`git show main:operator/vlm_operator/podreads/reader.py`, loaded at
run time, not kept as code), side by side in one run, on pages a hostile pod can serve (at most
METRICS_CAP bytes: what podhttp reads) and on a real vLLM 0.32.0 page.

For each page: the CPU time of one parse by each parser (median and worst of --reps calls; a
parse that refuses the page counts as well: that is the work it did; CPU time, since the
machine may be shared), and the worst wake-up delay of
another thread sleeping 1 ms at a time while 1 and then 3 threads parse the page back to back
(the GIL a parse holds delays every other thread of the operator: its rounds, its watches).
The names read are those of a Builtin VLMDeployment's round.

Usage: .venv/bin/python bench/metrics_parse.py [--reps 5] [--window 1.0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
import types
from importlib import metadata
from pathlib import Path

from common import ROOT, machine
from vlm_operator.autoscaling.autoscaler import metric_names
from vlm_operator.podreads import reader
from vlm_operator.stalls.verdicts import PROGRESS_METRICS
from vlm_testbed import vllmsim

RESULTS = Path(__file__).resolve().parent / "results"
NAMES = frozenset({*PROGRESS_METRICS, *metric_names({"autoscaling": {
    "metric": "vllm:num_requests_waiting"}})})
NAME = b"vllm:num_requests_running"  # one of NAMES


def main_parser():
    """parse_metrics as main has it."""
    source = subprocess.run(["git", "show", "main:operator/vlm_operator/podreads/reader.py"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("reader_main")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, "main:operator/vlm_operator/podreads/reader.py", "exec"), module.__dict__)
    return module.parse_metrics


def pages() -> dict[str, bytes]:
    cap, line_cap = reader.METRICS_CAP, reader.LINE_CAP
    fill = line_cap - len(NAME) - 10  # what a line at the cap holds besides its name
    at_cap = cap // line_cap
    return {
        "real vLLM 0.32.0 page": vllmsim.REAL_METRICS.read_bytes(),
        "one line, a label value never closed": NAME + b'{a="' + b"x" * (cap - 40),
        "one line, 2 MiB of empty labels": NAME + b"{" + b'a="",' * (cap // 5 - 10) + b"} 1",
        "one line, quotes between labels": NAME + b"{" + b'a"b"' * (cap // 4 - 10) + b"} 1",
        "one line, escapes never closed": NAME + b'{a="' + b"\\x" * (cap // 2 - 20),
        "4 KiB lines, a value never closed": (NAME + b'{a="' + b"x" * fill + b"\n") * at_cap,
        "4 KiB lines, empty labels": (NAME + b"{" + b'a="",' * (fill // 5) + b"} 1\n") * at_cap,
        "4 KiB lines, escapes": (NAME + b'{a="' + b"\\x" * (fill // 2) + b'"} 1\n') * at_cap,
        f"{reader.MAX_SAMPLE_LINES} short lines (the most read)": (
            NAME + b'{a="1"} 1\n') * reader.MAX_SAMPLE_LINES,
        "4096 short lines": (NAME + b'{a="1"} 1\n') * 4096,
        "short lines to the cap": (NAME + b'{a="1"} 1\n') * (cap // (len(NAME) + 11)),
        "names that are prefixes": (NAME + b"_x 1\n") * (cap // (len(NAME) + 5)),
        "other samples only": b'vllm:other{a="1"} 1\n' * (cap // 20),
        "empty lines": b"\n" * cap,
    }


def parse_times(parse, page: bytes, reps: int) -> tuple[list[float], str]:
    """The CPU seconds of each of `reps` parses, and what the last one read."""
    times, outcome = [], ""
    for _ in range(reps):
        t0 = time.thread_time()
        try:
            outcome = f"{sum(parse(page, NAMES).values()):g} summed"
        except ValueError as exc:
            outcome = f"refused: {str(exc)[:60]}"
        times.append(time.thread_time() - t0)
    return times, outcome


def worst_wakeup(parse, page: bytes, parsers: int, window_s: float) -> float:
    """The worst delay past its 1 ms sleep of a thread that sleeps and wakes for window_s,
    while `parsers` threads parse the page back to back (none: the machine's own)."""
    stop = threading.Event()

    def parsing() -> None:
        while not stop.is_set():
            with contextlib.suppress(ValueError):
                parse(page, NAMES)

    threads = [threading.Thread(target=parsing, daemon=True) for _ in range(parsers)]
    for t in threads:
        t.start()
    worst, end = 0.0, time.perf_counter() + window_s
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        time.sleep(0.001)
        worst = max(worst, time.perf_counter() - t0 - 0.001)
    stop.set()
    for t in threads:
        t.join()
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite the .md from the .json of the last run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window", type=float, default=1.0, help="seconds of each wake-up run")
    args = ap.parse_args()
    if args.markdown_only:
        write_markdown(json.loads((RESULTS / "metrics-parse.json").read_text()))
        return
    parsers = {"main": main_parser(), "now": reader.parse_metrics}
    idle = worst_wakeup(lambda page, names: None, b"", 0, args.window)
    rows = []
    for page_name, page in pages().items():
        row: dict = {"page": page_name, "bytes": len(page)}
        for way, parse in parsers.items():
            times, outcome = parse_times(parse, page, args.reps)
            row[way] = {"outcome": outcome,
                        "parse_cpu_ms": [round(t * 1000, 3) for t in times],
                        "median_ms": round(statistics.median(times) * 1000, 3),
                        "worst_ms": round(max(times) * 1000, 3),
                        "worst_wakeup_ms": {
                            str(n): round(worst_wakeup(parse, page, n, args.window) * 1000, 1)
                            for n in (1, 3)}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"benchmark": "metrics-parse", "reps": args.reps, "window_s": args.window,
              "names_read": sorted(NAMES), "line_cap": reader.LINE_CAP,
              "max_sample_lines": reader.MAX_SAMPLE_LINES, "page_cap": reader.METRICS_CAP,
              "idle_worst_wakeup_ms": round(idle * 1000, 1), "results": rows,
              "machine": machine(google_re2=metadata.version("google-re2"))}
    (RESULTS / "metrics-parse.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(result)


def write_markdown(result: dict) -> None:
    rows = result["results"]
    worst = {way: max(r[way]["worst_ms"] for r in rows) for way in ("main", "now")}
    wake = {way: max(r[way]["worst_wakeup_ms"]["3"] for r in rows) for way in ("main", "now")}
    lines = [
        "# Parsing a pod's /metrics: the worst pages", "",
        "`bench/metrics_parse.py`: `reader.parse_metrics` now against main's (loaded from "
        "`git show main:...` at run time), one run, on pages of at most "
        f"{result['page_cap']} bytes (what the operator reads of a /metrics answer), reading "
        f"the {len(result['names_read'])} samples a Builtin VLMDeployment's round reads. "
        f"Parse: CPU time of the parsing thread, median and worst of {result['reps']} calls (a "
        "refused page counts: the work was done). Wake-up: the worst delay past a 1 ms sleep "
        "of another thread, over "
        f"{result['window_s']} s while 1 or 3 threads parse the page back to back; with no "
        f"parsing thread it was {result['idle_worst_wakeup_ms']} ms on this machine, shared "
        "with other work, so wake-ups below that are its own noise.", "",
        f"Worst parse (CPU): main {worst['main']} ms, now {worst['now']} ms. Worst wake-up with 3 "
        f"parsing threads: main {wake['main']} ms, now {wake['now']} ms. Now: a wanted line "
        f"is at most {result['line_cap']} bytes (refused before its content is read), at most "
        f"{result['max_sample_lines']} of them are parsed, each label set by RE2.", "",
        "| page | bytes | main: CPU median / worst | now: CPU median / worst | main: wake-up "
        "1 / 3 threads | now: wake-up 1 / 3 threads | now reads |",
        "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        old, new = r["main"], r["now"]
        lines.append(
            f"| {r['page']} | {r['bytes']} | {old['median_ms']} / {old['worst_ms']} ms "
            f"| {new['median_ms']} / {new['worst_ms']} ms "
            f"| {old['worst_wakeup_ms']['1']} / {old['worst_wakeup_ms']['3']} ms "
            f"| {new['worst_wakeup_ms']['1']} / {new['worst_wakeup_ms']['3']} ms "
            f"| {new['outcome']} |")
    m = result["machine"]
    lines += ["", f"Python {m['python']}, google-re2 {m['google_re2']}, {m['platform']}, "
              f"{m['cores']} CPUs ({m['cpu']}) shared with other work, load average "
              f"{m['load_avg'][0]:.1f} at the end, commit {m['commit']}, {m['time']}.", ""]
    (RESULTS / "metrics-parse.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
