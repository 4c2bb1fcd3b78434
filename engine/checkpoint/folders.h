// What saving and loading share of a checkpoint folder's layout.
#pragma once

#include <cstdint>
#include <filesystem>
#include <utility>
#include <vector>

namespace tessel::checkpoint {

/// The marker a step folder gets last: a folder without it is never read.
inline constexpr const char* kMarker = "COMPLETE";

/// Complete step_<N> folders of a checkpoint dir, by step.
std::vector<std::pair<int64_t, std::filesystem::path>> complete_steps(
    const std::filesystem::path& root);

}  // namespace tessel::checkpoint
