#include "model/strict_json.h"

#include <set>
#include <stdexcept>
#include <vector>

namespace ml4 {
namespace {

// Thrown by the parse callback, caught below: a message for the user.
struct StrictJsonError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

Status parse_strict_json(const std::string& label, std::string_view text, int max_depth,
                         const StrictJsonMessages& messages, nlohmann::json* out) {
  using json = nlohmann::json;
  // One set of keys per open object; arrays push an empty set so pops stay balanced.
  std::vector<std::set<std::string>> open_objects;
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= max_depth)
          throw StrictJsonError(fmt::format("{} JSON nests deeper than {} levels", messages.what, max_depth));
        open_objects.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!open_objects.empty() && !open_objects.back().insert(key).second)
          throw StrictJsonError(messages.duplicate(depth, key));
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    *out = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const StrictJsonError& e) {
    return invalid_argument("{}: {}", label, e.what());
  } catch (const json::exception& e) {
    return invalid_argument("{}: {} is not valid JSON: {}", label, messages.what, e.what());
  }
  return ok_status();
}

}  // namespace ml4
