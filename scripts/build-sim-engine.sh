#!/usr/bin/env bash
# Compile the simulator's hot module, gpushare/sim/gpu.py, with mypyc into gpushare/sim/_native/.
#
# The compiled module is the same source, type-checked and turned into C: it gives bit-identical
# results several times faster (about 6x on the slowest shipped run), which is what keeps every
# shipped scenario at 10x real time or more (docs/simulator.md section 5). It is optional:
# gpushare.sim.engine loads it only when it was built from the gpu.py now in the tree, and
# otherwise runs the pure-Python source.
#
# Usage: scripts/build-sim-engine.sh [PYTHON]   (default: <repo>/.venv/bin/python)
# Exit 0 when built or already current, and when the machine has no C compiler (said on stderr:
# the simulator then runs in pure Python); non-zero with a message naming the fix otherwise.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$repo/.venv/bin/python}
src="$repo/gpushare/sim/gpu.py"
out="$repo/gpushare/sim/_native"

say() { printf 'build-sim-engine: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

[[ -x "$py" ]] || fail "$py not found: run 'make' (it creates .venv) or pass the Python to build for"
# Absolute, but not through the venv's symlink (the build runs elsewhere and needs the venv's mypyc).
[[ "$py" == /* ]] || py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
digest=$(sha256sum "$src" | cut -d' ' -f1)
suffix=$("$py" -c 'import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])')
if [[ -f "$out/gpu$suffix" && "$(cat "$out/SOURCE_SHA256" 2>/dev/null)" == "$digest" ]]; then
    say "up to date ($out)"
    exit 0
fi
if ! command -v cc >/dev/null 2>&1; then
    say "no C compiler (install gcc): the simulator runs in pure Python, several times slower"
    exit 0
fi
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[[ -f "$include/Python.h" ]] || fail "Python headers missing ($include/Python.h): install python3-dev for this Python"
"$py" -c 'import mypyc' 2>/dev/null || fail "mypyc not found for $py: pip install -e '.[dev]' (mypy provides it)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Built from a copy so the tree gets no build/ directory and no .so next to gpu.py: a stale
# extension there would shadow an edited gpu.py.
mkdir -p "$tmp/gpushare/sim"
cp "$src" "$tmp/gpushare/sim/gpu.py"
touch "$tmp/gpushare/__init__.py" "$tmp/gpushare/sim/__init__.py"
say "compiling gpushare/sim/gpu.py with mypyc (about 10 s)"
if ! (cd "$tmp" && "$py" -m mypyc gpushare/sim/gpu.py) >"$tmp/build.log" 2>&1; then
    tail -n 30 "$tmp/build.log" >&2
    fail "mypyc failed (log above); the simulator still runs in pure Python"
fi
rm -rf "$out.new"
mkdir -p "$out.new"
cp "$tmp"/gpushare/sim/*"$suffix" "$out.new/"
echo "$digest" >"$out.new/SOURCE_SHA256"
rm -rf "$out"
mv "$out.new" "$out"
say "built $(cd "$out" && ls ./*"$suffix" | tr '\n' ' ')in $out"
