// tessel-data: UTF-8 text files -> Megatron-LM .bin/.idx (byte tokens 0-255, each document
// followed by the end-of-document token 256; one document per file).
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <cstdio>

#include "engine/config.h"
#include "engine/data.h"

int main(int argc, char** argv) {
  CLI::App app{"tessel-data: text files to a Megatron .bin/.idx dataset (byte tokens)",
               "tessel-data"};
  std::vector<std::string> inputs;
  std::string out;
  app.add_option("inputs", inputs, "UTF-8 text files or globs; one document per file")->required();
  app.add_option("--out", out, "Output prefix: writes PREFIX.bin and PREFIX.idx")->required();
  CLI11_PARSE(app, argc, argv);
  spdlog::set_pattern("[%H:%M:%S] %v");
  try {
    tessel::DataConfig d;
    d.format = "text";
    d.path = inputs;
    auto stream = tessel::data::open_stream(d);
    // Re-cut the stream into documents at each end-of-document token.
    std::vector<std::vector<uint16_t>> docs(1);
    std::vector<int64_t> buf(1 << 16);
    for (int64_t pos = 0; pos < stream.size(); pos += static_cast<int64_t>(buf.size())) {
      int64_t n = std::min<int64_t>(static_cast<int64_t>(buf.size()), stream.size() - pos);
      stream.read(pos, n, buf.data());
      for (int64_t i = 0; i < n; ++i) {
        docs.back().push_back(static_cast<uint16_t>(buf[i]));
        if (buf[i] == tessel::data::kTextEod) docs.emplace_back();
      }
    }
    if (docs.back().empty()) docs.pop_back();
    tessel::data::write_megatron(out, docs);
    spdlog::info("wrote {}.bin / {}.idx: {} documents, {} tokens", out, out, docs.size(),
                 stream.size());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel-data: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
