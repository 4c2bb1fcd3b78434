// The seam between a model and what runs around its blocks: the model calls these hooks, and
// parallel/dp/zero3.h implements them (so parallel/ never needs to know the model).
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace tessel::parallel {

/// What runs around the blocks: ZeRO-3 (parallel/dp/zero3.h) gathers a layer's parameters just
/// before it runs and frees them after. `layer` is the global layer index.
class BlockHooks {
 public:
  virtual ~BlockHooks() = default;
  /// Before a chunk's forward: the parameters outside the blocks (embeddings, norm, head).
  virtual void before_stage() = 0;
  virtual torch::Tensor before_block(int64_t layer, const torch::Tensor& x) = 0;
  virtual torch::Tensor after_block(int64_t layer, const torch::Tensor& y) = 0;
};

}  // namespace tessel::parallel
