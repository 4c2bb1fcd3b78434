// tessel-data: text or JSONL corpora -> a Megatron-LM .bin/.idx dataset. With --tokenizer, a
// Hugging Face tokenizer.json encodes the documents (one helper process per worker thread);
// without, tokens are bytes 0-255 with end-of-document 256 (data.format text's vocabulary).
// One reader thread cuts documents into chunks, the workers encode them, and the main thread
// writes the chunks in input order, so the output does not depend on --workers.
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <thread>

#include "core/plan/config.h"
#include "engine/cli/cli_checks.h"
#include "engine/data/data.h"
#include "engine/data/vocabulary.h"
#include "engine/io/tokenizer.h"

namespace {
namespace fs = std::filesystem;

struct Options {
  std::vector<std::string> inputs;
  std::string out, tokenizer, input_format = "auto", key = "text", eod, python;
  int workers = 0;
  bool no_special = false, progress = true;
};

struct Chunk {
  std::vector<std::string> texts;
  int64_t bytes = 0;
  std::vector<std::vector<uint32_t>> ids;
};

// The pipeline's shared state: chunks in flight, results by index, and the first error.
class Pipeline {
 public:
  explicit Pipeline(size_t capacity) : capacity_(capacity) {}
  bool push(Chunk c) {  // reader; false once stopped
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return stop_ || todo_.size() + done_.size() < capacity_; });
    if (stop_) return false;
    todo_.emplace_back(next_in_++, std::move(c));
    cv_.notify_all();
    return true;
  }
  void close() {
    std::lock_guard<std::mutex> l(m_);
    closed_ = true;
    cv_.notify_all();
  }
  bool pop(int64_t& index, Chunk& c) {  // worker
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return stop_ || closed_ || !todo_.empty(); });
    if (stop_ || todo_.empty()) return false;
    index = todo_.front().first;
    c = std::move(todo_.front().second);
    todo_.pop_front();
    return true;
  }
  void done(int64_t index, Chunk c) {
    std::lock_guard<std::mutex> l(m_);
    done_.emplace(index, std::move(c));
    cv_.notify_all();
  }
  // Writer: the next chunk in input order; false at the end (or after an error).
  bool next(Chunk& c, std::chrono::milliseconds wait) {
    std::unique_lock<std::mutex> l(m_);
    while (true) {
      if (stop_) return false;
      auto it = done_.find(next_out_);
      if (it != done_.end()) {
        c = std::move(it->second);
        done_.erase(it);
        ++next_out_;
        cv_.notify_all();
        return true;
      }
      if (closed_ && next_out_ == next_in_) return false;
      if (cv_.wait_for(l, wait) == std::cv_status::timeout) {
        c = Chunk{};
        c.bytes = -1;  // nothing yet: the caller refreshes its progress line
        return true;
      }
    }
  }
  void fail(std::exception_ptr e) {
    std::lock_guard<std::mutex> l(m_);
    if (!error_) error_ = e;
    stop_ = true;
    cv_.notify_all();
  }
  void rethrow() {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  size_t capacity_;
  std::deque<std::pair<int64_t, Chunk>> todo_;
  std::map<int64_t, Chunk> done_;
  int64_t next_in_ = 0, next_out_ = 0;
  bool closed_ = false, stop_ = false;
  std::exception_ptr error_;
};

std::string format_of(const Options& o, const std::string& file) {
  if (o.input_format != "auto") return o.input_format;
  auto ext = fs::path(file).extension().string();
  return ext == ".jsonl" || ext == ".json" || ext == ".ndjson" ? "jsonl" : "text";
}

// Collects documents into chunks of about 1 MiB and pushes each full one.
class Chunker {
 public:
  Chunker(Pipeline& p, std::atomic<int64_t>& skipped) : p_(p), skipped_(skipped) {}
  // False once the pipeline has stopped.
  bool add(std::string text, const std::string& where) {
    const auto* b = reinterpret_cast<const uint8_t*>(text.data());
    if (int64_t bad = tessel::data::utf8_error(b, static_cast<int64_t>(text.size())); bad >= 0)
      throw tessel::plan::UserError(where + ": not UTF-8 (invalid byte at offset " +
                                    std::to_string(bad) + ")");
    if (text.empty()) {
      ++skipped_;
      return true;
    }
    c_.bytes += static_cast<int64_t>(text.size());
    c_.texts.push_back(std::move(text));
    if (c_.bytes < kChunkBytes) return true;
    bool ok = p_.push(std::move(c_));
    c_ = Chunk{};
    return ok;
  }
  void flush() {
    if (!c_.texts.empty()) p_.push(std::move(c_));
  }

 private:
  static constexpr int64_t kChunkBytes = 1 << 20;
  Pipeline& p_;
  std::atomic<int64_t>& skipped_;
  Chunk c_;
};

// A text file is one document. False once the pipeline has stopped.
bool read_text_file(std::ifstream& f, const std::string& file, std::atomic<int64_t>& read_bytes,
                    Chunker& chunks) {
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  read_bytes += static_cast<int64_t>(text.size());
  return chunks.add(std::move(text), file);
}

// The document of one JSONL line: its --text-key field, which must be a string.
std::string jsonl_document(const Options& o, const std::string& line, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const std::exception& e) {
    throw tessel::plan::UserError(where + ": not a JSON object (" + e.what() + ")");
  }
  if (!j.is_object()) throw tessel::plan::UserError(where + ": a JSON value, not an object");
  if (!j.contains(o.key)) {
    std::string keys;
    for (auto& [name, _] : j.items()) keys += (keys.empty() ? "" : ", ") + name;
    throw tessel::plan::UserError(
        fmt::format("{}: no field \"{}\" (--text-key names the field); this line's fields: {}",
                    where, o.key, keys.empty() ? "none" : keys));
  }
  if (!j[o.key].is_string())
    throw tessel::plan::UserError(
        fmt::format("{}: field \"{}\" is a {}, not a string", where, o.key, j[o.key].type_name()));
  return j[o.key].get<std::string>();
}

// A JSONL file is one document per non-blank line. False once the pipeline has stopped.
bool read_jsonl_file(const Options& o, std::ifstream& f, const std::string& file,
                     std::atomic<int64_t>& read_bytes, Chunker& chunks) {
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    read_bytes += static_cast<int64_t>(line.size()) + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto where = fmt::format("{}:{}", file, n);
    if (!chunks.add(jsonl_document(o, line, where), where)) return false;
  }
  return true;
}

// Reads every input and pushes chunks of documents (about 1 MiB each).
void read_inputs(const Options& o, const std::vector<std::string>& files, Pipeline& p,
                 std::atomic<int64_t>& read_bytes, std::atomic<int64_t>& skipped) {
  Chunker chunks(p, skipped);
  for (const auto& file : files) {
    std::ifstream f(file, std::ios::binary);
    if (!f) throw tessel::plan::UserError(file + ": cannot open");
    const bool more = format_of(o, file) == "text"
                          ? read_text_file(f, file, read_bytes, chunks)
                          : read_jsonl_file(o, f, file, read_bytes, chunks);
    if (!more) return;
  }
  chunks.flush();
}

// Byte tokens: each document's UTF-8 bytes.
std::vector<std::vector<uint32_t>> byte_tokens(const std::vector<std::string>& texts) {
  std::vector<std::vector<uint32_t>> ids(texts.size());
  for (size_t i = 0; i < texts.size(); ++i)
    ids[i].assign(reinterpret_cast<const uint8_t*>(texts[i].data()),
                  reinterpret_cast<const uint8_t*>(texts[i].data()) + texts[i].size());
  return ids;
}

// A worker: encodes chunks (each document ends with eod) until the reader is done.
void encode_chunks(const Options& o, uint32_t eod, Pipeline& p) {
  std::unique_ptr<tessel::io::TokenizerProcess> tok;
  if (!o.tokenizer.empty())
    tok = std::make_unique<tessel::io::TokenizerProcess>(o.tokenizer, o.python);
  int64_t index;
  Chunk c;
  while (p.pop(index, c)) {
    c.ids = tok ? tok->encode(c.texts, !o.no_special) : byte_tokens(c.texts);
    for (auto& d : c.ids) d.push_back(eod);
    c.texts.clear();
    p.done(index, std::move(c));
  }
}

std::string human(double v, const char* unit) {
  const char* p[] = {"", "k", "M", "G", "T"};
  int i = 0;
  for (; v >= 1000 && i < 4; ++i) v /= 1000;
  return *unit ? fmt::format("{:.1f} {}{}", v, p[i], unit) : fmt::format("{:.1f}{}", v, p[i]);
}

// The inputs, never this run's own output: a glob that matches PREFIX.bin / .idx / .tessel.json (a
// previous run
// with the same --out) skips them, saying so; an input named outright that --out would
// overwrite is refused before anything is written.
std::vector<std::string> input_files(const Options& o) {
  std::error_code ec;
  std::set<fs::path> outputs;
  for (const char* ext : {".bin", ".idx", ".bin.tmp", ".tessel.json", ".tessel.json.tmp"})
    outputs.insert(fs::weakly_canonical(o.out + ext, ec));
  std::vector<std::string> files;
  for (const auto& in : o.inputs) {
    const bool glob = in.find_first_of("*?[") != std::string::npos;
    for (auto& f : tessel::data::expand(in)) {
      if (!outputs.count(fs::weakly_canonical(f, ec))) {
        files.push_back(std::move(f));
      } else if (glob) {
        spdlog::info("{}: skipped: it is this run's output (--out {}), not an input", f, o.out);
      } else {
        throw tessel::plan::UserError(
            fmt::format("{}: is an input and also what --out {} writes (PREFIX.bin, PREFIX.idx and "
                        "PREFIX.tessel.json); "
                        "choose another --out, or the input would be overwritten",
                        f, o.out));
      }
    }
  }
  if (files.empty() && !o.inputs.empty())
    throw tessel::plan::UserError(fmt::format(
        "no input left: every file the inputs match is this run's output (--out {})", o.out));
  return files;
}

int64_t total_size(const std::vector<std::string>& files) {
  int64_t total_bytes = 0;
  for (const auto& f : files) total_bytes += static_cast<int64_t>(fs::file_size(f));
  return total_bytes;
}

struct Vocabulary {
  int64_t size = tessel::data::kTextVocab;
  uint32_t eod = tessel::data::kTextEod;
  std::string eod_text = "256 (bytes)";
};

// The end-of-document id and the vocabulary, checked before any work starts.
Vocabulary vocabulary_of(const Options& o) {
  Vocabulary v;
  if (o.tokenizer.empty()) {
    if (!o.eod.empty())
      throw tessel::plan::UserError("--eod needs --tokenizer (byte tokens end documents with 256)");
    return v;
  }
  tessel::io::TokenizerProcess probe(o.tokenizer, o.python);
  auto s = tessel::io::special_tokens(o.tokenizer);
  // Ids may have gaps: the bound is the highest id + 1, not the number of tokens.
  v.size = std::max(probe.vocab_size(), s.vocab_size);
  if (o.eod.empty()) {
    if (!s.eos)
      throw tessel::plan::UserError(o.tokenizer +
                                    ": no end-of-document token found (none of <|endoftext|>, "
                                    "<|end_of_text|>, </s>, <eos>); name one with --eod TOKEN");
    v.eod = static_cast<uint32_t>(*s.eos), v.eod_text = s.eos_text;
  } else {
    auto id = probe.token_to_id(o.eod);
    if (!id)
      throw tessel::plan::UserError("--eod '" + o.eod + "' is not a token of " + o.tokenizer);
    v.eod = static_cast<uint32_t>(*id), v.eod_text = o.eod;
  }
  return v;
}

// On any early exit (a thread that cannot start, an exception below) stop and join the threads:
// destroying a joinable std::thread would terminate the process instead of reporting the error.
struct JoinAll {
  Pipeline& p;
  std::vector<std::thread>& threads;
  ~JoinAll() {
    for (auto& t : threads)
      if (t.joinable()) {
        p.fail(std::make_exception_ptr(std::runtime_error("stopped early")));
        t.join();
      }
  }
};

// Starts a pipeline thread: its exception stops the pipeline, and the main thread rethrows it.
template <class F>
void spawn(std::vector<std::thread>& threads, Pipeline& p, F body) {
  threads.emplace_back([&p, body] {
    try {
      body();
    } catch (...) {
      p.fail(std::current_exception());
    }
  });
}

// The progress line: a bar redrawn every 200 ms on a terminal, else a log line every 10 s.
class Progress {
 public:
  Progress(const Options& o, int64_t total_bytes, const std::atomic<int64_t>& read_bytes,
           const tessel::data::MegatronWriter& out)
      : o_(o),
        total_bytes_(total_bytes),
        read_bytes_(read_bytes),
        out_(out),
        tty_(o.progress && ::isatty(2)) {}
  bool tty() const { return tty_; }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  void report(bool final) {
    const auto now = std::chrono::steady_clock::now();
    if (!final && now - last_ < (tty_ ? std::chrono::milliseconds(200) : std::chrono::seconds(10)))
      return;
    last_ = now;
    const double s = std::chrono::duration<double>(now - start_).count();
    const double done = static_cast<double>(read_bytes_.load());
    const double frac = total_bytes_ ? done / total_bytes_ : 1.0;
    const int width = 30, filled = static_cast<int>(frac * width);
    const auto line = fmt::format(
        "[{}{}] {:3.0f}% {} of {}, {} documents, {} tokens, {}/s", std::string(filled, '#'),
        std::string(width - filled, '.'), 100 * frac, human(done, "B"),
        human(static_cast<double>(total_bytes_), "B"), out_.documents(),
        human(static_cast<double>(out_.tokens()), ""), human(s > 0 ? done / s : 0, "B"));
    if (tty_)
      std::fprintf(stderr, "\r%s", line.c_str());
    else if (o_.progress)
      spdlog::info("{}", line);
  }

 private:
  const Options& o_;
  int64_t total_bytes_;
  const std::atomic<int64_t>& read_bytes_;
  const tessel::data::MegatronWriter& out_;
  bool tty_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_ = start_;
};

// The main thread's part: writes the encoded chunks in input order.
void write_chunks(Pipeline& p, tessel::data::MegatronWriter& out, Progress& progress) {
  Chunk c;
  try {
    while (p.next(c, std::chrono::milliseconds(200))) {
      for (const auto& d : c.ids) out.add(d.data(), static_cast<int64_t>(d.size()));
      progress.report(false);
    }
  } catch (...) {
    p.fail(std::current_exception());
  }
}

int run(const Options& o) {
  const auto files = input_files(o);
  const int64_t total_bytes = total_size(files);
  const Vocabulary v = vocabulary_of(o);
  const int workers = o.workers > 0
                          ? o.workers
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  spdlog::info("{} input file{} ({}), {}, end-of-document {} = {}, {} worker{}", files.size(),
               files.size() == 1 ? "" : "s", human(static_cast<double>(total_bytes), "B"),
               o.tokenizer.empty() ? "byte tokens" : "tokenizer " + o.tokenizer, v.eod_text, v.eod,
               workers, workers == 1 ? "" : "s");

  // Opened before any thread starts: a bad --out is an error, not std::terminate on joinable
  // threads.
  tessel::data::MegatronWriter out(o.out, v.size);
  Pipeline p(static_cast<size_t>(2 * workers + 2));
  std::atomic<int64_t> read_bytes{0}, skipped{0};
  std::vector<std::thread> threads;
  JoinAll join_all{p, threads};
  spawn(threads, p, [&] {
    read_inputs(o, files, p, read_bytes, skipped);
    p.close();
  });
  const uint32_t eod = v.eod;
  for (int w = 0; w < workers; ++w) spawn(threads, p, [&o, &p, eod] { encode_chunks(o, eod, p); });

  Progress progress(o, total_bytes, read_bytes, out);
  write_chunks(p, out, progress);
  for (auto& t : threads) t.join();
  if (progress.tty()) {
    progress.report(true);
    std::fputc('\n', stderr);
  }
  p.rethrow();
  out.finish();
  // What a plan checks the dataset against (engine/data/vocabulary.h).
  const bool bytes = o.tokenizer.empty();
  tessel::data::write_vocabulary(
      o.out, {v.size, v.eod, v.eod_text, bytes ? "bytes" : o.tokenizer,
              bytes ? "bytes" : tessel::data::tokenizer_fingerprint(o.tokenizer)});
  if (!progress.tty()) progress.report(true);
  spdlog::info(
      "wrote {0}.bin / {0}.idx (and {0}.tessel.json): {1} documents, {2} tokens ({3}-bit, "
      "vocabulary {4}){5} "
      "in {6:.1f} s",
      o.out, out.documents(), out.tokens(), 8 * out.elem_size(), v.size,
      skipped ? fmt::format(", {} empty documents skipped", skipped.load()) : "",
      progress.seconds());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tessel-data: text or JSONL corpora to a Megatron .bin/.idx dataset", "tessel-data"};
  Options o;
  app.add_option("inputs", o.inputs,
                 "Input files or globs: .jsonl (one document per line) or text (one document per "
                 "file)")
      ->required();
  app.add_option("--out", o.out, "Output prefix: writes PREFIX.bin and PREFIX.idx")->required();
  app.add_option("--tokenizer", o.tokenizer,
                 "A Hugging Face tokenizer.json (default: byte tokens, end-of-document 256)");
  app.add_option("--format", o.input_format, "Input format (auto: .jsonl/.json/.ndjson are JSONL)")
      ->check(CLI::IsMember({"auto", "text", "jsonl"}));
  app.add_option("--text-key", o.key, "JSONL: the field holding the document's text");
  app.add_option("--eod", o.eod,
                 "End-of-document token appended to every document (default: the tokenizer's "
                 "eos, e.g. <|endoftext|>)");
  app.add_flag("--no-special-tokens", o.no_special,
               "Do not apply the tokenizer's post-processor (no BOS for Llama-3 tokenizers)");
  app.add_option("--workers", o.workers, "Tokenizer worker threads (default: all cores)")
      ->check(CLI::PositiveNumber);
  app.add_option("--python", o.python,
                 "Python with the `tokenizers` package (default: $TESSEL_PYTHON, then the "
                 "checkout's .env)");
  app.add_flag("!--no-progress", o.progress, "No progress bar or progress lines");
  TESSEL_CLI_PARSE(app, argc, argv);
  spdlog::set_pattern("[%H:%M:%S] %v");
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-data: error: %s\n", e.what());
    return 2;
  }
}
