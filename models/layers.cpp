#include "models/layers.h"
#include "core/kernels/activations.h"
#include "core/kernels/fused_ops.h"
#include "models/moe.h"
#include "models/recompute.h"

#include <torch/torch.h>

#include <algorithm>

#include "core/kernels/attention_kernels.h"
#include "parallel/autograd_comm.h"
#include "parallel/cp/attention.h"
#include "parallel/pp/weight_grad.h"
#include "parallel/tp/head_loss.h"

namespace tessel::models {
namespace tp = parallel::tp;

torch::Tensor ParamSpec::local_of(const torch::Tensor& global) const {
  if (padded_rows <= global.size(0)) return shard.of(global);
  // A padded vocabulary: this rank's rows of the padded table, its real rows then zeros, so that
  // only they are read (the table may be a view of a mapped file).
  const bool split = shard.dim == 0 && shard.parts > 1;
  const int64_t rows = split ? padded_rows / shard.parts : padded_rows;
  const int64_t begin = split ? rows * shard.index : 0;
  const int64_t real = std::clamp<int64_t>(global.size(0) - begin, 0, rows);
  auto pad_shape = global.sizes().vec();
  pad_shape[0] = rows - real;
  auto mine = torch::cat({global.narrow(0, std::min(begin, global.size(0)), real),
                          torch::zeros(pad_shape, global.options())});
  return split ? mine : shard.of(mine);
}

std::vector<std::pair<int64_t, int64_t>> ParamSpec::global_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> r;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    int64_t full = (d == 0 && padded_rows > 0) ? padded_rows : global_shape[d];
    if (static_cast<int64_t>(d) != shard.dim || shard.parts == 1) {
      r.emplace_back(0, global_shape[d]);
      continue;
    }
    const int64_t chunk = full / shard.parts, begin = chunk * shard.index;
    r.emplace_back(std::min(begin, global_shape[d]), std::min(begin + chunk, global_shape[d]));
  }
  return r;
}

NormImpl::NormImpl(int64_t dim, double eps, bool layer_norm) : eps_(eps), layer_norm_(layer_norm) {
  weight = register_parameter("weight", torch::ones({dim}));
  if (layer_norm) bias = register_parameter("bias", torch::zeros({dim}));
}

torch::Tensor NormImpl::forward(const torch::Tensor& x) {
  if (layer_norm_) return at::layer_norm(x, {x.size(-1)}, weight, bias, eps_);
  return kernels::rms_norm(x, weight, eps_, tessel_kernels);
}

AttentionImpl::AttentionImpl(const DecoderOptions& opt)
    : tp_(opt.tp),
      sp_(opt.sequence_parallel),
      cp_(opt.cp && opt.cp->size() > 1 ? opt.cp : nullptr),
      cp_method_(opt.cp_method) {
  const auto& m = opt.model;
  const int64_t t = tp_->size(), h = m.hidden, hd = m.head_dim();
  heads_ = m.heads / t;
  head_dim_ = hd;
  q = register_module("q", tp::ColumnParallelLinear(*tp_, h, h, opt.linear_bias, sp_));
  if (m.kv_heads % t == 0) {
    kv_heads_ = m.kv_heads / t;
    k = register_module("k",
                        tp::ColumnParallelLinear(*tp_, h, m.kv_heads * hd, opt.linear_bias, sp_));
    v = register_module("v",
                        tp::ColumnParallelLinear(*tp_, h, m.kv_heads * hd, opt.linear_bias, sp_));
  } else {
    // tp > kv_heads: this rank's query heads [r·heads/t, ...) all share key/value head
    // r / (t / kv_heads); every rank holds every key/value projection (their gradients are summed
    // over tp) and uses that one head.
    kv_heads_ = 1;
    kv_index_ = tp_->rank() / (t / m.kv_heads);
    auto lin = torch::nn::LinearOptions(h, m.kv_heads * hd).bias(opt.linear_bias);
    k_all = register_module("k", torch::nn::Linear(lin));
    v_all = register_module("v", torch::nn::Linear(lin));
  }
  o = register_module("o", tp::RowParallelLinear(*tp_, h, h, opt.linear_bias, sp_));
  if (m.qk_norm) {
    q_norm = register_module("q_norm", Norm(hd, m.norm_eps, false));
    k_norm = register_module("k_norm", Norm(hd, m.norm_eps, false));
  }
}

std::vector<std::pair<std::string, tp::Placement>> AttentionImpl::placements() const {
  std::vector<std::pair<std::string, tp::Placement>> p;
  tp::Placement partial;
  partial.partial_grad = true;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    if (t.defined()) p.push_back({name, partial});
  };
  if (k_all) {  // each rank's query heads reach only their key/value head
    add("k.weight", k_all->weight), add("k.bias", k_all->bias);
    add("v.weight", v_all->weight), add("v.bias", v_all->bias);
  }
  if (q_norm) {  // each rank normalises only its own heads (RMSNorm: a weight, no bias)
    add("q_norm.weight", q_norm->weight), add("k_norm.weight", k_norm->weight);
  }
  return p;
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const kernels::Documents* docs) {
  auto xf = tp::enter(*tp_, x, sp_);  // [b, s, h]: one gather (SP) or copy shared by q, k, v
  const int64_t b = xf.size(0), s = xf.size(1);
  // [b, s, heads·d] -> [b, heads, s, d]
  auto qh = q->forward_entered(xf).view({b, s, heads_, head_dim_}).transpose(1, 2);
  torch::Tensor kh, vh;
  if (k) {
    kh = k->forward_entered(xf).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
    vh = v->forward_entered(xf).view({b, s, kv_heads_, head_dim_}).transpose(1, 2);
  } else {
    kh = k_all(xf).view({b, s, -1, head_dim_}).narrow(2, kv_index_, 1).transpose(1, 2);
    vh = v_all(xf).view({b, s, -1, head_dim_}).narrow(2, kv_index_, 1).transpose(1, 2);
  }
  if (q_norm) qh = q_norm(qh), kh = k_norm(kh);
  if (cos.defined()) {
    qh = kernels::rope(qh, cos, sin, tessel_kernels);
    kh = kernels::rope(kh, cos, sin, tessel_kernels);
  }
  if (cache) {  // generation: earlier positions' keys and values come first
    if (cache->k.defined()) {
      kh = torch::cat({cache->k, kh}, 2);
      vh = torch::cat({cache->v, vh}, 2);
    }
    cache->k = kh, cache->v = vh;
  }
  // Causal within the new tokens; one new token after cached ones sees them all.
  TORCH_CHECK(qh.size(2) == kh.size(2) || qh.size(2) == 1,
              "cached attention takes a whole prompt or one token at a time");
  auto y = cp_    ? parallel::cp::attention(*cp_, cp_method_, qh, kh, vh, docs)
           : docs ? kernels::document_attention(qh, kh, vh, *docs, tessel_kernels)
                  : kernels::dense_attention(qh, kh, vh, /*causal=*/qh.size(2) == kh.size(2),
                                             tessel_kernels);
  return o(y.transpose(1, 2).reshape({b, s, heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const DecoderOptions& o)
    : tp_(o.tp), sp_(o.sequence_parallel), form_(&mlp_form(o.mlp)) {
  const int64_t h = o.model.hidden, f = o.model.ffn_hidden;
  up = register_module("up", tp::ColumnParallelLinear(*tp_, h, f, o.linear_bias, sp_));
  if (form_->gated())
    gate = register_module("gate", tp::ColumnParallelLinear(*tp_, h, f, o.linear_bias, sp_));
  down = register_module("down", tp::RowParallelLinear(*tp_, f, h, o.linear_bias, sp_));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  auto xf = tp::enter(*tp_, x, sp_);
  return down(form_->hidden(xf, *up, gate ? gate.get() : nullptr, tessel_kernels));
}

BlockImpl::BlockImpl(const DecoderOptions& o, int64_t layer, MoeState* moe_state) {
  attn_norm = register_module("attn_norm", Norm(o.model.hidden, o.model.norm_eps, o.layer_norm));
  attn = register_module("attn", Attention(o));
  mlp_norm = register_module("mlp_norm", Norm(o.model.hidden, o.model.norm_eps, o.layer_norm));
  if (o.model.moe.is_moe(layer))
    moe = register_module("mlp", std::make_shared<MoeImpl>(o, layer, moe_state));
  else
    mlp = register_module("mlp", Mlp(o));
}

torch::Tensor BlockImpl::ffn(const torch::Tensor& x) { return moe ? moe->forward(x) : mlp(x); }

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                 const torch::Tensor& sin, const kernels::Documents* docs) {
  auto h = x + attn(attn_norm(x), cos, sin, docs);
  if (recompute_mlp)
    return h + recompute([this](const torch::Tensor& t) { return ffn(mlp_norm(t)); }, h);
  return h + ffn(mlp_norm(h));
}

void DecoderImpl::set_kernels(plan::Kernels kernels) {
  const bool own = kernels == plan::Kernels::kTessel;
  for (const auto& m : modules()) {
    if (auto* n = m->as<NormImpl>()) n->tessel_kernels = own;
    if (auto* a = m->as<AttentionImpl>()) a->tessel_kernels = own;
    if (auto* p = m->as<MlpImpl>()) p->tessel_kernels = own;
  }
}

std::pair<int64_t, int64_t> DecoderImpl::set_fp8(plan::Fp8 recipe) {
  parallel::Group* tokens = o_.cp && o_.cp->size() > 1 ? o_.cp : nullptr;
  int64_t set = 0, kept = 0;
  auto column = [&](parallel::tp::ColumnParallelLinear& l) {
    if (l) l->set_fp8(recipe, tokens), ++set;
  };
  for (const auto& m : modules()) {
    if (auto* a = m->as<AttentionImpl>()) {
      column(a->q), column(a->k), column(a->v);
      a->o->set_fp8(recipe, tokens), ++set;
      kept += a->kv_replicated() ? 2 : 0;
    }
    if (auto* p = m->as<MlpImpl>()) {
      column(p->up), column(p->gate);
      p->down->set_fp8(recipe, tokens), ++set;
    }
  }
  return {set, kept};
}

void DecoderImpl::set_lean_logits(bool on, int64_t chunk_tokens) {
  lean_chunk_ = on ? chunk_tokens : -1;
}

void DecoderImpl::set_recompute(plan::Recompute mode) {
  recompute_blocks_ = mode == plan::Recompute::kFull;
  for (auto& chunk : blocks_)
    for (auto& b : chunk) b->recompute_mlp = mode == plan::Recompute::kSelective;
}

DecoderImpl::DecoderImpl(DecoderOptions o) : o_(std::move(o)) {
  if (!o_.tp) {
    solo_ = std::make_shared<parallel::Group>("solo", std::vector<int64_t>{0}, 0, nullptr);
    o_.tp = solo_.get();
    o_.sequence_parallel = false;
  }
  if (!o_.ep) {
    solo_ep_ = std::make_shared<parallel::Group>("solo", std::vector<int64_t>{0}, 0, nullptr);
    o_.ep = solo_ep_.get();
  }
  const auto& m = o_.model;
  if (m.moe.experts > 0) {
    moe_state_ = std::make_shared<MoeState>();
    // Replicas of the same tokens (tp without SP) count them once.
    moe_state_->count_here = o_.sequence_parallel || o_.tp->rank() == 0;
  }
  auto& part = o_.stages;
  if (part.chunks.empty()) part = {{{0, m.layers}}, true, true};
  const bool sp = o_.sequence_parallel;
  auto make_embed = [&] {
    return register_module("embed", tp::VocabParallelEmbedding(*o_.tp, m.vocab_size, m.hidden, sp));
  };
  // Registration order keeps each chunk's parameters contiguous (the optimizer lays them out in
  // reverse order and gradient buckets follow chunks): embeddings, layers by global index, then
  // the final norm and head; the last stage's copy of a tied token table comes last.
  if (part.first) {
    embed = make_embed();
    if (o_.learned_pos)
      pos_embed = register_module("pos_embed", torch::nn::Embedding(m.max_seq_len, m.hidden));
  }
  if (!o_.learned_pos) {
    const int64_t d = m.head_dim();
    inv_freq_ = 1.0 / torch::pow(m.rope_theta,
                                 torch::arange(0, d, 2, torch::kInt64).to(torch::kFloat32) / d);
  }
  layers = register_module("layers", std::make_shared<torch::nn::Module>());
  for (const auto& [begin, end] : part.chunks) {
    blocks_.emplace_back();
    for (int64_t i = begin; i < end; ++i)
      blocks_.back().push_back(
          layers->register_module(std::to_string(i), Block(o_, i, moe_state_.get())));
  }
  if (part.last) {
    norm = register_module("norm", Norm(m.hidden, m.norm_eps, o_.layer_norm));
    if (!m.tied()) {
      head = register_module(
          "head",
          tp::ColumnParallelLinear(*o_.tp, m.hidden, tp::padded_vocab(m.vocab_size, o_.tp->size()),
                                   false, sp, m.vocab_size));
      head->defer_weight_grad = false;  // W would hold the logits' gradient
    } else if (!embed)
      embed = make_embed();
  }
  build_specs();
}

std::set<std::string> DecoderImpl::global_names() const {
  const auto& m = o_.model;
  std::set<std::string> names{"embed.weight", "norm.weight"};
  if (o_.learned_pos) names.insert("pos_embed.weight");
  if (o_.layer_norm) names.insert("norm.bias");
  if (!m.tied()) names.insert("head.weight");
  // Dense blocks and MoE blocks each have the same parameters: the suffixes of each kind.
  auto opts = o_;
  opts.stages = {};
  opts.model.layers = 1;
  std::set<std::string> dense, moe;
  {
    opts.model.moe.experts = 0;
    Block b(opts, 0, nullptr);
    for (const auto& p : b->named_parameters()) dense.insert(p.key());
  }
  if (m.moe.experts > 0) {
    opts.model.moe = m.moe;
    opts.model.moe.every = 1;
    MoeState state;
    Block b(opts, 0, &state);
    for (const auto& p : b->named_parameters()) moe.insert(p.key());
  }
  for (int64_t i = 0; i < m.layers; ++i)
    for (const auto& key : m.moe.is_moe(i) ? moe : dense)
      names.insert("layers." + std::to_string(i) + "." + key);
  return names;
}

void DecoderImpl::update_moe_bias(const torch::Tensor& counts) {
  for (auto& chunk : blocks_)
    for (auto& b : chunk)
      if (b->moe && b->moe->balance_bias.defined())
        b->moe->update_balance_bias(counts[b->moe->index()]);
}

void DecoderImpl::reset_moe_stats() {
  if (!moe_state_) return;
  const auto& moe = o_.model.moe;
  const int64_t n = moe.layers_in(o_.model.layers);
  const auto device = parameters().front().device();
  if (!moe_state_->counts.defined() || moe_state_->counts.device() != device) {
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    moe_state_->counts = torch::zeros({n, moe.experts}, f32);
    moe_state_->aux = torch::zeros({n}, f32);
    moe_state_->dropped = torch::zeros({n}, f32);
    return;
  }
  moe_state_->counts.zero_();
  moe_state_->aux.zero_();
  moe_state_->dropped.zero_();
}

void DecoderImpl::build_specs() {
  // Each layer declares how its parameters sit over tp (and ep) where it makes them
  // (parallel/tp/layers.h Placement); what none declares is replicated, its gradient partial
  // under SP (each rank sees only its sequence chunk).
  const int64_t t = o_.tp->size();
  const bool sp = o_.sequence_parallel;
  std::map<std::string, tp::Placement> declared;
  // (Not the Decoder itself: this runs in its constructor, before a holder owns it.)
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    const auto* placed = dynamic_cast<const tp::Placed*>(item.value().get());
    if (!placed) continue;
    for (const auto& [local, placement] : placed->placements())
      declared[item.key() + "." + local] = placement;
  }
  for (const auto& p : named_parameters()) {
    const std::string& n = p.key();
    ParamSpec s;
    s.global_shape = p.value().sizes().vec();
    const auto it = declared.find(n);
    const tp::Placement place = it == declared.end() ? tp::Placement{} : it->second;
    s.shard = place.shard;
    s.global_shape[static_cast<size_t>(place.shard.dim)] *= place.shard.parts;
    s.expert = place.expert;
    if (place.shard.parts == 1 || place.expert) {  // whole on every tp rank
      s.tp_grad_sum = t > 1 && (sp || place.partial_grad);
      s.replicas = t;
    }
    if (place.true_rows > 0) {  // a padded vocabulary: its true rows
      s.padded_rows = s.global_shape[0];
      s.global_shape[0] = place.true_rows;
    }
    // Pipeline: which local chunk's backward produces the gradient; the first and last stage
    // both hold a tied token table (on different ranks), which the gradient norm counts once.
    const auto& part = o_.stages;
    const int64_t last_chunk = static_cast<int64_t>(part.chunks.size()) - 1;
    if (n.rfind("layers.", 0) == 0) {
      const int64_t layer = std::stoll(n.substr(7));
      for (int64_t c = 0; c <= last_chunk; ++c)
        if (layer >= part.chunks[c].first && layer < part.chunks[c].second) s.chunk = c;
    } else if (n == "pos_embed.weight") {
      s.chunk = 0;
    } else if (n == "embed.weight") {
      s.chunk = part.first ? 0 : last_chunk;
      s.pipeline_copy = !part.first;
      if (o_.model.tied() && part.first != part.last) s.replicas *= 2;
    } else {
      s.chunk = last_chunk;
    }
    specs_[n] = s;
  }
}

torch::Tensor DecoderImpl::positions(int64_t seq, const torch::Device& device,
                                     const kernels::Documents* docs) const {
  if (docs) {
    TORCH_CHECK(docs->tokens == seq, "documents of ", docs->tokens, "-token rows for a ", seq,
                "-token sequence");
    return parallel::cp::local_chunks(docs->positions, 1, cp_size(),
                                      cp_size() > 1 ? o_.cp->rank() : 0);
  }
  if (cp_size() == 1)
    return torch::arange(seq, torch::TensorOptions().dtype(torch::kInt64).device(device));
  return parallel::cp::local_positions(seq, cp_size(), o_.cp->rank(), device);
}

const std::pair<torch::Tensor, torch::Tensor>& DecoderImpl::rope(int64_t seq,
                                                                 const torch::Device& device,
                                                                 torch::ScalarType dtype) {
  auto key = std::make_tuple(seq, device.str(), static_cast<int>(dtype));
  std::lock_guard<std::mutex> lock(*rope_mutex_);
  if (auto it = rope_.find(key); it != rope_.end()) return it->second;
  return rope_[key] = rope_of(positions(seq, device), dtype);  // [s, d]
}

std::pair<torch::Tensor, torch::Tensor> DecoderImpl::rope_of(const torch::Tensor& positions,
                                                             torch::ScalarType dtype) const {
  // Angles in fp32 on the device, then cast to the activation dtype (as Hugging Face does).
  torch::NoGradGuard no_grad;
  torch::Tensor inv_freq = inv_freq_;
  if (positions.device() != inv_freq_.device()) {
    std::lock_guard<std::mutex> lock(*inv_freq_mutex_);
    auto& on = inv_freq_on_[positions.device().str()];
    if (!on.defined()) on = inv_freq_.to(positions.device());  // once per device
    inv_freq = on;
  }
  auto freqs = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;
  auto emb = torch::cat({freqs, freqs}, -1);  // [..., d]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

torch::Tensor DecoderImpl::embed_tokens(const torch::Tensor& tokens,
                                        const torch::Tensor& positions) {
  auto x = embed(tokens);  // [b, s, h]; SP: [b, s/t, h], this rank's sequence chunk
  if (!pos_embed) return x;
  const int64_t local = x.size(1), first = (tokens.size(1) == local) ? 0 : local * o_.tp->rank();
  return x + pos_embed(positions.narrow(-1, first, local));  // [T] or per row [b, T]
}

torch::Tensor DecoderImpl::run_blocks(int64_t chunk, torch::Tensor x,
                                      const torch::Tensor& positions,
                                      const kernels::Documents* docs) {
  torch::Tensor cos, sin;       // attention sees all local tokens (CP: positions of its two chunks)
  if (!o_.learned_pos && docs)  // each token's place in its document
    std::tie(cos, sin) = rope_of(positions, x.scalar_type());
  else if (!o_.learned_pos)
    std::tie(cos, sin) = rope(positions.size(0) * cp_size(), x.device(), x.scalar_type());
  int64_t layer = o_.stages.chunks[static_cast<size_t>(chunk)].first;  // global index
  for (auto& block : blocks_[static_cast<size_t>(chunk)]) {
    if (hooks_) x = hooks_->before_block(layer, x);
    if (recompute_blocks_)  // cos/sin and the block by value: backward reruns it later (in the
      x = recompute(        // same step, while the step's documents are held)
          [block, cos, sin, docs](const torch::Tensor& t) mutable {
            return block->forward(t, cos, sin, docs);
          },
          x);
    else
      x = block->forward(x, cos, sin, docs);
    if (hooks_) x = hooks_->after_block(layer, x);
    ++layer;
  }
  return x;
}

torch::Tensor DecoderImpl::logits(const torch::Tensor& x) {
  auto y = norm(x);
  if (head) return head(y);  // [b, s, Vp/t]
  return parallel::pp::linear(tp::enter(*o_.tp, y, o_.sequence_parallel), embed->weight, {},
                              /*deferrable=*/false);
}

torch::Tensor DecoderImpl::stage_forward(int64_t chunk, const torch::Tensor& input,
                                         const torch::Tensor& rows,
                                         const kernels::Documents* docs) {
  // The sequence length: from the rows on the first stage, else from the activation.
  if (hooks_) hooks_->before_stage();
  const bool first = is_first_stage(chunk), sp = o_.sequence_parallel;
  const int64_t cp = cp_size(), cp_rank = cp > 1 ? o_.cp->rank() : 0;
  const int64_t t = first ? rows.size(1) - 1 : input.size(1) * (sp ? o_.tp->size() : 1) * cp;
  const auto pos = positions(t, first ? rows.device() : input.device(), docs);
  auto x = run_blocks(
      chunk,
      first ? embed_tokens(parallel::cp::local_chunks(rows.narrow(1, 0, t), 1, cp, cp_rank), pos)
            : input,
      pos, docs);
  if (!is_last_stage(chunk)) return x;
  auto targets = parallel::cp::local_chunks(rows.narrow(1, 1, t), 1, cp, cp_rank);
  torch::Tensor weights;  // data.eod_mask_loss: 0 where the input token ends a document
  if (loss_mask_eod_ >= 0)
    weights = parallel::cp::local_chunks(rows.narrow(1, 0, t), 1, cp, cp_rank)
                  .ne(loss_mask_eod_)
                  .reshape({-1})
                  .to(torch::kFloat32);
  return head_loss_sum(x, targets.reshape({-1}), weights);
}

torch::Tensor DecoderImpl::head_loss_sum(const torch::Tensor& x, const torch::Tensor& targets,
                                         const torch::Tensor& weights) {
  if (lean_chunk_ < 0) return token_loss_sum(logits(x), targets, weights);
  auto y = tp::enter(*o_.tp, norm(x), o_.sequence_parallel);  // [b, T, h], every tp rank
  const auto& w = head ? head->weight : embed->weight;        // [Vp/t, h]
  const int64_t v = o_.model.vocab_size;
  return tp::fused_head_cross_entropy_sum(
      *o_.tp, y.reshape({-1, y.size(-1)}), w, targets,
      tp::vocab_slice_start(v, o_.tp->size(), o_.tp->rank()), v,
      lean_chunk_ > 0 ? lean_chunk_ : tp::default_head_chunk_rows(w.size(0), w.is_cuda()), weights);
}

torch::Tensor DecoderImpl::forward(const torch::Tensor& tokens, const kernels::Documents* docs) {
  TORCH_CHECK(chunks() == 1 && o_.stages.first && o_.stages.last,
              "DecoderImpl::forward needs the whole model on this rank");
  TORCH_CHECK(cp_size() == 1, "DecoderImpl::forward runs without context parallelism");
  const auto pos = positions(tokens.size(1), tokens.device(), docs);
  return logits(run_blocks(0, embed_tokens(tokens, pos), pos, docs));
}

torch::Tensor DecoderImpl::decode(const torch::Tensor& tokens, int64_t start) {
  TORCH_CHECK(
      chunks() == 1 && o_.stages.first && o_.stages.last && cp_size() == 1 && o_.tp->size() == 1,
      "DecoderImpl::decode needs the whole model in one process");
  auto& blocks = blocks_[0];
  if (start == 0) caches_.assign(blocks.size(), {});
  TORCH_CHECK(caches_.size() == blocks.size() && (start == 0 || caches_[0].k.size(2) == start),
              "decode: start ", start, " does not follow the cached positions");
  const int64_t n = tokens.size(1);
  auto pos = positions(start + n, tokens.device()).narrow(0, start, n);
  auto x = embed(tokens);
  if (pos_embed) x = x + pos_embed(pos);
  torch::Tensor cos, sin;
  if (!o_.learned_pos) {
    // One table for every length (a position's angles do not depend on the length).
    TORCH_CHECK(start + n <= o_.model.max_seq_len, "decode: position ", start + n,
                " is beyond model.max_seq_len ", o_.model.max_seq_len);
    const auto& [c, s] = rope(o_.model.max_seq_len, x.device(), x.scalar_type());
    cos = c.narrow(0, start, n), sin = s.narrow(0, start, n);
  }
  try {
    for (size_t i = 0; i < blocks.size(); ++i) {
      blocks[i]->attn->cache = &caches_[i];
      x = blocks[i]->forward(x, cos, sin);
      blocks[i]->attn->cache = nullptr;
    }
  } catch (...) {
    // No block may keep the cache (a later forward would attend to stale keys), and a cache
    // extended in some blocks only is dropped: the next decode must start again at 0.
    for (auto& b : blocks) b->attn->cache = nullptr;
    caches_.clear();
    throw;
  }
  return logits(x);
}

torch::Tensor DecoderImpl::loss_sum(const torch::Tensor& rows, const kernels::Documents* docs) {
  TORCH_CHECK(chunks() == 1 && o_.stages.first && o_.stages.last,
              "DecoderImpl::loss_sum needs the whole model on this rank");
  return stage_forward(0, {}, rows, docs);
}

torch::Tensor DecoderImpl::token_loss_sum(const torch::Tensor& logits, const torch::Tensor& targets,
                                          const torch::Tensor& weights) {
  auto flat = logits.reshape({-1, logits.size(-1)});  // [b·T, Vp/tp]
  // This rank's logits are its slice of the padded vocabulary (from the head or the table); with
  // one tensor-parallel rank, all of it. One fp32 [b·T, V/tp] buffer, softmax and gradient made
  // in place (torch's cross_entropy would keep an fp32 copy and the log-softmax besides).
  const int64_t v = o_.model.vocab_size;
  auto losses = tp::vocab_parallel_cross_entropy(
      *o_.tp, flat, targets, tp::vocab_slice_start(v, o_.tp->size(), o_.tp->rank()), v);
  return weights.defined() ? (losses * weights).sum() : losses.sum();
}

}  // namespace tessel::models
