// The CPU's arithmetic made the same from run to run. LibTorch's x86-64 wheel does its float
// matrix products in Intel oneMKL, which picks its code branch per CPU and, on Intel CPUs with
// AVX-512, may split and schedule a product's work differently from one call to the next: on a
// loaded 16-core Xeon (an H100 host, 2026-11-27) the same 6 steps of configs/default.yaml gave
// three different losses at step 2 in three runs, where this AMD machine gives one. oneMKL's
// conditional numerical reproducibility (MKL_CBWR) in its strict mode makes gemm bitwise the same
// on every run and every thread count of the branch it picks; MKL_DYNAMIC=FALSE keeps the thread
// count the one asked for. Both are read at oneMKL's first call, so they are set before any tensor
// exists; a value the user exported stands.
#pragma once

#include <cstdlib>

namespace tessel::device {

inline void reproducible_cpu_blas() {
  setenv("MKL_CBWR", "AUTO,STRICT", /*overwrite=*/0);
  setenv("MKL_DYNAMIC", "FALSE", /*overwrite=*/0);
}

}  // namespace tessel::device
