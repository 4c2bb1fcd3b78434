#!/usr/bin/env bash
# One command for a machine with a GPU: the GPU suite, then Tessel vs PyTorch eager vs
# torch.compile (bench/gpu_bench.py), written as one Markdown report. Runs from a checkout (after
# `make build`) or from an installed bundle (share/tessel/bench/gpu-check.sh), with the torch of
# TESSEL_PYTHON (else python3, or the checkout's .env). Needs no root, no network, no build.
#   gpu-check.sh [OUT]        (OUT: /tmp/tessel-gpu-check)
# It takes about 8 minutes on one H200 (2026-11-27), 75 s of it compiling Llama-3 1B with
# torch.compile; TESSEL_GPU_CHECK_COMPILE_BY=S starts no torch.compile run after S seconds of the
# bench (its table then says "not run" in those cells).
# On a machine without a GPU every GPU test reports skipped and the bench runs its CPU dry path: the
# command works end to end, and the report's first line says that nothing in it is a GPU figure.
# On a machine with NVIDIA GPUs that torch cannot use (a driver older than its CUDA needs,
# CUDA_VISIBLE_DEVICES empty) it runs nothing, says why in the report's first line, and exits 1.
set -uo pipefail
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
root=$(cd "$here/.." && pwd)
out=${1:-/tmp/tessel-gpu-check}
mkdir -p "$out"
if [ -x "$root/../../bin/tessel-train" ]; then            # installed: P/share/tessel/bench
  bin=$(cd "$root/../../bin" && pwd)
else                                                       # checkout
  bin=$root/build/bin
  [ -x "$bin/tessel-train" ] || { echo "gpu-check: no $bin/tessel-train: run make build first" >&2; exit 2; }
  [ -z "${TESSEL_PYTHON:-}" ] && [ -x "$root/.env/bin/python" ] && export TESSEL_PYTHON=$root/.env/bin/python
fi
py=${TESSEL_PYTHON:-python3}
export TESSEL_BIN=$bin TESSEL_ROOT=$root TESSEL_PYTHON=$py
report=$out/gpu-check.md
# What the machine has, asked before anything runs (bench/benchlib.py reads the driver's files).
# Two lines: the GPUs and driver ("" without a GPU), then why torch cannot use them ("" if it can).
verdict=$("$py" - "$here" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import benchlib
gpus, driver = benchlib.gpu_hardware()
print(f"{len(gpus)} NVIDIA GPU(s): {', '.join(gpus)}; driver {driver or 'version unknown'}" if gpus else "")
print(benchlib.unusable_gpu_reason())
PY
) || exit 2
hw=$(sed -n 1p <<< "$verdict")
unusable=$(sed -n 2p <<< "$verdict")
if [ -n "$unusable" ]; then
  { echo "# Tessel GPU check, $(date -u +%Y-%m-%d): FAILED before it started"; echo; echo "$unusable"; } > "$report"
  cat "$report"
  echo "gpu-check: FAILED: $unusable" >&2
  exit 1
fi
status() {
  case $1 in
    0) echo passed;;
    77) if [ -n "$hw" ]; then echo "FAILED (skipped on a machine with GPUs)"; else echo "skipped (no GPU)"; fi;;
    *) echo "FAILED (exit $1)";;
  esac
}

start=$(date +%s)
"$bin/tessel-gpu-tests" > "$out/gpu-tests.log" 2>&1; kernels=$?
(cd "$root" && "$py" tests/gpu/gpu_suite.py) > "$out/gpu-suite.log" 2>&1; suite=$?
"$py" "$root/bench/gpu_bench.py" "$out/bench" ${TESSEL_GPU_CHECK_COMPILE_BY:+--compile-by "$TESSEL_GPU_CHECK_COMPILE_BY"} > "$out/bench.md" 2> "$out/bench.log"; bench=$?
"$py" "$root/bench/fp8_bench.py" "$out/bench" > "$out/fp8.md" 2> "$out/fp8.log"; fp8=$?
took=$(( $(date +%s) - start ))

{
  if [ -n "$hw" ]; then echo "# Tessel GPU check, $(date -u +%Y-%m-%d), on $hw"
  else echo "# Tessel GPU check, $(date -u +%Y-%m-%d): no GPU on this machine, every GPU part skipped; no figure here is a GPU figure"; fi
  echo
  "$py" - <<'PY'
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU dry path: no figure here is a GPU figure)"
print(f"- device: {gpu}; torch {torch.__version__}; CUDA devices: {torch.cuda.device_count()}")
PY
  echo "- commit: $(cat "$root/COMMIT" 2>/dev/null || git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown); took ${took} s"
  echo
  echo "| part | result | log |"
  echo "|---|---|---|"
  echo "| kernels, CUDA RNG replay (tessel-gpu-tests) | $(status $kernels) | gpu-tests.log |"
  echo "| NCCL collectives, training on CUDA (tests/gpu/gpu_suite.py) | $(status $suite) | gpu-suite.log |"
  echo "| Tessel vs PyTorch eager vs torch.compile (bench/gpu_bench.py) | $(status $bench) | bench.md, bench.log |"
  echo "| float8: Tessel vs torchao + torch.compile (bench/fp8_bench.py) | $(status $fp8) | fp8.md, fp8.log |"
  echo
  cat "$out/bench.md"
  echo
  cat "$out/fp8.md"
  echo
  grep -hE "kernel|worst rel|bf16 error|host reads" "$out/gpu-tests.log" "$out/gpu-suite.log" | sed 's/^/    /'
} > "$report"
cat "$report"
# From a checkout, a GPU's report is also kept for committing: bench/gpu-results/DATE-COMMIT-CARD.md.
if [ -n "$hw" ] && [ -d "$root/.git" ]; then
  card=$("$py" -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null | tr -c 'A-Za-z0-9\n' '-' | tr -s '-')
  keep=$root/bench/gpu-results/$(date -u +%Y-%m-%d)-$(git -C "$root" rev-parse --short HEAD)-${card:-gpu}.md
  mkdir -p "$(dirname "$keep")" && cp "$report" "$keep"
  for j in gpu_bench fp8_bench; do [ -f "$out/bench/$j.json" ] && cp "$out/bench/$j.json" "${keep%.md}-$j.json"; done
  # The raw per-step figures of every Tessel run: one line per step, its run's name added.
  for m in "$out"/bench/*/metrics.jsonl; do
    [ -f "$m" ] && sed "s/^{/{\"run\":\"$(basename "$(dirname "$m")")\",/" "$m"
  done > "${keep%.md}-steps.jsonl"
  echo "gpu-check: report kept in $keep"
fi
for rc in $kernels $suite $bench $fp8; do
  [ "$rc" -eq 0 ] || { [ "$rc" -eq 77 ] && [ -z "$hw" ]; } || { echo "gpu-check: a part failed; logs in $out" >&2; exit 1; }
done
echo "gpu-check: report in $report"
