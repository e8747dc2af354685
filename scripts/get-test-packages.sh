#!/usr/bin/env bash
# Install the Debian packages the integration tests drive for real, when they are missing:
# zsh and fish (the shell-completion tests run the real shells); podman, runc and busybox-static
# (tests/cluster/test_kubernetes.py names a real container from its cgroup: runc because crun refuses
# hybrid cgroup hosts whose v2 hierarchy lists controllers, busybox to build the image locally).
#
# Needs root and apt-get (CI has both); elsewhere it says what is missing and exits 0, and the
# tests that need a missing program skip naming it. Idempotent: nothing is done when all are
# installed, and the package lists are refreshed only when something must be installed.
# Usage: scripts/get-test-packages.sh
set -euo pipefail

# program -> package
declare -A wanted=([zsh]=zsh [fish]=fish [podman]=podman [runc]=runc [busybox]=busybox-static)

missing=()
for prog in "${!wanted[@]}"; do
    command -v "$prog" >/dev/null 2>&1 || missing+=("${wanted[$prog]}")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

say() { printf 'get-test-packages: %s\n' "$*" >&2; }
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    say "not installed: ${missing[*]} (needs root and apt-get: apt-get install ${missing[*]}); the tests that need them skip"
    exit 0
fi
say "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get -qq update && apt-get -qq install -y --no-install-recommends "${missing[@]}"; } >/dev/null; then
    say "apt-get could not install ${missing[*]}; the tests that need them skip"
fi
exit 0
