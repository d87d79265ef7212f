#!/usr/bin/env bash
# Sets up everything and runs every test: lint, unit, e2e on the local Kubernetes control plane,
# and the engine tests under real tokenizers and real vLLM releases (each in its own cached
# venv). Prints one closing line with the totals; exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
say() { printf '\n[test %(%H:%M:%S)T] %s\n' -1 "$*"; }

hack/setup.sh || { echo "setup failed"; exit 1; }
results=.test-results
rm -rf "$results" && mkdir -p "$results"
export JUNIT_DIR="$PWD/$results"
rc=0

say "ruff"
.venv/bin/ruff check operator tests bench || rc=1

say "unit and e2e tests (real kube-apiserver, simulated nodes)"
.venv/bin/pytest tests/unit tests/e2e -p no:cacheprovider --junitxml="$results/main.xml" || rc=1

say "engine tests: the tokenizer pool under tokenizers 0.22.2 and current"
hack/test-engine.sh || rc=1

say "engine tests: the vLLM plugin against real vLLM releases"
hack/test-engine-vllm.sh || rc=1

.venv/bin/python hack/junit_total.py "$results"/*.xml || rc=1
exit $rc
