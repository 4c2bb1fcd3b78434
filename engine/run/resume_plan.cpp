#include "engine/run/resume_plan.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/optim/optim.h"
#include "engine/checkpoint/index.h"

namespace tessel::run {
namespace {

// training.steps shapes the LR only under a decay that runs to the last step.
bool steps_shape_the_lr(const plan::Config& a, const plan::Config& b) {
  return a.training.schedule.decay != plan::Decay::kConstant ||
         b.training.schedule.decay != plan::Decay::kConstant;
}

int64_t saved_step(const std::string& step_dir) {
  return checkpoint::read_index(step_dir).at("step").get<int64_t>();
}

}  // namespace

std::vector<PlanChange> plan_changes(const plan::Config& checkpoint_plan,
                                     const plan::Config& plan) {
  plan::Config before = checkpoint_plan, after = plan;
  const auto fb = plan::bind_fields(before), fa = plan::bind_fields(after);
  std::vector<PlanChange> out;
  for (size_t i = 0; i < fa.size(); ++i) {
    const std::string b = fb[i].value_text(), a = fa[i].value_text();
    if (a == b) continue;
    PlanChange ch{fa[i].key, b, a, fa[i].free_on_resume};
    // data.order megatron sizes its sample indices by steps x global_batch: a new length is a
    // new sample order from the resumed step on, never free.
    if (ch.key == "training.steps" && !steps_shape_the_lr(before, after) &&
        after.data.order != plan::DataOrder::kMegatron)
      ch.why_free = "the run's length: the constant decay does not depend on it";
    if (ch.key == "training.steps" && after.data.order == plan::DataOrder::kMegatron)
      ch.note =
          " [data.order megatron sizes its sample indices by training.steps x global_batch: "
          "from here on the samples are those of the new length]";
    for (const auto& k : plan.checkpoint.accept_changes) ch.accepted |= k == ch.key;
    out.push_back(std::move(ch));
  }
  return out;
}

void check_resume_plan(const plan::Config& plan, const std::string& step_dir, bool log) {
  const std::string saved = (std::filesystem::path(step_dir) / "config.yaml").string();
  // Without the plan it was saved under, nothing says whether this plan trains the same run
  // (seq_len, seed, data, model): resuming would silently continue another run.
  if (!std::filesystem::exists(saved))
    throw plan::UserError(fmt::format(
        "{}: resuming from {}: it has no config.yaml, the plan it was saved under (every "
        "checkpoint Tessel writes has one: a damaged or hand-made copy), so this plan cannot be "
        "checked against it. To start from its weights only: tessel-train export {} --out DIR, "
        "then model.init_from: DIR/model.safetensors with checkpoint.resume: never",
        plan.source, step_dir, step_dir));
  const plan::Config then = plan::load_config(saved);
  const auto changes = plan_changes(then, plan);
  if (changes.empty()) return;
  const int64_t next = saved_step(step_dir) + 1;
  const double lr_then = optim::lr_at(then.training, next),
               lr_now = optim::lr_at(plan.training, next);
  std::string lr_note;
  if (next > then.training.steps)
    lr_note = fmt::format(
        " (lr at step {}: {:.4g} under this plan; the checkpoint's plan ended at "
        "step {})",
        next, lr_now, then.training.steps);
  else if (lr_then != lr_now)
    lr_note =
        fmt::format(" (lr at step {}: {:.4g} under the checkpoint's plan, {:.4g} under this one)",
                    next, lr_then, lr_now);
  std::string lines, refused;
  for (const auto& ch : changes) {
    auto line = fmt::format("\n  {}: {} -> {}{}", ch.key, ch.before, ch.after, ch.note);
    const bool shapes_lr = ch.key.rfind("training.schedule.", 0) == 0 ||
                           ch.key == "training.optimizer.lr" || ch.key == "training.steps";
    if (!ch.why_free.empty()) {
      lines += line + " (" + ch.why_free + ")";
    } else if (ch.accepted) {
      lines += line + " (alters the run; accepted by checkpoint.accept_changes)" +
               (shapes_lr ? lr_note : "");
    } else {
      refused += line + (shapes_lr ? lr_note : "");
    }
  }
  if (!refused.empty())
    throw plan::UserError(fmt::format(
        "{}: resuming from {}, this plan changes what the run trains (the checkpoint was saved "
        "under {}):{}\nTo go on with these changes, name them in checkpoint.accept_changes (e.g. "
        "--set 'checkpoint.accept_changes=[{}]'): the step count and the data position "
        "(samples consumed) carry over, and each later step takes this plan's learning rate. "
        "Or start a new run: checkpoint.resume: never, or another checkpoint.dir.",
        plan.source, step_dir, saved, refused, [&] {
          std::string keys;
          for (const auto& ch : changes)
            if (ch.why_free.empty() && !ch.accepted) keys += (keys.empty() ? "" : ",") + ch.key;
          return keys;
        }()));
  if (log)
    spdlog::info(
        "resume: the plan differs from the checkpoint's ({}) in {} key{}; the run goes "
        "on:{}",
        saved, changes.size(), changes.size() == 1 ? "" : "s", lines);
}

}  // namespace tessel::run
