// Hugging Face tokenizers (tokenizer.json) for data preparation, generation and scoring text.
// No C API of the `tokenizers` library is packaged, so a small pinned Python helper (the
// `tokenizers` wheel that third_party/setup.sh installs) runs as a child process and speaks a
// length-prefixed binary protocol over pipes. Training never starts it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessel::io {

/// The python that runs the helper: `explicit_python`, else $TESSEL_PYTHON, else the checkout's
/// .env/bin/python next to this binary (build/bin/../../.env), else python3 on PATH.
std::string tokenizer_python(const std::string& explicit_python = "");

/// The special tokens of a tokenizer.json, read without Python: tokenizer_config.json beside it
/// when it names bos/eos, else the first known name among the added tokens (<|endoftext|>,
/// <|end_of_text|>, </s>, <eos>; <|begin_of_text|>, <s>, <bos>; bos = eos when only that exists,
/// as GPT-2 has it).
struct SpecialTokens {
  std::optional<int64_t> bos, eos;
  std::string bos_text, eos_text;
  int64_t vocab_size = 0;  // model vocabulary + added tokens (the highest id + 1)
};
SpecialTokens special_tokens(const std::string& tokenizer_json);

/// One helper process. Not thread-safe: give each thread its own.
class TokenizerProcess {
 public:
  TokenizerProcess(const std::string& tokenizer_json, const std::string& python = "");
  ~TokenizerProcess();
  TokenizerProcess(const TokenizerProcess&) = delete;
  TokenizerProcess& operator=(const TokenizerProcess&) = delete;

  /// Token ids of each text; `add_special` applies the tokenizer's post-processor (a BOS for
  /// Llama-3), as `tokenizer(text)` does in transformers.
  std::vector<std::vector<uint32_t>> encode(const std::vector<std::string>& texts,
                                            bool add_special);
  std::string decode(const std::vector<int64_t>& ids, bool skip_special);
  std::optional<int64_t> token_to_id(const std::string& token);
  int64_t vocab_size() const { return vocab_; }

 private:
  void send(const std::string& bytes);
  std::string receive(size_t n);
  void check_ok();
  void shutdown();  // close the pipes and reap the helper; idempotent
  std::string path_;
  int64_t vocab_ = 0;
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
};

}  // namespace tessel::io
