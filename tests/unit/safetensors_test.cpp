#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/plan/config.h"
#include "engine/io/checksum.h"
#include "engine/io/safetensors.h"
#include "engine/io/weights.h"

namespace fs = std::filesystem;

namespace tessel {
namespace {

std::string tmp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("tessel-st-" + std::to_string(getpid()) + "-" + name))
      .string();
}

// A file with a hand-written header, to exercise the checks.
std::string raw_file(const std::string& name, const std::string& header, size_t data_bytes) {
  std::string path = tmp_path(name);
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << std::string(data_bytes, '\0');
  return path;
}

void expect_refused(const std::string& path, const std::string& part) {
  try {
    io::read_safetensors(path);
    FAIL() << "accepted " << path;
  } catch (const plan::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
  fs::remove(path);
}

TEST(Safetensors, RoundTripsEveryDtype) {
  std::vector<std::pair<std::string, torch::Tensor>> ts = {
      {"a.weight", torch::randn({3, 5})},
      {"b", torch::randn({7}).to(torch::kBFloat16)},
      {"c", torch::arange(10, torch::kInt64).view({2, 5})},
      {"d", torch::ones({2, 2}, torch::kInt32)},
      {"e", torch::empty({0, 4})},
      {"f.strided", torch::randn({4, 6}).t()}};  // written in its logical (row-major) order
  std::string path = tmp_path("rt.safetensors");
  const auto written = io::write_safetensors(path, ts, {{"format", "pt"}});
  auto back = io::read_safetensors(path);
  EXPECT_EQ(back.metadata.at("format"), "pt");
  // The checksum of what was written is the checksum of the file read back.
  EXPECT_EQ(written.bytes, fs::file_size(path));
  EXPECT_EQ(back.bytes, written.bytes);
  EXPECT_EQ(back.checksum, written.checksum);
  ASSERT_EQ(back.tensors.size(), ts.size());
  for (const auto& [name, t] : ts) EXPECT_TRUE(torch::equal(back.tensors.at(name), t)) << name;
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  fs::remove(path);
}

TEST(Checksum, DependsOnTheBytesOnlyAndSeesEveryFlip) {
  std::vector<uint8_t> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + 7);
  io::Checksum whole;
  whole.update(data.data(), data.size());
  for (size_t split : {0, 1, 7, 31, 32, 33, 500, 999, 1000}) {  // any split: the same value
    io::Checksum parts;
    parts.update(data.data(), split);
    parts.update(data.data() + split, data.size() - split);
    EXPECT_EQ(parts.hex(), whole.hex()) << split;
  }
  for (size_t at : {0, 13, 31, 32, 500, 990, 999}) {  // any single bit flip: another value
    auto flipped = data;
    flipped[at] ^= 4;
    io::Checksum c;
    c.update(flipped.data(), flipped.size());
    EXPECT_NE(c.hex(), whole.hex()) << at;
  }
  io::Checksum shorter;  // a truncated file: another value
  shorter.update(data.data(), data.size() - 1);
  EXPECT_NE(shorter.hex(), whole.hex());
  EXPECT_EQ(whole.hex().size(), 16u);
}

TEST(Safetensors, RefusesBadFiles) {
  expect_refused(
      raw_file(
          "dup",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          8),
      "duplicate tensor name 'a'");
  expect_refused(
      raw_file(
          "overlap",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12),
      "tensors 'a' and 'b' overlap");
  expect_refused(raw_file("range", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
                 "tensor 'a': data_offsets [0, 16] out of range of the 8-byte data section");
  expect_refused(raw_file("size", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                 "tensor 'a': holds 8 bytes but its shape and dtype need 12");
  expect_refused(raw_file("dtype", R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", 1),
                 "unsupported dtype \"Q4\"");
  expect_refused(raw_file("json", "{not json", 0), "header is not JSON");
  // A header length over 100 MB is refused before anything is read.
  std::string path = tmp_path("huge");
  {
    std::ofstream f(path, std::ios::binary);
    uint64_t n = (100ull << 20) + 1;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << "{}";
  }
  expect_refused(path, "exceeds the 100 MB limit");
  expect_refused(tmp_path("missing"), "cannot open");
  std::string tiny = tmp_path("tiny");
  std::ofstream(tiny) << "abc";
  expect_refused(tiny, "shorter than its 8-byte header length");
}

// A Hugging Face folder of two shards and its index: every tensor a view of its shard; and every
// crafted index refused with the file and the key named, before anything is loaded.
TEST(MappedWeights, ReadsShardedFoldersAndRefusesCraftedIndexes) {
  const fs::path dir = tmp_path("shards");
  fs::create_directories(dir);
  const auto a = torch::arange(12, torch::kFloat32).view({3, 4}), b = torch::ones({5});
  io::write_safetensors((dir / "model-00001-of-00002.safetensors").string(), {{"a", a}});
  io::write_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"b", b}});
  auto index = [&](const std::string& weight_map) {
    std::ofstream(dir / io::kShardIndex)
        << R"({"metadata": {"total_size": 68}, "weight_map": )" << weight_map << "}";
  };
  index(R"({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})");
  {
    const io::MappedWeights w(dir.string(), "model.init_from");
    EXPECT_EQ(w.files(), 2u);
    EXPECT_EQ(w.source(), (dir / io::kShardIndex).string());
    EXPECT_TRUE(torch::equal(w.tensors().at("a"), a));
    EXPECT_TRUE(torch::equal(w.tensors().at("b"), b));
  }
  auto refused = [&](const std::string& weight_map, const std::string& part) {
    index(weight_map);
    try {
      io::MappedWeights w(dir.string(), "model.init_from");
      ADD_FAILURE() << weight_map << ": loaded";
    } catch (const plan::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  const std::string where = (dir / io::kShardIndex).string() + ": weight_map.";
  refused(R"({"a": "../../etc/x.safetensors", "b": "model-00002-of-00002.safetensors"})",
          where + "a: '../../etc/x.safetensors' is not a plain file name inside the model folder");
  refused(R"({"a": "/etc/x.safetensors"})", "is not a plain file name inside the model folder");
  refused(R"({"a": "model-00001-of-00002.safetensors", "b": "gone.safetensors"})",
          where + "b: shard " + (dir / "gone.safetensors").string() + " does not exist");
  refused(R"({"a": "model-00002-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})",
          where + "a names shard " + (dir / "model-00002-of-00002.safetensors").string() +
              ", which holds no such tensor");
  refused(R"({"b": "model-00002-of-00002.safetensors", "a": "model-00001-of-00002.safetensors",
             "c": "model-00001-of-00002.safetensors"})",
          "weight_map.c names shard");
  index(R"({"a": "model-00001-of-00002.safetensors"})");  // a shard the map never names: unread
  EXPECT_EQ(io::MappedWeights(dir.string(), "model.init_from").tensors().size(), 1u);
  refused(R"({})", "weight_map: expected an object of tensor names to shard files");
  refused(R"({"a": 3})", where + "a: expected a shard file name, got 3");
  refused(R"(["a"])", "weight_map: expected an object");
  // A shard holding a tensor the map gives to another shard.
  io::write_safetensors((dir / "model-00002-of-00002.safetensors").string(), {{"b", b}, {"a", a}});
  refused(R"({"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})",
          "holds tensor 'a', which the weight_map gives to model-00001-of-00002.safetensors");
  fs::remove(dir / io::kShardIndex);
  try {
    io::MappedWeights w(dir.string(), "--weights");
    ADD_FAILURE() << "a folder without an index or model.safetensors loaded";
  } catch (const plan::UserError& e) {
    EXPECT_NE(
        std::string(e.what()).find("--weights: " + dir.string() + " is a folder with neither"),
        std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessel
