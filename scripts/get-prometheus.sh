#!/usr/bin/env bash
# Install a Prometheus server and promtool from the distribution's packages, for the test that
# scrapes a simulated daemon and evaluates the dashboard's queries, docs/metrics.md's examples
# and deploy/prometheus/gpushare-rules.yml through the real HTTP API (tests/test_prometheus_real.py),
# and for `promtool check rules`. Nothing here configures or starts the package's service: the test
# starts its own server on loopback under a temporary directory (policy-rc.d or no systemd).
#
# Usage: scripts/get-prometheus.sh   (root, apt-get). Idempotent: exits 0 at once when both are there.
# Exit 0 when the binaries are present; non-zero with a message naming the fix otherwise.
set -euo pipefail

say() { printf 'get-prometheus: %s\n' "$*" >&2; }

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    say "prometheus and promtool are installed; nothing to do"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: cannot install prometheus; run as root, or apt-get install prometheus (the real-Prometheus test will skip)"
    exit 1
fi
command -v apt-get >/dev/null 2>&1 || { say "apt-get not found: install prometheus (server and promtool) with your package manager"; exit 1; }
say "installing prometheus"
export DEBIAN_FRONTEND=noninteractive
# The package's scripts would start its service where systemd runs: the test starts its own.
policy=/usr/sbin/policy-rc.d
made_policy=""
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[[ -n "$made_policy" ]] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends prometheus >&2 \
    || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends prometheus >&2; } \
    || { say "apt-get install prometheus failed (see above)"; exit 1; }
say "installed prometheus"
