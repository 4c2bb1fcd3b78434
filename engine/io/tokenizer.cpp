#include "engine/io/tokenizer.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/plan/config.h"

extern char** environ;

namespace tessel::io {
namespace fs = std::filesystem;

namespace {

// The helper. Frames: every reply starts "OK" or "ER" + u32 length + message. Requests:
//   E u8 add_special, u32 n, n × (u32 bytes, UTF-8)  ->  OK, n × (u32 count, count × u32 id)
//   D u8 skip_special, u32 n, n × u32 id             ->  OK, u32 bytes, UTF-8
//   T u32 bytes, token                               ->  OK, i64 id (-1: not in the vocabulary)
// Start-up replies OK + u32 vocabulary size (with added tokens). EOF on stdin ends it.
constexpr const char* kHelper = R"PY(
import struct, sys
from array import array
out, inp = sys.stdout.buffer, sys.stdin.buffer
def err(msg):
    b = msg.encode('utf-8', 'replace')
    out.write(b'ER' + struct.pack('<I', len(b)) + b)
    out.flush()
try:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(sys.argv[1])
except Exception as e:
    err(f'{type(e).__name__}: {e}')
    sys.exit(3)
out.write(b'OK' + struct.pack('<I', tok.get_vocab_size(with_added_tokens=True)))
out.flush()
def read(n):
    b = inp.read(n)
    if len(b) != n:
        sys.exit(0)
    return b
def u32():
    return struct.unpack('<I', read(4))[0]
while True:
    op = inp.read(1)
    if not op:
        break
    try:
        if op == b'E':
            special = read(1) == b'\x01'
            raw = [read(u32()) for _ in range(u32())]  # the whole request before any decoding,
            texts = [r.decode('utf-8') for r in raw]  # so an error reply keeps the stream in step
            parts = [b'OK']
            for e in tok.encode_batch(texts, add_special_tokens=special):
                ids = array('I', e.ids)
                parts.append(struct.pack('<I', len(ids)))
                parts.append(ids.tobytes())
            out.write(b''.join(parts))
        elif op == b'D':
            skip = read(1) == b'\x01'
            ids = array('I')
            ids.frombytes(read(4 * u32()))
            text = tok.decode(ids.tolist(), skip_special_tokens=skip).encode('utf-8')
            out.write(b'OK' + struct.pack('<I', len(text)) + text)
        elif op == b'T':
            i = tok.token_to_id(read(u32()).decode('utf-8'))
            out.write(b'OK' + struct.pack('<q', -1 if i is None else i))
        else:
            err(f'unknown request {op!r}')
            sys.exit(4)
    except Exception as e:
        err(f'{type(e).__name__}: {e}')
    out.flush()
)PY";

void put_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }

std::string self_dir() {
  std::error_code ec;
  auto exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

}  // namespace

std::string tokenizer_python(const std::string& explicit_python) {
  if (!explicit_python.empty()) return explicit_python;
  if (const char* p = std::getenv("TESSEL_PYTHON"); p && *p) return p;
  const auto dir = self_dir();
  if (!dir.empty()) {
    auto venv = fs::path(dir) / ".." / ".." / ".env" / "bin" / "python";
    if (::access(venv.c_str(), X_OK) == 0)
      return venv.lexically_normal().string();  // not canonical: a venv python is a symlink
  }
  return "python3";
}

namespace {

nlohmann::json read_tokenizer_json(const std::string& tokenizer_json) {
  std::ifstream f(tokenizer_json);
  if (!f) throw plan::UserError(tokenizer_json + ": cannot open the tokenizer");
  nlohmann::json t;
  try {
    t = nlohmann::json::parse(f);
  } catch (const std::exception& e) {
    throw plan::UserError(tokenizer_json + ": not a tokenizer.json (" + e.what() + ")");
  }
  return t;
}

// Fills `added` (added token text -> id) and s.vocab_size (the highest id + 1, added tokens and
// the model's vocabulary).
void read_vocab(const nlohmann::json& t, std::map<std::string, int64_t>& added, SpecialTokens& s) {
  for (const auto& a : t.value("added_tokens", nlohmann::json::array())) {
    added[a.at("content").get<std::string>()] = a.at("id").get<int64_t>();
    s.vocab_size = std::max(s.vocab_size, a.at("id").get<int64_t>() + 1);
  }
  if (t.contains("model") && t["model"].contains("vocab")) {
    const auto& v = t["model"]["vocab"];
    if (v.is_object())
      for (const auto& [_, id] : v.items())
        s.vocab_size = std::max(s.vocab_size, id.get<int64_t>() + 1);
    else if (v.is_array())  // Unigram: [[piece, score], ...]
      s.vocab_size = std::max<int64_t>(s.vocab_size, static_cast<int64_t>(v.size()));
  }
}

// The bos and eos tokens tokenizer_config.json (beside tokenizer.json) names, if any.
void configured_tokens(const std::string& tokenizer_json, std::string& cfg_bos,
                       std::string& cfg_eos) {
  auto cfg_path = fs::path(tokenizer_json).parent_path() / "tokenizer_config.json";
  if (std::ifstream c(cfg_path); c) {
    try {
      auto j = nlohmann::json::parse(c);
      auto text_of = [](const nlohmann::json& v) {
        if (v.is_string()) return v.get<std::string>();
        if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
        return std::string();
      };
      if (j.contains("bos_token")) cfg_bos = text_of(j["bos_token"]);
      if (j.contains("eos_token")) cfg_eos = text_of(j["eos_token"]);
    } catch (const std::exception& e) {
      throw plan::UserError(cfg_path.string() + ": not JSON (" + e.what() + ")");
    }
  }
}

// Sets (id, text) to the configured token, else to the first of `names` that is an added token.
void pick_token(const nlohmann::json& t, const std::map<std::string, int64_t>& added,
                std::optional<int64_t>& id, std::string& text, const std::string& configured,
                std::initializer_list<const char*> names) {
  if (!configured.empty() && added.count(configured)) {
    id = added.at(configured), text = configured;
    return;
  }
  // A token that tokenizer_config.json names may be an ordinary vocabulary entry.
  if (!configured.empty() && t.contains("model") && t["model"].contains("vocab") &&
      t["model"]["vocab"].is_object() && t["model"]["vocab"].contains(configured)) {
    id = t["model"]["vocab"][configured].get<int64_t>(), text = configured;
    return;
  }
  for (const char* n : names)
    if (added.count(n)) {
      id = added.at(n), text = n;
      return;
    }
}

}  // namespace

SpecialTokens special_tokens(const std::string& tokenizer_json) {
  const nlohmann::json t = read_tokenizer_json(tokenizer_json);
  std::map<std::string, int64_t> added;
  SpecialTokens s;
  read_vocab(t, added, s);
  std::string cfg_bos, cfg_eos;
  configured_tokens(tokenizer_json, cfg_bos, cfg_eos);
  pick_token(t, added, s.eos, s.eos_text, cfg_eos,
             {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"});
  pick_token(t, added, s.bos, s.bos_text, cfg_bos, {"<|begin_of_text|>", "<s>", "<bos>"});
  if (!s.bos && s.eos && cfg_bos.empty()) s.bos = s.eos, s.bos_text = s.eos_text;  // GPT-2
  return s;
}

TokenizerProcess::TokenizerProcess(const std::string& tokenizer_json, const std::string& python)
    : path_(tokenizer_json) {
  if (!fs::is_regular_file(tokenizer_json))
    throw plan::UserError(tokenizer_json + ": no such tokenizer file");
  std::signal(SIGPIPE, SIG_IGN);  // a dead helper is reported by the read, not by a signal
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(in[0]);
    ::close(in[1]);
    throw std::runtime_error(std::string("pipe: ") + std::strerror(e));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  const std::string py = tokenizer_python(python);
  std::vector<std::string> args = {py, "-c", kHelper, tokenizer_json};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Each helper encodes serially: callers run one helper per thread.
  std::vector<std::string> env_store = {"TOKENIZERS_PARALLELISM=false"};
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "TOKENIZERS_PARALLELISM=", 23) != 0) envp.push_back(*e);
  envp.push_back(env_store[0].data());
  envp.push_back(nullptr);
  int rc = posix_spawnp(&pid_, py.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(in[0]);
  ::close(out[1]);
  to_ = in[1], from_ = out[0];
  if (rc != 0) {
    pid_ = -1;
    shutdown();
    throw plan::UserError(
        "cannot start " + py + " for the tokenizer helper: " + std::strerror(rc) +
        " (set TESSEL_PYTHON or --python to a python with the `tokenizers` package)");
  }
  try {
    check_ok();
    uint32_t v;
    std::memcpy(&v, receive(4).data(), 4);
    vocab_ = v;
  } catch (const plan::UserError& e) {
    shutdown();  // the destructor does not run for a constructor that throws
    throw plan::UserError(std::string(e.what()) + " (python: " + py + ")");
  }
}

TokenizerProcess::~TokenizerProcess() { shutdown(); }

void TokenizerProcess::shutdown() {
  // Closing stdin ends the helper's loop (EOF), so the wait cannot hang.
  if (to_ >= 0) ::close(to_);
  if (from_ >= 0) ::close(from_);
  if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  to_ = from_ = -1;
  pid_ = -1;
}

void TokenizerProcess::send(const std::string& bytes) {
  for (size_t done = 0; done < bytes.size();) {
    ssize_t n = ::write(to_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw plan::UserError("the tokenizer helper for " + path_ + " exited (" +
                            std::strerror(errno) + ")");
    done += static_cast<size_t>(n);
  }
}

std::string TokenizerProcess::receive(size_t n) {
  std::string b(n, '\0');
  for (size_t done = 0; done < n;) {
    ssize_t r = ::read(from_, b.data() + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      throw plan::UserError("the tokenizer helper for " + path_ +
                            " exited without answering (is the `tokenizers` package installed? "
                            "third_party/setup.sh installs it)");
    done += static_cast<size_t>(r);
  }
  return b;
}

void TokenizerProcess::check_ok() {
  auto tag = receive(2);
  if (tag == "OK") return;
  uint32_t len;
  std::memcpy(&len, receive(4).data(), 4);
  throw plan::UserError(path_ + ": tokenizer: " + receive(len));
}

std::vector<std::vector<uint32_t>> TokenizerProcess::encode(const std::vector<std::string>& texts,
                                                            bool add_special) {
  std::string req = "E";
  req.push_back(add_special ? 1 : 0);
  put_u32(req, static_cast<uint32_t>(texts.size()));
  for (const auto& t : texts) {
    put_u32(req, static_cast<uint32_t>(t.size()));
    req += t;
  }
  send(req);
  check_ok();
  std::vector<std::vector<uint32_t>> ids(texts.size());
  for (auto& d : ids) {
    uint32_t n;
    std::memcpy(&n, receive(4).data(), 4);
    d.resize(n);
    auto b = receive(4 * static_cast<size_t>(n));
    std::memcpy(d.data(), b.data(), b.size());
  }
  return ids;
}

std::string TokenizerProcess::decode(const std::vector<int64_t>& ids, bool skip_special) {
  std::string req = "D";
  req.push_back(skip_special ? 1 : 0);
  put_u32(req, static_cast<uint32_t>(ids.size()));
  for (auto i : ids) put_u32(req, static_cast<uint32_t>(i));
  send(req);
  check_ok();
  uint32_t n;
  std::memcpy(&n, receive(4).data(), 4);
  return receive(n);
}

std::optional<int64_t> TokenizerProcess::token_to_id(const std::string& token) {
  std::string req = "T";
  put_u32(req, static_cast<uint32_t>(token.size()));
  send(req + token);
  check_ok();
  int64_t id;
  std::memcpy(&id, receive(8).data(), 8);
  return id < 0 ? std::nullopt : std::optional<int64_t>(id);
}

}  // namespace tessel::io
