// The mixture of experts (models/moe.h) against the definition written out token by token: the
// router's top k, the renormalised gate weights, each chosen expert's SwiGLU, the capacity rule
// (per sequence and expert, the first choices in token order) and the balance loss's gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/moe.h"

using namespace tessel;

namespace {

// Largest difference relative to the largest magnitude (sums over many tokens round apart).
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-12, b.abs().max().item<double>());
}

struct Fixture {
  parallel::Group solo{"solo", {0}, 0, nullptr}, solo_ep{"solo", {0}, 0, nullptr};
  models::MoeState state;
  std::shared_ptr<models::MoeImpl> moe;

  explicit Fixture(models::MoeShape shape) {
    models::DecoderOptions o;
    o.model.arch = plan::ModelArch::kLlama;
    o.model.layers = 1, o.model.hidden = 16, o.model.heads = 2, o.model.kv_heads = 2;
    o.model.ffn_hidden = 24;
    o.model.moe = shape;
    o.mlp = plan::Mlp::kSwiGlu, o.linear_bias = false;
    o.tp = &solo, o.ep = &solo_ep;
    torch::manual_seed(3);
    moe = std::make_shared<models::MoeImpl>(o, 0, &state);
    torch::NoGradGuard no_grad;
    for (auto& p : moe->parameters()) p.normal_(0, 0.3);
    state.counts = torch::zeros({1, shape.experts});
    state.aux = torch::zeros({1});
    state.dropped = torch::zeros({1});
  }
};

// The definition: token t's output is Σ over its top k experts (kept by capacity) of
// w_e · down_e(silu(gate_e x) · up_e x).
torch::Tensor reference(const models::MoeImpl& m, const models::MoeShape& s, const torch::Tensor& x,
                        int64_t* dropped) {
  const int64_t b = x.size(0), t = x.size(1), h = x.size(2);
  auto flat = x.reshape({-1, h});
  auto scores = torch::mm(flat, m.router.t()).softmax(-1);
  auto [w, idx] = scores.topk(s.top_k, -1);
  w = w / w.sum(-1, true);
  const auto cap =
      s.capacity_factor > 0
          ? static_cast<int64_t>(std::ceil(s.capacity_factor * static_cast<double>(t * s.top_k) /
                                           static_cast<double>(s.experts)))
          : INT64_MAX;
  std::vector<torch::Tensor> rows;
  *dropped = 0;
  for (int64_t seq = 0; seq < b; ++seq) {
    std::vector<int64_t> used(static_cast<size_t>(s.experts), 0);
    for (int64_t i = seq * t; i < (seq + 1) * t; ++i) {
      auto y = torch::zeros({h});
      for (int64_t j = 0; j < s.top_k; ++j) {
        const int64_t e = idx[i][j].item<int64_t>();
        if (used[static_cast<size_t>(e)]++ >= cap) {
          ++*dropped;
          continue;
        }
        auto xi = flat[i];
        auto a = torch::silu(torch::mv(m.gate[e], xi)) * torch::mv(m.up[e], xi);
        y = y + w[i][j] * torch::mv(m.down[e], a);
      }
      rows.push_back(y);
    }
  }
  return torch::stack(rows).view({b, t, h});
}

}  // namespace

TEST(Moe, GroupedExpertsAreTheDefinition) {
  for (double capacity : {0.0, 0.75}) {
    models::MoeShape s;
    s.experts = 4, s.top_k = 2, s.ffn_hidden = 8, s.capacity_factor = capacity;
    Fixture f(s);
    auto x = torch::randn({3, 10, 16}, torch::requires_grad());
    int64_t dropped = 0;
    auto want = reference(*f.moe, s, x, &dropped);
    f.state.loss_factor = torch::ones({});  // training: statistics counted
    f.state.seq_len = 10;
    auto got = f.moe->forward(x);
    EXPECT_LT((got - want).abs().max().item<double>(), 1e-6) << "capacity " << capacity;
    EXPECT_EQ(f.state.dropped.item<double>(), static_cast<double>(dropped))
        << "capacity " << capacity;
    EXPECT_EQ(f.state.counts.sum().item<double>(), static_cast<double>(3 * 10 * 2 - dropped));
    if (capacity > 0) EXPECT_GT(dropped, 0);
    // Gradients of the experts and the input (the balance loss off: aux_loss_coef 0).
    auto g = torch::randn_like(want);
    auto ga = torch::autograd::grad({got}, {x, f.moe->gate, f.moe->down}, {g});
    auto gb = torch::autograd::grad({want}, {x, f.moe->gate, f.moe->down}, {g});
    for (size_t i = 0; i < ga.size(); ++i)
      EXPECT_LT(rel_diff(ga[i], gb[i]), 1e-6) << "gradient " << i;
  }
}

TEST(Moe, BalanceLossGradientIsItsDefinition) {
  models::MoeShape s;
  s.experts = 4, s.top_k = 2, s.ffn_hidden = 8, s.aux_loss_coef = 0.3;
  Fixture f(s);
  const int64_t b = 2, t = 12;
  auto x = torch::randn({b, t, 16});
  f.state.loss_factor = torch::full({}, 0.5);  // the trainer's 1 / (global tokens), say
  f.state.seq_len = t;
  auto out = f.moe->forward(x);
  auto router_grad = torch::autograd::grad({out.sum()}, {f.moe->router})[0];
  // The same step by hand: d/dW [ out.sum() + factor · coef · T · Σ_seq Σ_e f_e P_e ].
  auto scores = torch::mm(x.reshape({-1, 16}), f.moe->router.t()).softmax(-1);
  auto idx = std::get<1>(scores.topk(2, -1));
  auto chosen = torch::zeros_like(scores).scatter_(1, idx, 1.0).view({b, t, 4}).sum(1);
  auto fe = chosen * (4.0 / (2.0 * t));
  auto pe = scores.view({b, t, 4}).sum(1) / t;
  auto aux = (fe * pe).sum();
  EXPECT_NEAR(f.state.aux.item<double>(), aux.item<double>(), 1e-6);
  f.state.loss_factor = torch::Tensor();  // not training: no balance gradient, nothing counted
  auto out_only = torch::autograd::grad({f.moe->forward(x).sum()}, {f.moe->router})[0];
  auto aux_grad = torch::autograd::grad({aux}, {f.moe->router})[0];
  auto want = out_only + 0.5 * 0.3 * t * aux_grad;
  EXPECT_LT(rel_diff(router_grad, want), 1e-6);
  EXPECT_GT(aux_grad.abs().max().item<double>(), 1e-4);  // the term is really there
}

TEST(Moe, BalanceBiasChoosesButDoesNotWeigh) {
  models::MoeShape s;
  s.experts = 4, s.top_k = 2, s.ffn_hidden = 8, s.bias_update_rate = 0.5;
  Fixture f(s);
  ASSERT_TRUE(f.moe->balance_bias.defined());
  EXPECT_EQ(f.moe->balance_bias.scalar_type(), torch::kFloat32);
  EXPECT_FALSE(f.moe->balance_bias.requires_grad());
  {
    torch::NoGradGuard no_grad;
    f.moe->balance_bias.copy_(torch::tensor({0.0, 0.0, 0.0, 10.0}));  // every token takes expert 3
  }
  f.state.loss_factor = torch::ones({});
  f.state.seq_len = 6;
  auto x = torch::randn({2, 6, 16});
  auto got = f.moe->forward(x);
  EXPECT_EQ(f.state.counts[0][3].item<double>(), 12.0);
  // By hand: expert 3 plus each token's best other expert, weighted by their renormalised scores.
  auto flat = x.reshape({-1, 16});
  auto scores = torch::mm(flat, f.moe->router.t()).softmax(-1);
  auto masked = scores.clone();
  masked.select(1, 3).fill_(-1);
  auto other = masked.argmax(1);
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < 12; ++i) {
    auto y = torch::zeros({16});
    const int64_t o = other[i].item<int64_t>();
    const auto w3 = scores[i][3], wo = scores[i][o];
    for (auto [e, w] : {std::pair{int64_t{3}, w3 / (w3 + wo)}, std::pair{o, wo / (w3 + wo)}}) {
      auto a = torch::silu(torch::mv(f.moe->gate[e], flat[i])) * torch::mv(f.moe->up[e], flat[i]);
      y = y + w * torch::mv(f.moe->down[e], a);
    }
    rows.push_back(y);
  }
  EXPECT_LT(rel_diff(got.reshape({-1, 16}), torch::stack(rows)), 1e-6);
  // After the step: below-mean experts move up by the rate, expert 3 (above) down.
  f.moe->update_balance_bias(f.state.counts[0]);
  EXPECT_NEAR(f.moe->balance_bias[3].item<double>(), 9.5, 1e-6);
}
