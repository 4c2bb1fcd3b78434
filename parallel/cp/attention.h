// Context parallelism: the sequence of every micro-batch is cut into 2·cp chunks and cp rank r
// holds chunks r and 2·cp−1−r, so each rank gets the same share of causal attention work (an
// early chunk sees few keys, its partner many). Everything outside attention is per token and
// runs on the local 2 chunks unchanged; attention needs every earlier key, so it is the one
// place that talks to the cp group:
//   allgather: all-gather K and V over cp (reduce-scatter their gradients in backward, in fp32),
//              then each local query chunk attends to its own chunk (causal) and to every
//              earlier chunk (one unmasked block), merged by log-sum-exp;
//   ring:      K/V blocks travel around the cp ring by p2p (the next block's transfer overlaps
//              the current block's attention); partial results are merged by log-sum-exp, and
//              backward sends dK/dV around the ring with their blocks, back to their owners.
// Both use the block kernels of parallel/attention_kernels.h (the CPU flash kernel; the
// memory-efficient kernel on CUDA), which return the log-sum-exp, and accumulate in fp32.
#pragma once

#include <torch/types.h>

#include <string>

#include "parallel/comm.h"

namespace tessel::parallel::cp {

enum class Method { kAllGather, kRing };
/// "allgather" | "ring" (parallel.context.method).
Method method_of(const std::string& name);

/// The global positions of cp rank `rank`'s tokens of a `seq`-token sequence: chunk `rank`, then
/// chunk 2·cp−1−rank. int64 [seq / cp].
torch::Tensor local_positions(int64_t seq, int64_t cp, int64_t rank, const torch::Device& device);

/// This rank's two chunks of `x` along `dim` (whose size is the whole sequence), concatenated.
torch::Tensor local_chunks(const torch::Tensor& x, int64_t dim, int64_t cp, int64_t rank);

/// Causal attention of this rank's queries against the whole sequence's keys and values.
/// q: [b, heads, 2c, d], k, v: [b, kv_heads, 2c, d] (this rank's two chunks, c = seq / (2·cp);
/// heads a multiple of kv_heads: grouped-query) -> [b, heads, 2c, d]. Differentiable.
torch::Tensor attention(Group& cp, Method method, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v);

}  // namespace tessel::parallel::cp
