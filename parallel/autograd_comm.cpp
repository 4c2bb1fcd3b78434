#include "parallel/autograd_comm.h"

#include <torch/torch.h>

namespace tessel::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group these Functions saved as "g" (pack_group).
Group& unpack(AutogradContext* ctx) { return unpack_group(ctx->saved_data["g"].toInt()); }

// Sums x over the group in place when it is contiguous (no copy), else a contiguous copy.
torch::Tensor all_reduced_in_place(Group& g, torch::Tensor x) {
  if (!x.is_contiguous()) x = x.contiguous();
  g.all_reduce(x).wait();
  return x;
}

torch::Tensor my_chunk(Group& g, const torch::Tensor& x, int64_t dim) {
  TORCH_CHECK(x.size(dim) % g.size() == 0, "split: size ", x.size(dim), " of dim ", dim,
              " is not divisible by group ", g.name(), " of ", g.size());
  return x.chunk(g.size(), dim)[static_cast<size_t>(g.rank())].contiguous();
}

// Backward sums the incoming gradient in place (as Megatron does): it is the fresh output of the
// matmuls' backward that consumed this copy.
struct CopyTo : torch::autograd::Function<CopyTo> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g) {
    ctx->saved_data["g"] = g;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduced_in_place(unpack(ctx), grad[0]), torch::Tensor()};
  }
};

// Forward sums the row-parallel matmul's partial output in place (nothing saved it) and marks
// it dirty, so that autograd refuses any later use of the unsummed value.
struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g) {
    auto& group = unpack_group(g);
    // A leaf that requires grad (a test's input) cannot be edited in place: sum a copy.
    if (!x.is_contiguous() || (x.is_leaf() && x.requires_grad()))
      return all_reduced_in_place(group, x.clone(at::MemoryFormat::Contiguous));
    auto y = x;
    group.all_reduce(y).wait();
    ctx->mark_dirty({x});
    return x;
  }
  static variable_list backward(AutogradContext*, variable_list grad) {
    return {grad[0], torch::Tensor()};
  }
};

// A collective along a dimension whose backward is another one: the four pairs below.
using DimOp = torch::Tensor (*)(Group&, const torch::Tensor&, int64_t);

template <DimOp Forward, DimOp Backward>
struct DimPair : torch::autograd::Function<DimPair<Forward, Backward>> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g,
                               int64_t dim) {
    ctx->saved_data["g"] = g;
    ctx->saved_data["dim"] = dim;
    return Forward(unpack(ctx), x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {Backward(unpack(ctx), grad[0], ctx->saved_data["dim"].toInt()), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

int64_t pack_group(Group& g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&g)); }
Group& unpack_group(int64_t packed) {
  return *reinterpret_cast<Group*>(static_cast<intptr_t>(packed));
}

// Rank r's part is chunk r along `dim`. The collective runs on [n, ...] buffers; moving n next
// to `dim` copies only when a dimension before `dim` is larger than 1 (with one sequence per
// micro-batch, sequence parallelism moves no data besides the collective).
torch::Tensor all_gather_dim(Group& g, const torch::Tensor& x, int64_t dim) {
  if (g.size() == 1) return x;
  auto in = x.contiguous();
  auto sizes = in.sizes().vec();
  sizes.insert(sizes.begin(), g.size());
  auto out = torch::empty(sizes, in.options());  // [n, ...]: rank r's tensor at [r]
  auto flat_out = out.view({-1});
  auto flat_in = in.view({-1});
  g.all_gather(flat_out, flat_in).wait();
  auto merged = in.sizes().vec();
  merged[static_cast<size_t>(dim)] *= g.size();
  return out.movedim(0, dim).reshape(merged);  // a view when nothing precedes dim
}

namespace {

// x with `dim` cut into one slice per rank and the slice index moved first: [n, ..., k, ...],
// contiguous (the layout a reduce-scatter's or an all-to-all's flat input needs).
torch::Tensor slices_first(Group& g, const torch::Tensor& x, int64_t dim, const char* op) {
  TORCH_CHECK(x.size(dim) % g.size() == 0, op, ": size ", x.size(dim), " of dim ", dim,
              " is not divisible by group ", g.name(), " of ", g.size());
  auto split = x.sizes().vec();  // [..., n, k, ...]
  split[static_cast<size_t>(dim)] /= g.size();
  split.insert(split.begin() + dim, g.size());
  return x.reshape(split).movedim(dim, 0).contiguous();
}

}  // namespace

torch::Tensor reduce_scatter_dim(Group& g, const torch::Tensor& x, int64_t dim) {
  if (g.size() == 1) return x;
  auto in = slices_first(g, x, dim, "reduce_scatter");
  auto sizes = x.sizes().vec();
  sizes[static_cast<size_t>(dim)] /= g.size();
  auto out = torch::empty(sizes, x.options());
  auto flat_out = out.view({-1});
  auto flat_in = in.view({-1});
  g.reduce_scatter(flat_out, flat_in).wait();
  return out;
}

torch::Tensor all_to_all_dim(Group& g, const torch::Tensor& x, int64_t dim) {
  if (g.size() == 1) return x;
  auto in = slices_first(g, x, dim, "all_to_all");
  auto out = torch::empty_like(in);
  auto flat_out = out.view({-1});
  auto flat_in = in.view({-1});
  g.all_to_all(flat_out, flat_in).wait();
  return out.movedim(0, dim).reshape(x.sizes());
}

torch::Tensor copy_to(Group& g, const torch::Tensor& x) {
  return g.size() == 1 ? x : CopyTo::apply(x, pack_group(g));
}
torch::Tensor reduce_from(Group& g, const torch::Tensor& x) {
  return g.size() == 1 ? x : ReduceFrom::apply(x, pack_group(g));
}
torch::Tensor split(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<my_chunk, all_gather_dim>::apply(x, pack_group(g), dim);
}
torch::Tensor gather(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<all_gather_dim, my_chunk>::apply(x, pack_group(g), dim);
}
torch::Tensor sequence_gather(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x
                       : DimPair<all_gather_dim, reduce_scatter_dim>::apply(x, pack_group(g), dim);
}
torch::Tensor sequence_scatter(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x
                       : DimPair<reduce_scatter_dim, all_gather_dim>::apply(x, pack_group(g), dim);
}

torch::Tensor exchange(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<all_to_all_dim, all_to_all_dim>::apply(x, pack_group(g), dim);
}

}  // namespace tessel::parallel
