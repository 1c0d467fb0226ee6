// Plain byte encoding of the control messages rank 0 sends its workers (a step's input, its
// forced decisions): fixed-width little-endian scalars and length-prefixed vectors. Both ends
// are the same binary, so no versioning; the reader still checks every length against what
// is left, so a short or corrupt message is an error, never an overread.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/status.h"

namespace ml4 {

class WireWriter {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    put<uint64_t>(v.size());
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    buf_.insert(buf_.end(), p, p + v.size() * sizeof(T));
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class WireReader {
 public:
  WireReader(const uint8_t* data, size_t size) : p_(data), left_(size) {}
  template <typename T>
  Status get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (left_ < sizeof(T)) return internal_error("control message: {} bytes short", sizeof(T) - left_);
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    left_ -= sizeof(T);
    return ok_status();
  }
  template <typename T>
  Status get_vec(std::vector<T>* v) {
    uint64_t n = 0;
    ML4_RETURN_IF_ERROR(get(&n));
    if (n > left_ / sizeof(T)) return internal_error("control message: a vector of {} elements overruns it", n);
    v->resize(n);
    std::memcpy(v->data(), p_, n * sizeof(T));
    p_ += n * sizeof(T);
    left_ -= n * sizeof(T);
    return ok_status();
  }
  size_t left() const { return left_; }

 private:
  const uint8_t* p_;
  size_t left_;
};

}  // namespace ml4
