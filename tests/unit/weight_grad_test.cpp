// The zero-bubble split (parallel/pp/weight_grad.h): linear() is torch's linear forward and
// backward; a B under a Deferring scope yields the input's gradient and leaves the parameters
// untouched; its W then gives every parameter the gradient one whole backward gives.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "parallel/pp/weight_grad.h"

namespace tessel::parallel::pp {
namespace {

struct Net {
  torch::Tensor w1 = torch::randn({6, 4}).requires_grad_(true);
  torch::Tensor b1 = torch::randn({6}).requires_grad_(true);
  torch::Tensor w2 = torch::randn({3, 6}).requires_grad_(true);
  torch::Tensor scale = torch::randn({3}).requires_grad_(true);  // not a linear layer's
  std::vector<torch::Tensor> params() const { return {w1, b1, w2, scale}; }
  torch::Tensor forward(const torch::Tensor& x) const {
    return pp::linear(torch::tanh(pp::linear(x, w1, b1)), w2) * scale;
  }
};

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

TEST(WeightGrad, BThenWIsOneBackward) {
  torch::manual_seed(1);
  Net net;
  auto x = torch::randn({2, 5, 4});
  auto g = torch::randn({2, 5, 3});
  // One whole backward, twice (gradients accumulate over micro-batches).
  auto in = x.clone().requires_grad_(true);
  for (int i = 0; i < 2; ++i) net.forward(in).backward(g);
  std::vector<torch::Tensor> whole;
  for (auto& p : net.params())
    whole.push_back(p.grad().clone()), p.mutable_grad() = torch::Tensor();
  const auto whole_x = in.grad().clone();
  // B, then W, twice: B leaves the parameters alone.
  for (int i = 0; i < 2; ++i) {
    auto in2 = x.clone().requires_grad_(true);
    auto y = net.forward(in2);
    WeightGrads store;
    {
      Deferring scope(store);
      auto gx = backward_input(torch::autograd::impl::gradient_edge(y), g, {in2});
      EXPECT_TRUE(torch::allclose(gx[0], whole_x / 2, 1e-5, 1e-6));
    }
    for (const auto& p : net.params())
      if (i == 0) EXPECT_FALSE(p.grad().defined());
    EXPECT_FALSE(store.empty());
    store.deliver();
    EXPECT_TRUE(store.empty());
  }
  for (size_t i = 0; i < whole.size(); ++i)
    EXPECT_TRUE(torch::allclose(net.params()[i].grad(), whole[i], 1e-5, 1e-6)) << "parameter " << i;
}

TEST(WeightGrad, OneStoreAtATime) {
  WeightGrads a, b;
  Deferring scope(a);
  EXPECT_EQ(deferring(), &a);
  EXPECT_THROW(Deferring again(b), c10::Error);
}

}  // namespace
}  // namespace tessel::parallel::pp
