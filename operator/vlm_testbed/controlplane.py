"""A real local Kubernetes control plane (etcd + kube-apiserver + controller-manager + scheduler).

No registry ships kube-apiserver binaries usable here, so ``build()`` compiles Kubernetes v1.20.2
from Debian bookworm's ``kubernetes`` source package and caches the binaries. ``ControlPlane``
starts etcd and the three control-plane components on loopback with self-made certificates and
RBAC on; only the node side (kubelet) is missing, which is why pods stay Pending.

CLI: ``python -m vlm_testbed.controlplane build|up|down|env``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

K8S_VERSION = "v1.20.2"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
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


# --------------------------------------------------------------------------- paths


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


def binary(name: str) -> Path:
    """Path of one cached binary; raises if the set is not built yet."""
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


# --------------------------------------------------------------------------- process helpers


def tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate then kill the process group we created for ``proc``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


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


# --------------------------------------------------------------------------- build


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


def _find_outputs(tree: Path) -> dict[str, Path]:
    # Not a recursive glob: _output/local/go/src links back to the whole tree.
    out = tree / "_output" / "local" / "bin" / "linux" / "amd64"
    found: dict[str, Path] = {}
    for b in BINARIES:
        if not os.access(out / b, os.X_OK):
            raise ControlPlaneError(f"build finished but {out / b} is missing")
        found[b] = out / b
    return found


def _install_binaries(outputs: dict[str, Path], dest: Path) -> None:
    """Copy into a temp sibling, write the marker, then rename: only a full set is visible."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    os.chmod(tmp, 0o755)
    manifest = {"version": K8S_VERSION, "built_at": time.time(), "files": {}}
    for name, src in outputs.items():
        shutil.copy2(src, tmp / name)
        os.chmod(tmp / name, 0o755)
        with open(tmp / name, "rb") as f:
            h = hashlib.file_digest(f, "sha256").hexdigest()
        manifest["files"][name] = {"sha256": h, "size": (tmp / name).stat().st_size}
    (tmp / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1))
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
        dest.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(dest)


def build(force: bool = False) -> Path:
    """Build (or reuse) the cached v1.20.2 binaries; returns the binary directory."""
    dest = bin_dir()
    if binaries_ready(dest) and not force:
        print(f"[build] Kubernetes {K8S_VERSION} binaries cached in {dest}", flush=True)
        return dest
    work = cache_root() / "build"
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _wait_for_lock(lock, timeout_s=5400)
            if binaries_ready(dest) and not force:
                print(f"[build] binaries now cached in {dest}", flush=True)
                return dest
        return _build_locked(dest, work)


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


def _build_locked(dest: Path, work: Path) -> Path:
    t0 = time.monotonic()
    log = work / "build.log"
    log.write_text("")
    print(f"[build] building Kubernetes {K8S_VERSION} from Debian source in {work} "
          f"(about 10 min on 2 cores); log {log}", flush=True)
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
    what = " ".join(f"cmd/{b}" for b in BINARIES)
    run_step("make", ["nice", "-n", "10", "make", f"WHAT={what}"], log, timeout_s=3600,
             cwd=tree, env=env, progress=True)
    _install_binaries(_find_outputs(tree), dest)
    # The source tree and Go cache take several GB; a rebuild is rare, so free them.
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work / "gocache", ignore_errors=True)
    print(f"[build] done in {time.monotonic() - t0:.0f} s: {dest}", flush=True)
    return dest


# --------------------------------------------------------------------------- certificates


def _openssl(args: Sequence[str], cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise ControlPlaneError(f"openssl {' '.join(args)} failed:\n{r.stderr[-2000:]}")


class CertAuthority:
    """A throw-away CA made with the openssl CLI, issuing serving and client certificates."""

    def __init__(self, directory: Path, name: str = "vlm-testbed-ca") -> None:
        self.dir = directory
        self.cert = directory / "ca.crt"
        self.key = directory / "ca.key"
        _openssl(["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key"],
                 directory)
        _openssl(["req", "-x509", "-new", "-key", "ca.key", "-sha256", "-days", "3650",
                  "-subj", f"/CN={name}", "-out", "ca.crt",
                  "-addext", "basicConstraints=critical,CA:TRUE",
                  "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"], directory)

    def issue(
        self,
        name: str,
        cn: str,
        orgs: Sequence[str] = (),
        sans: Sequence[str] = (),
        server: bool = False,
    ) -> tuple[Path, Path]:
        """Issue ``<name>.crt``/``<name>.key``; ``sans`` like ``IP:127.0.0.1`` or ``DNS:x``."""
        d = self.dir
        subj = "".join(f"/O={o}" for o in orgs) + f"/CN={cn}"
        _openssl(["ecparam", "-name", "prime256v1", "-genkey", "-noout",
                  "-out", f"{name}.ec.key"], d)
        _openssl(["pkcs8", "-topk8", "-nocrypt", "-in", f"{name}.ec.key", "-out", f"{name}.key"], d)
        (d / f"{name}.ec.key").unlink()
        _openssl(["req", "-new", "-key", f"{name}.key", "-subj", subj, "-out", f"{name}.csr"], d)
        usage = "serverAuth" if server else "clientAuth"
        ext = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
               f"extendedKeyUsage={usage}"]
        if sans:
            ext.append("subjectAltName=" + ",".join(sans))
        (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
        _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                  "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", f"{name}.ext",
                  "-out", f"{name}.crt"], d)
        return d / f"{name}.crt", d / f"{name}.key"


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> Path:
    """A self-contained kubeconfig (certificates embedded) so it can be copied anywhere."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "vlm-testbed", "cluster": {
            "server": server, "certificate-authority-data": _b64(ca)}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": _b64(cert), "client-key-data": _b64(key)}}],
        "contexts": [{"name": "vlm-testbed", "context": {"cluster": "vlm-testbed", "user": user}}],
        "current-context": "vlm-testbed",
    }
    path.write_text(yaml.safe_dump(cfg))
    os.chmod(path, 0o600)
    return path


# --------------------------------------------------------------------------- client helpers


def api_client_from_kubeconfig(kubeconfig: str | os.PathLike) -> Any:
    """A ``kubernetes.client.ApiClient`` for the given kubeconfig (its current context)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return client.ApiClient(cfg)


def load_manifests(items: Iterable[dict | str | os.PathLike]) -> list[dict]:
    """Dicts are taken as they are; paths are read as (multi-document) YAML."""
    docs: list[dict] = []
    for item in items:
        if isinstance(item, dict):
            docs.append(item)
            continue
        with open(item) as f:
            docs.extend(d for d in yaml.safe_load_all(f) if d)
    return docs


def _crd_established(obj: dict) -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conds)


def apply_manifests(api_client: Any, manifests: Iterable[dict | str | os.PathLike],
                    timeout_s: float = 60.0) -> None:
    """Create (or merge-patch when present) each object; CRDs first, waited until Established."""
    from kubernetes.dynamic import DynamicClient
    from kubernetes.dynamic.exceptions import ConflictError

    docs = load_manifests(manifests)
    crds = [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
    rest = [d for d in docs if d.get("kind") != "CustomResourceDefinition"]
    for group in (crds, rest):
        if not group:
            continue
        dyn = DynamicClient(api_client)
        for doc in group:
            res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            meta = doc.get("metadata") or {}
            ns = meta.get("namespace") if res.namespaced else None
            if res.namespaced and not ns:
                ns = "default"
            try:
                res.create(body=doc, namespace=ns)
            except ConflictError:
                res.patch(body=doc, name=meta["name"], namespace=ns,
                          content_type="application/merge-patch+json")
        if group is crds:
            crd_res = dyn.resources.get(api_version="apiextensions.k8s.io/v1",
                                        kind="CustomResourceDefinition")
            deadline = time.monotonic() + timeout_s
            for doc in crds:
                name = doc["metadata"]["name"]
                while not _crd_established(crd_res.get(name=name).to_dict()):
                    if time.monotonic() > deadline:
                        raise ControlPlaneError(f"CRD {name} not Established in {timeout_s} s")
                    time.sleep(0.1)


# --------------------------------------------------------------------------- control plane


def ready_namespace(api_client: Any, name: str, timeout_s: float = 120.0) -> str:
    """Create a namespace and wait until pods can be created in it: its default ServiceAccount
    exists (and, before Kubernetes 1.24, has its token Secret)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(api_client)
    core.create_namespace({"metadata": {"name": name}})
    need_secret = int(client.VersionApi(api_client).get_code().minor.rstrip("+")) < 24
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sa = core.read_namespaced_service_account("default", name)
            if sa.secrets or not need_secret:
                return name
        except ApiException as exc:
            if exc.status != 404:
                raise
        time.sleep(0.2)
    raise TimeoutError(f"default ServiceAccount in {name} not ready in {timeout_s} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _https_ok(url: str, ctx: ssl.SSLContext, timeout_s: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=ctx))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent() -> None:
    """In the child: get SIGTERM when our process dies, so no control plane is orphaned."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback.

    Use as a context manager. ``manifests`` (dicts or YAML paths) are applied once the apiserver
    is ready and before the controller-manager starts (so GC knows CRDs from its first sync).
    Only processes started here are stopped; the run dir is removed unless it was given.
    """

    SERVICE_CIDR = "10.0.0.0/24"

    def __init__(
        self,
        manifests: Iterable[dict | str | os.PathLike] = (),
        *,
        run_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 120.0,
        verbosity: int = 1,
        audit_users: Sequence[str] = (),
    ) -> None:
        """`audit_users`: requests of these users are written to the audit log
        (log_path("audit")), one JSON line each at completion (metadata only)."""
        self.manifests = list(manifests)
        self.audit_users = list(audit_users)
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else None
        self.start_timeout_s = start_timeout_s
        self.verbosity = verbosity
        self.procs: dict[str, subprocess.Popen] = {}
        self._etcd_data: Path | None = None
        self.kubeconfig: Path | None = None
        self.server: str | None = None
        self.ca: CertAuthority | None = None
        self.ports: dict[str, int] = {}
        self.start_seconds: float | None = None
        self._apiserver_cmd: list[Any] = []
        self._admin_ctx: ssl.SSLContext | None = None

    # -- public ---------------------------------------------------------------------------

    @property
    def kubectl(self) -> Path | None:
        return kubectl_path()

    def api_client(self) -> Any:
        if not self.kubeconfig:
            raise ControlPlaneError("control plane not started")
        return api_client_from_kubeconfig(self.kubeconfig)

    def log_path(self, component: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / f"{component}.log"

    def dead_components(self) -> dict[str, int]:
        """Components that exited, with their exit codes (empty while all run)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    # -- faults: the real apiserver stopped, restarted, frozen
    @property
    def apiserver_pid(self) -> int:
        return self.procs["kube-apiserver"].pid

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, SIGKILL after 10 s): connections are refused until
        start_apiserver. etcd and the other components keep running."""
        _kill_group(self.procs["kube-apiserver"])

    def start_apiserver(self) -> None:
        """Start kube-apiserver again, same port, certificates and etcd; returns once ready."""
        self._spawn("kube-apiserver", self._apiserver_cmd)
        self._wait("kube-apiserver", lambda: _https_ok(f"{self.server}/readyz", self._admin_ctx),
                   self.start_timeout_s)

    def freeze_apiserver(self) -> None:
        """SIGSTOP: its connections stay open and nothing answers, as with a half-open
        connection to an apiserver that vanished."""
        os.killpg(self.apiserver_pid, signal.SIGSTOP)

    def thaw_apiserver(self) -> None:
        os.killpg(self.apiserver_pid, signal.SIGCONT)

    def user_kubeconfig(self, user: str, groups: Sequence[str] = ("system:masters",)) -> Path:
        """A kubeconfig of its own for `user` (e.g. so the audit log tells its requests
        apart)."""
        assert self.ca is not None and self.run_dir is not None and self.server
        crt, key = self.ca.issue(f"user-{user}", user, orgs=groups)
        return write_kubeconfig(self.run_dir / f"{user}.kubeconfig", self.server, self.ca.cert,
                                crt, key, user)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        t0 = time.monotonic()
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="vlm-cp-"))
        else:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_all()
        except BaseException:
            self.stop(keep_logs=True)
            print(f"control plane failed to start; logs kept in {self.run_dir}", file=sys.stderr)
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self, keep_logs: bool = False) -> None:
        """Stop our processes in reverse start order (terminate, then kill); clean temp dirs."""
        for name in reversed(list(self.procs)):
            _kill_group(self.procs[name])
        if self._etcd_data:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
        if self._own_run_dir and self.run_dir and not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- internals --------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: Sequence[str]) -> subprocess.Popen:
        log = open(self.log_path(name), "ab")  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(
                [str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.run_dir,
                preexec_fn=_die_with_parent,
            )
        finally:
            log.close()
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, ready: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        proc = self.procs[name]
        while not ready():
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with {proc.returncode} during start; "
                    f"{self.log_path(name)} ends with:\n{tail(self.log_path(name))}"
                )
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{name} not ready after {timeout_s:.0f} s; "
                    f"{self.log_path(name)} ends with:\n{tail(self.log_path(name))}"
                )
            time.sleep(0.2)

    def _start_all(self) -> None:
        rd = self.run_dir
        assert rd is not None
        apiserver, cm, sched = (binary(b) for b in BINARIES[:3])
        pki = rd / "pki"
        pki.mkdir(exist_ok=True)
        ca = self.ca = CertAuthority(pki)
        names = ("etcd", "etcd-peer", "apiserver", "cm", "sched")
        ports: set[int] = set()
        while len(ports) < len(names):
            ports.add(free_port())
        p = self.ports = dict(zip(names, sorted(ports), strict=True))
        self.server = f"https://127.0.0.1:{p['apiserver']}"

        shm = Path("/dev/shm")  # etcd fsyncs a lot; tmpfs keeps it fast when big enough
        base = (shm if shm.is_dir() and os.access(shm, os.W_OK)
                and shutil.disk_usage(shm).free > 2 * 1024**3 else None)
        self._etcd_data = Path(tempfile.mkdtemp(prefix="vlm-etcd-", dir=base))
        etcd_url = f"http://127.0.0.1:{p['etcd']}"
        peer_url = f"http://127.0.0.1:{p['etcd-peer']}"
        self._spawn("etcd", [
            etcd_path(), "--name", "vlm", "--data-dir", self._etcd_data,
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"vlm={peer_url}", "--log-level", "warn",
            "--logger", "zap", "--quota-backend-bytes", str(2 * 1024**3),
        ])

        svc_ip = "10.0.0.1"
        srv_crt, srv_key = ca.issue(
            "apiserver", "kube-apiserver", server=True,
            sans=["IP:127.0.0.1", f"IP:{svc_ip}", "DNS:localhost", "DNS:kubernetes",
                  "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
                  "DNS:kubernetes.default.svc.cluster.local"])
        admin_crt, admin_key = ca.issue("admin", "vlm-admin", orgs=["system:masters"])
        kl_crt, kl_key = ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                                  orgs=["system:masters"])
        cm_crt, cm_key = ca.issue("controller-manager", "system:kube-controller-manager")
        sc_crt, sc_key = ca.issue("scheduler", "system:kube-scheduler")
        _openssl(["genrsa", "-out", "sa.key", "2048"], pki)
        _openssl(["rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub"], pki)

        self.kubeconfig = write_kubeconfig(rd / "admin.kubeconfig", self.server, ca.cert,
                                           admin_crt, admin_key, "vlm-admin")
        cm_kc = write_kubeconfig(rd / "controller-manager.kubeconfig", self.server, ca.cert,
                                 cm_crt, cm_key, "system:kube-controller-manager")
        sc_kc = write_kubeconfig(rd / "scheduler.kubeconfig", self.server, ca.cert,
                                 sc_crt, sc_key, "system:kube-scheduler")

        self._wait("etcd", lambda: _http_ok(f"{etcd_url}/health"), 30)
        v = f"--v={self.verbosity}"
        audit = []
        if self.audit_users:
            policy = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                      "omitStages": ["RequestReceived", "ResponseStarted"],
                      "rules": [{"level": "Metadata", "users": self.audit_users},
                                {"level": "None"}]}
            (rd / "audit-policy.yaml").write_text(yaml.safe_dump(policy))
            audit = [f"--audit-policy-file={rd / 'audit-policy.yaml'}",
                     f"--audit-log-path={self.log_path('audit')}", "--audit-log-maxbackup=1",
                     "--audit-log-maxsize=1024"]
        self._apiserver_cmd = [
            apiserver, v, f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={p['apiserver']}", "--insecure-port=0",
            f"--cert-dir={pki}", f"--tls-cert-file={srv_crt}", f"--tls-private-key-file={srv_key}",
            f"--client-ca-file={ca.cert}", "--authorization-mode=Node,RBAC",
            # as on OpenShift: setting blockOwnerDeletion needs update on the owner's finalizers
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={self.SERVICE_CIDR}", "--allow-privileged=true",
            f"--kubelet-client-certificate={kl_crt}", f"--kubelet-client-key={kl_key}",
            "--kubelet-preferred-address-types=InternalIP,Hostname,ExternalIP",
            "--profiling=false", *audit,
        ]
        self._spawn("kube-apiserver", self._apiserver_cmd)
        ctx = self._admin_ctx = ssl.create_default_context(cafile=str(ca.cert))
        ctx.load_cert_chain(str(admin_crt), str(admin_key))
        self._wait("kube-apiserver", lambda: _https_ok(f"{self.server}/readyz", ctx),
                   self.start_timeout_s)

        if self.manifests:
            with self.api_client() as client:
                apply_manifests(client, self.manifests)

        common = ["--bind-address=127.0.0.1", "--port=0", "--leader-elect=false", v]
        self._spawn("kube-controller-manager", [
            cm, *common, f"--secure-port={p['cm']}", f"--cert-dir={pki}",
            f"--kubeconfig={cm_kc}", f"--authentication-kubeconfig={cm_kc}",
            f"--authorization-kubeconfig={cm_kc}", "--controllers=*",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={ca.cert}", f"--cluster-signing-cert-file={ca.cert}",
            f"--cluster-signing-key-file={ca.key}",
            f"--service-cluster-ip-range={self.SERVICE_CIDR}",
        ])
        self._spawn("kube-scheduler", [
            sched, *common, f"--secure-port={p['sched']}", f"--cert-dir={pki}",
            f"--kubeconfig={sc_kc}", f"--authentication-kubeconfig={sc_kc}",
            f"--authorization-kubeconfig={sc_kc}",
        ])
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        for name, port in (("kube-controller-manager", p["cm"]), ("kube-scheduler", p["sched"])):
            self._wait(name, lambda port=port: _https_ok(
                f"https://127.0.0.1:{port}/healthz", insecure), self.start_timeout_s)


# --------------------------------------------------------------------------- CLI (up/down/env)


def state_dir() -> Path:
    """Where ``up`` keeps its run dir, kubeconfig path and pid file."""
    return cache_root() / "cluster"


def _read_state() -> dict:
    f = state_dir() / "state.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _pid_alive(pid: int, needle: str) -> bool:
    """Alive and still the program we started (guards against pid reuse)."""
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


ALREADY_UP = 3  # exit code of a supervisor that found another one holding the state dir


def _up_foreground(manifests: list[str], with_project_crd: bool) -> int:
    sd = state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    # One supervisor per state dir, held for its whole life: a second `up` must not wipe
    # the run dir of one that is still starting.
    lock = open(sd / "up.lock", "w")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"another control plane is up or starting for {sd}", file=sys.stderr)
        return ALREADY_UP
    print(f"supervisor pid {os.getpid()}", flush=True)
    run = sd / "run"
    shutil.rmtree(run, ignore_errors=True)
    items: list[Any] = list(manifests)
    if with_project_crd:
        from vlm_operator.api.crd import get_crd

        items.insert(0, get_crd())
    stopping = False

    def _on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    cp = ControlPlane(items, run_dir=run)
    try:
        cp.start()
        state = {
            "pid": os.getpid(), "kubeconfig": str(cp.kubeconfig), "server": cp.server,
            "run_dir": str(run), "kubectl": str(cp.kubectl) if cp.kubectl else None,
            "components": {n: pr.pid for n, pr in cp.procs.items()},
        }
        (sd / "state.json.tmp").write_text(json.dumps(state, indent=1))
        (sd / "state.json.tmp").rename(sd / "state.json")  # readers never see half a file
        (sd / "kubeconfig").unlink(missing_ok=True)
        (sd / "kubeconfig").symlink_to(cp.kubeconfig)
        (sd / "pid").write_text(str(os.getpid()))
        print(f"control plane up in {cp.start_seconds:.1f} s: {cp.server}\n"
              f"export KUBECONFIG={cp.kubeconfig}", flush=True)
        while not stopping:
            dead = cp.dead_components()
            if dead:
                print(f"component(s) exited: {dead}; logs in {run}", file=sys.stderr, flush=True)
                return 1
            time.sleep(1)
        return 0
    finally:
        cp.stop()
        for f in ("state.json", "pid", "kubeconfig"):
            (sd / f).unlink(missing_ok=True)


def cmd_up(args: argparse.Namespace) -> int:
    st = _read_state()
    if st and _pid_alive(st["pid"], "vlm_testbed.controlplane"):
        print(f"already up (pid {st['pid']})\nexport KUBECONFIG={st['kubeconfig']}")
        return 0
    build()
    if args.foreground:
        return _up_foreground(args.manifest, args.with_project_crd)
    sd = state_dir()
    sd.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "vlm_testbed.controlplane", "up", "--foreground"]
    cmd += [f"--manifest={m}" for m in args.manifest]
    if args.with_project_crd:
        cmd.append("--with-project-crd")
    with open(sd / "up.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    told = False
    while True:
        st = _read_state()
        if st and _pid_alive(st["pid"], "vlm_testbed.controlplane"):
            break
        rc = proc.poll()
        if rc == ALREADY_UP and not told:
            print("another `up` holds this state dir; waiting for it to be ready", flush=True)
            told = True
        failed = rc is not None and rc != ALREADY_UP
        if failed or time.monotonic() > deadline:
            _kill_group(proc)
            print(f"control plane failed to start; {sd / 'up.log'}:\n{tail(sd / 'up.log')}",
                  file=sys.stderr)
            return 1
        time.sleep(0.3)
    st = _read_state()
    print(f"control plane up (pid {st['pid']}): {st['server']}\n"
          f"export KUBECONFIG={st['kubeconfig']}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    st = _read_state()
    if not st:
        print("not running")
        return 0
    pid = st["pid"]
    if _pid_alive(pid, "vlm_testbed.controlplane"):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _pid_alive(pid, "vlm_testbed.controlplane") and time.monotonic() < deadline:
            time.sleep(0.2)
    # If the supervisor died hard, its components may remain: stop those we recorded.
    for name, cpid in st.get("components", {}).items():
        needle = "etcd" if name == "etcd" else name
        if _pid_alive(cpid, needle):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cpid, signal.SIGKILL)
    for f in ("state.json", "pid", "kubeconfig"):
        (state_dir() / f).unlink(missing_ok=True)
    print("control plane stopped")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    st = _read_state()
    if not st:
        print("# control plane not running: hack/cluster.sh up", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={st['kubeconfig']}")
    if st.get("kubectl"):
        print(f"export PATH={Path(st['kubectl']).parent}:$PATH")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlm_testbed.controlplane", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build and cache the Kubernetes binaries")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    up = sub.add_parser("up", help="start a control plane (background unless --foreground)")
    up.add_argument("--foreground", action="store_true")
    up.add_argument("--manifest", action="append", default=[],
                    help="YAML file applied before the controllers start (repeatable)")
    up.add_argument("--with-project-crd", action="store_true",
                    help="apply vlm_operator.crd.get_crd() before the controllers start")
    up.add_argument("--timeout", type=float, default=180.0)
    sub.add_parser("down", help="stop the control plane started by `up`")
    sub.add_parser("env", help="print shell exports for the running control plane")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            build(force=args.force)
            return 0
        return {"up": cmd_up, "down": cmd_down, "env": cmd_env}[args.cmd](args)
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
