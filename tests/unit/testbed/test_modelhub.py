"""The local model hub answers as the Hugging Face Hub does for what huggingface_hub reads to
download a model (a real download by vLLM through it runs in tests/e2e/test_real_vllm.py)."""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

import pytest

from vlm_testbed.modelhub import LFS_FROM_BYTES, ModelHub

REPO = "org/tiny"


@pytest.fixture
def hub(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * (LFS_FROM_BYTES // 256 + 1))
    (tmp_path / ".hidden").write_text("not served")
    with ModelHub({REPO: tmp_path}) as h:
        yield h, tmp_path


def get(url: str, method: str = "GET", headers: dict | None = None):
    with urllib.request.urlopen(urllib.request.Request(url, method=method,
                                                       headers=headers or {})) as rsp:
        return rsp.status, dict(rsp.headers), rsp.read()


def test_the_repo_info_names_its_commit_and_files_and_the_tree_marks_large_files_lfs(hub):
    h, root = hub
    _, _, body = get(f"{h.url}/api/models/{REPO}/revision/main")
    info = json.loads(body)
    assert len(info["sha"]) == 40
    assert sorted(s["rfilename"] for s in info["siblings"]) == ["config.json",
                                                               "model.safetensors"]
    _, _, body = get(f"{h.url}/api/models/{REPO}/tree/{info['sha']}?recursive=True")
    tree = {e["path"]: e for e in json.loads(body)}
    weights = (root / "model.safetensors").read_bytes()
    assert tree["model.safetensors"]["lfs"] == {
        "oid": hashlib.sha256(weights).hexdigest(), "size": len(weights), "pointerSize": 134}
    assert "lfs" not in tree["config.json"]


def test_a_file_resolves_with_the_hub_headers_its_range_and_counts_as_a_fetch(hub):
    h, root = hub
    url = f"{h.url}/{REPO}/resolve/main/model.safetensors"
    status, headers, body = get(url, "HEAD")
    weights = (root / "model.safetensors").read_bytes()
    assert (status, body) == (200, b"")
    assert headers["X-Repo-Commit"] == h.repos[REPO].sha
    assert headers["X-Linked-Etag"] == f'"{hashlib.sha256(weights).hexdigest()}"'
    assert int(headers["Content-Length"]) == len(weights)
    assert h.weight_fetches(REPO) == 0  # a HEAD fetches nothing
    status, headers, body = get(url, headers={"Range": "bytes=10-19"})
    assert (status, body) == (206, weights[10:20])
    assert headers["Content-Range"] == f"bytes 10-19/{len(weights)}"
    assert get(url)[2] == weights
    assert h.weight_fetches(REPO) == 2
    assert h.bytes_sent == 10 + len(weights)


@pytest.mark.parametrize("path,code", [
    ("other/repo/resolve/main/config.json", "RepoNotFound"),
    (f"{REPO}/resolve/v9/config.json", "RevisionNotFound"),
    (f"{REPO}/resolve/main/missing.json", "EntryNotFound"),
    (f"{REPO}/resolve/main/.hidden", "EntryNotFound"),
])
def test_what_the_hub_does_not_hold_is_a_404_with_the_hub_error_code(hub, path, code):
    h, _ = hub
    with pytest.raises(urllib.error.HTTPError) as err:
        get(f"{h.url}/{path}")
    assert (err.value.code, err.value.headers["X-Error-Code"]) == (404, code)
