#!/usr/bin/env bash
# Create (idempotently, cached) the version-pinned venvs the tokenizer pool tests and bench use:
#   tok-0.22    tokenizers 0.22.2 + transformers 4.57.6 ("Already borrowed" era)
#   tok-current tokenizers 0.23.3 + transformers 5.x    (rwlock era: silent wrong results)
# and extract vLLM's own tokenizer pool source (vllm/tokenizers/hf.py from the vllm wheel, fetched
# with `pip download --no-deps`, never installed) for bench/tokenizer_pool.py.
# Usage: hack/tokenizer-envs.sh [tok-0.22|tok-current|vllm-src ...]   (default: all three)
set -euo pipefail
CACHE="${VLM_CACHE:-$HOME/.cache/vlm-operator}"
ROOT="$CACHE/venvs"
PY="${PYTHON:-python3}"
VLLM_VERSION="${VLLM_VERSION:-0.24.0}"
mkdir -p "$ROOT"

spec() {
  case "$1" in
    tok-0.22) echo "tokenizers==0.22.2 transformers==4.57.6 pytest hypothesis psutil jinja2" ;;
    tok-current) echo "tokenizers==0.23.3 transformers>=5,<6 pytest hypothesis psutil jinja2" ;;
    *) echo "unknown env $1" >&2; return 1 ;;
  esac
}

make_env() {
  local name="$1" dir="$ROOT/$1" want
  want="$(spec "$name")"
  if [[ -x "$dir/bin/python" && -f "$dir/.vlm-spec" && "$(cat "$dir/.vlm-spec")" == "$want" ]]; then
    echo "[tokenizer-envs] $name: cached at $dir"
    return 0
  fi
  echo "[tokenizer-envs] $name: creating $dir ($want)"
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  # shellcheck disable=SC2086
  "$dir/bin/pip" install -q $want 2>&1 | grep -v "^WARNING: Location" || true
  "$dir/bin/python" -c 'import tokenizers, transformers as t; print("[tokenizer-envs] tokenizers", tokenizers.__version__, "transformers", t.__version__)' 2>&1 | grep tokenizer-envs
  echo "$want" >"$dir/.vlm-spec"
}

vllm_src() {
  local dest="$CACHE/vllm-src/$VLLM_VERSION" wheels="$CACHE/wheels"
  if [[ -f "$dest/vllm/tokenizers/hf.py" ]]; then
    echo "[tokenizer-envs] vllm $VLLM_VERSION hf.py: cached at $dest"
    return 0
  fi
  echo "[tokenizer-envs] vllm $VLLM_VERSION: downloading the wheel (no deps) to $wheels"
  mkdir -p "$wheels" "$dest"
  ls "$wheels"/vllm-"$VLLM_VERSION"-*.whl >/dev/null 2>&1 ||
    "$PY" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$wheels" 2>&1 | grep -v "^WARNING: Location" || true
  "$PY" - "$wheels" "$VLLM_VERSION" "$dest" <<'PYEOF'
import glob, sys, zipfile
wheels, version, dest = sys.argv[1:]
(whl,) = glob.glob(f"{wheels}/vllm-{version}-*.whl")
with zipfile.ZipFile(whl) as z:
    z.extract("vllm/tokenizers/hf.py", dest)
print("[tokenizer-envs] extracted vllm/tokenizers/hf.py from", whl)
PYEOF
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(tok-0.22 tok-current vllm-src)
for t in "${targets[@]}"; do
  if [[ "$t" == vllm-src ]]; then vllm_src; else make_env "$t"; fi
done
