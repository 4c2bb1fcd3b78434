// The zero-bubble split (parallel/pp/weight_grad.h): linear() is torch's linear forward and
// backward; B then W is one whole backward (tests/common/weight_grad_cases.h, also on CUDA); one
// store at a time.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <atomic>
#include <string_view>

#include "core/observe/counters.h"
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

// W holds one parameter's gradient at a time (computed, accumulated, dropped), not the chunk's:
// eight 256x256 linear layers' weight gradients (256 KiB each) add at most about two of them to
// what is allocated while W runs, and every hook fires once.
TEST(WeightGrad, WHoldsOneParametersGradientAtATime) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> ws;
  for (int i = 0; i < 8; ++i) ws.push_back((torch::randn({256, 256}) / 16).requires_grad_(true));
  auto x = torch::randn({64, 256}).requires_grad_(true);
  auto y = x;
  for (auto& w : ws) y = pp::linear(y, w);
  int fired = 0;
  for (auto& w : ws)
    w.register_hook([&fired](const torch::Tensor& g) {
      ++fired;
      return g;
    });
  WeightGrads store;
  {
    Deferring scope(store);
    backward_input(torch::autograd::impl::gradient_edge(y), torch::ones_like(y), {x});
  }
  for (auto& w : ws) w.mutable_grad() = torch::zeros_like(w);  // accumulated into, as in training
  fired = 0;  // (B's capture of the leaves runs the tensor hooks too)
  auto& counter = observe::CpuAllocationCounter::get();
  counter.take_peak();
  const int64_t before = counter.now();
  store.deliver();
  const int64_t one = 256 * 256 * 4;
  EXPECT_LE(counter.take_peak() - before, 2 * one + 4096);
  EXPECT_EQ(fired, 8);
  for (auto& w : ws) EXPECT_GT(w.grad().abs().sum().item<double>(), 0);
}

std::atomic<int> graph_tasks{0};

std::unique_ptr<at::ObserverContext> count_graph_task(const at::RecordFunction& fn) {
  if (std::string_view(fn.name()).rfind("autograd::engine::evaluate_function", 0) == 0)
    ++graph_tasks;
  return nullptr;
}

// W hands each gradient straight to its parameter's accumulator: no autograd graph task per
// parameter (on CUDA each one is a hand-over to the device's autograd thread and back), while
// the parameter's own hooks still see it once.
TEST(WeightGrad, WRunsNoAutogradGraphTask) {
  std::vector<torch::Tensor> ws;
  for (int i = 0; i < 6; ++i) ws.push_back(torch::randn({16, 16}).requires_grad_(true));
  auto x = torch::randn({4, 16}).requires_grad_(true);
  auto y = x;
  for (auto& w : ws) y = pp::linear(y, w);
  WeightGrads store;
  {
    Deferring scope(store);
    backward_input(torch::autograd::impl::gradient_edge(y), torch::ones_like(y), {x});
  }
  int hooked = 0;
  for (auto& w : ws) w.register_hook([&hooked](const torch::Tensor& g) { return ++hooked, g * 2; });
  const auto handle = at::addGlobalCallback(at::RecordFunctionCallback(count_graph_task));
  graph_tasks = 0;
  store.deliver();
  at::removeCallback(handle);
  EXPECT_EQ(graph_tasks.load(), 0);
  EXPECT_EQ(hooked, 6);
  // The whole backward's gradients, doubled by the hooks.
  auto x2 = x.detach().requires_grad_(true);
  std::vector<torch::Tensor> w2;
  for (auto& w : ws) w2.push_back(w.detach().clone().requires_grad_(true));
  auto y2 = x2;
  for (auto& w : w2) y2 = torch::nn::functional::linear(y2, w);
  y2.backward(torch::ones_like(y2));
  for (size_t i = 0; i < ws.size(); ++i)
    EXPECT_TRUE(torch::allclose(ws[i].grad(), 2 * w2[i].grad(), 1e-5, 1e-6)) << i;
}

}  // namespace
}  // namespace tessel::parallel::pp
