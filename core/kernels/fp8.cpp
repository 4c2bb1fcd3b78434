#include "core/kernels/fp8.h"

#include <ATen/ATen.h>

namespace tessel::kernels::fp8 {
namespace {

constexpr auto kE4m3 = torch::kFloat8_e4m3fn;
constexpr auto kE5m2 = torch::kFloat8_e5m2;

double finfo_max(c10::ScalarType dtype) {
  return dtype == kE4m3 ? 448.0 : 57344.0;  // torch.finfo(float8_e4m3fn / float8_e5m2).max
}

bool tensorwise(const Scaled& s) { return s.scale.dim() == 0; }

Scaled transposed(const Scaled& s) { return {s.data.t(), tensorwise(s) ? s.scale : s.scale.t()}; }

// amax / scale as torchao's amax_to_scale: float64 division, then float32.
torch::Tensor scale_of(torch::Tensor amax, c10::ScalarType dtype, bool power_of_two) {
  auto s = (finfo_max(dtype) / amax.to(torch::kFloat64).clamp_min(1e-12)).to(torch::kFloat32);
  return power_of_two ? at::exp2(at::floor(at::log2(s))) : s;
}

}  // namespace

Scaled cast(const torch::Tensor& x, c10::ScalarType dtype, int64_t dim, bool power_of_two,
            std::initializer_list<const Reduce*> reduces) {
  torch::NoGradGuard no_grad;
  auto amax = (dim < 0 ? x.abs().max() : x.abs().amax({dim}, /*keepdim=*/true)).to(torch::kFloat32);
  for (const Reduce* r : reduces)
    if (r && *r) (*r)(amax);
  return cast_with(x, dtype, scale_of(amax, dtype, power_of_two));
}

Scaled cast_with(const torch::Tensor& x, c10::ScalarType dtype, const torch::Tensor& scale) {
  torch::NoGradGuard no_grad;
  const double m = finfo_max(dtype);
  return {(x.to(torch::kFloat32) * scale).clamp_(-m, m).to(dtype), scale};
}

torch::Tensor scaled_mm(const Scaled& a, const Scaled& b, c10::ScalarType out, bool fast_accum) {
  torch::NoGradGuard no_grad;
  // The one layout every kernel takes: a row-major, b column-major (cuBLASLt's "TN").
  const auto a_data = a.data.is_contiguous() ? a.data : a.data.contiguous();
  const auto b_data = b.data.t().is_contiguous() ? b.data : b.data.t().contiguous().t();
  const auto ia = a.scale.reciprocal(), ib = b.scale.reciprocal();
  if (tensorwise(a) && tensorwise(b))
    return at::_scaled_mm(a_data, b_data, ia, ib, {}, {}, out, fast_accum);
  TORCH_CHECK(!tensorwise(a) && !tensorwise(b), "fp8: one operand rowwise, the other tensorwise");
  if (a_data.is_cuda()) {  // the rowwise kernel writes bf16 only (torchao casts it as here)
    auto y = at::_scaled_mm(a_data, b_data, ia, ib, {}, {}, torch::kBFloat16, fast_accum);
    return y.to(out);
  }
  // The kernel's definition: exact products of fp8 values, fp32 sums, then both inverse scales.
  auto y = a_data.to(torch::kFloat32).mm(b_data.to(torch::kFloat32));
  return y.mul_(ia).mul_(ib).to(out);
}

torch::Tensor forward(const Spec& s, const torch::Tensor& x, const torch::Tensor& w, Kept& kept) {
  if (s.recipe == Recipe::kTensorwise) {
    const auto xs = cast(x, kE4m3, -1, false, {&s.tokens, &s.in});
    const auto ws = cast(w, kE4m3, -1, false, {&s.out, &s.in});
    kept = {xs.scale, ws.scale};
    return scaled_mm(xs, transposed(ws), x.scalar_type(), true);
  }
  TORCH_CHECK(s.recipe == Recipe::kRowwise, "fp8::forward with training.fp8 off");
  kept = {};
  const auto xs = cast(x, kE4m3, 1, true, {&s.in});  // per token
  const auto ws = cast(w, kE4m3, 1, true, {&s.in});  // per output feature
  return scaled_mm(xs, transposed(ws), x.scalar_type(), true);
}

Grad grad_of(const Spec& s, const torch::Tensor& g) {
  if (s.recipe == Recipe::kTensorwise) return {g, cast(g, kE5m2, -1, false, {&s.tokens, &s.out})};
  return {g, {}};
}

torch::Tensor grad_input(const Spec& s, const Grad& g, const torch::Tensor& w, const Kept& kept) {
  const auto out = g.g.scalar_type();
  if (s.recipe == Recipe::kTensorwise)
    return scaled_mm(g.tensorwise, cast_with(w, kE4m3, kept.w_scale), out, false);
  const auto gs = cast(g.g, kE4m3, 1, true, {&s.out});  // per token
  const auto ws = cast(w, kE4m3, 0, true, {&s.out});    // per input feature
  return scaled_mm(gs, ws, out, false);
}

torch::Tensor grad_weight(const Spec& s, const Grad& g, const torch::Tensor& x, const Kept& kept) {
  const auto out = g.g.scalar_type();
  if (s.recipe == Recipe::kTensorwise)
    return scaled_mm(transposed(g.tensorwise), cast_with(x, kE4m3, kept.x_scale), out, false);
  const auto gs = cast(g.g, kE4m3, 0, true, {&s.tokens});  // per output feature, over tokens
  const auto xs = cast(x, kE4m3, 0, true, {&s.tokens});    // per input feature, over tokens
  return scaled_mm(transposed(gs), xs, out, false);
}

LinearReduces linear_reduces(Recipe recipe, double tokens, double in, double out) {
  if (recipe == Recipe::kOff) return {};
  // tensorwise: one scalar per cast, x over (tokens, in), w over (out, in), g over (tokens, out)
  if (recipe == Recipe::kTensorwise) return {{{1, 1}, {1, 1}}, {{2, 2}, {}}, {{1, 1}, {1, 1}}};
  // rowwise: x per token and w per output feature over in; g per token and w per input feature
  // over out; g per output feature and x per input feature over the tokens.
  return {{{}, {out + in, 2}}, {{tokens + out, 2}, {}}, {{}, {tokens + in, 2}}};
}

c10::ScalarType grad_dtype(Recipe recipe) { return recipe == Recipe::kTensorwise ? kE5m2 : kE4m3; }

}  // namespace tessel::kernels::fp8
