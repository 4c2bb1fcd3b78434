#include "parallel/autograd_comm.h"

#include <torch/torch.h>

namespace tessel::parallel {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The group travels through the autograd context as an integer (an IValue cannot hold a pointer).
int64_t pack(Group& g) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&g)); }
Group& unpack(AutogradContext* ctx) {
  return *reinterpret_cast<Group*>(static_cast<intptr_t>(ctx->saved_data["g"].toInt()));
}

torch::Tensor all_reduced(Group& g, const torch::Tensor& x) {
  auto y = x.contiguous().clone();
  g.all_reduce(y).wait();
  return y;
}

torch::Tensor my_chunk(Group& g, const torch::Tensor& x, int64_t dim) {
  TORCH_CHECK(x.size(dim) % g.size() == 0, "split: size ", x.size(dim), " of dim ", dim,
              " is not divisible by group ", g.name(), " of ", g.size());
  return x.chunk(g.size(), dim)[static_cast<size_t>(g.rank())].contiguous();
}

struct CopyTo : torch::autograd::Function<CopyTo> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g) {
    ctx->saved_data["g"] = g;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {all_reduced(unpack(ctx), grad[0]), torch::Tensor()};
  }
};

struct ReduceFrom : torch::autograd::Function<ReduceFrom> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, int64_t g) {
    return all_reduced(*reinterpret_cast<Group*>(static_cast<intptr_t>(g)), x);
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

torch::Tensor all_gather_dim(Group& g, const torch::Tensor& x, int64_t dim) {
  if (g.size() == 1) return x;
  auto front = x.movedim(dim, 0).contiguous();  // [k, ...]
  auto sizes = front.sizes().vec();
  sizes[0] *= g.size();
  auto out = torch::empty(sizes, front.options());  // [n·k, ...], rank r's rows at [r·k, (r+1)·k)
  auto flat_out = out.view({-1});
  auto flat_in = front.view({-1});
  g.all_gather(flat_out, flat_in).wait();
  return out.movedim(0, dim);
}

torch::Tensor reduce_scatter_dim(Group& g, const torch::Tensor& x, int64_t dim) {
  if (g.size() == 1) return x;
  auto front = x.movedim(dim, 0).contiguous();  // [n·k, ...]
  TORCH_CHECK(front.size(0) % g.size() == 0, "reduce_scatter: size ", front.size(0), " of dim ",
              dim, " is not divisible by group ", g.name(), " of ", g.size());
  auto sizes = front.sizes().vec();
  sizes[0] /= g.size();
  auto out = torch::empty(sizes, front.options());
  auto flat_out = out.view({-1});
  auto flat_in = front.view({-1});
  g.reduce_scatter(flat_out, flat_in).wait();
  return out.movedim(0, dim);
}

torch::Tensor copy_to(Group& g, const torch::Tensor& x) {
  return g.size() == 1 ? x : CopyTo::apply(x, pack(g));
}
torch::Tensor reduce_from(Group& g, const torch::Tensor& x) {
  return g.size() == 1 ? x : ReduceFrom::apply(x, pack(g));
}
torch::Tensor split(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<my_chunk, all_gather_dim>::apply(x, pack(g), dim);
}
torch::Tensor gather(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<all_gather_dim, my_chunk>::apply(x, pack(g), dim);
}
torch::Tensor sequence_gather(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<all_gather_dim, reduce_scatter_dim>::apply(x, pack(g), dim);
}
torch::Tensor sequence_scatter(Group& g, const torch::Tensor& x, int64_t dim) {
  return g.size() == 1 ? x : DimPair<reduce_scatter_dim, all_gather_dim>::apply(x, pack(g), dim);
}

}  // namespace tessel::parallel
