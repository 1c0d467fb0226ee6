// The Hugging Face tokenizer files for a tekken.json, so that a model directory ml4 writes
// opens in transformers (`AutoTokenizer.from_pretrained(dir)`) and in llama.cpp's
// convert_hf_to_gguf.py without edits (issue 22, "models other tools open unchanged").
//
// tokenizer.json follows what Mistral ships next to tekken.json in its Hub repos (and what
// transformers' TikTokenConverter builds from a tiktoken vocabulary):
//   model: BPE over GPT-2 byte-level symbols (bytes_to_unicode), vocab = the tekken regular
//     tokens at id rank + num_special, merges recovered from the ranks the tiktoken way: a
//     token of rank r is the last merge of byte-pair merging its bytes with the ranks below r
//     (tiktoken's _byte_pair_merge), which yields exactly two parts; `ignore_merges: true`
//     so a pre-token that is itself a vocabulary entry maps to it directly, as tiktoken does;
//   pre_tokenizer: Split on the file's own regex (config.pattern, behaviour Isolated), then
//     ByteLevel without its own regex; decoder ByteLevel;
//   added_tokens: the num_special control tokens at ids [0, num_special) (the file's list,
//     the deprecated defaults before v7, <SPECIAL_i> for the rest, as Tekkenizer builds it);
//   post_processor: "<s> $A" (mistral-common encodes with bos=True).
// tokenizer_config.json names PreTrainedTokenizerFast, bos/eos/unk/pad by name and the
// model's context length.
//
// One difference is inherent to HF tokenizers: special-token names written in the text
// ("[INST]") become their ids there, while tekken encodes them as text unless asked.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace ml4 {

struct HfTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  int64_t merges = 0;  // merges written (regular tokens of two or more bytes)
};

// `tekken_json`: the tekken.json text. Errors name what is wrong with it.
Result<HfTokenizerFiles> hf_tokenizer_from_tekken(const std::string& tekken_json, int64_t model_max_length);

}  // namespace ml4
