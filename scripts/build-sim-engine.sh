#!/usr/bin/env bash
# Compile the simulator's GPU model (the modules gpushare.sim.engine.COMPILED names: gpu.py,
# events.py, dispatch.py, waves.py, timeslice.py) with mypyc into gpushare/sim/_native/.
#
# The compiled modules are the same source, type-checked and turned into C: they give
# bit-identical results several times faster (about 6x on the slowest shipped run), which is what
# keeps every shipped scenario at 10x real time or more (docs/simulator.md section 5). They are
# compiled in one mypyc invocation, as one group: one shared library (gpu__mypyc) holds all their
# code, so that calls from one module to another stay native C calls, and each module gets a small
# extension that loads it. It is optional: gpushare.sim.engine loads the build only when it is
# complete and was built from the sources now in the tree (the SHA-256 of each, in
# _native/SOURCE_SHA256), and otherwise runs the pure-Python source.
#
# Usage: scripts/build-sim-engine.sh [PYTHON]   (default: <repo>/.venv/bin/python)
# Exit 0 when built or already current, and when the machine has no C compiler (said on stderr:
# the simulator then runs in pure Python); non-zero with a message naming the fix otherwise.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-$repo/.venv/bin/python}
out="$repo/gpushare/sim/_native"

say() { printf 'build-sim-engine: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

[[ -x "$py" ]] || fail "$py not found: run 'make' (it creates .venv) or pass the Python to build for"
# Absolute, but not through the venv's symlink (the build runs elsewhere and needs the venv's mypyc).
[[ "$py" == /* ]] || py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"
# The module list, the build record and "is the build current" come from gpushare.sim.engine, the
# loader itself, so that the script and the loader cannot disagree. The repo's copy, whatever the
# Python has installed.
engine() { PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "from gpushare.sim import engine; $1" "${@:2}"; }
engine 'pass' 2>/dev/null || fail "$py cannot import gpushare.sim.engine from $repo: is it Python 3.10 or later?"
if [[ "$(engine 'print(engine.choose(env={}).kind)')" == compiled ]]; then
    say "up to date ($out)"
    exit 0
fi
read -r -a modules <<<"$(engine 'print(*engine.COMPILED)')"
group=$(engine 'print(engine.GROUP)')
shared=$(engine 'print(engine.SHARED_LIB)')
if ! command -v cc >/dev/null 2>&1; then
    say "no C compiler (install gcc): the simulator runs in pure Python, several times slower"
    exit 0
fi
include=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
[[ -f "$include/Python.h" ]] || fail "Python headers missing ($include/Python.h): install python3-dev for this Python"
"$py" -c 'import mypyc, setuptools' 2>/dev/null || fail "mypyc or setuptools not found for $py: pip install -e '.[dev]' (mypy provides mypyc)"
suffix=$("$py" -c 'import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])')

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Built from a copy so the tree gets no build/ directory and no .so next to the sources: a stale
# extension there would shadow an edited source.
mkdir -p "$tmp/gpushare/sim"
paths=()
for m in "${modules[@]}"; do
    cp "$repo/gpushare/sim/$m.py" "$tmp/gpushare/sim/$m.py"
    paths+=("gpushare/sim/$m.py")
done
touch "$tmp/gpushare/__init__.py" "$tmp/gpushare/sim/__init__.py"
# What `python -m mypyc FILES` does (same optimisation and debug levels), with the group named:
# left unnamed, a group of several modules gets a hash for a name and its shared library goes to
# the top level, where the package's _native/ directory cannot serve it.
cat >"$tmp/setup.py" <<PY
from setuptools import setup
from mypyc.build import mypycify

paths = "${paths[*]}".split()
setup(
    name="gpushare-sim-engine",
    ext_modules=mypycify(paths, opt_level="3", debug_level="1", separate=[(paths, "$group")]),
)
PY
say "compiling ${paths[*]} with mypyc (about 20 s)"
if ! (cd "$tmp" && "$py" setup.py build_ext --inplace) >"$tmp/build.log" 2>&1; then
    tail -n 30 "$tmp/build.log" >&2
    fail "mypyc failed (log above); the simulator still runs in pure Python"
fi
built=()
for name in "$shared" "${modules[@]}"; do
    [[ -f "$tmp/gpushare/sim/$name$suffix" ]] || fail "mypyc made no gpushare/sim/$name$suffix (made: $(cd "$tmp" && find . -name "*$suffix" | tr '\n' ' ')); the simulator still runs in pure Python"
    built+=("$name$suffix")
done
# The build loads as the GPU model, every module compiled, before it replaces anything.
(cd "$tmp" && PYTHONPATH="$tmp" "$py" -c '
import importlib, sys
bad = [m for m in sys.argv[1:] if importlib.import_module("gpushare.sim." + m).__file__.endswith(".py")]
sys.exit(f"not compiled: {bad}" if bad else 0)' "${modules[@]}") ||
    fail "the build does not load (above); the simulator still runs in pure Python"
rm -rf "$out.new"
mkdir -p "$out.new"
for f in "${built[@]}"; do cp "$tmp/gpushare/sim/$f" "$out.new/"; done
# The record of the copies that were compiled, not of the tree (which may have changed since).
engine 'import sys; from pathlib import Path; print(engine.record(Path(sys.argv[1])), end="")' \
    "$tmp/gpushare/sim" >"$out.new/SOURCE_SHA256"
rm -rf "$out"
mv "$out.new" "$out"
say "built ${built[*]} in $out"
