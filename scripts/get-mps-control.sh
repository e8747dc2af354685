#!/usr/bin/env bash
# Put NVIDIA's real MPS control daemon (Debian non-free package nvidia-cuda-mps) into .cache/mps/
# without root and without touching the system's apt configuration.
#
# The binaries run without a GPU or driver (docs/mps.md), which lets the test suite
# drive the real nvidia-cuda-mps-control instead of a fake.
#
# Usage: scripts/get-mps-control.sh [CACHE_DIR]   (default: <repo>/.cache/mps)
# Exit 0 when a usable binary is on PATH or in the cache; non-zero with a message naming the fix.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${1:-$repo/.cache/mps}
control="$cache/root/usr/bin/nvidia-cuda-mps-control"
server="$cache/root/usr/sbin/nvidia-cuda-mps-server"

say() { printf 'get-mps-control: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

if [[ -z "${GPUSHARE_FORCE_MPS_FETCH:-}" ]] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    say "system binary found at $(command -v nvidia-cuda-mps-control); nothing to fetch"
    exit 0
fi
if [[ -x "$control" && -x "$server" ]]; then
    say "already present in $cache"
    exit 0
fi

command -v apt-get >/dev/null 2>&1 || fail "apt-get not found: install nvidia-cuda-mps from your distribution (Debian non-free) or put nvidia-cuda-mps-control on PATH"
command -v dpkg >/dev/null 2>&1 || fail "dpkg not found: needed to unpack the .deb"

# The archive URI and suite the host already uses, skipping the security archive.
uri=""
suite=""
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r "$f" ]] || continue
    while read -r type u s _; do
        [[ "$type" == deb && "$u" != *security* ]] || continue
        uri=$u; suite=$s; break 2
    done < <(grep -E '^\s*deb\s' "$f" | sed -E 's/\[[^]]*\]//')
done
if [[ -z "$uri" ]]; then
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -r "$f" ]] || continue
        u=$(awk '/^URIs:/ {print $2; exit}' "$f")
        s=$(awk '/^Suites:/ {print $2; exit}' "$f")
        [[ -n "$u" && "$u" != *security* && "$u" == *debian* ]] || continue
        uri=$u; suite=$s; break
    done
fi
[[ -n "$uri" ]] || fail "no Debian archive found in /etc/apt sources; install nvidia-cuda-mps by hand or put nvidia-cuda-mps-control on PATH"
suite=${suite%%-*}   # bookworm-updates -> bookworm

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/parts"
echo "deb $uri $suite non-free" > "$work/sources.list"
apt_opts=(
    -o "Dir::Etc::SourceList=$work/sources.list"
    -o "Dir::Etc::SourceParts=$work/parts"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::Cache=$work/cache"
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=$(id -un)"
    -qq
)
say "fetching nvidia-cuda-mps from $uri $suite non-free"
apt-get "${apt_opts[@]}" update >&2 || fail "apt-get update failed against $uri (no network to the Debian archive?)"
(cd "$work" && apt-get "${apt_opts[@]}" download nvidia-cuda-mps >&2) \
    || fail "apt-get download nvidia-cuda-mps failed: the package exists only for amd64/arm64/ppc64el in Debian non-free"
deb=$(ls "$work"/nvidia-cuda-mps_*.deb 2>/dev/null | head -n1)
[[ -n "$deb" ]] || fail "download produced no .deb"
rm -rf "$cache/root.tmp"
mkdir -p "$cache"
dpkg -x "$deb" "$cache/root.tmp" || fail "dpkg -x failed on $deb"
rm -rf "$cache/root"
mv "$cache/root.tmp" "$cache/root"
[[ -x "$control" && -x "$server" ]] || fail "package unpacked but binaries missing under $cache/root"
say "installed $(basename "$deb") into $cache"
