// Float8 training of a linear layer y = x·wᵀ (training.fp8), as torchao 0.18's Float8Linear
// computes it (its `tensorwise` and `rowwise` recipes), so that torchao is its reference:
//
//   scale  = finfo(fp8).max / max(amax, 1e-12), in float64, then float32 (rowwise: rounded down to
//            a power of two); amax over the whole tensor (tensorwise) or along one axis (rowwise)
//   cast   = clamp(x·scale, ±finfo(fp8).max) in fp8 (saturated: torch 2.11's casts do not saturate)
//   y      = (x8 · w8ᵀ) / (sx · sw), accumulated in fp32 (at::_scaled_mm on the device's kernel)
//   dx     = g8 · w8, dw = g8ᵀ · x8; tensorwise: g in e5m2, one cast each of x, w and g for all
//            three matmuls; rowwise: g in e4m3, each operand scaled along the matmul's inner
//            dimension (x and g per token for y and dx, per feature over the tokens for dw)
//
// Where the tensor is split across ranks (tensor parallelism splits a weight's rows or columns,
// context parallelism the tokens), each amax is completed over the ranks that hold the rest, so
// every rank's scales are the single-device ones. The CPU runs tensorwise through at::_scaled_mm
// and rowwise as the CUDA kernel defines it (fp8 operands multiplied exactly in fp32, summed in
// fp32, times both scales' inverses); CUDA needs compute capability 8.9 and dimensions that are
// multiples of 16 (engine/run checks both before anything starts).
#pragma once

#include <torch/types.h>

#include <functional>

namespace tessel::kernels::fp8 {

/// training.fp8's recipes (plan::Fp8, which the layers above map onto this).
enum class Recipe { kOff, kTensorwise, kRowwise };

/// Completes an amax (a float32 tensor, in place) over the ranks holding the rest of the tensor
/// along one axis: a MAX all-reduce over their group. Null: this rank holds that axis whole.
using Reduce = std::function<void(torch::Tensor&)>;

/// A linear's three axes (x [tokens, in], w [out, in], g [tokens, out]) and which are split.
struct Spec {
  Recipe recipe = Recipe::kOff;
  Reduce tokens, in, out;
};

/// An fp8 operand: `data` = saturate(x · scale) in fp8, `scale` float32 of shape [] (tensorwise),
/// [rows, 1] or [1, cols] (rowwise).
struct Scaled {
  torch::Tensor data, scale;
};

/// x [rows, cols] cast to `dtype` with one scale (`dim` -1) or one per row (`dim` 1: amax along the
/// columns) or per column (`dim` 0); `reduces` complete the amax over the split axes it spans.
Scaled cast(const torch::Tensor& x, c10::ScalarType dtype, int64_t dim, bool power_of_two,
            std::initializer_list<const Reduce*> reduces);
/// x cast with a scale already made (backward recasts what forward cast: the same bits, no amax).
Scaled cast_with(const torch::Tensor& x, c10::ScalarType dtype, const torch::Tensor& scale);

/// a [m, k] · b [k, n] of two fp8 operands (a's scale [] or [m, 1], b's [] or [1, n]) in `out`
/// dtype: at::_scaled_mm where the device runs it, else the kernel's definition in fp32.
/// `fast_accum`: CUDA's faster, less exact accumulation (torchao uses it for y only).
torch::Tensor scaled_mm(const Scaled& a, const Scaled& b, c10::ScalarType out, bool fast_accum);

/// What forward keeps for backward beside x and w themselves: their tensorwise scales (undefined
/// rowwise, where backward scales along other axes).
struct Kept {
  torch::Tensor x_scale, w_scale;
};

/// y [tokens, out] of x [tokens, in] and w [out, in].
torch::Tensor forward(const Spec& s, const torch::Tensor& x, const torch::Tensor& w, Kept& kept);

/// The output gradient g [tokens, out] as the backward's two matmuls take it (tensorwise: one
/// e5m2 cast for both; rowwise: g itself, cast per gemm).
struct Grad {
  torch::Tensor g;
  Scaled tensorwise;
};
Grad grad_of(const Spec& s, const torch::Tensor& g);
/// dx [tokens, in].
torch::Tensor grad_input(const Spec& s, const Grad& g, const torch::Tensor& w, const Kept& kept);
/// dw [out, in].
torch::Tensor grad_weight(const Spec& s, const Grad& g, const torch::Tensor& x, const Kept& kept);

/// Bytes a cast of `elements` holds while it is made, from an input `w` bytes wide: the input in
/// fp32 (when it is not), the scaled fp32 copy, the fp8 result.
inline double cast_bytes(double elements, double w) {
  return elements * ((w < 4 ? 4.0 : 0.0) + 4.0 + 1.0);
}

/// The amax all-reduces a linear layer's forward or backward issues over the group splitting one
/// of its axes: fp32 elements and calls.
struct Reduces {
  double elements = 0, calls = 0;
  Reduces& operator+=(const Reduces& o) {
    elements += o.elements, calls += o.calls;
    return *this;
  }
};
/// One linear layer's, per axis a group may split (tokens: context parallelism; in and out:
/// tensor parallelism), forward and backward apart (a recomputation reruns the forward's).
struct AxisReduces {
  Reduces forward, backward;
};
struct LinearReduces {
  AxisReduces tokens, in, out;
};
/// Under `recipe`, for `tokens` rows and `in` and `out` features as this rank holds them: as
/// forward(), grad_of(), grad_input() and grad_weight() call their Reduce.
LinearReduces linear_reduces(Recipe recipe, double tokens, double in, double out);

/// The float8 format of each operand under a recipe (for logs, docs and the planner).
c10::ScalarType grad_dtype(Recipe recipe);

}  // namespace tessel::kernels::fp8
