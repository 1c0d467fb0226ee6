// safetensors reading (mmap, validated) and writing (single file or sharded with an index).
//
// Format (huggingface/safetensors, docs "Format"): an 8-byte little-endian u64 N, then N
// bytes of JSON header, then the data region. The header maps tensor names to
// {"dtype", "shape", "data_offsets": [begin, end]} with offsets relative to the start of
// the data region, plus an optional "__metadata__" map of string to string.
//
// Reading: the file is mapped read-only once; `get` returns views into the mapping whose
// keepalive holds it, so no weight is copied at load. A checkpoint is untrusted input:
// `open` validates the whole header before returning (length bounds, JSON shape, dtypes,
// shapes, offsets inside the data region, sizes equal to numel * dtype size, no
// overlapping byte ranges, no duplicate names) and every error names the file, the
// tensor and what is wrong. Holes between tensors are allowed (the reference reader
// rejects them, but they are harmless and some converters leave them).
//
// Writing: the header is padded with spaces to a multiple of 8 bytes, as the reference
// writer (safetensors/src/tensor.rs, `prepare`) does, so that every tensor starts 8-byte
// aligned; tensors are laid out in the order they were added, unless that would leave one
// misaligned for its element size (then larger elements first, as the reference writer
// orders by dtype; the added order holds within a size). Sharded output follows the
// Hugging Face convention: `<prefix>-00001-of-0000N.safetensors` plus
// `<prefix>.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map":
// {name: file}}. Mistral's native layout uses the prefix `consolidated`, HF `model`.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace ml4 {

// The largest header accepted: real headers are a few MiB at most (a 1T-parameter model
// with ~100k tensors is ~15 MiB); anything bigger is a corrupt or hostile length field.
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct SafetensorsTensorInfo {
  DType dtype = DType::kF32;  // as stored: "U8" reads as kU8, "F8_E8M0" as kE8M0
  Shape shape;
  uint64_t begin = 0;  // byte offsets within the data region
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates its header; see the file comment for what is checked.
  static Result<std::shared_ptr<const SafetensorsFile>> open(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  size_t size() const { return tensors_.size(); }
  Result<SafetensorsTensorInfo> info(const std::string& name) const;
  // A view into the mapping (kept alive by the returned tensor). A tensor whose bytes are
  // not aligned to its element size (possible only in files from other writers) is copied
  // into an owned, aligned buffer instead.
  Result<Tensor> get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Size of the data region in bytes (the file minus 8 minus the header).
  uint64_t data_bytes() const { return data_bytes_; }
  // Unmaps this process's resident pages of the file (madvise MADV_DONTNEED on the private,
  // read-only mapping): views stay valid and fault their pages back from the page cache.
  // For a loader that copied what it streams (model/weight_memory.h).
  void drop_resident_pages() const;

  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

 private:
  SafetensorsFile() = default;

  std::string path_;
  std::shared_ptr<const void> mapping_;  // the whole file; unmapped when the last view dies
  uint64_t map_bytes_ = 0;               // the mapping's length (the file's)
  const uint8_t* data_ = nullptr;        // start of the data region
  uint64_t data_bytes_ = 0;
  std::map<std::string, SafetensorsTensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header (the JSON text) against a data region of `data_bytes`;
// `file` names the source in messages. Exposed so tests and tools can check a header
// without a file.
Status parse_safetensors_header(const std::string& file, const char* json, size_t json_len,
                                uint64_t data_bytes,
                                std::map<std::string, SafetensorsTensorInfo>* tensors,
                                std::map<std::string, std::string>* metadata);

class SafetensorsWriter {
 public:
  // Adds a tensor; the writer keeps a reference to its bytes (Tensor storage is shared),
  // so the tensor must not be modified until written. Fails on a duplicate or reserved
  // name or a tensor without data.
  Status add(const std::string& name, Tensor tensor);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // One file. Written to `path`.tmp and renamed, so a crash never leaves a half file
  // under the final name.
  Status write(const std::string& path) const;
  // Shards of at most `max_shard_bytes` of tensor data each (a larger tensor gets a shard
  // of its own), filled in the order added, plus the index. With one shard: just
  // `<dir>/<prefix>.safetensors` and no index. Creates `dir` if needed.
  Status write_sharded(const std::string& dir, const std::string& prefix, uint64_t max_shard_bytes) const;

  size_t size() const { return tensors_.size(); }
  uint64_t total_bytes() const;

 private:
  struct Entry {
    std::string name;
    Tensor tensor;
  };
  Status write_entries(const std::string& path, const std::vector<const Entry*>& entries) const;

  std::vector<Entry> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// File name of shard i (0-based) of n: "<prefix>-00001-of-00004.safetensors".
std::string safetensors_shard_name(const std::string& prefix, int i, int n);

}  // namespace ml4
