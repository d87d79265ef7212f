#!/usr/bin/env bash
# Run the engine-side tokenizer pool tests under each pinned tokenizers venv
# (tok-0.22: "Already borrowed" era; tok-current: rwlock era). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/tokenizer-envs.sh tok-0.22 tok-current
VENVS="${VLM_CACHE:-$HOME/.cache/vlm-operator}/venvs"
rc=0
for env in tok-0.22 tok-current; do
  echo "[test-engine] $env"
  junit=()
  [[ -n "${JUNIT_DIR:-}" ]] && junit=("--junitxml=$JUNIT_DIR/engine-$env.xml")
  PYTHONPATH=operator/plugin "$VENVS/$env/bin/python" -m pytest -p no:cacheprovider \
    tests/engine/test_tokenizer_pool.py "${junit[@]}" "$@" || rc=1
done
exit $rc
