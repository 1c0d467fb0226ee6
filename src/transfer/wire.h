// Little-endian byte encoding for the metadata blobs an agent and a connector publish, with
// a reader that checks every length against what is left (a truncated or corrupt blob is an
// error, never a read past the end) and FNV-1a over the whole blob.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ml4::transfer {

inline uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64-bit offset basis and prime
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class ByteWriter {
 public:
  void u8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void i64(int64_t v) { raw(&v, 8); }
  void bytes(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
  }
  std::string& str() { return out_; }

 private:
  void raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }  // x86/arm64: LE
  std::string out_;
};

class ByteReader {
 public:
  ByteReader(std::string_view in, const char* what) : in_(in), what_(what) {}
  Status u8(uint8_t* v) { return raw(v, 1); }
  Status u32(uint32_t* v) { return raw(v, 4); }
  Status u64(uint64_t* v) { return raw(v, 8); }
  Status i64(int64_t* v) { return raw(v, 8); }
  // A length-prefixed byte string of at most `max` bytes.
  Status bytes(std::string* s, uint32_t max) {
    uint32_t n = 0;
    ML4_RETURN_IF_ERROR(u32(&n));
    if (n > max) return invalid_argument("{}: a field claims {} bytes (at most {})", what_, n, max);
    if (n > in_.size() - pos_) return truncated(n);
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return ok_status();
  }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  Status raw(void* p, size_t n) {
    if (n > in_.size() - pos_) return truncated(n);
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return ok_status();
  }
  Status truncated(size_t n) const {
    return invalid_argument("{}: truncated ({} bytes wanted at offset {}, {} left)", what_, n, pos_, in_.size() - pos_);
  }
  std::string_view in_;
  const char* what_;
  size_t pos_ = 0;
};

// A blob = magic (8 bytes) + u64 FNV-1a of the body + u64 body length + body.
inline std::string seal_blob(const char (&magic)[9], const std::string& body) {
  ByteWriter w;
  w.str().append(magic, 8);
  w.u64(fnv1a64(body));
  w.u64(body.size());
  w.str() += body;
  return std::move(w.str());
}

inline Result<std::string_view> open_blob(std::string_view blob, const char (&magic)[9], const char* what) {
  if (blob.size() < 24) return invalid_argument("{}: truncated ({} bytes, the header alone is 24)", what, blob.size());
  if (std::memcmp(blob.data(), magic, 8) != 0)
    return invalid_argument("{}: not an ml4 blob of this kind (bad magic; another version of ml4?)", what);
  uint64_t sum = 0, len = 0;
  std::memcpy(&sum, blob.data() + 8, 8);
  std::memcpy(&len, blob.data() + 16, 8);
  if (len != blob.size() - 24)
    return invalid_argument("{}: truncated or padded (header says {} body bytes, found {})", what, len, blob.size() - 24);
  std::string_view body = blob.substr(24);
  if (fnv1a64(body) != sum) return invalid_argument("{}: corrupt (checksum mismatch)", what);
  return body;
}

}  // namespace ml4::transfer
