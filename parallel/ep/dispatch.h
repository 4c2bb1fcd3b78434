// Expert parallelism (parallel.ep): an MoE layer's experts are split over the ep group, rank j
// holding experts [j·E/ep, (j+1)·E/ep). Every rank routes its own tokens; dispatch() sends each
// (token, expert) row to the rank that holds its expert with one all-to-all of variable split
// sizes, and combine() brings the experts' outputs back with the reverse one. Both are
// differentiable: the backward of each transfer is the transfer the other way.
//
//   rows sorted by global expert     | e0 e1 | e2 e3 |   (ep = 2: rank 0 holds e0 e1)
//   received on rank r, by source    | from rank 0: er0 er1 | from rank 1: er0 er1 |
//   dispatched (expert-major)        | er0 (rank 0's, rank 1's) | er1 (...) |   -> grouped matmul
#pragma once

#include <torch/types.h>

#include <vector>

#include "parallel/comm.h"

namespace tessel::parallel::ep {

/// Where dispatch() sent the rows, for combine().
struct Route {
  std::vector<int64_t> send, recv;  // rows to and from each ep rank
  torch::Tensor restore;  // [R] int64: position in the dispatched order of each received row
  int64_t rows = 0;       // M: rows handed to dispatch(), dropped ones included
};

struct Dispatched {
  torch::Tensor rows;     // [R, h]: the rows of this rank's experts, local expert ascending
  torch::Tensor offsets;  // [E / ep] int32: cumulative rows per local expert (grouped matmul)
  std::vector<int64_t> local_rows;  // rows per local expert (host; empty unless read)
  Route route;
};

/// `rows` [M, h] sorted by global expert, `counts` [E] int64 on their device (rows of each
/// expert); rows past sum(counts) are dropped choices (the capacity factor's), which no expert
/// needs. With one ep rank nothing moves and nothing is read on the host unless `host_rows`
/// asks for the rows per expert (one read); the dropped rows ride in the last expert's group
/// (their gate weight is 0, so they add exact zeros). With several, the counts are exchanged
/// (one small all-to-all) and read on the host once for the split sizes, and the dropped rows
/// stay home. So an MoE layer reads the host at most once per forward: the split sizes of a
/// dropless exchange depend on the routing (Megatron-Core's all-to-all dispatcher reads them too).
Dispatched dispatch(Group& ep, const torch::Tensor& rows, const torch::Tensor& counts,
                    bool host_rows = false);

/// `out` [R, h] in dispatch()'s order -> [M, h] in the order of dispatch()'s `rows` (zeros for
/// the dropped rows that stayed home).
torch::Tensor combine(Group& ep, const torch::Tensor& out, const Route& route);

/// Whether at::_grouped_mm runs for `rows` without reading its offsets on the host: always on
/// the CPU; on CUDA its fast path (bf16 on compute capability 9.x and 10.x, PyTorch 2.11); its
/// fallback elsewhere reads them once per call (9 calls per MoE layer forward and backward).
bool grouped_mm_on_device(const torch::Tensor& rows);

/// All-to-all of rows with variable split sizes: send[j] rows of `x` (in order) go to rank j,
/// and the result holds recv[s] rows from each rank s, in rank order. Differentiable.
torch::Tensor all_to_all_rows(Group& g, const torch::Tensor& x, const std::vector<int64_t>& send,
                              const std::vector<int64_t>& recv);

}  // namespace tessel::parallel::ep
