// The plan: one struct per YAML section. Every field is declared once, in config_fields.cpp
// (key, default, help, range or choices); that one table drives YAML parsing, `--set` overrides,
// `tessel-train --help-config` (docs/configuration.md) and the resolved-plan dump.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "core/plan/choice.h"
#include "core/plan/choices.h"
#include "core/plan/user_error.h"

namespace tessel::plan {

struct RunConfig {
  std::string name;
  int64_t seed;
  std::string output_dir;
};

struct MoeConfig {  // model.moe.*: mixture of experts (llama); experts 0: dense
  int64_t experts, top_k, shared_experts;
  int64_t ffn_hidden;                // 0 = auto (model.ffn_hidden)
  int64_t every;                     // layer i is MoE when (i + 1) % every == 0
  double capacity_factor;            // 0: dropless
  Choice<RouterScore> router_score;  // model.moe.router.score
  bool norm_topk;                    // model.moe.router.norm_topk
  double aux_loss_coef;
  double bias_update_rate;  // auxiliary-loss-free balancing: the bias step per optimizer step
};

struct ModelConfig {
  Choice<ModelArch> arch;  // gpt2 | llama
  int64_t layers, hidden, heads;
  int64_t kv_heads;    // 0 = auto (= heads)
  int64_t ffn_hidden;  // 0 = auto (gpt2: 4·hidden; llama: 8/3·hidden rounded up to 64)
  int64_t vocab_size, max_seq_len;
  Choice<TieEmbeddings> tie_embeddings;  // auto | true | false; auto resolves by arch
  Choice<Mlp> mlp;                       // the MLP's form; auto: the arch's (models::features)
  double norm_eps, rope_theta, init_std;
  std::string init_from;  // safetensors file (Hugging Face or Tessel names) or empty
  std::vector<std::string> init_from_accept;  // keys that may contradict init_from's config.json
  bool qk_norm;                               // RMSNorm of each query/key head before RoPE (Qwen3)
  MoeConfig moe;

  bool tied() const { return tie_embeddings == TieEmbeddings::kTrue; }
  int64_t head_dim() const { return hidden / heads; }
};

struct ParallelConfig {
  int64_t dp;  // 0 = auto (world / (tp·cp·pp))
  int64_t tp, pp, cp;
  int64_t ep;  // expert parallelism: MoE experts split over ep ranks drawn from dp
  Choice<CpMethod> context_method;  // parallel.context.method
  int64_t context_alltoall_size;    // hybrid: ranks per all-to-all group (context.alltoall_size)
  bool sequence_parallel;
  Choice<RankOrder> order;  // tp-cp-dp-pp
  Choice<Backend> backend;  // parallel.backend
  double timeout_s;         // collectives and rendezvous
  double ddp_bucket_mb;
  int64_t zero;  // 0: DDP; 1: optimizer state sharded over dp×cp; 2: + gradients; 3: + parameters
  bool zero3_keep_gathered;  // ZeRO-3: units gathered once per step (not per use)
  int64_t zero_shard;        // hybrid sharding: ZeRO over groups of this many data ranks (1: all)
  Choice<PipelineSchedule> pipeline_schedule;  // parallel.pipeline.schedule
  int64_t virtual_stages;                      // model chunks per pipeline rank (interleaved)
  std::vector<double> layers_per_stage;        // empty: even split
};

struct OptimizerConfig {
  double lr;
  std::vector<double> betas;
  double eps, weight_decay;
  std::vector<std::string> no_decay;  // parameter-name globs exempt from weight decay
};

struct LrScheduleConfig {
  int64_t warmup_steps;
  Choice<Decay> decay;  // training.schedule.decay
  double min_lr;
};

struct LossScaleConfig {  // fp16 dynamic loss scaling (as torch.amp.GradScaler)
  double initial, growth_factor, backoff_factor, min_scale;
  int64_t growth_interval;
  int64_t inject_overflow_step;  // testing: multiply this step's loss by 1e30 (0 = never)
};

struct TrainingConfig {
  Choice<TrainDevice> device;  // auto | cpu | cuda
  Choice<Dtype> dtype;  // fp32 | bf16 | fp16 (auto resolved at load: bf16 on CUDA, else fp32)
  bool tf32;            // CUDA: fp32 matmuls and convolutions on TF32 tensor cores
  bool deterministic;   // deterministic kernels (PyTorch's deterministic algorithms)
  Choice<Recompute> recompute;  // activation checkpointing
  Choice<Kernels> kernels;      // Tessel's own fused kernels where they apply, or LibTorch's
  Choice<Fp8> fp8;   // the blocks' linear layers in float8 (core/kernels/fp8.h), or not (off)
  bool lean_logits;  // head fused with the loss, in chunks of tokens (parallel/tp/head_loss.h)
  int64_t
      lean_logits_chunk;  // tokens per chunk; 0: at most 64 MiB (CPU), 1 GiB (GPU) of fp32 logits
  bool cuda_graph;        // CUDA: the steady-state step captured once and replayed
                          // (engine/run/step_graph.h)
  bool microbatch_pairs;  // CPU, one process: micro-batches two at a time (parallel/pp/pairs.cpp)
  Choice<Recompute> activation_checkpointing;  // alias of recompute, resolved into it at load
  int64_t steps, global_batch, micro_batch, seq_len;
  double grad_clip;
  int64_t eval_every, eval_batches, threads;
  OptimizerConfig optimizer;
  LrScheduleConfig schedule;
  LossScaleConfig loss_scale;
};

/// One dataset of a weighted blend (data.blend): its weight and its files, globs or prefixes.
struct BlendSource {
  double weight = 0;
  std::vector<std::string> path;
  bool operator==(const BlendSource& o) const { return weight == o.weight && path == o.path; }
};

struct DataConfig {
  Choice<DataFormat> format;       // data.format
  std::vector<std::string> path;   // files or globs; megatron: prefixes (without .bin/.idx)
  std::vector<BlendSource> blend;  // data.blend: weighted datasets instead of data.path
  std::vector<BlendSource> valid;  // data.valid: validation datasets of their own
  std::vector<BlendSource> test;   // data.test: test datasets of their own
  std::string split;               // data.split: "969,30,1" (train, valid, test by documents)
  Choice<DataOrder> order;         // data.order: which samples, in which order
  std::string index_cache;         // data.index_cache: folder of data.order megatron's indices
  double val_fraction;
  bool shuffle;
  Choice<TokenDtype> token_dtype;  // data.token_dtype (tokens files)
  bool document_mask;              // data.document_mask: attention inside each document
  bool eod_mask_loss;              // data.eod_mask_loss: no loss on the token after an eod
  int64_t eod_token;               // data.eod_token: -1 = the data's own (engine/data/vocabulary.h)
};

struct CheckpointConfig {
  std::string dir;
  int64_t every, keep;
  std::string resume;                       // auto | never | path of a checkpoint
  std::vector<std::string> on_signal;       // SIGTERM | SIGUSR1 | SIGUSR2 | SIGINT: save and stop
  std::vector<std::string> accept_changes;  // plan keys that may differ from the checkpoint's
  std::string export_hf;                    // folder for the last checkpoint as HF safetensors
  bool async;                               // checkpoint.async: written in the background
};

struct LoggingConfig {
  int64_t every;
  std::string metrics_file;  // relative to run.output_dir
  double peak_tflops;        // 0 = from the device table (CPU: measured matmul peak)
  bool tensorboard;          // events under <output_dir>/tensorboard
  std::string profile;       // "" none; "N": N steps after 3 warm-up steps; "A-B": steps A to B
};

struct Config {
  std::string checkpoint_dir() const;  // checkpoint.dir, or <run.output_dir>/checkpoints
  RunConfig run;
  ModelConfig model;
  ParallelConfig parallel;
  TrainingConfig training;
  DataConfig data;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  std::string source;  // the file it came from, for messages
  // The keys the plan file (their line) or --set (line 0) gave; the others hold their defaults.
  std::map<std::string, int> given;
};

// ---- the field table -----------------------------------------------------------------------

using FieldRef = std::variant<int64_t*, double*, bool*, std::string*, std::vector<std::string>*,
                              std::vector<double>*, ChoiceBase*, std::vector<BlendSource>*>;
using FieldValue = std::variant<int64_t, double, bool, std::string, std::vector<std::string>,
                                std::vector<double>, std::vector<BlendSource>>;

struct Field {
  std::string key;  // dotted: "training.optimizer.lr"
  FieldRef ref;
  FieldValue def;
  std::string help;
  std::vector<std::string> choices;  // non-empty: the value must be one of these
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool auto_zero = false;  // integer where "auto" is accepted and stored as 0
  // Why a resumed run may take another value than its checkpoint's plan (layout, logging, ...);
  // empty: a change alters the run and needs checkpoint.accept_changes (engine/run/resume_plan.h).
  std::string free_on_resume;

  // Why the upper bound is where it is (a value above it would overflow a count or exhaust
  // memory before anything useful runs): said in the error and in --help-config.
  std::string max_why;

  Field& range(double lo, double hi = std::numeric_limits<double>::infinity()) {
    min = lo;
    max = hi;
    return *this;
  }
  Field& at_most(double hi, std::string why) {
    max = hi;
    max_why = std::move(why);
    return *this;
  }
  Field& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  Field& allow_auto() {
    auto_zero = true;
    return *this;
  }
  std::string type_name() const;
  std::string value_text() const;  // current value as YAML text
};

/// Every field of the plan, bound to `c`'s members (the single declaration of the schema).
std::vector<Field> bind_fields(Config& c);

/// Defaults, then the YAML file, then `--set key=value` overrides, then cross-field validation
/// and resolution of "auto" values. Throws UserError naming file, line, key and values.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
/// Completes a plan before its cross-field validation: given the plan as read (its `given`
/// filled), "key=value" settings for keys it did not give (engine/run/init_plan.h: the model
/// from model.init_from's config.json). UserError for what it refuses.
using Completion = std::function<std::vector<std::string>(const Config& as_read)>;
Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   const Completion& complete);
/// The same from YAML text (tests); `source` names it in messages.
Config load_config_text(const std::string& yaml, const std::string& source,
                        const std::vector<std::string>& overrides = {});

/// The resolved plan as YAML (every field, nested by section).
std::string dump_config(const Config& c);
/// Markdown reference of every field (docs/configuration.md).
std::string config_reference();
/// The closest known key to `key`, for "did you mean" messages.
std::string nearest_key(const std::string& key);

/// The steps logging.profile names, inclusive, for a run whose first step is `first_step` (> 1
/// when resumed): "N" is the N steps after 3 warm-up steps (fewer warm-up steps when the run is
/// short), "A-B" steps A to B. {0, -1} (empty) when unset. Throws UserError naming the key and
/// its value when it is not one of these forms or leaves 1..training.steps.
std::pair<int64_t, int64_t> profile_steps(const Config& c, int64_t first_step = 1);

/// Whether training steps run their micro-batches two at a time (training.microbatch_pairs): on
/// CPU, in one process (`world`), without ZeRO, experts or recomputation, with two or more
/// micro-batches and two or more intra-op `threads`.
bool pairs_microbatches(const Config& c, int64_t world, bool cuda, int64_t threads);

}  // namespace tessel::plan
