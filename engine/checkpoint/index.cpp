#include "engine/checkpoint/index.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "core/plan/user_error.h"
#include "engine/io/weights.h"

namespace fs = std::filesystem;

namespace tessel::checkpoint {
namespace {

// The dtypes a checkpoint holds, as the writer records them (c10::toString).
const std::set<std::string>& known_dtypes() {
  static const std::set<std::string> names = [] {
    std::set<std::string> s;
    for (auto t : {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64,
                   torch::kInt64, torch::kInt32})
      s.insert(c10::toString(t));
    return s;
  }();
  return names;
}

// Checks of one index.json, each error naming the file and the key.
class IndexCheck {
 public:
  explicit IndexCheck(fs::path path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw plan::UserError(
        fmt::format("{}: {}: {}; the checkpoint is damaged or was not written by "
                    "Tessel, and is not loaded",
                    path_.string(), key, what));
  }

  const nlohmann::json& at(const nlohmann::json& j, const std::string& parent,
                           const std::string& key) const {
    if (!j.is_object() || !j.contains(key)) fail(parent + key, "missing");
    return j.at(key);
  }

  // An integer in [lo, hi]: a float (1e30), a string or a negative count is refused.
  int64_t integer(const nlohmann::json& v, const std::string& key, int64_t lo,
                  int64_t hi = kMaxIndexInteger) const {
    if (!v.is_number_integer()) fail(key, "expected an integer, got " + v.dump());
    // A parsed non-negative number is unsigned in nlohmann::json; compare it as one.
    if (v.is_number_unsigned()
            ? (v.get<uint64_t>() > static_cast<uint64_t>(hi) ||
               v.get<uint64_t>() < static_cast<uint64_t>(std::max<int64_t>(lo, 0)))
            : (v.get<int64_t>() < lo || v.get<int64_t>() > hi))
      fail(key, fmt::format("{} is outside [{}, {}]", v.dump(), lo, hi));
    return v.get<int64_t>();
  }

  // [begin, end) with 0 <= begin <= end <= limit.
  std::pair<int64_t, int64_t> range(const nlohmann::json& v, const std::string& key,
                                    int64_t limit) const {
    if (!v.is_array() || v.size() != 2) fail(key, "expected [begin, end], got " + v.dump());
    const int64_t b = integer(v[0], key + "[0]", 0), e = integer(v[1], key + "[1]", 0);
    if (b > e || e > limit)
      fail(key, fmt::format("[{}, {}) is not a range inside [0, {})", b, e, limit));
    return {b, e};
  }

  void file_entry(const std::string& name, const nlohmann::json& f) const {
    const std::string key = "files." + name;
    io::check_plain_name(name, path_.string() + ": " + key);
    integer(at(f, key + ".", "bytes"), key + ".bytes", 0);
    if (!at(f, key + ".", "checksum").is_string()) fail(key + ".checksum", "expected a string");
  }

  void tensor(const std::string& name, const nlohmann::json& t, const nlohmann::json& files) const {
    const std::string key = "tensors." + name;
    const auto& shape_json = at(t, key + ".", "shape");
    if (!shape_json.is_array() || shape_json.size() > 8)
      fail(key + ".shape", "expected at most 8 dimensions, got " + shape_json.dump());
    std::vector<int64_t> shape;
    double numel = 1;
    for (size_t d = 0; d < shape_json.size(); ++d) {
      shape.push_back(integer(shape_json[d], fmt::format("{}.shape[{}]", key, d), 0));
      numel *= static_cast<double>(shape.back());
    }
    if (numel > static_cast<double>(kMaxIndexInteger))
      fail(key + ".shape", fmt::format("{} elements is more than any tensor can hold", numel));
    const auto& dtype = at(t, key + ".", "dtype");
    if (!dtype.is_string() || !known_dtypes().count(dtype.get<std::string>()))
      fail(key + ".dtype", fmt::format("expected one of {}, got {}",
                                       fmt::join(known_dtypes(), ", "), dtype.dump()));
    const auto& shards = at(t, key + ".", "shards");
    if (!shards.is_array() || shards.empty()) fail(key + ".shards", "expected a list of shards");
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string s = fmt::format("{}.shards[{}]", key, i);
      const auto& file = at(shards[i], s + ".", "file");
      if (!file.is_string()) fail(s + ".file", "expected a file name, got " + file.dump());
      io::check_plain_name(file.get<std::string>(), path_.string() + ": " + s + ".file");
      if (!files.contains(file.get<std::string>()))
        throw plan::UserError(fmt::format(
            "{}: index.json records no size and checksum for {}, so it cannot be verified (a "
            "checkpoint written before checksums existed, or an edited index); refusing to load "
            "it. Resume from a checkpoint written by this version (checkpoint.resume)",
            path_.string(), file.get<std::string>()));
      const auto& slice = at(shards[i], s + ".", "slice");
      if (!slice.is_array() || slice.size() != shape.size())
        fail(s + ".slice", fmt::format("expected {} ranges (one per dimension), got {}",
                                       shape.size(), slice.dump()));
      int64_t extent = 1;
      for (size_t d = 0; d < shape.size(); ++d) {
        const auto [b, e] = range(slice[d], fmt::format("{}.slice[{}]", s, d), shape[d]);
        extent *= e - b;
      }
      if (shards[i].contains("flat")) range(shards[i].at("flat"), s + ".flat", extent);
    }
  }

 private:
  fs::path path_;
};

}  // namespace

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw plan::UserError(p.string() + ": cannot read");
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

nlohmann::json read_index(const fs::path& dir) {
  const fs::path path = dir / "index.json";
  if (!fs::exists(path))
    throw plan::UserError(
        fmt::format("{}: missing: every complete checkpoint folder holds one (this folder has the "
                    "COMPLETE marker but no index: a damaged copy); resume from another checkpoint",
                    path.string()));
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_text(path));
  } catch (const nlohmann::json::exception& e) {
    throw plan::UserError(path.string() + ": not valid JSON: " + e.what());
  }
  const IndexCheck check(path);
  if (!index.is_object()) check.fail("(top level)", "expected an object");
  if (const auto& f = check.at(index, "", "format"); f != "tessel-checkpoint-1")
    check.fail("format", "expected \"tessel-checkpoint-1\", got " + f.dump());
  const int64_t step = check.integer(check.at(index, "", "step"), "step", 0);
  // A step reads at most training.global_batch's bound of samples (4M): a larger count is not
  // a run's, and would send a blend's walk to its position for ever.
  check.integer(
      check.at(index, "", "consumed_samples"), "consumed_samples", 0,
      step > kMaxIndexInteger / (int64_t{4} << 20) ? kMaxIndexInteger : step * (int64_t{4} << 20));
  check.integer(check.at(index, "", "world_size"), "world_size", 1, int64_t{1} << 24);
  // A step_<N> folder holds step N (a copy under another name is not held to it).
  std::smatch m;
  const std::string folder = fs::absolute(dir).lexically_normal().filename().string();
  if (std::regex_match(folder, m, std::regex("step_([0-9]{1,15})")) && std::stoll(m[1]) != step)
    check.fail("step", fmt::format("{} in folder {}", step, folder));
  // Without "files" every shard is refused below as unverifiable, naming its file.
  const auto& files = index.contains("files") ? index.at("files") : nlohmann::json::object();
  if (!files.is_object()) check.fail("files", "expected an object");
  for (const auto& [name, f] : files.items()) check.file_entry(name, f);
  const auto& tensors = check.at(index, "", "tensors");
  if (!tensors.is_object()) check.fail("tensors", "expected an object");
  for (const auto& [name, t] : tensors.items()) check.tensor(name, t, files);
  return index;
}

std::unique_ptr<io::MappedSafetensors> open_verified(const fs::path& dir,
                                                     const nlohmann::json& index,
                                                     const std::string& file) {
  io::check_plain_name(file, (dir / "index.json").string());
  const fs::path path = dir / file;
  std::error_code ec;
  const auto real = fs::canonical(path, ec);
  const auto folder = fs::canonical(dir, ec);
  if (!ec && real.parent_path() != folder)
    throw plan::UserError(fmt::format(
        "{}: a link to {}, outside the checkpoint folder; the checkpoint is not loaded (copy the "
        "file into the folder)",
        path.string(), real.string()));
  const auto& want = index.at("files").at(file);
  const auto bytes = want.at("bytes").get<uint64_t>();
  const auto sum = want.at("checksum").get<std::string>();
  auto corrupt = [&](const std::string& found) {
    return plan::UserError(fmt::format(
        "{}: corrupt checkpoint file: {}, but {} bytes with checksum {} when it was written "
        "(index.json); resume from another checkpoint (checkpoint.resume)",
        path.string(), found, bytes, sum));
  };
  if (const auto size = fs::file_size(path, ec); !ec && size != bytes)
    throw corrupt(fmt::format("{} bytes", size));
  std::unique_ptr<io::MappedSafetensors> f;
  try {
    f = std::make_unique<io::MappedSafetensors>(path.string());
  } catch (const plan::UserError& e) {
    throw corrupt(e.what());
  }
  if (const auto got = f->checksum(); got != sum)
    throw corrupt(fmt::format("{} bytes with checksum {}", f->bytes(), got));
  return f;
}

std::vector<int64_t> shard_shape(const nlohmann::json& shard) {
  if (shard.contains("flat"))
    return {shard.at("flat")[1].get<int64_t>() - shard.at("flat")[0].get<int64_t>()};
  std::vector<int64_t> out;
  for (const auto& r : shard.at("slice")) out.push_back(r[1].get<int64_t>() - r[0].get<int64_t>());
  return out;
}

void check_shard_tensor(const fs::path& file, const std::string& name, const nlohmann::json& entry,
                        const nlohmann::json& shard, const torch::Tensor& part) {
  const std::string dtype = entry.at("dtype");
  const auto shape = shard_shape(shard);
  if (c10::toString(part.scalar_type()) != dtype || part.sizes().vec() != shape)
    throw plan::UserError(fmt::format(
        "{}: tensor '{}' is {} [{}] in the file, but index.json says {} [{}] for this shard; "
        "the checkpoint is damaged and is not loaded",
        file.string(), name, c10::toString(part.scalar_type()), fmt::join(part.sizes(), ", "),
        dtype, fmt::join(shape, ", ")));
}

}  // namespace tessel::checkpoint
