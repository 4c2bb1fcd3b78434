// Each tensor-parallel layer against its dense counterpart: forward and every gradient within
// 1e-6, with and without sequence parallelism. The dense reference is computed on every rank
// from the same seeded tensors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "parallel/tp/head_loss.h"
#include "parallel/tp/layers.h"
#include "tests/dist/dist_env.h"

namespace tessel::parallel::tp {
namespace {

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return torch::allclose(a, b, 1e-6, 1e-6);
}

torch::Tensor chunk_of(const torch::Tensor& t, int64_t dim) {
  auto& g = test_group();
  return t.chunk(g.size(), dim)[static_cast<size_t>(g.rank())].contiguous();
}

class TpLayers : public ::testing::TestWithParam<bool> {  // param: sequence parallelism
 protected:
  void SetUp() override { torch::manual_seed(1234); }
  int64_t t() { return test_group().size(); }
};

TEST_P(TpLayers, ColumnParallelLinear) {
  const bool sp = GetParam();
  const int64_t b = 2, s = 2 * t(), in = 6, out = 3 * t();
  auto W = torch::randn({out, in}), B = torch::randn({out}), x = torch::randn({b, s, in}),
       w = torch::randn({b, s, out});
  auto Wd = W.clone().requires_grad_(), Bd = B.clone().requires_grad_(),
       xd = x.clone().requires_grad_();
  auto yd = torch::nn::functional::linear(xd, Wd, Bd);
  (yd * w).sum().backward();

  ColumnParallelLinear layer(test_group(), in, out, true, sp);
  {
    torch::NoGradGuard ng;
    layer->weight.copy_(layer->weight_shard().of(W));
    layer->bias.copy_(chunk_of(B, 0));
  }
  auto xin = (sp ? chunk_of(x, 1) : x.clone()).requires_grad_();
  auto y = layer(xin);
  EXPECT_TRUE(close(y, chunk_of(yd, 2)));
  (y * chunk_of(w, 2)).sum().backward();
  EXPECT_TRUE(close(layer->weight.grad(), chunk_of(Wd.grad(), 0)));
  EXPECT_TRUE(close(layer->bias.grad(), chunk_of(Bd.grad(), 0)));
  EXPECT_TRUE(close(xin.grad(), sp ? chunk_of(xd.grad(), 1) : xd.grad()));
}

TEST_P(TpLayers, RowParallelLinear) {
  const bool sp = GetParam();
  const int64_t b = 2, s = 2 * t(), in = 2 * t(), out = 5;
  auto W = torch::randn({out, in}), B = torch::randn({out}), x = torch::randn({b, s, in}),
       w = torch::randn({b, s, out});
  auto Wd = W.clone().requires_grad_(), Bd = B.clone().requires_grad_(),
       xd = x.clone().requires_grad_();
  auto yd = torch::nn::functional::linear(xd, Wd, Bd);
  (yd * w).sum().backward();

  RowParallelLinear layer(test_group(), in, out, true, sp);
  {
    torch::NoGradGuard ng;
    layer->weight.copy_(layer->weight_shard().of(W));
    layer->bias.copy_(B);
  }
  auto xin = chunk_of(x, 2).requires_grad_();
  auto y = layer(xin);
  EXPECT_TRUE(close(y, sp ? chunk_of(yd, 1) : yd));
  (y * (sp ? chunk_of(w, 1) : w)).sum().backward();
  EXPECT_TRUE(close(layer->weight.grad(), chunk_of(Wd.grad(), 1)));
  EXPECT_TRUE(close(xin.grad(), chunk_of(xd.grad(), 2)));
  // The replicated bias: whole gradient without SP; with SP each rank holds its rows' share.
  auto db = layer->bias.grad().clone();
  if (sp) test_group().all_reduce(db).wait();
  EXPECT_TRUE(close(db, Bd.grad()));
}

TEST_P(TpLayers, VocabParallelEmbedding) {
  const bool sp = GetParam();
  const int64_t b = 2, s = 2 * t(), vocab = 4 * t() + 1, dim = 5;  // vocab not divisible by t
  auto W = torch::randn({vocab, dim}), w = torch::randn({b, s, dim});
  auto tokens = torch::randint(0, vocab, {b, s}, torch::kInt64);
  tokens[0][0] = vocab - 1;  // the last real row
  auto Wd = W.clone().requires_grad_();
  auto ed = torch::embedding(Wd, tokens);
  (ed * w).sum().backward();

  VocabParallelEmbedding layer(test_group(), vocab, dim, sp);
  const int64_t vp = padded_vocab(vocab, t());
  auto padded = torch::cat({W, torch::zeros({vp - vocab, dim})});
  {
    torch::NoGradGuard ng;
    layer->weight.copy_(layer->weight_shard().of(padded));
  }
  auto e = layer(tokens);
  EXPECT_TRUE(close(e, sp ? chunk_of(ed, 1) : ed));
  (e * (sp ? chunk_of(w, 1) : w)).sum().backward();
  auto dpadded = torch::cat({Wd.grad(), torch::zeros({vp - vocab, dim})});
  EXPECT_TRUE(close(layer->weight.grad(), layer->weight_shard().of(dpadded)));
}

// The cross-entropy of a vocabulary of `vocab` over this group against torch's dense one.
void check_cross_entropy(int64_t vocab) {
  auto& g = test_group();
  const int64_t n = 7, vp = padded_vocab(vocab, g.size());
  auto logits = torch::randn({n, vocab}) * 3, w = torch::rand({n});
  auto targets = torch::randint(0, vocab, {n}, torch::kInt64);
  targets[0] = vocab - 1;
  auto ld = logits.clone().requires_grad_();
  auto dense = torch::nn::functional::cross_entropy(
      ld, targets, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  (dense * w).sum().backward();
  // Padding columns carry large logits: they must not change the loss.
  auto padded = torch::cat({logits, torch::full({n, vp - vocab}, 50.0)}, 1);
  Shard shard{1, g.size(), g.rank()};
  auto local = shard.of(padded).requires_grad_();
  auto loss = vocab_parallel_cross_entropy(g, local, targets,
                                           vocab_slice_start(vocab, g.size(), g.rank()), vocab);
  EXPECT_TRUE(close(loss, dense)) << "vocab " << vocab;
  (loss * w).sum().backward();
  auto dpadded = torch::cat({ld.grad(), torch::zeros({n, vp - vocab})}, 1);
  EXPECT_TRUE(close(local.grad(), shard.of(dpadded))) << "vocab " << vocab;
}

TEST_P(TpLayers, VocabParallelCrossEntropyNeverCountsPadding) { check_cross_entropy(3 * t() + 2); }

// A vocabulary of (t-1)^2 puts only padding on the last rank (its slice starts at the vocabulary's
// size): that rank adds nothing to the softmax, and its gradient is zeros.
TEST_P(TpLayers, VocabParallelCrossEntropyWithASliceOfPaddingOnly) {
  if (t() < 2) GTEST_SKIP() << "one rank holds the whole vocabulary";
  const int64_t vocab = (t() - 1) * (t() - 1);
  ASSERT_EQ(vocab_slice_start(vocab, t(), t() - 1), vocab);
  check_cross_entropy(vocab);
}

// The lean-logits head and loss over the group (fp32: each chunk's logits become the log-softmax in
// place) against the dense head and torch's loss: loss and both gradients, in chunks of 3 rows.
TEST_P(TpLayers, FusedHeadCrossEntropyOverTheGroup) {
  auto& g = test_group();
  const int64_t n = 7, h = 5, vocab = 3 * t() + 2, vp = padded_vocab(vocab, t());
  auto y = torch::randn({n, h}), w = torch::randn({vocab, h});
  auto targets = torch::randint(0, vocab, {n}, torch::kInt64);
  auto yd = y.clone().requires_grad_(), wd = w.clone().requires_grad_();
  auto dense = torch::nn::functional::cross_entropy(
      torch::mm(yd, wd.t()), targets,
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
  dense.backward();
  Shard shard{0, t(), g.rank()};
  auto wl = shard.of(torch::cat({w, torch::zeros({vp - vocab, h})})).requires_grad_();
  auto yl = y.clone().requires_grad_();
  auto loss = fused_head_cross_entropy_sum(g, yl, wl, targets,
                                           vocab_slice_start(vocab, t(), g.rank()), vocab, 3);
  EXPECT_NEAR(loss.item<double>(), dense.item<double>(), 1e-5 * std::abs(dense.item<double>()));
  loss.backward();
  // y's gradient sums over the group (each rank's is its slice's part), as the head's entry does.
  auto dy = yl.grad().clone();
  g.all_reduce(dy).wait();
  EXPECT_TRUE(close(dy, yd.grad()));
  auto dw = torch::cat({wd.grad(), torch::zeros({vp - vocab, h})});
  EXPECT_TRUE(close(wl.grad(), shard.of(dw)));
}

INSTANTIATE_TEST_SUITE_P(SequenceParallel, TpLayers, ::testing::Values(false, true),
                         [](const auto& info) {
                           return info.param ? std::string("sp") : std::string("no_sp");
                         });

}  // namespace
}  // namespace tessel::parallel::tp
