#!/bin/sh
# Build the shallow-queue interposer gpushare/native/libgpushare_inflight.so (gpushare.native), or
# into the path given as the first argument; how is in gpushare/native/build.py, which
# `gpushare install` and tests/native use too (the tests build their own plain, ASan+UBSan and
# TSan copies: `--sanitize=asan|tsan OUT` makes such a variant by hand, never one to install).
# Without a C compiler this says why and exits 0: shallow-queue clients then fall back to
# CUDA_LAUNCH_BLOCKING=1 and tests/native skips, naming the reason.
set -eu
cd "$(dirname "$0")/.."
# The package imports nothing beyond the standard library here: any Python 3 will do.
PYTHONPATH=. exec "${PYTHON:-python3}" -m gpushare.native.build --strict "$@"
