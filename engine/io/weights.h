// A model's weights as they ship, memory-mapped: one safetensors file, or a folder holding
// model.safetensors or Hugging Face's sharded form (model.safetensors.index.json naming each
// tensor's shard, as save_pretrained writes above its max_shard_size). Every tensor is a view of
// its file's mapping, so a rank that copies only the slices it keeps (its tensor-, pipeline- and
// expert-parallel part) reads only those pages, never the whole model.
#pragma once

#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/io/safetensors.h"

namespace tessel::io {

/// The index of a sharded Hugging Face folder.
inline constexpr const char* kShardIndex = "model.safetensors.index.json";

/// `name` (a shard or rank file named by an index, or a `latest` pointer) as a plain file name
/// inside its folder: not empty, no '/', not "." or "..", no control character, at most 255
/// bytes. A name such as "../../x.safetensors" or "/etc/x" would make a crafted index read
/// outside its folder. `where` names the file the name was read from; `what` the folder's kind
/// ("checkpoint", "model"), named in the UserError.
void check_plain_name(const std::string& name, const std::string& where,
                      const std::string& what = "checkpoint");

/// The weights file of a folder: its model.safetensors.index.json, else its model.safetensors;
/// empty when it holds neither (or `folder` is not a folder).
std::string weights_in_folder(const std::string& folder);

/// The file a weights path opens: the path itself when it is a file, else the folder's
/// model.safetensors.index.json, else its model.safetensors. UserError naming `key` (the plan key
/// or option that gave the path) and what was looked for otherwise.
std::string weights_entry(const std::string& path, const std::string& key);

class MappedWeights {
 public:
  /// Maps `path` (as weights_entry resolves it). An index is checked before anything is mapped:
  /// a weight_map of tensor names to plain shard names inside the folder; then each shard's
  /// header (as read_safetensors checks it), every tensor of the map present in its shard and no
  /// shard holding a tensor the map does not give it. UserError naming the file and the key.
  MappedWeights(const std::string& path, const std::string& key);
  /// Views of every tensor, by its name in the files; valid while this object lives.
  const std::map<std::string, torch::Tensor>& tensors() const { return views_; }
  /// The file opened (an index or a safetensors file), for messages.
  const std::string& source() const { return source_; }
  size_t files() const { return files_.size(); }

 private:
  std::string source_;
  std::vector<std::unique_ptr<MappedSafetensors>> files_;
  std::map<std::string, torch::Tensor> views_;
};

}  // namespace tessel::io
