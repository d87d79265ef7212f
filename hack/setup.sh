#!/usr/bin/env bash
# Sets up everything the demo and the tests need on a fresh Debian 12 machine (idempotent):
# Debian packages, the project's virtualenv (.venv), the npm packages of the object schema checks
# and the local Kubernetes build (cached in ~/.cache/vlm-operator/k8s/v1.20.2, about 10 minutes
# the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }

say "Debian packages"
hack/install-deps.sh
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
# the three distributions, editable: the operator (with its dev extras), the plugin for vLLM
# engines (operator/plugin) and the test bed (operator/testbed)
say "Python packages (pip install -e '.[dev]' -e operator/plugin -e operator/testbed)"
.venv/bin/pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/pip install -q -e '.[dev]' -e operator/plugin -e operator/testbed 2>&1 \
  | grep -v '^WARNING: Location' || true
say "npm packages for the object schema checks (hack/validate-objects, from its lockfile)"
if [ ! hack/validate-objects/node_modules/.package-lock.json -nt hack/validate-objects/package-lock.json ]; then
  npm ci --prefix hack/validate-objects --no-audit --no-fund --loglevel=error
fi
say "Kubernetes v1.20.2 control plane binaries"
.venv/bin/python -m vlm_testbed.controlplane build
say "setup done"
