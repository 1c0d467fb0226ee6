// Header parsers for image_size_from_header (PNG spec 11.2.2 IHDR; JPEG ITU T.81 B.2.2 SOF;
// GIF89a logical screen; WebP VP8/VP8L/VP8X chunks; BMP BITMAPINFOHEADER).
#include "tokenizer/image_header.h"

#include <cstdint>

namespace ml4 {
namespace {

uint32_t be32(const unsigned char* p) { return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3]; }
uint32_t be16(const unsigned char* p) { return (uint32_t(p[0]) << 8) | p[1]; }
uint32_t le16(const unsigned char* p) { return uint32_t(p[0]) | (uint32_t(p[1]) << 8); }
uint32_t le24(const unsigned char* p) { return le16(p) | (uint32_t(p[2]) << 16); }
uint32_t le32(const unsigned char* p) { return le24(p) | (uint32_t(p[3]) << 24); }

}  // namespace

Result<ImageSize> image_size_from_header(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  auto ok = [](uint32_t w, uint32_t h) -> Result<ImageSize> {
    if (w == 0 || h == 0 || w > (1u << 20) || h > (1u << 20))
      return invalid_argument("image has an invalid size {}x{}", w, h);
    return ImageSize{static_cast<int>(w), static_cast<int>(h)};
  };
  if (n >= 24 && bytes.substr(0, 8) == std::string_view("\x89PNG\r\n\x1a\n", 8) && bytes.substr(12, 4) == "IHDR")
    return ok(be32(p + 16), be32(p + 20));
  if (n >= 10 && (bytes.substr(0, 6) == "GIF87a" || bytes.substr(0, 6) == "GIF89a")) return ok(le16(p + 6), le16(p + 8));
  if (n >= 26 && p[0] == 'B' && p[1] == 'M') {
    int32_t h = static_cast<int32_t>(le32(p + 22));
    return ok(le32(p + 18), static_cast<uint32_t>(h < 0 ? -h : h));
  }
  if (n >= 30 && bytes.substr(0, 4) == "RIFF" && bytes.substr(8, 4) == "WEBP") {
    std::string_view kind = bytes.substr(12, 4);
    if (kind == "VP8 " && n >= 30) return ok(le16(p + 26) & 0x3FFF, le16(p + 28) & 0x3FFF);
    if (kind == "VP8L" && n >= 25) {
      uint32_t b = le32(p + 21);
      return ok((b & 0x3FFF) + 1, ((b >> 14) & 0x3FFF) + 1);
    }
    if (kind == "VP8X" && n >= 30) return ok(le24(p + 24) + 1, le24(p + 27) + 1);
    return invalid_argument("unsupported WebP chunk {}", std::string(kind));
  }
  if (n >= 4 && p[0] == 0xFF && p[1] == 0xD8) {
    size_t i = 2;
    while (i + 4 <= n) {
      if (p[i] != 0xFF) return invalid_argument("corrupt JPEG: expected a marker at byte {}", i);
      unsigned char m = p[i + 1];
      if (m == 0xFF) { ++i; continue; }  // fill byte
      if (m == 0xD8 || m == 0x01 || (m >= 0xD0 && m <= 0xD7)) { i += 2; continue; }
      uint32_t len = be16(p + i + 2);
      bool sof = m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC;
      if (sof) {
        if (i + 9 > n) break;
        return ok(be16(p + i + 7), be16(p + i + 5));
      }
      i += 2 + len;
    }
    return invalid_argument("JPEG without a frame header");
  }
  return invalid_argument("unrecognised image format (PNG, JPEG, GIF, WebP and BMP are supported)");
}

}  // namespace ml4
