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
// Both use the block kernels of core/kernels/attention_kernels.h (the CPU flash kernel; the
// memory-efficient kernel on CUDA), which return the log-sum-exp, and accumulate in fp32.
//   alltoall:  (Ulysses; Jacobs et al. 2023, arXiv:2309.14509) one all-to-all trades this rank's
//              tokens of every head for every token of 1/cp of the heads (q, k and v in one
//              message); dense causal attention runs on the whole sequence for those heads (the
//              kernel a single process uses), and a second all-to-all brings the outputs back.
//              Backward is the same two all-to-alls reversed. Query heads per rank must divide by
//              cp; key/value heads that do not are repeated to the least multiple of cp that
//              does (grouped-query attention keeps its grouping).
//   hybrid:    alltoall inside groups of consecutive cp ranks (Group::inner), then ring over the
//              ranks at the same place in every group (Group::outer), each ring member holding
//              its group's tokens of its share of the heads; Megatron-Core's a2a+p2p.
#pragma once

#include <torch/types.h>

#include <string>

#include "core/kernels/document_attention.h"
#include "core/plan/choices.h"
#include "parallel/comm.h"

namespace tessel::parallel::cp {

/// The global positions of cp rank `rank`'s tokens of a `seq`-token sequence: chunk `rank`, then
/// chunk 2·cp−1−rank. int64 [seq / cp].
torch::Tensor local_positions(int64_t seq, int64_t cp, int64_t rank, const torch::Device& device);

/// This rank's two chunks of `x` along `dim` (whose size is the whole sequence), concatenated.
torch::Tensor local_chunks(const torch::Tensor& x, int64_t dim, int64_t cp, int64_t rank);

/// alltoall: the key/value heads each rank's all-to-all carries for `kv_heads` heads per tp rank
/// over `cp` ranks: kv_heads when cp divides it, else their least common multiple (each head
/// repeated lcm / kv_heads times).
int64_t alltoall_kv_heads(int64_t kv_heads, int64_t cp);

/// Causal attention of this rank's queries against the whole sequence's keys and values.
/// q: [b, heads, 2c, d], k, v: [b, kv_heads, 2c, d] (this rank's two chunks, c = seq / (2·cp);
/// heads a multiple of kv_heads: grouped-query) -> [b, heads, 2c, d]. Differentiable. `docs`
/// (the whole sequence's documents; alltoall only): attention kept inside each document.
torch::Tensor attention(Group& cp, plan::CpMethod method, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& v,
                        const kernels::Documents* docs = nullptr);

}  // namespace tessel::parallel::cp
