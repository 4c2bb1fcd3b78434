#!/bin/bash
# `make test-aarch64`: Tessel built for aarch64 (Grace) with Debian's cross compiler against the
# aarch64 torch wheel (tools/cross/aarch64.cmake), then under qemu-user: the unit tests, and 10
# steps of configs/default.yaml whose losses must equal the x86-64 build's within 2e-5
# (relative): the two builds' matrix products round differently (NVPL's BLAS on aarch64, MKL's on
# x86-64), and ten steps of training amplify it; measured 6.6e-7, 1.48e-5 and 1.06e-5 in three
# runs on 2026-11-28 (the first two on this checkout's own text, which changes with every commit). Exit 77 where the cross tools are missing (tools/cross/aarch64-setup.sh says which).
# Usage: tests/cross/aarch64_train.sh [X86_BIN_DIR] [AARCH64_BUILD_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
x86=${1:-$here/build/bin}
build=${2:-$here/build/aarch64}
root=${TESSEL_AARCH64_ROOT:-$HOME/.cache/tessel/aarch64}
python=${TESSEL_PYTHON:-$here/.env/bin/python}
"$here/tools/cross/aarch64-setup.sh" || exit $?
set -e
start=$SECONDS
[ -f "$build/build.ninja" ] ||
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_TOOLCHAIN_FILE="$here/tools/cross/aarch64.cmake" >/dev/null
cmake --build "$build" -j "$(nproc)" --target tessel-train tessel-unit-tests
echo "aarch64 build: $((SECONDS - start)) s"
aarch64() {  # runs an aarch64 program under qemu-user with the target's libraries
  env QEMU_LD_PREFIX=/usr/aarch64-linux-gnu TESSEL_ROOT="$here" \
      LD_LIBRARY_PATH="$root/torch/lib:$root/nvidia/cu13/lib:$root/deb-root/usr/lib/aarch64-linux-gnu" \
      qemu-aarch64 "$@"
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
start=$SECONDS
(cd "$here/tests/unit" && aarch64 "$build/bin/tessel-unit-tests" --gtest_brief=1)
echo "aarch64 unit tests under qemu: $((SECONDS - start)) s"
# The plan's model and training on a fixed text (its own corpus is this checkout's files, which
# change with every commit): the same bytes for both builds and every run of this test.
"$python" - "$out/corpus.txt" <<'PY'
import sys
words = "the model trains on every layout and matches one process within its tolerance".split()
state, out = 12345, []
for _ in range(60000):
    state = (1103515245 * state + 12345) % 2**31
    out.append(words[state % len(words)])
open(sys.argv[1], "w").write(" ".join(out) + "\n")
PY
steps=(--set training.steps=10 --set training.schedule.warmup_steps=5 --set training.eval_every=0
       --set logging.every=1 --set "data.path=[$out/corpus.txt]")
cd "$here"
"$x86/tessel-train" configs/default.yaml "${steps[@]}" --set run.output_dir="$out/x86_64" >/dev/null
start=$SECONDS
aarch64 "$build/bin/tessel-train" configs/default.yaml "${steps[@]}" \
  --set run.output_dir="$out/aarch64" >/dev/null
echo "aarch64 10 steps under qemu: $((SECONDS - start)) s"
"$python" - "$out" <<'PY'
import json, sys
def losses(arch):
    with open(f"{sys.argv[1]}/{arch}/metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]
x86, arm = losses("x86_64"), losses("aarch64")
assert len(x86) == len(arm) == 10, (len(x86), len(arm))
diffs = [abs(a - b) / abs(a) for a, b in zip(x86, arm)]
worst = max(diffs)
print(f"losses x86-64 {x86[0]:.6f} .. {x86[-1]:.6f}; aarch64 {arm[0]:.6f} .. {arm[-1]:.6f}; "
      f"relative differences per step {' '.join(f'{d:.1e}' for d in diffs)}")
assert worst < 2e-5, worst
PY
