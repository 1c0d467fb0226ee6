// Base64 codec (RFC 4648 section 4).
#include "tokenizer/base64.h"

#include <array>

namespace ml4 {
namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
constexpr std::array<int8_t, 256> make_table() {
  std::array<int8_t, 256> t{};
  for (auto& v : t) v = -1;
  for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(kAlphabet[i])] = static_cast<int8_t>(i);
  return t;
}
constexpr auto kTable = make_table();
}  // namespace

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      char c = in[i + k];
      if (c == '=') {
        if (i + 4 != in.size() || k < 2) return false;
        v[k] = 0;
        ++pad;
      } else {
        if (pad) return false;
        v[k] = kTable[static_cast<unsigned char>(c)];
        if (v[k] < 0) return false;
      }
    }
    uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out.push_back(static_cast<char>(w >> 16));
    if (pad < 2) out.push_back(static_cast<char>((w >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(w & 0xFF));
  }
  return true;
}

std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    uint32_t w = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8) |
                 static_cast<unsigned char>(in[i + 2]);
    out += kAlphabet[w >> 18];
    out += kAlphabet[(w >> 12) & 63];
    out += kAlphabet[(w >> 6) & 63];
    out += kAlphabet[w & 63];
  }
  if (size_t rest = in.size() - i) {
    uint32_t w = static_cast<unsigned char>(in[i]) << 16;
    if (rest == 2) w |= static_cast<unsigned char>(in[i + 1]) << 8;
    out += kAlphabet[w >> 18];
    out += kAlphabet[(w >> 12) & 63];
    out += rest == 2 ? kAlphabet[(w >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

}  // namespace ml4
