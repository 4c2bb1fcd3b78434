// training.fp8's linear layer (core/kernels/fp8.h through parallel/pp/weight_grad.h's linear)
// against the recipes' definitions written out here in fp64: the scales (tensorwise: 448/amax;
// rowwise: a power of two per row), the saturated casts, and y, dx and dw as the dequantised fp8
// operands' products. torchao itself is the reference of tests/reference/fp8_torchao_test.py.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "core/kernels/fp8.h"
#include "parallel/pp/weight_grad.h"

namespace tessel::testing {
namespace {

namespace fp8 = kernels::fp8;
constexpr auto kE4m3 = torch::kFloat8_e4m3fn;
constexpr auto kE5m2 = torch::kFloat8_e5m2;

double max_rel(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got.to(torch::kFloat64) - want).abs().max() / want.abs().max()).item<double>();
}

// The recipe's cast, written out: scale = max / amax in fp64 (then fp32; rowwise rounded down to
// a power of two), values saturated at ±max. `dim` -1: one scale; else the amax along `dim`.
std::pair<torch::Tensor, torch::Tensor> reference_cast(const torch::Tensor& x, c10::ScalarType t,
                                                       int64_t dim, bool pow2) {
  const double max = t == kE4m3 ? 448.0 : 57344.0;
  auto amax = dim < 0 ? x.abs().max() : x.abs().amax({dim}, true);
  auto scale = (max / amax.to(torch::kFloat64)).to(torch::kFloat32);
  if (pow2) scale = torch::exp2(torch::floor(torch::log2(scale)));
  auto q = (x * scale).clamp(-max, max).to(t).to(torch::kFloat64);
  return {q, scale.to(torch::kFloat64)};
}

struct Case {
  torch::Tensor x, w, g;
};
Case inputs() {
  torch::manual_seed(3);
  return {torch::randn({48, 32}) * 3, torch::randn({16, 32}) * 0.05, torch::randn({48, 16}) * 1e-3};
}

// y, dx and dw of pp::linear with the recipe (the weight gradient as backward leaves it).
std::vector<torch::Tensor> run_linear(const fp8::Spec& spec, const Case& c) {
  auto x = c.x.clone().requires_grad_(true), w = c.w.clone().requires_grad_(true);
  auto y = parallel::pp::linear(x.view({3, 16, 32}), w, {}, true, &spec);
  y.backward(c.g.view({3, 16, 16}));
  return {y.reshape({48, 16}).detach(), x.grad(), w.grad()};
}

TEST(Fp8, TensorwiseLinearIsTheDequantisedProducts) {
  const auto c = inputs();
  const auto got = run_linear({fp8::Recipe::kTensorwise}, c);
  auto [xq, sx] = reference_cast(c.x, kE4m3, -1, false);
  auto [wq, sw] = reference_cast(c.w, kE4m3, -1, false);
  auto [gq, sg] = reference_cast(c.g, kE5m2, -1, false);
  EXPECT_LT(max_rel(got[0], xq.mm(wq.t()) / (sx * sw)), 1e-6);
  EXPECT_LT(max_rel(got[1], gq.mm(wq) / (sg * sw)), 1e-6);
  EXPECT_LT(max_rel(got[2], gq.t().mm(xq) / (sg * sx)), 1e-6);
  // Not the fp32 product: the fp8 rounding is there (e4m3 keeps 3 bits of mantissa).
  EXPECT_GT(max_rel(got[0], c.x.to(torch::kFloat64).mm(c.w.to(torch::kFloat64).t())), 1e-3);
}

TEST(Fp8, RowwiseScalesEachOperandAlongTheInnerDimension) {
  const auto c = inputs();
  const auto got = run_linear({fp8::Recipe::kRowwise}, c);
  // y: x per token, w per output feature; dx: g per token, w per input feature; dw: g per
  // output feature and x per input feature, both over the tokens. All e4m3.
  auto [xr, sxr] = reference_cast(c.x, kE4m3, 1, true);
  auto [wr, swr] = reference_cast(c.w, kE4m3, 1, true);
  EXPECT_LT(max_rel(got[0], xr.mm(wr.t()) / sxr / swr.t()), 1e-6);
  auto [gr, sgr] = reference_cast(c.g, kE4m3, 1, true);
  auto [wc, swc] = reference_cast(c.w, kE4m3, 0, true);
  EXPECT_LT(max_rel(got[1], gr.mm(wc) / sgr / swc), 1e-6);
  auto [gc, sgc] = reference_cast(c.g, kE4m3, 0, true);
  auto [xc, sxc] = reference_cast(c.x, kE4m3, 0, true);
  EXPECT_LT(max_rel(got[2], gc.t().mm(xc) / sgc.t() / sxc), 1e-6);
  // The scales are powers of two.
  auto s = fp8::cast(c.x, kE4m3, 1, true, {}).scale;
  EXPECT_TRUE(torch::equal(s, torch::exp2(torch::round(torch::log2(s)))));
}

TEST(Fp8, AnAmaxIsCompletedByTheGroupThatSplitsItsAxis) {
  // A rank holding part of x's features: the reduce over `in` brings the other ranks' larger
  // amax, and the scale is theirs, as one device holding all of x would have it.
  fp8::Reduce in = [](torch::Tensor& amax) { amax.clamp_min_(100.0f); };
  auto x = torch::full({4, 16}, 2.0f);
  auto s = fp8::cast(x, kE4m3, -1, false, {&in});
  EXPECT_FLOAT_EQ(s.scale.item<float>(), static_cast<float>(448.0 / 100.0));
  auto rows = fp8::cast(x, kE4m3, 1, true, {&in});  // rowwise: [4, 1], 2^floor(log2(4.48))
  EXPECT_EQ(rows.scale.sizes(), (std::vector<int64_t>{4, 1}));
  EXPECT_FLOAT_EQ(rows.scale[0][0].item<float>(), 4.0f);
}

TEST(Fp8, CastsSaturateInsteadOfOverflowing) {
  // torch 2.11's eager cast turns e4m3 overflow into NaN; the recipe clamps to ±448 first.
  auto x = torch::tensor({1.0f, -3.0f, 0.1875f});
  auto q = fp8::cast_with(x, kE4m3, torch::tensor(500.0f)).data.to(torch::kFloat32);
  EXPECT_TRUE(torch::equal(q, torch::tensor({448.0f, -448.0f, 96.0f})));
  auto zero = fp8::cast(torch::zeros({2, 16}), kE4m3, -1, false, {});  // amax 0: scale 448/1e-12
  EXPECT_TRUE(std::isfinite(zero.scale.item<float>()));
  EXPECT_EQ(zero.data.to(torch::kFloat32).abs().sum().item<float>(), 0.0f);
}

TEST(Fp8, OffIsTorchsLinear) {
  const auto c = inputs();
  fp8::Spec off;
  auto y = parallel::pp::linear(c.x, c.w, {}, true, &off);
  EXPECT_TRUE(torch::equal(y, at::linear(c.x, c.w)));
}

}  // namespace
}  // namespace tessel::testing
