#include "parallel/cp/attention.h"

#include <torch/torch.h>

#include <array>
#include <stdexcept>

#include "parallel/attention_kernels.h"
#include "parallel/autograd_comm.h"

namespace tessel::parallel::cp {
namespace {

// The global chunk indices this rank's two chunks hold.
std::array<int64_t, 2> chunks_of(int64_t cp, int64_t rank) { return {rank, 2 * cp - 1 - rank}; }

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

// The end of both methods' forward: the two chunks' merged outputs (fp32) in the queries' dtype;
// saves `inputs`, then the output and the log-sum-exp, for backward.
torch::Tensor save_merged(torch::autograd::AutogradContext* ctx,
                          const std::array<torch::Tensor, 2>& out,
                          const std::array<torch::Tensor, 2>& lse,
                          std::vector<torch::Tensor> inputs, int64_t group) {
  auto y = torch::cat({out[0], out[1]}, 2).to(inputs[0].scalar_type());
  inputs.push_back(y);
  inputs.push_back(torch::cat({lse[0], lse[1]}, 2));
  ctx->save_for_backward(inputs);
  ctx->saved_data["group"] = group;
  return y;
}

// Ring attention as one autograd node: forward and backward each walk the ring once.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t group) {
    auto& g = unpack_group(group);
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
    return save_merged(ctx, out, lse, {q, k, v}, group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = unpack_group(ctx->saved_data["group"].toInt());
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

// All-gathered chunks along `dim` (each rank's 2 chunks of c, rank r's being r and 2n-1-r) put in
// global chunk order. Views and one cat: no index tensor to copy to the device on every layer.
torch::Tensor to_global_order(const torch::Tensor& all, int64_t dim, int64_t n, int64_t c) {
  std::vector<torch::Tensor> ordered;
  for (int64_t chunk = 0; chunk < 2 * n; ++chunk)
    ordered.push_back(
        all.narrow(dim, (chunk < n ? 2 * chunk : 2 * (2 * n - 1 - chunk) + 1) * c, c));
  return torch::cat(ordered, dim);
}
// Its inverse: rank r's slot holds global chunks r and 2n-1-r.
torch::Tensor to_rank_order(const torch::Tensor& global, int64_t dim, int64_t n, int64_t c) {
  std::vector<torch::Tensor> ordered;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t chunk : chunks_of(n, r)) ordered.push_back(global.narrow(dim, chunk * c, c));
  return torch::cat(ordered, dim);
}

// All-gather attention as one autograd node. Forward all-gathers K and V; each local query chunk
// then attends to its own (diagonal) key chunk causally and to every earlier chunk in one
// unmasked block, merged by log-sum-exp: the same block kernels as ring (flash on CPU, memory-
// efficient on CUDA), no materialised mask, and no math-kernel fallback for grouped-query heads.
// Backward accumulates dK/dV over the whole sequence in fp32 and reduce-scatters them in fp32
// (as ring accumulates), so bf16 gradients are rounded once, after the sum over cp ranks.
struct AllGatherAttention : torch::autograd::Function<AllGatherAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t group) {
    auto& g = unpack_group(group);
    const int64_t n = g.size(), c = q.size(2) / 2, heads = q.size(1);
    const auto mine = chunks_of(n, g.rank());
    // [2, b, kv_heads, 2c, d] -> [2, b, kv_heads, 2n·c, d]: one all-gather for K and V.
    auto kv = to_global_order(all_gather_dim(g, torch::stack({k, v}), 3), 3, n, c);
    std::array<torch::Tensor, 2> out, lse;
    for (int a = 0; a < 2; ++a) {
      const auto qa = q.narrow(2, a * c, c);
      const int64_t at = mine[a] * c;  // keys before this chunk: [0, at)
      auto [o, l] = block_forward(qa, expand_heads(kv[0].narrow(2, at, c), heads),
                                  expand_heads(kv[1].narrow(2, at, c), heads), /*causal=*/true);
      out[a] = o.to(torch::kFloat32);
      lse[a] = l;
      if (at > 0) {
        auto [op, lp] = block_forward(qa, expand_heads(kv[0].narrow(2, 0, at), heads),
                                      expand_heads(kv[1].narrow(2, 0, at), heads), false);
        merge(out[a], lse[a], op, lp);
      }
    }
    return save_merged(ctx, out, lse, {q, kv}, group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = unpack_group(ctx->saved_data["group"].toInt());
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &kv = saved[1], &y = saved[2], &lse = saved[3];
    const int64_t n = g.size(), c = q.size(2) / 2, heads = q.size(1), kvh = kv.size(2);
    const auto mine = chunks_of(n, g.rank());
    auto dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat32));
    auto dkv = torch::zeros(kv.sizes(), dq.options());  // [2, b, kv_heads, 2n·c, d], global order
    auto add = [&](int64_t a, int64_t from, int64_t len, bool causal) {
      auto [dqa, dk, dv] = block_backward(grads[0].narrow(2, a * c, c), q.narrow(2, a * c, c),
                                          expand_heads(kv[0].narrow(2, from, len), heads),
                                          expand_heads(kv[1].narrow(2, from, len), heads),
                                          y.narrow(2, a * c, c), lse.narrow(2, a * c, c), causal);
      dq.narrow(2, a * c, c).add_(dqa);
      dkv[0].narrow(2, from, len).add_(sum_heads(dk, kvh));
      dkv[1].narrow(2, from, len).add_(sum_heads(dv, kvh));
    };
    for (int64_t a = 0; a < 2; ++a) {
      add(a, mine[a] * c, c, true);
      if (mine[a] > 0) add(a, 0, mine[a] * c, false);
    }
    // Every rank's contribution to this rank's two chunks, summed in fp32.
    auto mine_kv = reduce_scatter_dim(g, to_rank_order(dkv, 3, n, c), 3);  // [2, b, kvh, 2c, d]
    return {dq.to(q.scalar_type()), mine_kv[0].to(q.scalar_type()), mine_kv[1].to(q.scalar_type()),
            torch::Tensor()};
  }
};

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
  if (method == Method::kAllGather) return AllGatherAttention::apply(q, k, v, pack_group(cp));
  return RingAttention::apply(q, k, v, pack_group(cp));
}

}  // namespace tessel::parallel::cp
