// Base64 (RFC 4648, standard alphabet with padding) for tekken.json's token_bytes.
#pragma once

#include <string>
#include <string_view>

namespace ml4 {

// Decodes `in` into `out`; false on a character outside the alphabet or bad padding.
bool base64_decode(std::string_view in, std::string& out);
std::string base64_encode(std::string_view in);

}  // namespace ml4
