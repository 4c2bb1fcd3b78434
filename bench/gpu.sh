#!/usr/bin/env bash
# Tessel vs PyTorch eager vs torch.compile on one GPU (bench/gpu_bench.py): configs/default.yaml's
# model, GPT-2 124M at seq 1024 and Llama-3 1B at seq 2048 in bf16, printing tokens/s, MFU, peak
# memory and the ratios as a Markdown table for bench/RESULTS.md. It builds nothing (a GPU machine
# may have no package registry or root): run `make build` here, or use an installed bundle, whose
# bench/gpu-check.sh runs this together with the GPU suite.
#   bench/gpu.sh [OUT]            (OUT defaults to /tmp/tessel-gpu-bench)
# Without a GPU it runs the CPU dry path (tiny models, a few steps) to show that the path works.
# TESSEL_PYTHON: a python with torch (default: the checkout's .env, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/tessel-gpu-bench}
[ -x build/bin/tessel-train ] || [ -n "${TESSEL_BIN:-}" ] || {
  echo "bench/gpu.sh: no build/bin/tessel-train: run make build (or set TESSEL_BIN)" >&2; exit 2; }
py=${TESSEL_PYTHON:-$([ -x .env/bin/python ] && echo .env/bin/python || echo python3)}
exec "$py" bench/gpu_bench.py "$out"
