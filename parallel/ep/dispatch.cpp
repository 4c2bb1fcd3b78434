#include "parallel/ep/dispatch.h"

#include <torch/torch.h>

#include "core/device/cuda.h"
#include "core/observe/host_reads.h"
#include "parallel/autograd_comm.h"

namespace tessel::parallel::ep {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor transfer(Group& g, const torch::Tensor& x, const std::vector<int64_t>& send,
                       const std::vector<int64_t>& recv) {
  int64_t rows = 0;
  for (auto r : recv) rows += r;
  auto shape = x.sizes().vec();
  shape[0] = rows;
  auto out = torch::empty(shape, x.options());
  auto in = x.contiguous();
  g.all_to_all(out, in, recv, send).wait();
  return out;
}

struct RowsAllToAll : torch::autograd::Function<RowsAllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g,
                               std::vector<int64_t> send, std::vector<int64_t> recv) {
    ctx->saved_data["g"] = g;
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return transfer(unpack_group(g), x, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto& g = unpack_group(ctx->saved_data["g"].toInt());
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {transfer(g, grad[0], recv, send), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all_rows(Group& g, const torch::Tensor& x, const std::vector<int64_t>& send,
                              const std::vector<int64_t>& recv) {
  TORCH_CHECK(static_cast<int64_t>(send.size()) == g.size() &&
                  static_cast<int64_t>(recv.size()) == g.size(),
              "all_to_all_rows: one split size per rank of ", g.name());
  if (g.size() == 1) return x;
  return RowsAllToAll::apply(x, pack_group(g), send, recv);
}

Dispatched dispatch(Group& ep, const torch::Tensor& rows, const torch::Tensor& counts,
                    bool host_rows) {
  const int64_t n = ep.size(), experts = counts.size(0), local = experts / n;
  TORCH_CHECK(experts % n == 0, "dispatch: ", experts, " experts over ", n, " ep ranks");
  const int64_t total = rows.size(0);
  Dispatched d;
  d.route.rows = total;
  if (n == 1) {
    // The last group ends at the last row: dropped rows (if any) ride in it.
    auto ends = counts.cumsum(0);
    ends.narrow(0, experts - 1, 1).fill_(total);
    d.rows = rows;
    d.offsets = ends.to(torch::kInt32);
    if (host_rows) {
      auto h = observe::read_on_host(counts);
      d.local_rows.assign(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + experts);
      int64_t kept = 0;
      for (auto r : d.local_rows) kept += r;
      d.local_rows.back() += total - kept;
    }
    return d;
  }
  // What every source sends to each of this rank's experts: row s, column e.
  auto mine = all_to_all_dim(ep, counts.view({n, local}).contiguous(), 0);
  // The one host read of the layer: split sizes of both transfers.
  auto host = observe::read_on_host(torch::cat({counts.view({n, local}).sum(1), mine.reshape(-1)}));
  const auto* h = host.data_ptr<int64_t>();
  d.route.send.assign(h, h + n);
  d.route.recv.assign(static_cast<size_t>(n), 0);
  d.local_rows.assign(static_cast<size_t>(local), 0);
  int64_t kept = 0;
  for (int64_t s = 0; s < n; ++s) {
    kept += h[s];
    for (int64_t e = 0; e < local; ++e) {
      d.route.recv[static_cast<size_t>(s)] += h[n + s * local + e];
      d.local_rows[static_cast<size_t>(e)] += h[n + s * local + e];
    }
  }
  auto received = all_to_all_rows(ep, rows.narrow(0, 0, kept), d.route.send, d.route.recv);
  // Source-major -> expert-major (stable: within an expert, by source rank, then sent order).
  const int64_t r = received.size(0);
  auto idx = torch::TensorOptions().dtype(torch::kInt64).device(rows.device());
  auto expert_of = torch::repeat_interleave(torch::arange(local, idx).repeat({n}), mine.reshape(-1),
                                            /*dim=*/0, /*output_size=*/r);
  auto order = std::get<1>(expert_of.sort(std::optional<bool>(true), 0));
  d.route.restore = torch::empty_like(order).scatter_(0, order, torch::arange(r, idx));
  d.rows = received.index_select(0, order);
  d.offsets = mine.sum(0).cumsum(0).to(torch::kInt32);
  return d;
}

torch::Tensor combine(Group& ep, const torch::Tensor& out, const Route& route) {
  if (ep.size() == 1) return out;
  auto back = all_to_all_rows(ep, out.index_select(0, route.restore), route.recv, route.send);
  if (back.size(0) == route.rows) return back;
  return torch::cat(
      {back, torch::zeros({route.rows - back.size(0), back.size(1)}, back.options())});
}

bool grouped_mm_on_device(const torch::Tensor& rows) {
  if (!rows.is_cuda()) return true;
  if (rows.scalar_type() != torch::kBFloat16) return false;
  const auto* cuda = device::cuda_module();
  const int cc = cuda ? cuda->compute_capability(rows.device().index()) : 0;
  return cc >= 90 && cc < 110;
}

}  // namespace tessel::parallel::ep
