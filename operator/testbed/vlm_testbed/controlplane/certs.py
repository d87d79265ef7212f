"""The control plane's self-made certificates (one CA) and the kubeconfigs that use them."""

from __future__ import annotations

import base64
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .build import ControlPlaneError


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


def api_client_from_kubeconfig(kubeconfig: str | os.PathLike) -> Any:
    """A ``kubernetes.client.ApiClient`` for the given kubeconfig (its current context)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    return client.ApiClient(cfg)
