#!/usr/bin/env bash
# The local demo: sets up (first run builds Kubernetes), then runs it. Pass --keep to leave it
# running and get a KUBECONFIG.
set -euo pipefail
cd "$(dirname "$0")/.."
hack/setup.sh
exec .venv/bin/python -m vlm_testbed.demo "$@"
