// Precompiled for every LibTorch-using target (see CMakeLists.txt): LibTorch's headers are most of
// the compile time on small machines. Code still includes what it uses.
#pragma once
#include <torch/torch.h>

#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>
