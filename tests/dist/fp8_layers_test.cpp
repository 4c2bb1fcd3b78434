// training.fp8 under tensor and context parallelism: each split float8 linear layer against the
// same layer in float8 on one device, from the same seeded tensors. With every amax completed
// over the group that splits its axis (parallel/tp/layers.h fp8_spec), each rank casts with the
// single device's scales, so its values are products of the same fp8 numbers and only the
// matmuls' summation splits differ: outputs and every gradient within 1e-6 of the largest.
// Without them (a rank's own amax over its tokens) they differ by fp8 rounding steps (asserted).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "parallel/pp/weight_grad.h"
#include "parallel/tp/layers.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel::tp {
namespace {

namespace fp8 = kernels::fp8;

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max()).item<double>();
}

torch::Tensor chunk_of(const torch::Tensor& t, int64_t dim) {
  auto& g = test_group();
  return t.chunk(g.size(), dim)[static_cast<size_t>(g.rank())].contiguous();
}

// param: (rowwise, sequence parallelism)
class Fp8Layers : public ::testing::TestWithParam<std::tuple<bool, bool>> {
 protected:
  void SetUp() override { torch::manual_seed(77); }
  int64_t t() { return test_group().size(); }
  plan::Fp8 recipe() {
    return std::get<0>(GetParam()) ? plan::Fp8::kRowwise : plan::Fp8::kTensorwise;
  }
  fp8::Spec dense() {
    return {recipe() == plan::Fp8::kRowwise ? fp8::Recipe::kRowwise : fp8::Recipe::kTensorwise};
  }
  // y, dx, dw of the dense fp8 linear on the whole tensors.
  std::vector<torch::Tensor> reference(const torch::Tensor& x, const torch::Tensor& W,
                                       const torch::Tensor& w) {
    const auto spec = dense();
    auto xd = x.clone().requires_grad_(), Wd = W.clone().requires_grad_();
    auto y = pp::linear(xd, Wd, {}, true, &spec);
    (y * w).sum().backward();
    return {y.detach(), xd.grad(), Wd.grad()};
  }
};

TEST_P(Fp8Layers, ColumnParallelLinearHasTheSingleDevicesScales) {
  const bool sp = std::get<1>(GetParam());
  const int64_t b = 2, s = 4 * t(), in = 8 * t(), out = 4 * t();
  auto W = torch::randn({out, in}) * 0.1, x = torch::randn({b, s, in}) * 3,
       w = torch::randn({b, s, out});
  W.select(0, 0).mul_(8);  // rank 0's rows hold the weight's largest values: amaxes differ
  const auto want = reference(x, W, w);
  ColumnParallelLinear layer(test_group(), in, out, false, sp);
  {
    torch::NoGradGuard ng;
    layer->weight.copy_(layer->weight_shard().of(W));
  }
  layer->set_fp8(recipe(), nullptr);
  auto xin = (sp ? chunk_of(x, 1) : x.clone()).requires_grad_();
  auto y = layer(xin);
  (y * chunk_of(w, 2)).sum().backward();
  EXPECT_LT(rel(y, chunk_of(want[0], 2)), 1e-6);
  EXPECT_LT(rel(layer->weight.grad(), chunk_of(want[2], 0)), 1e-6);
  EXPECT_LT(rel(xin.grad(), sp ? chunk_of(want[1], 1) : want[1]), 1e-6);
}

TEST_P(Fp8Layers, RowParallelLinearHasTheSingleDevicesScales) {
  const bool sp = std::get<1>(GetParam());
  const int64_t b = 2, s = 4 * t(), in = 8 * t(), out = 12;
  auto W = torch::randn({out, in}) * 0.1, x = torch::randn({b, s, in}) * 3,
       w = torch::randn({b, s, out});
  x.select(2, 0).mul_(8), W.select(1, 1).mul_(8);  // rank 0's features: the largest values
  const auto want = reference(x, W, w);
  RowParallelLinear layer(test_group(), in, out, false, sp);
  {
    torch::NoGradGuard ng;
    layer->weight.copy_(layer->weight_shard().of(W));
  }
  layer->set_fp8(recipe(), nullptr);
  auto xin = chunk_of(x, 2).requires_grad_();
  auto y = layer(xin);
  (y * (sp ? chunk_of(w, 1) : w)).sum().backward();
  EXPECT_LT(rel(y, sp ? chunk_of(want[0], 1) : want[0]), 1e-6);
  EXPECT_LT(rel(layer->weight.grad(), chunk_of(want[2], 1)), 1e-6);
  EXPECT_LT(rel(xin.grad(), chunk_of(want[1], 2)), 1e-6);
}

TEST_P(Fp8Layers, TokensSplitOverContextParallelRanks) {
  // Each rank holds a chunk of the tokens (as under context parallelism); the weight whole.
  const int64_t b = 2, s = 4 * t(), in = 16, out = 8;
  auto W = torch::randn({out, in}) * 0.1, x = torch::randn({b, s, in}) * 3,
       w = torch::randn({b, s, out});
  x.select(1, 0).mul_(8);  // rank 0's tokens: the largest values
  const auto want = reference(x, W, w);
  for (bool reduce : {true, false}) {  // false: each rank's own amax over its tokens
    auto spec = fp8_spec(recipe(), reduce ? &test_group() : nullptr, nullptr, nullptr);
    auto xin = chunk_of(x, 1).requires_grad_(), Win = W.clone().requires_grad_();
    auto y = pp::linear(xin, Win, {}, true, &spec);
    (y * chunk_of(w, 1)).sum().backward();
    auto dw = Win.grad().clone();
    test_group().all_reduce(dw).wait();  // each rank's tokens' share of the weight's gradient
    const double worst = std::max(
        {rel(y, chunk_of(want[0], 1)), rel(xin.grad(), chunk_of(want[1], 1)), rel(dw, want[2])});
    // Rowwise scales are powers of two, and a power of two moves no value's rounding: its other
    // amax shows only where a value would saturate or fall below e4m3's normal range.
    if (reduce)
      EXPECT_LT(worst, 1e-6);
    else if (t() > 1 && recipe() == plan::Fp8::kTensorwise)
      EXPECT_GT(worst, 1e-4) << "the tokens' amax must matter in this test";
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8Layers,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "Rowwise" : "Tensorwise") +
                                  (std::get<1>(info.param) ? "SequenceParallel" : "");
                         });

}  // namespace
}  // namespace tessel::parallel::tp
