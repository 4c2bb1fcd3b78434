#include "engine/checkpoint/save.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "core/device/cuda.h"
#include "core/optim/state_names.h"
#include "engine/checkpoint/folders.h"
#include "engine/checkpoint/index.h"
#include "engine/io/safetensors.h"

namespace fs = std::filesystem;

namespace tessel::checkpoint {
namespace {

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
    if (!opt.sharding().weights || !p.value().requires_grad())
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
    if (opt.sharding().weights) out.push_back(entry(piece.name, piece.weight));
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
  Entry entry;  // its `local` dropped once the tensor is copied (checkpoint.async)
  torch::Tensor tensor;
  std::pair<int64_t, int64_t> flat;
};

nlohmann::json index_fragment(const std::vector<Written>& mine, const std::string& file,
                              const io::WrittenFile& written) {
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& w : mine) {
    const Entry& e = w.entry;
    nlohmann::json slice = nlohmann::json::array();
    for (auto [b, en] : e.spec.global_ranges()) slice.push_back({b, en});
    nlohmann::json shard = {{"file", file}, {"slice", slice}};
    if (e.flat_begin >= 0) shard["flat"] = {w.flat.first, w.flat.second};
    tensors[e.name] = {
        {"shape", e.spec.global_shape.empty() ? w.tensor.sizes().vec() : e.spec.global_shape},
        {"dtype", c10::toString(w.tensor.scalar_type())},
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

// One save: its folders and step, and this rank's tensors (views of the live state, or their
// copies in host memory once snapshot() ran).
struct SavePart {
  fs::path root, dir, tmp;
  CheckpointState st;
  std::vector<Written> mine;
  device::HostCopy copied;  // the device-to-host copies in flight (CUDA)
};

namespace {

// Rank 0 clears what an interrupted save left and makes the folder; every rank meets; this
// rank's tensors chosen. Data (and context) replicas hold the same tensors, but for ZeRO pieces:
// the first replica's tensor- and pipeline-parallel ranks write, each its shards and stages
// (every rank of the dp×cp group its pieces; under hybrid sharding, of the first shard group);
// replicated tensors are written by tp rank 0 only, a tied token table by the first stage only.
std::shared_ptr<SavePart> prepare(const plan::Config& c, const parallel::Mesh& mesh,
                                  models::Decoder& model, const optim::FlatAdamW& opt,
                                  const optim::LossScaler& scaler, const CheckpointState& st) {
  auto p = std::make_shared<SavePart>();
  p->root = c.checkpoint_dir();
  p->dir = p->root / ("step_" + std::to_string(st.step));
  p->tmp = p->root / ("step_" + std::to_string(st.step) + ".tmp");
  p->st = st;
  if (mesh.rank() == 0) {
    fs::create_directories(p->root);
    remove_stale(p->root, p->tmp);
    fs::remove_all(p->tmp);
    fs::create_directories(p->tmp);
  }
  mesh.world_group().barrier();
  const auto& me = mesh.coord();
  for (auto& e : checkpoint_entries(model, opt, scaler)) {
    // Experts: split over ep (the first ep data ranks hold them all), replicated over tp.
    const int64_t replica = e.spec.expert ? me.dp / mesh.layout().ep : me.dp;
    // Under hybrid sharding the shard groups hold the same pieces: the first group's write.
    const auto* replicas = mesh.zero_replicas(e.spec.expert);
    if (((e.spec.shard.parts == 1 || e.spec.expert) && me.tp != 0) || e.spec.pipeline_copy ||
        ((replica != 0 || me.cp != 0) && !e.every_data_rank) ||
        (e.every_data_rank && replicas && replicas->rank() != 0))
      continue;
    std::pair<int64_t, int64_t> flat{-1, -1};
    if (auto t = real_part(e, &flat); t.defined()) p->mine.push_back({std::move(e), t, flat});
  }
  return p;
}

// This rank's tensors copied out of the live state into one host arena, sized exactly (each
// tensor at a 256-byte boundary) and kept for the next save when it fits (the same shapes every
// save: no allocation, no first-touch page faults); page-locked for CUDA, where the copies run on
// a side stream. Returns the arena's bytes.
int64_t snapshot(SavePart& p, torch::Tensor& arena, bool& pinned) {
  constexpr int64_t kAlign = 256;
  std::vector<int64_t> at;
  int64_t bytes = 0;
  bool cuda = false;
  for (const auto& w : p.mine) {
    at.push_back(bytes);
    bytes += (w.tensor.numel() * w.tensor.element_size() + kAlign - 1) / kAlign * kAlign;
    cuda = cuda || w.tensor.is_cuda();
  }
  if (!arena.defined() || arena.numel() != bytes || pinned != cuda) {
    arena = torch::Tensor();  // the old one freed first
    arena = cuda ? device::cuda_module()->pinned_bytes(bytes) : torch::empty({bytes}, torch::kByte);
    pinned = cuda;
  }
  std::vector<torch::Tensor> dst, src;
  for (size_t i = 0; i < p.mine.size(); ++i) {
    auto& w = p.mine[i];
    const int64_t n = w.tensor.numel() * w.tensor.element_size();
    auto host = arena.narrow(0, at[i], n).view(w.tensor.scalar_type()).view(w.tensor.sizes());
    w.entry.local = torch::Tensor();
    if (w.tensor.is_cuda()) {
      src.push_back(w.tensor), dst.push_back(host);
    } else {
      host.copy_(w.tensor);
    }
    w.tensor = host;
  }
  if (!src.empty()) p.copied = device::cuda_module()->copy_to_host(dst, src);
  return bytes;
}

void write_part(const SavePart& p, int64_t rank) {
  if (p.copied.wait_host) p.copied.wait_host();
  if (p.mine.empty()) return;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const auto& w : p.mine) tensors.emplace_back(w.entry.name, w.tensor);
  const std::string file = rank_file(rank);
  const auto written =
      io::write_safetensors((p.tmp / file).string(), tensors, {{"format", "tessel"}});
  io::write_file_atomic((p.tmp / fmt::format("index.{:05d}.json", rank)).string(),
                        index_fragment(p.mine, file, written).dump());
}

// Rank 0, once every rank's file is written.
void publish(const plan::Config& c, const SavePart& p, int64_t world) {
  write_index(c, p.tmp, p.st, world);
  io::write_file_atomic((p.tmp / "config.yaml").string(), plan::dump_config(c));
  // The marker goes last; only then does the folder get its final name and `latest` point at it.
  io::write_file_atomic((p.tmp / kMarker).string(), std::to_string(p.st.step) + "\n");
  fs::remove_all(p.dir);
  fs::rename(p.tmp, p.dir);
  io::write_file_atomic((p.root / "latest").string(), p.dir.filename().string() + "\n");
  prune(p.root, c.checkpoint.keep, p.st.step);
}

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace

std::string save_checkpoint(const plan::Config& c, const parallel::Mesh& mesh,
                            models::Decoder& model, const optim::FlatAdamW& opt,
                            const optim::LossScaler& scaler, const CheckpointState& st) {
  const auto part = prepare(c, mesh, model, opt, scaler, st);
  write_part(*part, mesh.rank());
  mesh.world_group().barrier();
  if (mesh.rank() == 0) publish(c, *part, mesh.world());
  mesh.world_group().barrier();
  return part->dir.string();
}

AsyncSaver::AsyncSaver(const plan::Config& c, const parallel::Mesh& mesh) : c_(c), mesh_(mesh) {}

AsyncSaver::~AsyncSaver() {
  // Not waited for (the run is failing): the writer stops waiting for the other ranks, whose
  // files may never come, and the save stays unpublished.
  abandon_ = true;
  try {
    wait();
  } catch (const std::exception& e) {
    spdlog::error("checkpoint.async: the save of step {} was not published: {}", step_, e.what());
  }
}

// Polls the store: its wait() cannot be abandoned, and another rank's writer may never report.
void AsyncSaver::wait_keys(c10d::Store& store, const std::vector<std::string>& keys) const {
  while (!store.check(keys)) {
    if (abandon_) throw plan::UserError("abandoned: the run stopped before every rank wrote");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

AsyncSaver::Held AsyncSaver::save(models::Decoder& model, const optim::FlatAdamW& opt,
                                  const optim::LossScaler& scaler, const CheckpointState& st) {
  auto ms_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  };
  Held held;
  auto t0 = std::chrono::steady_clock::now();
  if (writer_.joinable()) {
    if (writing_)  // else it is done: joining it costs nothing, and nothing waits
      spdlog::info("checkpoint.async: step {} waits for step {}'s save, still being written",
                   st.step, step_);
    wait();
    held.wait_ms = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
  }
  before_state_changes();
  auto part = prepare(c_, mesh_, model, opt, scaler, st);
  held.arena_bytes = snapshot(*part, arena_, arena_pinned_);
  device_wait_ = part->copied.wait_on_device;
  dir_ = part->dir.string(), step_ = st.step;
  writing_ = true;
  writer_ = std::thread([this, part] {
    try {
      write(part);
    } catch (...) {
      error_ = std::current_exception();
    }
    writing_ = false;
  });
  held.copy_ms = ms_since(t0);
  return held;
}

void AsyncSaver::before_state_changes() {
  if (device_wait_) std::exchange(device_wait_, nullptr)();
}

std::string AsyncSaver::wait() {
  if (!writer_.joinable()) return "";
  writer_.join();
  std::string dir = std::exchange(dir_, "");
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return dir;
}

// The writer thread: this rank's file, then (through the rendezvous store) rank 0 publishes once
// every rank reported its file written, and the others wait for its word.
void AsyncSaver::write(std::shared_ptr<SavePart> part) {
  const auto t0 = std::chrono::steady_clock::now();
  if (const char* d = std::getenv("TESSEL_TEST_SAVE_DELAY_MS"))  // tests: a write in flight
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(d)));
  const int64_t rank = mesh_.rank(), world = mesh_.world();
  auto* store = mesh_.store();
  std::string mine = "ok";
  try {
    write_part(*part, rank);
  } catch (const std::exception& e) {
    mine = e.what();
  }
  if (world > 1 && store) {
    const std::string key = fmt::format("tessel/checkpoint/{}/", part->st.step);
    store->set(key + std::to_string(rank), bytes_of(mine));
    if (rank != 0) {
      wait_keys(*store, {key + "published"});
      if (auto word = text_of(store->get(key + "published")); word != "ok")
        throw plan::UserError(fmt::format("checkpoint {}: {}", part->dir.string(), word));
      return;
    }
    std::vector<std::string> keys;
    for (int64_t r = 0; r < world; ++r) keys.push_back(key + std::to_string(r));
    wait_keys(*store, keys);
    std::string failed;
    for (int64_t r = 0; r < world; ++r)
      if (auto v = text_of(store->get(keys[static_cast<size_t>(r)])); v != "ok")
        failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ", r, v);
    std::string word = failed.empty() ? "ok" : "not published: " + failed;
    if (failed.empty()) try {
        publish(c_, *part, world);
      } catch (const std::exception& e) {
        word = std::string("not published: ") + e.what();
      }
    store->set(key + "published", bytes_of(word));
    if (word != "ok")
      throw plan::UserError(fmt::format("checkpoint {}: {}", part->dir.string(), word));
  } else {
    if (mine != "ok") throw plan::UserError(mine);
    publish(c_, *part, world);
  }
  spdlog::info("checkpoint {} (written in the background in {:.1f} s)", part->dir.string(),
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace tessel::checkpoint
