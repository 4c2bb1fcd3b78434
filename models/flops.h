// What a step is worth, by one convention, declared by each part beside its forward
// (models/layers.h, models/moe.h): the model FLOPs MFU counts and the forward work a
// recomputation reruns. --dry-run and the run's MFU both add up the same declarations.
#pragma once

#include <utility>

#include "core/kernels/fp8.h"

namespace tessel::models {

/// PaLM (appendix B): 6 FLOPs per token for each weight a token passes through (2 in forward, 4
/// in backward; norms' weights and biases count as weights, as N counts every parameter), and
/// attention's own matmuls, 12·H·Q·T per layer (T the sequence length; not halved for the causal
/// mask). Input embeddings (lookups) count nothing; a token table tied to the head counts as the
/// head. A mixture of experts counts the experts a token is routed to (top_k of E).
constexpr const char* kFlopsConvention =
    "PaLM 6N + 12·L·H·Q·T per token (N without input embeddings; attention term not halved; "
    "under a document mask, times the share of attention its documents keep)";

/// FLOPs per token of a part: `train` its forward and backward by the convention, `forward` one
/// forward of it (a third of train: what recomputation reruns, which MFU does not count).
/// `linear`: the share of train in the blocks' tensor-parallel linear layers' matmuls, which
/// training.fp8 runs in float8 (core/kernels/fp8.h).
struct Flops {
  double train = 0, forward = 0, linear = 0;
  Flops& operator+=(const Flops& o) {
    train += o.train, forward += o.forward, linear += o.linear;
    return *this;
  }
};
/// Of `weights` elements every token passes through.
inline Flops weight_flops(double weights) { return {6 * weights, 2 * weights}; }
/// Of `weights` elements, `matrices` of them the weights of tensor-parallel linear layers.
inline Flops weight_flops(double weights, double matrices) {
  return {6 * weights, 2 * weights, 6 * matrices};
}

/// training.fp8's amax all-reduces a part issues per micro-batch (kernels::fp8::linear_reduces),
/// by the group that splits the axis: tp (column layers' output features, row layers' input
/// features) and cp (every layer's tokens).
struct Fp8Reduces {
  kernels::fp8::AxisReduces tp, cp;
  Fp8Reduces& operator+=(const Fp8Reduces& o) {
    for (auto [a, b] : {std::pair{&tp, &o.tp}, std::pair{&cp, &o.cp}})
      a->forward += b->forward, a->backward += b->backward;
    return *this;
  }
};

}  // namespace tessel::models
