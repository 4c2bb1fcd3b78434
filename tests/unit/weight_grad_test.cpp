// The zero-bubble split (parallel/pp/weight_grad.h): linear() is torch's linear forward and
// backward; B then W is one whole backward (tests/common/weight_grad_cases.h, also on CUDA); one
// store at a time.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "parallel/pp/weight_grad.h"
#include "tests/common/weight_grad_cases.h"

namespace tessel::parallel::pp {
namespace {

TEST(WeightGrad, LinearIsTorchLinear) {
  torch::manual_seed(0);
  auto x = torch::randn({2, 5, 4}).requires_grad_(true);
  auto w = torch::randn({6, 4}).requires_grad_(true), b = torch::randn({6}).requires_grad_(true);
  auto g = torch::randn({2, 5, 6});
  auto y = pp::linear(x, w, b);
  y.backward(g);
  auto x2 = x.detach().clone().requires_grad_(true), w2 = w.detach().clone().requires_grad_(true),
       b2 = b.detach().clone().requires_grad_(true);
  auto y2 = torch::nn::functional::linear(x2, w2, b2);
  y2.backward(g);
  EXPECT_TRUE(torch::allclose(y, y2, 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(x.grad(), x2.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(w.grad(), w2.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(b.grad(), b2.grad(), 1e-5, 1e-6));
  auto no_bias = pp::linear(x.detach(), w);  // no bias, input without gradient
  EXPECT_TRUE(torch::allclose(no_bias, torch::nn::functional::linear(x.detach(), w), 1e-6, 1e-6));
}

TEST(WeightGrad, BThenWIsOneBackward) { testing::check_split_backward(torch::kCPU); }

TEST(WeightGrad, OneStoreAtATime) {
  WeightGrads a, b;
  Deferring scope(a);
  EXPECT_EQ(deferring(), &a);
  EXPECT_THROW(Deferring again(b), c10::Error);
}

}  // namespace
}  // namespace tessel::parallel::pp
