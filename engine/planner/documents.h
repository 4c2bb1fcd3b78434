// data.document_mask in the planner's figures: the share of a causal sequence's attention work
// that attention inside documents keeps, measured on the run's own first training samples.
#pragma once

#include <string>

#include "core/plan/config.h"
#include "engine/data/dataset.h"

namespace tessel::planner {

/// Samples the share is measured on (the first of the training order, before any rank split).
constexpr int64_t kDocumentShareSamples = 256;

/// The documents of the first kDocumentShareSamples training samples.
struct DocumentFigures {
  double share = 1;       // Σ l(l+1) over samples·T(T+1) (kernels::Documents::attention_share)
  double per_sample = 1;  // documents (pieces of documents) per sample
  int64_t longest = 0;    // the longest document (piece) in them, in tokens
  int64_t samples = 0;    // the samples measured (0: no mask)
  int64_t eod = -1;       // the id documents end with (data::document_eod)
  std::string unread;     // why the data could not be read (--dry-run away from it): the
                          // figures above are then those of no mask
};
/// Those figures; share 1 and one document per sample without data.document_mask, or where the
/// data cannot be read (`unread` says why: a dry-run on a machine without the data). Reads the
/// data once per data section and sequence length (the layout search asks for every candidate).
DocumentFigures document_figures(const plan::Config& c);
/// The same from a dataset the caller holds (the trainer's: no second one opened).
DocumentFigures document_figures(const plan::Config& c, data::Dataset& ds);

}  // namespace tessel::planner
