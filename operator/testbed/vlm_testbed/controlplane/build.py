"""Builds the control plane's binaries: Kubernetes v1.20.2 compiled from Debian bookworm's
`kubernetes` source package, cached under ~/.cache/vlm-operator (or VLM_OPERATOR_CACHE)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .processes import _kill_group, tail

K8S_VERSION = "v1.20.2"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
# The node's binaries: built in the same `make` as the control plane's when that one runs (the
# packages they share compile once); added on their own to a cache made before they were. The
# two vlm-* programs are the test bed's own Go sources (realnode/go/<name>/main.go), copied into
# the tree as cmd/<name> so they build against its vendored packages: a device plugin for
# stand-in GPUs and a pod sandbox's pause process.
NODE_BINARIES = ("kubelet", "vlm-gpu-device-plugin", "vlm-pause")
OWN_GO_SOURCES = Path(__file__).resolve().parent.parent / "realnode" / "go"
DEB_SRC_FILE = "/etc/apt/sources.list.d/vlm-operator-bookworm-src.sources"
DEB_SRC_ENTRY = """Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
REFLECT2_DEBIAN = "/usr/share/gocode/src/github.com/modern-go/reflect2"
COMPLETE_MARKER = "COMPLETE.json"
PROGRESS_EVERY_S = 30.0


class ControlPlaneError(RuntimeError):
    """A build step or a component failed; the message names the step and shows the log tail."""


def cache_root() -> Path:
    """Cache root; ``VLM_OPERATOR_CACHE`` overrides ``~/.cache/vlm-operator``."""
    env = os.environ.get("VLM_OPERATOR_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vlm-operator"


def bin_dir() -> Path:
    """Directory of the cached binaries; ``VLM_K8S_BIN_DIR`` overrides it directly."""
    env = os.environ.get("VLM_K8S_BIN_DIR")
    return Path(env) if env else cache_root() / "k8s" / K8S_VERSION


def binaries_ready(directory: Path | None = None) -> bool:
    """True when the directory holds a complete, marked set of binaries."""
    d = directory or bin_dir()
    if not (d / COMPLETE_MARKER).is_file():
        return False
    return all(os.access(d / b, os.X_OK) for b in BINARIES)


def node_binaries_ready(directory: Path | None = None) -> bool:
    """True when the cache also holds the node's binaries (the kubelet)."""
    d = directory or bin_dir()
    return binaries_ready(d) and all(os.access(d / b, os.X_OK) for b in NODE_BINARIES)


def node_binary(name: str = "kubelet") -> Path:
    """A cached node binary (kubelet, ...); raises naming the command that builds them."""
    if not node_binaries_ready():
        raise ControlPlaneError(
            f"kubelet not built in {bin_dir()}: run `python -m vlm_testbed.controlplane build` "
            "(adds it to a cached control plane, about 7 min on 2 cores)"
        )
    return bin_dir() / name


def binary(name: str) -> Path:
    """Path of one cached binary; raises if the set is not built yet."""
    if name in NODE_BINARIES:
        return node_binary(name)
    if not binaries_ready():
        raise ControlPlaneError(
            f"Kubernetes binaries not built in {bin_dir()}: run "
            "`python -m vlm_testbed.controlplane build` (or hack/cluster.sh build)"
        )
    return bin_dir() / name


def kubectl_path() -> Path | None:
    """The cached kubectl, or None when not built."""
    p = bin_dir() / "kubectl"
    return p if binaries_ready() else None


def etcd_path() -> Path:
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not found:
        raise ControlPlaneError("etcd not found: install Debian etcd-server (hack/install-deps.sh)")
    return Path(found)


def run_step(
    step: str,
    cmd: Sequence[str],
    log: Path,
    *,
    timeout_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    progress: bool = False,
) -> None:
    """Run one build step with a timeout; on failure raise naming the step with the log tail."""
    print(f"[build] {step}: {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    with open(log, "ab") as out:
        out.write(f"\n=== {step}: {' '.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        next_report = start + PROGRESS_EVERY_S
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - start > timeout_s:
                    _kill_group(proc)
                    raise ControlPlaneError(
                        f"build step '{step}' timed out after {timeout_s:.0f} s; "
                        f"log {log}, last lines:\n{tail(log)}"
                    )
                if progress and now >= next_report:
                    print(f"[build] still building... {now - start:.0f} s", flush=True)
                    next_report += PROGRESS_EVERY_S
                time.sleep(0.5)
        except BaseException:
            _kill_group(proc)
            raise
    if proc.returncode != 0:
        raise ControlPlaneError(
            f"build step '{step}' failed (exit {proc.returncode}); log {log}, last lines:\n"
            f"{tail(log)}"
        )
    print(f"[build] {step}: ok in {time.monotonic() - start:.0f} s", flush=True)


def _deb_src_configured() -> bool:
    files = glob.glob("/etc/apt/sources.list.d/*.sources")
    for f in files:
        with contextlib.suppress(OSError), open(f) as fh:
            text = fh.read()
            if "deb-src" in text and "bookworm" in text:
                return True
    for f in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
        with contextlib.suppress(OSError), open(f) as fh:
            if any(ln.startswith("deb-src") and "bookworm" in ln for ln in fh):
                return True
    return False


def _sudo() -> list[str]:
    return [] if os.geteuid() == 0 else ["sudo", "-n"]


def patch_reflect2(tree: Path) -> None:
    """Swap vendored reflect2 1.0.1 (SIGSEGV on custom resources with Go >= 1.18) for 1.0.2."""
    src = Path(REFLECT2_DEBIAN)
    if not (src / "reflect2.go").is_file():
        raise ControlPlaneError(
            f"{src} missing: install golang-github-modern-go-reflect2-dev (hack/install-deps.sh)"
        )
    dst = tree / "vendor/github.com/modern-go/reflect2"
    shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("go.mod", "*_test.go"))
    for name in ("vendor/modules.txt", "go.mod"):
        p = tree / name
        lines = p.read_text().splitlines(keepends=True)
        p.write_text(
            "".join(
                ln.replace("v1.0.1", "v1.0.2") if "github.com/modern-go/reflect2" in ln else ln
                for ln in lines
            )
        )


def _find_outputs(tree: Path, names: Sequence[str]) -> dict[str, Path]:
    # Not a recursive glob: _output/local/go/src links back to the whole tree.
    out = tree / "_output" / "local" / "bin" / "linux" / "amd64"
    found: dict[str, Path] = {}
    for b in names:
        if not os.access(out / b, os.X_OK):
            raise ControlPlaneError(f"build finished but {out / b} is missing")
        found[b] = out / b
    return found


def _copy_binary(src: Path, dst: Path) -> dict[str, Any]:
    shutil.copy2(src, dst)
    os.chmod(dst, 0o755)
    with open(dst, "rb") as f:
        h = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": h, "size": dst.stat().st_size}


def _install_binaries(outputs: dict[str, Path], dest: Path, make_s: float) -> None:
    """Copy into a temp sibling, write the marker, then rename: only a full set is visible."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)
    manifest: dict[str, Any] = {"version": K8S_VERSION, "built_at": time.time(), "files": {},
                                "make_seconds": {" ".join(outputs): round(make_s)}}
    for name, src in outputs.items():
        manifest["files"][name] = _copy_binary(src, tmp / name)
    (tmp / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1))
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
        dest.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(dest)


def _add_binaries(outputs: dict[str, Path], dest: Path, make_s: float) -> None:
    """Add binaries to a complete cached set: each appears by rename (never half-copied) and
    the marker is rewritten by rename, so running processes and readers see old or new."""
    manifest = json.loads((dest / COMPLETE_MARKER).read_text())
    for name, src in outputs.items():
        tmp = dest / f".{name}.{os.getpid()}"
        manifest["files"][name] = _copy_binary(src, tmp)
        tmp.rename(dest / name)
    manifest.setdefault("make_seconds", {})[" ".join(outputs)] = round(make_s)
    tmp_marker = dest / f".{COMPLETE_MARKER}.{os.getpid()}"
    tmp_marker.write_text(json.dumps(manifest, indent=1))
    tmp_marker.rename(dest / COMPLETE_MARKER)


def _needed(dest: Path, force: bool, node: bool | None) -> tuple[str, ...]:
    if force or not binaries_ready(dest):
        return BINARIES + NODE_BINARIES if node is not False else BINARIES
    if node and not node_binaries_ready(dest):
        return NODE_BINARIES
    return ()


def build(force: bool = False, node: bool | None = None) -> Path:
    """Build (or reuse) the cached v1.20.2 binaries; returns the binary directory.

    `node`: None builds the kubelet along with the control plane when that one is built, but
    never on its own (callers that only need a control plane don't wait for it); True also
    adds it to a cached control plane that lacks it; False never builds it."""
    dest = bin_dir()
    names = _needed(dest, force, node)
    if not names:
        print(f"[build] Kubernetes {K8S_VERSION} binaries cached in {dest}", flush=True)
        return dest
    work = cache_root() / "build"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(lock, timeout_s=5400)
            names = _needed(dest, False, node)
            if not names:
                print(f"[build] binaries now cached in {dest}", flush=True)
                return dest
        return _build_locked(dest, work, names)


def _wait_for_lock(lock: Any, timeout_s: float) -> None:
    start = time.monotonic()
    print("[build] another build is running; waiting for it", flush=True)
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise ControlPlaneError(f"waited {waited:.0f} s for another build") from None
            time.sleep(2)


def _build_locked(dest: Path, work: Path, names: Sequence[str]) -> Path:
    t0 = time.monotonic()
    log = work / "build.log"
    log.write_text("")
    print(f"[build] building Kubernetes {K8S_VERSION} {', '.join(names)} from Debian source in "
          f"{work} (10-15 min on 2 cores; the kubelet alone about 7 min); log {log}", flush=True)
    for tool in ("go", "make", "rsync", "dpkg-source"):
        if not shutil.which(tool):
            raise ControlPlaneError(f"'{tool}' not found: run hack/install-deps.sh")
    if not _deb_src_configured():
        print(f"[build] adding deb-src entry {DEB_SRC_FILE}", flush=True)
        subprocess.run([*_sudo(), "tee", DEB_SRC_FILE], input=DEB_SRC_ENTRY.encode(),
                       stdout=subprocess.DEVNULL, check=True, timeout=30)
        run_step("apt-get update", [*_sudo(), "apt-get", "update", "-q"], log, timeout_s=300)

    src = work / "src"
    tree_marker = src / ".vlm-prepared"
    trees = [Path(p) for p in glob.glob(str(src / "kubernetes-*")) if os.path.isdir(p)]
    if not (tree_marker.is_file() and len(trees) == 1):
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        get_source = ["apt-get", "source", "-q", "kubernetes"]
        try:
            run_step("apt-get source kubernetes", get_source, log, timeout_s=600, cwd=src)
        except ControlPlaneError:
            print("[build] retrying after apt-get update (deb-src lists may be stale)", flush=True)
            run_step("apt-get update", [*_sudo(), "apt-get", "update", "-q"], log, timeout_s=300)
            run_step("apt-get source kubernetes", get_source, log, timeout_s=600, cwd=src)
        trees = [Path(p) for p in glob.glob(str(src / "kubernetes-*")) if os.path.isdir(p)]
        if len(trees) != 1:
            raise ControlPlaneError(f"apt-get source: expected one kubernetes-* dir in {src}")
        print("[build] reflect2 fix: vendoring Debian's reflect2 1.0.2", flush=True)
        patch_reflect2(trees[0])
        tree_marker.write_text(trees[0].name)
    tree = trees[0]

    env = dict(os.environ)
    env.update(
        GOPROXY="off", GOFLAGS="-mod=vendor", CGO_ENABLED="0", GO111MODULE="on",
        GOCACHE=str(work / "gocache"), GOTOOLCHAIN="local",
    )
    for name in names:
        own = OWN_GO_SOURCES / name
        if own.is_dir():
            shutil.copytree(own, tree / "cmd" / name, dirs_exist_ok=True)
    what = " ".join(f"cmd/{b}" for b in names)
    t_make = time.monotonic()
    run_step(f"make {' '.join(names)}", ["nice", "-n", "10", "make", f"WHAT={what}"], log,
             timeout_s=3600, cwd=tree, env=env, progress=True)
    make_s = time.monotonic() - t_make
    outputs = _find_outputs(tree, names)
    if set(BINARIES) <= set(names):
        _install_binaries(outputs, dest, make_s)
    else:
        _add_binaries(outputs, dest, make_s)
    # The source tree and Go cache take several GB; a rebuild is rare, so free them.
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work / "gocache", ignore_errors=True)
    print(f"[build] done in {time.monotonic() - t0:.0f} s: {dest}", flush=True)
    return dest
