// --dry-run's report, rendered here only: what matters first (valid or not, memory, step time,
// tokens/s, MFU, a faster layout), the state per rank, the pipeline's and context parallelism's
// particulars, and with --details the resolved plan and the rank grid; and the JSON written.
#include <fmt/format.h>
#include <fmt/printf.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "engine/data/dataset.h"
#include "engine/planner/documents.h"
#include "engine/planner/planner.h"
#include "models/from_plan.h"
#include "models/registry.h"
#include "parallel/mesh.h"
#include "parallel/pp/schedule.h"

namespace tessel::planner {

namespace {

// A CPU profile's measured rates, one line.
std::string cpu_line(const DeviceProfile& d) {
  return fmt::format(
      "# this CPU, measured now on {} thread{} per rank: matmul {:.1f} GFLOP/s ({:.0f}% counted), "
      "attention {:.1f} GFLOP/s, MLP activation {:.2f} ns per element, {:.1f} us per operator, "
      "memory {:.1f} GB/s{}\n",
      d.threads, d.threads == 1 ? "" : "s", 1e3 * d.peak_tflops, 100 * d.efficiency,
      1e3 * d.attention_tflops, d.activation_ns, d.op_us, d.memory_gbps,
      d.latency_us > 0
          ? fmt::format("; Gloo over loopback {:.0f} us per collective, all-reduce {:.2f} GB/s, "
                        "all-gather {:.2f} GB/s, send/receive {:.2f} GB/s",
                        d.latency_us, d.intra_node_gbps, d.gather_gbps, d.p2p_gbps)
          : "");
}

// The device in brief: a GPU's datasheet, or (cpu_line has the rest) this CPU's matmul rate.
std::string device_brief(const DeviceProfile& d, const plan::Config& c) {
  if (d.cpu)
    return fmt::format("cpu ({:.3g} TFLOP/s {} measured, {} rank{} here)",
                       matmul_peak_tflops(d, c.training), c.training.dtype.name(), d.gpus_per_node,
                       d.gpus_per_node == 1 ? "" : "s");
  return fmt::format(
      "{} ({:.0f} TFLOP/s {} peak at {:.0f}% efficiency, {} GB/s in a node, {} GB/s between "
      "nodes, {} per node)",
      d.name, matmul_peak_tflops(d, c.training), matmul_peak_name(c.training), 100 * d.efficiency,
      d.intra_node_gbps, d.inter_node_gbps, d.gpus_per_node);
}

// Bytes with a binary unit: 512 B, 1.50 KiB, 6.15 GiB.
std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  for (; b >= 1024 && u < 4; ++u) b /= 1024;
  return fmt::format("{:.{}f} {}", b, u == 0 ? 0 : 2, units[u]);
}

// --dry-run: what each rank will keep for the run, from the plan alone (the estimate's state
// bytes per stage: nothing is built).
std::string state_bytes(const plan::Config& c, const plan::Layout& l, const PlanEstimate& e) {
  const auto zero = plan::sharding(c);
  const int64_t data_ranks = l.dp * l.cp;
  const auto split = plan::zero_split(c, l);
  const double w = static_cast<double>(c10::elementSize(models::resolve_dtype(c.training.dtype)));
  std::string out = fmt::sprintf(
      "# state per rank, ZeRO %lld over %lld data rank%s%s, %s (activations not included):\n",
      static_cast<long long>(zero.stage()),
      static_cast<long long>(zero.state ? split.shards : data_ranks),
      (zero.state ? split.shards : data_ranks) == 1 ? "" : "s",
      split.hybrid() ? fmt::format(" ({} replicas: parallel.zero_shard)", split.replicas) : "",
      c.training.dtype.name().c_str());
  for (const auto& r : e.ranks) {
    std::string units;
    if (zero.weights) {  // the root unit stays gathered; a block, its prefetched neighbour,
                         // and briefly a third while backward crosses from one block to the next
      // Each of the stage's blocks as this rank holds it (an MoE block: E/ep experts); the root
      // unit is the rest of the rank's parameters.
      const auto m = models::model_shape(c.model);
      int64_t root = r.params, block = 0;
      for (const auto& [begin, end] : models::stage_part(c, l.pp, r.stage).chunks)
        for (int64_t i = begin; i < end; ++i) {
          const int64_t b = models::block_parameters(m, l.tp, i, l.ep);
          root -= b;
          block = std::max(block, b);
        }
      units = fmt::format("; + gathered: the root unit {} and 2-3 blocks of up to {}",
                          human_bytes(w * static_cast<double>(root)),
                          human_bytes(w * static_cast<double>(block)));
    }
    out +=
        fmt::sprintf("#   %s%lld parameters: weights %s, gradients %s, optimizer %s, total %s%s\n",
                     l.pp > 1 ? fmt::format("pipeline stage {}: ", r.stage).c_str() : "",
                     static_cast<long long>(r.params), human_bytes(r.weights).c_str(),
                     human_bytes(r.grads).c_str(), human_bytes(r.optimizer).c_str(),
                     human_bytes(r.weights + r.grads + r.optimizer).c_str(), units.c_str());
  }
  return out;
}

// --dry-run with pipeline stages: the schedule, its bubble and peak activations, the layers.
// Without `details` the schedule's timeline per rank (a line of thousands of characters on a
// real plan's micro-batches) is left out, and said to be there.
std::string pipeline_lines(const plan::Config& c, const plan::Layout& layout, bool details) {
  std::string out;
  namespace pp = parallel::pp;
  const auto& t = c.training;
  const int64_t m = t.global_batch / (layout.dp * t.micro_batch);
  auto schedule =
      pp::make_schedule(c.parallel.pipeline_schedule, layout.pp, m, c.parallel.virtual_stages);
  auto sim = pp::simulate(schedule);
  const std::string grid = pp::render(schedule, sim);
  out += details ? grid
                 : grid.substr(0, grid.find('\n') + 1) +
                       "# the schedule's timeline per rank: --details\n";
  out += fmt::sprintf(
      "# predicted bubble %.4f of ideal step time (the paper's figure for %s: %.4f); peak "
      "activations per rank:",
      sim.bubble, schedule.name.c_str(),
      pp::theory_bubble(c.parallel.pipeline_schedule, layout.pp, m, c.parallel.virtual_stages));
  for (auto a : sim.peak_activations) out += fmt::sprintf(" %lld", static_cast<long long>(a));
  out += fmt::sprintf(" micro-batch chunks (held from forward to weight gradient)\n");
  out += fmt::sprintf("# layers per stage (stage = %s): %s\n",
                      schedule.v_shape ? "chunk 0: pipeline rank r, chunk 1: 2·pp − 1 − r"
                                       : "chunk·pp + pipeline rank",
                      pp::stage_layer_counts(c.model.layers, layout.pp * c.parallel.virtual_stages,
                                             c.parallel.layers_per_stage)
                          .c_str());
  return out;
}

std::string context_parallel_lines(const plan::Config& c, const plan::Layout& layout) {
  std::string out;
  out += fmt::sprintf(
      "# context parallel: %lld ranks (%s), %lld tokens per rank per sequence (chunks "
      "r and %lld-r of %lld)\n",
      static_cast<long long>(layout.cp), c.parallel.context_method.name().c_str(),
      static_cast<long long>(c.training.seq_len / layout.cp),
      static_cast<long long>(2 * layout.cp - 1), static_cast<long long>(2 * layout.cp));
  if (c.parallel.context_method == plan::CpMethod::kHybrid)
    out += fmt::sprintf(
        "# hybrid: all-to-all inside groups of %lld consecutive cp ranks, ring across %lld "
        "groups\n",
        static_cast<long long>(c.parallel.context_alltoall_size),
        static_cast<long long>(layout.cp / c.parallel.context_alltoall_size));
  return out;
}

// A layout the planner finds faster than the plan's (`current`), and the command that plans it.
std::string faster_layout_lines(const std::string& config, int64_t n, const LayoutChoice& b,
                                const PlanEstimate& current) {
  std::string out;
  double most = 0;
  for (const auto& r : b.estimate.ranks) most = std::max(most, r.total());
  std::string sets;
  for (const auto& s : b.sets) sets += " --set " + s;
  out += fmt::sprintf(
      "# by these figures a faster layout on %lld processes: tp %lld cp %lld pp %lld dp %lld, "
      "ZeRO %lld%s%s: step %.1f ms, %.0f%% less than this plan's %.1f ms, at most %s per rank\n"
      "#   tessel-train %s --dry-run --world-size %lld%s\n",
      static_cast<long long>(n), static_cast<long long>(b.layout.tp),
      static_cast<long long>(b.layout.cp), static_cast<long long>(b.layout.pp),
      static_cast<long long>(b.layout.dp), static_cast<long long>(plan::sharding(b.plan).stage()),
      plan::sharding(b.plan).state && b.plan.parallel.zero_shard > 1
          ? fmt::format(" sharded over {} ranks", b.plan.parallel.zero_shard).c_str()
          : "",
      b.layout.pp > 1 ? (" (" + b.plan.parallel.pipeline_schedule.name() + ")").c_str() : "",
      1e3 * b.estimate.step_s, 100 * (1 - b.estimate.step_s / current.step_s), 1e3 * current.step_s,
      human_bytes(most).c_str(), config.c_str(), static_cast<long long>(n), sets.c_str());
  return out;
}

}  // namespace

namespace {

// What the data and checkpoint keys add: a document mask's attention saved, and what an
// asynchronous save holds in host memory.
std::string plan_notes(const PlanEstimate& e, const plan::Config& c) {
  std::string s;
  if (c.data.document_mask && !e.document_unread.empty())
    s += fmt::format(
        "# document mask: its attention share is measured on the data, which cannot be read "
        "here ({}): the figures below count attention whole, as without the mask\n",
        e.document_unread);
  else if (c.data.document_mask)
    s += fmt::format(
        "# document mask (data.eod_token {}): attention inside documents does {:.1f}% of a "
        "causal sequence's attention work on the first {} training samples, {:.4g} TFLOP per "
        "step fewer (not in the model FLOPs above, nor in MFU)\n",
        e.document_eod, 100 * e.attention_share, e.document_samples,
        e.attention_flops_saved_per_step / 1e12);
  if (c.checkpoint.async) {
    // A rank's part of a checkpoint: its weights, master copy and moments. In fp32 the optimizer
    // holds the moments only (the weights are the master), yet the checkpoint writes a master
    // copy too: half the moments' bytes more, sharded as they are.
    const bool fp32 = models::resolve_dtype(c.training.dtype) == c10::kFloat;
    double held = 0;
    for (const auto& r : e.ranks)
      held = std::max(held, r.weights + r.optimizer * (fp32 ? 1.5 : 1.0));
    s += fmt::format(
        "# checkpoint.async: a save holds up to {:.2f} MiB of host memory per rank (its part of "
        "the checkpoint{}) from the step it is taken until it is written\n",
        held / (1024.0 * 1024), c.training.device == plan::TrainDevice::kCpu ? "" : ", pinned");
  }
  return s;
}

}  // namespace

std::string render(const PlanEstimate& e, const plan::Config& c, const DeviceProfile& d) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024)); };
  auto mib = [](double b) { return fmt::format("{:.1f} MiB", b / (1024.0 * 1024)); };
  std::string s = fmt::format(
      "# planner: {:.4g} B parameters; {:.4g} TFLOP per step ({} tokens); training.recompute "
      "{}; dtype {}\n",
      static_cast<double>(e.params_total) / 1e9, e.flops_per_step / 1e12,
      c.training.global_batch * c.training.seq_len, c.training.recompute.name(),
      c.training.dtype.name());
  s += plan_notes(e, c);
  for (const auto& r : e.ranks) {
    s += fmt::format(
        "#   {}{} parameters, {} blocks: weights {}, gradients {}, optimizer {}, activations {} "
        "({} micro-batch{} in flight{}){} = {}{}\n",
        e.ranks.size() > 1 ? fmt::format("stage {}: ", r.stage) : "", r.params, r.layers,
        gib(r.weights), gib(r.grads), gib(r.optimizer), gib(r.activations), r.inflight,
        r.inflight == 1 ? "" : "es",
        r.gathered > 0 ? ", incl. ZeRO-3 gathered " + gib(r.gathered) : "",
        r.comm_buffers > 0
            ? fmt::format(", NCCL buffers {} ({} communicator{}, {} peer{} at {:g} MiB)",
                          gib(r.comm_buffers), r.communicators, r.communicators == 1 ? "" : "s",
                          r.peers, r.peers == 1 ? "" : "s", d.nccl_peer_mib)
            : "",
        gib(r.total()),
        d.memory_gib > 0 && r.total() > d.memory_gib * 1024 * 1024 * 1024
            ? fmt::format("  ** exceeds {}'s {} GiB **", d.name, d.memory_gib)
            : "");
    std::string comm;
    for (const auto& [name, bytes] : r.comm)
      comm += fmt::format("{}{} {}", comm.empty() ? "" : ", ", name, mib(bytes));
    if (!comm.empty()) s += "#     communication per step on this rank: " + comm + "\n";
  }
  std::string links;
  for (const auto& [name, sec] : e.comm_s)
    links += fmt::format("{}{} {:.1f} ms", links.empty() ? "" : ", ", name, 1e3 * sec);
  if (d.cpu) s += cpu_line(d);
  const std::string device = device_brief(d, c);
  s += fmt::format(
      "# predicted on {}: step {:.1f} ms = compute {:.1f}{} + exposed communication "
      "{:.1f} + bubble {:.1f}; {:.0f} tokens/s ({:.0f} per device), MFU {:.1f}%{}\n",
      device, 1e3 * e.step_s, 1e3 * e.compute_s,
      e.recompute_flops_per_step > 0
          ? fmt::format(" (of which {} recomputation {:.1f})", c.training.recompute.name(),
                        1e3 * e.compute_s * e.recompute_flops_per_step /
                            (e.flops_per_step + e.recompute_flops_per_step))
          : "",
      1e3 * e.comm_exposed_s, 1e3 * e.bubble_s, e.tokens_per_s,
      e.tokens_per_s / static_cast<double>(e.world), 100 * e.mfu,
      links.empty() ? "" : "; link time per group: " + links);
  if (!e.compute_parts.empty()) {
    std::string parts;
    for (const auto& [what, sec] : e.compute_parts)
      parts += fmt::format("{}{} {:.1f} ms", parts.empty() ? "" : ", ", what, 1e3 * sec);
    s += "#   compute on the slowest stage: " + parts + "\n";
  }
  return s;
}

std::string to_json(const PlanEstimate& e, const DeviceProfile& d) {
  nlohmann::json j = {{"world", e.world},
                      {"params_total", e.params_total},
                      {"flops_per_step", e.flops_per_step},
                      {"recompute_flops_per_step", e.recompute_flops_per_step},
                      {"fp8_flops_per_step", e.fp8_flops_per_step},
                      {"attention_share", e.attention_share},
                      {"attention_flops_saved_per_step", e.attention_flops_saved_per_step},
                      {"device",
                       {{"name", d.name},
                        {"peak_tflops", d.peak_tflops},
                        {"fp32_tflops", d.fp32_tflops},
                        {"intra_node_gbps", d.intra_node_gbps},
                        {"inter_node_gbps", d.inter_node_gbps},
                        {"gpus_per_node", d.gpus_per_node},
                        {"memory_gib", d.memory_gib},
                        {"efficiency", d.efficiency},
                        {"cpu", d.cpu},
                        {"threads", d.threads},
                        {"attention_tflops", d.attention_tflops},
                        {"activation_ns", d.activation_ns},
                        {"memory_gbps", d.memory_gbps},
                        {"latency_us", d.latency_us},
                        {"gather_gbps", d.gather_gbps},
                        {"p2p_gbps", d.p2p_gbps},
                        {"op_us", d.op_us}}},
                      {"step_s", e.step_s},
                      {"compute_s", e.compute_s},
                      {"comm_exposed_s", e.comm_exposed_s},
                      {"bubble_s", e.bubble_s},
                      {"comm_s", e.comm_s},
                      {"compute_parts_s", e.compute_parts},
                      {"tokens_per_s", e.tokens_per_s},
                      {"mfu", e.mfu},
                      {"ranks", nlohmann::json::array()}};
  for (const auto& r : e.ranks)
    j["ranks"].push_back({{"stage", r.stage},
                          {"params", r.params},
                          {"layers", r.layers},
                          {"weights_bytes", r.weights},
                          {"grads_bytes", r.grads},
                          {"optimizer_bytes", r.optimizer},
                          {"activation_bytes", r.activations},
                          {"gathered_bytes", r.gathered},
                          {"nccl_buffer_bytes", r.comm_buffers},
                          {"inflight_microbatches", r.inflight},
                          {"total_bytes", r.total()},
                          {"comm_bytes_per_step", r.comm}});
  return j.dump(1) + "\n";
}

nlohmann::json predicted_bytes(const plan::Config& c, const plan::Layout& l) {
  // `--dry-run --world-size N`'s prediction (the h100 profile: its rates are not used here).
  const auto e = estimate(c, l, device_profile("h100", {}));
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& r : e.ranks)
    stages.push_back({{"stage", r.stage},
                      {"weights_bytes", r.weights},
                      {"grads_bytes", r.grads},
                      {"optimizer_bytes", r.optimizer},
                      {"activation_bytes", r.activations},
                      {"comm_bytes_per_step", r.comm}});
  return stages;
}

// Hybrid sharding's choices (a GPU plan with ZeRO over more ranks than a node, or one that sets
// parallel.zero_shard), each with its memory, bytes and step time, and the best named.
std::string zero_shard_lines(const plan::Config& c, const plan::Layout& l, const DeviceProfile& d) {
  const auto choices = zero_shard_choices(c, l, d);
  if (choices.size() < 2) return "";
  const int64_t data = l.dp * l.cp;
  const auto split = plan::zero_split(c, l);
  std::string out = fmt::format(
      "# hybrid sharding (parallel.zero_shard): ZeRO {} over groups of N of the {} data ranks, "
      "replicated across the groups; {} GPUs a node:\n",
      plan::sharding(c).stage(), data, d.gpus_per_node);
  const ShardChoice* best = nullptr;
  for (const auto& k : choices) {
    if (k.best) best = &k;
    out += fmt::format(
        "#   {:<18} {}, {} replica{}: {} per rank{}; data group per step {} inside a shard "
        "group, {} across replicas; step {:.4g} ms{}{}\n",
        k.whole ? fmt::format("N {} (whole group)", k.shards) : fmt::format("N {}", k.shards),
        k.in_node ? "inside a node" : "across nodes", data / k.shards,
        data / k.shards == 1 ? "" : "s", human_bytes(k.peak_bytes), k.fits ? "" : " (does not fit)",
        human_bytes(k.inside_bytes), human_bytes(k.across_bytes), 1e3 * k.step_s,
        k.shards == split.shards ? "  <- this plan" : "", k.best ? "  <- best" : "");
  }
  if (best && best->shards != split.shards)
    out += fmt::format("# best for {} GPUs a node: --set parallel.zero_shard={}\n", d.gpus_per_node,
                       best->whole ? 1 : best->shards);
  return out;
}

// The data's order and split, and for data.blend each dataset's weight and the samples the run's
// steps take from it (the blend's rule is a function of the weights alone, so no file is read).
std::string blend_lines(const plan::Config& c) {
  const auto& d = c.data;
  std::string out;
  if (d.order != plan::DataOrder::kTessel || !d.split.empty() || !d.valid.empty() ||
      !d.test.empty())
    out +=
        fmt::format("# data: order {}{}{}{}\n", d.order.name(),
                    d.split.empty() ? "" : ", split " + d.split + " (train,valid,test)",
                    d.valid.empty() ? "" : fmt::format(", {} validation datasets", d.valid.size()),
                    d.test.empty() ? "" : fmt::format(", {} test datasets", d.test.size()));
  if (d.blend.empty()) return out;
  // data.order megatron blends as Megatron-Core: its weights normalised twice (builder, blend).
  const auto given = data::blend_weights(d);
  const bool megatron = d.order == plan::DataOrder::kMegatron;
  data::Blend blend(megatron ? data::numpy_normalize(given) : given, megatron);
  const int64_t samples = c.training.steps * c.training.global_batch;
  bool exact = true;
  const auto taken = blend.shares(samples, &exact);
  out += fmt::format(
      "# data: a blend of {} datasets; of the run's {} samples (Megatron-Core's rule: each from "
      "the dataset lagging its weight most{}):\n",
      blend.size(), samples,
      exact ? "" : "; past 2^36 samples, each its weight's share, within one");
  for (size_t i = 0; i < blend.size(); ++i) {
    std::string paths;
    for (const auto& p : d.blend[i].path) paths += (paths.empty() ? "" : ", ") + p;
    out += fmt::format("#   item {}: weight {:.4g}, {} samples: {}\n", i + 1, blend.weights()[i],
                       taken[i], paths);
  }
  return out;
}

std::string dry_run_report(const DryRun& r) {
  const auto& c = r.plan;
  const auto& l = r.layout;
  const auto& t = c.training;
  std::string out = fmt::sprintf(
      "# plan %s is valid for %lld processes: %lld micro-batches of %lld sequences per data rank "
      "per step; "
      "%lld tokens per step\n",
      r.plan_path.c_str(), static_cast<long long>(r.world),
      static_cast<long long>(t.global_batch / (l.dp * t.micro_batch)),
      static_cast<long long>(t.micro_batch), static_cast<long long>(t.global_batch * t.seq_len));
  out += render(r.estimate, c, r.device);
  if (r.faster) out += faster_layout_lines(r.plan_path, r.world, *r.faster, r.estimate);
  out += state_bytes(c, l, r.estimate);
  if (l.pp > 1) out += pipeline_lines(c, l, r.details);
  if (l.cp > 1) out += context_parallel_lines(c, l);
  out += blend_lines(c);
  if ((!r.device.cpu && r.device.gpus_per_node > 0 && r.world > r.device.gpus_per_node) ||
      c.parallel.zero_shard > 1)
    out += zero_shard_lines(c, l, r.device);
  if (!r.device.cpu && r.device.gpus_per_node > 0 && r.world > r.device.gpus_per_node)
    out += "# groups " + parallel::node_placement(c, l, r.device.gpus_per_node) + "\n";
  if (r.details)
    out += plan::dump_config(c) + parallel::describe_grid(l);
  else
    out += "# the resolved plan and the rank grid: --details\n";
  return out;
}

}  // namespace tessel::planner
