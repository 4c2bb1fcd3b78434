#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/observe/tensorboard.h"
#include "engine/data/dataset.h"
#include "engine/data/vocabulary.h"

namespace fs = std::filesystem;

namespace tessel::data {
namespace {

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tessel-data-test-" + std::to_string(getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& bytes) {
    std::ofstream(dir_ / name, std::ios::binary) << bytes;
    return (dir_ / name).string();
  }
  plan::Config plan(const std::string& format, std::vector<std::string> path, int64_t seq_len = 8) {
    plan::Config c = plan::load_config_text("data: {path: x}\n", "t.yaml");
    if (!c.data.format.set_name(format)) throw std::invalid_argument("data.format " + format);
    c.data.path = std::move(path);
    c.data.shuffle = false;
    c.training.seq_len = seq_len;
    return c;
  }
  void expect_error(const std::function<void()>& f, const std::string& part) {
    try {
      f();
      FAIL() << "no error; expected: " << part;
    } catch (const plan::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  fs::path dir_;
};

TEST_F(DataTest, TextToMegatronToSamplesRoundTrip) {
  auto a = write("a.txt", "hello world, this is a text");
  auto b = write("b.txt", "second document \xc3\xa9t\xc3\xa9");
  Dataset text(plan("text", {(dir_ / "*.txt").string()}));
  // The same documents written as .bin/.idx (what tessel-data does) read back identically.
  std::vector<std::vector<uint16_t>> docs;
  for (const auto& f : {a, b}) {
    std::ifstream in(f, std::ios::binary);
    std::string s((std::istreambuf_iterator<char>(in)), {});
    std::vector<uint16_t> d(s.begin(), s.end());
    for (auto& t : d) t &= 0xff;
    d.push_back(static_cast<uint16_t>(kTextEod));
    docs.push_back(d);
  }
  write_megatron((dir_ / "ds").string(), docs);
  Dataset mega(plan("megatron", {(dir_ / "ds").string()}));
  ASSERT_EQ(text.train_samples(), mega.train_samples());
  ASSERT_EQ(text.train_samples(), (27 + 1 + 21 + 1 - 1) / 8);
  auto x = text.train_batch(0, text.train_samples()), y = mega.train_batch(0, mega.train_samples());
  EXPECT_TRUE(torch::equal(x, y));
  // Window i starts at token i·seq_len and carries seq_len+1 tokens; documents end in 256.
  EXPECT_EQ(x[0][0].item<int64_t>(), 'h');
  EXPECT_EQ(x[1][0].item<int64_t>(), x[0][8].item<int64_t>());
  EXPECT_EQ(x[3][3].item<int64_t>(), kTextEod);  // token 27 ends a.txt (27 bytes)
}

TEST_F(DataTest, OrderIsAPureFunctionOfSeedAndEpoch) {
  auto p1 = epoch_permutation(1000, 5, 0), p2 = epoch_permutation(1000, 5, 0);
  EXPECT_EQ(p1, p2);
  EXPECT_NE(p1, epoch_permutation(1000, 5, 1));
  EXPECT_NE(p1, epoch_permutation(1000, 6, 0));
  auto sorted = p1;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(sorted[i], i);
  // Positions past one epoch wrap into the next epoch's order.
  write("a.txt", std::string(400, 'x'));
  plan::Config c = plan("text", {(dir_ / "a.txt").string()});
  c.data.shuffle = true;
  Dataset d(c);
  const int64_t n = d.train_samples();
  auto e1 = epoch_permutation(n, c.run.seed, 1);
  EXPECT_EQ(d.sample_at(n + 3), e1[3]);
}

TEST_F(DataTest, ValidationSplitIsTheEndOfTheStream) {
  std::string s;
  for (int i = 0; i < 200; ++i) s += static_cast<char>('a' + i % 26);
  write("a.txt", s);
  plan::Config c = plan("text", {(dir_ / "a.txt").string()});
  c.data.val_fraction = 0.25;
  Dataset d(c);
  EXPECT_EQ(d.train_tokens(), 201 - 50);
  EXPECT_EQ(d.val_samples(), (50 - 1) / 8);
  auto v = d.split_batch(SampleSplit::kValid, 0, 0, 1);
  EXPECT_EQ(v[0][0].item<int64_t>(), 'a' + (151 % 26));
}

// data.split cuts each dataset by documents (text: files; megatron: sequences) and a tokens file
// by tokens, as Megatron's split matrix; each split reads its own documents only.
TEST_F(DataTest, SplitCutsByDocuments) {
  for (char f : {'a', 'b', 'c', 'd'}) write(std::string(1, f) + ".txt", std::string(40, f));
  plan::Config c = plan("text", {(dir_ / "*.txt").string()});
  c.data.split = "2,1,1";  // 4 files: train a, b; validation c; test d
  Dataset d(c);
  EXPECT_EQ(d.train_tokens(), 2 * 41);
  EXPECT_EQ(d.train_samples(), (82 - 1) / 8);
  ASSERT_EQ(d.sources(SampleSplit::kValid).size(), 1u);
  auto v = d.split_batch(SampleSplit::kValid, 0, 0, d.val_samples());
  EXPECT_TRUE(((v == 'c') | (v == kTextEod)).all().item<bool>());
  auto t = d.split_batch(SampleSplit::kTest, 0, 0, d.sources(SampleSplit::kTest)[0].samples);
  EXPECT_TRUE(((t == 'd') | (t == kTextEod)).all().item<bool>());
  auto x = d.train_batch(0, d.train_samples());
  EXPECT_TRUE(((x == 'a') | (x == 'b') | (x == kTextEod)).all().item<bool>());
  // A split share whose documents hold no sample is refused, naming the key and the split.
  c.data.split = "97,2,1";
  expect_error([&] { Dataset e(c); }, "data.path: the valid split of 4 files holds 0 tokens");
  // A tokens file marks no documents: cut by tokens.
  std::vector<uint16_t> toks(1000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint16_t>(i % 200);
  write("t.u16", std::string(reinterpret_cast<const char*>(toks.data()), toks.size() * 2));
  plan::Config k = plan("tokens", {(dir_ / "t.u16").string()});
  k.data.split = "90,10";
  Dataset e(k);
  EXPECT_EQ(e.train_tokens(), 900);
  EXPECT_EQ(e.split_batch(SampleSplit::kValid, 0, 0, 1)[0][0].item<int64_t>(), 900 % 200);
}

// A .bin whose sequences lie back to back is one span, its documents read from the mapped index;
// one whose sequences lie anywhere (here in reverse) is read sequence by sequence, the same way.
TEST_F(DataTest, MegatronSequencesAnywhereInTheBin) {
  write_megatron((dir_ / "ds").string(), {{10, 11, 12}, {13, 14}});
  plan::Config c = plan("megatron", {(dir_ / "ds").string()}, 2);
  const auto back_to_back = open_stream(c.data);
  ASSERT_EQ(back_to_back.documents(), 2);
  EXPECT_EQ(back_to_back.doc_start(1), 3);
  EXPECT_EQ(back_to_back.megatron_sizes()[1], 2);
  std::string idx;
  {
    std::ifstream in(dir_ / "ds.idx", std::ios::binary);
    idx.assign((std::istreambuf_iterator<char>(in)), {});
  }
  // Pointers (after the 34-byte header and two int32 lengths): sequence 0 at byte 4 (its tokens
  // 2..4 of the .bin), sequence 1 at byte 0; lengths 3 and 2.
  const int64_t ptrs[2] = {4, 0};
  idx.replace(34 + 8, 16, std::string(reinterpret_cast<const char*>(ptrs), 16));
  write("ds.idx", idx);
  const auto anywhere = open_stream(c.data);
  std::vector<int64_t> got(5);
  anywhere.read(0, 5, got.data());
  EXPECT_EQ(got, (std::vector<int64_t>{12, 13, 14, 10, 11}));
  EXPECT_EQ(anywhere.doc_start(1), 3);
  EXPECT_EQ(anywhere.megatron_sizes()[0], 3);
}

TEST_F(DataTest, CorruptIndexGivesClearErrors) {
  write_megatron((dir_ / "ds").string(), {{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}});
  std::string idx;
  {
    std::ifstream in(dir_ / "ds.idx", std::ios::binary);
    idx.assign((std::istreambuf_iterator<char>(in)), {});
  }
  auto prefix = (dir_ / "ds").string();
  write("ds.idx", "XXXXXXXXX" + idx.substr(9));
  expect_error([&] { Dataset d(plan("megatron", {prefix})); },
               "ds.idx: corrupt Megatron index: bad magic");
  write("ds.idx", idx.substr(0, idx.size() - 3));
  expect_error([&] { Dataset d(plan("megatron", {prefix})); },
               "ds.idx: corrupt Megatron index: 1 sequences");
  write("ds.idx", idx);
  std::string bin;
  {
    std::ifstream in(dir_ / "ds.bin", std::ios::binary);
    bin.assign((std::istreambuf_iterator<char>(in)), {});
  }
  write("ds.bin", bin.substr(0, 12));
  expect_error(
      [&] { Dataset d(plan("megatron", {prefix})); },
      "ds.bin: truncated: sequence 0 of " + prefix + ".idx needs bytes up to 20, the file has 12");
}

TEST_F(DataTest, OutOfRangeTokenNamesFileAndSample) {
  std::vector<uint16_t> toks(40, 7);
  toks[21] = 300;
  write("t.u16", std::string(reinterpret_cast<const char*>(toks.data()), toks.size() * 2));
  plan::Config c = plan("tokens", {(dir_ / "t.u16").string()});
  Dataset d(c);
  EXPECT_NO_THROW(d.train_batch(0, 2));  // tokens 0..16
  expect_error([&] { d.train_batch(2, 1); },
               "t.u16 (token 21): token id 300 is outside model.vocab_size 257 (sample 2)");
}

// The start-up scan finds every bad id wherever it sits: either side of a 64Ki-token chunk
// boundary, in the last token of a file, in a later file, as a negative id in signed data; and it
// finds none in clean data, whatever the rank's share.
TEST_F(DataTest, StartUpScanFindsEveryBadIdAndOnlyThose) {
  const int64_t n = 200000;
  for (int64_t pos : {int64_t{0}, int64_t{65535}, int64_t{65536}, int64_t{131073}, n - 1}) {
    std::vector<uint16_t> a(n, 299), b(1000, 3);
    a[pos] = 300;
    write("a.u16", std::string(reinterpret_cast<const char*>(a.data()), a.size() * 2));
    write("b.u16", std::string(reinterpret_cast<const char*>(b.data()), b.size() * 2));
    plan::Config c = plan("tokens", {(dir_ / "*.u16").string()});
    c.model.vocab_size = 300;
    const auto s = open_stream(c.data);
    EXPECT_EQ(s.first_outside(0, s.size(), 300), pos);
    EXPECT_EQ(s.first_outside(0, s.size(), 301), -1);
    EXPECT_EQ(s.first_outside(pos + 1, s.size(), 300), -1);
    for (int64_t world : {1, 2, 3}) {  // exactly one rank's share holds it
      int failed = 0;
      for (int64_t r = 0; r < world; ++r) try {
          check_token_ids(c, r, world);
        } catch (const plan::UserError& e) {
          ++failed;
          EXPECT_NE(std::string(e.what()).find("a.u16 (token " + std::to_string(pos) +
                                               "): token id 300 is outside model.vocab_size 300"),
                    std::string::npos)
              << e.what();
        }
      EXPECT_EQ(failed, 1) << "pos " << pos << " world " << world;
    }
  }
  // In the second file, found by its own index there.
  std::vector<uint16_t> a(5000, 1), b(7000, 2);
  b[6999] = 65535;
  write("a.u16", std::string(reinterpret_cast<const char*>(a.data()), a.size() * 2));
  write("b.u16", std::string(reinterpret_cast<const char*>(b.data()), b.size() * 2));
  plan::Config c = plan("tokens", {(dir_ / "*.u16").string()});
  c.model.vocab_size = 300;
  expect_error([&] { check_token_ids(c, 0, 1); },
               "b.u16 (token 6999): token id 65535 is outside model.vocab_size 300");
  c.model.vocab_size = 65536;  // every uint16 fits: nothing to find
  EXPECT_NO_THROW(check_token_ids(c, 0, 1));
  // A hand-made int32 dataset with a negative id (Megatron's code 4 is signed).
  std::vector<std::vector<uint16_t>> docs = {{1, 2, 3}};
  write_megatron((dir_ / "neg").string(), docs);
  {
    std::ifstream in(dir_ / "neg.idx", std::ios::binary);
    std::string idx((std::istreambuf_iterator<char>(in)), {});
    idx[17] = 4;            // int32 tokens
    const int32_t len = 2;  // one sequence of two of them, at byte 0
    std::memcpy(&idx[34], &len, 4);
    write("neg.idx", idx);
    const int32_t toks[2] = {7, -5};
    write("neg.bin", std::string(reinterpret_cast<const char*>(toks), 8));
  }
  plan::Config m = plan("megatron", {(dir_ / "neg").string()}, 1);
  m.model.vocab_size = 300;
  expect_error([&] { check_token_ids(m, 0, 1); },
               "neg.bin (token 1): token id -5 is outside model.vocab_size 300");
}

TEST_F(DataTest, BadFilesAreNamed) {
  expect_error([&] { Dataset d(plan("text", {(dir_ / "none*.txt").string()})); },
               "matches no file");
  write("odd.u16", "abc");
  expect_error([&] { Dataset d(plan("tokens", {(dir_ / "odd.u16").string()})); },
               "odd.u16: size 3 bytes is not a multiple of 2");
  write("bin.txt", std::string("ok\xff\xfe", 4));
  expect_error([&] { Dataset d(plan("text", {(dir_ / "bin.txt").string()})); },
               "bin.txt: not UTF-8 text (invalid byte at offset 2)");
  write("short.txt", "abc");
  expect_error([&] { Dataset d(plan("text", {(dir_ / "short.txt").string()})); }, "not one sample");
}

// The validator accepts exactly what Python's strict UTF-8 decoder (the tokenizer helper) accepts.
// What tessel-data records beside a dataset: another tokenizer, a larger vocabulary, another
// end-of-document id are refused naming the dataset; data.document_mask takes the recorded id.
TEST_F(DataTest, VocabularyRecordsCheckedPerDataset) {
  std::vector<std::string> prefixes;
  for (const char* name : {"web", "code", "books"}) {
    const std::string prefix = (dir_ / name).string();
    data::MegatronWriter w(prefix, 300);
    const std::vector<uint32_t> doc{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
    w.add(doc.data(), static_cast<int64_t>(doc.size()));
    w.finish();
    prefixes.push_back(prefix);
  }
  write_vocabulary(prefixes[0], {300, 299, "<eos>", "tok.json", "00aa"});
  write_vocabulary(prefixes[1], {300, 299, "<eos>", "copy/tok.json", "00aa"});
  auto c = plan("megatron", {});
  c.model.vocab_size = 300;
  c.data.blend = {{0.5, {prefixes[0]}}, {0.5, {prefixes[1]}}, {0.5, {prefixes[2]}}};
  EXPECT_NO_THROW(check_vocabularies(c));  // the same tokenizer; books has no record
  EXPECT_EQ(document_eod(c), -1) << "no document mask";
  c.data.document_mask = true;
  EXPECT_EQ(document_eod(c), 299) << "the records' id";
  c.data.eod_token = 7;
  expect_error([&] { document_eod(c); },
               "data.eod_token: data.blend item 1 (" + prefixes[0] +
                   ") ends its documents with id 299 (<eos>), not data.eod_token 7");
  c.data.eod_token = -1;
  write_vocabulary(prefixes[1], {300, 0, "<s>", "other.json", "00bb"});
  expect_error([&] { check_vocabularies(c); },
               "data.blend item 2 (" + prefixes[1] +
                   ") was tokenized by tokenizer other.json [00bb], and data.blend item 1 (" +
                   prefixes[0] + ") by tokenizer tok.json [00aa]");
  write_vocabulary(prefixes[1], {300, 299, "<eos>", "tok.json", "00aa"});
  c.model.vocab_size = 280;
  expect_error([&] { check_vocabularies(c); },
               "data.blend item 1 (" + prefixes[0] +
                   ") was tokenized with a vocabulary of 300 ids (tokenizer tok.json [00aa]); "
                   "model.vocab_size is 280");
  // No record anywhere: the mask needs data.eod_token.
  c.data.blend = {{1.0, {prefixes[2]}}};
  expect_error([&] { document_eod(c); },
               "data.eod_token: data.document_mask and data.eod_mask_loss act after each "
               "end-of-document token, and no dataset records");
  write(std::string("books.tessel.json"), "{\"format\": 3}");
  expect_error([&] { document_eod(c); }, "books.tessel.json: not a vocabulary record");
}

TEST(Utf8, WellFormedOnly) {
  struct Case {
    std::string bytes;
    int64_t error;  // offset of the first bad sequence, -1 when well formed
  };
  const std::vector<Case> cases = {
      {"plain ascii", -1},
      {"\xC3\xA9t\xC3\xA9", -1},  // é
      {"\xE2\x82\xAC", -1},       // €
      {"\xF0\x9F\x98\x80", -1},   // U+1F600
      {"\xED\x9F\xBF", -1},       // U+D7FF, the last before the surrogates
      {"\xF4\x8F\xBF\xBF", -1},   // U+10FFFF
      {"ab\xC0\x80", 2},          // overlong NUL (modified UTF-8)
      {"\xC1\xBF", 0},            // overlong
      {"\xE0\x80\xAF", 0},        // overlong 3-byte
      {"x\xF0\x80\x80\xAF", 1},   // overlong 4-byte
      {"\xED\xA0\x80", 0},        // surrogate U+D800
      {"\xF4\x90\x80\x80", 0},    // U+110000
      {"\xF5\x80\x80\x80", 0},    // lead past F4
      {"ok\xE2\x82", 2},          // truncated at the end
      {"\xE2(\xAC", 0},           // bad continuation
      {"\x80", 0},                // lone continuation
  };
  for (const auto& c : cases)
    EXPECT_EQ(utf8_error(reinterpret_cast<const uint8_t*>(c.bytes.data()),
                         static_cast<int64_t>(c.bytes.size())),
              c.error)
        << testing::PrintToString(c.bytes);
}

}  // namespace
}  // namespace tessel::data

namespace tessel::data {
namespace {

TEST_F(DataTest, WriterPicks16Or32BitTokensAndReadsBack) {
  const std::vector<std::vector<uint32_t>> docs = {{1, 70000, 65536, 5}, {}, {131071, 2}};
  for (int64_t vocab : {int64_t{65536}, int64_t{131072}}) {
    const auto prefix = (dir_ / ("v" + std::to_string(vocab))).string();
    {
      data::MegatronWriter w(prefix, vocab);
      if (vocab <= 65536) {  // 16-bit tokens: ids past the vocabulary are refused, never cut
        expect_error([&] { w.add(docs[0].data(), 4); },
                     "document 0 token 1: id 70000 is outside the vocabulary of 65536 ids");
        const std::vector<uint32_t> ok = {1, 65535, 5};
        w.add(ok.data(), 3);
        EXPECT_EQ(w.elem_size(), 2);
        w.finish();
        data::TokenStream s;
        data::add_megatron(s, prefix);
        std::vector<int64_t> got(3);
        s.read(0, 3, got.data());
        EXPECT_EQ(got, (std::vector<int64_t>{1, 65535, 5}));
        continue;
      }
      for (const auto& d : docs) w.add(d.data(), static_cast<int64_t>(d.size()));
      EXPECT_EQ(w.elem_size(), 4);
      EXPECT_FALSE(fs::exists(prefix + ".idx"));  // nothing is visible before finish()
      w.finish();
    }
    data::TokenStream s;
    data::add_megatron(s, prefix);
    ASSERT_EQ(s.size(), 6);
    std::vector<int64_t> got(6);
    s.read(0, 6, got.data());
    EXPECT_EQ(got, (std::vector<int64_t>{1, 70000, 65536, 5, 131071, 2}));
  }
  {  // an unfinished writer leaves nothing behind
    data::MegatronWriter w((dir_ / "partial").string(), 300);
    const uint32_t t[] = {1, 2};
    w.add(t, 2);
  }
  EXPECT_FALSE(fs::exists(dir_ / "partial.bin") || fs::exists(dir_ / "partial.bin.tmp"));
}

TEST(TensorBoard, Crc32cKnownVectorAndRecordFraming) {
  EXPECT_EQ(observe::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  const auto dir = fs::temp_directory_path() / ("tessel-tb-" + std::to_string(getpid()));
  std::string path;
  {
    observe::TensorBoardWriter w(dir.string());
    w.scalars(7, {{"train/loss", 2.5}});
    path = w.path();
  }
  std::ifstream f(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // Two records (file_version, then the scalar), each 8 + 4 + payload + 4 bytes.
  size_t at = 0;
  int records = 0;
  while (at < bytes.size()) {
    uint64_t len;
    std::memcpy(&len, bytes.data() + at, 8);
    ASSERT_LE(at + 16 + len, bytes.size());
    at += 16 + len;
    ++records;
  }
  EXPECT_EQ(records, 2);
  EXPECT_NE(bytes.find("train/loss"), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessel::data
