// What tessel-data records beside a Megatron dataset it writes, PREFIX.tessel.json: the
// vocabulary its ids come from (size, and which tokenizer) and the id that ends each document.
// A plan's datasets are checked against it before any work (check_vocabularies): a dataset of
// another tokenizer than the others, or of a vocabulary larger than the model's, is refused
// naming its plan key; data.document_mask takes its end-of-document id from it. Datasets made
// by other tools have no such file and are checked by their ids alone (check_token_ids).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "core/plan/config.h"

namespace tessel::data {

struct DataVocabulary {
  int64_t size = 0;         // the dataset's ids are below this
  int64_t eod = -1;         // the id appended to every document
  std::string eod_text;     // that token as text
  std::string tokenizer;    // the tokenizer file's name; "bytes" for tessel-data's byte tokens
  std::string fingerprint;  // checksum of the tokenizer file's bytes; "bytes" likewise
};

/// PREFIX.tessel.json.
std::string vocabulary_path(const std::string& prefix);
/// Writes it beside and renames it into place (a reader never sees half of one).
void write_vocabulary(const std::string& prefix, const DataVocabulary& v);
/// The record of `prefix`, none when it has none; UserError naming `key` (the plan key that gave
/// the prefix) and the file when it is unreadable, not a regular file, or holds values out of
/// range (vocab_size not a positive integer, eod not an integer id below it).
std::optional<DataVocabulary> read_vocabulary(const std::string& prefix,
                                              const std::string& key = "data.path");
/// The fingerprint of a tokenizer file (its bytes' checksum, hex).
std::string tokenizer_fingerprint(const std::string& path);

/// The plan's Megatron datasets (training, data.valid, data.test) against their records: a
/// vocabulary larger than model.vocab_size, or another tokenizer than an earlier dataset's, is a
/// UserError naming the dataset's key and both tokenizers; and under data.document_mask the
/// end-of-document id must agree with data.eod_token (or between the records when it is -1).
void check_vocabularies(const plan::Config& c);

/// The id data.document_mask cuts documents after: data.eod_token; else the text format's 256;
/// else the one every Megatron dataset's record gives. UserError naming data.eod_token when
/// none does. -1 without data.document_mask.
int64_t document_eod(const plan::Config& c);
/// The id data.eod_mask_loss masks the loss after (the same id); -1 without it.
int64_t loss_mask_eod(const plan::Config& c);
/// The end-of-document id either option uses, found as document_eod says; -1 with neither.
int64_t eod_id(const plan::Config& c);

}  // namespace tessel::data
