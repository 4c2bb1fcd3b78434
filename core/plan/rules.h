// The plan's cross-field rules (core/plan/rules.cpp): what load_config checks once every value is
// read.
#pragma once

#include <map>
#include <string>

#include "core/plan/config.h"

namespace tessel::plan {

/// Resolves `c`'s "auto" values, then checks every rule that ties fields together; throws one
/// UserError listing each broken rule with the line of its key (`lines`: key -> line in the plan).
void check_rules(Config& c, const std::map<std::string, int>& lines);

/// The shortest of %.15g..%.17g that reads back to the same double: 0.9, not 0.90000000000000002.
std::string fmt_double(double v);

}  // namespace tessel::plan
