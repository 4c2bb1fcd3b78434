#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "models/from_plan.h"
#include "models/registry.h"
#include "tests/common/recompute_cases.h"

namespace tessel::models {
namespace {

ModelShape model(const std::string& yaml) {
  return models::model_shape(
      plan::load_config_text("data: {path: x}\nmodel: " + yaml + "\n", "t").model);
}

TEST(Init, KeyedBySeedAndGlobalName) {
  // A parameter's initial value depends only on (seed, name): a deeper model holds the same
  // values under the same names, and another seed gives other values.
  auto a = model_weights(*std::make_unique<Decoder>(build_model(model("{layers: 2}"), 11)));
  auto b = model_weights(*std::make_unique<Decoder>(build_model(model("{layers: 3}"), 11)));
  auto c = model_weights(*std::make_unique<Decoder>(build_model(model("{layers: 2}"), 12)));
  for (const auto& [name, t] : a) {
    // Residual output projections draw the same numbers, scaled by 1/sqrt(2·layers) (4 vs 6).
    const bool scaled =
        name.find("attn.o.") != std::string::npos || name.find("mlp.down.") != std::string::npos;
    if (scaled && name.find(".weight") != std::string::npos)
      EXPECT_TRUE(torch::allclose(t * std::sqrt(4.0 / 6.0), b.at(name), 1e-6, 0)) << name;
    else
      EXPECT_TRUE(torch::equal(t, b.at(name))) << name;
    if (name.find(".bias") == std::string::npos && name.find("norm") == std::string::npos)
      EXPECT_FALSE(torch::equal(t, c.at(name))) << name;
  }
  // Residual output projections are scaled by 1/sqrt(2·layers).
  double std_q = a.at("layers.0.attn.q.weight").std().item<double>();
  double std_o = a.at("layers.0.attn.o.weight").std().item<double>();
  EXPECT_NEAR(std_q, 0.02, 0.003);
  EXPECT_NEAR(std_o, 0.02 / 2.0, 0.0015);
}

TEST(Models, ParameterNamesAndShapes) {
  auto g = build_model(model("{arch: gpt2, layers: 1, hidden: 16, heads: 2, vocab_size: 300}"), 1);
  auto names = g->named_parameters().keys();
  for (const char* n : {"embed.weight", "pos_embed.weight", "layers.0.attn.q.weight",
                        "layers.0.attn.q.bias", "layers.0.mlp.up.weight", "norm.bias"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  EXPECT_EQ(std::find(names.begin(), names.end(), "head.weight"), names.end())
      << "gpt2 ties its head";
  auto l = build_model(
      model("{arch: llama, layers: 1, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 300}"), 1);
  auto p = l->named_parameters();
  EXPECT_EQ(p["layers.0.attn.k.weight"].sizes(), (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(p["head.weight"].sizes(), (std::vector<int64_t>{300, 16}));
  EXPECT_FALSE(p.contains("layers.0.attn.q.bias"));
  auto logits = l(torch::randint(0, 300, {2, 5}, torch::kInt64));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 5, 300}));
}

TEST(Models, CausalAndGroupedQueryAttention) {
  // The logits of position i do not depend on tokens after i.
  auto l = build_model(
      model("{arch: llama, layers: 2, hidden: 32, heads: 4, kv_heads: 1, vocab_size: 300}"), 5);
  auto x = torch::randint(0, 300, {1, 8}, torch::kInt64);
  auto y = x.clone();
  y[0][7] = (x[0][7].item<int64_t>() + 1) % 300;
  EXPECT_TRUE(torch::allclose(l(x).narrow(1, 0, 7), l(y).narrow(1, 0, 7), 1e-6, 1e-6));
  EXPECT_FALSE(torch::allclose(l(x).narrow(1, 7, 1), l(y).narrow(1, 7, 1), 1e-6, 1e-6));
}

TEST(Models, CachedDecodingEqualsTheWholeSequence) {
  // Generation's key/value cache: the prompt at once, then one token per call, gives the logits
  // of running the whole sequence (gpt2's learned positions and llama's RoPE with GQA).
  torch::NoGradGuard no_grad;
  for (const char* yaml : {"{arch: gpt2, layers: 2, hidden: 32, heads: 4, vocab_size: 300}",
                           "{arch: llama, layers: 2, hidden: 32, heads: 4, kv_heads: 2, "
                           "vocab_size: 300}"}) {
    auto d = build_model(model(yaml), 5);
    auto x = torch::randint(0, 300, {2, 12}, torch::kInt64);
    auto whole = d(x);  // [2, 12, Vp]
    std::vector<torch::Tensor> parts = {d->decode(x.narrow(1, 0, 5), 0)};
    for (int64_t i = 5; i < 12; ++i) parts.push_back(d->decode(x.narrow(1, i, 1), i));
    auto stepped = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(stepped, whole, 1e-5, 1e-5))
        << yaml << ": " << (stepped - whole).abs().max().item<float>();
    EXPECT_THROW(d->decode(x.narrow(1, 0, 1), 3), c10::Error);  // not where the cache ends
  }
}

TEST(Models, PipelineStagesChainToTheWholeModel) {
  // p = 2 ranks x v = 2 chunks: stages 0..3 hold layers [0,2) [2,3) [3,5) [5,6) (chunk c of rank r
  // is stage 2c + r). Chaining the stages' forwards gives the whole model's loss, every parameter
  // of the global model is held by exactly one stage (the tied table by the first and last), and
  // each rank lays its chunks out as contiguous ranges.
  for (const char* arch : {"gpt2", "llama"}) {
    auto m = model(fmt::format("{{arch: {}, layers: 6, hidden: 16, heads: 4, kv_heads: {}}}", arch,
                               std::string(arch) == "gpt2" ? 4 : 2));
    auto whole = build_model(m, 3);
    StagePart r0{{{0, 2}, {3, 5}}, true, false}, r1{{{2, 3}, {5, 6}}, false, true};
    auto a = build_model(m, 3, nullptr, false, r0), b = build_model(m, 3, nullptr, false, r1);
    auto rows = torch::randint(0, 257, {2, 9}, torch::kInt64);
    auto x = a->stage_forward(0, {}, rows);
    x = b->stage_forward(0, x, rows);
    x = a->stage_forward(1, x, rows);
    auto loss = b->stage_forward(1, x, rows);
    // Within the parity bar: the stages' and the whole model's buffers differ in alignment, which
    // AVX-512 matmul kernels round by (about 1e-6 relative measured on such a CPU).
    EXPECT_TRUE(torch::allclose(loss, whole->loss_sum(rows), 1e-5, 0))
        << arch << ": " << loss.item<double>() << " vs " << whole->loss_sum(rows).item<double>();
    EXPECT_TRUE(a->is_first_stage(0) && !a->is_last_stage(1) && b->is_last_stage(1));
    std::set<std::string> held;
    for (auto* d : {&a, &b})
      for (const auto& p : (*d)->named_parameters()) {
        const bool copy = (*d)->specs().at(p.key()).pipeline_copy;
        EXPECT_TRUE(held.insert(p.key()).second || copy) << p.key();
        EXPECT_TRUE(torch::equal(p.value(), whole->named_parameters()[p.key()])) << p.key();
      }
    std::set<std::string> all;
    for (const auto& p : whole->named_parameters()) all.insert(p.key());
    EXPECT_EQ(held, all) << arch;
    EXPECT_EQ(a->global_names(), all) << arch;
    EXPECT_EQ(b->global_names(), all) << arch;
    const bool tied = std::string(arch) == "gpt2";
    EXPECT_EQ(b->specs().count("embed.weight"), tied ? 1u : 0u);
    if (tied) EXPECT_EQ(b->specs().at("embed.weight").replicas, 2);
    EXPECT_EQ(a->specs().at("layers.4.mlp.up.weight").chunk, 1);
    EXPECT_EQ(b->specs().at("norm.weight").chunk, 1);
  }
}

// --dry-run's count from the plan equals the built model's, for whole models and pipeline stages
// (tensor-parallel ranks are checked against real runs in tests/dist/zero_parity_test.py).
TEST(Models, ParameterCountFromThePlan) {
  for (const char* arch : {"gpt2", "llama"}) {
    auto m =
        model(fmt::format("{{arch: {}, layers: 5, hidden: 16, heads: 4, kv_heads: {}, "
                          "vocab_size: 301, max_seq_len: 128}}",
                          arch, std::string(arch) == "gpt2" ? 4 : 2));
    for (const StagePart& part : {StagePart{}, StagePart{{{0, 2}, {3, 4}}, true, false},
                                  StagePart{{{2, 3}, {4, 5}}, false, true}}) {
      auto d = build_model(m, 3, nullptr, false, part);
      const std::string one =
          "layers." + std::to_string(part.chunks.empty() ? 0 : part.chunks[0].first) + ".";
      int64_t built = 0, block = 0;
      for (const auto& p : d->named_parameters()) {
        built += p.value().numel();
        if (p.key().rfind(one, 0) == 0) block += p.value().numel();
      }
      EXPECT_EQ(parameters_on_rank(m, 1, part), built) << arch;
      EXPECT_EQ(block_parameters(m, 1), block) << arch;
    }
  }
}

// The parts' FLOPs declarations (models/flops.h) are the convention over the built model's own
// parameters: 6 per element a token passes through (input lookups none, experts top_k of E)
// plus 12·L·H·Q·T·share; a recomputation reruns one forward, 2 per element, of each block
// (full) or each MLP half (selective), with attention's 4·H·Q·T·share under full.
TEST(Models, FlopsAreTheConventionOverTheBuiltModel) {
  const std::vector<std::string> shapes = {
      "{arch: gpt2, layers: 3, hidden: 16, heads: 4, vocab_size: 301, max_seq_len: 128}",
      "{arch: gpt2, layers: 2, hidden: 16, heads: 2, vocab_size: 301, mlp: relu2}",
      "{arch: llama, layers: 3, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 301}",
      "{arch: llama, layers: 4, hidden: 16, heads: 4, kv_heads: 1, vocab_size: 301, "
      "tie_embeddings: true, qk_norm: true, moe: {experts: 4, top_k: 2, ffn_hidden: 8, "
      "shared_experts: 1, every: 2}}"};
  const int64_t seq = 48;
  for (const auto& yaml : shapes)
    for (double share : {1.0, 0.375}) {
      const auto m = model(yaml);
      auto d = build_model(m, 3);
      double n = 0, blocks = 0, mlp_halves = 0;
      for (const auto& [name, spec] : d->specs()) {
        if (name == "pos_embed.weight" || (name == "embed.weight" && !m.tied())) continue;
        double numel = 1;
        for (auto e : spec.global_shape) numel *= static_cast<double>(e);
        if (spec.expert) numel *= static_cast<double>(m.moe.top_k) / m.moe.experts;
        n += numel;
        if (name.rfind("layers.", 0) == 0) blocks += numel;
        if (name.find(".mlp") != std::string::npos) mlp_halves += numel;  // mlp_norm and mlp.*
      }
      const double attention = 4.0 * m.layers * m.hidden * seq * share;  // H·Q = hidden
      const auto f = DecoderImpl::flops(d->options(), seq, share);
      EXPECT_DOUBLE_EQ(f.train, 6 * n + 3 * attention) << yaml;
      EXPECT_DOUBLE_EQ(f.forward, 2 * n + attention) << yaml;
      EXPECT_DOUBLE_EQ(DecoderImpl::rerun_flops(d->options(), plan::Recompute::kFull, seq, share),
                       2 * blocks + attention)
          << yaml;
      EXPECT_DOUBLE_EQ(
          DecoderImpl::rerun_flops(d->options(), plan::Recompute::kSelective, seq, share),
          2 * mlp_halves)
          << yaml;
      EXPECT_EQ(DecoderImpl::rerun_flops(d->options(), plan::Recompute::kNone, seq, share), 0.0);
    }
}

// The plan's parameter list (what --dry-run lays ZeRO's buckets out from) is the built model's:
// names, sizes, chunks and expert flags in registration order, under tp, ep, qk-norm, shared
// experts, untied heads and every kind of stage.
TEST(Models, ParameterEntriesFromThePlan) {
  const std::vector<std::string> shapes = {
      "{arch: gpt2, layers: 5, hidden: 16, heads: 4, vocab_size: 301, max_seq_len: 160}",
      "{arch: llama, layers: 5, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 301}",
      "{arch: llama, layers: 5, hidden: 16, heads: 4, kv_heads: 1, vocab_size: 301, "
      "tie_embeddings: true, qk_norm: true, moe: {experts: 4, top_k: 2, ffn_hidden: 8, "
      "shared_experts: 1, "
      "every: 2, bias_update_rate: 0.001}}"};
  for (const auto& yaml : shapes)
    for (int64_t tp : {1, 2})
      for (int64_t ep : {1, 2})
        for (const StagePart& part :
             {StagePart{}, StagePart{{{0, 2}, {3, 4}}, true, false},
              StagePart{{{2, 3}, {4, 5}}, false, true}, StagePart{{{0, 1}, {4, 5}}, true, true}}) {
          auto m = model(yaml);
          std::vector<int64_t> tp_ranks(static_cast<size_t>(tp)), ep_ranks(static_cast<size_t>(ep));
          std::iota(tp_ranks.begin(), tp_ranks.end(), 0);
          std::iota(ep_ranks.begin(), ep_ranks.end(), 0);
          parallel::Group tp_group("tp", tp_ranks, 0, nullptr),
              ep_group("ep", ep_ranks, 0, nullptr);
          auto d = build_model(m, 3, &tp_group, false, part, nullptr, plan::CpMethod::kAllGather,
                               &ep_group);
          const auto built = named_params(d);
          const auto planned = param_entries(m, tp, part, ep);
          const std::string what =
              fmt::format("{} tp {} ep {} chunks {}", yaml, tp, ep, part.chunks.size());
          ASSERT_EQ(planned.size(), built.size()) << what;
          for (size_t i = 0; i < built.size(); ++i) {
            EXPECT_EQ(planned[i].name, built[i].name) << what;
            EXPECT_EQ(planned[i].numel, built[i].tensor.numel()) << what << " " << built[i].name;
            EXPECT_EQ(planned[i].chunk, built[i].chunk) << what << " " << built[i].name;
            EXPECT_EQ(planned[i].expert, built[i].expert) << what << " " << built[i].name;
          }
        }
}

TEST(HfNames, RoundTripBothArchitectures) {
  for (const char* yaml :
       {"{arch: gpt2, layers: 2, hidden: 16, heads: 2, vocab_size: 300}",
        "{arch: llama, layers: 2, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 300}"}) {
    auto m = model(yaml);
    auto w = model_weights(*std::make_unique<Decoder>(build_model(m, 9)));
    Weights hf;
    for (auto& [k, t] : arch(m.arch).to_hf(w, m)) hf[k] = t;
    auto back = arch(m.arch).from_hf(hf, m, "mem", nullptr);
    ASSERT_EQ(back.size(), w.size()) << yaml;
    for (const auto& [k, t] : w) EXPECT_TRUE(torch::equal(t, back.at(k))) << k;
  }
  // A file with more layers than the plan is refused, not silently truncated.
  auto deep = model("{arch: llama, layers: 3, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 300}");
  auto shallow =
      model("{arch: llama, layers: 2, hidden: 16, heads: 4, kv_heads: 2, vocab_size: 300}");
  Weights hf3;
  for (auto& [k, t] :
       arch(plan::ModelArch::kLlama)
           .to_hf(model_weights(*std::make_unique<Decoder>(build_model(deep, 1))), deep))
    hf3[k] = t;
  try {
    arch(plan::ModelArch::kLlama).from_hf(hf3, shallow, "deep.safetensors", nullptr);
    FAIL();
  } catch (const plan::UserError& e) {
    EXPECT_NE(
        std::string(e.what()).find("deep.safetensors: tensors the plan's model does not have"),
        std::string::npos);
    EXPECT_NE(std::string(e.what()).find("model.layers.2.mlp.up_proj.weight"), std::string::npos)
        << e.what();
  }
  auto m = model("{arch: gpt2, layers: 1, hidden: 16, heads: 2, vocab_size: 300}");
  Weights partial;
  try {
    arch(plan::ModelArch::kGpt2).from_hf(partial, m, "x.safetensors", nullptr);
    FAIL();
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("x.safetensors: missing Hugging Face tensor 'wte.weight'"),
              std::string::npos);
  }
}

// The rerun of a recomputed piece draws the forward's random numbers (dropout would otherwise
// drop other units in backward than in forward).
TEST(Recompute, ReplaysTheForwardsRandomDraws) {
  testing::check_recompute_replays_rng(torch::kCPU);
}

}  // namespace
}  // namespace tessel::models
