// Lean logits: the output head fused with the vocabulary-parallel cross-entropy, a chunk of tokens
// at a time, so a micro-batch's [tokens, V/tp] logits are never held at once (the idea of Liger
// Kernel's fused linear cross-entropy). Each chunk's logits are made, turned into the chunk's loss
// and into its gradients (d loss / d logits = softmax - one-hot does not depend on what follows
// the loss but for a scalar factor), multiplied into the gradients of the hidden states and the
// head weight, and dropped. Backward only scales those two by the loss's incoming gradient.
// Memory: one chunk's fp32 logits, plus the gradients of the input [tokens, h] and, in fp32, of
// the weight [V/tp, h], instead of the fp32 logits (and their softmax) of every token kept from
// forward to backward. FLOPs: the same three matmuls as the unfused head and loss.
#pragma once

#include <torch/types.h>

#include "parallel/comm.h"
#include "parallel/tp/layers.h"

namespace tessel::parallel::tp {

/// Sum over rows of the next-token loss of hidden states `y` [N, h] (already entered: every tp
/// rank holds all N rows) through this rank's head rows `weight` [V/tp, h], whose first row is
/// global token `vocab_start`; rows at or beyond `vocab` are padding and never count. Chunks of
/// `chunk_rows` rows (0: all in one). A scalar (fp32); differentiable in `y` and `weight` when
/// grad mode is on, else only the loss is computed, chunk by chunk. `row_weights` [N] fp32
/// (undefined: all 1) weigh each row's loss and gradient (0: the row is not scored).
torch::Tensor fused_head_cross_entropy_sum(Group& tp, const torch::Tensor& y,
                                           const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t vocab_start,
                                           int64_t vocab, int64_t chunk_rows,
                                           const torch::Tensor& row_weights = {});

/// The rows per chunk that keep one chunk's fp32 logits within `budget_bytes` (at least 1).
int64_t head_chunk_rows(int64_t vocab_local, int64_t budget_bytes);

/// Rows per chunk where training.lean_logits_chunk is 0: one chunk's fp32 logits within 64 MiB on
/// a CPU, 1 GiB on a GPU. Every chunk reads and writes the fp32 [V/tp, h] weight gradient once,
/// whatever its rows, and a GPU moves a byte at about 1/300 of its matmul rate: with 64 MiB chunks
/// Llama-3 1B's 8192-token micro-batch (vocabulary 128256) made 63 chunks of 130 tokens, which
/// spent 74 ms of a 301 ms H100 step summing that gradient (bench/RESULTS.md); 1 GiB makes 4.
int64_t default_head_chunk_rows(int64_t vocab_local, bool gpu);

/// What a micro-batch's head and loss keep from its forward to its backward and hold while they
/// run, in bytes, over `tokens` rows, this rank's `vocab_local` rows of the head, width `h`, in
/// elements `w` bytes wide.
struct HeadLossBytes {
  double kept, transient;
};
/// Whole logits (training.lean_logits off): the head's output and the loss's fp32 softmax and
/// gradient buffer (vocab_parallel_cross_entropy) for every token, kept.
inline HeadLossBytes whole_logits_bytes(double tokens, double vocab_local, double w) {
  return {tokens * vocab_local * (w + 4), 0.0};
}
/// fused_head_cross_entropy_sum in chunks of `chunk` rows: forward makes the gradients, kept for
/// backward (the weight's in fp32 and the input's); while it runs, one chunk's output and its
/// fp32 copy, or in bf16/fp16 the chunk's weight gradient as a matmul of its own beside the
/// chunk's logit gradient, before it is widened into the fp32 sum (`matmul`: the device's matmul
/// bytes).
HeadLossBytes fused_head_bytes(double tokens, double vocab_local, double h, double w, double chunk,
                               const MatmulBytes& matmul);

}  // namespace tessel::parallel::tp
