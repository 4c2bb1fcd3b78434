#!/usr/bin/env bash
# spdlog and fmt from their headers alone (TESSEL_HEADER_ONLY_LOGGING=1), as on a cluster without
# their packages: in a private mount namespace the system's spdlog and fmt (headers, CMake configs,
# libraries) are hidden after their headers are copied into a folder of their own, named by
# CMAKE_PREFIX_PATH. Without the setting setup's probe must miss them; with it the probe finds them
# and a fresh build folder configures with them. (The portable bundle is built and run this way:
# make test-old-distro.) Needs root or unprivileged user namespaces; else exits 77 (skipped).
set -uo pipefail
root=$(cd "$1" && pwd)
if [ -z "${TESSEL_HEADER_ONLY_INSIDE:-}" ]; then
  userns=(); [ "$(id -u)" -eq 0 ] || userns=(--map-root-user)
  unshare --mount --propagation private "${userns[@]}" true 2>/dev/null ||
    { echo "header_only: skipped: no mount namespace for this user (unshare --mount failed)"; exit 77; }
  exec unshare --mount --propagation private "${userns[@]}" env TESSEL_HEADER_ONLY_INSIDE=1 "$0" "$@"
fi
[ -f /usr/include/spdlog/spdlog.h ] && [ -f /usr/include/fmt/core.h ] ||
  { echo "header_only: skipped: no system spdlog and fmt headers to hide and copy"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/headers/include" && cp -r /usr/include/spdlog /usr/include/fmt "$work/headers/include/"
for d in /usr/include/spdlog /usr/include/fmt /usr/lib/*/cmake/spdlog /usr/lib/*/cmake/fmt; do
  [ -d "$d" ] && mount -t tmpfs none "$d"
done
for f in /usr/lib/*/libspdlog.so* /usr/lib/*/libfmt.so*; do [ -e "$f" ] && mount --bind /dev/null "$f"; done
probe() { cmake -S "$root/third_party/probe" -B "$work/probe-$1" 2>&1 | grep -E "^(found|missing) (spdlog|fmt)$" | sort | tr '\n' ' '; }
without=$(probe plain)
echo "header_only: the system's spdlog and fmt hidden: $without"
[ "$without" = "missing fmt missing spdlog " ] || { echo "header_only: FAILED: they are still found"; exit 1; }
export TESSEL_HEADER_ONLY_LOGGING=1 CMAKE_PREFIX_PATH="$work/headers${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
with=$(probe headers)
echo "header_only: TESSEL_HEADER_ONLY_LOGGING=1: $with"
[ "$with" = "found fmt found spdlog " ] || { echo "header_only: FAILED: the probe misses their headers"; exit 1; }
start=$(date +%s)
if ! cmake -S "$root" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" 2>&1; then
  tail -n 30 "$work/configure.log"; echo "header_only: FAILED: configure with spdlog and fmt as headers only"; exit 1
fi
line=$(grep -- "-- spdlog and fmt header-only:" "$work/configure.log")
echo "$line"
[ "$line" = "-- spdlog and fmt header-only: $work/headers/include, $work/headers/include" ] ||
  { echo "header_only: FAILED: not configured from the copied headers"; exit 1; }
echo "header_only: configured in $(( $(date +%s) - start )) s with spdlog and fmt as headers only"
