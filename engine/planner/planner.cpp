#include "engine/planner/planner.h"

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>

#include "core/kernels/attention_cpu.h"
#include "core/kernels/document_attention.h"
#include "core/optim/optim.h"
#include "engine/planner/basis.h"
#include "engine/planner/figures.h"
#include "models/from_plan.h"
#include "models/moe.h"
#include "models/recompute.h"
#include "models/registry.h"
#include "parallel/cp/attention.h"
#include "parallel/pp/schedule.h"
#include "parallel/tp/head_loss.h"

namespace tessel::planner {
namespace {

const std::map<std::string, DeviceProfile>& builtin_profiles() {
  // Dense peaks from NVIDIA's datasheets (SXM); NVLink per GPU one way (H100/H200: 900 GB/s
  // both ways; A100: 600); NICs: ConnectX-7 400 Gb/s, ConnectX-6 200 Gb/s, one per GPU.
  // H100 PCIe and H100 NVL (datasheets, dense bf16: 756 and 835 TFLOP/s; fp32: 51 and 60;
  // 80 and 94 GB): their NVLink bridges join pairs only, so the rest of a node talks over PCIe
  // Gen5 x16 (64 GB/s one way). Dense fp8: 1978.9 (H100/H200 SXM), 1513 (PCIe), 1671 (NVL);
  // the A100 has no float8 tensor cores.
  static const std::map<std::string, DeviceProfile> p = {
      {"h100", {"h100", 989.4, 66.9, 1978.9, 450, 50, 8, 80, 0.5}},
      {"h100-pcie", {"h100-pcie", 756, 51, 1513, 64, 50, 8, 80, 0.5}},
      {"h100-nvl", {"h100-nvl", 835, 60, 1671, 64, 50, 8, 94, 0.5}},
      {"h200", {"h200", 989.4, 66.9, 1978.9, 450, 50, 8, 141, 0.5}},
      {"a100", {"a100", 312, 19.5, 0, 300, 25, 8, 80, 0.5}},
  };
  return p;
}

}  // namespace

double matmul_peak_tflops(const DeviceProfile& d, const plan::TrainingConfig& t) {
  return t.fp8 != plan::Fp8::kOff && !d.cpu ? d.fp8_tflops : dtype_peak_tflops(d, t);
}

double dtype_peak_tflops(const DeviceProfile& d, const plan::TrainingConfig& t) {
  if (d.cpu) return d.peak_tflops;  // measured in the plan's dtype
  if (t.dtype != plan::Dtype::kFp32) return d.peak_tflops;
  return t.tf32 ? d.peak_tflops / 2 : d.fp32_tflops;
}

std::string matmul_peak_name(const plan::TrainingConfig& t) {
  if (t.fp8 != plan::Fp8::kOff) return "dense fp8 (training.fp8)";
  if (t.dtype != plan::Dtype::kFp32) return "dense " + t.dtype.name();
  return t.tf32 ? "dense TF32 (fp32 matmuls on tensor cores: training.tf32)" : "fp32";
}

const DeviceProfile* profile_of_gpu(const std::string& cuda_name) {
  // CUDA's names: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", ...:
  // the specific forms before the bare model.
  static const std::pair<const char*, const char*> kByName[] = {{"H200", "h200"},
                                                                {"H100 PCIe", "h100-pcie"},
                                                                {"H100 NVL", "h100-nvl"},
                                                                {"H100", "h100"},
                                                                {"A100", "a100"}};
  for (const auto& [key, profile] : kByName)
    if (cuda_name.find(key) != std::string::npos) return &builtin_profiles().at(profile);
  return nullptr;
}

namespace {

std::string builtin_profile_names() {
  std::string names;
  for (const auto& [name, _] : builtin_profiles()) names += (names.empty() ? "" : ", ") + name;
  return names;
}

// The device profile's keys, declared once: what each sets, and its bound beyond "a positive
// number". The YAML file, --profile-set and the unknown-key message read this table.
struct ProfileKey {
  const char* key;
  double DeviceProfile::*number;  // null: a text (name) or a whole number (gpus_per_node)
  const char* bound;              // extra rule, in words; empty: none
};
const std::vector<ProfileKey>& profile_keys() {
  static const std::vector<ProfileKey> k{
      {"name", nullptr, ""},
      {"peak_tflops", &DeviceProfile::peak_tflops, ""},
      {"fp32_tflops", &DeviceProfile::fp32_tflops, ""},
      {"fp8_tflops", &DeviceProfile::fp8_tflops, ""},
      {"intra_node_gbps", &DeviceProfile::intra_node_gbps, ""},
      {"inter_node_gbps", &DeviceProfile::inter_node_gbps, ""},
      {"gpus_per_node", nullptr, "a whole number"},
      {"memory_gib", &DeviceProfile::memory_gib, ""},
      {"efficiency", &DeviceProfile::efficiency, "a fraction of the peak (0 < efficiency <= 1)"},
      {"attention_tflops", &DeviceProfile::attention_tflops, ""},
      {"activation_ns", &DeviceProfile::activation_ns, ""},
      {"memory_gbps", &DeviceProfile::memory_gbps, ""},
      {"latency_us", &DeviceProfile::latency_us, ""},
      {"gather_gbps", &DeviceProfile::gather_gbps, ""},
      {"p2p_gbps", &DeviceProfile::p2p_gbps, ""},
      {"op_us", &DeviceProfile::op_us, ""},
      {"nccl_peer_mib", &DeviceProfile::nccl_peer_mib, ""}};
  return k;
}

void set_field(DeviceProfile& d, const std::string& key, const std::string& value,
               const std::string& where) {
  const auto& keys = profile_keys();
  const auto it =
      std::find_if(keys.begin(), keys.end(), [&](const ProfileKey& k) { return key == k.key; });
  if (it == keys.end()) {
    std::string names = "name, base";
    for (const auto& k : keys)
      if (std::string(k.key) != "name") names += std::string(", ") + k.key;
    throw plan::UserError(where + ": unknown device profile key '" + key + "' (keys: " + names +
                          ")");
  }
  if (key == "name") {
    d.name = value;
    return;
  }
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(value, &used);
    if (used != value.size() || v <= 0) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw plan::UserError(where + ": " + key + " must be a positive number, not '" + value + "'");
  }
  if (key == "gpus_per_node") {
    if (v != std::floor(v))
      throw plan::UserError(where + ": gpus_per_node must be a whole number, not '" + value + "'");
    d.gpus_per_node = static_cast<int64_t>(v);
    return;
  }
  if (key == "efficiency" && v > 1)
    throw plan::UserError(where + ": efficiency is " + it->bound + ", not '" + value + "'");
  d.*(it->number) = v;
}

// Do `ranks` (a group's, ascending) share a node?
bool within_node(const std::vector<int64_t>& ranks, int64_t gpus_per_node) {
  if (ranks.size() < 2) return true;
  return ranks.front() / gpus_per_node == ranks.back() / gpus_per_node;
}

}  // namespace

DeviceProfile device_profile(const std::string& spec, const std::vector<std::string>& overrides) {
  const auto& builtin = builtin_profiles();
  DeviceProfile d = builtin.at("h100");
  if (builtin.count(spec)) {
    d = builtin.at(spec);
  } else if (!spec.empty()) {
    if (!std::filesystem::is_regular_file(spec))
      throw plan::UserError("--device-profile '" + spec + "': neither a built-in profile (" +
                            builtin_profile_names() + ", cpu) nor a YAML file");
    YAML::Node y;
    try {
      y = YAML::LoadFile(spec);
    } catch (const YAML::Exception& e) {
      throw plan::UserError(spec + ": " + e.what());
    }
    if (y["base"]) {
      const auto base = y["base"].as<std::string>();
      if (!builtin.count(base))
        throw plan::UserError(spec + ": base '" + base + "' is not a built-in profile (" +
                              builtin_profile_names() + ")");
      d = builtin.at(base);
    }
    d.name = std::filesystem::path(spec).stem().string();
    for (const auto& kv : y) {
      const auto key = kv.first.as<std::string>();
      if (key != "base") set_field(d, key, kv.second.as<std::string>(), spec);
    }
  }
  apply_profile_overrides(d, overrides);
  return d;
}

void apply_profile_overrides(DeviceProfile& d, const std::vector<std::string>& overrides) {
  for (const auto& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos)
      throw plan::UserError("--profile-set '" + o + "': expected key=value");
    set_field(d, o.substr(0, eq), o.substr(eq + 1), "--profile-set");
  }
}

namespace {

// Bytes per token that Tessel's short-sequence CPU attention holds for backward beyond what
// SDPA's kernels would (its declaration, core/kernels/attention_cpu.h), where the plan runs it:
// Tessel's kernels, no context parallelism. Under a document mask too: a sample that is one
// document holds them all (the peak any step may meet, not the first samples' mean).
double short_attention_bytes(const plan::Config& c, const plan::Layout& l,
                             const models::ModelShape& m, torch::ScalarType dtype,
                             bool own_kernels) {
  if (!own_kernels || l.cp > 1) return 0;
  return kernels::short_attention_kept_bytes(dtype, c.training.seq_len, m.heads / l.tp);
}

// One micro-batch's saved activations in one block (b.per_layer) and in one MoE layer.
// fp32 document masking on CUDA (efficient-varlen) keeps a log-sum-exp row per document and head
// as long as the longest document (core/kernels/document_attention.h): with many short documents
// and one long one, far more than a value per token. Counted from the documents of the first
// samples (planner/documents.h), the measured mean per sample and the longest.
double masked_lse_bytes(const PlanBasis& b, const plan::Config& c, const plan::Layout& l) {
  if (b.cpu || !c.data.document_mask || b.dtype != torch::kFloat32 || b.docs.samples == 0 ||
      c.training.recompute == plan::Recompute::kFull)
    return 0;
  const auto documents = static_cast<int64_t>(
      std::ceil(b.docs.per_sample * static_cast<double>(c.training.micro_batch)));
  return kernels::document_lse_bytes(documents, b.m.heads / l.tp, b.docs.longest);
}

void add_layer_bytes(PlanBasis& b, const plan::Config& c, const plan::Layout& l) {
  const auto& t = c.training;
  const auto& m = b.m;
  const auto& a = b.a;
  const double w = b.w, tok = b.tok, h = b.h, tp = b.tp, kvd = b.kvd;
  const bool sp = b.sp;
  const double block_tokens_floats = a.replicated * h / (sp ? tp : 1.0) +
                                     (a.attn * h + a.kv * kvd + a.ffn * m.ffn_hidden) / tp +
                                     sp_gathered_floats(t.recompute, h, tp, sp);
  // One micro-batch through one block: its saved activations and its cp method's
  // (parallel/cp/bytes.h).
  b.per_layer =
      w * tok * block_tokens_floats +
      parallel::cp::kept_bytes(c.parallel.context_method, attention_size(c, l, b)) +
      (t.recompute == plan::Recompute::kFull ? 0.0 : b.short_attention * tok) +
      (t.recompute != plan::Recompute::kNone && b.cpu ? models::piece_rng_state_bytes() : 0.0) +
      masked_lse_bytes(b, c, l);
  if (m.moe.experts > 0) {
    // An MoE layer keeps its routed tokens' tensors (MoeImpl::routed_kept) and its shared
    // experts' as an MLP's; recomputation reruns it (like the MLP).
    const auto& e = m.moe;
    const double routed =
        t.recompute == plan::Recompute::kNone ? models::MoeImpl::routed_kept(b.parts, w) : 0.0;
    const double f = static_cast<double>(e.ffn_hidden);
    const double shared = a.ffn * static_cast<double>(e.shared) * f / tp;
    b.per_moe_layer = b.per_layer + w * tok / (sp ? tp : 1.0) * routed + w * tok * shared -
                      w * tok * a.ffn * static_cast<double>(m.ffn_hidden) / tp;
  }
}

// A schedule's simulation, once per shape: the layout search asks for the same one for every
// ZeRO stage and sharding it tries (the simulation is most of a search's time: 128 micro-batches
// of an interleaved schedule on 4 stages take milliseconds).
parallel::pp::Simulation simulated(plan::PipelineSchedule kind, int64_t pp, int64_t mbs,
                                   int64_t v) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int64_t, int64_t>, parallel::pp::Simulation> known;
  const auto key = std::make_tuple(static_cast<int>(kind), pp, mbs, v);
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  return known[key] = parallel::pp::simulate(parallel::pp::make_schedule(kind, pp, mbs, v));
}

PlanBasis plan_basis(const plan::Config& c, const plan::Layout& l, bool cpu) {
  namespace pp = parallel::pp;
  const auto& t = c.training;
  PlanBasis b;
  const auto& m = b.m = models::model_shape(c.model);
  b.parts = models::features(m);
  b.dtype = models::resolve_dtype(t.dtype);
  const double w = b.w = static_cast<double>(c10::elementSize(b.dtype));
  const bool sp = b.sp = c.parallel.sequence_parallel && l.tp > 1;
  b.mbs = t.global_batch / (l.dp * t.micro_batch);
  const double tok = b.tok =
      static_cast<double>(t.micro_batch * t.seq_len) / static_cast<double>(l.cp);
  const double h = b.h = static_cast<double>(m.hidden), tp = b.tp = static_cast<double>(l.tp);
  b.kvd = static_cast<double>(m.kv_heads * m.head_dim());
  b.docs = document_figures(c);
  b.vocab_local = std::ceil(static_cast<double>(m.vocab_size) / tp);
  b.cpu = cpu;
  b.own_kernels = cpu && t.kernels == plan::Kernels::kTessel && b.dtype == torch::kFloat32;
  b.fp8 = t.fp8 != plan::Fp8::kOff;
  b.threads = t.threads > 0 ? t.threads : int64_t{at::get_num_threads()};
  b.lanes = plan::pairs_microbatches(c, l.world(), !cpu, b.threads) ? 2 : 1;
  b.a = activation_model(b.parts, t.recompute, b.own_kernels, b.cpu, w);
  b.short_attention = short_attention_bytes(c, l, m, b.dtype, b.own_kernels);
  const auto kind = l.pp > 1 ? plan::PipelineSchedule(c.parallel.pipeline_schedule)
                             : plan::PipelineSchedule::kGpipe;
  b.sim = simulated(kind, l.pp, b.mbs, c.parallel.virtual_stages);
  b.act_row = tok * h * w / (sp ? tp : 1.0);
  b.sharding = plan::sharding(c), b.data_ranks = l.dp * l.cp, b.pp = l.pp;
  b.keep_gathered = c.parallel.zero3_keep_gathered, b.split = plan::zero_split(c, l);
  b.block = static_cast<double>(models::block_parameters(m, l.tp));
  add_layer_bytes(b, c, l);
  return b;
}

// The model FLOPs of a step and the forward work recomputation reruns on top of them: the parts'
// declarations (models/flops.h), which the run's MFU adds up too.
void add_step_flops(PlanEstimate& e, const PlanBasis& b, const plan::TrainingConfig& t) {
  using models::DecoderImpl;
  e.params_total = models::parameters_on_rank(b.m, 1, {});
  const auto tokens = static_cast<double>(t.global_batch * t.seq_len);
  const auto flops = DecoderImpl::flops(b.parts, t.seq_len, b.docs.share);
  e.flops_per_step = flops.train * tokens;
  e.fp8_flops_per_step = t.fp8 != plan::Fp8::kOff ? flops.linear * tokens : 0.0;
  e.recompute_flops_per_step =
      DecoderImpl::rerun_flops(b.parts, t.recompute, t.seq_len, b.docs.share) * tokens;
  // Attention's own matmuls, of which a document mask keeps a share.
  e.attention_share = b.docs.share, e.document_samples = b.docs.samples;
  e.document_eod = b.docs.eod, e.document_unread = b.docs.unread;
  e.attention_flops_saved_per_step = (1 - b.docs.share) * static_cast<double>(b.m.layers) *
                                     models::AttentionImpl::core_flops(b.parts, t.seq_len).train *
                                     tokens;
}

// CPU step constants (cpu_compute_s; a block's host operators are its own declaration,
// models::BlockImpl::host_ops): element-wise passes over a block's [tokens, hidden], over the
// logits, and over the optimizer's fp32 state.
constexpr double kBlockPasses = 20, kHeadPasses = 8, kOptimizerPasses = 12;
// Operators one more document adds to a block's attention (narrows, the call, the join; forward
// and backward), from CPU fp32 runs of 32-token samples cut into ~5 documents (2026-11-28).
constexpr double kDocumentOps = 8;

parallel::GroupKind group_kind(const std::string& name) {
  return name == "tp"       ? parallel::GroupKind::kTp
         : name == "cp"     ? parallel::GroupKind::kCp
         : name == "pp"     ? parallel::GroupKind::kPp
         : name == "dp_cp"  ? parallel::GroupKind::kDpCp
         : name == "ep"     ? parallel::GroupKind::kEp
         : name == "edp_cp" ? parallel::GroupKind::kEdpCp
                            : parallel::GroupKind::kEmbedding;
}

// The part of a stage's communication time that its `compute` does not hide. Records each
// group's bytes on `r` and its link time on `e` (the slowest stage's).
double exposed_comm_s(const std::map<std::string, Traffic>& g, double compute,
                      const plan::Layout& l, const DeviceProfile& dev, const PlanBasis& b,
                      RankEstimate& r, PlanEstimate& e) {
  double exposed = 0;
  for (const auto& [name, traffic] : g) {
    r.comm[name] = traffic.bytes();
    if (traffic.replica > 0) r.replica_comm[name] = traffic.replica;
    const parallel::GroupKind kind = group_kind(name);
    // The first group of the kind carries its bytes; under hybrid sharding its first shard group
    // the buckets' and its first replica group the pieces' sums, each on its own link.
    auto ranks = parallel::group_ranks(kind, l)[0];
    double replica_s = 0;
    if (traffic.replica > 0) {
      auto split = parallel::split_ranks(
          ranks, kind == parallel::GroupKind::kEdpCp ? b.split.expert_shards : b.split.shards);
      ranks = split.inner[0];
      const double n = static_cast<double>(split.outer[0].size());
      replica_s = 2 * (n - 1) / n * traffic.replica /
                  ((within_node(split.outer[0], dev.gpus_per_node) ? dev.intra_node_gbps
                                                                   : dev.inter_node_gbps) *
                   1e9);
    }
    const int64_t n = static_cast<int64_t>(ranks.size());
    const double gbps =
        within_node(ranks, dev.gpus_per_node) ? dev.intra_node_gbps : dev.inter_node_gbps;
    const double s = traffic.ops * dev.latency_us * 1e-6 + traffic.wire(n, gbps, dev) + replica_s;
    e.comm_s[name] = std::max(e.comm_s[name], s);
    if (dev.cpu) {  // every core computes: Gloo's threads take their time from the step
      exposed += s;
      continue;
    }
    // tp, cp and pipeline transfers sit on the critical path; data-parallel reductions overlap
    // backward (about 2/3 of compute), ZeRO-1/2's weight all-gather after the step does not.
    if (name == "dp_cp" || name == "edp_cp") {
      // After backward, and so never hidden: ZeRO-1's sums over the replicas (hybrid sharding;
      // ZeRO-2/3 start each as its bucket completes, during backward); ZeRO-1/2's gather of the
      // weights after the step.
      const double after_step = (b.sharding.state_only() ? replica_s : 0) +
                                (b.sharding.state && !b.sharding.weights && name == "dp_cp"
                                     ? b.w * static_cast<double>(r.params) / (gbps * 1e9)
                                     : 0);
      exposed += std::max(0.0, s - after_step - (b.sharding.weights ? 1.0 : 2.0 / 3.0) * compute) +
                 after_step;
    } else {
      exposed += s;
    }
  }
  return exposed;
}

// A stage's compute per step on a CPU profile: its matmuls at the measured rate × efficiency,
// attention at the measured SDPA rate, the MLP activation per element, the host's cost of the
// operators a block issues, and the element-wise rest (norms, residual adds, biases, the loss over
// the logits, the optimizer) as passes over their tensors at the measured bandwidth. Operators and
// passes per block were counted on CPU fp32 runs of gpt2 and llama (2026-11-25, planner_test's
// StepTime checks the result on five layouts).
std::map<std::string, double> cpu_compute_s(const plan::Config& c, const PlanBasis& b,
                                            const RankEstimate& r, const models::StagePart& part,
                                            const DeviceProfile& d) {
  const auto& t = c.training;
  const auto& m = b.m;
  const bool full = t.recompute == plan::Recompute::kFull;
  const double micro = static_cast<double>(b.mbs), tokens = micro * b.tok;
  const double layers = static_cast<double>(r.layers), h = b.h, tp = b.tp;
  const double mlp =
      models::MlpImpl::weight_matrices(b.parts) * h * static_cast<double>(m.ffn_hidden) / tp;
  const double rerun = full ? b.block : t.recompute == plan::Recompute::kSelective ? mlp : 0.0;
  const double head = part.last ? b.vocab_local * h : 0.0;
  const double matmul = (6 * (layers * b.block + head) + 2 * layers * rerun) * tokens /
                        (d.peak_tflops * 1e12 * d.efficiency);
  const double attention = 12 * layers * static_cast<double>(m.heads) / tp *
                           static_cast<double>(m.head_dim() * t.seq_len) * tokens *
                           (full ? 4.0 / 3 : 1.0) * b.docs.share /
                           // never faster than the matmul peak MFU is measured against (a pinned
                           // peak below the measured attention rate would put MFU over 100%)
                           (std::min(d.attention_tflops, d.peak_tflops * d.efficiency) * 1e12);
  const double activation = layers * tokens * static_cast<double>(m.ffn_hidden) / tp *
                            d.activation_ns * 1e-9 * (rerun > 0 ? 1.5 : 1.0);
  const double block_ops = models::BlockImpl::host_ops(b.parts, b.own_kernels);
  // A document mask's CPU attention is a call per document: about kDocumentOps operators more
  // for each document after a sample's first, forward and backward.
  const double doc_ops =
      kDocumentOps * (b.docs.per_sample - 1) * static_cast<double>(t.micro_batch);
  const double ops = (block_ops * (full ? 1.4 : 1.0) + doc_ops) * layers * micro;
  const double state = static_cast<double>(r.params) / static_cast<double>(b.split.shards);
  const double bytes = kBlockPasses * layers * tokens * h * b.w / (b.sp ? tp : 1.0) +
                       kHeadPasses * tokens * (part.last ? b.vocab_local : 0.0) * 4 +
                       kOptimizerPasses * state * 4;
  return {{"matmul", matmul},
          {"attention", attention},
          {"activation", activation},
          {"operators", ops * d.op_us * 1e-6},
          {"element-wise", bytes / (d.memory_gbps * 1e9)}};
}

}  // namespace

PlanEstimate estimate(const plan::Config& c, const plan::Layout& l, const DeviceProfile& dev) {
  const auto& t = c.training;
  // Where the run computes decides its kernels, whichever device the figures are predicted on.
  const plan::TrainDevice device = c.training.device;
  const PlanBasis b = plan_basis(
      c, l, device == plan::TrainDevice::kCpu || (device == plan::TrainDevice::kAuto && dev.cpu));
  if (t.fp8 != plan::Fp8::kOff && !dev.cpu && dev.fp8_tflops <= 0)
    throw plan::UserError(fmt::format(
        "{}: training.fp8 {}: the device profile {} has no float8 peak (fp8_tflops; an A100 has "
        "no float8 tensor cores): set training.fp8 off, or --profile-set fp8_tflops=...",
        c.source, t.fp8.name(), dev.name));
  PlanEstimate e;
  e.world = l.world();
  add_step_flops(e, b, t);
  for (int64_t stage = 0; stage < l.pp; ++stage) {
    const auto part = models::stage_part(c, l.pp, stage);
    RankEstimate r = stage_memory(c, l, b, stage, part);
    const auto buffers = communicator_buffers(c, l, stage, dev);
    r.comm_buffers = buffers.bytes, r.communicators = buffers.communicators,
    r.peers = buffers.peers;
    const auto traffic = stage_traffic(c, l, b, r, part);
    // Time on the device profile: this stage's compute, its communication on the group's link.
    // On a GPU the float8 matmuls at the fp8 peak, the rest at the dtype's.
    const double peak = dtype_peak_tflops(dev, t) * 1e12 * dev.efficiency;
    const double fp8 = dev.cpu ? 0.0 : e.fp8_flops_per_step;
    std::map<std::string, double> parts;
    if (dev.cpu) parts = cpu_compute_s(c, b, r, part, dev);
    double compute = ((e.flops_per_step + e.recompute_flops_per_step - fp8) / peak +
                      (fp8 > 0 ? fp8 / (dev.fp8_tflops * 1e12 * dev.efficiency) : 0.0)) /
                     static_cast<double>(e.world);
    if (dev.cpu) {
      compute = 0;
      for (const auto& [what, s] : parts) compute += s;
    }
    // Plus, on every step, the world's all-reduce of the gradient norm and stop votes, and on
    // logged steps the loss's over the pipeline and data groups (latency only: a few bytes).
    const double small =
        e.world > 1 ? 1.0 + 2.0 / static_cast<double>(std::max<int64_t>(1, c.logging.every)) : 0.0;
    const double exposed =
        exposed_comm_s(traffic, compute, l, dev, b, r, e) + small * dev.latency_us * 1e-6;
    if (stage == 0 || compute + exposed > e.compute_s + e.comm_exposed_s) {
      e.compute_s = compute;
      e.comm_exposed_s = exposed;
      e.compute_parts = parts;
    }
    e.ranks.push_back(std::move(r));
  }
  e.bubble_s = l.pp > 1 ? e.compute_s * b.sim.bubble : 0.0;
  e.step_s = e.compute_s + e.comm_exposed_s + e.bubble_s;
  e.tokens_per_s = static_cast<double>(t.global_batch * t.seq_len) / e.step_s;
  e.mfu = e.flops_per_step / e.step_s / static_cast<double>(e.world) /
          (matmul_peak_tflops(dev, t) * 1e12);
  return e;
}

}  // namespace tessel::planner
