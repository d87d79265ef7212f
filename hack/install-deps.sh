#!/usr/bin/env bash
# Installs the Debian packages the local Kubernetes test bed needs (build + run), Prometheus and
# promtool for the observability tests, iptables for the tests that drop or reject the
# operator's traffic to a pod (operator/testbed/vlm_testbed/firewall.py), containerd, runc, the CNI plugins and
# iproute2 for the real-node test bed (operator/testbed/vlm_testbed/realnode: a real kubelet on its own
# containerd), buildah, debootstrap and docker-registry for its images (the project's Dockerfiles
# built on stand-in bases and served by a local registry), and npm where there is none (helm and the owners' object schemas come from npm packages).
# Idempotent: skips apt entirely when everything is present.
set -euo pipefail

PKGS=(golang-go etcd-server dpkg-dev openssl rsync make golang-github-modern-go-reflect2-dev xz-utils
      prometheus iptables containerd runc containernetworking-plugins iproute2 buildah debootstrap
      docker-registry)
if ! command -v npm >/dev/null; then
  PKGS+=(nodejs npm)
fi
SRC_FILE=/etc/apt/sources.list.d/vlm-operator-bookworm-src.sources

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

need_src=0
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src .*bookworm' /etc/apt/sources.list; then
  need_src=1
fi

if [ ${#missing[@]} -eq 0 ] && [ $need_src -eq 0 ]; then
  echo "install-deps: all packages present (${PKGS[*]}), deb-src configured"
  exit 0
fi

if [ $need_src -eq 1 ]; then
  echo "install-deps: adding deb-src entry for bookworm in $SRC_FILE"
  $SUDO tee "$SRC_FILE" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

echo "install-deps: apt-get update"
$SUDO apt-get update -q
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  # The tests start their own Prometheus on a free loopback port; the package's service (a
  # server on :9090 scraping this machine) is not wanted where systemd started it.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now prometheus || true
  fi
  # Each real node of the test bed starts a containerd of its own (own root, state and socket);
  # the package's system-wide service is not wanted where systemd started it.
  if [[ " ${missing[*]} " == *" containerd "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now containerd || true
  fi
  # The local registry is started by the test bed on a free loopback port; not the package's.
  if [[ " ${missing[*]} " == *" docker-registry "* ]] && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now docker-registry || true
  fi
fi
echo "install-deps: done"
