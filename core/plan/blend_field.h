// data.blend's field (a list of {weight, path}): how a plan reads, checks and writes it back.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>
#include <vector>

#include "core/plan/config.h"

namespace tessel::plan {

/// Parses a list of {weight, path} (path a string or a list of strings), or null; returns what
/// was expected, naming the item, or "".
std::string assign_blend(std::vector<BlendSource>& out, const YAML::Node& n);
/// Every weight finite and > 0, every path non-empty: "" or what is wrong, naming the item.
std::string check_blend(const std::vector<BlendSource>& blend);
/// As YAML that reads back the same: [{weight: 0.3, path: [a, b]}, ...].
std::string blend_text(const std::vector<BlendSource>& blend);

}  // namespace tessel::plan
