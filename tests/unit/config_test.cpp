#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/plan/config.h"

namespace tessel {
namespace {

const char* kGood = R"(run: {name: t, seed: 7, output_dir: /tmp/x}
model:
  arch: llama
  layers: 2
  hidden: 64
  heads: 4
  kv_heads: 2
training: {steps: 10, global_batch: 8, micro_batch: 4, seq_len: 32}
data: {format: text, path: [a.txt]}
)";

TEST(Config, DefaultsResolveAndOverride) {
  plan::Config c =
      plan::load_config_text(kGood, "good.yaml", {"training.optimizer.lr=0.01", "model.layers=3"});
  EXPECT_EQ(c.model.arch, plan::ModelArch::kLlama);
  EXPECT_EQ(c.model.kv_heads, 2);
  EXPECT_EQ(c.model.tie_embeddings, plan::TieEmbeddings::kFalse);  // auto resolves by arch
  EXPECT_EQ(c.model.ffn_hidden, 192);                              // 8/3·64 = 170.7 -> 192
  EXPECT_DOUBLE_EQ(c.training.optimizer.lr, 0.01);
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_EQ(c.parallel.dp, 0);  // auto: resolved against the world by plan::check_layout
  plan::Config g = plan::load_config_text("data: {path: x}\n", "g.yaml");
  EXPECT_EQ(g.model.tie_embeddings, plan::TieEmbeddings::kTrue);
  EXPECT_EQ(g.model.ffn_hidden, 4 * g.model.hidden);
  EXPECT_EQ(g.data.path, std::vector<std::string>{"x"});  // a scalar is a one-element list
}

TEST(Config, DumpReloadsToTheSamePlan) {
  plan::Config c =
      plan::load_config_text(kGood, "good.yaml", {"training.optimizer.betas=[0.8, 0.99]"});
  std::string dumped = plan::dump_config(c);
  plan::Config again = plan::load_config_text(dumped, "dumped.yaml");
  EXPECT_EQ(plan::dump_config(again), dumped);
  EXPECT_EQ(again.training.optimizer.betas, (std::vector<double>{0.8, 0.99}));
}

const std::string kData = "data: {path: a.txt}\n";

// training.recompute and training.activation_checkpointing are one setting: an override of
// either wins over the plan's other name, and the resolved plan carries both.
TEST(Config, RecomputeAliases) {
  const std::string plan = kData + "training: {activation_checkpointing: full}\n";
  plan::Config c = plan::load_config_text(plan, "p.yaml", {"training.recompute=none"});
  EXPECT_EQ(c.training.recompute.name(), "none");
  EXPECT_EQ(c.training.activation_checkpointing.name(), "none");
  c = plan::load_config_text(plan, "p.yaml");
  EXPECT_EQ(c.training.recompute.name(), "full");
  c = plan::load_config_text(kData + "training: {recompute: selective}\n", "p.yaml",
                             {"training.activation_checkpointing=full"});
  EXPECT_EQ(c.training.recompute.name(), "full");
  EXPECT_EQ(c.training.activation_checkpointing.name(), "full");
  plan::Config again =
      plan::load_config_text(plan::dump_config(c), "dumped.yaml");  // both keys, agreeing
  EXPECT_EQ(again.training.recompute.name(), "full");
}

struct BadPlan {
  const char* name;
  std::string yaml;
  std::vector<std::string> overrides;
  std::string expected;  // a substring of the message
};

void PrintTo(const BadPlan& p, std::ostream* os) { *os << p.name; }

class BadPlans : public ::testing::TestWithParam<BadPlan> {};

TEST_P(BadPlans, FailWithTheirMessage) {
  const auto& p = GetParam();
  try {
    plan::load_config_text(p.yaml, "plan.yaml", p.overrides);
    FAIL() << "accepted: " << p.name;
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(p.expected), std::string::npos)
        << p.name << "\n  got:      " << e.what() << "\n  expected: " << p.expected;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, BadPlans,
    ::testing::Values(
        BadPlan{"recompute names disagree",
                kData + "training:\n  recompute: full\n  activation_checkpointing: selective\n",
                {},
                "plan.yaml:4: training.activation_checkpointing (selective) and "
                "training.recompute (full, line 3) name the same setting and disagree"},
        BadPlan{"unknown key",
                kData + "training:\n  lrr: 3\n",
                {},
                "plan.yaml:3: unknown key 'training.lrr'; did you mean"},
        BadPlan{"misspelt section key",
                kData + "model:\n  hiden: 64\n",
                {},
                "plan.yaml:3: unknown key 'model.hiden'; did you mean 'model.hidden'?"},
        BadPlan{"right key, wrong section",
                kData + "model:\n  steps: 5\n",
                {},
                "did you mean 'training.steps'?"},
        BadPlan{"wrong type",
                kData + "training:\n  steps: ten\n",
                {},
                "plan.yaml:3: training.steps: expected an integer, got 'ten'"},
        BadPlan{"out of range",
                kData + "training:\n  steps: 0\n",
                {},
                "plan.yaml:3: training.steps: must be in [1, 1073741824], got 0"},
        BadPlan{
            "an MoE model's MLP form",
            kData + "model: {arch: llama, mlp: gelu_tanh, moe: {experts: 4}}\n",
            {},
            "model.mlp gelu_tanh: an MoE model's routed experts are SwiGLU (model.moe.experts 4); "
            "leave model.mlp auto or swiglu"},
        BadPlan{"bad choice",
                kData + "model: {arch: bert}\n",
                {},
                "model.arch: must be one of gpt2|llama, got 'bert'"},
        BadPlan{"heads do not divide hidden",
                kData + "model: {hidden: 100, heads: 12}\n",
                {},
                "model.hidden (100) must be divisible by model.heads (12)"},
        BadPlan{"kv heads do not divide heads",
                kData + "model: {arch: llama, hidden: 64, heads: 4, kv_heads: 3}\n",
                {},
                "model.heads (4) must be divisible by model.kv_heads (3)"},
        BadPlan{"global batch vs micro batch",
                kData + "training: {global_batch: 10, micro_batch: 4}\n",
                {},
                "training.global_batch (10) must be divisible by training.micro_batch (4)"},
        BadPlan{"sequence longer than the model",
                kData + "model: {max_seq_len: 64}\ntraining: {seq_len: 128}\n",
                {},
                "training.seq_len (128) must be <= model.max_seq_len (64)"},
        BadPlan{"text data needs 257 ids",
                kData + "model: {vocab_size: 100}\n",
                {},
                "model.vocab_size (100) must be >= 257"},
        BadPlan{"eval without validation data",
                kData + "training: {eval_every: 5}\n",
                {},
                "training.eval_every (5) needs validation data: give data.split (e.g. "
                "969,30,1), data.valid or data.val_fraction"},
        BadPlan{"split that does not parse",
                "data: {path: a.txt, split: '98,2,x'}\n",
                {},
                "data.split '98,2,x' does not parse: 'x' is not a number"},
        BadPlan{"split of four shares",
                "data: {path: a.txt, split: '1,1,1,1'}\n",
                {},
                "more than 3 shares"},
        BadPlan{
            "split of nothing", "data: {path: a.txt, split: '0,0'}\n", {}, "the shares sum to 0"},
        BadPlan{"split without training",
                "data: {path: a.txt, split: '0,1,0'}\n",
                {},
                "data.split '0,1,0' gives training no share"},
        BadPlan{"megatron order's item of two prefixes",
                "data: {format: megatron, order: megatron, blend: [{weight: 1, path: [p, q]}]}\n",
                {},
                "data.blend item 1 lists 2 prefixes: data.order megatron reads one prefix per "
                "dataset"},
        BadPlan{"split and val_fraction",
                "data: {path: a.txt, split: '98,2', val_fraction: 0.1}\n",
                {},
                "data.val_fraction (0.1) and data.split ('98,2') both hold out validation data"},
        BadPlan{"split's validation and data.valid",
                "data: {path: a.txt, split: '98,2', valid: [{weight: 1, path: b.txt}]}\n",
                {},
                "data.valid names validation datasets of their own, and data.split '98,2'"},
        BadPlan{"megatron order of text",
                "data: {path: a.txt, order: megatron}\n",
                {},
                "data.order megatron reads Megatron-Core's samples of Megatron indexed datasets: "
                "data.format must be megatron (it is text)"},
        BadPlan{"megatron order's seed",
                "run: {seed: 5000000000}\ndata: {path: p, format: megatron, order: megatron}\n",
                {},
                "seed runs from 0 to 4294967295; run.seed is 5000000000"},
        BadPlan{"document mask without its id",
                "data: {path: p, format: tokens, document_mask: true}\n",
                {},
                "data.document_mask cuts documents after their end-of-document "
                "token; tokens data does not say which id that is"},
        BadPlan{"eod loss mask without its id",
                "data: {path: p, format: tokens, eod_mask_loss: true}\n",
                {},
                "data.eod_mask_loss masks the loss after their end-of-document token; tokens data "
                "does not say which id that is"},
        BadPlan{"eod loss mask in a captured step",
                "data: {path: a.txt, eod_mask_loss: true}\ntraining: {device: cuda, cuda_graph: "
                "true}\n",
                {},
                "data.eod_mask_loss: every step scores another number of tokens, and "
                "training.cuda_graph replays one step's loss scale"},
        BadPlan{"document mask's id outside the vocabulary",
                "model: {vocab_size: 1000}\ndata: {path: p, format: megatron, document_mask: true, "
                "eod_token: 50256}\n",
                {},
                "data.eod_token (50256) must be below model.vocab_size (1000)"},
        BadPlan{"document mask with ring attention",
                "data: {path: a.txt, document_mask: true}\nparallel: {cp: 2, context: {method: "
                "ring}}\n",
                {},
                "needs parallel.context.method alltoall (it is ring)"},
        BadPlan{"document mask in a captured step",
                "data: {path: a.txt, document_mask: true}\ntraining: {device: cuda, cuda_graph: "
                "true}\n",
                {},
                "every step packs other documents, and training.cuda_graph replays one step's "
                "shapes"},
        BadPlan{"no data", "training: {steps: 3}\n", {}, "data.path is empty"},
        BadPlan{"betas",
                kData + "training:\n  optimizer: {betas: [0.9]}\n",
                {},
                "training.optimizer.betas must be two numbers in [0, 1), got [0.9]"},
        BadPlan{"duplicate key",
                kData + "model:\n  layers: 2\n  layers: 3\n",
                {},
                "plan.yaml:4: duplicate key 'model.layers'"},
        BadPlan{"section given a scalar",
                kData + "model: 3\n",
                {},
                "plan.yaml:2: 'model' is a section: expected a mapping"},
        BadPlan{"invalid yaml", "model: {layers: [1, 2\n", {}, "plan.yaml:2: invalid YAML"},
        BadPlan{"unknown --set key",
                kData,
                {"training.lr=1"},
                "--set training.lr=1: unknown key 'training.lr'; did you mean"},
        BadPlan{"--set without value", kData, {"training.steps"}, "expected section.key=value"},
        BadPlan{"--set wrong type",
                kData,
                {"training.steps=1.5"},
                "--set training.steps=1.5: training.steps: expected an integer"},
        BadPlan{"unknown backend",
                kData + "parallel: {backend: mpi}\n",
                {},
                "parallel.backend: must be one of auto|gloo|nccl, got 'mpi'"},
        BadPlan{
            "RoPE needs an even head dim",
            kData + "model: {arch: llama, hidden: 12, heads: 4}\n",
            {},
            "RoPE needs an even head dimension: model.hidden (12) / model.heads (4) = 3 is odd"},
        BadPlan{"cuda_graph on the CPU",
                kData + "training: {cuda_graph: true, device: cpu}\n",
                {},
                "plan.yaml:2: training.cuda_graph needs training.device cuda (it is cpu)"},
        BadPlan{"cuda_graph with a pipeline",
                kData + "training: {cuda_graph: true, device: cuda}\nparallel: {pp: 2}\n",
                {},
                "training.cuda_graph captures one step and replays it: with parallel.pp 2"},
        BadPlan{"cuda_graph with ZeRO",
                kData + "training: {cuda_graph: true, device: cuda}\nparallel: {zero: 1}\n",
                {},
                "training.cuda_graph captures one step and replays it: ZeRO 1 gathers"},
        BadPlan{"cuda_graph over gloo",
                kData + "training: {cuda_graph: true, device: cuda}\nparallel: {backend: gloo}\n",
                {},
                "parallel.backend gloo waits on the host"},
        BadPlan{"cuda_graph with recomputation",
                kData + "training: {cuda_graph: true, device: cuda, recompute: selective}\n",
                {},
                "(training.recompute selective) saves and restores the CUDA generator's state"},
        BadPlan{"cuda_graph with experts",
                kData + "model: {arch: llama, moe: {experts: 4}}\n",
                {"training.cuda_graph=true", "training.device=cuda"},
                "a mixture of experts routes tokens in shapes known only at run time"},
        BadPlan{"accept_changes names plan keys",
                kData + "checkpoint: {accept_changes: [training.step]}\n",
                {},
                "checkpoint.accept_changes: 'training.step' is not a plan key; did you mean "
                "'training.steps'?"}),
    [](const auto& info) {
      std::string n = info.param.name;
      for (auto& ch : n)
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

TEST(Config, ReportsEveryCrossFieldError) {
  try {
    plan::load_config_text(
        kData + "model: {hidden: 100, heads: 12}\ntraining: {global_batch: 10, micro_batch: 4}\n",
        "plan.yaml");
    FAIL();
  } catch (const plan::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("plan.yaml:2: model.hidden (100)"), std::string::npos) << m;
    EXPECT_NE(m.find("plan.yaml:3: training.global_batch (10)"), std::string::npos) << m;
  }
}

TEST(Config, NearestKey) {
  EXPECT_EQ(plan::nearest_key("training.optimizer.weightdecay"), "training.optimizer.weight_decay");
  EXPECT_EQ(plan::nearest_key("model.vocab"), "model.vocab_size");
}

TEST(Config, GeneratedReferenceIsCurrent) {
  const char* root = std::getenv("TESSEL_ROOT");
  ASSERT_NE(root, nullptr) << "set TESSEL_ROOT to the checkout (ctest does)";
  std::ifstream f(std::string(root) + "/docs/configuration.md");
  ASSERT_TRUE(f) << "docs/configuration.md is missing: run `make docs`";
  std::stringstream s;
  s << f.rdbuf();
  EXPECT_EQ(s.str(), plan::config_reference()) << "docs/configuration.md is stale: run `make docs`";
}

}  // namespace
}  // namespace tessel
