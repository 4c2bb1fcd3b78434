#!/bin/sh
# Tessel's CPU loops (core/kernels) built for aarch64 (Grace) with Debian's cross compiler and run
# under qemu-user: the portable loops the aarch64 build carries (no x86 intrinsics; the compiler
# vectorises them for NEON) within their error bounds, as the x86-64 build's AVX2 loops are.
# Exit 77 (ctest: skipped) where the cross compiler or qemu is missing:
#   apt-get install g++-aarch64-linux-gnu qemu-user
# Usage: tests/cross/aarch64.sh [OUT_DIR]
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${TMPDIR:-/tmp}/tessel-cross-$$}
mkdir -p "$out"
cxx=aarch64-linux-gnu-g++
for tool in "$cxx" qemu-aarch64; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "skipped: $tool not found (apt-get install g++-aarch64-linux-gnu qemu-user)"
    exit 77
  fi
done
sources="tests/cross/kernels_check.cpp core/kernels/activation_kernels.cpp
  core/kernels/softmax_kernels.cpp core/kernels/norm_kernels.cpp"
flags="-std=c++17 -O3 -fopenmp -fno-trapping-math -Wall -Wextra -Werror -I$root"
cd "$root"
# shellcheck disable=SC2086
"${CXX:-g++}" $flags $sources -o "$out/kernels_check.x86_64"
# shellcheck disable=SC2086
"$cxx" $flags $sources -o "$out/kernels_check.aarch64"
echo "== x86-64"
"$out/kernels_check.x86_64"
echo "== aarch64 (qemu-user)"
# Debian's cross toolchain keeps the aarch64 C library under /usr/aarch64-linux-gnu.
qemu-aarch64 -L "${QEMU_LD_PREFIX:-/usr/aarch64-linux-gnu}" "$out/kernels_check.aarch64"
if command -v aarch64-linux-gnu-objdump >/dev/null 2>&1; then
  "$cxx" $flags -c core/kernels/activation_kernels.cpp -o "$out/activation_kernels.o"
  lanes=$(aarch64-linux-gnu-objdump -d "$out/activation_kernels.o" | grep -cE '\s(fmla|fmul|fadd|fdiv)\s+v[0-9]+\.4s' || true)
  echo "aarch64 activation loops: $lanes four-lane NEON float instructions"
  [ "$lanes" -gt 0 ]
fi
rm -rf "$out"
