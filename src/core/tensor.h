// A host tensor: dtype, shape, and bytes that are either owned or borrowed (an mmap view).
//
// Deliberately small: the CPU backend works on f32 activations in std::vector-backed
// tensors and reads weights in their stored format through views into the mapped file.
#pragma once

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace ml4 {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "[16384, 512]"

inline int64_t shape_numel(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

class Tensor {
 public:
  Tensor() = default;
  // Owned, zero-filled storage.
  Tensor(DType dtype, Shape shape);
  // A borrowed view; `keepalive` holds whatever owns the bytes (a mapped file).
  static Tensor view(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> keepalive);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i < 0 ? shape_.size() + i : i]; }
  int rank() const { return static_cast<int>(shape_.size()); }
  // Elements as stored: for kF4E2M1x2 this counts bytes (two values each).
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool empty() const { return data_ == nullptr; }

  const void* data() const { return data_; }
  void* mutable_data() { return const_cast<void*>(data_); }
  template <typename T> const T* as() const { return static_cast<const T*>(data_); }
  template <typename T> T* mutable_as() { return static_cast<T*>(mutable_data()); }

  std::string describe() const;  // "[16384, 512] bf16"

 private:
  DType dtype_ = DType::kF32;
  Shape shape_;
  const void* data_ = nullptr;
  std::shared_ptr<const void> owner_;
};

}  // namespace ml4
