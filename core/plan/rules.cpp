#include "core/plan/rules.h"

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "core/device/cuda.h"
#include "core/plan/data_split.h"

namespace tessel::plan {
namespace {

// Cross-field rules, run after every value is in. Messages name both quantities and their values.
class Validator {
 public:
  Validator(Config& c, const std::map<std::string, int>& lines) : c_(c), lines_(lines) {}

  void require(bool ok, const std::string& key, const std::string& msg) {
    if (ok) return;
    auto it = lines_.find(key);
    std::string where = c_.source + (it != lines_.end() ? ":" + std::to_string(it->second) : "");
    errors_.push_back(where + ": " + msg);
  }
  template <class A, class B>
  static std::string q(const std::string& a, A va, const std::string& rel, const std::string& b,
                       B vb) {
    std::ostringstream s;
    s << a << " (" << va << ") " << rel << " " << b << " (" << vb << ")";
    return s.str();
  }

  void run() {
    // Resolve the "auto" values first: later rules talk about the resolved numbers.
    resolve_auto();
    check_model();
    check_training();
    check_data_and_checkpoint();
    check_data_splits();
    check_document_mask();
    check_cuda_graph();
    // The layout is checked against the world size by check_layout (layout.h): it needs the world.
    if (!errors_.empty()) {
      std::string all;
      for (const auto& e : errors_) all += (all.empty() ? "" : "\n") + e;
      throw UserError(all);
    }
  }

 private:
  void resolve_auto() {
    auto& m = c_.model;
    auto& t = c_.training;
    if (m.kv_heads == 0) m.kv_heads = m.heads;
    if (m.tie_embeddings == TieEmbeddings::kAuto)
      m.tie_embeddings = m.arch == ModelArch::kGpt2 ? TieEmbeddings::kTrue : TieEmbeddings::kFalse;
    if (m.ffn_hidden == 0)
      m.ffn_hidden = m.arch == ModelArch::kGpt2 ? 4 * m.hidden : (8 * m.hidden / 3 + 63) / 64 * 64;
    if (m.moe.ffn_hidden == 0) m.moe.ffn_hidden = m.ffn_hidden;
    if (t.dtype == Dtype::kAuto)  // bf16 where it is fast and safe (CUDA), fp32 elsewhere
      t.dtype = t.device == TrainDevice::kCuda ||
                        (t.device == TrainDevice::kAuto && device::cuda_available())
                    ? Dtype::kBf16
                    : Dtype::kFp32;
  }

  void check_model() {
    const auto& m = c_.model;
    require(m.hidden % m.heads == 0, "model.hidden",
            q("model.hidden", m.hidden, "must be divisible by", "model.heads", m.heads));
    require(m.heads % m.kv_heads == 0, "model.kv_heads",
            q("model.heads", m.heads, "must be divisible by", "model.kv_heads", m.kv_heads));
    require(m.arch != ModelArch::kGpt2 || m.kv_heads == m.heads, "model.kv_heads",
            q("gpt2 has no grouped-query attention: model.kv_heads", m.kv_heads, "must equal",
              "model.heads", m.heads));
    require(m.arch != ModelArch::kLlama || m.head_dim() % 2 == 0, "model.hidden",
            fmt::format("RoPE needs an even head dimension: model.hidden ({}) / model.heads ({}) "
                        "= {} is odd",
                        m.hidden, m.heads, m.head_dim()));
    require(m.moe.experts == 0 || m.mlp == Mlp::kAuto || m.mlp == Mlp::kSwiGlu, "model.mlp",
            fmt::format("model.mlp {}: an MoE model's routed experts are SwiGLU (model.moe.experts "
                        "{}); leave model.mlp auto or swiglu",
                        m.mlp.name(), m.moe.experts));
    require(m.arch == ModelArch::kLlama || !m.qk_norm, "model.qk_norm",
            "model.qk_norm is a llama-family option (Qwen3); model.arch is " + m.arch.name());
    // Each key is bounded; their product is too, in double (int64 byte counts of the weights,
    // gradients and optimizer state stay exact below 2^44 parameters, 16 bytes each).
    const double h = static_cast<double>(m.hidden),
                 experts = static_cast<double>(std::max<int64_t>(1, m.moe.experts));
    const double params =
        static_cast<double>(m.layers) *
            (4 * h * h + 3 * h * static_cast<double>(std::max(m.ffn_hidden, m.moe.ffn_hidden)) *
                             (experts + static_cast<double>(m.moe.shared_experts))) +
        2 * h * static_cast<double>(m.vocab_size + m.max_seq_len);
    constexpr double kMaxParams = 17.5e12;  // 2^44
    require(params <= kMaxParams, "model.hidden",
            fmt::format("model: about {:.3g} parameters (model.layers {}, model.hidden {}, "
                        "ffn_hidden {}, {} experts, vocab_size {}): at most {:.3g} (ten times "
                        "the largest published models; byte counts would overflow)",
                        params, m.layers, m.hidden, m.ffn_hidden, m.moe.experts, m.vocab_size,
                        kMaxParams));
    check_moe();
  }

  void check_moe() {
    const auto& m = c_.model;
    const auto& e = m.moe;
    const auto& p = c_.parallel;
    if (e.experts == 0) {
      require(p.ep == 1, "parallel.ep",
              q("parallel.ep", p.ep, "needs a mixture of experts: set", "model.moe.experts",
                e.experts));
      return;
    }
    require(m.arch == ModelArch::kLlama, "model.moe.experts",
            "model.moe.experts (" + std::to_string(e.experts) +
                ") builds llama-family MoE layers (Mixtral, Qwen3-MoE); model.arch is " +
                m.arch.name());
    require(e.top_k <= e.experts, "model.moe.top_k",
            q("model.moe.top_k", e.top_k, "must be <=", "model.moe.experts", e.experts));
    require(e.every <= m.layers, "model.moe.every",
            q("model.moe.every", e.every, "leaves no MoE layer: it must be <=", "model.layers",
              m.layers));
    require(e.experts % p.ep == 0, "parallel.ep",
            q("model.moe.experts", e.experts, "must be divisible by", "parallel.ep", p.ep) +
                ": each ep rank holds experts/ep whole experts");
    const bool split_sequence = p.cp > 1 || (p.sequence_parallel && p.tp > 1);
    require(e.capacity_factor == 0 || !split_sequence, "model.moe.capacity_factor",
            fmt::format("model.moe.capacity_factor ({}) drops choices per whole sequence in token "
                        "order, which needs each sequence on one rank: parallel.cp ({}) > 1 or "
                        "parallel.sequence_parallel with parallel.tp ({}) > 1 splits it; use "
                        "capacity_factor 0 (dropless) there",
                        fmt_double(e.capacity_factor), p.cp, p.tp));
    // Grouped matmuls over 16-bit weights need rows of 16-byte multiples.
    const bool half = c_.training.dtype != Dtype::kFp32;
    require(!half || (m.hidden % 8 == 0 && e.ffn_hidden % 8 == 0), "model.moe.ffn_hidden",
            fmt::format("training.dtype {}: the experts' grouped matmuls need model.hidden ({}) "
                        "and model.moe.ffn_hidden ({}) to be multiples of 8",
                        c_.training.dtype.name(), m.hidden, e.ffn_hidden));
  }

  void check_training() {
    const auto& m = c_.model;
    const auto& t = c_.training;
    require(t.seq_len <= m.max_seq_len, "training.seq_len",
            q("training.seq_len", t.seq_len, "must be <=", "model.max_seq_len", m.max_seq_len));
    constexpr double kMaxTokensPerStep = 4294967296.0;  // 2^32: x 2^30 steps stays in int64
    require(
        static_cast<double>(t.global_batch) * static_cast<double>(t.seq_len) <= kMaxTokensPerStep,
        "training.global_batch",
        fmt::format("training.global_batch ({}) x training.seq_len ({}) = {:.4g} tokens per "
                    "step: at most 2^32 (the largest published runs use under 2^25; token "
                    "counts must stay exact)",
                    t.global_batch, t.seq_len,
                    static_cast<double>(t.global_batch) * static_cast<double>(t.seq_len)));
    require(t.global_batch % t.micro_batch == 0, "training.global_batch",
            q("training.global_batch", t.global_batch, "must be divisible by",
              "training.micro_batch", t.micro_batch));
    require(t.optimizer.betas.size() == 2 && t.optimizer.betas[0] >= 0 &&
                t.optimizer.betas[0] < 1 && t.optimizer.betas[1] >= 0 && t.optimizer.betas[1] < 1,
            "training.optimizer.betas",
            "training.optimizer.betas must be two numbers in [0, 1), got " + betas_text());
    require(t.schedule.min_lr <= t.optimizer.lr, "training.schedule.min_lr",
            q("training.schedule.min_lr", t.schedule.min_lr, "must be <=", "training.optimizer.lr",
              t.optimizer.lr));
    require(!c_.parallel.zero3_keep_gathered || c_.parallel.zero == 3,
            "parallel.zero3.keep_gathered",
            fmt::format("parallel.zero3.keep_gathered is a ZeRO-3 setting (it keeps sharded "
                        "parameters gathered); parallel.zero is {}, whose parameters are never "
                        "sharded: set parallel.zero 3, or remove keep_gathered",
                        c_.parallel.zero));
    require(c_.parallel.zero_shard == 1 || c_.parallel.zero > 0, "parallel.zero_shard",
            fmt::format("parallel.zero_shard ({}) is a ZeRO setting (it chooses how many data "
                        "ranks share one copy of the sharded state); parallel.zero is 0, which "
                        "shards nothing: set parallel.zero 1, 2 or 3, or remove zero_shard",
                        c_.parallel.zero_shard));
    require(t.schedule.warmup_steps <= t.steps, "training.schedule.warmup_steps",
            q("training.schedule.warmup_steps", t.schedule.warmup_steps,
              "must be <=", "training.steps", t.steps));
  }

  // Megatron-Core's indices for the run's samples: 24 bytes each (a sample's start, 16, and its
  // place in the shuffle, 8), held in memory while they are built. Past this machine's memory
  // the build would end in std::bad_alloc: refused here, --dry-run included.
  void check_megatron_index_size() {
    const double samples = static_cast<double>(c_.training.steps) *
                           static_cast<double>(c_.training.global_batch),
                 bytes = 24.0 * samples,
                 memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                          static_cast<double>(::sysconf(_SC_PAGESIZE));
    require(memory <= 0 || bytes <= memory, "training.steps",
            fmt::format("data.order megatron builds its sample indices for training.steps {} x "
                        "training.global_batch {} = {:.0f} samples: {:.1f} GiB at 24 bytes a "
                        "sample, more than this machine's memory ({:.1f} GiB); give fewer "
                        "training.steps or a smaller training.global_batch",
                        c_.training.steps, c_.training.global_batch, samples, bytes / (1 << 30),
                        memory / (1 << 30)));
  }

  // Validation and test data (data.split, data.valid, data.test, data.val_fraction) and the
  // sample order.
  void check_data_splits() {
    const auto& d = c_.data;
    std::array<double, 3> shares{};
    const std::string bad = parse_split(d.split, shares);
    const std::string shown =
        d.split.size() <= 64
            ? d.split
            : d.split.substr(0, 40) + "... (" + std::to_string(d.split.size()) + " characters)";
    require(bad.empty(), "data.split", "data.split '" + shown + "' does not parse: " + bad);
    require(d.split.empty() || d.val_fraction == 0, "data.val_fraction",
            "data.val_fraction (" + fmt_double(d.val_fraction) + ") and data.split ('" + d.split +
                "') both hold out validation data: give one (data.split cuts each dataset by "
                "documents)");
    require(
        d.valid.empty() || (shares[1] == 0 && d.val_fraction == 0), "data.valid",
        "data.valid names validation datasets of their own, and " +
            std::string(d.val_fraction > 0 ? "data.val_fraction" : "data.split '" + d.split + "'") +
            " also holds validation out of the training data: give one");
    require(d.test.empty() || shares[2] == 0, "data.test",
            "data.test names test datasets of their own, and data.split '" + d.split +
                "' also holds a test share out of the training data: give one");
    const bool megatron = d.order == DataOrder::kMegatron;
    require(shares[0] > 0, "data.split",
            "data.split '" + d.split +
                "' gives training no share: its first number is the "
                "training data's");
    for (const auto* list : {&d.blend, &d.valid, &d.test})
      for (size_t i = 0; megatron && i < list->size(); ++i)
        require((*list)[i].path.size() == 1, "data.order",
                fmt::format("{} item {} lists {} prefixes: data.order megatron reads one prefix "
                            "per dataset, as Megatron's --data-path (give each its own item "
                            "and weight)",
                            list == &d.blend   ? "data.blend"
                            : list == &d.valid ? "data.valid"
                                               : "data.test",
                            i + 1, (*list)[i].path.size()));
    if (megatron) check_megatron_index_size();
    require(!megatron || d.format == DataFormat::kMegatron, "data.order",
            "data.order megatron reads Megatron-Core's samples of Megatron indexed datasets: "
            "data.format must be megatron (it is " +
                d.format.name() + ")");
    require(!megatron || d.val_fraction == 0, "data.val_fraction",
            "data.val_fraction holds out the end of a token stream (data.order tessel); with "
            "data.order megatron hold out validation with data.split, as Megatron's --split");
    require(!megatron || (c_.run.seed >= 0 && c_.run.seed <= 0xffffffffll), "run.seed",
            "data.order megatron shuffles as numpy's RandomState(run.seed), whose seed runs from "
            "0 to 4294967295; run.seed is " +
                std::to_string(c_.run.seed));
    require(!megatron || d.shuffle, "data.shuffle",
            "data.order megatron reads Megatron-Core's shuffled samples: data.shuffle false is "
            "data.order tessel's");
    const int64_t every = c_.training.eval_every;
    require(every == 0 || d.val_fraction > 0 || shares[1] > 0 || !d.valid.empty(),
            "training.eval_every",
            "training.eval_every (" + std::to_string(every) +
                ") needs validation data: give data.split (e.g. 969,30,1), data.valid or "
                "data.val_fraction");
  }

  // Which end-of-document id data.document_mask and data.eod_mask_loss use (`what` names the one
  // that asks; each problem is reported once).
  void check_eod_token(const std::string& what) {
    const auto& d = c_.data;
    if (eod_checked_) return;
    eod_checked_ = true;
    const bool text = d.format == DataFormat::kText;
    require(!text || d.eod_token < 0 || d.eod_token == 256, "data.eod_token",
            "text data ends each document with id 256: data.eod_token " +
                std::to_string(d.eod_token) + " names another (leave it -1)");
    require(d.format != DataFormat::kTokens || d.eod_token >= 0, "data.eod_token",
            what +
                " their end-of-document token; tokens data does not say which id that is: "
                "give data.eod_token (the tokenizer's, e.g. 50256 for GPT-2, 128001 for Llama 3)");
    require(
        d.eod_token < c_.model.vocab_size, "data.eod_token",
        q("data.eod_token", d.eod_token, "must be below", "model.vocab_size", c_.model.vocab_size));
  }

  // data.document_mask: which end-of-document id, and the layouts that keep documents apart.
  void check_document_mask() {
    const auto& d = c_.data;
    const auto& p = c_.parallel;
    if (d.eod_mask_loss) check_eod_token("data.eod_mask_loss masks the loss after");
    require(!d.eod_mask_loss || !c_.training.cuda_graph, "training.cuda_graph",
            "data.eod_mask_loss: every step scores another number of tokens, and "
            "training.cuda_graph replays one step's loss scale (set it false)");
    if (!d.document_mask) return;
    check_eod_token("data.document_mask cuts documents after");
    require(p.cp == 1 || p.context_method == CpMethod::kAllToAll, "parallel.context.method",
            "data.document_mask with parallel.cp " + std::to_string(p.cp) +
                " needs parallel.context.method alltoall (it is " + p.context_method.name() +
                "): alltoall gives each rank every token of its heads, so attention sees whole "
                "documents; allgather, ring and hybrid attend in blocks cut by position, which "
                "a document mask would split into a block per document piece");
    require(!c_.training.cuda_graph, "training.cuda_graph",
            "data.document_mask: every step packs other documents, and training.cuda_graph "
            "replays one step's shapes (set it false)");
  }

  // Megatron's --data-path "0.3 A 0.7 B" (weights between prefixes) written in data.path: its
  // numbers would be read as file names. Named, with the blend that says it.
  void check_megatron_style_weights() {
    std::vector<std::string> words;
    for (const auto& item : c_.data.path) {
      std::istringstream in(item);
      for (std::string w; in >> w;) words.push_back(w);
    }
    auto number = [](const std::string& w) {
      char* end = nullptr;
      std::strtod(w.c_str(), &end);
      return !w.empty() && end == w.c_str() + w.size();
    };
    if (words.size() < 2 || !number(words[0])) return;
    std::string blend;
    for (size_t i = 0; i + 1 < words.size(); i += 2)
      blend += (blend.empty() ? "" : ", ") + std::string("{weight: ") + words[i] +
               ", path: " + words[i + 1] + "}";
    require(false, "data.path",
            "data.path '" + fmt::format("{}", fmt::join(c_.data.path, " ")) +
                "' reads as Megatron's --data-path (weights between prefixes); Tessel names "
                "weighted datasets in data.blend: blend: [" +
                blend + "] (and no data.path)");
  }

  void check_data_and_checkpoint() {
    const auto& m = c_.model;
    require(c_.data.format != DataFormat::kText || m.vocab_size >= 257, "model.vocab_size",
            q("text data has 257 token ids (bytes and end-of-document): model.vocab_size",
              m.vocab_size, "must be >=", "257", 257));
    require(!c_.data.path.empty() || !c_.data.blend.empty(), "data.path",
            "data.path is empty: name the training data (or data.blend, weighted datasets)");
    require(c_.data.path.empty() || c_.data.blend.empty(), "data.blend",
            "data.path and data.blend both name training data: give one (a blend lists every "
            "dataset with its weight)");
    check_megatron_style_weights();
    try {
      profile_steps(c_);
    } catch (const UserError& e) {
      require(false, "logging.profile", e.what());
    }
    Config scratch;
    const auto fields = bind_fields(scratch);
    for (const auto& key : c_.checkpoint.accept_changes) {
      const auto f =
          std::find_if(fields.begin(), fields.end(), [&](const Field& x) { return x.key == key; });
      if (f == fields.end())
        require(false, "checkpoint.accept_changes",
                "checkpoint.accept_changes: '" + key + "' is not a plan key; did you mean '" +
                    nearest_key(key) + "'?");
      else
        require(f->free_on_resume.empty(), "checkpoint.accept_changes",
                "checkpoint.accept_changes: '" + key +
                    "' needs no acceptance: a resumed run may change it freely (" +
                    f->free_on_resume + "); remove it from the list");
    }
  }

  // A captured step replays its device work only: whatever the host decides inside a step must
  // be the same every step, and every wait must be on the device.
  void check_cuda_graph() {
    const auto& t = c_.training;
    const auto& p = c_.parallel;
    if (!t.cuda_graph) return;
    const std::string why = "training.cuda_graph captures one step and replays it";
    require(t.device == TrainDevice::kCuda, "training.cuda_graph",
            "training.cuda_graph needs training.device cuda (it is " + t.device.name() +
                "): CUDA graphs are a CUDA feature");
    require(p.backend != Backend::kGloo, "parallel.backend",
            why +
                ": its collectives must be NCCL's (queued on the device); parallel.backend "
                "gloo waits on the host");
    require(p.pp == 1, "parallel.pp",
            why + ": with parallel.pp " + std::to_string(p.pp) +
                " the pipeline's transfers and schedule are driven from the host; use pp 1");
    require(p.zero == 0, "parallel.zero",
            why + ": ZeRO " + std::to_string(p.zero) +
                " gathers and releases weights by host bookkeeping across steps; use zero 0");
    require(t.recompute == Recompute::kNone, "training.recompute",
            why + ": recomputation (training.recompute " + t.recompute.name() +
                ") saves and restores the CUDA generator's state, which a capture cannot read");
    require(c_.model.moe.experts == 0, "model.moe.experts",
            why +
                ": a mixture of experts routes tokens in shapes known only at run time "
                "(model.moe.experts " +
                std::to_string(c_.model.moe.experts) + ")");
  }

  std::string betas_text() const {
    std::string s = "[";
    for (double b : c_.training.optimizer.betas) s += (s.size() > 1 ? ", " : "") + fmt_double(b);
    return s + "]";
  }
  Config& c_;
  bool eod_checked_ = false;  // check_eod_token ran (document_mask and eod_mask_loss share it)
  const std::map<std::string, int>& lines_;
  std::vector<std::string> errors_;
};

}  // namespace

void check_rules(Config& c, const std::map<std::string, int>& lines) {
  Validator v(c, lines);
  v.run();
}

}  // namespace tessel::plan
