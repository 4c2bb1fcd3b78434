#include "parallel/tp/head_loss.h"

#include <torch/autograd.h>

#include <algorithm>

#include "core/kernels/accumulate.h"
#include "parallel/autograd_comm.h"
#include "parallel/tp/layers.h"

namespace tessel::parallel::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// One chunk: its loss sum, and (when `dlogits` is wanted) softmax - one-hot in y's dtype, made in
/// its fp32 log-softmax's buffer. Statistics cross the group as vectors of the chunk's rows
/// (vocab_parallel_log_softmax).
struct ChunkLoss {
  torch::Tensor loss_sum, dlogits;
};

ChunkLoss chunk_loss(Group& g, const torch::Tensor& y, const torch::Tensor& weight,
                     const torch::Tensor& targets, int64_t vocab_start, int64_t vocab, bool dlogits,
                     const torch::Tensor& rows_w) {
  // The logits [n, Vl] in the model's dtype are ours: fp32 ones become the log-softmax in place,
  // others live only for the copy.
  auto s = vocab_parallel_log_softmax(g, torch::mm(y, weight.t()), targets, vocab_start, vocab,
                                      /*overwrite=*/true);
  ChunkLoss out{rows_w.defined() ? (s.loss * rows_w).sum() : s.loss.sum(), {}};
  if (dlogits) out.dlogits = softmax_minus_target(s, rows_w, y.scalar_type());
  return out;
}

struct FusedHeadCrossEntropy : torch::autograd::Function<FusedHeadCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& y,
                               const torch::Tensor& weight, const torch::Tensor& targets,
                               int64_t group, int64_t vocab_start, int64_t vocab, int64_t chunk,
                               const torch::Tensor& row_weights) {
    Group& g = unpack_group(group);
    const int64_t n = y.size(0);
    // The gradients as forward makes them: the input's in its dtype (each chunk writes its own
    // rows), the weight's summed over chunks in fp32.
    auto dy = torch::empty_like(y);
    auto dw = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
    auto loss = torch::zeros({}, y.options().dtype(torch::kFloat32));
    for (int64_t b = 0; b < n; b += chunk) {
      const int64_t rows = std::min(chunk, n - b);
      auto yc = y.narrow(0, b, rows);
      auto c =
          chunk_loss(g, yc, weight, targets.narrow(0, b, rows), vocab_start, vocab, true,
                     row_weights.numel() > 0 ? row_weights.narrow(0, b, rows) : torch::Tensor());
      loss += c.loss_sum;
      const auto& dl = c.dlogits;            // in y's dtype
      auto dy_rows = dy.narrow(0, b, rows);  // contiguous: whole rows of dy
      torch::mm_out(dy_rows, dl, weight);    // [rows, h]
      if (y.scalar_type() == torch::kFloat32)
        dw.addmm_(dl.t(), yc);  // [Vl, h]
      else  // the matmul in the model's dtype (tensor cores), summed over chunks in fp32
        kernels::add_widened(dw, torch::mm(dl.t(), yc));  // no fp32 copy of the product
    }
    ctx->save_for_backward({dy, dw});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto saved = ctx->get_saved_variables();
    const auto scale = grad[0];  // a scalar: the loss sum's gradient
    auto dtype = static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    return {saved[0].mul_(scale.to(saved[0].scalar_type())),
            saved[1].mul_(scale).to(dtype),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

int64_t head_chunk_rows(int64_t vocab_local, int64_t budget_bytes) {
  return std::max<int64_t>(1, budget_bytes / (4 * std::max<int64_t>(1, vocab_local)));
}

int64_t default_head_chunk_rows(int64_t vocab_local, bool gpu) {
  return head_chunk_rows(vocab_local, gpu ? int64_t{1} << 30 : int64_t{64} << 20);
}

HeadLossBytes fused_head_bytes(double tokens, double vocab_local, double h, double w, double chunk,
                               const MatmulBytes& matmul) {
  const double v = vocab_local;
  double product = 0;
  if (w < 4) {
    const auto n = static_cast<int64_t>(chunk), vl = static_cast<int64_t>(v),
               hh = static_cast<int64_t>(h);
    product = chunk * v * w + std::max(matmul_bytes(matmul, vl, n, hh, true, w),
                                       matmul_bytes(matmul, n, vl, hh, false, w) - chunk * h * w);
  }
  return {v * h * 4 + tokens * h * w, std::max(chunk * v * (w == 4 ? 4 : w + 4), product)};
}

torch::Tensor fused_head_cross_entropy_sum(Group& tp, const torch::Tensor& y,
                                           const torch::Tensor& weight,
                                           const torch::Tensor& targets, int64_t vocab_start,
                                           int64_t vocab, int64_t chunk_rows,
                                           const torch::Tensor& row_weights) {
  const int64_t n = y.size(0), chunk = chunk_rows > 0 ? std::min(chunk_rows, n) : n;
  if (torch::GradMode::is_enabled() && (y.requires_grad() || weight.requires_grad()))
    // autograd::Function takes defined tensors only: no weights travel as an empty one.
    return FusedHeadCrossEntropy::apply(
        y, weight, targets, pack_group(tp), vocab_start, vocab, chunk,
        row_weights.defined() ? row_weights
                              : torch::empty({0}, y.options().dtype(torch::kFloat32)));
  auto loss = torch::zeros({}, y.options().dtype(torch::kFloat32));
  torch::NoGradGuard no_grad;
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t rows = std::min(chunk, n - b);
    loss +=
        chunk_loss(tp, y.narrow(0, b, rows), weight, targets.narrow(0, b, rows), vocab_start, vocab,
                   false, row_weights.defined() ? row_weights.narrow(0, b, rows) : torch::Tensor())
            .loss_sum;
  }
  return loss;
}

}  // namespace tessel::parallel::tp
