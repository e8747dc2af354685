#!/bin/sh
# Build the shallow-queue interposer gpushare/native/libgpushare_inflight.so (gpushare.native), or
# into the path given as the first argument (tests/native builds its own copy that way).
# Without a C compiler this says why and exits 0: shallow-queue clients then fall back to
# CUDA_LAUNCH_BLOCKING=1 and tests/native skips, naming the reason.
set -eu
cd "$(dirname "$0")/.."
CC="${CC:-cc}"
src=gpushare/native/inflight.c
out="${1:-gpushare/native/libgpushare_inflight.so}"
if ! command -v "$CC" >/dev/null 2>&1; then
    echo "build-native: no C compiler ($CC) on PATH: $out not built (apt-get install gcc)"
    exit 0
fi
# -O2 is load-bearing: dlsym(RTLD_NEXT, ...) must be forwarded as a tail call (see inflight.c).
"$CC" -std=c11 -O2 -fPIC -shared -fvisibility=hidden -Wall -Wextra -Werror \
    -o "$out.tmp" "$src" -ldl -lpthread
mv "$out.tmp" "$out"
echo "build-native: built $out"
