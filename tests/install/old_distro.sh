#!/bin/bash
# `make test-old-distro`: the portable bundle (tools/portable/bundle.sh, built in a Debian 11 root)
# run by a user without root inside root filesystems of older distributions than this machine's:
#   Debian 11 (glibc 2.31)    20 steps of configs/default.yaml, LibTorch from this checkout's
#                             pip-installed torch 2.11 (TESSEL_TORCH_LIBS: bullseye's python 3.9 is
#                             older than torch 2.11 installs into)
#   Ubuntu 22.04 (glibc 2.35) torch 2.11 pip-installed into a venv of its python 3.10 (PyPI's CUDA
#                             13.0 build, as a user would); 20 steps, then bench/gpu-check.sh (its
#                             CPU path: the GPU suite skipped, the bench's dry path)
# and the aarch64 (Grace) portable bundle, built with the root's cross compiler against the aarch64
# torch wheel, under qemu-user with Debian 11's arm64 glibc (2.31) and nothing else beside it:
# 3 steps of configs/default.yaml, within 2e-5 of this build's losses (the two BLAS libraries
# round differently: tests/cross/aarch64_train.sh).
# Every run's losses must equal this checkout's build within 1e-5 (relative; the two builds' compilers
# differ), and the bundle built on this machine (Debian 12) must be refused on Ubuntu 22.04 by
# run.sh's glibc check, naming both versions. The roots are made once with debootstrap into
# TESSEL_CACHE (Debian's and Ubuntu's registries; Ubuntu's archive key from its keyring package,
# checked against the digest below) and reused. Needs root, debootstrap, qemu-user and the aarch64
# cross tools (tools/cross/aarch64-setup.sh); exits 77 naming what is missing.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cache=${TESSEL_CACHE:-$HOME/.cache/tessel}
python=$here/.env/bin/python
[ "$(id -u)" -eq 0 ] || { echo "skipped: needs root (debootstrap, chroot)"; exit 77; }
command -v debootstrap >/dev/null || { echo "skipped: debootstrap not found (apt-get install debootstrap)"; exit 77; }
command -v qemu-aarch64 >/dev/null || { echo "skipped: qemu-aarch64 not found (apt-get install qemu-user)"; exit 77; }
"$here/tools/cross/aarch64-setup.sh" || exit $?
set -e
for arch in x86_64 aarch64; do
  start=$SECONDS
  "$here/tools/portable/bundle.sh" "$here" $arch
  echo "portable bundle, $arch: $((SECONDS - start)) s"
done
commit=$(git -C "$here" rev-parse --short HEAD)
bundle=$(ls "$here"/build/tessel-$commit-x86_64-glibc*.tar.gz)
floor=$(cat "$here/build/portable/bundle/tessel/share/tessel/GLIBC_FLOOR")
floor_arm=$(cat "$here/build/portable-aarch64/bundle/tessel/share/tessel/GLIBC_FLOOR")
# Nothing installed names this machine's checkout or caches (the binaries' debug paths included).
for b in portable portable-aarch64; do
  if grep -rlF -e "$here" -e "$cache" "$here/build/$b/bundle/tessel"; then
    echo "old_distro: FAILED: the files above name $here or $cache"; exit 1
  fi
done

ubuntu_key=ubuntu-keyring_2021.03.26_all.deb
ubuntu_key_sha256=0d0e7ed6b112f5d03eabf3c7eb01ebdacf9c57714b279e90495cfc58c8c4520f
make_root() {  # NAME SUITE MIRROR [debootstrap options]: a minimal root with a user "tessel"
  local name=$1 suite=$2 mirror=$3; shift 3
  local dir=$cache/$name
  [ -f "$dir/.complete-1" ] && return 0
  echo "old_distro: making $dir ($suite, once)"
  rm -rf "$dir"
  debootstrap --variant=minbase "$@" "$suite" "$dir" "$mirror" >"$cache/$name.log" 2>&1 ||
    { tail -n 20 "$cache/$name.log"; exit 1; }
  cp /etc/resolv.conf "$dir/etc/resolv.conf"
  mkdir -p "$dir/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/"
  chroot "$dir" useradd -m -u 4242 tessel
  touch "$dir/.complete-1"
}
make_root bullseye-run bullseye http://deb.debian.org/debian
if [ ! -f "$cache/jammy-run/.complete-1" ]; then
  keys=$(mktemp -d)
  curl -fsS -m 120 -o "$keys/$ubuntu_key" "http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/$ubuntu_key"
  echo "$ubuntu_key_sha256  $keys/$ubuntu_key" | sha256sum -c --quiet
  dpkg-deb -x "$keys/$ubuntu_key" "$keys"
  make_root jammy-run jammy http://archive.ubuntu.com/ubuntu --components=main,universe \
    --keyring="$keys/usr/share/keyrings/ubuntu-archive-keyring.gpg" --include=python3-venv
  rm -rf "$keys"
fi
jammy=$cache/jammy-run
torch_version=$(sed -n 's/^TORCH_VERSION=//p' "$here/third_party/setup.sh")
if [ ! -f "$jammy/opt/py/.complete-torch$torch_version" ]; then
  echo "old_distro: pip install torch==$torch_version in Ubuntu 22.04's python (once; about 3 GB)"
  chroot "$jammy" env -u PIP_FIND_LINKS sh -c "rm -rf /opt/py && python3 -m venv /opt/py &&
    /opt/py/bin/pip install -q --no-cache-dir torch==$torch_version && touch /opt/py/.complete-torch$torch_version"
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
steps=(training.steps=20 training.schedule.warmup_steps=5 training.eval_every=0 logging.every=1
       checkpoint.every=0)
sets=""; for s in "${steps[@]}"; do sets="$sets --set $s"; done
# This checkout's build: the reference losses.
sets3=${sets/training.steps=20/training.steps=3}; sets3=${sets3/warmup_steps=5/warmup_steps=2}
(cd "$here" && build/bin/tessel-train configs/default.yaml $sets --set run.output_dir="$out/ref" >/dev/null)
(cd "$here" && build/bin/tessel-train configs/default.yaml $sets3 --set run.output_dir="$out/ref3" >/dev/null)
# The bundle built on this machine, for the refusal.
cmake --install "$here/build" --prefix "$out/host-bundle" >/dev/null
torch_env=$(readlink -f "$here/.env")
export here cache out bundle torch_env sets

# In a private mount namespace: each root gets the bundles unpacked at /opt, and runs as "tessel".
unshare --mount --propagation private bash -euo pipefail -c '
  as_user() {  # ROOT SCRIPT
    chroot --userspec=tessel:tessel "$1" env -i HOME=/home/tessel PATH=/usr/bin:/bin LANG=C.UTF-8 \
      bash -euo pipefail -c "$2"
  }
  for r in bullseye-run jammy-run; do
    root=$cache/$r
    rm -rf "$root/opt/tessel" "$root/opt/host-bundle" "$root/home/tessel/run"
    tar -C "$root/opt" -xzf "$bundle"
    mount -t proc proc "$root/proc" && mount --bind /dev "$root/dev"
  done
  # Debian 11: LibTorch from this checkout'\''s torch environment, mounted read-only.
  root=$cache/bullseye-run
  mkdir -p "$root/opt/torch-env" && mount --bind -o ro "$torch_env" "$root/opt/torch-env"
  site=$(cd "$torch_env" && echo lib/python3*/site-packages)
  libs=/opt/torch-env/$site/torch/lib
  for d in "$torch_env/$site"/nvidia/*/lib; do libs=$libs:/opt/torch-env/${d#$torch_env/}; done
  t=$SECONDS
  as_user "$root" "echo \"uid \$(id -u) on \$(ldd --version | head -n 1)\"; cd /opt/tessel/share/tessel
    TESSEL_TORCH_LIBS=$libs /opt/tessel/bin/tessel-train configs/default.yaml $sets \
      --set run.output_dir=/home/tessel/run >/dev/null"
  echo "Debian 11: 20 steps in $((SECONDS - t)) s"
  mkdir -p "$out/bullseye" && cp "$root/home/tessel/run/metrics.jsonl" "$out/bullseye/"
  # Ubuntu 22.04: its own python with torch pip-installed.
  root=$cache/jammy-run
  cp -r "$out/host-bundle" "$root/opt/host-bundle"
  t=$SECONDS
  as_user "$root" "echo \"uid \$(id -u) on \$(ldd --version | head -n 1)\"; cd /opt/tessel/share/tessel
    export TESSEL_PYTHON=/opt/py/bin/python
    /opt/tessel/bin/tessel-train configs/default.yaml $sets --set run.output_dir=/home/tessel/run >/dev/null
    /opt/tessel/share/tessel/bench/gpu-check.sh /home/tessel/check >/dev/null
    if /opt/host-bundle/bin/tessel-train --version > /home/tessel/refused 2>&1; then exit 1; fi"
  echo "Ubuntu 22.04: 20 steps and the GPU check in $((SECONDS - t)) s"
  mkdir -p "$out/jammy" && cp "$root/home/tessel/run/metrics.jsonl" "$out/jammy/"
  cp "$root/home/tessel/check/gpu-check.md" "$root/home/tessel/refused" "$out/jammy/"
'
# aarch64: Debian 11's arm64 C library alone (from the build root's packages) as qemu's prefix.
arm_libc=$cache/bullseye-arm64-libc
if [ ! -f "$arm_libc/.complete-1" ]; then
  rm -rf "$arm_libc" && mkdir -p "$arm_libc"
  chroot "$cache/bullseye-build" sh -c 'cd /tmp && rm -f libc6_*_arm64.deb &&
    apt-get download -q libc6:arm64 >/dev/null 2>&1'
  deb=$(ls "$cache"/bullseye-build/tmp/libc6_*_arm64.deb)
  dpkg-deb -x "$deb" "$arm_libc" && touch "$arm_libc/.complete-1"
fi
arm=$out/arm && mkdir -p "$arm" && tar -C "$arm" -xzf "$(ls "$here"/build/tessel-$commit-aarch64-glibc*.tar.gz)"
aarch64_root=${TESSEL_AARCH64_ROOT:-$cache/aarch64}
t=$SECONDS
(cd "$arm/tessel/share/tessel" &&
  env -i PATH=/usr/bin:/bin HOME="$out" QEMU_LD_PREFIX="$arm_libc" \
    LD_LIBRARY_PATH="$aarch64_root/torch/lib:$aarch64_root/nvidia/cu13/lib" \
    qemu-aarch64 "$arm/tessel/libexec/tessel/tessel-train" configs/default.yaml $sets3 \
      --set run.output_dir="$out/aarch64" >/dev/null)
echo "aarch64 under qemu (Debian 11's arm64 glibc): 3 steps in $((SECONDS - t)) s"
"$python" - "$out" "$floor" "$floor_arm" <<'PY'
import json, sys
out, floor = sys.argv[1], sys.argv[2]
def losses(name):
    with open(f"{out}/{name}/metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]
ref = losses("ref")
assert len(ref) == 20, len(ref)
for name, label in (("bullseye", "Debian 11, glibc 2.31"), ("jammy", "Ubuntu 22.04, glibc 2.35")):
    got = losses(name)
    assert len(got) == len(ref), (name, len(got))
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"{label}: 20 steps, losses {got[0]:.6f} .. {got[-1]:.6f}, within {worst:.1e} of this build's")
    assert worst < 1e-5, (name, worst)
report = open(f"{out}/jammy/gpu-check.md").read()
assert "skipped (no GPU)" in report, report[:2000]
assert "| Tessel vs PyTorch eager vs torch.compile (bench/gpu_bench.py) | passed |" in report, report[:2000]
refused = open(f"{out}/jammy/refused").read()
assert "needs glibc 2.36" in refused and "glibc 2.35" in refused, refused
print(f"Ubuntu 22.04: gpu-check.sh ran its CPU path; the Debian 12 bundle refused: {refused.strip()[:160]}")
arm, ref3 = losses("aarch64"), losses("ref3")
assert len(arm) == len(ref3) == 3, (len(arm), len(ref3))
worst = max(abs(a - b) / abs(b) for a, b in zip(arm, ref3))
print(f"aarch64 under qemu: 3 steps, losses {arm[0]:.6f} .. {arm[-1]:.6f}, within {worst:.1e} of this build's")
assert worst < 2e-5, worst
# Torch 2.11's wheels (manylinux_2_28) set the floor of every install; a bundle must not raise it.
for arch, f in (("x86_64", floor), ("aarch64", sys.argv[3])):
    assert tuple(map(int, f.split("."))) <= (2, 28), f"the portable {arch} bundle needs glibc {f}"
    print(f"the portable {arch} bundle asks for glibc {f} (torch 2.11's wheels for 2.28)")
PY
