#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/optim/optim.h"
#include "models/from_plan.h"
#include "models/registry.h"

namespace tessel {
namespace {

TEST(LrSchedule, WarmupThenDecay) {
  plan::Config c = plan::load_config_text(
      "data: {path: x}\ntraining: {steps: 10, optimizer: {lr: 1.0}, schedule: {warmup_steps: 2, "
      "min_lr: 0.1}}\n",
      "t");
  auto& t = c.training;
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 1), 0.5);
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 2), 1.0);
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 6), 0.1 + 0.9 * 0.5);  // cosine halfway
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 10), 0.1);
  t.schedule.decay = plan::Decay::kLinear;
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 4), 0.1 + 0.9 * 0.75);
  t.schedule.decay = plan::Decay::kConstant;
  EXPECT_DOUBLE_EQ(optim::lr_at(t, 9), 1.0);
}

TEST(WeightDecay, ChosenByName) {
  std::vector<std::string> g = {"*norm*", "*.bias", "embed.*", "pos_embed.*"};
  EXPECT_TRUE(optim::exempt_from_decay("layers.0.attn_norm.weight", g));
  EXPECT_TRUE(optim::exempt_from_decay("norm.weight", g));
  EXPECT_TRUE(optim::exempt_from_decay("layers.3.mlp.up.bias", g));
  EXPECT_TRUE(optim::exempt_from_decay("embed.weight", g));
  EXPECT_FALSE(optim::exempt_from_decay("layers.0.attn.q.weight", g));
  EXPECT_FALSE(optim::exempt_from_decay("head.weight", g));
}

// The flat fused AdamW equals the textbook AdamW applied per parameter.
TEST(FlatAdamW, MatchesReferenceAdamWAndClipping) {
  plan::Config c = plan::load_config_text(
      "data: {path: x}\nmodel: {arch: llama, layers: 1, hidden: 16, heads: 2, vocab_size: 300}\n"
      "training: {optimizer: {lr: 0.01, weight_decay: 0.1}}\n",
      "t");
  auto model = models::build_model(models::model_shape(c.model), 3);
  std::map<std::string, torch::Tensor> w0;
  for (const auto& p : model->named_parameters()) w0[p.key()] = p.value().detach().clone();
  optim::FlatAdamW opt(models::named_params(model), c.training);
  // The parameters are now views of the flat master buffer, with their values unchanged.
  for (const auto& p : model->named_parameters()) ASSERT_TRUE(torch::equal(p.value(), w0[p.key()]));
  std::map<std::string, torch::Tensor> m, v;
  for (int step = 1; step <= 3; ++step) {
    auto tokens = torch::randint(0, 300, {2, 9}, torch::kInt64);
    auto loss = torch::nn::functional::cross_entropy(model(tokens.narrow(1, 0, 8)).view({-1, 300}),
                                                     tokens.narrow(1, 1, 8).reshape({-1}));
    loss.backward();
    std::map<std::string, torch::Tensor> g;
    for (const auto& p : model->named_parameters()) g[p.key()] = p.value().grad().clone();
    double norm = 0;
    for (auto& [k, t] : g) norm += t.pow(2).sum().item<double>();
    norm = std::sqrt(norm);
    auto got_norm = opt.clip_grad_norm(0.05).item<double>();
    EXPECT_NEAR(got_norm, norm, 1e-5 * norm);
    double coef = std::min(1.0, 0.05 / (norm + 1e-6));
    opt.step(0.01);
    const double b1 = 0.9, b2 = 0.95, eps = 1e-8, lr = 0.01;
    for (auto& [k, w] : w0) {
      auto gk = g[k] * coef;
      if (!m.count(k)) m[k] = torch::zeros_like(w), v[k] = torch::zeros_like(w);
      double wd = optim::exempt_from_decay(k, c.training.optimizer.no_decay) ? 0.0 : 0.1;
      w.mul_(1 - lr * wd);
      m[k] = b1 * m[k] + (1 - b1) * gk;
      v[k] = b2 * v[k] + (1 - b2) * gk * gk;
      auto mhat = m[k] / (1 - std::pow(b1, step)), vhat = v[k] / (1 - std::pow(b2, step));
      w.sub_(lr * mhat / (vhat.sqrt() + eps));
    }
    for (const auto& p : model->named_parameters()) {
      EXPECT_TRUE(torch::allclose(p.value(), w0[p.key()], 1e-5, 1e-6))
          << p.key() << " step " << step;
      EXPECT_EQ(p.value().grad().abs().sum().item<double>(), 0.0) << "gradients cleared";
    }
  }
}

// The buffers FlatAdamW allocates for each ZeRO stage and dtype (one shard rank of two or three:
// nothing communicates while they are laid out) are what --dry-run predicts from the plan, up to
// the alignment padding of each slot and bucket.
TEST(FlatAdamW, StateBytesAsPlanned) {
  plan::Config c = plan::load_config_text(
      "data: {path: x}\nmodel: {arch: llama, layers: 2, hidden: 16, heads: 2, vocab_size: 301}\n",
      "t");
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kHalf})
    for (int64_t shards : {1, 2, 3})
      for (int64_t zero = 0; zero <= 3; ++zero) {
        if (zero == 0 && shards > 1) continue;
        auto model = models::build_model(models::model_shape(c.model), 3);
        model->to(dtype);
        const auto params = models::named_params(model);
        optim::FlatAdamW opt(
            params, c.training,
            optim::layout_of(params, {2000, shards, shards - 1, plan::Sharding::of(zero), false}));
        const auto got = opt.bytes();
        const auto want =
            optim::planned_state_bytes(opt.numel(), plan::Sharding::of(zero), shards, dtype);
        // Padding: up to kAlignElements before each slot and per piece of each bucket, at up to
        // 12 bytes an element (the optimizer's fp32 master and moments).
        const int64_t pad = (static_cast<int64_t>(opt.layout().slots().size()) +
                             static_cast<int64_t>(opt.layout().buckets().size()) * shards) *
                            optim::kAlignElements;
        const int64_t slack = 12 * pad;
        const auto what = ::testing::Message()
                          << c10::toString(dtype) << " zero " << zero << " shards " << shards;
        EXPECT_NEAR(got.params, want.params, slack) << what;
        EXPECT_NEAR(got.grads, want.grads, slack) << what;
        EXPECT_NEAR(got.optimizer, want.optimizer, slack) << what;
      }
}

// Every view FlatAdamW hands out starts on a kAlignElements boundary of its buffer (and so on 16
// bytes, which CUDA's grouped matmul requires of the MoE experts' weights): the parameters, their
// gradients, and this rank's pieces of the master weights and moments, for data groups of 1, 2,
// 3 and 6 ranks (an odd factor used to shift later slots), without ZeRO and at stages 1-3, with
// experts, in fp32 and bf16, on a model whose sizes are no multiple of 64 (hidden 40).
TEST(FlatAdamW, EveryViewIsAligned) {
  plan::Config c = plan::load_config_text(
      "data: {path: x}\nmodel: {arch: llama, layers: 2, hidden: 40, heads: 2, vocab_size: 301, "
      "moe: {experts: 3, top_k: 2, ffn_hidden: 28, every: 1, shared_experts: 1}}\n",
      "t");
  auto aligned = [](const torch::Tensor& t) {
    return t.storage_offset() % optim::kAlignElements == 0 &&
           reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  for (auto dtype : {torch::kFloat32, torch::kBFloat16})
    for (int64_t shards : {1, 2, 3, 6})
      for (int64_t zero = 0; zero <= 3; ++zero) {
        if (zero == 0 && shards > 1) continue;  // without ZeRO nothing is split
        auto model = models::build_model(models::model_shape(c.model), 3);
        model->to(dtype);
        const auto params = models::named_params(model);
        bool experts = false;
        for (const auto& p : params) experts |= p.expert;
        ASSERT_TRUE(experts);
        optim::LayoutOptions o{2000, shards, shards - 1, plan::Sharding::of(zero), false};
        o.expert_shards = shards;
        o.expert_shard_rank = shards - 1;
        optim::FlatAdamW opt(params, c.training, optim::layout_of(params, o));
        const auto what = ::testing::Message()
                          << c10::toString(dtype) << " zero " << zero << " shards " << shards;
        for (const auto& p : params) {
          EXPECT_TRUE(aligned(p.tensor)) << p.name << " " << what;
          // fp32 stages 0-1: the gradient is a view of the flat fp32 buffer. bf16: none between
          // backwards (each is folded into that buffer as it comes: held once, in fp32).
          if (zero < 2 && dtype == torch::kFloat32)
            EXPECT_TRUE(aligned(p.tensor.grad())) << p.name << " grad " << what;
          if (dtype != torch::kFloat32) EXPECT_FALSE(p.tensor.grad().defined()) << p.name << what;
        }
        if (zero < 2) {  // 4 bytes of gradient per element, whatever the weights' dtype
          EXPECT_EQ(opt.bytes().grads, 4 * opt.grad().numel()) << what;
          EXPECT_TRUE(aligned(opt.grad())) << what;
        }
        for (const auto& piece : opt.pieces()) {
          EXPECT_TRUE(aligned(piece.weight)) << piece.name << " " << what;
          EXPECT_TRUE(aligned(piece.master)) << piece.name << " " << what;
          EXPECT_TRUE(aligned(piece.exp_avg)) << piece.name << " " << what;
          EXPECT_TRUE(aligned(piece.exp_avg_sq)) << piece.name << " " << what;
        }
        for (const auto& b : opt.layout().buckets()) {
          EXPECT_EQ(b.begin % optim::kAlignElements, 0) << what;
          EXPECT_EQ(opt.layout().piece_numel(b) % optim::kAlignElements, 0) << what;
        }
      }
}

}  // namespace
}  // namespace tessel
