"""ControlPlane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler started on
loopback with the certificates of certs.py and RBAC on."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from .build import BINARIES, ControlPlaneError, binary, etcd_path, kubectl_path
from .certs import CertAuthority, _openssl, api_client_from_kubeconfig, write_kubeconfig
from .manifests import apply_manifests
from .processes import _die_with_parent, _http_ok, _https_ok, _kill_group, free_port, tail


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
        pod_address: str | None = None,
    ) -> None:
        """`audit_users`: requests of these users are written to the audit log
        (log_path("audit")), one JSON line each at completion (metadata only). `pod_address`:
        an address of this machine that pods on real nodes reach; the apiserver then listens
        on every address (not only loopback), advertises this one and its certificate names
        it, and in_cluster_env() says how a pod reaches it (there is no kube-proxy here to
        carry the kubernetes Service's ClusterIP)."""
        self.manifests = list(manifests)
        self.pod_address = pod_address
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

    def in_cluster_env(self) -> dict[str, str]:
        """The environment a pod's in-cluster client needs to reach this apiserver at
        pod_address, in place of the kubernetes Service the kubelet names."""
        if not self.pod_address:
            raise ControlPlaneError("the control plane was started without a pod_address")
        return {"KUBERNETES_SERVICE_HOST": self.pod_address,
                "KUBERNETES_SERVICE_PORT": str(self.ports["apiserver"])}

    def log_path(self, component: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / f"{component}.log"

    def dead_components(self) -> dict[str, int]:
        """Components that exited, with their exit codes (empty while all run)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    # -- faults: the real apiserver stopped, restarted, frozen; another component frozen
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

    def freeze(self, component: str = "kube-apiserver") -> None:
        """SIGSTOP: its connections stay open and nothing answers, as with a half-open
        connection to an apiserver that vanished; a frozen kube-controller-manager's caches
        and statuses stay as they were, as those of one that lags."""
        os.killpg(self.procs[component].pid, signal.SIGSTOP)

    def thaw(self, component: str = "kube-apiserver") -> None:
        os.killpg(self.procs[component].pid, signal.SIGCONT)

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
            sans=["IP:127.0.0.1", f"IP:{svc_ip}",
                  *([f"IP:{self.pod_address}"] if self.pod_address else []),
                  "DNS:localhost", "DNS:kubernetes",
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
            *(["--bind-address=0.0.0.0", f"--advertise-address={self.pod_address}"]
              if self.pod_address else ["--bind-address=127.0.0.1"]),
            f"--secure-port={p['apiserver']}", "--insecure-port=0",
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
