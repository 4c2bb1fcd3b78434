#include "core/kernels/activations.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>

#include "core/kernels/activation_kernels.h"

namespace tessel::kernels {
namespace {

// dy·slope, in place when nothing else holds the incoming gradient (sole_gradient): the product
// then goes where its operand already sits in cache instead of into a fresh [tokens, width] buffer.
torch::Tensor times_slope(torch::Tensor& g, const torch::Tensor& slope) {
  return sole_gradient(g, slope.sizes()) ? g.mul_(slope) : g * slope;
}

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
    return {times_slope(grads[0], ctx->get_saved_variables()[0])};
  }
};

// GELU(x + bias), the bias a linear layer's (models/layers.cpp, GPT-2's MLP): its gradient is
// the column sum of dx, as the linear layer's own backward takes it (parallel/pp/weight_grad.cpp).
class BiasGeluTanhCpu : public torch::autograd::Function<BiasGeluTanhCpu> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& bias) {
    RECORD_FUNCTION("tessel::bias_gelu_tanh", std::vector<c10::IValue>());
    torch::Tensor slope;
    auto y = bias_gelu_tanh_cpu(x, bias, &slope);
    ctx->save_for_backward({slope});
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto dx = times_slope(grads[0], ctx->get_saved_variables()[0]);
    torch::Tensor db;
    if (ctx->needs_input_grad(1)) db = dx.reshape({-1, dx.size(-1)}).sum(0);
    return {dx, db};
  }
};

}  // namespace

bool sole_gradient(const torch::Tensor& g, at::IntArrayRef sizes) {
  return g.use_count() <= 2 && g.storage().use_count() == 1 && g.is_contiguous() &&
         g.sizes() == sizes;
}

bool gelu_tanh_uses_cpu_kernel(const torch::Tensor& x) {
  return x.device().is_cpu() && x.scalar_type() == torch::kFloat32;
}

torch::Tensor gelu_tanh_cpu(const torch::Tensor& x, torch::Tensor* slope) {
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const float* px = xc.const_data_ptr<float>();
  float* py = y.mutable_data_ptr<float>();
  if (!slope) {
    cpu::gelu_tanh_forward(px, py, xc.numel());  // over the intra-op threads
    return y;
  }
  *slope = torch::empty_like(xc);
  cpu::gelu_tanh_forward_slope(px, py, slope->mutable_data_ptr<float>(), xc.numel());
  return y;
}

torch::Tensor bias_gelu_tanh_cpu(const torch::Tensor& x, const torch::Tensor& bias,
                                 torch::Tensor* slope) {
  auto xc = x.contiguous(), b = bias.contiguous();
  TORCH_CHECK(b.dim() == 1 && b.size(0) == xc.size(-1), "bias ", b.sizes(), " for ", xc.sizes());
  auto y = torch::empty_like(xc);
  *slope = torch::empty_like(xc);
  cpu::gelu_tanh_bias_forward_slope(xc.const_data_ptr<float>(), b.const_data_ptr<float>(),
                                    b.size(0), y.mutable_data_ptr<float>(),
                                    slope->mutable_data_ptr<float>(), xc.numel());
  return y;
}

torch::Tensor bias_gelu_tanh(const torch::Tensor& x, const torch::Tensor& bias) {
  if (!gelu_tanh_uses_cpu_kernel(x) || !gelu_tanh_uses_cpu_kernel(bias))
    return torch::gelu(x + bias, "tanh");
  if (torch::GradMode::is_enabled() && (x.requires_grad() || bias.requires_grad()))
    return BiasGeluTanhCpu::apply(x, bias);
  return gelu_tanh_cpu(x + bias);  // no backward to come: y alone, the same values
}

torch::Tensor gelu_tanh(const torch::Tensor& x) {
  if (!gelu_tanh_uses_cpu_kernel(x)) return torch::gelu(x, "tanh");
  if (torch::GradMode::is_enabled() && x.requires_grad()) return GeluTanhCpu::apply(x);
  return gelu_tanh_cpu(x);  // no backward to come (evaluation, generation): y alone
}

}  // namespace tessel::kernels
