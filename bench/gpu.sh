#!/usr/bin/env bash
# One command on a machine with one GPU: build, then Tessel vs PyTorch eager vs torch.compile on
# configs/default.yaml's model and GPT-2 124M in bf16 (bench/gpu_bench.py), printing tokens/s, MFU
# and the ratios as a Markdown table for bench/RESULTS.md.
#   bench/gpu.sh [OUT]            (OUT defaults to /tmp/tessel-gpu-bench)
# Without a GPU it runs the CPU dry path (tiny models, a few steps) to show that the path works.
# TESSEL_PYTHON: a python with torch and transformers (default: the project's .env).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/tessel-gpu-bench}
make build >/dev/null
py=${TESSEL_PYTHON:-.env/bin/python}
flag=""
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "bench/gpu.sh: no CUDA device: running the CPU dry path" >&2; flag=--cpu; }
exec "$py" bench/gpu_bench.py "$out" $flag
