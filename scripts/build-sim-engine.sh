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
# loader itself, so that the script and the loader cannot disagree: the repo's copy (run from the
# repo, which comes first on sys.path), whatever the Python has installed.
engine() { (cd "$repo" && PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "from gpushare.sim import engine; $1" "${@:2}"); }
engine 'pass' || fail "$py cannot import gpushare.sim.engine from $repo (above): it needs Python 3.10 or later"
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
# What `python -m mypyc FILES` (mypyc.build.mypycify) does, with the same C flags, except for the
# group's name: left to mypycify, a group of several modules is named after a hash and its shared
# library goes to the top level, where the package's _native/ directory cannot serve it; named
# through mypycify's `separate`, the build loses mypyc's global optimisations (every method call
# through the vtable instead of a direct C call, measurably slower). So this calls the two steps
# mypycify is made of (mypy 1.13, pinned in pyproject.toml) with the group named gpushare.sim.gpu.
cat >"$tmp/setup.py" <<PY
from mypyc.build import build_using_shared_lib, mypyc_build, setup_mypycify_vars
from mypyc.options import CompilerOptions
from setuptools import setup

paths = "${paths[*]}".split()
options = CompilerOptions()
assert options.global_opts and options.include_runtime_files
groups, cfiles = mypyc_build(paths, options, separate=[(paths, "$group")])
setup_mypycify_vars()
# mypycify's flags for a Unix C compiler at its default levels (-O3, -g1).
cflags = [
    "-O3", "-g1", "-Werror", "-Wno-unused-function", "-Wno-unused-label",
    "-Wno-unreachable-code", "-Wno-unused-variable", "-Wno-unused-command-line-argument",
    "-Wno-unknown-warning-option", "-Wno-unused-but-set-variable",
    "-Wno-ignored-optimization-argument", "-Wno-cpp",
]
[(sources, group)] = groups
[(files, deps)] = cfiles
setup(
    name="gpushare-sim-engine",
    ext_modules=build_using_shared_lib(sources, group, files, deps, options.target_dir, cflags),
)
PY
say "compiling ${paths[*]} with mypyc (about 10 s)"
if ! (cd "$tmp" && "$py" setup.py build_ext --inplace) >"$tmp/build.log" 2>&1; then
    tail -n 30 "$tmp/build.log" >&2
    fail "mypyc failed (log above); the simulator still runs in pure Python"
fi
built=()
for name in "$shared" "${modules[@]}"; do
    [[ -f "$tmp/gpushare/sim/$name$suffix" ]] ||
        fail "mypyc made no gpushare/sim/$name$suffix; the simulator still runs in pure Python"
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
# Swapped by two renames, so a simulator starting meanwhile finds the old build, none (and runs the
# source), or the new one, never a part of one.
rm -rf "$out.old"
[[ ! -e "$out" ]] || mv "$out" "$out.old"
mv "$out.new" "$out"
rm -rf "$out.old"
say "built ${built[*]} in $out"
