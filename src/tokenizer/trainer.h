// Training a tekken.json: byte-level BPE over the tekken pre-split, for the small models.
//
// The file is what mistral-common loads (tests/golden/tokenizer holds mistral-common's ids
// for a vocabulary made here): special tokens first (the standard Mistral names at the
// ranks real files use, padded with <SPECIAL_i>), then the 256 single bytes, then merges in
// the order they were learned, so a token's rank is larger than its parts' ranks and
// tiktoken's lowest-rank-first encoder replays the training merges. Training is the classic
// BPE loop (Sennrich et al. 2016; the same loop as tiktoken's educational
// `bpe_train`): count adjacent symbol pairs inside pre-split pieces weighted by piece
// frequency, merge the most frequent pair (ties: the pair whose merged bytes sort first),
// repeat. Pair counts are updated only in pieces that contain the merged pair.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"

namespace ml4 {

// The pre-split regex of Mistral's tekken files (tekken_240911.json config.pattern).
extern const char* const kTekkenPattern;

struct TekkenTrainOptions {
  int vocab_size = 512;           // total ids: special + 256 bytes + merges
  int num_special_tokens = 100;   // ids [0, num_special) are special tokens
  std::string version = "v13";    // v7, v11, v13 or v15 (decides the named special tokens)
};

// Trains on `corpus` (UTF-8; invalid bytes are replaced as the tokenizer does). When the
// corpus runs out of pairs to merge before vocab_size, the remaining ranks are filled with
// byte strings no UTF-8 text contains ("\xFF" + number), so the size is always exact.
Result<std::string> train_tekken_json(std::string_view corpus, const TekkenTrainOptions& options);

// A merge-free vocabulary: num_special_tokens special tokens and the 256 bytes, so
// vocab_size = num_special_tokens + 256 (the default 1000 gives 1256). For a model with
// vocab_size V pass V - 256. num_special_tokens below the version's named tokens (v7 20,
// v11 34, v13 36, v15 38) is raised to that minimum; an unknown version means v13.
std::string byte_level_tekken_json(int num_special_tokens = 1000, const std::string& version = "v13");

}  // namespace ml4
