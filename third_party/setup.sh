#!/usr/bin/env bash
# Installs what Tessel needs, idempotently; a second run takes about a second. Root is never
# required: what the machine already has (any prefix CMake finds: CMAKE_PREFIX_PATH, conda,
# spack, modules) is used as it is.
#   - C++ libraries (yaml-cpp, spdlog, fmt, CLI11, nlohmann-json, gloo's headers; GoogleTest for
#     tests): when CMake cannot find one, Debian's package is installed with apt-get where this user
#     may (root, or sudo without a password), else downloaded with `apt-get download` and unpacked
#     without root into ${TESSEL_CACHE:-~/.cache/tessel}/deb-root (linked as .deps, which the build
#     searches). Without apt-get, it names what is missing and how to supply it, and exits 1.
#   - Tools: cmake and ninja from PyPI into the environment below when the machine has none.
#   - The pinned PyPI torch wheel (its LibTorch) plus the Python test dependencies, into a per-user
#     cache shared by every checkout: ${TESSEL_CACHE:-~/.cache/tessel}/py-torch<ver>. A fresh clone
#     therefore neither downloads 2.7 GB again nor recompiles (ccache lives under the same cache).
#   - NVIDIA's CUDA compiler wheels of torch's CUDA version into the same environment (step 4).
#   - .env in the checkout: a symlink to that environment (git-ignored), which the build uses.
# An existing LibTorch is used instead when Torch_DIR is set, or TESSEL_PYTHON names a python whose
# torch is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
TOKENIZERS_VERSION=0.22.2  # the version transformers==4.57.6 pins
MEGATRON_CORE_VERSION=0.16.1
TORCHAO_VERSION=0.18.0  # training.fp8's reference (tests/reference/fp8_torchao_test.py)
PY_TEST_DEPS=(transformers==4.57.6 safetensors matplotlib==3.10.7 tensorboard==2.20.0)
cache=${TESSEL_CACHE:-$HOME/.cache/tessel}
mode=${1:-build}   # build | test (test also needs GoogleTest, Slurm, Open MPI and the parity deps)

# Who may install system packages: root, or sudo that asks for no password.
apt_ok=""
if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then apt_ok=root; elif sudo -n true 2>/dev/null; then apt_ok=sudo; fi
fi
have_pkg() { command -v dpkg-query >/dev/null 2>&1 &&
             dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
apt_install() {
  local sudo_cmd=""; [ "$apt_ok" = sudo ] && sudo_cmd="sudo -n"
  echo "setup: installing Debian packages: $*"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. Tools and test-only system programs: Debian packages when this user may install them.
tools=(cmake ninja-build ccache g++)
[ "$mode" = test ] && tools+=(openmpi-bin slurmctld slurmd slurm-client)
# python3-venv: only to create our environment (no Torch_DIR or TESSEL_PYTHON) with a python that
# lacks venv (Debian's; a pyenv python has it).
if [ -z "${Torch_DIR:-}${TESSEL_PYTHON:-}" ] && ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  tools+=(python3-venv)
fi
missing_tools=()
for p in "${tools[@]}"; do have_pkg "$p" || missing_tools+=("$p"); done
if [ ${#missing_tools[@]} -gt 0 ] && [ -n "$apt_ok" ]; then
  apt_install "${missing_tools[@]}"
elif [ ${#missing_tools[@]} -gt 0 ]; then
  for p in "${missing_tools[@]}"; do
    case $p in
      cmake|ninja-build) ;;  # from PyPI below when absent
      ccache) command -v ccache >/dev/null || echo "setup: note: no ccache: builds are not cached" ;;
      g++) command -v g++ >/dev/null || { echo "setup: no C++ compiler (g++ 9 or newer): load one (module load gcc) or install g++" >&2; exit 1; } ;;
      python3-venv) echo "setup: python3 has no venv module: install python3-venv, or set TESSEL_PYTHON to a python with torch==$TORCH_VERSION" >&2; exit 1 ;;
      *) command -v "${p%%-*}" >/dev/null || command -v mpirun >/dev/null ||
           echo "setup: note: $p is not installed and this user cannot install it: the tests that need it will fail" ;;
    esac
  done
fi

# 2. C++ libraries: whatever CMake finds is used; the rest from Debian's packages.
probe() {  # prints the names CMake cannot find
  local dir; dir=$(mktemp -d)
  cmake -S third_party/probe -B "$dir" -DTESSEL_DEPS="$cache/deb-root" \
        $([ "$mode" = test ] && echo -DTESSEL_PROBE_TEST=ON) 2>&1 | sed -n 's/^missing //p'
  rm -rf "$dir"
}
declare -A deb=([yaml-cpp]=libyaml-cpp-dev [spdlog]=libspdlog-dev [fmt]=libfmt-dev [CLI11]=libcli11-dev
                [nlohmann_json]=nlohmann-json3-dev [GTest]=libgtest-dev [gloo]=libgloo-dev)
if command -v cmake >/dev/null 2>&1; then
  missing=($(probe))
  if [ ${#missing[@]} -gt 0 ] && [ -n "$apt_ok" ]; then
    apt_install $(for m in "${missing[@]}"; do echo "${deb[$m]}"; done)
    missing=($(probe))
  fi
  if [ ${#missing[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
    # No root: download the packages (and the libraries they depend on) and unpack them privately.
    pkgs=$(for m in "${missing[@]}"; do echo "${deb[$m]}"; done)
    deps=$(apt-cache depends $pkgs 2>/dev/null | sed -n 's/^ *Depends: \(lib[^<>]*\)$/\1/p' | sort -u)
    echo "setup: unpacking without root into $cache/deb-root: $pkgs $deps"
    mkdir -p "$cache/debs" "$cache/deb-root"
    (cd "$cache/debs" && apt-get download $pkgs $deps >/dev/null)
    for f in "$cache"/debs/*.deb; do dpkg-deb -x "$f" "$cache/deb-root"; done
    missing=($(probe))
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: CMake cannot find: ${missing[*]}. Supply them in one of these ways, then run again:" >&2
    for m in "${missing[@]}"; do
      case $m in
        spdlog|fmt) echo "  $m: Debian/Ubuntu package ${deb[$m]}, conda install -c conda-forge $m, spack, or a module, then its prefix in CMAKE_PREFIX_PATH; or its headers alone (spdlog 1.10+, fmt 9+): TESSEL_HEADER_ONLY_LOGGING=1 with the folder holding include/$m in CMAKE_PREFIX_PATH" >&2 ;;
        gloo) echo "  gloo: Debian/Ubuntu package libgloo-dev, or TESSEL_GLOO_INCLUDE=<folder holding gloo/algorithm.h and gloo/config.h> (a gloo install prefix's include/; headers only)" >&2 ;;
        *) echo "  $m: Debian/Ubuntu package ${deb[$m]}, conda install -c conda-forge $(echo "$m" | tr 'A-Z_' 'a-z-'), spack, or a module; then put its prefix in CMAKE_PREFIX_PATH" >&2 ;;
      esac
    done
    exit 1
  fi
  [ -d "$cache/deb-root/usr" ] && ln -sfn "$cache/deb-root" .deps
fi

# 3. LibTorch.
if [ -n "${Torch_DIR:-}" ]; then
  echo "setup: using Torch_DIR=$Torch_DIR"
  [ "$mode" = test ] && echo "setup: note: parity tests need a python with torch, transformers and safetensors (TESSEL_PYTHON)"
  exit 0
fi

if [ -n "${TESSEL_PYTHON:-}" ]; then
  env_dir=$(cd "$(dirname "$TESSEL_PYTHON")/.." && pwd)
else
  env_dir=$cache/py-torch$TORCH_VERSION
  if [ ! -x "$env_dir/bin/python" ]; then
    echo "setup: creating $env_dir"
    mkdir -p "$cache"
    python3 -m venv "$env_dir"
  fi
  # Package metadata, not `import torch` (which takes seconds): keeps the no-op path fast.
  if ! "$env_dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "setup: installing torch==$TORCH_VERSION into $env_dir (about 2.7 GB, once per machine)"
    "$env_dir/bin/pip" install --no-input -q "torch==$TORCH_VERSION" numpy
  fi
fi
# cmake and ninja from PyPI when the machine has none (the Makefile puts .env/bin last on PATH).
for t in cmake ninja; do
  command -v "$t" >/dev/null 2>&1 || [ -x "$env_dir/bin/$t" ] || {
    echo "setup: installing $t from PyPI into $env_dir"; "$env_dir/bin/pip" install --no-input -q "$t"; }
done
# tessel-data and generate run Hugging Face tokenizers through a Python helper (engine/io/tokenizer.h).
if ! "$env_dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('tokenizers') != '$TOKENIZERS_VERSION')" 2>/dev/null; then
  echo "setup: installing tokenizers==$TOKENIZERS_VERSION (tessel-data's tokenizer helper)"
  "$env_dir/bin/pip" install --no-input -q "tokenizers==$TOKENIZERS_VERSION"
fi
if [ "$mode" = test ] && ! "$env_dir/bin/python" -c "import importlib.metadata as m; [m.version(p) for p in ('transformers', 'safetensors', 'matplotlib', 'tensorboard')]" 2>/dev/null; then
  echo "setup: installing Python test dependencies: ${PY_TEST_DEPS[*]}"
  "$env_dir/bin/pip" install --no-input -q "${PY_TEST_DEPS[@]}"
fi
# Megatron-Core's dataset builder, which data.order megatron is checked against
# (tests/reference/megatron_samples_test.py); its own needs (torch, numpy, packaging) are there.
if [ "$mode" = test ] && ! "$env_dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$MEGATRON_CORE_VERSION')" 2>/dev/null; then
  echo "setup: installing megatron-core==$MEGATRON_CORE_VERSION (a test reference for data.order megatron)"
  "$env_dir/bin/pip" install --no-input -q --no-deps "megatron-core==$MEGATRON_CORE_VERSION"
fi
# torchao's float8 training, which training.fp8 is checked against; pure Python over torch.
if [ "$mode" = test ] && ! "$env_dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torchao') != '$TORCHAO_VERSION')" 2>/dev/null; then
  echo "setup: installing torchao==$TORCHAO_VERSION (a test reference for training.fp8)"
  "$env_dir/bin/pip" install --no-input -q --no-deps "torchao==$TORCHAO_VERSION"
fi
# 4. A CUDA compiler of torch's CUDA version. Tessel compiles no CUDA code, but the CUDA build of
# LibTorch's CMake config enables the CUDA language and looks for the toolkit; a machine without
# one (a laptop, a CPU-only box, a login node whose CUDA module is 12.x) could not configure. NVIDIA's
# compiler wheels (nvcc, nvvm, crt, cccl) go into this environment beside the runtime wheels torch
# brought, and the build uses them (third_party/dependencies.cmake): no root, and the headers and
# runtime Tessel compiles against are torch's own, whatever toolkit the machine has.
torch_pkg=$("$env_dir/bin/python" -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('torch').origin))")
cuda=$(sed -n "s/^cuda[^=]*= *'\([0-9]*\.[0-9]*\)'.*/\1/p" "$torch_pkg/version.py")
if [ -n "$cuda" ]; then
  kit=$(dirname "$torch_pkg")/nvidia/cu${cuda%%.*}
  if [ ! -x "$kit/bin/nvcc" ] || [ ! -d "$kit/nvvm" ] || [ ! -d "$kit/include/crt" ] || [ ! -d "$kit/include/cccl" ]; then
    echo "setup: installing NVIDIA's CUDA $cuda compiler wheels into $env_dir (about 100 MB, once per machine: LibTorch's CMake config needs a CUDA compiler; running needs none)"
    "$env_dir/bin/pip" install --no-input -q --no-deps "nvidia-cuda-nvcc==$cuda.*" "nvidia-nvvm==$cuda.*" \
      "nvidia-cuda-crt==$cuda.*" "nvidia-cuda-cccl==$cuda.*"
  fi
  # What a toolkit's folder has and the wheels lack: lib64, and unversioned library names (CMake's
  # FindCUDA looks for libcudart.so).
  [ -e "$kit/lib64" ] || ln -s lib "$kit/lib64"
  for f in "$kit"/lib/lib*.so.[0-9]*; do
    b=${f%%.so.*}.so
    [ -e "$b" ] || ln -s "$(basename "$f")" "$b"
  done
fi
ln -sfn "$env_dir" .env
