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

if [ -z "${TESSEL_TORCH_LIBS:-}" ]; then
  py=${TESSEL_PYTHON:-python3}
  command -v "$py" >/dev/null 2>&1 || {
    echo "tessel: no python to take LibTorch from: '$py' is not on PATH. Set TESSEL_PYTHON to a" \
         "python with torch $(cat "$prefix/share/tessel/TORCH_VERSION") installed." >&2
    exit 127
  }
  # Package metadata and paths only: importing torch would take seconds.
  TESSEL_TORCH_LIBS=$("$py" - "$(cat "$prefix/share/tessel/TORCH_VERSION")" <<'PY'
import glob, importlib.metadata as md, importlib.util, os, sys
want = sys.argv[1]
spec = importlib.util.find_spec("torch")
if spec is None or not spec.origin:
    sys.exit(f"tessel: {sys.executable} has no torch; install torch=={want} there or set TESSEL_PYTHON")
have = md.version("torch").split("+")[0]
if have.split(".")[:2] != want.split(".")[:2]:
    sys.exit(f"tessel: built against torch {want}; {sys.executable} has torch {have} (C++ ABI differs): "
             f"set TESSEL_PYTHON to a python with torch {want}")
torch_dir = os.path.dirname(spec.origin)
site = os.path.dirname(torch_dir)
dirs = [os.path.join(torch_dir, "lib")] + sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))
print(":".join(d for d in dirs if os.path.isdir(d)))
PY
) || exit 127
  export TESSEL_TORCH_LIBS
  [ -n "${TESSEL_PYTHON:-}" ] || TESSEL_PYTHON=$(command -v "$py") && export TESSEL_PYTHON
fi
export LD_LIBRARY_PATH="$TESSEL_TORCH_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$exe" "$@"
