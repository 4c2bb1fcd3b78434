// The --dry-run planner: what a plan costs on each rank, from the plan alone (nothing is built,
// so it sizes 8B models on this machine). Memory and communication figures follow this
// implementation's own buffers and collectives; tests/dist/planner_test.py runs small plans and
// compares them with the measured counters in memory.json (engine/run/step_counters.h).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/plan/config.h"
#include "parallel/mesh.h"

namespace tessel::planner {

/// A device for the step-time prediction. Built in: h100, h200, a100 (SXM, dense bf16 peaks;
/// NVLink per-GPU one-way bandwidth; one 400 Gb/s (H100/H200) or 200 Gb/s (A100) NIC per GPU),
/// h100-pcie and h100-nvl (their own peaks; PCIe between GPUs of a node).
struct DeviceProfile {
  std::string name;
  double peak_tflops = 0;      // dense, in the plan's dtype (bf16/fp16; fp32 uses fp32_tflops)
  double fp32_tflops = 0;      // without TF32
  double fp8_tflops = 0;       // dense float8 (training.fp8); 0: none (A100, CPUs)
  double intra_node_gbps = 0;  // GB/s per GPU inside a node (NVLink)
  double inter_node_gbps = 0;  // GB/s per GPU between nodes
  int64_t gpus_per_node = 8;
  double memory_gib = 0;
  double efficiency = 0.5;  // share of the peak the matmuls reach (MFU of the compute alone)
  // A CPU profile (measure_cpu_profile, engine/planner/cpu_profile.h) times the rest of the step
  // too; the GPU profiles leave these 0 and time a step by its matmuls.
  bool cpu = false;
  int64_t threads = 0;          // per rank, what the rates were measured on
  double attention_tflops = 0;  // SDPA forward + backward, counted as 12·H·Q·T per token
  double activation_ns = 0;     // the MLP activation's forward + backward, per element
  double memory_gbps = 0;       // an element-wise add: bytes read and written per second
  double latency_us = 0;        // added to every collective and transfer
  double op_us = 0;             // the host's cost of one small operator, forward and backward
  double gather_gbps = 0;       // all-gather and reduce-scatter (0: the group's link)
  double p2p_gbps = 0;          // send/receive (0: the group's link)
  double nccl_peer_mib = 384;   // an NCCL communicator's buffers per peer it connects to
                                // (engine/planner/comm_buffers.cpp says where from)
};
/// The dense peak a plan's matmuls run at in its dtype: bf16/fp16 on tensor cores; fp32 as TF32
/// (half the bf16 peak) when training.tf32, else plain fp32.
double dtype_peak_tflops(const DeviceProfile& d, const plan::TrainingConfig& t);
/// The one peak MFU is measured against, by the step time and the run alike: the dtype's, or
/// under training.fp8 on a GPU the float8 peak (its blocks' linear layers run at it, the rest of
/// the step at the dtype's).
double matmul_peak_tflops(const DeviceProfile& d, const plan::TrainingConfig& t);
/// Which peak that is, in words ("dense bf16", "dense TF32 (training.tf32)", "fp32").
std::string matmul_peak_name(const plan::TrainingConfig& t);
/// The built-in profile of a GPU by its CUDA name ("NVIDIA H100 80GB HBM3" -> h100), or null.
const DeviceProfile* profile_of_gpu(const std::string& cuda_name);

/// `spec`: a built-in name, or a YAML file with the fields above (any subset, over `base`, a
/// built-in name, default h100); then `overrides` (key=value).
DeviceProfile device_profile(const std::string& spec, const std::vector<std::string>& overrides);
/// `overrides` (key=value, the YAML file's keys) on `d`; a UserError names a bad one.
void apply_profile_overrides(DeviceProfile& d, const std::vector<std::string>& overrides);

struct RankEstimate {
  int64_t stage = 0;                             // pipeline rank
  int64_t params = 0;                            // elements held (tp shards of this stage's layers)
  int64_t layers = 0;                            // transformer blocks held
  double weights = 0, grads = 0, optimizer = 0;  // bytes between steps
  double activations = 0;  // bytes a step adds at its peak (saved activations, logits, buffers)
  double gathered = 0;     // ZeRO-3: gathered units at the peak (part of `activations`' peak)
  int64_t inflight = 0;    // micro-batches whose activations are held at once
  std::map<std::string, double> comm;          // group -> payload bytes per step (this rank)
  std::map<std::string, double> replica_comm;  // of comm, hybrid sharding's sums over replicas
  double comm_buffers = 0;                     // NCCL communicators' own buffers (device)
  int64_t communicators = 0, peers = 0;        // those holding them, and the peers they connect
  double total() const { return weights + grads + optimizer + activations + comm_buffers; }
};

/// Whether the plan's ranks talk over NCCL on `dev` (parallel.backend, or auto on a GPU).
bool uses_nccl(const plan::Config& c, const DeviceProfile& dev);
/// The device memory a stage's first rank's NCCL communicators keep for themselves
/// (engine/planner/comm_buffers.cpp): those Mesh::plan lists, by the peers each connects to.
struct CommBuffers {
  int64_t communicators = 0, peers = 0;
  double bytes = 0;
};
CommBuffers communicator_buffers(const plan::Config& c, const plan::Layout& l, int64_t stage,
                                 const DeviceProfile& dev);

struct PlanEstimate {
  int64_t world = 0, params_total = 0;
  double flops_per_step = 0;  // model FLOPs of the global batch (PaLM convention, as metrics)
  double recompute_flops_per_step = 0;  // the forward work recomputation reruns (not in MFU)
  double fp8_flops_per_step = 0;        // of flops_per_step, in float8 matmuls (training.fp8)
  // data.document_mask: the share of causal attention work kept (measured on the first training
  // samples; flops_per_step counts that share of the attention term), and the FLOPs it saves.
  double attention_share = 1, attention_flops_saved_per_step = 0;
  int64_t document_samples = 0;     // the samples the share was measured on
  int64_t document_eod = -1;        // the id documents end with
  std::string document_unread;      // why the share could not be measured (no data here)
  std::vector<RankEstimate> ranks;  // one per pipeline stage (tp/dp/cp peers are alike)
  // Step time on the device profile (seconds): compute, exposed communication, bubble.
  double compute_s = 0, comm_exposed_s = 0, bubble_s = 0, step_s = 0;
  std::map<std::string, double> comm_s;         // per group, the time its bytes take on their links
  std::map<std::string, double> compute_parts;  // a CPU profile's compute, by kind (seconds)
  double tokens_per_s = 0, mfu = 0;
};

PlanEstimate estimate(const plan::Config& c, const plan::Layout& l, const DeviceProfile& d);

/// A layout of the same model, batch and recomputation on the same world, and its figures.
struct LayoutChoice {
  plan::Config plan;  // the plan with its parallel keys (and micro_batch) changed
  plan::Layout layout;
  PlanEstimate estimate;
  std::vector<std::string> sets;  // the --set overrides that turn the plan into this one
};
/// The fastest layout by the planner's own figures among tp, cp, pp (1F1B or interleaved), dp
/// and ZeRO stages that the checks accept and that fit the device's memory (90%); nullopt when
/// none is at least `margin` (0.1 = 10%) faster than `current`.
std::optional<LayoutChoice> faster_layout(const plan::Config& c, int64_t world,
                                          const DeviceProfile& d, const PlanEstimate& current,
                                          double margin = 0.1);

/// One hybrid sharding choice (parallel.zero_shard `shards`; `whole`: the whole data group, as
/// zero_shard 1): the largest memory per rank of any stage, the data groups' bytes per step on
/// a rank inside its shard group and across the replicas, the step time, whether a shard group
/// stays inside a node, whether the memory fits the device (90%), and the best of them.
struct ShardChoice {
  int64_t shards = 0;
  bool whole = false;
  double peak_bytes = 0, inside_bytes = 0, across_bytes = 0, step_s = 0;
  bool in_node = false, fits = true, best = false;
};
/// Every shard size a ZeRO plan's layout accepts (the divisors of dp·cp from 2 that ep divides),
/// each estimated on `d`; the best is the fastest that fits (within 1%, the larger shard
/// group), else the one that holds least. Empty without ZeRO or data parallelism.
std::vector<ShardChoice> zero_shard_choices(const plan::Config& c, const plan::Layout& l,
                                            const DeviceProfile& d);

/// Human-readable lines for --dry-run ("# ..."), and the same figures as JSON.
std::string render(const PlanEstimate& e, const plan::Config& c, const DeviceProfile& d);

/// What --dry-run prints, whole: `plan` resolved against `layout` for `world` processes, its
/// estimate on `device`, the faster layout when there is one, and with `details` the resolved
/// plan and the rank grid.
struct DryRun {
  const plan::Config& plan;
  const std::string& plan_path;
  const plan::Layout& layout;
  int64_t world;
  const DeviceProfile& device;
  const PlanEstimate& estimate;
  const std::optional<LayoutChoice>& faster;
  bool details;
};
std::string dry_run_report(const DryRun& r);
std::string to_json(const PlanEstimate& e, const DeviceProfile& d);

/// The byte figures --dry-run predicts for this plan and layout, per pipeline stage (weights,
/// gradients, optimizer state, step activation peak, bytes per group per step): what the trainer
/// writes beside its measured counters in memory.json ("predicted"), so that every run checks
/// the planner against itself: `--dry-run --world-size N`'s figures (the h100 profile; its rates
/// do not enter bytes).
nlohmann::json predicted_bytes(const plan::Config& c, const plan::Layout& l);

}  // namespace tessel::planner
