// `ml4 make-model`: a model directory with random weights for a preset
// (src/model/random_checkpoint.h), plus its tokenizer.
#include "command.h"
#include "core/log.h"
#include "model/config_overrides.h"
#include "model/model_config.h"
#include "model/weight_names.h"
#include "model/presets.h"
#include "model/random_checkpoint.h"
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tokenizer/base64.h"

namespace ml4 {
namespace cli {
namespace {

// A byte-level tekken.json of exactly `vocab_size` ids: the special tokens first
// (mistral-common's v7 set, padded with <SPECIAL_n>), then the 256 single bytes.
std::string default_tokenizer_json(int vocab_size) {
  const std::vector<std::string> named = {"<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]",
                                          "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                                          "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
                                          "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"};
  // At most 1000 special tokens (tekken's default); ids past specials + 256 bytes are unused.
  const int num_special = std::clamp<int>(vocab_size - 256, static_cast<int>(named.size()), 1000);
  nlohmann::json specials = nlohmann::json::array();
  for (int i = 0; i < num_special; ++i) {
    std::string name = i < static_cast<int>(named.size()) ? named[i] : fmt::format("<SPECIAL_{}>", i);
    specials.push_back({{"rank", i}, {"token_str", name}, {"is_control", true}});
  }
  nlohmann::json vocab = nlohmann::json::array();
  for (int b = 0; b < 256 && num_special + b < vocab_size; ++b) {
    std::string byte(1, static_cast<char>(b));
    vocab.push_back({{"rank", b}, {"token_bytes", base64_encode(byte)}, {"token_str", nullptr}});
  }
  nlohmann::json doc = {
      {"config",
       {{"pattern", R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
        {"num_vocab_tokens", static_cast<int>(vocab.size())},
        {"default_vocab_size", vocab_size},
        {"default_num_special_tokens", num_special},
        {"version", "v7"}}},
      {"vocab", vocab},
      {"special_tokens", specials}};
  return doc.dump();
}

// The tokenizer for a model of `vocab_size`: --tokenizer if given; else a tekken.json the
// repo ships whose default_vocab_size matches (tests/golden/tokenizer/: Mistral's real
// tekken_240911.json for 131,072, vocabularies trained by `ml4 tokenizer train` for the tiny
// presets); else a byte-level one.
Result<std::string> tokenizer_for(int vocab_size, const std::string& path) {
  auto read = [](const std::string& p) -> Result<std::string> {
    std::ifstream f(p, std::ios::binary);
    if (!f) return not_found("cannot read tokenizer {}", p);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  if (!path.empty()) return read(path);
  const std::filesystem::path dir = std::filesystem::path(ML4_SOURCE_DIR) / "tests/golden/tokenizer";
  for (const char* name : {"tekken_240911.json", "tekken_trained_v15_512.json", "tekken_trained_v13_1500.json"}) {
    auto text = read((dir / name).string());
    if (!text.ok()) continue;
    auto doc = nlohmann::json::parse(*text, nullptr, false);
    if (!doc.is_discarded() && doc["config"].value("default_vocab_size", 0) == vocab_size) return text;
  }
  return default_tokenizer_json(vocab_size);
}

}  // namespace

namespace {

CommandRegistrar reg("make-model", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("make-model", "write a model directory with random weights for a preset or any shape");
  auto o = std::make_shared<MakeModelOptions>();
  auto params_file = std::make_shared<std::string>();
  cmd->add_option("--preset", o->preset, "ml4, ml4-slice-N, ml4-tiny, mistral4-tiny, dsv32-tiny");
  cmd->add_option("--params", *params_file,
                  "a params.json (or HF config.json) giving the shape, instead of a preset");
  cmd->add_option("--set", o->overrides,
                  "KEY=VALUE[,KEY=VALUE...] over the preset or --params: dotted keys into blocks, JSON values, "
                  "null deletes (e.g. dim=2048,n_layers=8,moe.num_experts=32,indexer=null); repeatable");
  cmd->add_option("--out", o->out_dir, "output directory")->required();
  cmd->add_option("--seed", o->seed, "weight seed");
  cmd->add_option("--dtype", o->weight_dtype, "weight format: bf16, fp8, nvfp4 (experts), mxfp4 (experts)");
  cmd->add_option("--layout", o->layout, "native, hf, both (HF copy in OUT/hf), merged (both in OUT, as Mistral's repos), default (the preset's own)");
  cmd->add_option("--max-shard-bytes", o->max_shard_bytes, "split the weights into shards of at most this size");
  cmd->add_option("--hf-model-type", o->hf_model_type, "model_type of the HF copy (default: the preset's, else mistral4)");
  auto tokenizer_path = std::make_shared<std::string>();
  cmd->add_option("--tokenizer", *tokenizer_path, "tekken.json to copy into the model (default: a shipped one of the same vocab size)");
  cmd->callback([o, exit_code, tokenizer_path, params_file] {
    auto fail = [&](const Status& s) {
      ML4_LOG_ERROR("make-model: {}", s.message());
      *exit_code = 1;
    };
    if (o->preset.empty() && params_file->empty()) return fail(invalid_argument("give --preset NAME or --params FILE"));
    if (!o->preset.empty() && !params_file->empty())
      return fail(invalid_argument("give one of --preset and --params (--set edits either)"));
    if (!params_file->empty()) {
      std::ifstream f(*params_file, std::ios::binary);
      if (!f) return fail(not_found("cannot read --params {}", *params_file));
      o->params_text.assign(std::istreambuf_iterator<char>(f), {});
    }
    auto cfg = resolve_model_config(o->preset, o->params_text, o->overrides);
    if (!cfg.ok()) return fail(cfg.status());
    auto tok = tokenizer_for(cfg->vocab_size, *tokenizer_path);
    if (!tok.ok()) return fail(tok.status());
    o->tokenizer_json = std::move(tok).value();
    Status s = make_model(*o);
    if (!s.ok()) return fail(s);
    ML4_LOG_INFO("make-model: wrote {} ({}, {:.3f}B parameters)", o->out_dir, cfg->name,
                 static_cast<double>(count_parameters(*cfg).total) / 1e9);
  });
});

}  // namespace
}  // namespace cli
}  // namespace ml4
