#!/usr/bin/env bash
# Install a single-node Slurm's parts from the distribution's packages: slurmctld, slurmd, the
# client commands (sbatch, srun, scontrol), munge, and slurmdbd with MariaDB for accounting. The test suite starts its own cluster from
# them under a temporary directory (tests/support/slurm_cluster.py); nothing here configures or starts a
# service, and the packages' own units are not started (policy-rc.d or no systemd).
#
# Usage: scripts/get-slurm.sh   (root, apt-get). Idempotent: exits 0 at once when all are there.
# Exit 0 when the binaries are present; non-zero with a message naming the fix otherwise.
set -euo pipefail

say() { printf 'get-slurm: %s\n' "$*" >&2; }

missing=()
# slurmdbd and MariaDB: accounting, without which a job has no QOS (tests/cluster/test_slurm_qos.py).
for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge slurmdbd:slurmdbd mariadbd:mariadb-server; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || [[ -x "/usr/sbin/${tool%%:*}" ]] || missing+=("${tool#*:}")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    say "slurmctld, slurmd, slurm-client, munge, slurmdbd and mariadb-server are installed; nothing to do"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: cannot install ${missing[*]}; run as root, or apt-get install ${missing[*]} (the Slurm tests will skip)"
    exit 1
fi
command -v apt-get >/dev/null 2>&1 || { say "apt-get not found: install ${missing[*]} with your package manager"; exit 1; }
say "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Package scripts would start the daemons where systemd runs: the test suite starts its own.
policy=/usr/sbin/policy-rc.d
made_policy=""
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
trap '[[ -n "$made_policy" ]] && rm -f "$policy"' EXIT
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
    || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; } \
    || { say "apt-get install ${missing[*]} failed (see above)"; exit 1; }
say "installed ${missing[*]}"
