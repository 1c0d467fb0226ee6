// safetensors reader and writer; the format and the checks are described in safetensors.h.
//
// The header is parsed with nlohmann::json's callback parser so that duplicate keys,
// which a plain parse silently collapses (the last one wins), are seen and rejected, and
// nesting deeper than any real header is refused before it costs memory. Exceptions from
// the JSON library stay inside this file; callers only see Status.
#include "model/safetensors.h"

#include "model/strict_json.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace ml4 {
namespace {

using json = nlohmann::json;

// Real headers nest three deep ({name: {shape: [..]}}); anything much deeper is hostile.
constexpr int kMaxJsonDepth = 16;

// The mapped file; unmapped when the last owner (the SafetensorsFile or a view) goes.
struct Mapping {
  void* addr = nullptr;
  size_t len = 0;
  ~Mapping() {
    if (addr != nullptr) munmap(addr, len);
  }
};

// Parses `text`, rejecting duplicate keys in any object and excessive nesting.
Status parse_header_json(const std::string& file, const char* text, size_t len, json* out) {
  StrictJsonMessages m;
  m.what = "header";
  m.duplicate = [](int depth, const std::string& key) {
    return depth <= 1 ? fmt::format("tensor \"{}\" appears twice in the header (duplicate key)", key)
                      : fmt::format("duplicate key \"{}\" in the header", key);
  };
  return parse_strict_json(file, std::string_view(text, len), kMaxJsonDepth, m, out);
}

// Reads a non-negative JSON integer; floats, negatives and non-numbers are refused.
bool json_to_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    int64_t s = v.get<int64_t>();
    if (s < 0) return false;
    *out = static_cast<uint64_t>(s);
    return true;
  }
  return false;
}

std::string json_brief(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

Status parse_tensor_entry(const std::string& file, const std::string& name, const json& e,
                          uint64_t data_bytes, SafetensorsTensorInfo* info) {
  auto fail = [&](const std::string& what) {
    return invalid_argument("{}: tensor \"{}\": {}", file, name, what);
  };
  if (!e.is_object()) return fail(fmt::format("entry is {}, not an object {{dtype, shape, data_offsets}}", json_brief(e)));
  for (const char* k : {"dtype", "shape", "data_offsets"}) {
    if (!e.contains(k)) return fail(fmt::format("entry has no \"{}\"", k));
  }
  for (auto it = e.begin(); it != e.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return fail(fmt::format("unexpected field \"{}\" (expected dtype, shape, data_offsets)", it.key()));
    }
  }
  const json& jd = e["dtype"];
  if (!jd.is_string()) return fail(fmt::format("dtype is {}, not a string", json_brief(jd)));
  auto dt = dtype_from_safetensors(jd.get_ref<const std::string&>());
  if (!dt) return fail(fmt::format("unknown dtype \"{}\"", jd.get_ref<const std::string&>()));
  info->dtype = *dt;

  const json& js = e["shape"];
  if (!js.is_array()) return fail(fmt::format("shape is {}, not an array", json_brief(js)));
  info->shape.clear();
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : js) {
    uint64_t v = 0;
    if (!json_to_u64(d, &v) || v > static_cast<uint64_t>(INT64_MAX)) {
      return fail(fmt::format("shape {} has a dimension {} that is not a non-negative integer", json_brief(js), json_brief(d)));
    }
    info->shape.push_back(static_cast<int64_t>(v));
    if (__builtin_mul_overflow(numel, v, &numel)) overflow = true;
  }

  const json& jo = e["data_offsets"];
  uint64_t b = 0, en = 0;
  if (!jo.is_array() || jo.size() != 2 || !json_to_u64(jo[0], &b) || !json_to_u64(jo[1], &en)) {
    return fail(fmt::format("data_offsets {} is not [begin, end] of non-negative integers", json_brief(jo)));
  }
  if (b > en) return fail(fmt::format("data_offsets [{}, {}] has begin > end", b, en));
  if (en > data_bytes) {
    return fail(fmt::format("data_offsets [{}, {}] end past the data region ({} bytes): file truncated?", b, en, data_bytes));
  }
  uint64_t want = 0;
  if (overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(*dt)), &want)) {
    return fail(fmt::format("shape {} {} is too large (its byte size overflows 64 bits)", shape_str(info->shape),
                            jd.get_ref<const std::string&>()));
  }
  if (en - b != want) {
    return fail(fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} {} needs {}", b, en, en - b,
                            shape_str(info->shape), jd.get_ref<const std::string&>(), want));
  }
  info->begin = b;
  info->end = en;
  return ok_status();
}

Status write_all(FILE* f, const void* p, size_t n) {
  if (n != 0 && std::fwrite(p, 1, n, f) != n) return io_error("write failed: {}", std::strerror(errno));
  return ok_status();
}

// Writes `bytes` to `path` through `path`.tmp + rename.
Status write_text_file(const std::string& path, const std::string& bytes) {
  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return io_error("{}: cannot create: {}", tmp, std::strerror(errno));
  Status s = write_all(f, bytes.data(), bytes.size());
  if (std::fclose(f) != 0 && s.ok()) s = io_error("close failed: {}", std::strerror(errno));
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) s = io_error("rename failed: {}", std::strerror(errno));
  if (!s.ok()) std::remove(tmp.c_str());
  return s.with_context(path);
}

}  // namespace

Status parse_safetensors_header(const std::string& file, const char* text, size_t len, uint64_t data_bytes,
                                std::map<std::string, SafetensorsTensorInfo>* tensors,
                                std::map<std::string, std::string>* metadata) {
  tensors->clear();
  metadata->clear();
  json h;
  ML4_RETURN_IF_ERROR(parse_header_json(file, text, len, &h));
  if (!h.is_object()) return invalid_argument("{}: header JSON is {}, not an object", file, h.type_name());
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (!it->is_object()) return invalid_argument("{}: __metadata__ is {}, not an object", file, it->type_name());
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return invalid_argument("{}: __metadata__ \"{}\" is {}, not a string", file, m.key(), m->type_name());
        }
        (*metadata)[m.key()] = m->get<std::string>();
      }
      continue;
    }
    SafetensorsTensorInfo info;
    ML4_RETURN_IF_ERROR(parse_tensor_entry(file, name, *it, data_bytes, &info));
    tensors->emplace(name, std::move(info));
  }
  // Overlap: sort the non-empty ranges by begin and compare each with the furthest end so far.
  std::vector<std::pair<const std::string*, const SafetensorsTensorInfo*>> ranges;
  for (const auto& [name, info] : *tensors) {
    if (info.end > info.begin) ranges.emplace_back(&name, &info);
  }
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin : *a.first < *b.first;
  });
  for (size_t i = 1, far = 0; i < ranges.size(); ++i) {
    const auto* prev = ranges[far].second;
    const auto* cur = ranges[i].second;
    if (cur->begin < prev->end) {
      return invalid_argument("{}: tensor \"{}\": data_offsets [{}, {}] overlap tensor \"{}\" [{}, {}]", file,
                              *ranges[i].first, cur->begin, cur->end, *ranges[far].first, prev->begin, prev->end);
    }
    if (cur->end > prev->end) far = i;
  }
  return ok_status();
}

Result<std::shared_ptr<const SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return not_found("{}: no such file", path);
    return io_error("{}: cannot open: {}", path, std::strerror(errno));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return io_error("{}: cannot stat: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return invalid_argument("{}: not a regular file", path);
  }
  uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    return invalid_argument("{}: file is {} bytes, too short for the 8-byte header length: file truncated?", path, file_bytes);
  }
  void* addr = mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (addr == MAP_FAILED) return io_error("{}: mmap failed: {}", path, std::strerror(map_err));
  auto mapping = std::make_shared<Mapping>();
  mapping->addr = addr;
  mapping->len = file_bytes;

  const auto* bytes = static_cast<const uint8_t*>(addr);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];  // little-endian whatever the host
  if (n > kMaxSafetensorsHeaderBytes) {
    return invalid_argument("{}: header length {} is absurd (more than {} bytes): not a safetensors file?", path, n,
                            kMaxSafetensorsHeaderBytes);
  }
  if (n > file_bytes - 8) {
    return invalid_argument("{}: header length {} runs past the end of the file ({} bytes): file truncated?", path, n,
                            file_bytes);
  }
  if (n < 2) return invalid_argument("{}: header length {} is too short for a JSON object", path, n);

  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_bytes_ = file_bytes;
  f->data_ = bytes + 8 + n;
  f->data_bytes_ = file_bytes - 8 - n;
  ML4_RETURN_IF_ERROR(parse_safetensors_header(path, reinterpret_cast<const char*>(bytes + 8), n, f->data_bytes_,
                                               &f->tensors_, &f->metadata_));
  f->mapping_ = std::shared_ptr<const void>(mapping, mapping->addr);
  return std::shared_ptr<const SafetensorsFile>(std::move(f));
}

void SafetensorsFile::drop_resident_pages() const {
  if (mapping_ != nullptr) madvise(const_cast<void*>(mapping_.get()), map_bytes_, MADV_DONTNEED);
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& kv : tensors_) out.push_back(kv.first);
  return out;
}

Result<SafetensorsTensorInfo> SafetensorsFile::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return not_found("{}: no tensor \"{}\"", path_, name);
  return it->second;
}

Result<Tensor> SafetensorsFile::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return not_found("{}: no tensor \"{}\"", path_, name);
  const SafetensorsTensorInfo& info = it->second;
  const uint8_t* p = data_ + info.begin;
  if (reinterpret_cast<uintptr_t>(p) % dtype_size(info.dtype) != 0) {
    Tensor copy(info.dtype, info.shape);
    if (info.nbytes() != 0) std::memcpy(copy.mutable_data(), p, info.nbytes());
    return copy;
  }
  return Tensor::view(info.dtype, info.shape, p, mapping_);
}

// ---------------------------------------------------------------------------------------
// Writer

std::string safetensors_shard_name(const std::string& prefix, int i, int n) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", prefix, i + 1, n);
}

Status SafetensorsWriter::add(const std::string& name, Tensor tensor) {
  if (name.empty()) return invalid_argument("safetensors writer: empty tensor name");
  if (name == "__metadata__") return invalid_argument("safetensors writer: \"__metadata__\" is reserved");
  if (index_.count(name) != 0) return invalid_argument("safetensors writer: tensor \"{}\" added twice", name);
  if (tensor.empty() && tensor.nbytes() != 0) {
    return invalid_argument("safetensors writer: tensor \"{}\" {} has no data", name, tensor.describe());
  }
  for (int64_t d : tensor.shape()) {
    if (d < 0) return invalid_argument("safetensors writer: tensor \"{}\" has negative shape {}", name, shape_str(tensor.shape()));
  }
  index_[name] = tensors_.size();
  tensors_.push_back({name, std::move(tensor)});
  return ok_status();
}

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t t = 0;
  for (const auto& e : tensors_) t += e.tensor.nbytes();
  return t;
}

Status SafetensorsWriter::write_entries(const std::string& path, const std::vector<const Entry*>& in_order) const {
  // Data in the order added, unless that would leave a tensor misaligned for its element
  // size (an odd-sized small tensor before an f32 one, say): then, like the reference
  // writer, larger elements first (stable, so the added order holds within a size).
  // The file then needs no holes, which the reference reader would refuse.
  std::vector<const Entry*> entries = in_order;
  uint64_t pos = 0;
  bool aligned = true;
  for (const Entry* e : entries) {
    aligned = aligned && pos % dtype_size(e->tensor.dtype()) == 0;
    pos += e->tensor.nbytes();
  }
  if (!aligned) {
    std::stable_sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
      return dtype_size(a->tensor.dtype()) > dtype_size(b->tensor.dtype());
    });
  }
  // ordered_json keeps __metadata__ first and the tensors in data order, as the reference does.
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) m[k] = v;
    h["__metadata__"] = std::move(m);
  }
  uint64_t off = 0;
  for (const Entry* e : entries) {
    uint64_t n = e->tensor.nbytes();
    h[e->name] = {{"dtype", dtype_to_safetensors(e->tensor.dtype())},
                  {"shape", e->tensor.shape()},
                  {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string header;
  try {
    header = h.dump();
  } catch (const nlohmann::ordered_json::exception& ex) {  // invalid UTF-8 in a name
    return invalid_argument("{}: cannot encode header: {}", path, ex.what());
  }
  header.append((8 - header.size() % 8) % 8, ' ');
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));

  std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return io_error("{}: cannot create: {}", tmp, std::strerror(errno));
  Status s = write_all(f, len_bytes, 8);
  if (s.ok()) s = write_all(f, header.data(), header.size());
  for (const Entry* e : entries) {
    if (!s.ok()) break;
    s = write_all(f, e->tensor.data(), e->tensor.nbytes());
  }
  if (std::fclose(f) != 0 && s.ok()) s = io_error("close failed: {}", std::strerror(errno));
  if (s.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) s = io_error("rename failed: {}", std::strerror(errno));
  if (!s.ok()) std::remove(tmp.c_str());
  return s.with_context(path);
}

Status SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Entry*> all;
  for (const auto& e : tensors_) all.push_back(&e);
  return write_entries(path, all);
}

Status SafetensorsWriter::write_sharded(const std::string& dir, const std::string& prefix, uint64_t max_shard_bytes) const {
  namespace fs = std::filesystem;
  if (max_shard_bytes == 0) return invalid_argument("write_sharded: max_shard_bytes must be positive");
  if (prefix.empty() || prefix.find('/') != std::string::npos) {
    return invalid_argument("write_sharded: bad prefix \"{}\"", prefix);
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("{}: cannot create directory: {}", dir, ec.message());

  std::vector<std::vector<const Entry*>> shards;
  uint64_t in_shard = 0;
  for (const auto& e : tensors_) {
    uint64_t n = e.tensor.nbytes();
    if (shards.empty() || (in_shard > 0 && in_shard + n > max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&e);
    in_shard += n;
  }
  if (shards.empty()) shards.emplace_back();  // no tensors: still a valid (empty) file

  const fs::path base(dir);
  const fs::path single = base / (prefix + ".safetensors");
  const fs::path index = base / (prefix + ".safetensors.index.json");
  if (shards.size() == 1) {
    // A stale index from an earlier sharded write would make the directory ambiguous.
    fs::remove(index, ec);
    return write_entries(single.string(), shards[0]);
  }
  fs::remove(single, ec);
  const int n = static_cast<int>(shards.size());
  json weight_map = json::object();  // sorted by name, as transformers writes it
  for (int i = 0; i < n; ++i) {
    std::string fname = safetensors_shard_name(prefix, i, n);
    ML4_RETURN_IF_ERROR(write_entries((base / fname).string(), shards[i]));
    for (const Entry* e : shards[i]) weight_map[e->name] = fname;
  }
  nlohmann::ordered_json idx = {{"metadata", {{"total_size", total_bytes()}}}, {"weight_map", weight_map}};
  return write_text_file(index.string(), idx.dump(2) + "\n");
}

}  // namespace ml4
