#!/bin/bash
# Everything an aarch64 (Grace) cross build needs, fetched without root into one folder
# (TESSEL_AARCH64_ROOT, default ~/.cache/tessel/aarch64), once per machine:
#   torch/          the pinned torch wheel for manylinux_2_28_aarch64 (PyPI), unpacked: headers
#                   and libraries (its CPU half is what the cross build links)
#   nvidia/cu13/    the CUDA runtime and CUPTI that libtorch_cpu names (NVIDIA's aarch64 wheels)
#   nvidia/nccl/    NCCL's headers (c10d's NCCL headers name them; libtessel_cuda's build)
#   deb-root/       Debian's arm64 packages of yaml-cpp, spdlog, fmt, gloo's headers and
#                   GoogleTest, and the header-only CLI11 and nlohmann-json, unpacked
# Needs the cross compiler and qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user) and
# apt's arm64 package lists (as root, once: dpkg --add-architecture arm64 && apt-get update).
# Exits 77 (ctest: skipped) naming what is missing.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
root=${TESSEL_AARCH64_ROOT:-$HOME/.cache/tessel/aarch64}
torch_version=$(sed -n 's/^TORCH_VERSION=//p' "$here/third_party/setup.sh")
# The CUDA 13.0 runtime and CUPTI that torch $torch_version's aarch64 wheel was built against.
nvidia=("nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cupti==13.0.85")
debs=(libyaml-cpp-dev:arm64 libyaml-cpp0.7:arm64 libspdlog-dev:arm64 libspdlog1.10:arm64
      libfmt-dev:arm64 libfmt9:arm64 libgtest-dev:arm64 libgmock-dev:arm64 libgloo-dev:arm64
      libcli11-dev nlohmann-json3-dev)
stamp="$root/.complete-torch$torch_version-nccl"
[ -f "$stamp" ] && exit 0

for tool in aarch64-linux-gnu-g++ qemu-aarch64 apt-get; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "skipped: $tool not found (apt-get install g++-aarch64-linux-gnu qemu-user)"; exit 77; }
done
policy=$(apt-cache policy libyaml-cpp-dev:arm64 2>/dev/null || true)
if ! grep -q "Candidate: [0-9]" <<<"$policy"; then
  echo "skipped: apt has no arm64 package lists (as root, once: dpkg --add-architecture arm64 && apt-get update)"
  exit 77
fi
python=${TESSEL_PYTHON:-$here/.env/bin/python}
mkdir -p "$root/wheels" "$root/debs" "$root/deb-root"
echo "aarch64 setup: torch $torch_version and the CUDA runtime for manylinux aarch64 into $root"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_aarch64 -d "$root/wheels" "torch==$torch_version"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_17_aarch64 --platform manylinux_2_25_aarch64 -d "$root/wheels" "${nvidia[@]}"
rm -rf "$root/torch" "$root/nvidia"
(cd "$root" && unzip -qo "wheels/torch-$torch_version-"*aarch64.whl 'torch/lib/*' 'torch/include/*' \
   'torch/share/*' torch/version.py)
for w in "$root"/wheels/nvidia_*aarch64*.whl; do (cd "$root" && unzip -qo "$w" 'nvidia/*'); done
# The CUDA headers c10's and ATen's CUDA headers name (cuBLAS, cuSPARSE, cuSOLVER: C headers, the
# same on every architecture) from this machine's torch environment, beside the target's runtime.
host_cuda=$("$python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'include'))")
cp -rn "$host_cuda/." "$root/nvidia/cu13/include/"
# NCCL's headers, which c10d's ProcessGroupNCCL.hpp names (libtessel_cuda's build), likewise.
host_nccl=$("$python" -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'nccl', 'include'))")
mkdir -p "$root/nvidia/nccl/include" && cp -rn "$host_nccl/." "$root/nvidia/nccl/include/"
echo "aarch64 setup: Debian's arm64 packages into $root/deb-root"
(cd "$root/debs" && apt-get download "${debs[@]}" 2>/dev/null)
for f in "$root"/debs/*.deb; do dpkg-deb -x "$f" "$root/deb-root"; done
touch "$stamp"
