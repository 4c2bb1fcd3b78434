// A mixture-of-experts layer on any device against the same layer on the CPU in fp32: the
// router's choices, the grouped expert matmuls (at::_grouped_mm's device kernel or its fallback),
// the combine and the balance loss's gradient, forward and backward. Shared by the unit tests
// (CPU) and the GPU suite (CUDA, fp32 and bf16).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/moe.h"

namespace tessel::testing {

inline void check_moe_on(const torch::Device& device, torch::ScalarType dtype, double tol) {
  parallel::Group solo{"solo", {0}, 0, nullptr}, solo_ep{"solo", {0}, 0, nullptr};
  models::DecoderOptions o;
  o.model.arch = tessel::plan::ModelArch::kLlama;
  o.model.layers = 1, o.model.hidden = 64, o.model.heads = 4, o.model.kv_heads = 4;
  o.model.moe.experts = 8, o.model.moe.top_k = 2, o.model.moe.ffn_hidden = 32;
  o.model.moe.shared = 1, o.model.moe.aux_loss_coef = 0.1;
  o.mlp = plan::Mlp::kSwiGlu, o.linear_bias = false;
  o.tp = &solo, o.ep = &solo_ep;
  auto run = [&](const torch::Device& dev, torch::ScalarType dt) {
    torch::manual_seed(5);
    models::MoeState state;
    auto moe = std::make_shared<models::MoeImpl>(o, 0, &state);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : moe->parameters()) p.normal_(0, 0.2);
    }
    moe->to(dev, dt);
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(dev);
    state.counts = torch::zeros({1, 8}, f32), state.aux = torch::zeros({1}, f32);
    state.dropped = torch::zeros({1}, f32), state.loss_factor = torch::full({}, 0.5, f32);
    state.seq_len = 24;
    auto x = torch::randn({3, 24, 64}).to(dev, dt).requires_grad_(true);
    auto g = torch::randn({3, 24, 64}).to(dev, dt);
    auto y = moe->forward(x);
    y.backward(g);
    std::vector<torch::Tensor> out{y.detach(),       x.grad(),         moe->router.grad(),
                                   moe->gate.grad(), moe->down.grad(), state.counts};
    for (auto& t : out) t = t.to(torch::kCPU, torch::kFloat32);
    return out;
  };
  const auto want = run(torch::kCPU, torch::kFloat32), got = run(device, dtype);
  const char* what[] = {"output", "input grad", "router grad", "gate grad", "down grad", "counts"};
  for (size_t i = 0; i < want.size(); ++i) {
    const double scale = std::max(1e-12, want[i].abs().max().item<double>());
    EXPECT_LT((got[i] - want[i]).abs().max().item<double>() / scale, tol) << what[i];
  }
}

}  // namespace tessel::testing
