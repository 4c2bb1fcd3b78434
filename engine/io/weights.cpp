#include "engine/io/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/plan/user_error.h"

namespace tessel::io {
namespace fs = std::filesystem;

namespace {

// The index's weight_map: tensor name -> shard file name, each checked.
std::map<std::string, std::string> read_weight_map(const std::string& path) {
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  if (!f) throw plan::UserError(path + ": cannot be read");
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw plan::UserError(fmt::format("{}: not JSON ({})", path, e.what()));
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object() ||
      index["weight_map"].empty())
    throw plan::UserError(path +
                          ": weight_map: expected an object of tensor names to shard files (as "
                          "save_pretrained writes it), with at least one entry");
  std::map<std::string, std::string> map;
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw plan::UserError(fmt::format("{}: weight_map.{}: expected a shard file name, got {}",
                                        path, name, file.dump()));
    check_plain_name(file.get<std::string>(), path + ": weight_map." + name, "model");
    map[name] = file.get<std::string>();
  }
  return map;
}

}  // namespace

void check_plain_name(const std::string& name, const std::string& where, const std::string& what) {
  const bool control = std::any_of(name.begin(), name.end(),
                                   [](char ch) { return static_cast<unsigned char>(ch) < 0x20; });
  if (name.empty() || name == "." || name == ".." || name.size() > 255 ||
      name.find('/') != std::string::npos || control)
    throw plan::UserError(fmt::format(
        "{}: '{}' is not a plain file name inside the {} folder (a name with '/' or '..' would "
        "make Tessel read outside it); the {} is not loaded",
        where, name, what, what));
}

std::string weights_in_folder(const std::string& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return "";
  for (const char* name : {kShardIndex, "model.safetensors"}) {
    const auto inside = fs::path(folder) / name;
    if (fs::is_regular_file(inside, ec)) return inside.string();
  }
  return "";
}

std::string weights_entry(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (auto inside = weights_in_folder(path); !inside.empty()) return inside;
    throw plan::UserError(fmt::format(
        "{}: {} is a folder with neither {} nor model.safetensors; name the safetensors file (a "
        "Hugging Face save_pretrained folder holds one of them, a `tessel-train export` folder "
        "model.safetensors)",
        key, path, kShardIndex));
  }
  if (!fs::is_regular_file(path, ec)) throw plan::UserError(key + ": " + path + ": no such file");
  return path;
}

MappedWeights::MappedWeights(const std::string& path, const std::string& key)
    : source_(weights_entry(path, key)) {
  if (fs::path(source_).filename() != kShardIndex) {
    files_.push_back(std::make_unique<MappedSafetensors>(source_));
    for (const auto& name : files_[0]->names()) views_[name] = files_[0]->view(name);
    return;
  }
  const auto map = read_weight_map(source_);
  const fs::path folder = fs::path(source_).parent_path();
  std::map<std::string, const MappedSafetensors*> shards;
  for (const auto& [name, file] : map) {
    if (shards.count(file)) continue;
    const auto shard = (folder / file).string();
    std::error_code ec;
    if (!fs::is_regular_file(shard, ec))
      throw plan::UserError(
          fmt::format("{}: weight_map.{}: shard {} does not exist", source_, name, shard));
    files_.push_back(std::make_unique<MappedSafetensors>(shard));
    shards[file] = files_.back().get();
  }
  for (const auto& [name, file] : map) {
    views_[name] = shards.at(file)->view(name);
    if (!views_[name].defined())
      throw plan::UserError(
          fmt::format("{}: weight_map.{} names shard {}, which holds no such "
                      "tensor",
                      source_, name, (folder / file).string()));
  }
  for (const auto& [file, shard] : shards)
    for (const auto& name : shard->names())
      if (!map.count(name) || map.at(name) != file)
        throw plan::UserError(fmt::format(
            "{}: shard {} holds tensor '{}', which the weight_map {}", source_,
            (folder / file).string(), name,
            map.count(name) ? "gives to " + map.at(name) : std::string("does not name")));
}

}  // namespace tessel::io
