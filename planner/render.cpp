// --dry-run's report of a plan estimate: the lines printed and the JSON written.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "planner/planner.h"

namespace tessel {

std::string render(const PlanEstimate& e, const Config& c, const DeviceProfile& d) {
  auto gib = [](double b) { return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024)); };
  auto mib = [](double b) { return fmt::format("{:.1f} MiB", b / (1024.0 * 1024)); };
  std::string s = fmt::format(
      "# planner: {:.4g} B parameters; {:.4g} TFLOP per step ({} tokens); training.recompute "
      "{}; dtype {}\n",
      static_cast<double>(e.params_total) / 1e9, e.flops_per_step / 1e12,
      c.training.global_batch * c.training.seq_len, c.training.recompute, c.training.dtype);
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
  s += fmt::format(
      "# predicted on {} ({:.0f} TFLOP/s {} peak at {:.0f}% efficiency, {} GB/s in a node, {} GB/s "
      "between nodes, {} per node): step {:.1f} ms = compute {:.1f}{} + exposed communication "
      "{:.1f} + bubble {:.1f}; {:.0f} tokens/s ({:.0f} per device), MFU {:.1f}%{}\n",
      d.name, matmul_peak_tflops(d, c.training), matmul_peak_name(c.training), 100 * d.efficiency,
      d.intra_node_gbps, d.inter_node_gbps, d.gpus_per_node, 1e3 * e.step_s, 1e3 * e.compute_s,
      e.recompute_flops_per_step > 0
          ? fmt::format(" (of which {} recomputation {:.1f})", c.training.recompute,
                        1e3 * e.compute_s * e.recompute_flops_per_step /
                            (e.flops_per_step + e.recompute_flops_per_step))
          : "",
      1e3 * e.comm_exposed_s, 1e3 * e.bubble_s, e.tokens_per_s,
      e.tokens_per_s / static_cast<double>(e.world), 100 * e.mfu,
      links.empty() ? "" : "; link time per group: " + links);
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
                        {"efficiency", d.efficiency}}},
                      {"step_s", e.step_s},
                      {"compute_s", e.compute_s},
                      {"comm_exposed_s", e.comm_exposed_s},
                      {"bubble_s", e.bubble_s},
                      {"comm_s", e.comm_s},
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

}  // namespace tessel
