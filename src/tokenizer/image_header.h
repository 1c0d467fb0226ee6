// Image width and height from the first bytes of a PNG, JPEG, GIF, WebP or BMP file.
//
// The [IMG] placeholder grid of a Mistral chat prompt depends only on the image size
// (mistral-common ImageEncoder._image_to_num_tokens), so the tokenizer reads the header
// and never decodes pixels. Sizes are those PIL's Image.open reports (JPEG: the SOF frame,
// EXIF orientation not applied).
#pragma once

#include <string_view>

#include "core/status.h"

namespace ml4 {

struct ImageSize {
  int width = 0;
  int height = 0;
};

Result<ImageSize> image_size_from_header(std::string_view file_bytes);

}  // namespace ml4
