#!/usr/bin/env bash
# Regenerates every file derived from the one CRD definition (operator/vlm_operator/api/crd.py).
# Tests fail when these drift; run this after changing the API.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
"$py" -m vlm_operator.cli crd > manifests/crds/serving.vlm-operator.dev_vlmdeployments.yaml
"$py" -m vlm_operator.cli crd --peering > manifests/crds/kopf.dev_peerings.yaml
echo "generated manifests/crds/"

# The Helm chart ships the same CRDs (Helm installs crds/ before templates, never deletes them).
cp manifests/crds/serving.vlm-operator.dev_vlmdeployments.yaml manifests/crds/kopf.dev_peerings.yaml \
  charts/vlm-operator/crds/
echo "generated charts/vlm-operator/crds/"

hack/render-install.sh > manifests/install.yaml
echo "generated manifests/install.yaml"

"$py" -m vlm_operator.api.reference_docs > docs/reference.md
echo "generated docs/reference.md"
