// Row and column slices of stored linear weights (weight_shard.h), every format.
#include "model/weight_shard.h"

#include <cstring>
#include <memory>

#include "model/quant.h"

namespace ml4 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A [rows, t.dim(1)] view of rows [row0, row0 + rows) of a 2-D tensor, keeping t's bytes alive.
Tensor view_rows(const Tensor& t, int64_t row0, int64_t rows) {
  const int64_t row_bytes = static_cast<int64_t>(t.nbytes()) / t.dim(0);
  auto keep = std::make_shared<Tensor>(t);
  return Tensor::view(t.dtype(), {rows, t.dim(1)}, static_cast<const uint8_t*>(t.data()) + row0 * row_bytes, keep);
}

// Columns [c0, c0 + n) of a 2-D tensor with `per_col` bytes per column (copied).
Tensor copy_cols(const Tensor& t, int64_t c0, int64_t n, DType dtype, int64_t out_cols) {
  const int64_t R = t.dim(0);
  const int64_t row_bytes = static_cast<int64_t>(t.nbytes()) / R;
  const int64_t col_bytes = row_bytes / t.dim(1);
  Tensor out(dtype, {R, out_cols});
  auto* dst = static_cast<uint8_t*>(out.mutable_data());
  const auto* src = static_cast<const uint8_t*>(t.data());
  for (int64_t r = 0; r < R; ++r) std::memcpy(dst + r * n * col_bytes, src + r * row_bytes + c0 * col_bytes, n * col_bytes);
  return out;
}

Status check_range(const LinearWeight& w, int64_t begin, int64_t count, int64_t total, const char* what) {
  if (begin < 0 || count <= 0 || begin + count > total)
    return internal_error("tensor {}: {} slice [{}, {}) outside [0, {})", w.name, what, begin, begin + count, total);
  return ok_status();
}

// A slice along a quantization-blocked dimension must cut whole blocks (vLLM refuses such
// TP sizes too: "not divisible by weight quantization block").
Status check_blocks(const LinearWeight& w, int64_t begin, int64_t count, int64_t total, int64_t block,
                    const char* what) {
  if (begin % block != 0 || (count % block != 0 && begin + count != total))
    return invalid_argument(
        "tensor {}: the parallel split takes {} [{}, {}), which cuts its {} blocks of {}; choose a tensor-parallel "
        "size that keeps {} slices multiples of {}",
        w.name, what, begin, begin + count, linear_format_name(w.format), block, what, block);
  return ok_status();
}

}  // namespace

Tensor slice_tensor_rows(const Tensor& t, int64_t row0, int64_t rows) {
  if (row0 == 0 && rows == t.dim(0)) return t;
  return view_rows(t, row0, rows);
}

Result<LinearWeight> slice_linear_rows(const LinearWeight& w, int64_t row0, int64_t rows) {
  ML4_RETURN_IF_ERROR(check_range(w, row0, rows, w.out_features, "row"));
  if (row0 == 0 && rows == w.out_features) return w;
  Tensor scale;
  switch (w.format) {
    case LinearFormat::kF32:
    case LinearFormat::kBF16:
      break;
    case LinearFormat::kFP8Block:
      ML4_RETURN_IF_ERROR(check_blocks(w, row0, rows, w.out_features, kFp8BlockSize, "rows"));
      scale = view_rows(w.scale, row0 / kFp8BlockSize, ceil_div(rows, kFp8BlockSize));
      break;
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4:
      scale = view_rows(w.scale, row0, rows);
      break;
  }
  return make_linear_weight(w.name, w.format, rows, w.in_features, view_rows(w.weight, row0, rows), scale,
                            w.global_scale);
}

Result<LinearWeight> slice_linear_cols(const LinearWeight& w, int64_t col0, int64_t cols) {
  ML4_RETURN_IF_ERROR(check_range(w, col0, cols, w.in_features, "column"));
  if (col0 == 0 && cols == w.in_features) return w;
  Tensor weight, scale;
  switch (w.format) {
    case LinearFormat::kF32:
    case LinearFormat::kBF16:
      weight = copy_cols(w.weight, col0, cols, w.weight.dtype(), cols);
      break;
    case LinearFormat::kFP8Block: {
      ML4_RETURN_IF_ERROR(check_blocks(w, col0, cols, w.in_features, kFp8BlockSize, "columns"));
      weight = copy_cols(w.weight, col0, cols, w.weight.dtype(), cols);
      const int64_t b0 = col0 / kFp8BlockSize, nb = ceil_div(cols, kFp8BlockSize);
      scale = copy_cols(w.scale, b0, nb, DType::kF32, nb);
      break;
    }
    case LinearFormat::kNVFP4:
    case LinearFormat::kMXFP4: {
      const int64_t g = w.format == LinearFormat::kNVFP4 ? kNvfp4GroupSize : kMxfp4GroupSize;
      if (col0 % g != 0 || cols % g != 0)
        return invalid_argument("tensor {}: the parallel split takes columns [{}, {}), which cuts its {} groups of {}",
                                w.name, col0, col0 + cols, linear_format_name(w.format), g);
      // Two values per byte: byte columns [col0 / 2, (col0 + cols) / 2).
      weight = copy_cols(w.weight, col0 / 2, cols / 2, w.weight.dtype(), cols / 2);
      scale = copy_cols(w.scale, col0 / g, cols / g, w.scale.dtype(), cols / g);
      break;
    }
  }
  return make_linear_weight(w.name, w.format, w.out_features, cols, weight, scale, w.global_scale);
}

}  // namespace ml4
