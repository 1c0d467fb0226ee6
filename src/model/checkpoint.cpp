// Checkpoint directory discovery and index validation; see checkpoint.h for the rules.
#include "model/checkpoint.h"

#include "model/strict_json.h"


#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace ml4 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// An index maps each tensor to a file name: ~100 bytes a tensor; 100 MiB is far beyond any model.
constexpr uintmax_t kMaxIndexBytes = 100ull << 20;

bool is_regular(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// Parses the index JSON, refusing duplicate keys (a tensor mapped twice) at any level.
Status parse_index_json(const std::string& path, const std::string& text, json* out) {
  StrictJsonMessages m;
  m.what = "index";
  m.duplicate = [](int, const std::string& key) {
    return fmt::format("key \"{}\" appears twice (a tensor mapped to two shards?)", key);
  };
  return parse_strict_json(path, text, 16, m, out);
}

Result<std::string> read_small_file(const fs::path& p) {
  std::error_code ec;
  uintmax_t size = fs::file_size(p, ec);
  if (ec) return io_error("{}: cannot stat: {}", p.string(), ec.message());
  if (size > kMaxIndexBytes) return invalid_argument("{}: {} bytes is too large for an index", p.string(), size);
  std::ifstream in(p, std::ios::binary);
  if (!in) return io_error("{}: cannot open", p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (!in && !in.eof()) return io_error("{}: read failed", p.string());
  return ss.str();
}

bool has_shards(const fs::path& dir, const std::string& prefix) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.size() > prefix.size() + 13 && n.compare(0, prefix.size() + 1, prefix + "-") == 0 &&
        n.compare(n.size() - 12, 12, ".safetensors") == 0) {
      return true;
    }
  }
  return false;
}

}  // namespace

const char* checkpoint_layout_name(CheckpointLayout l) {
  switch (l) {
    case CheckpointLayout::kMistral: return "mistral";
    case CheckpointLayout::kHF: return "hf";
  }
  return "?";
}

Status Checkpoint::add_file(std::shared_ptr<const SafetensorsFile> f) {
  size_t idx = files_.size();
  for (const std::string& n : f->names()) {
    auto [it, inserted] = where_.emplace(n, idx);
    if (!inserted) {
      return invalid_argument("{}: tensor \"{}\" is in both {} and {}", dir_, n,
                              fs::path(files_[it->second]->path()).filename().string(),
                              fs::path(f->path()).filename().string());
    }
  }
  files_.push_back(std::move(f));
  return ok_status();
}

Result<Checkpoint> Checkpoint::open_single(const std::string& dir, const std::string& file, CheckpointLayout layout) {
  Checkpoint c;
  c.dir_ = dir;
  c.layout_ = layout;
  ML4_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(file));
  ML4_RETURN_IF_ERROR(c.add_file(std::move(f)));
  return c;
}

Result<Checkpoint> Checkpoint::open_index(const std::string& dir, const std::string& index_file, CheckpointLayout layout) {
  const std::string& ip = index_file;
  ML4_ASSIGN_OR_RETURN(std::string text, read_small_file(index_file));
  json idx;
  ML4_RETURN_IF_ERROR(parse_index_json(ip, text, &idx));
  if (!idx.is_object()) return invalid_argument("{}: index is {}, not an object", ip, idx.type_name());
  if (!idx.contains("weight_map") || !idx["weight_map"].is_object()) {
    return invalid_argument("{}: no \"weight_map\" object", ip);
  }
  const json& wm = idx["weight_map"];

  // Files in order of first appearance; each must be a plain name inside `dir`.
  std::vector<std::string> file_names;
  std::map<std::string, size_t> file_index;
  std::map<std::string, std::string> mapped;  // tensor -> file name
  for (auto it = wm.begin(); it != wm.end(); ++it) {
    if (!it->is_string()) {
      return invalid_argument("{}: weight_map[\"{}\"] is {}, not a file name", ip, it.key(), it->type_name());
    }
    const std::string& fname = it->get_ref<const std::string&>();
    if (fname.empty() || fname == "." || fname == ".." || fname.find('/') != std::string::npos ||
        fname.find('\\') != std::string::npos) {
      return invalid_argument("{}: tensor \"{}\" maps to \"{}\", not a file name in the directory", ip, it.key(), fname);
    }
    if (file_index.emplace(fname, file_names.size()).second) file_names.push_back(fname);
    mapped[it.key()] = fname;
  }

  std::vector<std::shared_ptr<const SafetensorsFile>> opened;
  for (const std::string& fname : file_names) {
    fs::path p = fs::path(dir) / fname;
    if (!is_regular(p)) return not_found("{}: names shard {}, which does not exist in {}", ip, fname, dir);
    ML4_ASSIGN_OR_RETURN(auto f, SafetensorsFile::open(p.string()));
    opened.push_back(std::move(f));
  }
  // Every tensor of a shard must be mapped to that shard; one mapped elsewhere is either a
  // duplicate (the other shard holds it too) or a wrong index entry.
  for (size_t i = 0; i < opened.size(); ++i) {
    const std::string& fname = file_names[i];
    for (const std::string& n : opened[i]->names()) {
      auto m = mapped.find(n);
      if (m == mapped.end()) {
        return invalid_argument("{}: shard {} holds tensor \"{}\", which the index does not list", ip, fname, n);
      }
      if (m->second != fname) {
        if (opened[file_index.at(m->second)]->contains(n)) {
          return invalid_argument("{}: tensor \"{}\" is in two shards, {} and {}", ip, n, m->second, fname);
        }
        return invalid_argument("{}: tensor \"{}\" is in shard {}, but the index maps it to {}, which does not hold it",
                                ip, n, fname, m->second);
      }
    }
  }
  Checkpoint c;
  c.dir_ = dir;
  c.layout_ = layout;
  for (auto& f : opened) ML4_RETURN_IF_ERROR(c.add_file(std::move(f)));
  for (const auto& [n, fname] : mapped) {
    if (!c.where_.count(n)) {
      return not_found("{}: tensor \"{}\" is mapped to {}, which does not hold it", ip, n, fname);
    }
  }
  return c;
}

Result<Checkpoint> Checkpoint::open(const std::string& dir) {
  std::error_code ec;
  fs::path d(dir);
  if (is_regular(d) && d.extension() == ".safetensors") {
    // A single file given directly: its name tells the layout.
    std::string stem = d.filename().string();
    auto layout = stem.rfind("model", 0) == 0 ? CheckpointLayout::kHF : CheckpointLayout::kMistral;
    return open_single(d.parent_path().string(), dir, layout);
  }
  if (!fs::is_directory(d, ec)) return not_found("{}: no such directory", dir);

  const std::pair<const char*, CheckpointLayout> kLayouts[] = {
      {"consolidated", CheckpointLayout::kMistral},
      {"model", CheckpointLayout::kHF},
  };
  for (const auto& [prefix, layout] : kLayouts) {
    fs::path single = d / (std::string(prefix) + ".safetensors");
    fs::path index = d / (std::string(prefix) + ".safetensors.index.json");
    bool has_single = is_regular(single), has_index = is_regular(index);
    if (has_single && has_index) {
      return invalid_argument("{}: both {} and {} exist; which are the weights? remove one", dir,
                              single.filename().string(), index.filename().string());
    }
    if (has_index) return open_index(dir, index.string(), layout);
    if (has_single) return open_single(dir, single.string(), layout);
    if (has_shards(d, prefix)) {
      return not_found("{}: {}-*.safetensors shards but no {}", dir, prefix, index.filename().string());
    }
  }
  return not_found(
      "{}: no weights found (looked for consolidated.safetensors, consolidated.safetensors.index.json, "
      "model.safetensors, model.safetensors.index.json)",
      dir);
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& kv : where_) out.push_back(kv.first);
  return out;
}

const SafetensorsFile* Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  return it == where_.end() ? nullptr : files_[it->second].get();
}

Result<SafetensorsTensorInfo> Checkpoint::info(const std::string& name) const {
  const SafetensorsFile* f = file_of(name);
  if (f == nullptr) return not_found("checkpoint {}: no tensor \"{}\"", dir_, name);
  return f->info(name);
}

Result<Tensor> Checkpoint::get(const std::string& name) const {
  const SafetensorsFile* f = file_of(name);
  if (f == nullptr) return not_found("checkpoint {}: no tensor \"{}\"", dir_, name);
  return f->get(name);
}

const std::map<std::string, std::string>& Checkpoint::metadata() const {
  static const std::map<std::string, std::string> kEmpty;
  return files_.empty() ? kEmpty : files_[0]->metadata();
}

}  // namespace ml4
