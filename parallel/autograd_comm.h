// Collectives that autograd differentiates: each forward collective has its conjugate in
// backward (Megatron-LM's pairs). The group must outlive the autograd graph (it lives in the Mesh).
//
//   copy_to(x)                forward: identity          backward: all-reduce (sum)
//   reduce_from(x)            forward: all-reduce (sum)  backward: identity
//   split(x, dim)             forward: keep my chunk     backward: all-gather along dim
//   gather(x, dim)            forward: all-gather        backward: keep my chunk
//   sequence_gather(x, dim)   forward: all-gather        backward: reduce-scatter (sum)
//   sequence_scatter(x, dim)  forward: reduce-scatter    backward: all-gather
//   exchange(x, dim)          forward: all-to-all        backward: all-to-all
//
// Chunks are in group-rank order: rank r holds slice r of size(dim) / group size.
#pragma once

#include <torch/types.h>

#include "parallel/comm.h"

namespace tessel::parallel {

torch::Tensor copy_to(Group& g, const torch::Tensor& x);
torch::Tensor reduce_from(Group& g, const torch::Tensor& x);
torch::Tensor split(Group& g, const torch::Tensor& x, int64_t dim);
torch::Tensor gather(Group& g, const torch::Tensor& x, int64_t dim);
torch::Tensor sequence_gather(Group& g, const torch::Tensor& x, int64_t dim);
torch::Tensor sequence_scatter(Group& g, const torch::Tensor& x, int64_t dim);
/// x's `dim` holds one slice per rank: slice j goes to rank j, and slice r of the result is what
/// rank r sent this rank (the same shape as x). Its own conjugate.
torch::Tensor exchange(Group& g, const torch::Tensor& x, int64_t dim);

/// A group travels through an autograd Function's arguments and saved data as an integer (an
/// IValue cannot hold a pointer): pack_group() makes it, unpack_group() turns it back into the
/// group, which must outlive the graph.
int64_t pack_group(Group& g);
Group& unpack_group(int64_t packed);

/// Plain (non-autograd) helpers used by the pairs: all-gather / reduce-scatter along a dimension.
torch::Tensor all_gather_dim(Group& g, const torch::Tensor& x, int64_t dim);
torch::Tensor reduce_scatter_dim(Group& g, const torch::Tensor& x, int64_t dim);
torch::Tensor all_to_all_dim(Group& g, const torch::Tensor& x, int64_t dim);

}  // namespace tessel::parallel
