#include "core/optim/optim.h"

#include "core/kernels/accumulate.h"
#include "core/observe/counters.h"

#include <fmt/format.h>

#include <ATen/ops/_fused_adamw.h>
#include <fnmatch.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace tessel::optim {

double lr_at(const plan::TrainingConfig& t, int64_t step) {
  const auto& s = t.schedule;
  const double peak = t.optimizer.lr;
  if (step <= s.warmup_steps)
    return peak * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.decay == plan::Decay::kConstant) return peak;
  const double progress = static_cast<double>(step - s.warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, t.steps - s.warmup_steps));
  const double frac =
      s.decay == plan::Decay::kCosine ? 0.5 * (1.0 + std::cos(M_PI * progress)) : 1.0 - progress;
  return s.min_lr + (peak - s.min_lr) * frac;
}

bool exempt_from_decay(const std::string& name, const std::vector<std::string>& globs) {
  for (const auto& g : globs)
    if (fnmatch(g.c_str(), name.c_str(), 0) == 0) return true;
  return false;
}

optim::FlatLayout layout_of(std::vector<optim::ParamEntry> registered,
                            const optim::LayoutOptions& o) {
  std::reverse(registered.begin(), registered.end());
  return optim::FlatLayout(registered, o);
}

optim::FlatLayout layout_of(const std::vector<NamedParam>& params, const optim::LayoutOptions& o) {
  std::vector<optim::ParamEntry> entries;
  for (const auto& p : params) entries.push_back({p.name, p.tensor.numel(), p.chunk, p.expert});
  return layout_of(std::move(entries), o);
}

optim::LayoutOptions layout_options(const plan::Config& c, int64_t data_ranks, int64_t data_rank,
                                    int64_t expert_ranks, int64_t expert_rank, int64_t pp) {
  const auto z = plan::sharding(c);
  return {std::max<int64_t>(1, static_cast<int64_t>(c.parallel.ddp_bucket_mb * (1 << 20) / 4)),
          z.state ? data_ranks : 1,
          z.state ? data_rank : 0,
          z,
          z.state && pp > 1 && c.model.tied(),
          z.state ? expert_ranks : 1,
          z.state ? expert_rank : 0};
}

FlatAdamW::FlatAdamW(const std::vector<NamedParam>& params, const plan::TrainingConfig& t)
    : FlatAdamW(params, t,
                layout_of(params, {std::numeric_limits<int64_t>::max(), 1, 0, 0, false})) {}

FlatAdamW::FlatAdamW(const std::vector<NamedParam>& named, const plan::TrainingConfig& t,
                     optim::FlatLayout layout)
    : t_(t), layout_(std::move(layout)) {
  TORCH_CHECK(!named.empty(), "optimizer: no parameters");
  std::map<std::string, const NamedParam*> params;
  for (const auto& p : named) params[p.name] = &p;
  const auto& front = named.front().tensor;
  low_precision_ = front.scalar_type() != torch::kFloat32;
  dtype_ = front.scalar_type();
  allocate_buffers(front);

  // Re-seat every parameter (and, at stages 0-1, its .grad) as a view of the flat buffers, so
  // backward accumulates straight into them and the optimizer updates them in place.
  torch::NoGradGuard no_grad;
  for (const auto& slot : layout_.slots())
    seat_param(slot, params.at(slot.name)->tensor);  // shares the parameter's TensorImpl
  groups_.erase(std::remove_if(groups_.begin(), groups_.end(),
                               [](const DecayGroup& g) { return g.w.empty(); }),
                groups_.end());

  const std::vector<int64_t> at = build_grad_pieces();
  build_replicated_spans(params, at);
}

void FlatAdamW::allocate_buffers(const torch::Tensor& front) {
  const auto& z = layout_.sharding();
  const int64_t n = layout_.numel(), s = layout_.shard_numel();
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(front.device());
  auto w16 = f32.dtype(front.scalar_type());
  {  // each buffer counted by the CPU allocator as the part of the state it holds (counters.h)
    observe::HeldAs weights(observe::Held::kWeights);
    if (!z.weights) params_ = torch::zeros({n}, w16);
    if (z.weights && low_precision_) shard16_ = torch::zeros({s}, w16);
    observe::HeldAs master(low_precision_ ? observe::Held::kOptimizer : observe::Held::kWeights);
    if (low_precision_ || z.weights)
      master_ = torch::zeros({s}, f32);  // fp32 stages 0-2: the weights
    observe::HeldAs grads(observe::Held::kGrads);
    if (!z.grads) grad_ = torch::zeros({n}, f32);
    if (z.grads) grad_shard_ = torch::zeros({s}, f32);
    observe::HeldAs optimizer(observe::Held::kOptimizer);
    exp_avg_ = torch::zeros({s}, f32);
    exp_avg_sq_ = torch::zeros({s}, f32);
  }
  step_count_ = torch::zeros({}, f32);
  if (z.weights)
    for (const auto& b : layout_.buckets()) units_.push_back(torch::zeros({b.end - b.begin}, w16));
}

void FlatAdamW::seat_param(const optim::Slot& slot, torch::Tensor p) {
  const auto& z = layout_.sharding();
  const auto& b = layout_.buckets()[static_cast<size_t>(slot.bucket)];
  auto full = !z.weights ? params_.narrow(0, slot.offset, slot.numel)
                         : units_[static_cast<size_t>(slot.bucket)].narrow(0, slot.offset - b.begin,
                                                                           slot.numel);
  const auto values = p.detach().flatten();
  full.copy_(values);
  const bool decay =
      !exempt_from_decay(slot.name, t_.optimizer.no_decay) && t_.optimizer.weight_decay > 0;
  for (const auto& piece : layout_.pieces(slot)) add_piece(slot.name, piece, values, decay);
  p.set_data(full.view(p.sizes()));
  // fp32: backward accumulates into the flat gradient itself. bf16/fp16: each micro-batch's
  // gradient of a parameter is folded into it in fp32 as soon as backward produces it
  // (fold_grad), so no second full-size gradient is kept.
  if (!z.grads && !low_precision_)
    p.mutable_grad() = grad_.narrow(0, slot.offset, slot.numel).view(p.sizes());
}

void FlatAdamW::add_piece(const std::string& name, const optim::Piece& piece,
                          const torch::Tensor& values, bool decay) {
  auto mine = values.narrow(0, piece.param_offset, piece.numel);
  if (master_.defined()) master_view(piece).copy_(mine);
  if (shard16_.defined()) shard16_.narrow(0, piece.shard, piece.numel).copy_(mine);
  auto weight = !layout_.sharding().weights
                    ? params_.narrow(0, piece.flat, piece.numel)
                    : (low_precision_ ? shard16_ : master_).narrow(0, piece.shard, piece.numel);
  pieces_.push_back({name, piece.param_offset, piece.numel, weight, master_view(piece),
                     exp_avg_.narrow(0, piece.shard, piece.numel),
                     exp_avg_sq_.narrow(0, piece.shard, piece.numel)});
  // One fused call per weight-decay group over per-piece views, built once: the views stay
  // valid because the buffers are only ever updated in place.
  if (groups_.empty()) groups_ = {{true, {}, {}, {}, {}, {}}, {false, {}, {}, {}, {}, {}}};
  auto& grp = groups_[decay ? 0 : 1];
  grp.w.push_back(master_view(piece));
  grp.g.push_back(grad_view(piece));
  grp.m.push_back(pieces_.back().exp_avg);
  grp.v.push_back(pieces_.back().exp_avg_sq);
  grp.steps.push_back(step_count_);  // read-only in the kernel; step() increments it
}

std::vector<int64_t> FlatAdamW::build_grad_pieces() {
  // The reduced gradient this rank holds: all of it (stage 0), its piece of each bucket inside
  // the full buffer (stage 1), or its shard (stages 2-3); `at` is each piece's offset in this
  // rank's shard coordinates (those of optim::Piece::shard).
  const auto& z = layout_.sharding();
  std::vector<int64_t> at;
  if (z.state_only()) {
    for (const auto& b : layout_.buckets()) {
      grad_pieces_.push_back(grad_.narrow(0, layout_.piece_flat(b), layout_.piece_numel(b)));
      at.push_back(b.shard_offset);
    }
  } else {
    grad_pieces_.push_back(z.grads ? grad_shard_ : grad_);
    at.push_back(0);
  }
  return at;
}

void FlatAdamW::build_replicated_spans(const std::map<std::string, const NamedParam*>& params,
                                       const std::vector<int64_t>& at) {
  // Parameters replicated over tensor-parallel ranks count once in the global norm: their
  // squares are weighted 1/replicas (views, no N-sized weight vector).
  std::map<int64_t, std::vector<torch::Tensor>> by_replicas;
  for (const auto& slot : layout_.slots()) {
    const int64_t r = params.at(slot.name)->replicas;
    if (r <= 1) continue;
    for (const auto& piece : layout_.pieces(slot)) {
      size_t i = 0;
      while (i + 1 < at.size() && at[i + 1] <= piece.shard) ++i;
      by_replicas[r].push_back(grad_pieces_[i].narrow(0, piece.shard - at[i], piece.numel));
    }
  }
  for (auto& [r, spans] : by_replicas)
    replicated_spans_.emplace_back(1.0 - 1.0 / static_cast<double>(r), std::move(spans));
}

torch::Tensor FlatAdamW::master_view(const optim::Piece& p) const {
  return master_.defined() ? master_.narrow(0, p.shard, p.numel)
                           : params_.narrow(0, p.flat, p.numel);
}

torch::Tensor FlatAdamW::grad_view(const optim::Piece& p) const {
  return grad_.defined() ? grad_.narrow(0, p.flat, p.numel)
                         : grad_shard_.narrow(0, p.shard, p.numel);
}

int64_t FlatAdamW::numel() const {
  int64_t n = 0;
  for (const auto& s : layout_.slots()) n += s.numel;
  return n;
}

std::vector<torch::Tensor> FlatAdamW::grad_views(const optim::Slot& slot) const {
  std::vector<torch::Tensor> out;
  for (const auto& piece : layout_.pieces(slot)) out.push_back(grad_view(piece));
  return out;
}

torch::Tensor FlatAdamW::grad_bucket_piece(const optim::Slot& slot) const {
  const auto& b = layout_.buckets()[static_cast<size_t>(slot.bucket)];
  TORCH_CHECK(b.params == 1, "grad_bucket_piece: ", slot.name, " shares its bucket");
  const int64_t n = layout_.piece_numel(b);
  return grad_.defined() ? grad_.narrow(0, layout_.piece_flat(b), n)
                         : grad_shard_.narrow(0, b.shard_offset, n);
}

StateBytes FlatAdamW::bytes() const {
  auto b = [](const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; };
  StateBytes out;
  out.params = !sharding().weights ? b(params_) : (low_precision_ ? b(shard16_) : b(master_));
  out.grads = b(grad_) + b(grad_shard_);
  out.optimizer =
      b(exp_avg_) + b(exp_avg_sq_) + ((sharding().weights && !low_precision_) ? 0 : b(master_));
  return out;
}

StateBytes FlatAdamW::alignment_padding() const {
  int64_t dense = 0, experts = 0, expert_shards = 1;
  for (const auto& s : layout_.slots()) {
    const auto& b = layout_.buckets()[static_cast<size_t>(s.bucket)];
    (b.expert ? experts : dense) += s.numel;
    if (b.expert) expert_shards = b.shards;
  }
  const auto d = planned_state_bytes(dense, sharding(), layout_.shards(), dtype_);
  const auto e = planned_state_bytes(experts, sharding(), expert_shards, dtype_);
  const auto have = bytes();
  return {have.params - d.params - e.params, have.grads - d.grads - e.grads,
          have.optimizer - d.optimizer - e.optimizer};
}

int64_t FlatAdamW::alignment_padding_bound() const {
  int64_t pieces = 0;
  for (const auto& b : layout_.buckets()) pieces += b.shards;
  return 12 * optim::kAlignElements * (static_cast<int64_t>(layout_.slots().size()) + pieces);
}

StateBytes planned_state_bytes(int64_t numel, const plan::Sharding& sharding, int64_t data_ranks,
                               torch::ScalarType dtype) {
  const int64_t w = static_cast<int64_t>(c10::elementSize(dtype));
  const bool low = dtype != torch::kFloat32;
  const int64_t n = numel, s = sharding.state ? (numel + data_ranks - 1) / data_ranks : numel;
  StateBytes b;
  b.params = sharding.weights ? w * s : w * n;
  b.grads =
      sharding.grads ? 4 * s : 4 * n;  // fp32 only: a 16-bit gradient is folded in as it comes
  // The fp32 master is the weights themselves in fp32 runs (and, at stage 3, counted there).
  b.optimizer = 8 * s + (low ? 4 * s : 0);
  return b;
}

void FlatAdamW::load_slot(int kind, const std::string& name, const torch::Tensor& local,
                          const std::string& source) {
  static const char* what[] = {"master", "exp_avg", "exp_avg_sq"};
  const optim::Slot* slot = nullptr;
  for (const auto& s : layout_.slots())
    if (s.name == name) slot = &s;
  if (!slot) return;  // not this rank's parameter
  if (local.numel() != slot->numel)
    throw plan::UserError(
        fmt::format("{}: optimizer state optim.{}.{} has {} elements, this rank's "
                    "slice needs {}",
                    source, what[kind], name, local.numel(), slot->numel));
  torch::NoGradGuard no_grad;
  const auto flat = local.reshape({-1});
  if (kind == 0 && params_.defined()) params_.narrow(0, slot->offset, slot->numel).copy_(flat);
  for (const auto& piece : layout_.pieces(*slot)) {
    const auto from = flat.narrow(0, piece.param_offset, piece.numel);
    if (kind == 0)
      master_view(piece).copy_(from);
    else
      (kind == 1 ? exp_avg_ : exp_avg_sq_).narrow(0, piece.shard, piece.numel).copy_(from);
  }
  loaded_[name] |= 1 << kind;
}

void FlatAdamW::finish_load(const torch::Tensor& step, const std::string& source) {
  for (const auto& s : layout_.slots())
    if (loaded_[s.name] != 7)
      throw plan::UserError(
          source + ": optimizer state of " + s.name +
          " is missing (optim.master, optim.exp_avg and optim.exp_avg_sq are needed)");
  loaded_.clear();
  torch::NoGradGuard no_grad;
  step_count_.copy_(step);
  refresh_weights();
}

void FlatAdamW::fold_grad(const optim::Slot& slot, torch::Tensor& grad) {
  TORCH_CHECK(grad_.defined() && low_precision_ && grad.numel() == slot.numel,
              "fold_grad: ", slot.name, "'s gradient of ", grad.numel(), " elements");
  kernels::add_widened(grad_.narrow(0, slot.offset, slot.numel), grad.reshape({-1}));
  grad = torch::Tensor();
}

torch::Tensor FlatAdamW::clip_grad_norm(double max_norm,
                                        const std::function<void(torch::Tensor&)>& sum_over_shards,
                                        const torch::Tensor& unscale) {
  if (unscale.defined())
    for (auto& g : grad_pieces_) g.mul_(unscale);
  // Multi-tensor norms (one kernel per list on CUDA), no N-sized temporaries. Accumulated in
  // fp64 and summed over ranks in fp64, then rounded once to fp32: each layout cuts the gradient
  // into other pieces (pipeline stages, tensor-parallel slices, ZeRO shards), and fp32 partial
  // sums made the norm, hence the clipping factor and the weights, depend on the cut (2-6e-6
  // apart at step 1). In fp64 the cuts differ by ~1e-16, below one fp32 rounding step.
  // The pieces go in as views of at most a chunk each: the CPU's foreach norm converts every
  // tensor it is given to fp64 first, so a whole piece would cost an fp64 copy of it (8 bytes
  // per parameter at the step's end); a chunk costs 128 KiB. On CUDA the views only bound the
  // same cost, in fewer, larger chunks (one multi-tensor kernel reads them all).
  const auto grad_device = step_count_.device();
  auto sum_sq = [&grad_device](const std::vector<torch::Tensor>& ts) {
    std::vector<torch::Tensor> chunks;
    for (const auto& t : ts) {
      const int64_t chunk = t.is_cuda() ? int64_t{1} << 20 : int64_t{1} << 14;
      if (t.numel() > 0)
        for (auto& c : t.reshape(-1).split(chunk)) chunks.push_back(c);
    }
    if (chunks.empty())
      return torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(grad_device));
    return torch::stack(at::_foreach_norm(chunks, 2, torch::kFloat64)).square().sum();
  };
  torch::Tensor sq = sum_sq(grad_pieces_);
  for (const auto& [drop, spans] : replicated_spans_) sq = sq - drop * sum_sq(spans);
  if (!replicated_spans_.empty()) sq = sq.clamp_min(0);  // rounding never makes it negative
  if (sum_over_shards) sum_over_shards(sq);
  // A squared norm beyond fp32's range stays non-finite, as it was when summed in fp32: the
  // non-finite check (and fp16's overflow skip) keys on it.
  sq = sq.masked_fill(sq > static_cast<double>(std::numeric_limits<float>::max()),
                      std::numeric_limits<double>::infinity());
  auto norm = sq.sqrt().to(torch::kFloat32);
  if (max_norm > 0) {
    // As torch.nn.utils.clip_grad_norm_: scale by min(1, max_norm / (norm + 1e-6)), on device.
    auto factor = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    for (auto& g : grad_pieces_) g.mul_(factor);
  }
  return norm;
}

void FlatAdamW::step(double lr, const torch::Tensor& found_inf) {
  step(torch::full({}, lr, torch::dtype(torch::kFloat64)), found_inf);
}

void FlatAdamW::step(const torch::Tensor& lr, const torch::Tensor& found_inf) {
  step_count_.add_(1);
  const auto& o = t_.optimizer;
  std::optional<at::Tensor> skip;
  if (found_inf.defined()) skip = found_inf;
  // A host rate (a float64 CPU scalar) is read from host memory (the double path, no device
  // sync, no operator); a device rate is read by the kernel. The same call either way.
  auto update = [&](const auto& rate) {
    for (const auto& grp : groups_)
      at::_fused_adamw_(grp.w, grp.g, grp.m, grp.v, {}, grp.steps, rate, o.betas[0], o.betas[1],
                        grp.decay ? o.weight_decay : 0.0, o.eps, /*amsgrad=*/false,
                        /*maximize=*/false, /*grad_scale=*/std::nullopt, skip);
  };
  if (lr.device().is_cpu()) {
    TORCH_CHECK(lr.scalar_type() == torch::kFloat64, "FlatAdamW::step: a host rate is float64");
    update(*lr.data_ptr<double>());
  } else {
    update(lr);
  }
  if (found_inf.defined()) step_count_.sub_(found_inf);  // a skipped step does not count
  refresh_weights();
  (grad_.defined() ? grad_ : grad_shard_).zero_();
}

void FlatAdamW::refresh_weights() {
  if (!low_precision_) return;  // fp32: the master is (or is part of) the weights
  torch::NoGradGuard no_grad;
  if (!sharding().state) {
    params_.copy_(master_);
  } else if (sharding().weights) {
    shard16_.copy_(master_);
  } else {  // this rank's piece of each bucket; parallel::dp all-gathers the rest
    for (const auto& b : layout_.buckets())
      params_.narrow(0, layout_.piece_flat(b), layout_.piece_numel(b))
          .copy_(master_.narrow(0, b.shard_offset, layout_.piece_numel(b)));
  }
}

}  // namespace tessel::optim
