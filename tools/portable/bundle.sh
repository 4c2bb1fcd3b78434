#!/bin/bash
# `make bundle-portable`: the bundle built inside a Debian 11 (bullseye) root, so that it runs on
# the Linux systems clusters use (glibc 2.28 and newer: Rocky/RHEL 8 and 9, Ubuntu 20.04-24.04), as
# torch 2.11's own wheel does; for x86-64, and for aarch64 (Grace) with the root's cross compiler.
# A bundle carries the C++ runtime of the system it was built on, and that runtime and the binaries
# ask for the C library's symbol versions of that system: Debian 12's need glibc 2.36. Debian 11's
# GCC 10 runtime needs glibc 2.18, and the build keeps the binaries' own needs at or below 2.28
# (TESSEL_GLIBC_COMPAT: glibc_compat.cpp); the install records the floor in
# share/tessel/GLIBC_FLOOR, which bin/* compare with the system's glibc.
#   tools/portable/bundle.sh [CHECKOUT] [x86_64|aarch64]
#     -> CHECKOUT/build/tessel-<commit>-<arch>-glibc<floor>.tar.gz
# The root (TESSEL_CACHE/bullseye-build, about 1 GB) is made once with debootstrap from Debian's
# registry: GCC 10 and its aarch64 cross compiler, yaml-cpp 0.6 (amd64; arm64's -dev in /opt/arm64),
# GoogleTest;
# cmake and ninja from PyPI; the header-only CLI11, nlohmann-json, spdlog and fmt and gloo's
# headers from this machine's Debian release (bullseye has no CLI11), unpacked into /opt/deps.
# LibTorch is this checkout's torch environment (.env) or, for aarch64, the aarch64 wheel that
# tools/cross/aarch64-setup.sh unpacks; both mounted in. Needs root (debootstrap, chroot) and
# debootstrap itself (apt-get install debootstrap): a release machine's job, not a user's. Exits 77
# naming what is missing.
set -euo pipefail
here=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
arch=${2:-x86_64}
cache=${TESSEL_CACHE:-$HOME/.cache/tessel}
root=$cache/bullseye-build
out=$here/build/portable
[ "$arch" = x86_64 ] || out=$here/build/portable-$arch
[ "$(id -u)" -eq 0 ] || { echo "skipped: the portable build needs root (debootstrap and chroot)"; exit 77; }
command -v debootstrap >/dev/null ||
  { echo "skipped: debootstrap not found (apt-get install debootstrap)"; exit 77; }
[ -e "$here/.env" ] || { echo "bundle-portable: no torch environment: run make build first" >&2; exit 2; }
torch_env=$(readlink -f "$here/.env")
stamp=$root/.complete-3
if [ ! -f "$stamp" ]; then
  echo "bundle-portable: making the Debian 11 build root in $root (once; about 2 minutes)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=g++,make,ccache,git,file,python3-venv,libyaml-cpp-dev,libgtest-dev,libgmock-dev \
    bullseye "$root" http://deb.debian.org/debian >"$cache/bullseye-build.log" 2>&1 ||
    { tail -n 20 "$cache/bullseye-build.log"; exit 1; }
  # The host's name resolution and trusted certificates (a proxy's among them) for pip.
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mkdir -p "$root/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  # The aarch64 side: the cross compiler, GoogleTest and yaml-cpp's library for arm64 (multiarch),
  # and yaml-cpp's arm64 -dev package unpacked into /opt/arm64 (it cannot be installed beside the
  # amd64 one; its CMake config names the library where the multiarch package put it).
  chroot "$root" sh -c "dpkg --add-architecture arm64 && apt-get update -q && apt-get install -y -q \
    g++-aarch64-linux-gnu libgtest-dev:arm64 libgmock-dev:arm64 libyaml-cpp0.6:arm64 &&
    mkdir -p /tmp/arm64 && cd /tmp/arm64 && apt-get download -q libyaml-cpp-dev:arm64 &&
    for f in *.deb; do dpkg-deb -x \$f /opt/arm64; done && rm -rf /tmp/arm64" >/dev/null 2>&1
  chroot "$root" python3 -m venv /opt/tools
  chroot "$root" env -u PIP_FIND_LINKS /opt/tools/bin/pip install -q "cmake>=3.25,<4" ninja
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libgloo-dev 2>/dev/null)
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$root/opt/deps"; done
  rm -rf "$debs"
  touch "$stamp"
fi
mkdir -p "$cache/ccache-bullseye" "$out"
mounts=("$here" "$torch_env" "$cache/ccache-bullseye")
configure="-DTorch_DIR=$(echo "$torch_env"/lib/python3*/site-packages/torch/share/cmake/Torch)"
case $arch in
  x86_64) ;;
  aarch64)
    aarch64_root=${TESSEL_AARCH64_ROOT:-$cache/aarch64}
    "$here/tools/cross/aarch64-setup.sh" || exit $?
    mounts+=("$aarch64_root")
    configure="-DCMAKE_TOOLCHAIN_FILE=$here/tools/portable/aarch64.cmake" ;;
  *) echo "bundle-portable: no such architecture: $arch (x86_64 or aarch64)" >&2; exit 2 ;;
esac
# Inside a private mount namespace (the mounts end with it): the checkout, the torch environment
# and the compiler cache at their own paths, then the build as the root's own system would run it.
export here root out cache configure aarch64_root=${aarch64_root:-} mounts_list="${mounts[*]}"
unshare --mount --propagation private bash -euo pipefail -c '
  for d in $mounts_list; do
    mkdir -p "$root$d" && mount --bind "$d" "$root$d"
  done
  mount -t proc proc "$root/proc" && mount --bind /dev "$root/dev"
  chroot "$root" env -i PATH=/opt/tools/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    CCACHE_DIR="$cache/ccache-bullseye" CCACHE_BASEDIR="$here" CCACHE_NOHASHDIR=true \
    CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
    TESSEL_GLOO_INCLUDE=/opt/deps/usr/include TESSEL_AARCH64_ROOT="$aarch64_root" \
    bash -euo pipefail -c "
      cmake -S $here -B $out -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH=/opt/deps/usr -DTESSEL_HEADER_ONLY_LOGGING=ON -DTESSEL_GLIBC_COMPAT=ON \
        $configure >/dev/null
      cmake --build $out -j $(nproc) --target tessel-train tessel-launch tessel-data \
        tessel-bench-comm tessel-bench-cp tessel_cuda tessel-gpu-tests
      rm -rf $out/bundle && cmake --install $out --prefix $out/bundle/tessel >/dev/null"
'
floor=$(cat "$out/bundle/tessel/share/tessel/GLIBC_FLOOR")
name=tessel-$(git -C "$here" rev-parse --short HEAD)-$arch-glibc$floor
tar -C "$out/bundle" -czf "$here/build/$name.tar.gz" tessel
echo "$here/build/$name.tar.gz ($(du -h "$here/build/$name.tar.gz" | cut -f1)): runs on glibc $floor or newer"
