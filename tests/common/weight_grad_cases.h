// The zero-bubble split on any device: B (under a Deferring scope) yields the input's gradient and
// leaves the parameters alone; W then gives every parameter what one whole backward gives, over
// two micro-batches, with a recomputed piece inside (its rerun's backward runs within B). On CUDA
// the autograd engine runs backward on its device thread, which hands the store its gradients.
// Shared by the unit tests (CPU) and the GPU suite (CUDA).
#pragma once

#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "models/recompute.h"
#include "parallel/pp/weight_grad.h"

namespace tessel::testing {

inline void check_split_backward(const torch::Device& device) {
  namespace pp = parallel::pp;
  torch::manual_seed(1);
  const auto opts = torch::TensorOptions().device(device);
  std::vector<torch::Tensor> params{torch::randn({6, 4}, opts), torch::randn({6}, opts),
                                    torch::randn({3, 6}, opts), torch::randn({3}, opts)};
  for (auto& p : params) p.requires_grad_(true);
  auto forward = [&](const torch::Tensor& x) {  // the middle is rerun in backward
    auto h = models::recompute(
        [&](const torch::Tensor& in) { return torch::tanh(pp::linear(in, params[0], params[1])); },
        x);
    return pp::linear(h, params[2]) * params[3];  // params[3]: not a linear layer's
  };
  const auto x = torch::randn({2, 5, 4}, opts), g = torch::randn({2, 5, 3}, opts);
  auto in = x.clone().requires_grad_(true);
  for (int i = 0; i < 2; ++i) forward(in).backward(g);
  std::vector<torch::Tensor> whole;
  for (auto& p : params) whole.push_back(p.grad().clone()), p.mutable_grad() = torch::Tensor();
  const auto whole_x = in.grad() / 2;
  for (int i = 0; i < 2; ++i) {
    auto in2 = x.clone().requires_grad_(true);
    auto y = forward(in2);
    pp::WeightGrads store;
    {
      pp::Deferring scope(store);
      auto gx = pp::backward_input(torch::autograd::impl::gradient_edge(y), g, {in2});
      EXPECT_TRUE(torch::allclose(gx[0], whole_x, 1e-5, 1e-6)) << device;
    }
    for (const auto& p : params)
      if (i == 0) EXPECT_FALSE(p.grad().defined()) << "B reached a parameter on " << device;
    EXPECT_FALSE(store.empty());
    store.deliver();
    EXPECT_TRUE(store.empty());
  }
  for (size_t i = 0; i < whole.size(); ++i)
    EXPECT_TRUE(torch::allclose(params[i].grad(), whole[i], 1e-5, 1e-6))
        << "parameter " << i << " on " << device;
}

}  // namespace tessel::testing
