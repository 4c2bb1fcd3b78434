// Zero-bubble pipelines (Qi et al. 2023, arXiv:2401.10241) split a micro-batch's backward into
// B, which computes the gradient of the stage's input (what the previous stage waits for), and
// W, which computes the weights' gradients (what nobody waits for until the optimizer), so that a
// schedule can run W in what would otherwise be a bubble.
//
// B runs the autograd graph with a WeightGrads store active: every linear layer (linear() here)
// then computes only its input's gradient and leaves its weight's matmul (g^T·x) in the store,
// and every other parameter's gradient (norms, biases, embeddings: cheap) is captured there
// instead of reaching the parameter. W computes the deferred matmuls and hands every gradient to
// its parameter through autograd's accumulator, so that whatever watches the parameters (the
// data-parallel reducer's hooks) sees a W exactly as it sees a whole backward.
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/types.h>

#include <functional>
#include <utility>
#include <vector>

#include "core/kernels/fp8.h"

namespace tessel::parallel::pp {

/// One (micro-batch, chunk)'s weight gradients between its B and its W.
class WeightGrads {
 public:
  /// A gradient computed in B.
  void add(const torch::Tensor& param, torch::Tensor grad);
  /// A gradient W computes (a linear layer's weight: `grad` runs the matmul).
  void defer(const torch::Tensor& param, std::function<torch::Tensor()> grad);
  /// W: every gradient, summed per parameter, accumulated into the parameters (their hooks fire).
  void deliver();
  bool empty() const { return items_.empty(); }

 private:
  struct Item {
    torch::Tensor param, grad;
    std::function<torch::Tensor()> later;
  };
  std::vector<Item> items_;
};

/// While alive, backward on any thread hands weight gradients to `store` (one at a time).
class Deferring {
 public:
  explicit Deferring(WeightGrads& store);
  ~Deferring();
  Deferring(const Deferring&) = delete;
  Deferring& operator=(const Deferring&) = delete;
};

/// The store backward hands weight gradients to now; null outside B.
WeightGrads* deferring();

/// B of the graph below `root`: the gradient `grad` taken back to every leaf it reaches, with
/// weight gradients left in the active store. Returns the gradients of `inputs` (undefined where
/// none arrives); every other leaf's goes to the store.
std::vector<torch::Tensor> backward_input(const torch::autograd::Edge& root,
                                          const torch::Tensor& grad,
                                          const std::vector<torch::Tensor>& inputs);

/// y = x·wᵀ + b, as torch's linear, whose weight gradient a zero-bubble B defers to W when
/// `deferrable` (the head's is not: W would keep the logits' gradient alive). With `fp8` (its
/// recipe not off; it outlives the backward) the three matmuls run in float8 (core/kernels/fp8.h)
/// and b is added after, in x's dtype, as torchao does.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {},
                     bool deferrable = true, const kernels::fp8::Spec* fp8 = nullptr);

}  // namespace tessel::parallel::pp
