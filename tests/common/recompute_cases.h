// Recomputation replays the forward's random draws (dropout-like pieces), on any device: shared
// by the unit tests (CPU) and the GPU suite (CUDA).
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/recompute.h"

namespace tessel::testing {

inline void check_recompute_replays_rng(const torch::Device& device) {
  torch::manual_seed(7);
  auto x = (torch::rand({64}, torch::TensorOptions().device(device)) + 0.5).requires_grad_();
  // A piece that draws: y = x · r with r uniform; dy/dx = r, so x.grad shows the r of the rerun.
  auto y = models::recompute([](const torch::Tensor& in) { return in * torch::rand_like(in); }, x);
  const auto drawn = (y / x).detach();                              // the forward's r
  auto probe = torch::rand({4}, x.options().requires_grad(false));  // the stream after forward
  y.sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), drawn, 1e-6, 1e-6))
      << "the rerun drew other numbers than the forward on " << device;
  // The rerun leaves the stream where backward found it: the next draw follows `probe`.
  auto after = torch::rand({4}, probe.options());
  torch::manual_seed(7);
  for (int64_t n : {64, 64, 4}) torch::rand({n}, probe.options());  // x, r, probe
  EXPECT_TRUE(torch::equal(after, torch::rand({4}, probe.options())));
}

}  // namespace tessel::testing
