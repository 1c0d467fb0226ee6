// A model directory's weights: one or several safetensors files seen as one name -> tensor map.
//
// Layouts, tried in this order (MODEL.md section 2):
//   Mistral native : consolidated.safetensors, or consolidated-*.safetensors shards listed
//                    in consolidated.safetensors.index.json
//   Hugging Face   : model.safetensors, or model-*.safetensors shards listed in
//                    model.safetensors.index.json
// Mistral's Hub repos often ship both layouts side by side; the native one wins, as in
// vLLM's `--load-format mistral`. Within one prefix, a single file and an index together
// are ambiguous and refused.
//
// The index is untrusted like the files: every file it names must be a plain name in the
// directory that exists and opens, every tensor it maps must be in that file, no tensor may
// be in two shards, and no shard may hold a tensor the index does not list. All files stay
// mapped for the Checkpoint's lifetime (and longer, while any view from `get` lives).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "model/model_config.h"
#include "model/safetensors.h"

namespace ml4 {

// CheckpointLayout (kMistral, kHF) is defined in model/model_config.h.

const char* checkpoint_layout_name(CheckpointLayout l);

class Checkpoint {
 public:
  static Result<Checkpoint> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  CheckpointLayout layout() const { return layout_; }
  // Sorted tensor names across all files.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  size_t size() const { return where_.size(); }
  Result<SafetensorsTensorInfo> info(const std::string& name) const;
  // A view into the mapped file (see SafetensorsFile::get). A missing name is kNotFound.
  Result<Tensor> get(const std::string& name) const;
  // The file that holds `name`, or nullptr.
  const SafetensorsFile* file_of(const std::string& name) const;
  const std::vector<std::shared_ptr<const SafetensorsFile>>& files() const { return files_; }
  // Metadata of the first file (HF writes {"format": "pt"} into every shard).
  const std::map<std::string, std::string>& metadata() const;

 private:
  Status add_file(std::shared_ptr<const SafetensorsFile> f);
  static Result<Checkpoint> open_single(const std::string& dir, const std::string& file, CheckpointLayout layout);
  static Result<Checkpoint> open_index(const std::string& dir, const std::string& index_file, CheckpointLayout layout);

  std::string dir_;
  CheckpointLayout layout_ = CheckpointLayout::kMistral;
  std::vector<std::shared_ptr<const SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

}  // namespace ml4
