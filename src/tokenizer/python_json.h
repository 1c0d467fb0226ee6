// JSON text exactly as Python's json.dumps(obj, ensure_ascii=False) writes it.
//
// mistral-common serialises tool definitions, tool-call arguments and model settings with
// json.dumps and tokenizes the result, so every byte counts: ", " and ": " separators,
// keys in insertion order (callers use nlohmann::ordered_json), floats in repr() form
// (shortest round-trip; exponent when the decimal exponent is < -4 or >= 16; "1.0" not "1"),
// and only '"', '\\' and control characters escaped (CPython Lib/json/encoder.py,
// py_encode_basestring; Objects/floatobject.c float_repr).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ml4 {

std::string python_json_dumps(const nlohmann::ordered_json& v);
void python_json_dumps_into(const nlohmann::ordered_json& v, std::string& out);
// repr() of a double as Python prints it ("1e-05", "100.0", "Infinity" in JSON).
std::string python_float_repr(double d);
// json.loads: false when `text` is not one JSON document (the caller keeps the raw text).
bool python_json_loads(std::string_view text, nlohmann::ordered_json& out);

}  // namespace ml4
