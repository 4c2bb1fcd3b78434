// GPT-2's MLP: down(GELU_tanh(up(x))), up with its bias; on the CPU Tessel's kernel adds the bias
// in the GELU's own pass and keeps the slope for backward (core/kernels/activations.h).
#include <torch/torch.h>

#include "core/kernels/activations.h"
#include "models/mlp.h"

namespace tessel::models {
namespace {

class GeluTanh final : public MlpForm {
 public:
  bool gated() const override { return false; }
  torch::Tensor hidden(const torch::Tensor& x, parallel::tp::ColumnParallelLinearImpl& up,
                       parallel::tp::ColumnParallelLinearImpl*, bool own_kernels) const override {
    if (!own_kernels) return torch::gelu(up.forward_entered(x), "tanh");
    if (up.bias.defined() &&
        kernels::gelu_tanh_uses_cpu_kernel(x))  // the bias added in the GELU's pass
      return kernels::bias_gelu_tanh(up.forward_entered(x, false), up.bias);
    return kernels::gelu_tanh(up.forward_entered(x));
  }
  // Up's output and the GELU's (2-core Xeon, CPU fp32, 2026-11-23), either kernel.
  double kept_per_ffn(bool) const override { return 2.0; }
  double backward_extra_per_ffn(bool) const override { return 0.0; }  // one pass, either way
  void activation_pass(bool own_kernels, const torch::Tensor& up, const torch::Tensor&,
                       const torch::Tensor& grad, const torch::Tensor& bias) const override {
    if (own_kernels) {      // Tessel's: the forward adds the bias and writes y and the slope,
      torch::Tensor slope;  // backward multiplies
      auto y = kernels::bias_gelu_tanh_cpu(up, bias, &slope);
      auto dx = grad * slope;
      return;
    }
    at::gelu(up, "tanh"), at::gelu_backward(grad, up, "tanh");
  }
};

}  // namespace

const MlpForm& gelu_tanh_mlp() {
  static const GeluTanh form;
  return form;
}

}  // namespace tessel::models
