#include "engine/planner/documents.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "core/kernels/document_attention.h"
#include "engine/data/dataset.h"
#include "engine/data/vocabulary.h"

namespace tessel::planner {

DocumentFigures document_figures(const plan::Config& c, data::Dataset& ds) {
  if (!c.data.document_mask) return {};
  const int64_t eod = data::document_eod(c);
  // The first samples the run reads, no more than it may (a megatron-order blend holds
  // training.steps x global_batch, which can be fewer than kDocumentShareSamples).
  const int64_t n = std::min(kDocumentShareSamples, ds.readable_train_samples());
  const auto rows = ds.train_batch(0, n);
  const auto docs =
      kernels::find_documents(rows.narrow(1, 0, c.training.seq_len), eod, torch::kCPU);
  const double samples = static_cast<double>(std::max<int64_t>(1, n));
  return {docs.attention_share(), static_cast<double>(docs.count()) / samples, docs.longest, n,
          eod};
}

DocumentFigures document_figures(const plan::Config& c) {
  if (!c.data.document_mask) return {};
  // What decides the first samples: the data, the seed, the sequence length and (megatron
  // order) the samples the run asks for.
  const auto& d = c.data;
  std::string key =
      fmt::format("{}|{}|{}|{}|{}|{}|{}|{}|{}|{}", d.format.name(), d.order.name(), d.split,
                  d.val_fraction, d.eod_token, c.run.seed, c.training.seq_len,
                  c.training.steps * c.training.global_batch, d.shuffle, d.token_dtype.name());
  for (const auto& p : d.path) key += "|" + p;
  for (const auto& b : d.blend) {
    key += fmt::format("|{}:", b.weight);
    for (const auto& p : b.path) key += p + ",";
  }
  static std::mutex mu;
  static std::map<std::string, DocumentFigures> known;
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(key); it != known.end()) return it->second;
  try {
    data::Dataset ds(c, {});
    return known[key] = document_figures(c, ds);
  } catch (const plan::UserError& e) {
    DocumentFigures none;
    none.unread = e.what();
    return known[key] = none;
  }
}

}  // namespace tessel::planner
