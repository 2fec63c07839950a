#!/usr/bin/env bash
# Install podman (and runc) for the container sandbox backend (megatron_tsync/rollout/sandbox/container.py).
#
#   bash tools/install_podman.sh      # no-op when podman (and, where needed, runc) is already there; prints
#                                     # 'podman version X' on stdout, logs on stderr; exit 1 when it cannot install
#
# Debian/Ubuntu, root: apt-get install --no-install-recommends podman runc catatonit (Debian 12: podman 4.3.1,
# runc 1.1.5, crun 1.8.1, catatonit 0.1.7: the --init of each container). runc is needed on machines with a
# cgroup v1 + v2 "hybrid" hierarchy (crun refuses those); the backend picks it by itself there. Nothing is started: rootful podman needs no daemon, no image is pulled (the
# backend's default root filesystem is the host's /usr, /etc, /opt bound read-only).
set -euo pipefail

log() { echo "[install_podman] $*" >&2; }
die() { log "error: $*"; exit 1; }

need_runc() { grep -q . /sys/fs/cgroup/unified/cgroup.controllers 2>/dev/null; }  # hybrid: v2 has controllers

if command -v podman >/dev/null && [ -x /usr/libexec/podman/catatonit ] \
   && { ! need_runc || command -v runc >/dev/null; }; then
  podman --version
  exit 0
fi
[ "$(id -u)" = 0 ] || die "podman is not installed and installing it needs root"
command -v apt-get >/dev/null || die "podman is not installed and there is no apt-get to install it"
log "installing podman runc catatonit (apt, --no-install-recommends)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null || die "apt-get update failed"
apt-get install -y -q --no-install-recommends podman runc catatonit >/dev/null \
  || die "apt-get install podman runc catatonit failed"
podman --version
