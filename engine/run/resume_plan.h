// Resuming under a changed plan. A checkpoint keeps the plan it was saved with (config.yaml);
// at start-up the plan of the resuming run is compared with it key by key, and every difference
// is printed. A change that keeps the run what it was (the layout, micro-batch, precision,
// logging, checkpointing: each field's free_on_resume says why) goes on with a line saying so;
// any other change (seq_len, global_batch, seed, data, model, optimizer, the LR schedule, and
// training.steps when the decay depends on it) is refused before any work, unless the plan
// names it in checkpoint.accept_changes. The step count and the data position (samples
// consumed) always carry over; the LR of each later step is the new plan's.
#pragma once

#include <string>
#include <vector>

#include "core/plan/config.h"

namespace tessel::run {

struct PlanChange {
  std::string key, before, after;
  std::string why_free;   // non-empty: the change keeps the run what it was
  bool accepted = false;  // named in checkpoint.accept_changes
  std::string note;       // what else the change does, for the message
};

/// Every key whose value differs between the checkpoint's plan and this one, in table order.
std::vector<PlanChange> plan_changes(const plan::Config& checkpoint_plan, const plan::Config& plan);

/// Start-up, when the run resumes from `step_dir`: compares the plan with the
/// checkpoint's config.yaml; logs every difference (when `log`), and throws UserError naming
/// every change that alters the run and is not accepted, with the LR figures at the next step.
void check_resume_plan(const plan::Config& plan, const std::string& step_dir, bool log);

}  // namespace tessel::run
