#!/usr/bin/env bash
# Regenerates every file derived from the one CRD definition (operator/vlm_operator/api/crd.py).
# Tests fail when these drift; run this after changing the API.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
# One copy of each CRD, in the chart (Helm installs crds/ before templates, never deletes them);
# manifests/crds/ links to it for `kubectl apply -f manifests/crds/ -f manifests/`.
"$py" -m vlm_operator.cli crd > charts/vlm-operator/crds/serving.vlm-operator.dev_vlmdeployments.yaml
"$py" -m vlm_operator.cli crd --peering > charts/vlm-operator/crds/kopf.dev_peerings.yaml
echo "generated charts/vlm-operator/crds/"

hack/render-install.sh > manifests/install.yaml
echo "generated manifests/install.yaml"

"$py" -m vlm_operator.api.reference_docs > docs/reference.md
echo "generated docs/reference.md"
