#!/usr/bin/env bash
# Regenerates every file derived from the one CRD definition (operator/vlm_operator/crd.py).
# Tests fail when these drift; run this after changing the API.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m vlm_operator.cli crd > manifests/crds/serving.vlm-operator.dev_vlmdeployments.yaml
"$py" -m vlm_operator.cli crd --peering > manifests/crds/kopf.dev_peerings.yaml
echo "generated manifests/crds/"
