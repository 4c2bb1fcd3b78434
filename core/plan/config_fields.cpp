// The one declaration of every plan field: key, default, help, and its range or choices.
#include "core/plan/config.h"

#include <tuple>

namespace tessel::plan {
namespace {
using S = std::string;
using Strings = std::vector<std::string>;
using Doubles = std::vector<double>;

// Appends one field to the table, in call order (the order of docs/configuration.md and of the
// YAML dump); returns it for .range() / .one_of() / .allow_auto().
class FieldAdder {
 public:
  explicit FieldAdder(std::vector<Field>& f) : f_(f) {}
  Field& operator()(S key, FieldRef ref, FieldValue def, S help) {
    f_.push_back(Field{std::move(key), ref, std::move(def), std::move(help)});
    if (auto* choice = std::get_if<ChoiceBase*>(&ref)) f_.back().choices = (*choice)->names();
    return f_.back();
  }

 private:
  std::vector<Field>& f_;
};

// run.*
void add_run_fields(FieldAdder& add, Config& c) {
  add("run.name", &c.run.name, S("tessel"), "Name shown in logs and metrics.");
  add("run.seed", &c.run.seed, int64_t{1234},
      "Seed of the initial weights (keyed by parameter name) and of the data order.")
      .range(0);
  add("run.output_dir", &c.run.output_dir, S("runs/tessel"),
      "Folder for metrics.jsonl, the resolved plan (config.yaml) and checkpoints.");
}

// model.*
void add_model_fields(FieldAdder& add, Config& c) {
  add("model.arch", &c.model.arch, S("gpt2"), "Architecture.");
  add("model.layers", &c.model.layers, int64_t{2}, "Transformer blocks.").range(1);
  add("model.hidden", &c.model.hidden, int64_t{64}, "Model width.").range(1);
  add("model.heads", &c.model.heads, int64_t{4}, "Attention (query) heads.").range(1);
  add("model.kv_heads", &c.model.kv_heads, int64_t{0},
      "Key/value heads (grouped-query attention; llama). auto = heads.")
      .range(0)
      .allow_auto();
  add("model.ffn_hidden", &c.model.ffn_hidden, int64_t{0},
      "MLP width. auto = 4·hidden (gpt2) or 8/3·hidden rounded up to a multiple of 64 (llama).")
      .range(0)
      .allow_auto();
  add("model.vocab_size", &c.model.vocab_size, int64_t{257},
      "Vocabulary size (text data needs at least 257: bytes plus end-of-document).")
      .range(1);
  add("model.max_seq_len", &c.model.max_seq_len, int64_t{256},
      "Longest sequence (gpt2: rows of the position table).")
      .range(1);
  add("model.tie_embeddings", &c.model.tie_embeddings, S("auto"),
      "Share input embedding and output head. auto = true for gpt2, false for llama.");
  add("model.mlp", &c.model.mlp, S("auto"),
      "The MLP's form: gelu_tanh = down(GELU_tanh(up x)) (GPT-2's); swiglu = down(SiLU(gate x) "
      "* up x) (Llama's); relu2 = down(ReLU(up x)^2) (squared ReLU, as Primer and Nemotron-4). "
      "auto = gelu_tanh for gpt2, swiglu for llama. MoE layers' routed experts are SwiGLU.");
  add("model.norm_eps", &c.model.norm_eps, 1e-5, "Epsilon of LayerNorm / RMSNorm.").range(0);
  add("model.rope_theta", &c.model.rope_theta, 10000.0, "RoPE base (llama).").range(1);
  add("model.init_std", &c.model.init_std, 0.02, "Std of the normal initial weights.").range(0);
  add("model.init_from", &c.model.init_from, S(""),
      "Start from these weights, Hugging Face names (save_pretrained of GPT2LMHeadModel / "
      "LlamaForCausalLM / Mixtral / Qwen3-MoE) or Tessel names: one safetensors file, or a folder "
      "holding model.safetensors.index.json and its shards (what save_pretrained writes above "
      "its max_shard_size, as released models ship) or model.safetensors (a `tessel-train "
      "export` folder). The files are memory-mapped: each rank reads only the slices it keeps. "
      "Empty = seeded init.");
  add("model.init_from_accept", &c.model.init_from_accept, Strings{},
      "Model keys this plan may set otherwise than model.init_from's config.json says (e.g. "
      "[model.rope_theta] to train with another base). Without it a contradiction is refused "
      "naming both values; keys the plan does not give are taken from config.json.");
  add("model.qk_norm", &c.model.qk_norm, false,
      "RMSNorm of every query and key head before RoPE, as Qwen3 (llama).");
}

// model.moe.*
void add_moe_fields(FieldAdder& add, Config& c) {
  add("model.moe.experts", &c.model.moe.experts, int64_t{0},
      "Mixture of experts (llama): routed experts per MoE layer. 0 = a dense model.")
      .range(0);
  add("model.moe.top_k", &c.model.moe.top_k, int64_t{2}, "Experts each token is routed to.")
      .range(1);
  add("model.moe.shared_experts", &c.model.moe.shared_experts, int64_t{0},
      "Shared experts every token also passes through (DeepSeek, Qwen2-MoE), run as one MLP of "
      "shared_experts·moe.ffn_hidden.")
      .range(0);
  add("model.moe.ffn_hidden", &c.model.moe.ffn_hidden, int64_t{0},
      "Each expert's inner width. auto = model.ffn_hidden.")
      .range(0)
      .allow_auto();
  add("model.moe.every", &c.model.moe.every, int64_t{1},
      "MoE placement: layer i (from 0) is an MoE layer when (i + 1) % every == 0; the others "
      "keep the dense MLP.")
      .range(1);
  add("model.moe.capacity_factor", &c.model.moe.capacity_factor, 0.0,
      "0 = dropless. Else each expert keeps at most ceil(factor·seq_len·top_k / experts) choices "
      "per sequence, the first in token order; the rest pass by the residual only.")
      .range(0);
  add("model.moe.router.score", &c.model.moe.router_score, S("softmax"),
      "Router scores: softmax over experts (Mixtral, Qwen3-MoE) or sigmoid per expert "
      "(DeepSeek-V3).");
  add("model.moe.router.norm_topk", &c.model.moe.norm_topk, true,
      "Renormalise the k chosen experts' gate weights to sum to 1 (Mixtral; Qwen3-MoE's "
      "norm_topk_prob).");
  add("model.moe.aux_loss_coef", &c.model.moe.aux_loss_coef, 0.01,
      "Weight of the sequence-wise load-balancing loss (DeepSeek-V3), summed over MoE layers. "
      "Its gradient trains the router; the reported loss stays the language-model loss and the "
      "balance loss is reported beside it (moe_aux_loss).")
      .range(0);
  add("model.moe.bias_update_rate", &c.model.moe.bias_update_rate, 0.0,
      "Auxiliary-loss-free balancing (DeepSeek-V3): each MoE layer keeps a per-expert bias added "
      "to the scores for choosing experts only (not to the gate weights); after every step it "
      "moves by this rate toward balance (up for experts with fewer choices than the mean over "
      "the global batch, down for more). 0 = off. DeepSeek-V3 uses 0.001.")
      .range(0);
}

// parallel.*: degrees, rank order and collectives
void add_parallel_fields(FieldAdder& add, Config& c) {
  add("parallel.dp", &c.parallel.dp, int64_t{0},
      "Data-parallel degree. auto = world size / (tp·cp·pp).")
      .range(0)
      .allow_auto();
  add("parallel.tp", &c.parallel.tp, int64_t{1}, "Tensor-parallel degree.").range(1);
  add("parallel.pp", &c.parallel.pp, int64_t{1}, "Pipeline-parallel degree.").range(1);
  add("parallel.ep", &c.parallel.ep, int64_t{1},
      "Expert-parallel degree (MoE): each MoE layer's experts are split over ep ranks drawn from "
      "the data-parallel ranks (ep divides dp; dp=2 with ep=2 runs on 2 processes), tokens "
      "reaching them by all-to-all; expert gradients are summed over the dp/ep ranks that hold "
      "the same experts.")
      .range(1);
  add("parallel.cp", &c.parallel.cp, int64_t{1},
      "Context-parallel degree: each sequence is cut into 2·cp chunks and cp rank r holds chunks "
      "r and 2·cp−1−r (equal causal work per rank).")
      .range(1);
  add("parallel.context.method", &c.parallel.context_method, S("allgather"),
      "How attention sees the other cp ranks' keys and values: allgather = gather K/V over cp "
      "before attention (reduce-scatter their gradients); ring = pass K/V blocks around the cp "
      "ring while attending to the current one, merged by log-sum-exp; alltoall = Ulysses: an "
      "all-to-all trades this rank's tokens of every head for every token of 1/cp of the heads, "
      "dense attention runs on those, and a second all-to-all brings the outputs back (query "
      "heads per tp rank must divide by cp); hybrid = alltoall inside groups of "
      "parallel.context.alltoall_size consecutive cp ranks and ring across the groups.");
  add("parallel.context.alltoall_size", &c.parallel.context_alltoall_size, int64_t{2},
      "hybrid: cp ranks per all-to-all group (consecutive cp ranks, within a node by the default "
      "order); it divides parallel.cp, and each tp rank's query heads divide by it. The ring runs "
      "over the cp / alltoall_size groups.")
      .range(1);
  add("parallel.sequence_parallel", &c.parallel.sequence_parallel, false,
      "Split activations outside the tensor-parallel regions along the sequence (tp > 1): "
      "all-gather before column-parallel layers, reduce-scatter after row-parallel ones.");
  add("parallel.order", &c.parallel.order, S("tp-cp-dp-pp"),
      "Rank order, fastest-varying first (tensor-parallel peers share a node).");
  add("parallel.backend", &c.parallel.backend, S("auto"),
      "Collectives: auto = nccl on CUDA, gloo on CPU.");
  add("parallel.timeout_s", &c.parallel.timeout_s, 600.0,
      "Rendezvous and collective timeout; a collective that takes longer fails, naming its group, "
      "operation, sequence number and rank.")
      .range(1);
}

// parallel.*: pipeline schedule, gradient buckets and ZeRO
void add_parallel_pipeline_fields(FieldAdder& add, Config& c) {
  add("parallel.pipeline.schedule", &c.parallel.pipeline_schedule, S("1f1b"),
      "Pipeline schedule: gpipe (all forwards, then all backwards), 1f1b, interleaved 1F1B, "
      "zb-h1 (zero-bubble: backward split into input and weight gradients, the weights' deferred "
      "into the bubble; 1F1B's memory, about a third of its bubble) or zbv (zero-bubble in a V: "
      "two chunks per rank, virtual_stages 2).");
  add("parallel.pipeline.virtual_stages", &c.parallel.virtual_stages, int64_t{1},
      "Model chunks per pipeline rank (interleaved: 2 or more; zbv: 2; 1 otherwise).")
      .range(1);
  add("parallel.pipeline.layers_per_stage", &c.parallel.layers_per_stage, Doubles{},
      "Layers of each pipeline stage (pp·virtual_stages integers summing to model.layers); empty = "
      "an even split.");
  add("parallel.ddp.bucket_mb", &c.parallel.ddp_bucket_mb, 25.0,
      "Gradient bucket size (MiB of fp32): each bucket is summed over dp×cp as soon as backward "
      "completes it.")
      .range(0.001);
  add("parallel.zero", &c.parallel.zero, int64_t{0},
      "ZeRO stage over the data group (dp×cp): 0 = every rank holds everything (DDP); 1 = AdamW "
      "state and fp32 master sharded (gradients reduce-scattered, parameters all-gathered after "
      "the step); 2 = gradients sharded too (reduce-scattered per bucket during every "
      "backward); 3 = parameters sharded too (each layer gathered before its forward and "
      "backward, freed after).")
      .range(0, 3);
  add("parallel.zero_shard", &c.parallel.zero_shard, int64_t{1},
      "Hybrid sharding (ZeRO 1-3): shard over groups of this many consecutive data ranks (dp×cp) "
      "and replicate across the groups, as FSDP's HSDP and Megatron's distributed-optimizer "
      "instances do: each bucket's gradients are reduce-scattered inside a group and the pieces "
      "all-reduced across groups once per step. 1 (or the whole data group) = shard over the "
      "whole data group. Must divide dp×cp, and be a multiple of parallel.ep. --dry-run prints "
      "the memory and bytes of each choice and names the best for the node size.")
      .range(1);
  add("parallel.zero3.keep_gathered", &c.parallel.zero3_keep_gathered, false,
      "ZeRO-3 with several micro-batches per step (pipelines, gradient accumulation): true keeps "
      "each unit (a block, or the embeddings, norm and head) gathered from its first use to the "
      "end of the step, and with fp32 weights accumulates the micro-batches' gradients in the "
      "parameters and reduce-scatters them once per step (faster: one gather and one "
      "reduce-scatter per unit per step; the stage's whole weights and gradients live during the "
      "step); false gathers a unit for every forward and backward and frees it after (leaner: "
      "2 gathers and 1 reduce-scatter per unit per micro-batch).");
}

// training.*: device, precision, batch shape and evaluation
void add_training_fields(FieldAdder& add, Config& c) {
  add("training.device", &c.training.device, S("auto"), "auto = cuda when available, else cpu.");
  add("training.dtype", &c.training.dtype, S("auto"),
      "fp32, or bf16/fp16 weights and activations with fp32 master weights and fp32 gradient "
      "accumulation; fp16 scales the loss dynamically (training.loss_scale). auto = bf16 when "
      "training.device resolves to cuda, else fp32.");
  add("training.tf32", &c.training.tf32, true,
      "On CUDA, fp32 matrix multiplications and convolutions use TF32 tensor cores (as "
      "Megatron-LM and torchtitan do); false keeps them exact fp32 (parity checks).");
  add("training.deterministic", &c.training.deterministic, false,
      "Deterministic kernels, so that a run repeats bitwise on the same GPUs, layout and plan: "
      "PyTorch's deterministic algorithms (flash and memory-efficient attention backward without "
      "atomics, cuDNN's attention left out), cuBLAS with a fixed workspace "
      "(CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), cuDNN deterministic and not benchmarking. "
      "It costs speed (attention backward and scatter-adds serialise) and an operator without a "
      "deterministic CUDA kernel stops the run naming it. CPU runs repeat bitwise either way (for "
      "the same thread count: tessel-train sets oneMKL's MKL_CBWR=AUTO,STRICT and "
      "MKL_DYNAMIC=FALSE "
      "unless exported, since on Intel CPUs with AVX-512 oneMKL's matrix products otherwise vary "
      "from run to run under load).");
  add("training.recompute", &c.training.recompute, S("none"),
      "Activation checkpointing. none: keep every block's activations for backward. selective: "
      "keep attention's and rerun each block's MLP half (its norm and the ffn-wide tensors, the "
      "largest per token) in backward. full: keep only each block's input and rerun the whole "
      "block in backward (about one more forward of compute).");
  add("training.activation_checkpointing", &c.training.activation_checkpointing, S("none"),
      "The same setting as training.recompute, under its earlier name: either "
      "name sets both (--set of one overrides the plan's other; a plan giving both must agree).");
  add("training.steps", &c.training.steps, int64_t{100}, "Optimizer steps.").range(1);
  add("training.global_batch", &c.training.global_batch, int64_t{8},
      "Sequences per optimizer step, over all data-parallel ranks.")
      .range(1);
  add("training.micro_batch", &c.training.micro_batch, int64_t{8},
      "Sequences per forward/backward; micro-batches per step = global_batch / (dp·micro_batch).")
      .range(1);
  add("training.seq_len", &c.training.seq_len, int64_t{128}, "Tokens per sequence.").range(1);
  add("training.grad_clip", &c.training.grad_clip, 1.0,
      "Clip the global gradient norm to this value; 0 = no clipping.")
      .range(0);
  add("training.eval_every", &c.training.eval_every, int64_t{0},
      "Validation loss every N steps (and at the last step); 0 = never.")
      .range(0);
  add("training.eval_batches", &c.training.eval_batches, int64_t{4},
      "Global batches of validation data per evaluation.")
      .range(1);
  add("training.threads", &c.training.threads, int64_t{0},
      "CPU threads for intra-op parallelism. auto = torch's default.")
      .range(0)
      .allow_auto();
}

// training.*: what makes a step fast, none of it changing what is trained (float rounding aside)
void add_training_speed_fields(FieldAdder& add, Config& c) {
  add("training.kernels", &c.training.kernels, S("tessel"),
      "tessel: Tessel's own kernels where they apply, on fp32 CPU tensors: vectorised tanh-GELU "
      "and SwiGLU, RMSNorm and rotary embedding each as one pass forward and one backward, and "
      "attention over at most 256 keys as two batched matmuls around one softmax pass (it keeps "
      "each head's probabilities for backward: 4·heads·seq_len bytes per token and layer); the "
      "same functions within float rounding (docs/performance.md). torch: LibTorch's operators "
      "everywhere (SDPA's flash kernel for attention). Elsewhere (CUDA, bf16, fp16) both run "
      "LibTorch's.");
  add("training.fp8", &c.training.fp8, S("off"),
      "The transformer blocks' linear layers (attention's projections, the MLP) in float8 with "
      "dynamic scales, as torchao's float8 training recipes: tensorwise (one scale per tensor; "
      "inputs and weights e4m3, gradients e5m2) or rowwise (one scale per row, rounded down to a "
      "power of two; e4m3 throughout). The embedding, the head, norms, the router, the experts "
      "and the optimizer stay in training.dtype, master weights and moments in fp32. On CUDA "
      "it needs compute capability 8.9 (Ada, Hopper, Blackwell) and every such layer's "
      "dimensions, and the tokens of a micro-batch on one rank, multiples of 16; the CPU runs "
      "both recipes (docs/performance.md). off: every matmul in training.dtype.");
  add("training.lean_logits", &c.training.lean_logits, true,
      "Fuse the output head with the cross-entropy and run them a chunk of tokens at a time, "
      "making the gradients as each chunk's logits are made: a micro-batch's [tokens, vocab/tp] "
      "logits are never held at once (the same matmuls; the loss equal within float rounding). "
      "false: the whole logits, then the loss.");
  add("training.lean_logits_chunk", &c.training.lean_logits_chunk, int64_t{0},
      "With training.lean_logits: tokens per chunk. 0 = as many as keep one chunk's fp32 logits "
      "within 64 MiB on a CPU, 1 GiB on a GPU (each chunk reads and writes the head's fp32 weight "
      "gradient once: on a GPU, small chunks spend more time there than in their matmuls).")
      .range(0);
  add("training.microbatch_pairs", &c.training.microbatch_pairs, true,
      "CPU, one process, two or more micro-batches and intra-op threads, no ZeRO, experts or "
      "recomputation: run "
      "the micro-batches two at a time, each on half of the threads, instead of one at a time on "
      "all of them (faster on small models: no fork and join per operator). Two micro-batches' "
      "activations are held at once (the planner counts them). Gradients are added in micro-batch "
      "order, as one at a time adds them, so runs repeat bit for bit; against one at a time they "
      "agree within float rounding (a matmul on one thread may round differently from one on "
      "two). false: one at a time.");
  add("training.cuda_graph", &c.training.cuda_graph, false,
      "CUDA: after 3 eager warm-up steps, capture one whole training step (forward, backward, "
      "gradient all-reduces, clipping, the optimizer) as a CUDA graph and replay it for every "
      "later step: one launch per step instead of thousands. The batch, learning rate and step "
      "number reach it through fixed device buffers, so the replays compute what eager steps "
      "would (the same kernels in the same order). Needs training.device cuda, the NCCL backend, "
      "and a step whose shapes and host decisions never change: parallel.pp 1, parallel.zero 0, "
      "training.recompute none, no mixture of experts. If capture fails the run goes on eagerly, "
      "saying why in the log. "
      "Exposed communication time is not measured inside a graph (logged as n/a).");
}

// training.optimizer.* and training.schedule.*
void add_training_optimizer_fields(FieldAdder& add, Config& c) {
  add("training.optimizer.lr", &c.training.optimizer.lr, 3e-4, "Peak learning rate (AdamW).")
      .range(0);
  add("training.optimizer.betas", &c.training.optimizer.betas, Doubles{0.9, 0.95},
      "AdamW betas [beta1, beta2].");
  add("training.optimizer.eps", &c.training.optimizer.eps, 1e-8, "AdamW epsilon.").range(0);
  add("training.optimizer.weight_decay", &c.training.optimizer.weight_decay, 0.1,
      "Decoupled weight decay.")
      .range(0);
  add("training.optimizer.no_decay", &c.training.optimizer.no_decay,
      Strings{"*norm*", "*.bias", "embed.*", "pos_embed.*"},
      "Parameter-name globs exempt from weight decay (Tessel names, e.g. layers.0.attn.q.bias).");
  add("training.schedule.warmup_steps", &c.training.schedule.warmup_steps, int64_t{0},
      "Linear warmup: lr·s/warmup_steps at step s.")
      .range(0);
  add("training.schedule.decay", &c.training.schedule.decay, S("cosine"),
      "Decay from lr to min_lr over the steps after warmup.");
  add("training.schedule.min_lr", &c.training.schedule.min_lr, 0.0, "Final learning rate.")
      .range(0);
}

// training.loss_scale.* (fp16)
void add_training_loss_scale_fields(FieldAdder& add, Config& c) {
  add("training.loss_scale.initial", &c.training.loss_scale.initial, 65536.0,
      "fp16: the first loss scale.")
      .range(1);
  add("training.loss_scale.growth_factor", &c.training.loss_scale.growth_factor, 2.0,
      "fp16: the scale is multiplied by this after growth_interval steps without overflow.")
      .range(1);
  add("training.loss_scale.backoff_factor", &c.training.loss_scale.backoff_factor, 0.5,
      "fp16: the scale is multiplied by this after a step whose gradients overflow (the step is "
      "skipped).")
      .range(0, 1);
  add("training.loss_scale.growth_interval", &c.training.loss_scale.growth_interval, int64_t{2000},
      "fp16: steps without overflow before the scale grows.")
      .range(1);
  add("training.loss_scale.min_scale", &c.training.loss_scale.min_scale, 1.0,
      "fp16: the scale never backs off below this.")
      .range(0);
  add("training.loss_scale.inject_overflow_step", &c.training.loss_scale.inject_overflow_step,
      int64_t{0},
      "Testing: multiply this step's loss by 1e30 so its gradients overflow (0 = never). fp16 "
      "skips the step; other dtypes stop with the non-finite error.")
      .range(0);
}

// data.*
void add_data_fields(FieldAdder& add, Config& c) {
  add("data.format", &c.data.format, S("text"),
      "text: UTF-8 files as byte tokens 0-255 plus end-of-document 256; megatron: .bin/.idx "
      "indexed datasets (path = prefix); tokens: flat little-endian token files.");
  add("data.path", &c.data.path, Strings{},
      "Files, globs (text, tokens) or prefixes (megatron); relative to the working directory.");
  add("data.blend", &c.data.blend, std::vector<BlendSource>{},
      "Weighted datasets instead of data.path: a list of {weight, path} (path: files, globs or "
      "prefixes of data.format, a string or a list; weights normalised). Each global sample comes "
      "from the dataset whose share so far lags its weight most (Megatron-Core's BlendedDataset "
      "rule), each dataset's samples in its own order; validation and test as data.split or "
      "data.val_fraction cut each.");
  add("data.split", &c.data.split, S(""),
      "Train, validation and test shares of each dataset by documents, as Megatron's --split: "
      "\"969,30,1\" (1 to 3 non-negative numbers, normalised; missing ones are 0). Documents are "
      "a megatron index's sequences and text files; a tokens file, which marks none, is split by "
      "tokens. Empty: all training (or data.val_fraction).");
  add("data.valid", &c.data.valid, std::vector<BlendSource>{},
      "Validation datasets of their own (a list of {weight, path} as data.blend): each is "
      "evaluated alone; the overall validation loss weighs them by weight.");
  add("data.test", &c.data.test, std::vector<BlendSource>{},
      "Test datasets of their own (as data.valid), scored by `tessel-train score PLAN --split "
      "test`.");
  add("data.order", &c.data.order, S("tessel"),
      "Which samples a run trains on, in which order. tessel: windows of seq_len+1 tokens cut "
      "back to back, shuffled per epoch by run.seed (independent of training.steps, so a run "
      "may be extended). megatron: Megatron-Core's GPTDataset/BlendedDataset samples for the "
      "same prefixes, weights, split, seed and seq_len, sized for training.steps x "
      "training.global_batch samples (data.format megatron).");
  add("data.index_cache", &c.data.index_cache, S(""),
      "Folder of data.order megatron's sample indices, built once and mapped by every rank "
      "(keyed by the data, split, samples, seq_len and seed; checked on reuse). Empty: beside "
      "each dataset, in <its folder>/cache/tessel-indices (as Megatron-Core keeps its own).");
  add("data.val_fraction", &c.data.val_fraction, 0.0,
      "Share of the token stream (its end) held out for validation (data.order tessel, without "
      "data.split).")
      .range(0, 0.5);
  add("data.shuffle", &c.data.shuffle, true,
      "Shuffle the sample order each epoch (a pure function of run.seed and the epoch).");
  add("data.token_dtype", &c.data.token_dtype, S("uint16"), "Element type of `tokens` files.");
  add("data.document_mask", &c.data.document_mask, false,
      "Keep attention inside each document of a packed sample (block-diagonal causal, cut after "
      "every data.eod_token) and restart positions (RoPE, learned) at each document.");
  add("data.eod_mask_loss", &c.data.eod_mask_loss, false,
      "No loss on the token after an end-of-document id (data.eod_token), as Megatron-LM's "
      "--eod-mask-loss: the first token of the next document is not predicted from the one "
      "before. The loss is the mean over the global batch's scored tokens (Megatron's "
      "--calculate-per-token-loss), so every layout and micro-batch size gives the same.");
  add("data.eod_token", &c.data.eod_token, int64_t{-1},
      "The end-of-document token id data.document_mask cuts after and data.eod_mask_loss "
      "masks after. -1: the data's own: the text "
      "format's 256, or what tessel-data recorded beside each megatron dataset "
      "(PREFIX.tessel.json); tokens data names its tokenizer's (e.g. 50256 for GPT-2, 128001 for "
      "Llama 3).")
      .range(-1, 1e12);
}

// checkpoint.*
void add_checkpoint_fields(FieldAdder& add, Config& c) {
  add("checkpoint.dir", &c.checkpoint.dir, S(""),
      "Checkpoint folder. Empty = <run.output_dir>/checkpoints.");
  add("checkpoint.every", &c.checkpoint.every, int64_t{0},
      "Save every N steps; the last step is always saved. 0 = only the last.")
      .range(0);
  add("checkpoint.keep", &c.checkpoint.keep, int64_t{0},
      "Keep the newest N checkpoints. 0 = keep all.")
      .range(0);
  add("checkpoint.resume", &c.checkpoint.resume, S("auto"),
      "auto: continue from <checkpoint.dir>/latest when it exists, else start; never: start from "
      "step 0; or the path of a checkpoint (step_<N> folder or a checkpoint.dir) to continue "
      "from.");
  add("checkpoint.on_signal", &c.checkpoint.on_signal, Strings{"SIGTERM", "SIGUSR1", "SIGINT"},
      "Signals that make every rank finish its current step, save a checkpoint and exit with "
      "code 75 (preempted, or Ctrl-C: rerun to resume; a second Ctrl-C ends the run at once, "
      "nothing saved). [] = the default action (terminate, nothing saved).")
      .one_of({"SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"});
  add("checkpoint.accept_changes", &c.checkpoint.accept_changes, Strings{},
      "Plan keys a resumed run may change although they alter the run (seq_len, global_batch, "
      "seed, data, model, optimizer, LR schedule and, under a cosine or linear decay, steps), e.g. "
      "[training.steps]. A resume under any other such change is refused, naming it. The step "
      "count and the data position (samples consumed) carry over; the LR of each later step is "
      "the new plan's.");
  add("checkpoint.async", &c.checkpoint.async, false,
      "Save in the background: at the step boundary each rank copies its part of the state to "
      "host memory (one buffer, sized exactly; page-locked, on a side stream on CUDA, which only "
      "the optimizer step waits for) and training goes on while a thread writes "
      "the same files, checksums and marker. At most one save in flight; a stop and the end of "
      "training wait for it. Costs host memory: each rank's part of the checkpoint.");
  add("checkpoint.export_hf", &c.checkpoint.export_hf, S(""),
      "At the end of training (not on a stop), also write the last checkpoint in Hugging Face "
      "form into this folder, as `tessel-train export CHECKPOINT --out DIR` would, without a "
      "second process. Empty = none.");
}

// logging.*
void add_logging_fields(FieldAdder& add, Config& c) {
  add("logging.tensorboard", &c.logging.tensorboard, true,
      "Also write the logged figures as TensorBoard events under <run.output_dir>/tensorboard "
      "(rank 0; `tensorboard --logdir` reads them).");
  add("logging.every", &c.logging.every, int64_t{1}, "Console and metrics line every N steps.")
      .range(1);
  add("logging.metrics_file", &c.logging.metrics_file, S("metrics.jsonl"),
      "JSON-lines metrics, relative to run.output_dir.");
  add("logging.peak_tflops", &c.logging.peak_tflops, 0.0,
      "Peak TFLOP/s per device for MFU. 0 = the device table (GPUs) or a matmul measured at start "
      "(CPU).")
      .range(0);
  add("logging.profile", &c.logging.profile, S(""),
      "Profile these training steps with LibTorch's profiler: \"N\" (N steps after 3 warm-up "
      "steps) or \"A-B\" (steps A to B). Each rank writes <run.output_dir>/profile/"
      "rank<R>.pt.trace.json (Perfetto, TensorBoard) and rank<R>.top.md, the operators by self "
      "time; rank 0 prints its table. Same as tessel-train --profile STEPS.");
}

void mark_free_on_resume(std::vector<Field>& f) {
  // What a resumed run may change without altering what it trains (the start-up prints each
  // change); every other key needs checkpoint.accept_changes.
  const std::pair<const char*, const char*> free_on_resume[] = {
      {"run.name", "a label"},
      {"run.output_dir", "where the run writes"},
      {"model.init_from", "initial weights: a resumed run's come from the checkpoint"},
      {"model.init_from_accept", "initial weights: a resumed run's come from the checkpoint"},
      {"model.init_std", "initial weights: a resumed run's come from the checkpoint"},
      {"parallel.", "the layout: the same global batch, the same losses"},
      {"training.micro_batch", "the layout: the same global batch, the same losses"},
      {"training.device", "where the run computes"},
      {"training.dtype", "arithmetic precision: master weights and moments stay fp32"},
      {"training.fp8", "arithmetic precision of the blocks' matmuls: the state is unchanged"},
      {"training.tf32", "arithmetic precision of fp32 matmuls on CUDA"},
      {"training.deterministic", "speed: deterministic variants of the same kernels"},
      {"training.recompute", "memory against time: the same losses"},
      {"training.kernels", "speed: the same functions, float rounding aside"},
      {"training.lean_logits", "memory: the same loss, float rounding aside"},
      {"training.cuda_graph", "speed: the same kernels, replayed"},
      {"training.microbatch_pairs", "speed: the same sums, float rounding aside"},
      {"training.activation_checkpointing", "memory against time: the same losses"},
      {"training.threads", "speed"},
      {"training.eval_", "evaluation only"},
      {"training.loss_scale.", "fp16 loss scaling: its state carries over in the checkpoint"},
      {"checkpoint.", "checkpointing"},
      {"data.index_cache", "where the sample indices are kept: the same indices"},
      {"logging.", "logging"},
  };
  for (auto& field : f)
    for (const auto& [prefix, why] : free_on_resume)
      if (field.key.rfind(prefix, 0) == 0) field.free_on_resume = why;
}

// Upper bounds of the integer keys whose size builds something: a value past them would overflow
// a count (parameters, bytes, tokens, int64 inside LibTorch) or exhaust memory building modules
// and schedules before a step runs. Each is far above any published model or run; the reason is
// given with the bound in the error and in --help-config. Products are bounded by the plan's
// cross-field checks (tokens per step, parameters).
void mark_upper_bounds(std::vector<Field>& f) {
  constexpr double k = 1024;
  const std::string model = "far above published models (their largest use ";
  const std::string ranks = "65,536 ranks or more are beyond any cluster Tessel's launcher starts";
  const std::tuple<const char*, double, std::string> bounds[] = {
      {"model.layers", k, model + "under 200)"},
      {"model.hidden", 128 * k, model + "under 32,768)"},
      {"model.heads", 4 * k, model + "under 256)"},
      {"model.kv_heads", 4 * k, model + "under 256)"},
      {"model.ffn_hidden", k * k, model + "under 100,000)"},
      {"model.vocab_size", 16 * k * k, model + "under 300,000 token ids)"},
      {"model.max_seq_len", 4 * k * k, "4M tokens: the position tables and masks grow with it"},
      {"model.moe.experts", 4 * k, model + "under 512 experts)"},
      {"model.moe.top_k", 4 * k, "at most the experts"},
      {"model.moe.shared_experts", 64, model + "under 8 shared experts)"},
      {"model.moe.ffn_hidden", k * k, model + "under 100,000)"},
      {"model.moe.every", k, "at most model.layers"},
      {"parallel.dp", 64 * k, ranks},
      {"parallel.tp", 64 * k, ranks},
      {"parallel.pp", 64 * k, ranks},
      {"parallel.ep", 64 * k, ranks},
      {"parallel.cp", 64 * k, ranks},
      {"parallel.context.alltoall_size", 64 * k, ranks},
      {"parallel.zero_shard", 64 * k, ranks},
      {"parallel.pipeline.virtual_stages", k, "at most model.layers"},
      {"training.steps", k * k * k, "2^30 steps: the token count stays exact in int64"},
      {"training.global_batch", 4 * k * k, "4M sequences per step: every sample's index is held"},
      {"training.micro_batch", 4 * k * k, "at most training.global_batch"},
      {"training.seq_len", 4 * k * k, "at most model.max_seq_len"},
      {"training.eval_batches", k * k, "each evaluation reads them all"},
      {"training.schedule.warmup_steps", k * k * k, "at most training.steps"},
  };
  for (auto& field : f)
    for (const auto& [key, hi, why] : bounds)
      if (field.key == key) field.at_most(hi, why);
}

}  // namespace

std::vector<Field> bind_fields(Config& c) {
  std::vector<Field> f;
  FieldAdder add(f);
  add_run_fields(add, c);
  add_model_fields(add, c);
  add_moe_fields(add, c);
  add_parallel_fields(add, c);
  add_parallel_pipeline_fields(add, c);
  add_training_fields(add, c);
  add_training_speed_fields(add, c);
  add_training_optimizer_fields(add, c);
  add_training_loss_scale_fields(add, c);
  add_data_fields(add, c);
  add_checkpoint_fields(add, c);
  add_logging_fields(add, c);
  mark_free_on_resume(f);
  mark_upper_bounds(f);
  return f;
}

}  // namespace tessel::plan
