#!/usr/bin/env bash
# Install Debian's python3-torch (a CPU build of PyTorch for the system Python) for
# tests/daemon/test_e2e_torch_restart.py, which runs examples/train_checkpoint.py for real as an
# offline client that gpushare restarts. PyPI's default wheel pulls the CUDA libraries (GBs); the
# Debian package is a CPU build. It is large all the same (about 180 packages with
# --no-install-recommends: OpenCV, GDAL and Qt come with libtorch), see docs/adoption.md.
#
# Usage: scripts/get-torch.sh   (root, apt-get). Idempotent: exits 0 at once when torch imports.
# Exit 0 when /usr/bin/python3 can import torch; non-zero with a message naming the fix otherwise.
set -euo pipefail

say() { printf 'get-torch: %s\n' "$*" >&2; }

if /usr/bin/python3 -c 'import torch' >/dev/null 2>&1; then
    say "python3-torch is installed; nothing to do"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: cannot install python3-torch; run as root, or apt-get install python3-torch (the PyTorch restart test will skip)"
    exit 1
fi
command -v apt-get >/dev/null 2>&1 || { say "apt-get not found: install python3-torch with your package manager"; exit 1; }
say "installing python3-torch"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends python3-torch >&2 \
    || { apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends python3-torch >&2; } \
    || { say "apt-get install python3-torch failed (see above)"; exit 1; }
say "installed python3-torch"
