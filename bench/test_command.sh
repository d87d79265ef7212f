#!/usr/bin/env bash
# The test command's time from a fresh clone: clones this checkout's HEAD into a new folder, runs
# `bash .ci/run` there and prints its phases (.test-results/phases.txt) with the wall time.
#
#   bench/test_command.sh [--nothing-cached] [DEST]
#
# --nothing-cached first removes everything the test command installs or builds on this
# machine, as on CI's fresh machine: ~/.cache (the Kubernetes build, the engine venvs, the tiny
# models, pip's and vLLM's caches), ~/.npm, and the Debian packages hack/install-deps.sh adds
# (with their dependencies and apt's downloads). Destructive: for a machine of its own.
# Results: bench/results/test-command.md.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
wipe=0
if [[ "${1:-}" == "--nothing-cached" ]]; then wipe=1; shift; fi
DEST="${1:-$(mktemp -d /tmp/test-command.XXXXXX)/clone}"

if (( wipe )); then
  echo "[test-command] removing ~/.cache, ~/.npm and the test bed's Debian packages"
  rm -rf "$HOME/.cache" "$HOME/.npm"
  SUDO=""; [[ "$(id -u)" != 0 ]] && SUDO="sudo"
  # hack/install-deps.sh's PKGS less those a Debian 12 image ships (dpkg-dev, openssl, make,
  # xz-utils, iproute2: removing them would take more than the test command ever installed)
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get purge -y -q golang-go etcd-server rsync \
    golang-github-modern-go-reflect2-dev prometheus iptables containerd runc \
    containernetworking-plugins buildah debootstrap docker-registry >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get autoremove -y -q >/dev/null
  $SUDO apt-get clean
  $SUDO rm -f /etc/apt/sources.list.d/vlm-operator-bookworm-src.sources
fi

git clone -q "$ROOT" "$DEST" || exit 1
# CI's clone has a copy of shared/ beside it (the seeds' logs and CRDs some tests read)
if [[ -d "$ROOT/../shared" && ! -e "$DEST/../shared" ]]; then
  ln -s "$(cd "$ROOT/../shared" && pwd)" "$DEST/../shared"
fi
cd "$DEST" || exit 1
echo "[test-command] $(git log --oneline -1 | cut -c1-80) in $DEST"
start=$SECONDS
bash .ci/run >test-command.log 2>&1
rc=$?
echo "[test-command] rc=$rc after $((SECONDS - start)) s; log $DEST/test-command.log"
cat .test-results/phases.txt
tail -n 1 test-command.log
exit $rc
