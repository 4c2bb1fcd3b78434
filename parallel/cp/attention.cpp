#include "parallel/cp/attention.h"

#include <torch/torch.h>

#include <array>
#include <numeric>
#include <stdexcept>

#include "core/kernels/attention_kernels.h"
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
  works.clear();
  if (n == 1) return send;  // a ring of one (hybrid with one all-to-all group): it stays here
  auto recv = torch::empty_like(send);
  works = g.send_recv(
      {{P2POp::kSend, send, (r + 1) % n, tag}, {P2POp::kRecv, recv, (r + n - 1) % n, tag}});
  return recv;
}

void wait_all(std::vector<Work>& works) {
  for (auto& w : works) w.wait();
  works.clear();
}

// The end of both methods' forward: the chunks' merged outputs (fp32) in the queries' dtype;
// saves `inputs`, then the output and the log-sum-exp, for backward.
torch::Tensor save_merged(torch::autograd::AutogradContext* ctx,
                          const std::vector<torch::Tensor>& out,
                          const std::vector<torch::Tensor>& lse, std::vector<torch::Tensor> inputs,
                          int64_t group) {
  auto y = torch::cat(out, 2).to(inputs[0].scalar_type());
  inputs.push_back(y);
  inputs.push_back(torch::cat(lse, 2));
  ctx->save_for_backward(inputs);
  ctx->saved_data["group"] = group;
  return y;
}

// The global chunks ring member `member` holds, in the order they lie along its sequence
// dimension, when each member holds the tokens of `blocks` consecutive cp ranks of `n` (plain
// ring: 1, the member's own two chunks; hybrid: its all-to-all group's, in group rank order).
std::vector<int64_t> held_chunks(int64_t n, int64_t blocks, int64_t member) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t chunk : chunks_of(n, member * blocks + i)) out.push_back(chunk);
  return out;
}

// Ring attention as one autograd node: forward and backward each walk the ring once. Each ring
// member holds the tokens of `blocks` cp ranks (held_chunks) of n = ring size · blocks.
struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
                               const torch::Tensor& k, const torch::Tensor& v, int64_t group,
                               int64_t blocks) {
    auto& g = unpack_group(group);
    const int64_t m = g.size(), r = g.rank(), n = m * blocks, heads = q.size(1);
    const auto mine = held_chunks(n, blocks, r);
    const auto held = static_cast<int64_t>(mine.size());
    const int64_t c = q.size(2) / held;
    std::vector<torch::Tensor> out(static_cast<size_t>(held)), lse(out.size());
    for (size_t a = 0; a < out.size(); ++a) {
      out[a] = torch::zeros({q.size(0), heads, c, q.size(3)}, q.options().dtype(torch::kFloat32));
      lse[a] = torch::full({q.size(0), heads, c}, -INFINITY, out[a].options());
    }
    auto kv = torch::stack({k, v}).contiguous();  // [2, b, kv_heads, held·c, d]: one message
    std::vector<Work> works;
    for (int64_t step = 0; step < m; ++step) {
      torch::Tensor next;
      if (step + 1 < m) next = ring_send_recv(g, kv, works, static_cast<int>(step));
      const auto theirs = held_chunks(n, blocks, (r - step + m) % m);
      for (int64_t a = 0; a < held; ++a)
        for (int64_t b = 0; b < held; ++b) {
          if (theirs[b] > mine[a]) continue;  // keys after every query of the chunk
          auto [o, l] = kernels::block_forward(
              q.narrow(2, a * c, c), kernels::expand_heads(kv[0].narrow(2, b * c, c), heads),
              kernels::expand_heads(kv[1].narrow(2, b * c, c), heads), theirs[b] == mine[a]);
          merge(out[a], lse[a], o, l);
        }
      wait_all(works);
      if (next.defined()) kv = next;
    }
    ctx->saved_data["blocks"] = blocks;
    return save_merged(ctx, out, lse, {q, k, v}, group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& g = unpack_group(ctx->saved_data["group"].toInt());
    const int64_t blocks = ctx->saved_data["blocks"].toInt();
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &y = saved[3], &lse = saved[4];
    const auto dy = grads[0].contiguous();
    const int64_t m = g.size(), r = g.rank(), n = m * blocks, heads = q.size(1), kvh = k.size(1);
    const auto mine = held_chunks(n, blocks, r);
    const auto held = static_cast<int64_t>(mine.size());
    const int64_t c = q.size(2) / held;
    auto dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat32));
    auto kv = torch::stack({k, v}).contiguous();
    auto dkv = torch::zeros(kv.sizes(), dq.options());  // travels with its block
    std::vector<Work> works;
    for (int64_t step = 0; step < m; ++step) {
      torch::Tensor next;
      if (step + 1 < m) next = ring_send_recv(g, kv, works, static_cast<int>(2 * step));
      const auto theirs = held_chunks(n, blocks, (r - step + m) % m);
      for (int64_t a = 0; a < held; ++a)
        for (int64_t b = 0; b < held; ++b) {
          if (theirs[b] > mine[a]) continue;
          auto [dqa, dk, dv] = kernels::block_backward(
              dy.narrow(2, a * c, c), q.narrow(2, a * c, c),
              kernels::expand_heads(kv[0].narrow(2, b * c, c), heads),
              kernels::expand_heads(kv[1].narrow(2, b * c, c), heads), y.narrow(2, a * c, c),
              lse.narrow(2, a * c, c), theirs[b] == mine[a]);
          dq.narrow(2, a * c, c).add_(dqa);
          dkv[0].narrow(2, b * c, c).add_(kernels::sum_heads(dk, kvh));
          dkv[1].narrow(2, b * c, c).add_(kernels::sum_heads(dv, kvh));
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
            torch::Tensor(), torch::Tensor()};
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
    std::vector<torch::Tensor> out(2), lse(2);
    for (int a = 0; a < 2; ++a) {
      const auto qa = q.narrow(2, a * c, c);
      const int64_t at = mine[a] * c;  // keys before this chunk: [0, at)
      auto [o, l] = kernels::block_forward(qa, kernels::expand_heads(kv[0].narrow(2, at, c), heads),
                                           kernels::expand_heads(kv[1].narrow(2, at, c), heads),
                                           /*causal=*/true);
      out[a] = o.to(torch::kFloat32);
      lse[a] = l;
      if (at > 0) {
        auto [op, lp] =
            kernels::block_forward(qa, kernels::expand_heads(kv[0].narrow(2, 0, at), heads),
                                   kernels::expand_heads(kv[1].narrow(2, 0, at), heads), false);
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
      auto [dqa, dk, dv] =
          kernels::block_backward(grads[0].narrow(2, a * c, c), q.narrow(2, a * c, c),
                                  kernels::expand_heads(kv[0].narrow(2, from, len), heads),
                                  kernels::expand_heads(kv[1].narrow(2, from, len), heads),
                                  y.narrow(2, a * c, c), lse.narrow(2, a * c, c), causal);
      dq.narrow(2, a * c, c).add_(dqa);
      dkv[0].narrow(2, from, len).add_(kernels::sum_heads(dk, kvh));
      dkv[1].narrow(2, from, len).add_(kernels::sum_heads(dv, kvh));
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

// Ulysses' exchange over `g` (n ranks): q [b, hq, L, d], k, v [b, hk, L, d] (this rank's L
// tokens, every head) -> [b, (hq + 2·hk')/n, n·L, d]: 1/n of q's, k's and v's heads (k and v
// repeated to hk' heads, a multiple of n) for the tokens of every rank of g, in group rank order.
torch::Tensor heads_for_tokens(Group& g, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  const int64_t n = g.size(), b = q.size(0), len = q.size(2), d = q.size(3);
  TORCH_CHECK(q.size(1) % n == 0, "alltoall attention: ", q.size(1), " query heads over ", n,
              " ranks");
  const int64_t e = alltoall_kv_heads(k.size(1), n) / k.size(1);  // repeats of each k/v head
  auto heads = [&](const torch::Tensor& x, int64_t repeat) {  // [b, h, L, d] -> [b, n, h/n, L, d]
    auto y = repeat > 1 ? x.repeat_interleave(repeat, 1) : x;
    return y.reshape({b, n, y.size(1) / n, len, d});
  };
  // Head group j goes to rank j; from rank r come its tokens of this rank's heads.
  auto got = exchange(g, torch::cat({heads(q, 1), heads(k, e), heads(v, e)}, 2), 1);
  return got.transpose(1, 2).reshape({b, got.size(2), n * len, d});
}

// Its inverse for the output: y [b, hq/n, n·L, d] (group rank order) -> [b, hq, L, d].
torch::Tensor tokens_for_heads(Group& g, const torch::Tensor& y) {
  const int64_t n = g.size(), b = y.size(0), h = y.size(1), len = y.size(2) / n, d = y.size(3);
  // Rank j's tokens go home; from rank r come this rank's tokens of head group r.
  auto back = exchange(g, y.reshape({b, h, n, len, d}), 2);
  return back.transpose(1, 2).reshape({b, h * n, len, d});
}

// Ulysses: dense causal attention on every token (in global order) of 1/n of the heads, through
// SDPA's kernels (as the block methods: context parallelism is for sequences long past Tessel's
// short-sequence kernel).
// With documents (the whole sequence's), attention inside each of them.
torch::Tensor alltoall_attention(Group& g, const torch::Tensor& q, const torch::Tensor& k,
                                 const torch::Tensor& v, const kernels::Documents* docs) {
  const int64_t n = g.size(), c = q.size(2) / 2, hq = q.size(1) / n;
  const int64_t hk = alltoall_kv_heads(k.size(1), n) / n;
  auto seq = to_global_order(heads_for_tokens(g, q, k, v), 2, n, c);
  const auto qs = seq.narrow(1, 0, hq), ks = seq.narrow(1, hq, hk), vs = seq.narrow(1, hq + hk, hk);
  auto y = docs ? kernels::document_attention(qs, ks, vs, *docs, /*tessel_kernels=*/false)
                : kernels::dense_attention(qs, ks, vs, /*causal=*/true, /*tessel_kernels=*/false);
  return tokens_for_heads(g, to_rank_order(y, 2, n, c));
}

// Hybrid: Ulysses inside the all-to-all group, then ring attention over the ranks that hold the
// same heads in every group, each holding its group's tokens.
torch::Tensor hybrid_attention(Group& cp, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v) {
  TORCH_CHECK(cp.inner() && cp.outer(), "hybrid attention: group ", cp.name(),
              " has no all-to-all / ring split");
  Group &inner = *cp.inner(), &outer = *cp.outer();
  const int64_t a = inner.size(), hq = q.size(1) / a;
  const int64_t hk = alltoall_kv_heads(k.size(1), a) / a;
  auto mine = heads_for_tokens(inner, q, k, v);
  auto y = RingAttention::apply(mine.narrow(1, 0, hq), mine.narrow(1, hq, hk),
                                mine.narrow(1, hq + hk, hk), pack_group(outer), a);
  return tokens_for_heads(inner, y);
}

}  // namespace

int64_t alltoall_kv_heads(int64_t kv_heads, int64_t cp) {
  return kv_heads % cp == 0 ? kv_heads : std::lcm(kv_heads, cp);
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

torch::Tensor attention(Group& cp, plan::CpMethod method, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& v,
                        const kernels::Documents* docs) {
  // The plan's rules refuse a document mask with the block methods (core/plan/rules.cpp).
  TORCH_CHECK(!docs || method == plan::CpMethod::kAllToAll,
              "context parallelism keeps attention inside documents with the alltoall method only");
  switch (method) {
    case plan::CpMethod::kAllGather:
      return AllGatherAttention::apply(q, k, v, pack_group(cp));
    case plan::CpMethod::kRing:
      return RingAttention::apply(q, k, v, pack_group(cp), 1);
    case plan::CpMethod::kAllToAll:
      return alltoall_attention(cp, q, k, v, docs);
    case plan::CpMethod::kHybrid:
      return hybrid_attention(cp, q, k, v);
  }
  throw std::logic_error("parallel::cp::attention: a method without its attention");
}

}  // namespace tessel::parallel::cp
