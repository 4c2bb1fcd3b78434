// data.split ("969,30,1"): the train, validation and test shares of each dataset, read as
// Megatron's --split is (numbers normalised by their sum; missing ones are 0).
#pragma once

#include <array>
#include <string>

namespace tessel::plan {

/// The shares as written ({969, 30, 1}); "" is {1, 0, 0}. Returns "" or what is wrong.
std::string parse_split(const std::string& text, std::array<double, 3>& shares);

}  // namespace tessel::plan
