// The row loops of Tessel's CPU attention for short sequences (parallel/attention_cpu.h is their
// user): softmax over score rows and its backward, in place, on raw fp32 arrays, free of
// LibTorch. Built for AVX2+FMA (intrinsics) and for the baseline instruction set; the CPU picks
// one. Each call splits its rows over LibTorch's intra-op threads.
#pragma once

#include <cstdint>

namespace tessel::parallel::kernels {

/// The rows of a score tensor [batches, rows, n] (rows·batches rows of n floats, contiguous).
/// Row r attends to keys [0, len(r)): every key when not causal, else keys 0..(r mod m) (query
/// r mod m of a block of m queries on the diagonal; grouped heads stack such blocks).
struct ScoreRows {
  int64_t count;  // rows in all
  int64_t n;      // keys per row
  int64_t m;      // queries per block (causal rows)
  bool causal;
  float scale;  // the scores' factor (1/sqrt(head size))
};

/// s <- softmax(scale·s) over each row's keys, 0 past them.
void softmax_rows(float* s, const ScoreRows& rows);
/// dp <- scale·p·(dp - sum_j p_j·dp_j) over each row's keys, 0 past them: the gradient of the
/// unscaled scores given p = softmax(scale·s) and dp the gradient of p.
void softmax_backward_rows(const float* p, float* dp, const ScoreRows& rows);

}  // namespace tessel::parallel::kernels
