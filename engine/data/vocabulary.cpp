#include "engine/data/vocabulary.h"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "engine/data/dataset.h"
#include "engine/data/files.h"
#include "engine/io/checksum.h"

namespace tessel::data {
namespace {

constexpr const char* kFormat = "tessel-data vocabulary 1";

// One Megatron dataset with a record: its key, its prefix, the record.
struct Recorded {
  std::string key, prefix;
  DataVocabulary v;
  std::string who() const { return fmt::format("{} ({})", key, prefix); }
  std::string tokens() const {
    return v.fingerprint == "bytes" ? "byte tokens"
                                    : fmt::format("tokenizer {} [{}]", v.tokenizer, v.fingerprint);
  }
};

std::vector<Recorded> recorded(const plan::DataConfig& d) {
  std::vector<Recorded> out;
  if (d.format != plan::DataFormat::kMegatron) return out;
  for (const auto& [key, prefixes] : named_datasets(d))
    for (const auto& prefix : prefixes)
      if (auto v = read_vocabulary(prefix, key)) out.push_back({key, prefix, *v});
  return out;
}

}  // namespace

std::string vocabulary_path(const std::string& prefix) { return prefix + ".tessel.json"; }

void write_vocabulary(const std::string& prefix, const DataVocabulary& v) {
  const std::string path = vocabulary_path(prefix), tmp = path + ".tmp";
  const nlohmann::json j = {
      {"format", kFormat},       {"vocab_size", v.size},     {"eod", v.eod},
      {"eod_token", v.eod_text}, {"tokenizer", v.tokenizer}, {"tokenizer_checksum", v.fingerprint}};
  {
    std::ofstream f(tmp);
    f << j.dump(1) << "\n";
    if (!f.flush())
      throw plan::UserError(fmt::format("{}: cannot write the dataset's vocabulary", tmp));
  }
  std::filesystem::rename(tmp, path);
}

std::optional<DataVocabulary> read_vocabulary(const std::string& prefix, const std::string& key) {
  const std::string path = vocabulary_path(prefix);
  const auto text = read_regular(path, key);  // a FIFO or a device is refused, never waited on
  if (!text) return std::nullopt;
  try {
    const auto j = nlohmann::json::parse(*text);
    if (j.at("format").get<std::string>() != kFormat)
      throw std::runtime_error("format '" + j.at("format").get<std::string>() + "'");
    // Each id field an integer in its range (a float or a string is not taken as one).
    auto integer = [&j](const char* field) {
      const auto& v = j.at(field);
      if (!v.is_number_integer())
        throw std::runtime_error(fmt::format("field {} is {}, not an integer", field, v.dump()));
      return v.get<int64_t>();
    };
    const int64_t size = integer("vocab_size"), eod = integer("eod");
    if (size <= 0)
      throw std::runtime_error(fmt::format("field vocab_size is {}: it must be positive", size));
    if (eod < 0 || eod >= size)
      throw std::runtime_error(fmt::format(
          "field eod is {}: an id of the vocabulary, in [0, vocab_size {})", eod, size));
    return DataVocabulary{size, eod, j.at("eod_token").get<std::string>(),
                          j.at("tokenizer").get<std::string>(),
                          j.at("tokenizer_checksum").get<std::string>()};
  } catch (const std::exception& e) {
    throw plan::UserError(fmt::format(
        "{}: {}: not a vocabulary record tessel-data wrote ({}); remake the dataset with "
        "tessel-data, or remove the file to check the dataset by its token ids alone",
        key, path, e.what()));
  }
}

std::string tokenizer_fingerprint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw plan::UserError(path + ": cannot read the tokenizer");
  io::Checksum sum;
  std::vector<char> buf(1 << 20);
  while (f.read(buf.data(), static_cast<std::streamsize>(buf.size())) || f.gcount() > 0)
    sum.update(buf.data(), static_cast<size_t>(f.gcount()));
  return fmt::format("{:016x}", sum.digest());
}

void check_vocabularies(const plan::Config& c) {
  const auto all = recorded(c.data);
  for (const auto& r : all) {
    if (r.v.size > c.model.vocab_size)
      throw plan::UserError(fmt::format(
          "{} was tokenized with a vocabulary of {} ids ({}); model.vocab_size is {}: the model "
          "has no embedding for the ids above it",
          r.who(), r.v.size, r.tokens(), c.model.vocab_size));
    if (r.v.fingerprint != all[0].v.fingerprint)
      throw plan::UserError(fmt::format(
          "{} was tokenized by {}, and {} by {}: their ids name other tokens, and one model "
          "reads one vocabulary (remake one with the other's tokenizer)",
          r.who(), r.tokens(), all[0].who(), all[0].tokens()));
  }
  eod_id(c);
}

int64_t document_eod(const plan::Config& c) { return c.data.document_mask ? eod_id(c) : -1; }

int64_t loss_mask_eod(const plan::Config& c) { return c.data.eod_mask_loss ? eod_id(c) : -1; }

int64_t eod_id(const plan::Config& c) {
  const auto& d = c.data;
  if (!d.document_mask && !d.eod_mask_loss) return -1;
  const auto all = recorded(d);
  for (const auto& r : all) {
    const int64_t want = d.eod_token >= 0 ? d.eod_token : all[0].v.eod;
    if (r.v.eod != want)
      throw plan::UserError(fmt::format(
          "data.eod_token: {} ends its documents with id {} ({}), {}", r.who(), r.v.eod,
          r.v.eod_text,
          d.eod_token >= 0
              ? fmt::format("not data.eod_token {}", d.eod_token)
              : fmt::format("{} with id {}: give data.eod_token", all[0].who(), all[0].v.eod)));
  }
  if (d.eod_token >= 0) return d.eod_token;
  if (d.format == plan::DataFormat::kText) return kTextEod;
  if (!all.empty()) return all[0].v.eod;
  throw plan::UserError(
      "data.eod_token: data.document_mask and data.eod_mask_loss act after each end-of-document "
      "token, and no dataset records which id that is (tessel-data writes PREFIX.tessel.json; "
      "these "
      "datasets have none): give data.eod_token (the tokenizer's, e.g. 50256 for GPT-2, 128001 "
      "for Llama 3)");
}

}  // namespace tessel::data
