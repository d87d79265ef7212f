"""Benchmark: thread-safety strategies for one HF fast tokenizer shared by many threads.

Grid: tokenizers 0.22.2 / 0.23.3 (venvs from hack/tokenizer-envs.sh) x vocabulary 8k / 151k
(byte-level BPE trained locally, cached) x 8 / 32 / 128 threads x strategy:
  retry      shared tokenizer behind vLLM's old retry loop (0.11-0.20: 5 tries, 0.5 s sleep)
  lock       shared tokenizer behind one global lock
  vllm-pool  vLLM's own maybe_make_thread_pool (vllm/tokenizers/hf.py from the 0.24.0 wheel)
  queue      the same bounded copies behind a queue.SimpleQueue (this pool before it handed
             copies out in arrival order): shows the starvation FIFO hand-off fixes
  ours       vllm_tokenizer_pool.make_thread_safe
  keyed      the alternative we measured before choosing: one copy per truncation/padding setting,
             shared by all threads using that setting (no pool, no waiting)
Workload per call: a 2-text batch encode with one of 5 mixed truncation/padding settings (each
switch calls a Rust setter), plus a batch_decode every 4th call, compared with single-threaded
reference output. Each point runs in its own subprocess (clean peak RSS) for a fixed duration.
Every call started counts: a call still waiting or running at the stop is counted with the time it
had waited so far (a lower bound) in the latency percentiles, and per-thread completions (min,
max, threads that completed none) show starvation that throughput hides. Threads still inside a
call at the stop are then abandoned (os._exit). A heartbeat thread measures the longest GIL stall.

Run:   hack/tokenizer-envs.sh && .venv/bin/python bench/tokenizer_pool.py   (~9 min on 2 cores)
Writes bench/results/tokenizer-pool.json and .md. With --uncontended: the cost of one call from
one thread per strategy (bench/results/tokenizer-pool-uncontended.json and .md, ~1 min).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import queue
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import machine, percentile

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("VLM_CACHE", Path.home() / ".cache" / "vlm-operator"))
VLLM_VERSION = "0.24.0"
ENVS = ("tok-0.22", "tok-current")
VOCABS = (8000, 151000)
THREADS = (8, 32, 128)
STRATEGIES = ("retry", "lock", "vllm-pool", "queue", "ours", "keyed")
SETTINGS = [
    {},
    {"truncation": True, "max_length": 7},
    {"truncation": True, "max_length": 64, "padding": "max_length"},
    {"padding": "longest"},
    {"truncation": True, "max_length": 33},
]


# ---------------------------------------------------------------- strategies (child process)
def vllm_maybe_make_thread_pool():
    """vLLM's own pool, compiled from the wheel's vllm/tokenizers/hf.py (only that function and
    its marker class: the module's other imports need the whole of vLLM)."""
    import contextlib
    import queue
    from typing import TypeVar

    from transformers import PreTrainedTokenizerFast

    src = CACHE / "vllm-src" / VLLM_VERSION / "vllm" / "tokenizers" / "hf.py"
    tree = ast.parse(src.read_text())
    keep = {"ThreadSafeHFTokenizerMixin", "maybe_make_thread_pool"}
    tree.body = [n for n in tree.body if getattr(n, "name", None) in keep]
    ns = {
        "contextlib": contextlib,
        "copy": copy,
        "queue": queue,
        "PreTrainedTokenizerFast": PreTrainedTokenizerFast,
        "_T": TypeVar("_T"),
    }
    exec(compile(tree, str(src), "exec"), ns)
    return ns["maybe_make_thread_pool"]


RETRIES = [0]  # "Failed to acquire tokenizer in current thread. Retrying" warnings


def with_retry(call):
    """vLLM 0.11-0.20 InputProcessingContext.call_hf_processor's retry loop, as it was."""
    num_tries = 5

    def retried(*args, **kwargs):
        for i in range(num_tries):
            try:
                return call(*args, **kwargs)
            except Exception as exc:
                if (
                    isinstance(exc, RuntimeError)
                    and exc.args
                    and exc.args[0] == "Already borrowed"
                    and i + 1 < num_tries
                ):
                    RETRIES[0] += 1  # vLLM logs the "Retrying (n/5)..." warning here
                    time.sleep(0.5)
                    continue
                raise ValueError(f"Failed to apply processor on data={args!r:.40}") from exc

    return retried


class Keyed:
    """One private copy per distinct settings key; same-key threads share it concurrently."""

    def __init__(self, template):
        self.template = template
        self.by_key: dict = {}
        self.lock = threading.Lock()

    def _for(self, kwargs):
        key = tuple(sorted(kwargs.items()))
        tok = self.by_key.get(key)
        if tok is None:
            with self.lock:
                tok = self.by_key.get(key)
                if tok is None:
                    tok = copy.deepcopy(self.template)
                    tok(["warm up"], **kwargs)  # set its Rust state before anyone shares it
                    self.by_key[key] = tok
        return tok

    def encode(self, texts, **kwargs):
        return self._for(kwargs)(texts, **kwargs)

    def decode(self, ids):
        return self._for({}).batch_decode(ids)


def make_calls(strategy, tok, copies):
    """(encode(texts, **settings) -> BatchEncoding, batch_decode(ids)) for ``strategy``."""
    if strategy == "retry":
        return with_retry(tok), with_retry(tok.batch_decode)
    if strategy == "lock":
        lock = threading.Lock()

        def locked(fn):
            def call(*args, **kwargs):
                with lock:
                    return fn(*args, **kwargs)

            return call

        return locked(tok), locked(tok.batch_decode)
    if strategy == "vllm-pool":
        pooled = vllm_maybe_make_thread_pool()(tok, copies)
        return pooled, pooled.batch_decode
    if strategy == "queue":
        free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(copies):
            free.put(copy.deepcopy(tok))

        def queued(name):
            def call(*args, **kwargs):
                t = free.get()
                try:
                    return getattr(t, name)(*args, **kwargs)
                finally:
                    free.put(t)

            return call

        return queued("__call__"), queued("batch_decode")
    if strategy == "ours":
        from vllm_tokenizer_pool import make_thread_safe

        safe = make_thread_safe(tok, copies)
        return safe, safe.batch_decode
    if strategy == "keyed":
        keyed = Keyed(tok)
        return keyed.encode, keyed.decode
    raise ValueError(strategy)


def tokenizers_alive() -> int:
    """Live HF tokenizer objects (whatever holds them), minus the reference copy."""
    import gc

    from transformers import PreTrainedTokenizerBase

    gc.collect()
    return sum(isinstance(o, PreTrainedTokenizerBase) for o in gc.get_objects()) - 1


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_point(strategy, vocab, threads, seconds, copies, varied) -> dict:
    import tokenizers
    import transformers

    from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer, generated_text

    tok = build_fast_tokenizer(vocab)
    reference = copy.deepcopy(tok)
    texts = [" ".join(generated_text(120, seed=s)) for s in range(8)]
    settings = (
        [{"truncation": True, "max_length": 16 + 8 * k} for k in range(48)] if varied else SETTINGS
    )
    cases = [(t, s) for t in texts for s in settings]
    expected = [reference([t, t[:100]], **s)["input_ids"] for t, s in cases]
    rss_before = rss_mb()
    t0 = time.perf_counter()
    encode, decode = make_calls(strategy, tok, copies)
    setup_s = time.perf_counter() - t0

    lat: list[list[float]] = [[] for _ in range(threads)]  # per thread, completed calls
    started: list[float | None] = [None] * threads  # when the thread's current call started
    counts = {"errors": 0, "wrong": 0}
    error_kinds: dict[str, int] = {}
    stop = threading.Event()
    start = threading.Barrier(threads + 1)

    def worker(n: int) -> None:
        rng = random.Random(n)
        start.wait()
        k = 0
        while not stop.is_set():
            i = rng.randrange(len(cases))
            text, kw = cases[i]
            t = started[n] = time.perf_counter()
            try:
                ids = encode([text, text[:100]], **kw)["input_ids"]
                if ids != expected[i]:
                    counts["wrong"] += 1
                if k % 4 == 0:
                    decode(ids)
            except Exception as e:
                counts["errors"] += 1
                kind = f"{type(e).__name__}: {str(e).split(' on data=')[0]}"
                kind += f" (from {e.__cause__!r})" if e.__cause__ else ""
                error_kinds[kind] = error_kinds.get(kind, 0) + 1
            if not stop.is_set():
                lat[n].append(time.perf_counter() - t)
                started[n] = None
            k += 1

    stall = [0.0]
    last_beat = [time.perf_counter()]

    def heartbeat() -> None:
        while not stop.is_set():
            time.sleep(0.005)
            now = time.perf_counter()
            stall[0] = max(stall[0], now - last_beat[0] - 0.005)
            last_beat[0] = now

    for n in range(threads):
        threading.Thread(target=worker, args=(n,), daemon=True).start()
    threading.Thread(target=heartbeat, daemon=True).start()
    start.wait()
    t_start = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    t_stop = time.perf_counter()
    elapsed = t_stop - t_start
    # Snapshot: calls still waiting or running at the stop count with the time they had so far.
    unfinished = sorted(t_stop - t for t in list(started) if t is not None)
    per_thread = [len(x) for x in lat]
    stall[0] = max(stall[0], time.perf_counter() - last_beat[0] - 0.005)  # a starved heartbeat
    done = sorted(x for xs in lat for x in xs)
    every = sorted(done + unfinished)

    def pct(values: list[float], q: float) -> float | None:
        return round(percentile(values, q) * 1000, 2) if values else None

    return {
        "strategy": strategy,
        "vocab": vocab,
        "threads": threads,
        "varied_max_length": varied,
        "copies": copies,
        "seconds": round(elapsed, 2),
        "calls": len(done),
        "throughput_per_s": round(len(done) / elapsed, 1),
        "per_thread_min": min(per_thread),
        "per_thread_max": max(per_thread),
        "threads_with_none": sum(1 for c in per_thread if c == 0),
        "unfinished_at_stop": len(unfinished),
        "unfinished_max_wait_ms": pct(unfinished, 100),
        "p50_ms": pct(every, 50),
        "p99_ms": pct(every, 99),
        "max_ms": pct(every, 100),
        "p99_completed_only_ms": pct(done, 99),
        "errors": counts["errors"],
        "error_kinds": error_kinds,
        "wrong": counts["wrong"],
        "retries": RETRIES[0],
        "max_gil_stall_ms": round(stall[0] * 1000, 1),
        "setup_s": round(setup_s, 3),
        "loadavg_1m": os.getloadavg()[0],
        "tokenizers_alive": tokenizers_alive(),
        "rss_before_mb": round(rss_before, 1),
        "peak_rss_mb": round(rss_mb(), 1),
        "tokenizers_version": tokenizers.__version__,
        "transformers_version": transformers.__version__,
    }


def run_uncontended(vocab, copies, calls=2000, reps=9) -> dict:
    """Microseconds per call from one thread (nothing to wait for): what each strategy adds to a
    chat-sized request. Best of ``reps`` interleaved runs of ``calls`` x (encode, decode)."""
    import tokenizers
    import transformers

    from vllm_tokenizer_pool.local_tokenizer import build_fast_tokenizer

    tok = build_fast_tokenizer(vocab)
    text = "<|im_start|>user\nDescribe this image please (42).<|im_end|>\n"
    calls_of = {}
    for strategy in ("plain", "lock", "vllm-pool", "queue", "ours"):
        t = copy.deepcopy(tok)
        calls_of[strategy] = (t, t.batch_decode) if strategy == "plain" else make_calls(
            strategy, t, copies)
    best = dict.fromkeys(calls_of, float("inf"))
    for _ in range(reps):  # strategies interleaved: drift in the machine's load hits all alike
        for strategy, (encode, decode) in calls_of.items():
            t0 = time.perf_counter()
            for i in range(calls):
                ids = encode([text], **SETTINGS[i % len(SETTINGS)])["input_ids"]
                decode(ids)
            best[strategy] = min(best[strategy], (time.perf_counter() - t0) / (2 * calls))
    us = {strategy: round(b * 1e6, 2) for strategy, b in best.items()}
    return {"vocab": vocab, "us_per_call": us, "loadavg_1m": os.getloadavg()[0],
            "tokenizers_version": tokenizers.__version__,
            "transformers_version": transformers.__version__}


def render_uncontended_md(data) -> str:
    m = data["machine"]
    lines = [
        "# Uncontended cost per call (bench/tokenizer_pool.py --uncontended)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; one thread, best of "
        "9 runs (strategies interleaved) of 2000 x (a chat-sized encode with mixed truncation "
        "settings + a decode); "
        f"{data['copies']} copies for the pools. Microseconds per call:",
        "",
        "| tokenizers | vocab | plain | lock | vllm-pool | queue | ours | ours - plain "
        "| ours/vllm-pool | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["points"]:
        u = r["us_per_call"]
        lines.append(
            f"| {r['tokenizers_version']} | {r['vocab'] // 1000}k | {u['plain']} | {u['lock']} "
            f"| {u['vllm-pool']} | {u['queue']} | {u['ours']} | {round(u['ours'] - u['plain'], 2)} "
            f"| {ratio(u['ours'], u['vllm-pool'])} | {r['loadavg_1m']:.1f} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- driver
def child(env, args_list, timeout):
    py = CACHE / "venvs" / env / "bin" / "python"
    cmd = [str(py), __file__, "--point", json.dumps(args_list)]
    penv = {**os.environ, "PYTHONPATH": str(ROOT / "operator"), "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=penv)
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"point {args_list} in {env} failed:\n{out.stderr[-2000:]}")


def ratio(a, b):
    return round(a / b, 2) if b else None


def render_md(data) -> str:
    m = data["machine"]
    versions = data["versions"].items()
    lines = [
        "# Tokenizer thread-safety strategies (bench/tokenizer_pool.py)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; "
        f"vLLM pool from {m['vllm_pool_source']}; {data['seconds']} s per point, "
        f"pool copies = {data['copies']} (vLLM's default renderer_num_workers 1 + 1).",
        "Versions: "
        + "; ".join(f"{e}: tokenizers {v[0]}, transformers {v[1]}" for e, v in versions),
        "",
        "Throughput in calls/s completed (2-text batch encode + a batch_decode every 4th call); "
        "`err`/`wrong` = failed calls / wrong results. `queue` is the same bounded pool behind a "
        "`queue.SimpleQueue` (this pool before FIFO hand-off).",
        "",
        "| tokenizers | vocab | threads | retry | lock | vllm-pool | queue | ours | keyed "
        "| ours/vllm-pool | ours/lock | ours/queue |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    grid = {(r["env"], r["vocab"], r["threads"], r["strategy"]): r for r in data["points"]
            if not r["varied_max_length"]}  # fmt: skip
    envs, vocabs, threads_ = ({r[k] for r in data["points"]} for k in ("env", "vocab", "threads"))
    for env in [e for e in ENVS if e in envs]:
        for vocab in sorted(vocabs):
            for threads in sorted(threads_):
                row = [data["versions"][env][0], f"{vocab // 1000}k", str(threads)]
                for s in STRATEGIES:
                    r = grid.get((env, vocab, threads, s))
                    row.append(
                        "-" if r is None else
                        f"{r['throughput_per_s']:.0f} ({r['errors']} err, {r['wrong']} wrong"
                        + (f", {r['retries']} retries)" if s == "retry" else ")")
                    )  # fmt: skip
                ours = grid.get((env, vocab, threads, "ours"))
                for other in ("vllm-pool", "lock", "queue"):
                    o = grid.get((env, vocab, threads, other))
                    row.append(str(ratio(ours["throughput_per_s"], o["throughput_per_s"]))
                               if ours and o else "-")  # fmt: skip
                lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "## Every call counted: fairness, latency, memory, stalls per point",
        "",
        "Per-thread completions (min / max over the threads; `none` = threads that completed no "
        "call); `unfinished` = calls still waiting or running at the stop, and the longest of "
        "their waits; p50/p99/max include those unfinished calls at the time they had waited "
        "(a lower bound); `p99 done` is the p99 of completed calls only (what a benchmark that "
        "drops unfinished calls reports). RSS = peak RSS minus RSS before the strategy was set "
        "up (MB); load = 1-minute load average of the machine at the end of the point.",
        "",
        "| tokenizers | vocab | threads | strategy | calls/s | per thread min / max | none "
        "| unfinished (max wait ms) | p50 ms | p99 ms | max ms | p99 done ms | max GIL stall ms "
        "| tokenizers alive | setup s | RSS growth MB | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- |",
    ]
    for r in data["points"]:
        lines.append(
            f"| {data['versions'][r['env']][0]} | {r['vocab'] // 1000}k | {r['threads']} "
            f"| {r['strategy']}{' (48 max_lengths)' if r['varied_max_length'] else ''} "
            f"| {r['throughput_per_s']:.0f} | {r['per_thread_min']} / {r['per_thread_max']} "
            f"| {r['threads_with_none']} | {r['unfinished_at_stop']} "
            f"({r['unfinished_max_wait_ms']}) | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} "
            f"| {r['p99_completed_only_ms']} | {r['max_gil_stall_ms']} | {r['tokenizers_alive']} "
            f"| {r['setup_s']} | {round(r['peak_rss_mb'] - r['rss_before_mb'], 1)} "
            f"| {r['loadavg_1m']:.1f} |"
        )
    lines += ["", "## Errors seen", ""]
    for r in data["points"]:
        for kind, n in r["error_kinds"].items():
            lines.append(
                f"- {data['versions'][r['env']][0]} {r['vocab'] // 1000}k {r['threads']} threads "
                f"{r['strategy']}: {n} x `{kind}`"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--envs", default=",".join(ENVS))
    ap.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    ap.add_argument("--threads", default=",".join(map(str, THREADS)))
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "tokenizer-pool"))
    ap.add_argument("--uncontended", action="store_true",
                    help="per-call cost from one thread instead of the contention grid")
    args = ap.parse_args()
    if args.point:
        point = json.loads(args.point)
        result = run_uncontended(*point[1:]) if point[0] == "uncontended" else run_point(*point)
        print(json.dumps(result), flush=True)
        os._exit(0)  # abandon threads still inside a call (a stalled strategy pays for them)
    if args.uncontended:
        points = []
        for env in args.envs.split(","):
            for v in map(int, args.vocabs.split(",")):
                points.append(child(env, ["uncontended", v, args.copies], timeout=600))
                print(json.dumps(points[-1]), flush=True)
        data = {"machine": machine(), "copies": args.copies, "points": points}
        out = Path(args.out + "-uncontended")
        out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
        out.with_suffix(".md").write_text(render_uncontended_md(data))
        print(f"wrote {out}.json and {out}.md")
        return

    points, versions = [], {}
    plan = [
        (env, s, v, t, False)
        for env in args.envs.split(",")
        for v in map(int, args.vocabs.split(","))
        for t in map(int, args.threads.split(","))
        for s in args.strategies.split(",")
    ]
    # The keyed alternative's weak spot: per-request max_length (vLLM truncates per request).
    plan += [(env, s, 8000, 32, True) for env in args.envs.split(",") for s in ("ours", "keyed")]
    t0 = time.time()
    for n, (env, s, v, t, varied) in enumerate(plan, 1):
        r = child(env, [s, v, t, args.seconds, args.copies, varied], timeout=300)
        r["env"] = env
        versions[env] = (r["tokenizers_version"], r["transformers_version"])
        points.append(r)
        print(
            f"[{n}/{len(plan)} {time.time() - t0:.0f}s] {env} {v} {t:>3} {s:<9}"
            f"{' varied' if varied else ''}: {r['throughput_per_s']:>7}/s "
            f"err={r['errors']} retries={r['retries']} wrong={r['wrong']} p99={r['p99_ms']}ms "
            f"thread min/max={r['per_thread_min']}/{r['per_thread_max']} "
            f"unfinished={r['unfinished_at_stop']} "
            f"stall={r['max_gil_stall_ms']}ms alive={r['tokenizers_alive']} "
            f"rss+={r['peak_rss_mb'] - r['rss_before_mb']:.0f}MB",
            flush=True,
        )
    data = {
        "machine": machine(vllm_pool_source=f"vllm {VLLM_VERSION} vllm/tokenizers/hf.py"),
        "versions": versions,
        "seconds": args.seconds,
        "copies": args.copies,
        "points": points,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render_md(data))
    print(f"wrote {out}.json and {out}.md in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
