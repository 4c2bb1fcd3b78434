#include "engine/optim.h"

#include <ATen/ops/_fused_adamw.h>
#include <fnmatch.h>
#include <torch/torch.h>

#include <cmath>

namespace tessel {

double lr_at(const TrainingConfig& t, int64_t step) {
  const auto& s = t.schedule;
  const double peak = t.optimizer.lr;
  if (step <= s.warmup_steps)
    return peak * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.decay == "constant") return peak;
  const double progress = static_cast<double>(step - s.warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, t.steps - s.warmup_steps));
  const double frac =
      s.decay == "cosine" ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return s.min_lr + (peak - s.min_lr) * frac;
}

bool exempt_from_decay(const std::string& name, const std::vector<std::string>& globs) {
  for (const auto& g : globs)
    if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

FlatAdamW::FlatAdamW(models::Decoder& model, const TrainingConfig& t) : t_(t) {
  auto params = model->named_parameters();
  auto device = params.values().front().device();
  low_precision_ = params.values().front().scalar_type() != torch::kFloat32;
  // Layout: reverse registration order, which is roughly the order backward produces gradients
  // in, so gradient buckets (contiguous ranges) fill one after another.
  for (auto it = params.items().rbegin(); it != params.items().rend(); ++it) {
    bool decay =
        !exempt_from_decay(it->key(), t.optimizer.no_decay) && t.optimizer.weight_decay > 0;
    slots_.push_back({it->key(), n_, it->value().numel(), decay});
    n_ += it->value().numel();
  }
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  // Parameters replicated over tensor-parallel ranks count once in the global gradient norm:
  // their squares are weighted 1/replicas before the sum over the model-parallel group.
  bool replicated = false;
  for (const auto& s : slots_) replicated = replicated || model->specs().at(s.name).replicas > 1;
  if (replicated) {
    norm_weight_ = torch::ones({n_}, f32);
    for (const auto& s : slots_)
      norm_weight_.narrow(0, s.offset, s.numel)
          .fill_(1.0 / static_cast<double>(model->specs().at(s.name).replicas));
  }
  master_ = torch::empty({n_}, f32);
  grad_ = torch::zeros({n_}, f32);
  exp_avg_ = torch::zeros({n_}, f32);
  exp_avg_sq_ = torch::zeros({n_}, f32);
  step_count_ = torch::zeros({}, f32);
  if (low_precision_) {
    params16_ = torch::empty({n_}, f32.dtype(params.values().front().scalar_type()));
    grads16_ = torch::zeros_like(params16_);
  }
  // Re-seat every parameter (and its .grad) as a view of the flat buffers, so backward
  // accumulates straight into them and the optimizer updates them in place.
  torch::NoGradGuard no_grad;
  torch::Tensor& weights = low_precision_ ? params16_ : master_;
  torch::Tensor& grads = low_precision_ ? grads16_ : grad_;
  for (const auto& s : slots_) {
    auto& p = params[s.name];
    master_.narrow(0, s.offset, s.numel).copy_(p.flatten());
    auto w = weights.narrow(0, s.offset, s.numel).view(p.sizes());
    if (low_precision_) w.copy_(p);
    p.set_data(w);
    p.mutable_grad() = grads.narrow(0, s.offset, s.numel).view(p.sizes());
  }
  // One fused call per weight-decay group over per-parameter views of the flat buffers, built
  // once: the views stay valid because the buffers are only ever updated in place.
  for (const bool decay : {true, false}) {
    DecayGroup grp{decay, {}, {}, {}, {}, {}};
    for (const auto& s : slots_) {
      if (s.decay != decay) continue;
      grp.w.push_back(master_.narrow(0, s.offset, s.numel));
      grp.g.push_back(grad_.narrow(0, s.offset, s.numel));
      grp.m.push_back(exp_avg_.narrow(0, s.offset, s.numel));
      grp.v.push_back(exp_avg_sq_.narrow(0, s.offset, s.numel));
      grp.steps.push_back(step_count_);  // read-only in the kernel; step() increments it
    }
    if (!grp.w.empty()) groups_.push_back(std::move(grp));
  }
}

void FlatAdamW::load_state(const std::map<std::string, torch::Tensor>& master,
                           const std::map<std::string, torch::Tensor>& exp_avg,
                           const std::map<std::string, torch::Tensor>& exp_avg_sq,
                           const torch::Tensor& step, const std::string& source) {
  torch::NoGradGuard no_grad;
  auto fill = [&](torch::Tensor& flat, const std::map<std::string, torch::Tensor>& by_name,
                  const char* what) {
    for (const auto& s : slots_) {
      auto it = by_name.find(s.name);
      if (it == by_name.end() || it->second.numel() != s.numel)
        throw UserError(source + ": optimizer state optim." + what + "." + s.name +
                        " is missing or has another size");
      flat.narrow(0, s.offset, s.numel).copy_(it->second.flatten());
    }
  };
  fill(master_, master, "master");
  fill(exp_avg_, exp_avg, "exp_avg");
  fill(exp_avg_sq_, exp_avg_sq, "exp_avg_sq");
  step_count_.copy_(step);
  if (low_precision_) params16_.copy_(master_);
}

void FlatAdamW::fold_microbatch(int64_t begin, int64_t end) {
  if (!low_precision_ || end <= begin) return;
  grad_.narrow(0, begin, end - begin).add_(grads16_.narrow(0, begin, end - begin));
  grads16_.narrow(0, begin, end - begin).zero_();
}

torch::Tensor FlatAdamW::clip_grad_norm(
    double max_norm, const std::function<void(torch::Tensor&)>& sum_over_shards) {
  auto sq = norm_weight_.defined() ? (grad_.pow(2) * norm_weight_).sum() : grad_.pow(2).sum();
  if (sum_over_shards) sum_over_shards(sq);
  auto norm = sq.sqrt();
  if (max_norm > 0) {
    // As torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)), on device.
    grad_.mul_((max_norm / (norm + 1e-6)).clamp_max(1.0));
  }
  return norm;
}

void FlatAdamW::step(double lr) {
  step_count_.add_(1);
  const auto& o = t_.optimizer;
  for (const auto& grp : groups_)
    at::_fused_adamw_(grp.w, grp.g, grp.m, grp.v, {}, grp.steps, lr, o.betas[0], o.betas[1],
                      grp.decay ? o.weight_decay : 0.0, o.eps, /*amsgrad=*/false,
                      /*maximize=*/false);
  if (low_precision_) params16_.copy_(master_);
  grad_.zero_();
}

}  // namespace tessel
