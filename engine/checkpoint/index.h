// A checkpoint's index.json, read as untrusted input: a checkpoint may come from anywhere (copied
// from another cluster, downloaded, hand-edited), so nothing in it is used before it is checked.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "engine/io/safetensors.h"

namespace tessel::checkpoint {

/// The largest step, sample count or element count an index may hold: 2^53, where a JSON number
/// stops being exact in every reader.
constexpr int64_t kMaxIndexInteger = int64_t{1} << 53;

/// A small text file of a checkpoint folder (index.json, latest, an index fragment), whole;
/// UserError naming it when it cannot be read.
std::string read_text(const std::filesystem::path& p);

/// index.json of a step folder, parsed and checked: format, step and consumed_samples (integers
/// in [0, 2^53]; step also matches a step_<N> folder name), world_size, every rank file (a plain
/// name, its size and checksum), every tensor (shape, dtype) and each shard (a listed file, a
/// slice inside the shape, a flat range inside the slice). UserError naming index.json and the
/// key otherwise.
nlohmann::json read_index(const std::filesystem::path& dir);

/// A rank file of a checked index, mapped and verified against the size and checksum the index
/// records; a path that leaves the folder (a symbolic link pointing elsewhere) is refused.
std::unique_ptr<io::MappedSafetensors> open_verified(const std::filesystem::path& dir,
                                                     const nlohmann::json& index,
                                                     const std::string& file);

/// The shape one shard's tensor has in its file: the slice's extents, or [end - begin] for a
/// ZeRO piece ("flat").
std::vector<int64_t> shard_shape(const nlohmann::json& shard);

/// A shard's tensor as read from `file` matches what the index says (dtype and shard_shape);
/// UserError naming the file, the tensor and both otherwise. Nothing is copied before this holds.
void check_shard_tensor(const std::filesystem::path& file, const std::string& name,
                        const nlohmann::json& entry, const nlohmann::json& shard,
                        const torch::Tensor& part);

}  // namespace tessel::checkpoint
