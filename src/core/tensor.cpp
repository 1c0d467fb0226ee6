#include "core/tensor.h"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace ml4 {

std::string shape_str(const Shape& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  size_t n = nbytes();
  auto buf = std::shared_ptr<uint8_t[]>(new uint8_t[n == 0 ? 1 : n]());
  data_ = buf.get();
  owner_ = std::shared_ptr<const void>(buf, buf.get());
}

Tensor Tensor::view(DType dtype, Shape shape, const void* data, std::shared_ptr<const void> keepalive) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.data_ = data;
  t.owner_ = std::move(keepalive);
  return t;
}

std::string Tensor::describe() const { return fmt::format("{} {}", shape_str(shape_), dtype_name(dtype_)); }

}  // namespace ml4
