#include "engine/checkpoint/checkpoint.h"

#include <sys/statvfs.h>

#include <c10/util/accumulate.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "core/optim/state_names.h"
#include "engine/checkpoint/folders.h"
#include "engine/checkpoint/index.h"
#include "engine/io/safetensors.h"
#include "engine/io/weights.h"

namespace fs = std::filesystem;

namespace tessel::checkpoint {
using checkpoint::open_verified;
using checkpoint::read_index;
using checkpoint::read_text;

std::vector<std::pair<int64_t, fs::path>> complete_steps(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> done;
  if (!fs::is_directory(root)) return done;
  std::regex re("step_([0-9]+)");
  for (const auto& e : fs::directory_iterator(root)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, re) && fs::exists(e.path() / kMarker))
      done.emplace_back(std::stoll(m[1]), e.path());
  }
  std::sort(done.begin(), done.end());
  return done;
}

// Bytes per parameter in a checkpoint: the weight in the run's dtype, master copy, two moments.
int64_t checkpoint_bytes_per_parameter(const plan::Config& c) {
  return (c.training.dtype == plan::Dtype::kFp32 ? 4 : 2) + 12;
}

double checkpoint_bytes(const plan::Config& c) {
  return static_cast<double>(models::parameters_on_rank(models::model_shape(c.model), 1, {})) *
         static_cast<double>(checkpoint_bytes_per_parameter(c));
}

void check_room_for_checkpoint(const plan::Config& c) {
  const std::string dir = c.checkpoint_dir();
  std::error_code ec;
  fs::path probe = fs::absolute(dir, ec);
  while (!probe.empty() && !fs::exists(probe, ec) && probe != probe.parent_path())
    probe = probe.parent_path();  // the folder may not exist yet: its nearest existing parent
  struct statvfs st {};
  if (::statvfs(probe.c_str(), &st) != 0) return;  // no figure to go by: the save will tell
  const double free_bytes = static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize);
  const double need = checkpoint_bytes(c);
  auto gib = [](double b) { return fmt::format("{:.3g} GiB", b / (1024.0 * 1024 * 1024)); };
  if (free_bytes < need)
    throw plan::UserError(fmt::format(
        "checkpoint.dir {}: its filesystem has {} free, and one checkpoint of this plan needs "
        "about {} ({} parameters x {} bytes: weights in {}, an fp32 master copy and two fp32 "
        "AdamW moments); free space there or set checkpoint.dir to a larger filesystem",
        dir, gib(free_bytes), gib(need),
        models::parameters_on_rank(models::model_shape(c.model), 1, {}),
        checkpoint_bytes_per_parameter(c), c.training.dtype.name()));
  if (free_bytes < 2 * need)
    spdlog::warn("checkpoint.dir {}: {} free, room for {:.0f} checkpoint(s) of about {}", dir,
                 gib(free_bytes), std::floor(free_bytes / need), gib(need));
}

std::string resolve_checkpoint(const std::string& dir) {
  fs::path p(dir);
  if (!fs::is_directory(p)) throw plan::UserError(dir + ": no such checkpoint folder");
  if (!fs::exists(p / "index.json") && fs::exists(p / "latest")) {
    std::string name = read_text(p / "latest");
    name.erase(name.find_last_not_of(" \n\r\t") + 1);
    io::check_plain_name(name, (p / "latest").string());
    p /= name;
  }
  if (!fs::exists(p / kMarker))
    throw plan::UserError(p.string() + ": not a complete checkpoint (no " + std::string(kMarker) +
                          " marker: the save was interrupted or this is not a step folder)");
  return p.string();
}

namespace {

// Copies a part out of the mapping 16 MiB at a time, dropping each block's pages once copied:
// resident memory holds the global tensor being assembled, not the files.
void copy_out(torch::Tensor dst, const torch::Tensor& src, const io::MappedSafetensors& f) {
  if (src.dim() == 0 || src.numel() == 0) {
    dst.copy_(src);
    return;
  }
  const int64_t row = src.numel() / src.size(0) * src.element_size();
  const int64_t rows = std::max<int64_t>(1, (16 << 20) / std::max<int64_t>(row, 1));
  for (int64_t r = 0; r < src.size(0); r += rows) {
    const int64_t n = std::min(rows, src.size(0) - r);
    dst.narrow(0, r, n).copy_(src.narrow(0, r, n));
    f.release(src.narrow(0, r, n).data_ptr(), static_cast<size_t>(n * row));
  }
}

// One shard that is the whole tensor covers it; otherwise a mask of which elements some shard
// wrote (1 byte each) checks that the shards cover it.
bool one_whole_shard(const nlohmann::json& shards, const std::vector<int64_t>& shape) {
  bool whole = shards.size() == 1 && !shards[0].contains("flat");
  for (size_t d = 0; whole && d < shape.size(); ++d)
    whole = shards[0].at("slice").at(d) == nlohmann::json::array({0, shape[d]});
  return whole;
}

// Writes one shard's `part` (from `file`) into its slice of `global` and marks it in `covered`:
// a tensor-parallel slice, or a ZeRO piece (elements [begin, end) of the slice, row-major).
void place_shard(const fs::path& path, const std::string& name, const nlohmann::json& shard,
                 const torch::Tensor& part, const io::MappedSafetensors& f, torch::Tensor view,
                 torch::Tensor cover) {
  int dim = 0;
  for (const auto& r : shard.at("slice")) {
    view = view.slice(dim, r[0].get<int64_t>(), r[1].get<int64_t>());
    cover = cover.slice(dim++, r[0].get<int64_t>(), r[1].get<int64_t>());
  }
  if (!shard.contains("flat")) {
    copy_out(view, part, f);
    cover.fill_(true);
    return;
  }
  const int64_t b = shard.at("flat")[0].get<int64_t>(), en = shard.at("flat")[1].get<int64_t>();
  if (b < 0 || en > view.numel() || en - b != part.numel())
    throw plan::UserError(path.string() + ": '" + name + "' piece [" + std::to_string(b) + ", " +
                          std::to_string(en) + ") does not fit its slice of " +
                          std::to_string(view.numel()) + " elements");
  auto write_flat = [&](torch::Tensor target, const torch::Tensor& values) {
    auto whole = target.contiguous();
    whole.view(-1).narrow(0, b, en - b).copy_(values);
    if (!target.is_contiguous() || whole.data_ptr() != target.data_ptr()) target.copy_(whole);
  };
  write_flat(view, part.flatten());
  write_flat(cover, torch::ones({en - b}, torch::kBool));
  f.release(part.data_ptr(), static_cast<size_t>(part.nbytes()));
}

// Shards that leave part of a tensor unwritten (a lost rank file, a hand-edited index) would
// resume from uninitialised memory.
void check_covered(const fs::path& dir, const std::string& name, const torch::Tensor& covered) {
  if (const int64_t missing = covered.numel() - covered.sum().item<int64_t>(); missing > 0)
    throw plan::UserError((dir / "index.json").string() + ": the shards of '" + name + "' cover " +
                          std::to_string(covered.numel() - missing) + " of its " +
                          std::to_string(covered.numel()) +
                          " elements; the checkpoint is incomplete and cannot be resumed");
}

// The global tensors of a complete checkpoint that `want` accepts, assembled one at a time from
// the mapped rank files and handed to `use`, then freed: only the files holding wanted tensors
// are opened (and verified), and only their pages that hold them are read.
void for_each_tensor(const fs::path& dir, const nlohmann::json& index,
                     const std::function<bool(const std::string&)>& want,
                     const std::function<void(const std::string&, torch::Tensor)>& use) {
  std::map<std::string, std::unique_ptr<io::MappedSafetensors>> files;
  for (const auto& [name, e] : index.at("tensors").items()) {
    if (!want(name)) continue;
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    const auto& shards = e.at("shards");
    const bool whole = one_whole_shard(shards, shape);
    // Every shard checked, and their elements counted, before the global tensor is allocated: an
    // index whose shape the shards cannot fill (a crafted 1 PB one) is refused, not allocated.
    std::vector<torch::Tensor> parts;
    int64_t held = 0;
    for (const auto& shard : shards) {
      std::string file = shard.at("file");
      if (!files.count(file)) files[file] = open_verified(dir, index, file);
      auto part = files[file]->view(name);
      if (!part.defined())
        throw plan::UserError((dir / file).string() + ": missing tensor '" + name +
                              "' listed in index.json");
      checkpoint::check_shard_tensor(dir / file, name, e, shard, part);
      held += part.numel();  // each within its file: no overflow
      parts.push_back(std::move(part));
    }
    // read_index bounds every shape at 2^53 elements: the product is exact.
    const int64_t numel = c10::multiply_integers(shape);
    if (!parts.empty() && numel > held)
      throw plan::UserError(fmt::format(
          "{}: the shards of '{}' cover {} of its {} elements (shape [{}] in index.json): not a "
          "checkpoint Tessel wrote whole",
          (dir / "index.json").string(), name, held, numel, fmt::join(shape, ", ")));
    torch::Tensor global, covered;
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto& shard = shards[k];
      const std::string file = shard.at("file");
      auto& part = parts[k];
      if (!global.defined()) {
        global = torch::empty(shape, part.options());
        if (!whole) covered = torch::zeros(global.sizes(), torch::kBool);
      }
      if (whole)
        copy_out(global, part, *files[file]);
      else
        place_shard(dir / file, name, shard, part, *files[file], global, covered);
    }
    if (!global.defined())
      throw plan::UserError((dir / "index.json").string() + ": '" + name + "' lists no shards");
    if (!whole) check_covered(dir, name, covered);
    use(name, std::move(global));
  }
}

}  // namespace

models::Weights read_checkpoint_tensors(const std::string& step_dir, const std::string& prefix) {
  const fs::path dir(step_dir);
  models::Weights out;
  for_each_tensor(
      dir, read_index(dir), [&](const std::string& name) { return name.rfind(prefix, 0) == 0; },
      [&](const std::string& name, torch::Tensor t) { out[name] = std::move(t); });
  return out;
}

models::Weights read_checkpoint_tensors(const std::string& step_dir,
                                        const std::set<std::string>& names) {
  const fs::path dir(step_dir);
  models::Weights out;
  for_each_tensor(
      dir, read_index(dir), [&](const std::string& name) { return names.count(name) > 0; },
      [&](const std::string& name, torch::Tensor t) { out[name] = std::move(t); });
  return out;
}

std::string checkpoint_to_resume(const plan::Config& c) {
  const std::string& r = c.checkpoint.resume;
  if (r == "never") return "";
  if (r == "auto") {
    const fs::path latest = fs::path(c.checkpoint_dir()) / "latest";
    if (fs::exists(latest)) return resolve_checkpoint(c.checkpoint_dir());
    // Complete checkpoints without `latest` (deleted, or a copied folder): starting over would
    // overwrite them, so say which exist and how to choose.
    const auto done = complete_steps(c.checkpoint_dir());
    if (!done.empty()) {
      std::string names;
      for (const auto& [step, path] : done)
        names += (names.empty() ? "" : ", ") + path.filename().string();
      throw plan::UserError(
          c.source + ": checkpoint.resume auto: " + c.checkpoint_dir() +
          " holds complete checkpoints (" + names +
          ") but no 'latest' file; set "
          "checkpoint.resume to one of them to continue, or to never to start over "
          "(their folders are then overwritten as the new run saves)");
    }
    return "";
  }
  try {
    return resolve_checkpoint(r);
  } catch (const plan::UserError& e) {
    throw plan::UserError(c.source + ": checkpoint.resume: " + e.what());
  }
}

namespace {

// Names and shapes, from the index alone: every model tensor of the file exists in the global
// model with its shape, and every parameter this rank holds is in the file, with the
// optimizer's step count.
void check_checkpoint_names(const std::string& source, const nlohmann::json& tensors,
                            models::Decoder& model) {
  const auto global = model->global_names();
  std::string missing, extra;
  for (const auto& [name, e] : tensors.items()) {
    if (optim::is_optimizer_state(name)) continue;
    if (!global.count(name)) {
      extra += (extra.empty() ? "" : ", ") + name;
      continue;
    }
    // The shape of a tensor this rank holds (another stage's is checked by its own ranks).
    const auto spec = model->specs().find(name);
    if (spec == model->specs().end()) continue;
    const auto shape = e.at("shape").get<std::vector<int64_t>>();
    if (shape != spec->second.global_shape)
      throw plan::UserError(
          fmt::format("{}: tensor '{}' has shape [{}] but the plan's model needs [{}]", source,
                      name, fmt::join(shape, ", "), fmt::join(spec->second.global_shape, ", ")));
  }
  for (const auto& p : model->named_parameters())
    if (!tensors.contains(p.key())) missing += (missing.empty() ? "" : ", ") + p.key();
  if (!missing.empty())
    throw plan::UserError(source + ": missing tensors for this model: " + missing);
  if (!extra.empty())
    throw plan::UserError(source + ": tensors this model does not have: " + extra);
  if (!tensors.contains(optim::kStepName))
    throw plan::UserError(source + ": no optimizer state (" + optim::kStepName +
                          ") to resume from");
}

// The optimizer slot a checkpoint name holds (0-2, FlatAdamW::load_slot's kinds) and its
// parameter; -1 and the name itself for a model weight or a scalar.
std::pair<int, std::string> slot_of(const std::string& name) {
  for (int i = 0; i < 3; ++i) {
    const auto& prefix = optim::kSlotPrefixes[static_cast<size_t>(i)];
    if (name.rfind(prefix, 0) == 0) return {i, name.substr(prefix.size())};
  }
  return {-1, name};
}

}  // namespace

CheckpointState load_checkpoint(const std::string& step_dir, models::Decoder& model,
                                optim::FlatAdamW& opt, optim::LossScaler* scaler) {
  const fs::path dir(step_dir);
  const std::string source = step_dir;
  const auto index = read_index(dir);
  check_checkpoint_names(source, index.at("tensors"), model);
  // Then only this rank's tensors (its pipeline stages), one global tensor at a time, each cut
  // to this rank's slice at once (any layout resumes any checkpoint).
  auto params = model->named_parameters();
  const auto mine = params.keys();
  const std::set<std::string> held(mine.begin(), mine.end());
  models::Weights scalars;
  torch::NoGradGuard no_grad;
  for_each_tensor(
      dir, index,
      [&](const std::string& name) {
        const auto [kind, param] = slot_of(name);
        return held.count(param) > 0 || (kind < 0 && optim::is_optimizer_state(name));
      },
      [&](const std::string& name, torch::Tensor t) {
        const auto [kind, param] = slot_of(name);
        if (!held.count(param)) {
          scalars[name] = std::move(t);  // optim.step, the loss scale
          return;
        }
        const auto local = model->specs().at(param).local_of(t);
        if (kind < 0)
          params[param].copy_(local);
        else
          opt.load_slot(kind, param, local, source);  // into this rank's pieces at once
      });
  opt.finish_load(scalars.at(optim::kStepName), source);
  if (scaler) scaler->load_state(scalars);
  return {index.at("step").get<int64_t>(), index.at("consumed_samples").get<int64_t>()};
}

}  // namespace tessel::checkpoint
