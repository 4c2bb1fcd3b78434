#include "parallel/cp/attention.h"

#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/torch.h>

#include <stdexcept>

#include "parallel/autograd_comm.h"

namespace tessel::parallel::cp {
namespace {

// The memory-efficient CUDA kernel pads its log-sum-exp to a multiple of 32 queries.
constexpr int64_t kLseAlign = 32;

// The global chunk indices this rank's two chunks hold.
std::array<int64_t, 2> chunks_of(int64_t cp, int64_t rank) { return {rank, 2 * cp - 1 - rank}; }

// Grouped-query: key/value heads repeated for the query heads that share them (SDPA's
// enable_gqa order), and their gradients summed back.
torch::Tensor expand_heads(const torch::Tensor& kv, int64_t heads) {
  const int64_t groups = heads / kv.size(1);
  return groups == 1 ? kv : kv.repeat_interleave(groups, 1);
}
torch::Tensor sum_heads(const torch::Tensor& g, int64_t kv_heads) {
  const int64_t groups = g.size(1) / kv_heads;
  if (groups == 1) return g;
  return g.view({g.size(0), kv_heads, groups, g.size(2), g.size(3)}).sum(2);
}

// out, lse (fp32 accumulators) <- the log-sum-exp merge of a block's (o, l).
void merge(torch::Tensor& out, torch::Tensor& lse, const torch::Tensor& o, const torch::Tensor& l) {
  auto merged = torch::logaddexp(lse, l);
  out = out * (lse - merged).exp().unsqueeze(-1) +
        o.to(torch::kFloat32) * (l - merged).exp().unsqueeze(-1);
  lse = merged;
}

torch::Tensor ring_send_recv(Group& g, const torch::Tensor& send, std::vector<Work>& works,
                             int tag) {
  const int64_t n = g.size(), r = g.rank();
  auto recv = torch::empty_like(send);
  works = g.send_recv(
      {{P2POp::kSend, send, (r + 1) % n, tag}, {P2POp::kRecv, recv, (r + n - 1) % n, tag}});
  return recv;
}

void wait_all(std::vector<Work>& works) {
  for (auto& w : works) w.wait();
  works.clear();
}

// Ring attention as one autograd node: forward and backward each walk the ring once.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t group) {
    auto& g = *reinterpret_cast<Group*>(group);
    const int64_t n = g.size(), r = g.rank(), c = q.size(2) / 2, heads = q.size(1);
    const auto mine = chunks_of(n, r);
    std::array<torch::Tensor, 2> out, lse;
    for (int a = 0; a < 2; ++a) {
      out[a] = torch::zeros({q.size(0), heads, c, q.size(3)}, q.options().dtype(torch::kFloat32));
      lse[a] = torch::full({q.size(0), heads, c}, -INFINITY, out[a].options());
    }
    auto kv = torch::stack({k, v}).contiguous();  // [2, b, kv_heads, 2c, d]: one message
    std::vector<Work> works;
    for (int64_t step = 0; step < n; ++step) {
      torch::Tensor next;
      if (step + 1 < n) next = ring_send_recv(g, kv, works, static_cast<int>(step));
      const auto theirs = chunks_of(n, (r - step + n) % n);
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          if (theirs[b] > mine[a]) continue;  // keys after every query of the chunk
          auto [o, l] =
              block_forward(q.narrow(2, a * c, c), expand_heads(kv[0].narrow(2, b * c, c), heads),
                            expand_heads(kv[1].narrow(2, b * c, c), heads), theirs[b] == mine[a]);
          merge(out[a], lse[a], o, l);
        }
      wait_all(works);
      if (next.defined()) kv = next;
    }
    auto y = torch::cat({out[0], out[1]}, 2).to(q.scalar_type());
    ctx->save_for_backward({q, k, v, y, torch::cat({lse[0], lse[1]}, 2)});
    ctx->saved_data["group"] = group;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &y = saved[3], &lse = saved[4];
    const auto dy = grads[0].contiguous();
    const int64_t n = g.size(), r = g.rank(), c = q.size(2) / 2, heads = q.size(1), kvh = k.size(1);
    const auto mine = chunks_of(n, r);
    auto dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat32));
    auto kv = torch::stack({k, v}).contiguous();
    auto dkv = torch::zeros(kv.sizes(), dq.options());  // travels with its block
    std::vector<Work> works;
    for (int64_t step = 0; step < n; ++step) {
      torch::Tensor next;
      if (step + 1 < n) next = ring_send_recv(g, kv, works, static_cast<int>(2 * step));
      const auto theirs = chunks_of(n, (r - step + n) % n);
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          if (theirs[b] > mine[a]) continue;
          auto [dqa, dk, dv] =
              block_backward(dy.narrow(2, a * c, c), q.narrow(2, a * c, c),
                             expand_heads(kv[0].narrow(2, b * c, c), heads),
                             expand_heads(kv[1].narrow(2, b * c, c), heads), y.narrow(2, a * c, c),
                             lse.narrow(2, a * c, c), theirs[b] == mine[a]);
          dq.narrow(2, a * c, c).add_(dqa);
          dkv[0].narrow(2, b * c, c).add_(sum_heads(dk, kvh));
          dkv[1].narrow(2, b * c, c).add_(sum_heads(dv, kvh));
        }
      // The block's gradient moves on with it; after the last step one more hop brings every
      // block's gradient home to its owner.
      std::vector<Work> sent;
      auto dnext = ring_send_recv(g, dkv, sent, static_cast<int>(2 * step + 1));
      wait_all(works);
      wait_all(sent);
      dkv = dnext;
      if (next.defined()) kv = next;
    }
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()),
            torch::Tensor()};
  }
};

// All-gather K/V (reduce-scatter of their gradients in backward), in global chunk order.
torch::Tensor gather_sequence(Group& g, const torch::Tensor& x) {
  const int64_t n = g.size(), c = x.size(2) / 2;
  auto all = sequence_gather(g, x.contiguous(), 2);  // rank order: r's chunks (r, 2n-1-r)
  // Global chunk `chunk` sits at rank chunk (first half) or rank 2n-1-chunk (second half). Views
  // and one cat: no index tensor to copy to the device on every layer.
  std::vector<torch::Tensor> ordered;
  for (int64_t chunk = 0; chunk < 2 * n; ++chunk)
    ordered.push_back(all.narrow(2, (chunk < n ? 2 * chunk : 2 * (2 * n - 1 - chunk) + 1) * c, c));
  return torch::cat(ordered, 2);
}

torch::Tensor allgather_attention(Group& g, const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v) {
  const int64_t c = q.size(2) / 2;
  auto keys = gather_sequence(g, k), values = gather_sequence(g, v);
  const auto mine = chunks_of(g.size(), g.rank());
  std::array<torch::Tensor, 2> out;
  for (int a = 0; a < 2; ++a) {
    // Queries of chunk `mine[a]` see every key up to their own position (causal, aligned to the
    // bottom right of the [c, (chunk + 1)·c] score block).
    const int64_t seen = (mine[a] + 1) * c;
    auto opts = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
    auto mask = torch::arange(seen, opts).unsqueeze(0) <=
                (torch::arange(c, opts) + mine[a] * c).unsqueeze(1);
    out[a] = at::scaled_dot_product_attention(q.narrow(2, a * c, c), keys.narrow(2, 0, seen),
                                              values.narrow(2, 0, seen), mask, 0.0, false,
                                              std::nullopt, /*enable_gqa=*/k.size(1) != q.size(1));
  }
  return torch::cat({out[0], out[1]}, 2);
}

}  // namespace

Method method_of(const std::string& name) {
  if (name == "allgather") return Method::kAllGather;
  if (name == "ring") return Method::kRing;
  throw std::invalid_argument("parallel.context.method: '" + name + "' (allgather or ring)");
}

torch::Tensor local_positions(int64_t seq, int64_t cp, int64_t rank, const torch::Device& device) {
  const int64_t c = seq / (2 * cp);
  auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  const auto mine = chunks_of(cp, rank);
  return torch::cat({torch::arange(mine[0] * c, (mine[0] + 1) * c, opts),
                     torch::arange(mine[1] * c, (mine[1] + 1) * c, opts)});
}

torch::Tensor local_chunks(const torch::Tensor& x, int64_t dim, int64_t cp, int64_t rank) {
  if (cp == 1) return x;
  const int64_t c = x.size(dim) / (2 * cp);
  const auto mine = chunks_of(cp, rank);
  return torch::cat({x.narrow(dim, mine[0] * c, c), x.narrow(dim, mine[1] * c, c)}, dim);
}

torch::Tensor attention(Group& cp, Method method, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v) {
  if (method == Method::kAllGather) return allgather_attention(cp, q, k, v);
  return RingAttention::apply(q, k, v, reinterpret_cast<int64_t>(&cp));
}

std::pair<torch::Tensor, torch::Tensor> block_forward(const torch::Tensor& q,
                                                      const torch::Tensor& k,
                                                      const torch::Tensor& v, bool causal) {
  if (q.is_cuda()) {
    auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
        q, k, v, std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal);
    return {out, lse.narrow(2, 0, q.size(2))};
  }
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q.contiguous(), k.contiguous(),
                                                                    v.contiguous(), 0.0, causal);
  return {out, lse};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_backward(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse, bool causal) {
  if (q.is_cuda()) {
    const int64_t m = q.size(2), padded = (m + kLseAlign - 1) / kLseAlign * kLseAlign;
    auto full = torch::zeros({lse.size(0), lse.size(1), padded}, lse.options());
    full.narrow(2, 0, m).copy_(lse);
    auto none = torch::zeros({}, q.options().dtype(torch::kInt64));  // no dropout: unused
    auto [dq, dk, dv, dbias] = at::_scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, torch::Tensor(), out.contiguous(), full, none, none, 0.0,
        {true, true, true, false}, causal);
    return {dq, dk, dv};
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
      lse.contiguous(), 0.0, causal);
}

}  // namespace tessel::parallel::cp
