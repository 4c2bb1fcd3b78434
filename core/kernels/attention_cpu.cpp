#include "core/kernels/attention_cpu.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/torch.h>

#include <cmath>

#include "core/kernels/softmax_kernels.h"

namespace tessel::kernels {
namespace {

// The problem's sizes: q [b, h, m, d], k and v [b, kvh, n, d], g = h / kvh query heads per key.
struct Dims {
  int64_t b, h, kvh, g, m, n, d;
  int64_t batches() const { return b * kvh; }
  cpu::ScoreRows rows(bool causal) const {
    return {batches() * g * m, n, m, causal, 1.0f / std::sqrt(static_cast<float>(d))};
  }
};

Dims dims(const torch::Tensor& q, int64_t kv_batches, int64_t n) {
  const int64_t b = q.size(0), h = q.size(1), kvh = kv_batches / b;
  return {b, h, kvh, h / kvh, q.size(2), n, q.size(3)};
}

// The fused head loops' views of [b, heads, s, d] tensors (last dimension contiguous).
cpu::HeadsConst in_view(const torch::Tensor& t) {
  return {t.const_data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
cpu::HeadsOut out_view(torch::Tensor& t) {
  return {t.mutable_data_ptr<float>(), t.stride(0), t.stride(1), t.stride(2)};
}
torch::Tensor last_contiguous(const torch::Tensor& t) {
  return t.stride(3) == 1 ? t : t.contiguous();
}
// [b, heads, s, d] over [b, s, heads, d] memory: what the projections' views have and what the
// output projection reads without a copy (SDPA's kernels return this layout too).
torch::Tensor heads_over_tokens(int64_t b, int64_t heads, int64_t s, int64_t d,
                                const torch::TensorOptions& o) {
  return torch::empty({b, s, heads, d}, o).transpose(1, 2);
}

cpu::AttentionDims loop_dims(const torch::Tensor& q, const torch::Tensor& k, bool causal) {
  return {q.size(0), q.size(1), k.size(1), q.size(2),
          k.size(2), q.size(3), causal,    1.0f / std::sqrt(static_cast<float>(q.size(3)))};
}

class ShortAttentionFn : public torch::autograd::Function<ShortAttentionFn> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, bool causal) {
    // Named in --profile's table: a custom function's forward is no dispatched operator.
    RECORD_FUNCTION("tessel::attention", std::vector<c10::IValue>());
    auto [out, saved] = short_attention_forward(q, k, v, causal);
    ctx->save_for_backward({saved.q, saved.k, saved.v, saved.probs});
    ctx->saved_data["causal"] = causal;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_FUNCTION("tessel::attention_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = short_attention_backward(grads[0], {s[0], s[1], s[2], s[3]},
                                                 ctx->saved_data["causal"].toBool());
    return {dq, dk, dv, torch::Tensor()};
  }
};

}  // namespace

bool short_attention_applies(const torch::Device& device, torch::ScalarType dtype, int64_t keys) {
  return device.is_cpu() && dtype == torch::kFloat32 && keys <= kShortAttentionKeys;
}

bool short_attention_applies(const torch::Tensor& q, const torch::Tensor& k, bool causal) {
  return short_attention_applies(q.device(), q.scalar_type(), k.size(2)) &&
         k.scalar_type() == torch::kFloat32 && q.size(1) % k.size(1) == 0 &&
         (!causal || q.size(2) == k.size(2));
}

std::pair<torch::Tensor, ShortAttentionSaved> short_attention_forward(const torch::Tensor& q,
                                                                      const torch::Tensor& k,
                                                                      const torch::Tensor& v,
                                                                      bool causal) {
  if (cpu::head_loops_apply(q.size(3))) {  // the fused loops: no copies in or out
    const auto a = loop_dims(q, k, causal);
    ShortAttentionSaved s{last_contiguous(q), last_contiguous(k), last_contiguous(v),
                          torch::empty({a.b, a.heads, a.m, cpu::padded_keys(a.n)}, q.options())};
    auto out = heads_over_tokens(a.b, a.heads, a.m, a.d, q.options());
    cpu::attention_forward(a, in_view(s.q), in_view(s.k), in_view(s.v), out_view(out),
                           s.probs.mutable_data_ptr<float>());
    return {out, std::move(s)};
  }
  const auto x = dims(q, q.size(0) * k.size(1), k.size(2));
  ShortAttentionSaved s;
  // One copy each out of the [b, s, heads, d] memory the projections wrote.
  s.q = q.reshape({x.batches(), x.g * x.m, x.d});
  s.k = k.reshape({x.batches(), x.n, x.d});
  s.v = v.reshape({x.batches(), x.n, x.d});
  s.probs = at::bmm(s.q, s.k.transpose(1, 2));
  cpu::softmax_rows(s.probs.mutable_data_ptr<float>(), x.rows(causal));
  auto out = at::bmm(s.probs, s.v).view({x.b, x.h, x.m, x.d});
  return {out, std::move(s)};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> short_attention_backward(
    const torch::Tensor& dout, const ShortAttentionSaved& saved, bool causal) {
  if (saved.probs.dim() == 4) {  // the forward ran the fused loops
    const auto a = loop_dims(saved.q, saved.k, causal);
    const auto o = saved.q.options();
    auto dq = heads_over_tokens(a.b, a.heads, a.m, a.d, o);
    auto dk = heads_over_tokens(a.b, a.kv_heads, a.n, a.d, o);
    auto dv = heads_over_tokens(a.b, a.kv_heads, a.n, a.d, o);
    cpu::attention_backward(a, in_view(last_contiguous(dout)), in_view(saved.q), in_view(saved.k),
                            in_view(saved.v), saved.probs.const_data_ptr<float>(), out_view(dq),
                            out_view(dk), out_view(dv));
    return {dq, dk, dv};
  }
  const auto x = dims(dout, saved.k.size(0), saved.k.size(1));
  const auto g = dout.reshape({x.batches(), x.g * x.m, x.d});
  auto dv = at::bmm(saved.probs.transpose(1, 2), g);
  auto ds = at::bmm(g, saved.v.transpose(1, 2));  // the probabilities' gradient, then the scores'
  cpu::softmax_backward_rows(saved.probs.const_data_ptr<float>(), ds.mutable_data_ptr<float>(),
                             x.rows(causal));
  auto dq = at::bmm(ds, saved.k).view({x.b, x.h, x.m, x.d});
  auto dk = at::bmm(ds.transpose(1, 2), saved.q).view({x.b, x.kvh, x.n, x.d});
  return {dq, dk, dv.view({x.b, x.kvh, x.n, x.d})};
}

torch::Tensor short_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, bool causal) {
  TORCH_CHECK(short_attention_applies(q, k, causal), "short_attention: q ", q.sizes(), " ",
              q.scalar_type(), " on ", q.device(), " against k ", k.sizes(),
              " is not what it takes (CPU fp32, at most ", kShortAttentionKeys, " keys)");
  if (torch::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad()))
    return ShortAttentionFn::apply(q, k, v, causal);
  RECORD_FUNCTION("tessel::attention", std::vector<c10::IValue>());
  return short_attention_forward(q, k, v, causal).first;
}

}  // namespace tessel::kernels
