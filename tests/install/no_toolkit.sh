#!/usr/bin/env bash
# The build on a machine with no CUDA toolkit (a laptop, a CPU-only box, a login node whose CUDA
# module is another version): in a private mount namespace, every /usr/local/cuda* folder and every
# nvcc on PATH is hidden, and the checkout configures afresh with NVIDIA's compiler wheels that
# third_party/setup.sh put beside torch. Without them LibTorch's own CMake config stops ("Your
# installed Caffe2 version uses CUDA but I cannot find the CUDA libraries").
#   no_toolkit.sh ROOT            configure only (ctest install.no_toolkit, seconds)
#   no_toolkit.sh ROOT --build    and build tessel-train and train 5 steps (make test-no-toolkit)
# Needs root or unprivileged user namespaces for the mount namespace; else exits 77 (skipped).
set -uo pipefail
root=$(cd "$1" && pwd); build_too=${2:-}
if [ -z "${TESSEL_NO_TOOLKIT_INSIDE:-}" ]; then
  userns=(); [ "$(id -u)" -eq 0 ] || userns=(--map-root-user)
  unshare --mount --propagation private "${userns[@]}" true 2>/dev/null ||
    { echo "no_toolkit: skipped: no mount namespace for this user (unshare --mount failed)"; exit 77; }
  exec unshare --mount --propagation private "${userns[@]}" env TESSEL_NO_TOOLKIT_INSIDE=1 "$0" "$@"
fi
# Inside: hide every toolkit folder and every nvcc on PATH.
for d in /usr/local/cuda*; do [ -d "$d" ] && mount -t tmpfs none "$d"; done
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do [ -e "$d/nvcc" ] && mount --bind /dev/null "$d/nvcc"; done
if command -v nvcc >/dev/null && nvcc --version >/dev/null 2>&1; then
  echo "no_toolkit: FAILED: nvcc is still reachable: $(command -v nvcc)"; exit 1
fi
ls /usr/local/cuda*/bin/nvcc >/dev/null 2>&1 && { echo "no_toolkit: FAILED: a toolkit is still visible"; exit 1; }
# The build folder sits beside the checkout's build/ (the same depth: ccache's relative paths, and
# so its entries, are the same).
out=$root/build-no-toolkit
rm -rf "$out"
start=$(date +%s)
if ! cmake -S "$root" -B "$out" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$out.log" 2>&1; then
  cat "$out.log"; echo "no_toolkit: FAILED: configure without a CUDA toolkit"; exit 1
fi
line=$(grep -- "-- CUDA compiler:" "$out.log")
echo "$line"
case $line in
  *"/nvidia/cu"*"/bin/nvcc"*) ;;
  *) echo "no_toolkit: FAILED: the CUDA compiler is not NVIDIA's wheel beside torch"; exit 1 ;;
esac
echo "no_toolkit: configured in $(( $(date +%s) - start )) s with no CUDA toolkit on the machine"
if [ "$build_too" = --build ]; then
  cmake --build "$out" -j "$(nproc)" --target tessel-train tessel_cuda >> "$out.log" 2>&1 ||
    { tail -30 "$out.log"; echo "no_toolkit: FAILED: build"; exit 1; }
  echo "no_toolkit: built tessel-train in $(( $(date +%s) - start )) s"
  "$out/bin/tessel-train" "$root/configs/default.yaml" --set run.output_dir="$out/run" \
    --set training.steps=5 --set training.schedule.warmup_steps=2 --set training.eval_every=0 \
    --set checkpoint.every=0 --set checkpoint.resume=never --set logging.every=1 2>&1 | grep "step 5/5" ||
    { echo "no_toolkit: FAILED: training"; exit 1; }
fi
rm -rf "$out" "$out.log"
echo "no_toolkit: passed in $(( $(date +%s) - start )) s"
