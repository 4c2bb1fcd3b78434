#include "models/moe.h"

#include <torch/torch.h>

#include "models/recompute.h"
#include "parallel/autograd_comm.h"
#include "parallel/ep/dispatch.h"

namespace tessel::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The balance loss's gradient, entered where the layer's output is: forward passes `out` on,
// backward hands the loss `factor` (d total loss / d aux) besides the output's gradient.
struct AuxLoss : torch::autograd::Function<AuxLoss> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& out,
                               const torch::Tensor& aux, const torch::Tensor& factor) {
    ctx->save_for_backward({factor});
    return out.view_as(out);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {grad[0], ctx->get_saved_variables()[0].clone(), torch::Tensor()};
  }
};

// at::_grouped_mm's backward takes its output's gradient as dense memory: give it that.
struct DenseGrad : torch::autograd::Function<DenseGrad> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x) { return x.view_as(x); }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0].contiguous()};
  }
};

int64_t moe_index(const MoeShape& m, int64_t layer) {
  int64_t n = 0;
  for (int64_t l = 0; l < layer; ++l) n += m.is_moe(l) ? 1 : 0;
  return n;
}

}  // namespace

MoeImpl::MoeImpl(const DecoderOptions& o, int64_t layer, MoeState* state)
    : m_(o.model.moe),
      layer_(layer),
      index_(moe_index(o.model.moe, layer)),
      tp_(o.tp),
      cp_(o.cp && o.cp->size() > 1 ? o.cp : nullptr),
      ep_(o.ep),
      sp_(o.sequence_parallel && o.tp->size() > 1),
      state_(state) {
  const int64_t h = o.model.hidden, f = m_.ffn_hidden, local = m_.experts / ep_->size();
  // Named as the checkpoints name them: mlp.router.weight, mlp.experts.{gate,up,down}.
  auto router_module = register_module("router", std::make_shared<torch::nn::Module>());
  auto experts_module = register_module("experts", std::make_shared<torch::nn::Module>());
  router = router_module->register_parameter("weight", torch::empty({m_.experts, h}));
  if (m_.bias_update_rate > 0)  // state, not trained: saved with the weights, kept in fp32
    balance_bias = router_module->register_parameter("bias", torch::zeros({m_.experts}),
                                                     /*requires_grad=*/false);
  gate = experts_module->register_parameter("gate", torch::empty({local, f, h}));
  up = experts_module->register_parameter("up", torch::empty({local, f, h}));
  down = experts_module->register_parameter("down", torch::empty({local, h, f}));
  if (m_.shared > 0) {
    auto so = o;
    so.model.ffn_hidden = m_.shared * f;
    shared = register_module("shared", Mlp(so));
  }
}

std::vector<std::pair<std::string, parallel::tp::Placement>> MoeImpl::placements() const {
  const parallel::tp::Shard over_ep{0, ep_->size(), ep_->rank()};
  return {{"experts.gate", {over_ep, 0, false, true}},
          {"experts.up", {over_ep, 0, false, true}},
          {"experts.down", {over_ep, 0, false, true}}};
}

torch::Tensor MoeImpl::experts(const parallel::ep::Dispatched& d) const {
  if (d.local_rows.empty() || parallel::ep::grouped_mm_on_device(d.rows)) {
    auto mm = [&](const torch::Tensor& a, const torch::Tensor& w) {
      return DenseGrad::apply(at::_grouped_mm(a, w.transpose(1, 2), d.offsets));
    };
    return mm(torch::silu(mm(d.rows, gate)) * mm(d.rows, up), down);
  }
  auto parts = d.rows.split_with_sizes(d.local_rows);
  std::vector<torch::Tensor> outs;
  for (size_t e = 0; e < parts.size(); ++e) {
    const auto i = static_cast<int64_t>(e);
    auto a = parts[e];
    outs.push_back(
        torch::mm(torch::silu(torch::mm(a, gate[i].t())) * torch::mm(a, up[i].t()), down[i].t()));
  }
  return torch::cat(outs);
}

torch::Tensor MoeImpl::forward(const torch::Tensor& x) {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2), e = m_.experts, k = m_.top_k;
  auto flat = x.reshape({-1, h});
  // The router in fp32 (its scores decide which expert a token goes to).
  auto logits = torch::mm(flat.to(torch::kFloat32), router.to(torch::kFloat32).t());
  auto scores = m_.score == plan::RouterScore::kSigmoid ? logits.sigmoid() : logits.softmax(-1);
  // [N, k], best first; with a balance bias the bias chooses and the scores weigh.
  const bool biased = balance_bias.defined();
  auto [top, chosen] = (biased ? scores + balance_bias.to(torch::kFloat32) : scores).topk(k, -1);
  auto weights = biased ? scores.gather(1, chosen) : top;
  if (m_.norm_topk)
    weights = m_.score == plan::RouterScore::kSigmoid ? weights / (weights.sum(-1, true) + 1e-20)
                                                      : weights / weights.sum(-1, true);
  // Each (token, choice) row by expert; choices over a sequence's capacity go to bin e (none),
  // with gate weight 0: sorted last, they pass by the residual only.
  auto bins = chosen.reshape(-1);
  auto gates = weights.reshape(-1);
  const int64_t slots = bins.size(0);
  if (m_.capacity_factor > 0) {
    // Per sequence and expert, the first `capacity` choices in token order are kept.
    const auto cap = static_cast<int64_t>(
        std::ceil(m_.capacity_factor * static_cast<double>(s * k) / static_cast<double>(e)));
    auto seq = torch::arange(slots, bins.options()).div(s * k, "floor");
    auto key = seq * e + bins;
    auto by_key = std::get<1>(key.sort(std::optional<bool>(true), 0));
    auto per_key =
        torch::zeros({b * e}, bins.options()).scatter_add_(0, key, torch::ones_like(key));
    auto first = per_key.cumsum(0) - per_key;  // first sorted position of each key
    auto rank =
        torch::arange(slots, bins.options()) - first.index_select(0, key.index_select(0, by_key));
    auto over = torch::zeros_like(bins, torch::kBool).scatter_(0, by_key, rank >= cap);
    bins = bins.masked_fill(over, e);
    gates = gates.masked_fill(over, 0.0);
  }
  auto order = std::get<1>(bins.sort(std::optional<bool>(true), 0));
  auto counts = torch::zeros({e + 1}, bins.options()).scatter_add_(0, bins, torch::ones_like(bins));
  auto token = order.div(k, "floor");
  // No host read here: dispatch() reads the split sizes once when ep > 1, or the rows per expert
  // when the grouped matmul would read its offsets itself (ep/dispatch.h).
  auto routed = flat.index_select(0, token);
  // Dropped rows enter their expert as zeros: it returns exact zeros (no overflow to meet a
  // gate of 0 as inf·0 in fp16), and they add nothing to its weights' gradients.
  if (m_.capacity_factor > 0)
    routed = routed.masked_fill((bins.index_select(0, order) == e).unsqueeze(1), 0.0);
  auto d = parallel::ep::dispatch(*ep_, routed, counts.narrow(0, 0, e),
                                  !parallel::ep::grouped_mm_on_device(routed));
  auto y = parallel::ep::combine(*ep_, experts(d), d.route);
  auto g = gates.index_select(0, order).to(x.scalar_type()).unsqueeze(1);
  auto out = torch::zeros_like(flat).index_add(0, token, y * g);
  if (state_ && state_->loss_factor.defined() && !recomputing()) {
    torch::NoGradGuard no_grad;
    if (state_->count_here) {
      state_->counts[index_] += counts.narrow(0, 0, e).to(torch::kFloat32);
      state_->dropped[index_] += counts[e].to(torch::kFloat32);
    }
  }
  out = balance(out, scores, chosen, b, s).view({b, s, h});
  return shared ? out + shared(x) : out;
}

void MoeImpl::update_balance_bias(const torch::Tensor& choices) {
  torch::NoGradGuard no_grad;
  auto c = choices.to(balance_bias.device(), torch::kFloat32);
  balance_bias.add_((c.mean() - c).sign().to(balance_bias.scalar_type()), m_.bias_update_rate);
}

torch::Tensor MoeImpl::balance(const torch::Tensor& out, const torch::Tensor& scores,
                               const torch::Tensor& chosen, int64_t b, int64_t s) {
  if (!state_ || !state_->loss_factor.defined()) return out;
  const bool attach = torch::GradMode::is_enabled() && m_.aux_loss_coef > 0 && out.requires_grad();
  const bool record = !recomputing();
  if (!attach && !record) return out;
  const int64_t e = m_.experts, k = m_.top_k, t = state_->seq_len;
  // Per sequence: choices of each expert (f, no gradient) and normalised scores (P) summed over
  // its tokens; a sequence split over tp (SP) or cp ranks is summed over them first.
  auto probs = m_.score == plan::RouterScore::kSigmoid ? scores / scores.sum(-1, true) : scores;
  auto p = probs.view({b, s, e}).sum(1);
  torch::Tensor f;
  {
    torch::NoGradGuard no_grad;
    f = torch::zeros_like(scores).scatter_(1, chosen, 1.0).view({b, s, e}).sum(1);
  }
  for (auto* g : {sp_ ? tp_ : nullptr, cp_}) {
    if (!g) continue;
    g->all_reduce(f).wait();
    p = parallel::reduce_from(*g, p);
  }
  // Σ_e f_e·P_e with f_e = E/(k·T)·choices and P_e = score sum / T, summed over sequences.
  auto aux = (f * p).sum() * (static_cast<double>(e) / static_cast<double>(k * t * t));
  if (record && tp_->rank() == 0 && (!cp_ || cp_->rank() == 0)) state_->aux[index_] += aux.detach();
  if (!attach) return out;
  return AuxLoss::apply(out, aux,
                        state_->loss_factor * (m_.aux_loss_coef * static_cast<double>(t)));
}

}  // namespace tessel::models
