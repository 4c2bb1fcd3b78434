#!/usr/bin/env bash
# Installs what Tessel needs, idempotently; a second run takes about a second.
#   - Debian packages (compiler tools and C++ libraries), when missing.
#   - The pinned PyPI torch wheel (its LibTorch) plus the Python test dependencies, into a per-user
#     cache shared by every checkout: ${TESSEL_CACHE:-~/.cache/tessel}/py-torch<ver>. A fresh clone
#     therefore neither downloads 2.7 GB again nor recompiles (ccache lives under the same cache).
#   - .env in the checkout: a symlink to that environment (git-ignored), which the build uses.
# An existing LibTorch is used instead when Torch_DIR is set, or TESSEL_PYTHON names a python whose
# torch is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.11.0
TOKENIZERS_VERSION=0.22.2  # the version transformers==4.57.6 pins
PY_TEST_DEPS=(transformers==4.57.6 safetensors matplotlib==3.10.7 tensorboard==2.20.0)
cache=${TESSEL_CACHE:-$HOME/.cache/tessel}
mode=${1:-build}   # build | test (test also needs the Python parity dependencies)

need_apt=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
for p in cmake ninja-build ccache g++ libyaml-cpp-dev libspdlog-dev libfmt-dev libcli11-dev \
         nlohmann-json3-dev libgtest-dev libgloo-dev openmpi-bin python3-venv; do
  have_pkg "$p" || need_apt+=("$p")
done
# The Slurm tests start a private cluster (tests/dist/local_slurm.py): Debian's Slurm, test mode only.
if [ "$mode" = test ]; then
  for p in slurmctld slurmd slurm-client; do have_pkg "$p" || need_apt+=("$p"); done
fi
# python3-venv is only needed when we create the venv with Debian's python; a pyenv python has venv.
if python3 -c 'import venv, ensurepip' 2>/dev/null; then
  need_apt=("${need_apt[@]/python3-venv}")
fi
need_apt=(${need_apt[@]+"${need_apt[@]}"})
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

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
# tessel-data and generate run Hugging Face tokenizers through a Python helper (engine/tokenizer.h).
if ! "$env_dir/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('tokenizers') != '$TOKENIZERS_VERSION')" 2>/dev/null; then
  echo "setup: installing tokenizers==$TOKENIZERS_VERSION (tessel-data's tokenizer helper)"
  "$env_dir/bin/pip" install --no-input -q "tokenizers==$TOKENIZERS_VERSION"
fi
if [ "$mode" = test ] && ! "$env_dir/bin/python" -c "import importlib.metadata as m; [m.version(p) for p in ('transformers', 'safetensors', 'matplotlib', 'tensorboard')]" 2>/dev/null; then
  echo "setup: installing Python test dependencies: ${PY_TEST_DEPS[*]}"
  "$env_dir/bin/pip" install --no-input -q "${PY_TEST_DEPS[@]}"
fi
ln -sfn "$env_dir" .env
