"""A local image registry for real nodes: the CNCF distribution registry (Debian's
`docker-registry`) on a free loopback port, plain HTTP, storage in a directory of its own.

Each node's containerd uses it as the mirror of docker.io and ghcr.io (config.containerd_config),
so a pod naming `ghcr.io/vlm-operator/vllm:v0.33.0` is pulled from here by the kubelet for real:
once per node, with the pull's own timing in the pod's Events, and imagePullPolicy meaning what
it means in a cluster. Nothing leaves the machine: a name this registry lacks fails to pull."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from vlm_testbed.controlplane.build import ControlPlaneError
from vlm_testbed.controlplane.processes import (
    _die_with_parent,
    _http_ok,
    _kill_group,
    free_port,
    tail,
)

MIRRORED = ("docker.io", "ghcr.io")
START_TIMEOUT_S = 30.0


def repository_path(image: str) -> str:
    """The registry path of an image name: its host dropped (docker.io's one-word names under
    library/, as the Docker Hub keeps them). `ghcr.io/a/b:t` -> `a/b:t`; `python:3` ->
    `library/python:3`."""
    first, _, rest = image.partition("/")
    if not rest or not ("." in first or ":" in first or first == "localhost"):
        rest = image  # no host given: a docker.io name
        first = "docker.io"
    if first not in MIRRORED:
        raise ValueError(f"{image}: only {', '.join(MIRRORED)} names are mirrored here")
    if first == "docker.io" and "/" not in rest:
        rest = f"library/{rest}"
    return rest


class LocalRegistry:
    """`with LocalRegistry() as reg:` a running registry at reg.address (host:port); its
    storage and process go with the block."""

    def __init__(self) -> None:
        self.address = ""
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        assert self._dir is not None
        return self._dir / "registry.log"

    def __enter__(self) -> LocalRegistry:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise ControlPlaneError("the local registry needs Debian's docker-registry "
                                    "(hack/install-deps.sh installs it)")
        self._dir = Path(tempfile.mkdtemp(prefix="vlm-registry-"))
        self.address = f"127.0.0.1:{free_port()}"
        config = self._dir / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self._dir / 'data'}\n"
            f"http:\n  addr: {self.address}\n")
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen([binary, "serve", str(config)], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True,
                                          preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _http_ok(f"http://{self.address}/v2/"):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                text = tail(self.log_path)
                self.__exit__(None, None, None)
                raise ControlPlaneError(f"the local registry did not start at {self.address}"
                                        f"; its log ends with:\n{text}")
            time.sleep(0.1)
        return self

    def reference(self, image: str) -> str:
        """Where an image name is pushed for the mirror to serve it."""
        return f"{self.address}/{repository_path(image)}"

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            _kill_group(self._proc)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
