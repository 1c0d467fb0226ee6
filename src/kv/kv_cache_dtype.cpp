#include "kv/kv_cache_dtype.h"

namespace ml4 {

Result<KvCacheDtype> parse_kv_cache_dtype(std::string_view s) {
  if (s == "fp8_ds_mla" || s == "auto") return KvCacheDtype::kFp8DsMla;
  if (s == "fp8") return KvCacheDtype::kFp8;
  if (s == "bf16") return KvCacheDtype::kBf16;
  return invalid_argument("kv cache dtype '{}': expected one of fp8_ds_mla, fp8, bf16, auto", s);
}

const char* kv_cache_dtype_name(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kFp8DsMla: return "fp8_ds_mla";
    case KvCacheDtype::kFp8: return "fp8";
    case KvCacheDtype::kBf16: return "bf16";
  }
  return "?";
}

}  // namespace ml4
