#!/bin/sh
# Runs an installed Tessel binary (libexec/tessel/<name>) against the LibTorch of a Python that has
# torch installed: TESSEL_PYTHON when set, else the python3 on PATH. bin/<name> are links to this
# script. The CUDA runtime, cuDNN and NCCL then come from that torch install (the wheel's nvidia/*
# packages), never from a system CUDA toolkit; the bundle's own lib/ holds the rest (yaml-cpp,
# spdlog, fmt, the C++ runtime). Nothing here needs root or a network.
set -eu
self=$(readlink -f "$0")
prefix=$(cd "$(dirname "$self")/../.." && pwd)
name=$(basename "$0")
[ "$name" = run.sh ] && { echo "run.sh: call it through bin/<tool>" >&2; exit 2; }
exe="$prefix/libexec/tessel/$name"
[ -x "$exe" ] || { echo "tessel: no such tool in this install: $name ($exe)" >&2; exit 2; }
share="$prefix/share/tessel"

# The C library: the binaries and the libraries carried need symbols up to GLIBC_FLOOR.
floor=$(cat "$share/GLIBC_FLOOR" 2>/dev/null || echo 0)
have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
if [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$floor" "$have" | sort -V | head -n 1)" != "$floor" ]; then
  echo "tessel: this bundle needs glibc $floor or newer (the newest symbol version its binaries and" \
       "the C++ runtime it carries use; it was built on a system of that glibc); this system has" \
       "glibc $have. Use a bundle built on an older distribution, or build from source here" \
       "(docs/building.md)." >&2
  exit 127
fi

if [ -z "${TESSEL_TORCH_LIBS:-}" ]; then
  py=${TESSEL_PYTHON:-python3}
  command -v "$py" >/dev/null 2>&1 || {
    echo "tessel: no python to take LibTorch from: '$py' is not on PATH. Set TESSEL_PYTHON to a" \
         "python with torch $(cat "$prefix/share/tessel/TORCH_VERSION") installed." >&2
    exit 127
  }
  # Package metadata and paths only: importing torch would take seconds.
  TESSEL_TORCH_LIBS=$("$py" - "$(cat "$share/TORCH_VERSION")" "$(cat "$share/TORCH_CUDA" 2>/dev/null)" <<'PY'
import glob, importlib.metadata as md, importlib.util, os, re, sys
want, want_cuda = sys.argv[1], sys.argv[2].strip()
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    sys.exit(f"tessel: {sys.executable} has no torch; install torch=={want} there or set TESSEL_PYTHON")
have = md.version("torch").split("+")[0]
if have.split(".")[:2] != want.split(".")[:2]:
    sys.exit(f"tessel: built against torch {want}; {sys.executable} has torch {have} (C++ ABI differs): "
             f"set TESSEL_PYTHON to a python with torch {want}")
torch_dir = os.path.dirname(spec.origin)
# Its build's CUDA version, from torch/version.py's text (importing torch would take seconds).
try:
    with open(os.path.join(torch_dir, "version.py")) as f:
        m = re.search(r"^cuda\b[^=]*=\s*'([^']*)'", f.read(), re.M)
    cuda = m.group(1) if m else ""
except OSError:
    cuda = ""
if cuda != want_cuda:
    def build(c): return f"the CUDA {c} build" if c else "a CPU-only build"
    sys.exit(f"tessel: built against torch {want}, {build(want_cuda)} (its binaries load that CUDA runtime); "
             f"{sys.executable} has torch {have}, {build(cuda)}. Install the matching build there "
             f"(PyPI's torch=={want} on Linux is the CUDA {want_cuda or '?'} build) or set TESSEL_PYTHON")
site = os.path.dirname(torch_dir)
dirs = [os.path.join(torch_dir, "lib")] + sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
print(":".join(d for d in dirs if os.path.isdir(d)))
PY
) || exit 127
  export TESSEL_TORCH_LIBS
  [ -n "${TESSEL_PYTHON:-}" ] || TESSEL_PYTHON=$(command -v "$py") && export TESSEL_PYTHON
fi
export LD_LIBRARY_PATH="$TESSEL_TORCH_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# A GPU's driver against the CUDA runtime torch brings (CUDA 13 needs R580 or newer). Said, not
# refused: the run may be on the CPU, and where CUDA is used it fails at start-up with LibTorch's
# own message.
cuda=$(cat "$share/TORCH_CUDA" 2>/dev/null || true)
if [ "${cuda%%.*}" = 13 ] && command -v nvidia-smi >/dev/null 2>&1; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ] 2>/dev/null; then
    echo "tessel: warning: the NVIDIA driver here is $driver; torch's CUDA $cuda runtime needs" \
         "driver R580 or newer, so CUDA will not start on this node (a CPU run is unaffected)." >&2
  fi
fi
exec "$exe" "$@"
