#include "engine/checkpoint/checkpoint.h"

#include <sys/statvfs.h>

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
#include "engine/checkpoint/index.h"
#include "engine/io/safetensors.h"
#include "engine/io/weights.h"

namespace fs = std::filesystem;

namespace tessel::checkpoint {
using checkpoint::open_verified;
using checkpoint::read_index;
using checkpoint::read_text;
namespace {

constexpr const char* kMarker = "COMPLETE";

// Complete step_<N> folders of a checkpoint dir, by step.
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

// Keeps the newest `keep` checkpoints of this run's lineage: those at or before the step just
// saved. Later steps belong to a timeline this run abandoned by resuming from an older
// checkpoint; they are left alone (the user may want them), and the one just saved is never
// removed.
void prune(const fs::path& root, int64_t keep, int64_t saved_step) {
  if (keep <= 0) return;
  std::vector<fs::path> lineage;
  for (const auto& [step, path] : complete_steps(root))
    if (step <= saved_step) lineage.push_back(path);
  // Renamed first (atomic), then removed: an interrupted prune leaves a step_<N>.pruned folder,
  // never a step_<N> with COMPLETE and some of its files gone.
  for (size_t i = 0; i + static_cast<size_t>(keep) < lineage.size(); ++i) {
    fs::path doomed = lineage[i];
    doomed += ".pruned";
    fs::rename(lineage[i], doomed);
    fs::remove_all(doomed);
  }
}

// Folders an interrupted save or prune left behind (step_<N>.tmp, step_<N>.pruned), never read:
// removed before a save.
void remove_stale(const fs::path& root, const fs::path& keep) {
  if (!fs::is_directory(root)) return;
  for (const auto& e : fs::directory_iterator(root)) {
    const auto name = e.path().filename().string();
    const auto ext = e.path().extension();
    if (e.is_directory() && name.rfind("step_", 0) == 0 && (ext == ".tmp" || ext == ".pruned") &&
        e.path() != keep)
      fs::remove_all(e.path());
  }
}

std::string rank_file(int64_t rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

// Every tensor of a checkpoint: (name, this rank's tensor, its spec). Optimizer state shares the
// parameter's spec; scalars are replicated. A ZeRO piece is elements [flat_begin, flat_end) of
// the flattened tensor-parallel slice, and every data rank writes its own.
struct Entry {
  std::string name;
  torch::Tensor local;
  models::ParamSpec spec;
  int64_t flat_begin = -1, flat_end = -1;  // -1: the whole slice
  bool every_data_rank = false;
};

std::vector<Entry> checkpoint_entries(models::Decoder& model, const optim::FlatAdamW& opt,
                                      const optim::LossScaler& scaler) {
  std::vector<Entry> out;
  auto params = model->named_parameters();
  for (const auto& p : params)  // ZeRO-3: only what the optimizer does not hold (not trained)
    if (opt.zero() < 3 || !p.value().requires_grad())
      out.push_back({p.key(), p.value().detach(), model->specs().at(p.key())});
  for (const auto& piece : opt.pieces()) {
    const auto& p = params[piece.name];
    const auto& spec = model->specs().at(piece.name);
    const bool whole = piece.numel == p.numel();
    // The piece may sit on any data rank (of its bucket's group).
    const auto& layout = opt.layout();
    const bool sharded =
        layout.buckets()[static_cast<size_t>(layout.slot(piece.name).bucket)].shards > 1;
    auto entry = [&](const std::string& name, const torch::Tensor& t) {
      if (whole) return Entry{name, t.view(p.sizes()), spec, -1, -1, sharded};
      return Entry{name, t, spec, piece.param_offset, piece.param_offset + piece.numel, true};
    };
    if (opt.zero() == 3) out.push_back(entry(piece.name, piece.weight));
    out.push_back(entry(optim::kSlotPrefixes[0] + piece.name, piece.master));
    out.push_back(entry(optim::kSlotPrefixes[1] + piece.name, piece.exp_avg));
    out.push_back(entry(optim::kSlotPrefixes[2] + piece.name, piece.exp_avg_sq));
  }
  models::ParamSpec scalar;
  out.push_back({optim::kStepName, opt.step_count(), scalar});
  for (const auto& [name, t] : scaler.state()) out.push_back({name, t, scalar});
  return out;
}

// The real (unpadded) part of a local tensor, or an undefined tensor when it holds none. Padding
// is whole rows at the end of dim 0, so a piece's real part is its overlap with a prefix of the
// flattened slice; `flat` gets the real range of a piece.
torch::Tensor real_part(const Entry& e, std::pair<int64_t, int64_t>* flat = nullptr) {
  auto t = e.local;
  const auto ranges = e.spec.global_ranges();
  if (e.flat_begin >= 0) {
    int64_t real = 1;
    for (auto [b, en] : ranges) real *= std::max<int64_t>(0, en - b);
    const int64_t end = std::min(e.flat_end, ranges.empty() ? e.flat_end : real);
    if (end <= e.flat_begin) return {};
    if (flat) *flat = {e.flat_begin, end};
    return t.narrow(0, 0, end - e.flat_begin);
  }
  for (size_t d = 0; d < ranges.size(); ++d) {
    const int64_t n = ranges[d].second - ranges[d].first;
    if (n <= 0) return {};
    if (n < t.size(static_cast<int64_t>(d))) t = t.narrow(static_cast<int64_t>(d), 0, n);
  }
  return t;
}

// This writer's part of the index: for each tensor it writes, the global shape, dtype and the
// slice of the global tensor its file holds (and for a ZeRO piece, its flat range in the slice).
struct Written {
  const Entry* entry;
  torch::Tensor tensor;
  std::pair<int64_t, int64_t> flat;
};

nlohmann::json index_fragment(const std::vector<Written>& mine, const std::string& file,
                              const io::WrittenFile& written) {
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& w : mine) {
    const Entry& e = *w.entry;
    nlohmann::json slice = nlohmann::json::array();
    for (auto [b, en] : e.spec.global_ranges()) slice.push_back({b, en});
    nlohmann::json shard = {{"file", file}, {"slice", slice}};
    if (e.flat_begin >= 0) shard["flat"] = {w.flat.first, w.flat.second};
    tensors[e.name] = {
        {"shape", e.spec.global_shape.empty() ? e.local.sizes().vec() : e.spec.global_shape},
        {"dtype", c10::toString(e.local.scalar_type())},
        {"shards", {shard}}};
  }
  return {{"tensors", tensors},
          {"file", file},
          {"bytes", written.bytes},
          {"checksum", written.checksum}};
}

// Rank 0: index.json from every writer's fragment (then removed). A replicated tensor written by
// several writers (the step counter, once per pipeline stage) keeps one shard.
void write_index(const plan::Config& c, const fs::path& tmp, const CheckpointState& st,
                 int64_t world) {
  nlohmann::json index = {{"format", "tessel-checkpoint-1"},
                          {"step", st.step},
                          {"consumed_samples", st.consumed_samples},
                          {"world_size", world},
                          {"arch", c.model.arch.name()},
                          {"tensors", nlohmann::json::object()}};
  auto& tensors = index["tensors"];
  auto& files = index["files"] = nlohmann::json::object();  // every rank file's size and checksum
  std::vector<fs::path> fragments;
  for (const auto& e : fs::directory_iterator(tmp))
    if (e.path().extension() == ".json" && e.path().filename().string().rfind("index.", 0) == 0)
      fragments.push_back(e.path());
  std::sort(fragments.begin(), fragments.end());
  for (const auto& f : fragments) {
    const auto fragment = nlohmann::json::parse(read_text(f));
    files[fragment.at("file").get<std::string>()] = {{"bytes", fragment.at("bytes")},
                                                     {"checksum", fragment.at("checksum")}};
    for (const auto& [name, t] : fragment.at("tensors").items()) {
      if (!tensors.contains(name)) {
        tensors[name] = t;
        continue;
      }
      auto& shards = tensors[name]["shards"];
      const auto& shard = t.at("shards").at(0);
      if (std::none_of(shards.begin(), shards.end(), [&](const nlohmann::json& s) {
            return s.at("slice") == shard.at("slice") &&
                   s.value("flat", nlohmann::json()) == shard.value("flat", nlohmann::json());
          }))
        shards.push_back(shard);
    }
    fs::remove(f);
  }
  io::write_file_atomic((tmp / "index.json").string(), index.dump(1));
}

}  // namespace

std::string save_checkpoint(const plan::Config& c, const parallel::Mesh& mesh,
                            models::Decoder& model, const optim::FlatAdamW& opt,
                            const optim::LossScaler& scaler, const CheckpointState& st) {
  const fs::path root = c.checkpoint_dir();
  const fs::path dir = root / ("step_" + std::to_string(st.step));
  const fs::path tmp = root / ("step_" + std::to_string(st.step) + ".tmp");
  auto& world = mesh.world_group();
  if (mesh.rank() == 0) {
    fs::create_directories(root);
    remove_stale(root, tmp);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  world.barrier();
  // Data (and context) replicas hold the same tensors, but for ZeRO pieces: the first replica's
  // tensor- and pipeline-parallel ranks write, each its shards and stages (every rank of the
  // dp×cp group its pieces); replicated tensors are written by tp rank 0 only, a tied token table
  // by the first stage only.
  const auto entries = checkpoint_entries(model, opt, scaler);
  const auto& me = mesh.coord();
  std::vector<Written> mine;
  for (const auto& e : entries) {
    // Experts: split over ep (the first ep data ranks hold them all), replicated over tp.
    const int64_t replica = e.spec.expert ? me.dp / mesh.layout().ep : me.dp;
    if (((e.spec.shard.parts == 1 || e.spec.expert) && me.tp != 0) || e.spec.pipeline_copy ||
        ((replica != 0 || me.cp != 0) && !e.every_data_rank))
      continue;
    std::pair<int64_t, int64_t> flat{-1, -1};
    if (auto t = real_part(e, &flat); t.defined()) mine.push_back({&e, t, flat});
  }
  if (!mine.empty()) {
    std::vector<std::pair<std::string, torch::Tensor>> tensors;
    for (const auto& w : mine) tensors.emplace_back(w.entry->name, w.tensor);
    const std::string file = rank_file(mesh.rank());
    const auto written =
        io::write_safetensors((tmp / file).string(), tensors, {{"format", "tessel"}});
    io::write_file_atomic((tmp / fmt::format("index.{:05d}.json", mesh.rank())).string(),
                          index_fragment(mine, file, written).dump());
  }
  world.barrier();
  if (mesh.rank() == 0) {
    write_index(c, tmp, st, mesh.world());
    io::write_file_atomic((tmp / "config.yaml").string(), plan::dump_config(c));
    // The marker goes last; only then does the folder get its final name and `latest` point at it.
    io::write_file_atomic((tmp / kMarker).string(), std::to_string(st.step) + "\n");
    fs::remove_all(dir);
    fs::rename(tmp, dir);
    io::write_file_atomic((root / "latest").string(), dir.filename().string() + "\n");
    prune(root, c.checkpoint.keep, st.step);
  }
  world.barrier();
  return dir.string();
}

// Bytes per parameter in a checkpoint: the weight in the run's dtype, master copy, two moments.
int64_t checkpoint_bytes_per_parameter(const plan::Config& c) {
  return (c.training.dtype == plan::Dtype::kFp32 ? 4 : 2) + 12;
}

double checkpoint_bytes(const plan::Config& c) {
  return static_cast<double>(models::parameters_on_rank(planner::model_shape(c.model), 1, {})) *
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
        models::parameters_on_rank(planner::model_shape(c.model), 1, {}),
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
    torch::Tensor global, covered;
    for (const auto& shard : shards) {
      std::string file = shard.at("file");
      if (!files.count(file)) files[file] = open_verified(dir, index, file);
      auto part = files[file]->view(name);
      if (!part.defined())
        throw plan::UserError((dir / file).string() + ": missing tensor '" + name +
                              "' listed in index.json");
      checkpoint::check_shard_tensor(dir / file, name, e, shard, part);
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
