#!/bin/bash
# `make bundle-portable`: the bundle built inside a Debian 11 (bullseye) root, so that it runs on
# the Linux systems clusters use (glibc 2.28 and newer: Rocky/RHEL 8 and 9, Ubuntu 20.04-24.04,
# SLES 15 SP3+), as torch 2.11's own wheel does. A bundle carries the C++ runtime of the system it
# was built on, and that runtime and the binaries ask for the C library's symbol versions of that
# system: Debian 12's need glibc 2.36. Debian 11's GCC 10 runtime needs glibc 2.18, and the build
# keeps the binaries' own needs at or below 2.28 (glibc_compat.cpp); the install checks both and
# records the floor in share/tessel/GLIBC_FLOOR, which bin/* compare with the system's glibc.
#   tools/portable/bundle.sh [CHECKOUT]    -> CHECKOUT/build/tessel-<commit>-x86_64.tar.gz
# The root (TESSEL_CACHE/bullseye-build, about 1 GB) is made once with debootstrap from Debian's
# registry: GCC 10, yaml-cpp 0.6, spdlog 1.8 and fmt 7 from bullseye; cmake and ninja from PyPI;
# the header-only CLI11 and gloo's headers from this machine's Debian release (bullseye has no
# CLI11; gloo's headers as the host build uses). LibTorch and the CUDA compiler are this checkout's
# torch environment (.env), mounted in. Needs root (debootstrap, chroot) and debootstrap itself
# (apt-get install debootstrap): a release machine's job, not a user's. Exits 77 naming what is
# missing.
set -euo pipefail
here=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
cache=${TESSEL_CACHE:-$HOME/.cache/tessel}
root=$cache/bullseye-build
out=$here/build/portable
[ "$(id -u)" -eq 0 ] || { echo "skipped: the portable build needs root (debootstrap and chroot)"; exit 77; }
command -v debootstrap >/dev/null ||
  { echo "skipped: debootstrap not found (apt-get install debootstrap)"; exit 77; }
[ -e "$here/.env" ] || { echo "bundle-portable: no torch environment: run make build first" >&2; exit 2; }
torch_env=$(readlink -f "$here/.env")
stamp=$root/.complete-1
if [ ! -f "$stamp" ]; then
  echo "bundle-portable: making the Debian 11 build root in $root (once; about 2 minutes)"
  rm -rf "$root"
  debootstrap --variant=minbase --include=g++,make,ccache,git,file,python3-venv,libyaml-cpp-dev,libgtest-dev,libgmock-dev \
    bullseye "$root" http://deb.debian.org/debian >"$cache/bullseye-build.log" 2>&1 ||
    { tail -n 20 "$cache/bullseye-build.log"; exit 1; }
  # The host's name resolution and trusted certificates (a proxy's among them) for pip.
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mkdir -p "$root/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  chroot "$root" python3 -m venv /opt/tools
  chroot "$root" env -u PIP_FIND_LINKS /opt/tools/bin/pip install -q "cmake>=3.25,<4" ninja
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libgloo-dev 2>/dev/null)
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$root/opt/deps"; done
  rm -rf "$debs"
  touch "$stamp"
fi
mkdir -p "$cache/ccache-bullseye" "$out"
# Inside a private mount namespace (the mounts end with it): the checkout, the torch environment
# and the compiler cache at their own paths, then the build as the root's own system would run it.
export here root out torch_env cache
unshare --mount --propagation private bash -euo pipefail -c '
  for d in "$here" "$torch_env" "$cache/ccache-bullseye"; do
    mkdir -p "$root$d" && mount --bind "$d" "$root$d"
  done
  mount -t proc proc "$root/proc" && mount --bind /dev "$root/dev"
  chroot "$root" env -i PATH=/opt/tools/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    CCACHE_DIR="$cache/ccache-bullseye" CCACHE_BASEDIR="$here" CCACHE_NOHASHDIR=true \
    CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
    TESSEL_GLOO_INCLUDE=/opt/deps/usr/include \
    bash -euo pipefail -c "
      cmake -S $here -B $out -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_PREFIX_PATH=/opt/deps/usr -DTESSEL_HEADER_ONLY_LOGGING=ON -DTESSEL_GLIBC_COMPAT=ON \
        -DTorch_DIR=$(echo "$torch_env"/lib/python3*/site-packages/torch/share/cmake/Torch) >/dev/null
      cmake --build $out -j $(nproc) --target tessel-train tessel-launch tessel-data \
        tessel-bench-comm tessel-bench-cp tessel_cuda tessel-gpu-tests
      rm -rf $out/bundle && cmake --install $out --prefix $out/bundle/tessel >/dev/null"
'
floor=$(cat "$out/bundle/tessel/share/tessel/GLIBC_FLOOR")
name=tessel-$(git -C "$here" rev-parse --short HEAD)-$(uname -m)-glibc$floor
tar -C "$out/bundle" -czf "$here/build/$name.tar.gz" tessel
echo "$here/build/$name.tar.gz ($(du -h "$here/build/$name.tar.gz" | cut -f1)): runs on glibc $floor or newer"
