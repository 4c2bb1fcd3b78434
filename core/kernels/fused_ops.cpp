#include "core/kernels/fused_ops.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include "core/kernels/activation_kernels.h"
#include "core/kernels/activations.h"
#include "core/kernels/norm_kernels.h"

namespace tessel::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

float* floats(torch::Tensor& t) { return t.mutable_data_ptr<float>(); }
const float* floats(const torch::Tensor& t) { return t.const_data_ptr<float>(); }

// Names in --profile's table: a custom function's forward is no dispatched operator.
#define TESSEL_NAMED(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

class RmsNormFn : public torch::autograd::Function<RmsNormFn> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& w, double eps) {
    TESSEL_NAMED("tessel::rms_norm");
    auto x = x_in.contiguous();
    const int64_t h = x.size(-1), rows = x.numel() / h;
    auto y = torch::empty_like(x);
    auto rstd = torch::empty({rows}, x.options());
    cpu::rms_norm_forward(floats(x), floats(w), floats(y), floats(rstd), rows, h,
                          static_cast<float>(eps));
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TESSEL_NAMED("tessel::rms_norm_backward");
    const auto s = ctx->get_saved_variables();
    const auto &x = s[0], &w = s[1], &rstd = s[2];
    auto dy = grads[0].contiguous();
    const int64_t h = x.size(-1), rows = x.numel() / h;
    auto dx = torch::empty_like(x), dw = torch::empty_like(w);
    cpu::rms_norm_backward(floats(dy), floats(x), floats(w), floats(rstd), floats(dx), floats(dw),
                           rows, h);
    return {dx, dw, torch::Tensor()};
  }
};

class SwigluFn : public torch::autograd::Function<SwigluFn> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_in,
                               const torch::Tensor& up_in) {
    TESSEL_NAMED("tessel::swiglu");
    auto gate = gate_in.contiguous(), up = up_in.contiguous();
    auto y = torch::empty_like(gate);
    cpu::swiglu_forward(floats(gate), floats(up), floats(y), y.numel());
    ctx->save_for_backward({gate, up});  // the sigmoid is recomputed in backward
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TESSEL_NAMED("tessel::swiglu_backward");
    const auto s = ctx->get_saved_variables();
    // du into dy's buffer when nothing else holds it (core/kernels/activations.h, sole_gradient):
    // the down projection's input gradient, just written.
    const bool own_dy = sole_gradient(grads[0], s[1].sizes());
    auto dy = grads[0].contiguous();
    auto dg = torch::empty_like(s[0]), du = own_dy ? dy : torch::empty_like(s[1]);
    cpu::swiglu_backward(floats(dy), floats(s[0]), floats(s[1]), floats(dg), floats(du),
                         dy.numel());
    return {dg, du};
  }
};

// x [b, heads, s, d] with a contiguous last dimension (else a contiguous copy), out laid out as x.
torch::Tensor rope_cpu(const torch::Tensor& x_in, const torch::Tensor& cos,
                       const torch::Tensor& sin, bool backward) {
  auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  auto out = torch::empty_like(x);
  // Tables [s, d] shared by every row, or [b, s, d] (positions restarting per document).
  const bool per_row = cos.dim() == 3;
  const cpu::RopeRows rows{x.size(0),
                           x.size(1),
                           x.size(2),
                           x.size(3),
                           x.stride(0),
                           x.stride(1),
                           x.stride(2),
                           out.stride(0),
                           out.stride(1),
                           out.stride(2),
                           per_row ? x.size(2) * x.size(3) : 0};
  TORCH_CHECK(out.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && (!per_row || cos.size(0) == x.size(0)) &&
                  cos.size(-2) == x.size(2) && cos.size(-1) == x.size(3),
              "rope: x ", x.sizes(), " against tables ", cos.sizes());
  cpu::rope(floats(x), floats(cos), floats(sin), floats(out), rows, backward);
  return out;
}

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    TESSEL_NAMED("tessel::rope");
    ctx->save_for_backward({cos, sin});
    return rope_cpu(x, cos, sin, false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TESSEL_NAMED("tessel::rope_backward");
    const auto s = ctx->get_saved_variables();
    return {rope_cpu(grads[0], s[0], s[1], true), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool fused_cpu(const torch::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       bool fused) {
  // (Without a gradient wanted, apply runs forward alone and keeps nothing.)
  if (fused && fused_cpu(x) && fused_cpu(weight)) return RmsNormFn::apply(x, weight, eps);
  // LibTorch's fused kernel (CUDA's one pass each way; on the CPU the same operator): statistics
  // in fp32 and the weight applied before the cast to x's dtype (the composite casts first; one
  // rounding apart in bf16). It keeps x and one fp32 scale per row for backward. It wants the
  // weight in x's dtype, which the model's weights are; fp64 (the tests' reference) stays on the
  // composite, whose statistics are fp32 as Hugging Face computes them.
  const auto dtype = x.scalar_type();
  if (weight.scalar_type() == dtype &&
      (dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kHalf))
    return std::get<0>(at::_fused_rms_norm(x, {x.size(-1)}, weight, eps));
  auto x32 = x.to(torch::kFloat32);
  auto y = x32 * torch::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * y.to(x.scalar_type());
}

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up, bool fused) {
  if (fused && fused_cpu(gate) && fused_cpu(up)) return SwigluFn::apply(gate, up);
  return torch::silu(gate) * up;
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                   bool fused) {
  if (fused && fused_cpu(x) && fused_cpu(cos) && fused_cpu(sin))
    return RopeFn::apply(x, cos.contiguous(), sin.contiguous());
  auto halves = x.chunk(2, -1);
  auto rotated = torch::cat({-halves[1], halves[0]}, -1);
  if (cos.dim() == 3) return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1);  // per row
  return x * cos + rotated * sin;
}

}  // namespace tessel::kernels
