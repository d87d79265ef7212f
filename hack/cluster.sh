#!/usr/bin/env bash
# Local Kubernetes v1.20.2 control plane for the demo and tests.
#   hack/cluster.sh build            build/cache the binaries (~10 min the first time)
#   hack/cluster.sh up [--with-project-crd] [--manifest F]...   start in the background
#   hack/cluster.sh down             stop it
#   eval "$(hack/cluster.sh env)"    export KUBECONFIG (and kubectl on PATH)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${ROOT}/.venv/bin/python"
if [ ! -x "$PY" ]; then
  echo "cluster.sh: $PY missing: create the venv first (python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' -e operator/plugin -e operator/testbed)" >&2
  exit 1
fi
case "${1:-}" in
  build|up|down|env) ;;
  *) echo "usage: hack/cluster.sh build|up|down|env [options]" >&2; exit 2 ;;
esac
cd "$ROOT"
exec "$PY" -m vlm_testbed.controlplane "$@"
