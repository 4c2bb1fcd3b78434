#include "models/activations.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>

#include "models/activation_kernels.h"

namespace tessel::models {
namespace {

class GeluTanhCpu : public torch::autograd::Function<GeluTanhCpu> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in) {
    // Named in --profile's table: a custom function's forward is no dispatched operator, so
    // without this its time would count as its caller's.
    RECORD_FUNCTION("tessel::gelu_tanh", std::vector<c10::IValue>());
    torch::Tensor slope;
    auto y = gelu_tanh_cpu(x_in, &slope);
    // The slope, not x, is kept: backward is one product (no exp), and x is needed by no one
    // else (the next linear keeps y), so the memory held is the same.
    ctx->save_for_backward({slope});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // In place when nothing else holds the incoming gradient (the next linear's input gradient,
    // just written): the product then goes where its operand already sits in cache instead of
    // into a fresh [tokens, width] buffer. Held here by the engine's list and this node's copy of
    // it (LibTorch's CppNode::apply); a third holder (a gradient shared with another branch)
    // keeps it untouched (tests/unit/activation_test.cpp).
    auto& g = grads[0];
    const auto slope = ctx->get_saved_variables()[0];
    if (g.use_count() <= 2 && g.storage().use_count() == 1 && g.is_contiguous() &&
        g.sizes() == slope.sizes())
      return {g.mul_(slope)};
    return {g * slope};
  }
};

}  // namespace

bool gelu_tanh_uses_cpu_kernel(const torch::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32;
}

torch::Tensor gelu_tanh_cpu(const torch::Tensor& x, torch::Tensor* slope) {
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const float* px = xc.const_data_ptr<float>();
  float* py = y.mutable_data_ptr<float>();
  if (!slope) {
    kernels::gelu_tanh_forward(px, py, xc.numel());  // over the intra-op threads
    return y;
  }
  *slope = torch::empty_like(xc);
  kernels::gelu_tanh_forward_slope(px, py, slope->mutable_data_ptr<float>(), xc.numel());
  return y;
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!gelu_tanh_uses_cpu_kernel(x)) return torch::gelu(x, "tanh");
  if (torch::GradMode::is_enabled() && x.requires_grad()) return GeluTanhCpu::apply(x);
  return gelu_tanh_cpu(x);  // no backward to come (evaluation, generation): y alone
}

}  // namespace tessel::models
