// A plan whose model.init_from names a Hugging Face folder (or a file beside its config.json):
// the architecture comes from config.json where the plan does not give it, and a plan value that
// contradicts it is refused naming both (model.init_from_accept lists the keys that may differ).
#pragma once

#include <string>
#include <vector>

#include "core/plan/config.h"

namespace tessel::run {

/// The plan `path` with `sets`, completed from model.init_from's config.json when there is one
/// (what was taken is logged). UserError naming the key, both values and the file for a plan value
/// that contradicts config.json and is not in model.init_from_accept.
plan::Config load_plan(const std::string& path, const std::vector<std::string>& sets);

}  // namespace tessel::run
