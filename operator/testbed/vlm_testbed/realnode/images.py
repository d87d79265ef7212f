"""Images for a real node without a registry: one-layer docker-archive tarballs written with
tarfile, imported into the node's containerd with `ctr images import`.

- the vLLM stand-in: this machine's Python (at its real path, with the stdlib and the shared
  libraries it loads) and the stand-in's code (vlm_testbed.vllmsim, vllm_tokenizer_pool), with
  `vllm` and `python3` on PATH. `vllm serve <args>` and `python3 -m
  vllm.entrypoints.openai.api_server <args>` both start `python -m vlm_testbed.vllmsim <args>`,
  as the node simulator maps a vllm image's command (nodesim.processes.default_command); it
  binds 0.0.0.0 in the pod's own network namespace.
- the pod sandbox's pause image (vlm-pause, built with the kubelet).

Tarballs are cached by content under the test bed's cache (images/)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from vlm_testbed.controlplane.build import ControlPlaneError, cache_root, node_binary

STANDIN_IMAGES = ("vllm/vllm-openai:v0.20.2", "ghcr.io/vlm-operator/vllm:v0.33.0")
PAUSE_IMAGE = "vlm-testbed.local/pause:1"
APP_DIR = "/opt/vlm"
# Not needed to run the stand-in, and most of the stdlib's size.
STDLIB_SKIP = {"site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
               "lib2to3", "unittest", "pydoc_data", "dist-packages"}
STDLIB_SKIP_PREFIX = ("config-",)

VLLM_SHIM = """#!{python}
# `vllm serve <model> [flags]` -> the vLLM stand-in with the same flags.
import os, sys
args = sys.argv[1:]
if args[:1] == ["serve"]:
    args = args[1:]
os.environ["PYTHONPATH"] = "{app}"
os.execv(sys.executable, [sys.executable, "-m", "vlm_testbed.vllmsim", *args])
"""
API_SERVER_MODULE = """# `python -m vllm.entrypoints.openai.api_server [flags]` -> the stand-in.
import sys
from vlm_testbed.vllmsim.cli import main
main(sys.argv[1:])
"""


class _Layer:
    """A layer tar being written: every path once, parents first, modes readable by all."""

    def __init__(self, fileobj: io.BufferedWriter) -> None:
        self.tar = tarfile.open(  # noqa: SIM115 - closed by close()
            fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT)
        self.seen: set[str] = set()

    def _info(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name.lstrip("/"))
        info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, 0, 0, 0
        return info

    def dir(self, path: str, mode: int = 0o755) -> None:
        path = path.rstrip("/")
        if not path or path in self.seen:
            return
        self.dir(os.path.dirname(path))
        self.seen.add(path)
        self.tar.addfile(self._info(path, tarfile.DIRTYPE, mode))

    def data(self, path: str, data: bytes, mode: int = 0o644) -> None:
        if path in self.seen:
            return
        self.dir(os.path.dirname(path))
        self.seen.add(path)
        info = self._info(path, tarfile.REGTYPE, mode)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))

    def symlink(self, path: str, target: str) -> None:
        if path in self.seen:
            return
        self.dir(os.path.dirname(path))
        self.seen.add(path)
        info = self._info(path, tarfile.SYMTYPE, 0o777)
        info.linkname = target
        self.tar.addfile(info)

    def host(self, path: str) -> None:
        """Add a host path as the host has it: each symlink on the way (/lib -> usr/lib) as a
        symlink, then what it points to; a file with its mode made readable by all."""
        parts = Path(path).parts
        cur = "/"
        for i, part in enumerate(parts[1:], start=1):
            cur = os.path.join(cur, part)
            if os.path.islink(cur):
                target = os.readlink(cur)
                self.symlink(cur, target)
                rest = os.path.join(os.path.dirname(cur), target, *parts[i + 1:])
                self.host(os.path.normpath(rest))
                return
        if os.path.isdir(path):
            self.dir(path)
            return
        if path in self.seen:
            return
        mode = os.stat(path).st_mode & 0o777 | 0o444
        with open(path, "rb") as f:
            self.data(path, f.read(), mode | (0o111 if mode & 0o100 else 0))

    def tree(self, root: str, skip: Iterable[str] = (), skip_prefix: Sequence[str] = ()) -> None:
        skip = set(skip)
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath == root:
                dirnames[:] = [d for d in dirnames if d not in skip
                               and not d.startswith(tuple(skip_prefix))]
            self.dir(dirpath)
            for name in sorted(filenames):
                if name in skip and dirpath == root:
                    continue
                self.host(os.path.join(dirpath, name))

    def close(self) -> None:
        self.tar.close()


def shared_libraries(paths: Iterable[str]) -> set[str]:
    """What ldd lists for these binaries (paths as the loader looks them up)."""
    found: set[str] = set()
    for p in paths:
        out = subprocess.run(["ldd", p], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
            if m:
                found.add(m.group(1))
    return found


def _docker_archive(out: Path, layer_path: Path, tags: Sequence[str], config: dict) -> None:
    h = hashlib.sha256()
    with open(layer_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    diff_id = h.hexdigest()
    cfg = {"architecture": "amd64", "os": "linux", "config": config,
           "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
           "history": [{"created_by": "vlm_testbed.realnode.images"}]}
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    cfg_name = hashlib.sha256(cfg_bytes).hexdigest() + ".json"
    manifest = [{"Config": cfg_name, "RepoTags": list(tags), "Layers": [f"{diff_id}/layer.tar"]}]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    with tarfile.open(tmp, "w") as t:
        for name, data in ((cfg_name, cfg_bytes), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        t.add(layer_path, f"{diff_id}/layer.tar")
    tmp.rename(out)


def _sources_digest(roots: Iterable[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root.parent)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _own_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _images_dir() -> Path:
    d = cache_root() / "images"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _drop_older(out: Path, prefix: str) -> None:
    """Keep one tarball per image: the one just written (an older one is of other content)."""
    for old in out.parent.glob(f"{prefix}-*.tar"):
        if old != out:
            old.unlink(missing_ok=True)


def standin_image(tags: Sequence[str] = STANDIN_IMAGES) -> Path:
    """The stand-in image's docker-archive (built once per content, then cached)."""
    import vllm_tokenizer_pool
    import vlm_testbed

    testbed = Path(vlm_testbed.__file__).parent
    plugin = Path(vllm_tokenizer_pool.__file__).parent
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = sysconfig.get_paths()["stdlib"]
    if not os.path.realpath(stdlib).startswith(prefix):
        stdlib = os.path.join(prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    key = _sources_digest([testbed / "vllmsim", testbed / "data", plugin],
                          f"{python} {sys.version} {sorted(tags)} {_own_digest()}")
    out = _images_dir() / f"vllm-standin-{key}.tar"
    if out.is_file():
        return out
    dynload = os.path.join(stdlib, "lib-dynload")
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".layer") as layer_file:
        layer = _Layer(layer_file)  # type: ignore[arg-type]
        for d in ("/tmp", "/home/vllm"):
            layer.dir(d, 0o1777)
        layer.data("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"
                   b"vllm:x:10001:10001:vllm:/home/vllm:/bin/sh\n")
        layer.data("/etc/group", b"root:x:0:\nvllm:x:10001:\n")
        layer.host(python)
        layer.tree(stdlib, STDLIB_SKIP, STDLIB_SKIP_PREFIX)
        so_files = [os.path.join(dynload, n) for n in os.listdir(dynload) if n.endswith(".so")]
        for lib in sorted(shared_libraries([python, *so_files])):
            layer.host(lib)
        layer.symlink("/usr/local/bin/python3", python)
        layer.symlink("/usr/local/bin/python", python)
        layer.data("/usr/local/bin/vllm",
                   VLLM_SHIM.format(python=python, app=APP_DIR).encode(), 0o755)
        for src, dst in ((testbed / "vllmsim", f"{APP_DIR}/vlm_testbed/vllmsim"),
                         (testbed / "data", f"{APP_DIR}/vlm_testbed/data"),
                         (plugin, f"{APP_DIR}/vllm_tokenizer_pool")):
            for p in sorted(src.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    layer.data(f"{dst}/{p.relative_to(src)}", p.read_bytes())
        layer.data(f"{APP_DIR}/vlm_testbed/__init__.py", b"")
        for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/openai"):
            layer.data(f"{APP_DIR}/{pkg}/__init__.py", b"")
        layer.data(f"{APP_DIR}/vllm/entrypoints/openai/api_server.py", API_SERVER_MODULE.encode())
        layer.close()
        layer_file.flush()
        config = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", f"PYTHONPATH={APP_DIR}",
                          "PYTHONDONTWRITEBYTECODE=1"],
                  "Entrypoint": ["vllm", "serve"], "WorkingDir": "/",
                  "ExposedPorts": {"8000/tcp": {}}}
        _docker_archive(out, Path(layer_file.name), tags, config)
    _drop_older(out, "vllm-standin")
    return out


def pause_image() -> Path:
    """The sandbox image: /pause (vlm-pause from the node binaries) and nothing else."""
    pause = node_binary("vlm-pause")
    key = hashlib.sha256(pause.read_bytes()).hexdigest()[:16]
    out = _images_dir() / f"pause-{key}.tar"
    if out.is_file():
        return out
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".layer") as layer_file:
        layer = _Layer(layer_file)  # type: ignore[arg-type]
        layer.data("/pause", pause.read_bytes(), 0o755)
        layer.close()
        layer_file.flush()
        _docker_archive(out, Path(layer_file.name), [PAUSE_IMAGE],
                        {"Entrypoint": ["/pause"], "WorkingDir": "/"})
    _drop_older(out, "pause")
    return out


def import_image(tarball: Path, socket: Path, log: Path) -> None:
    """`ctr -n k8s.io images import` into the containerd at `socket` (unpacked for overlayfs)."""
    cmd = ["ctr", "--address", str(socket), "-n", "k8s.io", "images", "import",
           "--snapshotter", "overlayfs", str(tarball)]
    with open(log, "ab") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    if r.returncode != 0:
        from vlm_testbed.controlplane import tail

        raise ControlPlaneError(f"importing {tarball.name} failed (exit {r.returncode}); "
                                f"{log} ends with:\n{tail(log)}")
