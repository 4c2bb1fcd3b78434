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
};

struct Dispatched {
  torch::Tensor rows;     // [R, h]: the rows of this rank's experts, local expert ascending
  torch::Tensor offsets;  // [E / ep] int32: cumulative rows per local expert (grouped matmul)
  std::vector<int64_t> local_rows;  // rows per local expert (host; empty when ep is 1)
  Route route;
};

/// `rows` [M, h] sorted by global expert, `counts` [E] int64 on their device (rows of each
/// expert). With one ep rank nothing moves and nothing waits for the host; otherwise the counts
/// are exchanged first (one small all-to-all) and read on the host for the split sizes.
Dispatched dispatch(Group& ep, const torch::Tensor& rows, const torch::Tensor& counts);

/// `out` [R, h] in dispatch()'s order -> [M, h] in the order of dispatch()'s `rows`.
torch::Tensor combine(Group& ep, const torch::Tensor& out, const Route& route);

/// All-to-all of rows with variable split sizes: send[j] rows of `x` (in order) go to rank j,
/// and the result holds recv[s] rows from each rank s, in rank order. Differentiable.
torch::Tensor all_to_all_rows(Group& g, const torch::Tensor& x, const std::vector<int64_t>& send,
                              const std::vector<int64_t>& recv);

}  // namespace tessel::parallel::ep
