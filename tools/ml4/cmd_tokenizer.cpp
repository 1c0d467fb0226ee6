// `ml4 tokenize`, `ml4 detokenize`, `ml4 chat-encode` and `ml4 tokenizer train|info`: the
// tekken tokenizer (src/tokenizer) on the command line.
//
// Ids are printed as a JSON array on one line so scripts can diff them against
// mistral-common (tools/tokenizer/make_goldens.py does the same on the Python side).
// Input text comes from --text, --file or stdin, bytes as they are (malformed UTF-8 is
// replaced the way Python's decode("utf-8", "replace") does before encoding).
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include "tokenizer/chat.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace ml4::cli {
namespace {

bool read_input(const std::string& text, const std::string& file, std::string* out) {
  if (!text.empty()) {
    *out = text;
    return true;
  }
  if (file.empty() || file == "-") {
    *out = std::string(std::istreambuf_iterator<char>(std::cin), {});
    return true;
  }
  std::ifstream f(file, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", file.c_str());
    return false;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

std::shared_ptr<const Tokenizer> load_or_report(const std::string& path) {
  auto tok = Tokenizer::load(path);
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().message().c_str());
    return nullptr;
  }
  return tok.value();
}

struct TokenizeOptions {
  std::string tokenizer, text, file;
  bool allow_special = false, bos = false, eos = false;
};

int run_tokenize(const TokenizeOptions& o) {
  auto tok = load_or_report(o.tokenizer);
  if (!tok) return 1;
  std::string input;
  if (!read_input(o.text, o.file, &input)) return 1;
  std::vector<int32_t> ids;
  if (o.bos) ids.push_back(tok->bos_id());
  tok->encode_into(input, o.allow_special, ids);
  if (o.eos) ids.push_back(tok->eos_id());
  fmt::print("[{}]\n", fmt::join(ids, ", "));
  return 0;
}

struct DetokenizeOptions {
  std::string tokenizer, ids, file;
  bool keep_special = false;
};

int run_detokenize(const DetokenizeOptions& o) {
  auto tok = load_or_report(o.tokenizer);
  if (!tok) return 1;
  std::string input;
  if (!read_input(o.ids, o.file, &input)) return 1;
  for (char& c : input)  // accept "[1, 2, 3]" as well as "1 2 3"
    if (c == '[' || c == ']' || c == ',') c = ' ';
  std::istringstream in(input);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    char* end = nullptr;
    long v = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || !tok->is_valid_id(static_cast<int32_t>(v))) {
      std::fprintf(stderr, "ml4 detokenize: '%s' is not an id in [0, %d)\n", word.c_str(), tok->vocab_size());
      return 2;
    }
    ids.push_back(static_cast<int32_t>(v));
  }
  std::string text = tok->decode(ids, !o.keep_special);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fputc('\n', stdout);
  return 0;
}

struct ChatEncodeOptions {
  std::string tokenizer, request;
  bool no_rewrite_ids = false, show_text = false;
};

int run_chat_encode(const ChatEncodeOptions& o) {
  auto tok = load_or_report(o.tokenizer);
  if (!tok) return 1;
  std::string input;
  if (!read_input("", o.request, &input)) return 1;
  auto req = nlohmann::ordered_json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (req.is_discarded()) {
    std::fprintf(stderr, "ml4 chat-encode: the request is not valid JSON\n");
    return 2;
  }
  ChatOptions opts;
  opts.rewrite_tool_call_ids = !o.no_rewrite_ids;
  auto ids = encode_chat(*tok, req, opts);
  if (!ids.ok()) {
    std::fprintf(stderr, "ml4 chat-encode: %s\n", ids.status().message().c_str());
    return 2;
  }
  fmt::print("[{}]\n", fmt::join(ids.value(), ", "));
  if (o.show_text) {
    std::string text = tok->decode(ids.value(), /*skip_special=*/false);
    std::fprintf(stderr, "%s\n", text.c_str());
  }
  return 0;
}

struct TrainOptions {
  std::string corpus, out;
  TekkenTrainOptions train;
};

int run_train(const TrainOptions& o) {
  std::string corpus;
  if (!read_input("", o.corpus, &corpus)) return 1;
  auto doc = train_tekken_json(corpus, o.train);
  if (!doc.ok()) {
    std::fprintf(stderr, "ml4 tokenizer train: %s\n", doc.status().message().c_str());
    return 2;
  }
  std::ofstream f(o.out, std::ios::binary);
  if (!f || !(f << doc.value())) {
    std::fprintf(stderr, "ml4 tokenizer train: cannot write %s\n", o.out.c_str());
    return 1;
  }
  f.close();
  auto check = Tokenizer::load(o.out);  // what we wrote must load
  if (!check.ok()) {
    std::fprintf(stderr, "ml4 tokenizer train: wrote an unloadable file: %s\n", check.status().message().c_str());
    return 1;
  }
  fmt::print(stderr, "wrote {}: vocab_size {} ({} special + {} regular), version {}\n", o.out,
             check.value()->vocab_size(), check.value()->num_special_tokens(),
             check.value()->vocab_size() - check.value()->num_special_tokens(), o.train.version);
  return 0;
}

int run_info(const std::string& path) {
  auto tok = load_or_report(path);
  if (!tok) return 1;
  fmt::print("name {}\nversion v{}\nvocab_size {}\nnum_special_tokens {}\nbos {} eos {} pad {} unk {}\n",
             tok->name(), tok->version(), tok->vocab_size(), tok->num_special_tokens(), tok->bos_id(),
             tok->eos_id(), tok->pad_id(), tok->unk_id());
  for (const char* n : {"[INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]", "[IMG]",
                        "[MODEL_SETTINGS]"})
    if (auto id = tok->special_id(n)) fmt::print("{} {}\n", n, *id);
  if (tok->image_config())
    fmt::print("image patch {} max {} merge {}\n", tok->image_config()->image_patch_size,
               tok->image_config()->max_image_size, tok->image_config()->spatial_merge_size);
  return 0;
}

CommandRegistrar reg_tokenize("tokenize", [](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<TokenizeOptions>();
  auto* cmd = app.add_subcommand("tokenize", "text to tekken token ids (JSON array)");
  cmd->add_option("--tokenizer,-t", o->tokenizer, "tekken.json")->required();
  cmd->add_option("--text", o->text, "text to encode (default: --file or stdin)");
  cmd->add_option("--file,-f", o->file, "file to encode ('-' = stdin)");
  cmd->add_flag("--allow-special", o->allow_special, "special-token names in the text become their ids");
  cmd->add_flag("--bos", o->bos, "prepend <s>");
  cmd->add_flag("--eos", o->eos, "append </s>");
  cmd->callback([o, exit_code] { *exit_code = run_tokenize(*o); });
});

CommandRegistrar reg_detokenize("detokenize", [](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<DetokenizeOptions>();
  auto* cmd = app.add_subcommand("detokenize", "token ids to text");
  cmd->add_option("--tokenizer,-t", o->tokenizer, "tekken.json")->required();
  cmd->add_option("--ids", o->ids, "ids, \"1 2 3\" or \"[1, 2, 3]\" (default: --file or stdin)");
  cmd->add_option("--file,-f", o->file, "file with ids ('-' = stdin)");
  cmd->add_flag("--keep-special", o->keep_special, "write special tokens by name instead of dropping them");
  cmd->callback([o, exit_code] { *exit_code = run_detokenize(*o); });
});

CommandRegistrar reg_chat("chat-encode", [](CLI::App& app, int* exit_code) {
  auto o = std::make_shared<ChatEncodeOptions>();
  auto* cmd = app.add_subcommand("chat-encode", "OpenAI chat request JSON to prompt ids (Mistral instruct format)");
  cmd->add_option("--tokenizer,-t", o->tokenizer, "tekken.json (version v7 or later)")->required();
  cmd->add_option("--request,-r", o->request, "request JSON file ('-' = stdin)")->capture_default_str();
  cmd->add_flag("--no-rewrite-ids", o->no_rewrite_ids, "refuse tool-call ids that are not 9 alphanumerics (v7/v11)");
  cmd->add_flag("--show-text", o->show_text, "also print the prompt with special tokens by name on stderr");
  cmd->callback([o, exit_code] { *exit_code = run_chat_encode(*o); });
});

CommandRegistrar reg_tokenizer("tokenizer", [](CLI::App& app, int* exit_code) {
  auto* cmd = app.add_subcommand("tokenizer", "tekken.json tools: train, info");
  cmd->require_subcommand(1);
  auto t = std::make_shared<TrainOptions>();
  auto* train = cmd->add_subcommand("train", "train a byte-level BPE tekken.json on a text corpus");
  train->add_option("--corpus,-c", t->corpus, "UTF-8 text file ('-' = stdin)")->required();
  train->add_option("--out,-o", t->out, "tekken.json to write")->required();
  train->add_option("--vocab-size", t->train.vocab_size, "total ids: special + 256 bytes + merges")
      ->capture_default_str();
  train->add_option("--num-special", t->train.num_special_tokens, "number of special-token ids")
      ->capture_default_str();
  train->add_option("--version", t->train.version, "tokenizer version: v7, v11, v13, v15")->capture_default_str();
  train->callback([t, exit_code] { *exit_code = run_train(*t); });
  auto path = std::make_shared<std::string>();
  auto* info = cmd->add_subcommand("info", "print a tekken.json's sizes and special ids");
  info->add_option("tekken", *path, "tekken.json")->required();
  info->callback([path, exit_code] { *exit_code = run_info(*path); });
});

}  // namespace
}  // namespace ml4::cli
