"""A local model hub: the part of the Hugging Face Hub's HTTP API that huggingface_hub (and so
vLLM and transformers) use to download a model, serving model directories of this machine.

A real `vllm serve ORG/NAME` with HF_ENDPOINT pointing here downloads the model into its
HF_HOME on its first start, as a pod does from huggingface.co or a cluster's hub mirror: so a
cold start (weights fetched), a warm start (weights in HF_HOME) and an in-place restart can be
told apart and timed with real vLLM. Downloads run at `bytes_per_s` (a hub mirror or the
internet: unlimited by default) and every file fetch is counted, so a test can assert that a
warm start fetched no weights.

Served: GET /api/models/{repo}[/revision/{rev}] (the repo's info: commit sha, files),
GET /api/models/{repo}/tree/{rev}[/{dir}] (the file listing, LFS entries with their sha256),
POST /api/models/{repo}/paths-info/{rev}, and HEAD/GET /{repo}/resolve/{rev}/{path} (the file,
with X-Repo-Commit, ETag and X-Linked-Etag/X-Linked-Size as the Hub sends them; Range
honoured). One revision per repo ("main", or its commit sha). No auth, no Xet, no uploads.

Usage: python -m vlm_testbed.modelhub --repo ORG/NAME=DIR [--repo ...] [--port P]
       [--bytes-per-s N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 1 << 20
LFS_FROM_BYTES = 10 << 20  # the Hub stores larger files in LFS (git-lfs's default threshold)
RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class HubFile:
    path: str
    local: Path
    size: int
    sha256: str
    git_oid: str  # the git blob id (sha1 of "blob <size>\0" + content), as the Hub reports it


@dataclass(frozen=True)
class Repo:
    repo_id: str
    sha: str  # the commit: a hash of every file's path and content
    files: dict[str, HubFile]


def _digests(path: Path) -> tuple[str, str]:
    sha256, blob = hashlib.sha256(), hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            sha256.update(chunk)
            blob.update(chunk)
    return sha256.hexdigest(), blob.hexdigest()


def load_repo(repo_id: str, root: Path) -> Repo:
    """Every regular file under `root` (hidden ones left out), hashed once."""
    files = {}
    for local in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = local.relative_to(root).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        sha256, oid = _digests(local)
        files[rel] = HubFile(rel, local, local.stat().st_size, sha256, oid)
    commit = hashlib.sha1(json.dumps(sorted((f.path, f.sha256) for f in files.values()))
                          .encode()).hexdigest()
    return Repo(repo_id, commit, files)


def tree_entry(f: HubFile) -> dict:
    entry = {"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid}
    if f.size >= LFS_FROM_BYTES:
        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
    return entry


class ModelHub:
    """The hub as a threaded HTTP server on `host`:`port` (0: any free port)."""

    def __init__(self, repos: dict[str, Path], host: str = "127.0.0.1", port: int = 0,
                 bytes_per_s: float | None = None) -> None:
        self.repos = {rid: load_repo(rid, Path(d)) for rid, d in repos.items()}
        self.bytes_per_s = bytes_per_s
        self.fetches: Counter[str] = Counter()  # "repo/path" -> GETs of its content
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ModelHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def weight_fetches(self, repo_id: str) -> int:
        """GETs of the repo's weights (*.safetensors) so far."""
        with self._lock:
            return sum(n for key, n in self.fetches.items()
                       if key.startswith(repo_id + "/") and key.endswith(".safetensors"))

    def _count(self, key: str, sent: int) -> None:
        with self._lock:
            self.fetches[key] += 1
            self.bytes_sent += sent

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args) -> None:  # quiet: the test's output stays short
                pass

            def do_GET(self) -> None:
                hub._route(self, body=True)

            def do_HEAD(self) -> None:
                hub._route(self, body=False)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = self.rfile.read(min(length, 1 << 20)).decode(errors="replace")
                hub._route(self, body=True, form=form)

        return Handler

    def _find(self, rest: str) -> tuple[Repo, str] | None:
        """The repo an URL path starts with (ids are ORG/NAME), and what follows it."""
        for rid, repo in self.repos.items():
            if rest == rid or rest.startswith(rid + "/"):
                return repo, rest[len(rid):].lstrip("/")
        return None

    def _route(self, req: BaseHTTPRequestHandler, *, body: bool, form: str = "") -> None:
        url = urllib.parse.urlsplit(req.path)
        path = urllib.parse.unquote(url.path).lstrip("/")
        api = path.startswith("api/models/")
        found = self._find(path[len("api/models/"):] if api else path)
        if found is None:
            return _send_json(req, 404, {"error": "Repository not found"}, body,
                              {"X-Error-Code": "RepoNotFound"})
        repo, rest = found
        if not api:
            kind, _, rest = rest.partition("/")
            rev, _, file_path = rest.partition("/")
            if kind != "resolve" or not self._revision_ok(repo, rev):
                return _send_json(req, 404, {"error": "Revision not found"}, body,
                                  {"X-Error-Code": "RevisionNotFound"})
            return self._resolve(req, repo, file_path, body)
        kind, _, rest = rest.partition("/")
        rev, _, sub = rest.partition("/")
        if kind in ("", "revision") and (kind == "" or self._revision_ok(repo, rev)):
            info = {"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha,
                    "private": False, "gated": False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": p} for p in repo.files]}
            return _send_json(req, 200, info, body)
        if kind == "tree" and self._revision_ok(repo, rev):
            prefix = sub.rstrip("/")
            entries = [tree_entry(f) for p, f in repo.files.items()
                       if not prefix or p.startswith(prefix + "/")]
            return _send_json(req, 200, entries, body)
        if kind == "paths-info" and self._revision_ok(repo, rev):
            asked = urllib.parse.parse_qs(form).get("paths") or []
            return _send_json(req, 200, [tree_entry(repo.files[p]) for p in asked
                                         if p in repo.files], body)
        return _send_json(req, 404, {"error": "Entry not found"}, body,
                          {"X-Error-Code": "EntryNotFound"})

    @staticmethod
    def _revision_ok(repo: Repo, rev: str) -> bool:
        return urllib.parse.unquote(rev) in ("main", repo.sha)

    def _resolve(self, req: BaseHTTPRequestHandler, repo: Repo, file_path: str,
                 body: bool) -> None:
        f = repo.files.get(file_path)
        if f is None:
            return _send_json(req, 404, {"error": "Entry not found"}, body,
                              {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.sha})
        start, end = 0, f.size - 1
        match = RANGE.match(req.headers.get("Range") or "")
        if match:
            start = int(match[1])
            end = min(int(match[2]), end) if match[2] else end
        etag = f.sha256 if f.size >= LFS_FROM_BYTES else f.git_oid
        req.send_response(206 if match else 200)
        for key, value in (("X-Repo-Commit", repo.sha), ("ETag", f'"{etag}"'),
                           ("X-Linked-Etag", f'"{etag}"'), ("X-Linked-Size", str(f.size)),
                           ("Accept-Ranges", "bytes"), ("Content-Type", "application/octet-stream"),
                           ("Content-Length", str(max(0, end - start + 1)))):
            req.send_header(key, value)
        if match:
            req.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        req.end_headers()
        if body:
            self._count(f"{repo.repo_id}/{f.path}", self._stream(req, f.local, start, end))

    def _stream(self, req: BaseHTTPRequestHandler, local: Path, start: int, end: int) -> int:
        """Send bytes start..end at bytes_per_s; returns how many went out."""
        sent, began = 0, time.monotonic()
        try:
            with local.open("rb") as f:
                f.seek(start)
                while sent < end - start + 1:
                    chunk = f.read(min(CHUNK, end - start + 1 - sent))
                    if not chunk:
                        break
                    req.wfile.write(chunk)
                    sent += len(chunk)
                    if self.bytes_per_s:
                        ahead = sent / self.bytes_per_s - (time.monotonic() - began)
                        if ahead > 0:
                            time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return sent


def _send_json(req: BaseHTTPRequestHandler, status: int, data, body: bool,
               headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(data).encode()
    req.send_response(status)
    for key, value in {"Content-Type": "application/json", "Content-Length": str(len(raw)),
                       **(headers or {})}.items():
        req.send_header(key, value)
    req.end_headers()
    if body:
        req.wfile.write(raw)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_testbed.modelhub",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", action="append", required=True, metavar="ORG/NAME=DIR")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bytes-per-s", type=float, default=None)
    args = parser.parse_args(argv)
    repos = dict(r.split("=", 1) for r in args.repo)
    with ModelHub(repos, args.host, args.port, args.bytes_per_s) as hub:
        print(f"model hub at {hub.url}: {', '.join(hub.repos)}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
