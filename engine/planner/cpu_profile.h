// This machine's CPU as a device profile for --dry-run: the rates a CPU step is made of, measured
// now on the threads each rank of the plan will use, so that a CPU plan's predicted step time is
// this machine's (tests/dist/planner_test.py compares it with measured steps).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

#include "core/plan/config.h"
#include "engine/planner/planner.h"

namespace tessel::planner {

/// Threads each rank of `c` computes with on a node running `ranks_on_node` of its processes:
/// training.threads; else OMP_NUM_THREADS; else 1 under tessel-launch with several workers (it
/// sets OMP_NUM_THREADS=1 then); else LibTorch's default for one process.
int64_t cpu_threads_per_rank(const plan::Config& c, int64_t ranks_on_node);

/// Measures (about a second) the matmul rate in the plan's dtype, scaled dot-product
/// attention forward and backward at the plan's head size and sequence, the MLP activation
/// (the model's MLP form's activation_pass) forward and backward, the memory bandwidth of an
/// element-wise add, and with more than one rank the latency and bandwidth of loopback Gloo
/// all-reduce, all-gather and send/receive between two ranks of this process. Rates are per rank:
/// on `cpu_threads_per_rank` threads, shared out when the node's ranks want more threads than it
/// has cores. Sets glibc's malloc to keep freed memory for the rest of the process (the
/// steady state of a training step; meant for --dry-run, which exits after planning).
DeviceProfile measure_cpu_profile(const plan::Config& c, int64_t ranks_on_node);

/// The most one matmul [m, k] × [k, n] in `dtype` allocates at once on this CPU, on `threads`
/// threads, its output included (`a_transposed`: the left operand a transposed view, as a
/// weight gradient's is). LibTorch's bf16/fp16 CPU matmuls go through oneDNN, whose workspaces
/// depend on the CPU and the threads: this is measured, once per shape and thread count, with the
/// counting allocator (core/observe/counters.h). A shape over 2 GFLOP is not run: its result in
/// fp32 and in `dtype`.
double cpu_matmul_bytes(int64_t m, int64_t k, int64_t n, c10::ScalarType dtype, bool a_transposed,
                        int64_t threads);

}  // namespace tessel::planner
