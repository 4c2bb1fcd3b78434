// Llama's MLP: down(SiLU(gate(x)) * up(x)); on the CPU Tessel's kernel runs the product in one
// pass forward and one backward (core/kernels/activation_kernels.h).
#include <torch/torch.h>

#include "core/kernels/activation_kernels.h"
#include "core/kernels/fused_ops.h"
#include "models/mlp.h"

namespace tessel::models {
namespace {

class SwiGlu final : public MlpForm {
 public:
  bool gated() const override { return true; }
  torch::Tensor hidden(const torch::Tensor& x, parallel::tp::ColumnParallelLinearImpl& up,
                       parallel::tp::ColumnParallelLinearImpl* gate,
                       bool own_kernels) const override {
    return kernels::swiglu(gate->forward_entered(x), up.forward_entered(x), own_kernels);
  }
  // Gate's and up's outputs and their product with Tessel's fused kernel; LibTorch's keeps the
  // SiLU's output besides (2-core Xeon, CPU fp32, 2026-11-23).
  double kept_per_ffn(bool own_kernels) const override { return own_kernels ? 3.0 : 4.0; }
  // Its gradients of gate and up are the two ffn-wide results the measured peaks (the same
  // runs) already hold.
  double backward_extra_per_ffn(bool) const override { return 0.0; }
  void activation_pass(bool own_kernels, const torch::Tensor& up, const torch::Tensor& gate,
                       const torch::Tensor& grad, const torch::Tensor&) const override {
    if (own_kernels) {  // one pass forward, one backward
      auto y = torch::empty_like(up), dg = torch::empty_like(up), du = torch::empty_like(up);
      kernels::cpu::swiglu_forward(gate.data_ptr<float>(), up.data_ptr<float>(),
                                   y.data_ptr<float>(), y.numel());
      kernels::cpu::swiglu_backward(grad.data_ptr<float>(), gate.data_ptr<float>(),
                                    up.data_ptr<float>(), dg.data_ptr<float>(),
                                    du.data_ptr<float>(), y.numel());
      return;
    }
    auto act = at::silu(gate);  // SiLU of the gate times the up projection, forward and backward
    auto y = act * up, dx = grad * act;
    at::silu_backward(grad * up, gate);
  }
};

}  // namespace

const MlpForm& swiglu_mlp() {
  static const SwiGlu form;
  return form;
}

}  // namespace tessel::models
