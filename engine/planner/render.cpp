// --dry-run's report of a plan estimate: the lines printed and the JSON written.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/planner/planner.h"

namespace tessel {

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
std::string device_brief(const DeviceProfile& d, const Config& c) {
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

}  // namespace

std::string render(const PlanEstimate& e, const Config& c, const DeviceProfile& d) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024)); };
  auto mib = [](double b) { return fmt::format("{:.1f} MiB", b / (1024.0 * 1024)); };
  std::string s = fmt::format(
      "# planner: {:.4g} B parameters; {:.4g} TFLOP per step ({} tokens); training.recompute "
      "{}; dtype {}\n",
      static_cast<double>(e.params_total) / 1e9, e.flops_per_step / 1e12,
      c.training.global_batch * c.training.seq_len, c.training.recompute.name(), c.training.dtype.name());
  for (const auto& r : e.ranks) {
    s += fmt::format(
        "#   {}{} parameters, {} blocks: weights {}, gradients {}, optimizer {}, activations {} "
        "({} micro-batch{} in flight{}) = {}{}\n",
        e.ranks.size() > 1 ? fmt::format("stage {}: ", r.stage) : "", r.params, r.layers,
        gib(r.weights), gib(r.grads), gib(r.optimizer), gib(r.activations), r.inflight,
        r.inflight == 1 ? "" : "es",
        r.gathered > 0 ? ", incl. ZeRO-3 gathered " + gib(r.gathered) : "", gib(r.total()),
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
                          {"inflight_microbatches", r.inflight},
                          {"total_bytes", r.total()},
                          {"comm_bytes_per_step", r.comm}});
  return j.dump(1) + "\n";
}

nlohmann::json predicted_bytes(const Config& c, const parallel::Layout& l) {
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

}  // namespace tessel
