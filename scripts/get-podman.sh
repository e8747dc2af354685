#!/usr/bin/env bash
# Install podman, runc and busybox-static from the distribution's packages, for the test that checks
# gpushare's container identification on the cgroup of a real container (tests/test_kubernetes.py).
#
# runc rather than crun: crun refuses hybrid cgroup hosts whose v2 hierarchy lists controllers.
# busybox-static: the test builds its image from it, so nothing is pulled from a registry.
#
# Usage: scripts/get-podman.sh   (root, apt-get). Idempotent: exits 0 at once when all are there.
# Exit 0 when the tools are present; non-zero with a message naming the fix otherwise.
set -euo pipefail

say() { printf 'get-podman: %s\n' "$*" >&2; }

missing=()
for tool in podman:podman runc:runc busybox:busybox-static; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    say "podman, runc and busybox are installed; nothing to do"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: cannot install ${missing[*]}; run as root, or apt-get install ${missing[*]} (the podman test will skip)"
    exit 1
fi
command -v apt-get >/dev/null 2>&1 || { say "apt-get not found: install ${missing[*]} with your package manager"; exit 1; }
say "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; } \
    || { say "apt-get install ${missing[*]} failed (see above)"; exit 1; }
say "installed ${missing[*]}"
