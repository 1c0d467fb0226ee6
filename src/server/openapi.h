// The server's OpenAPI 3.1 description, served at GET /openapi.json (as vLLM's FastAPI app
// serves its own): the routes, their methods, the request bodies' fields with their types and
// ranges, the error object. tests/server/test_fuzz.py generates requests from it
// (hypothesis-jsonschema) and checks that none gets a 5xx; keep it in step with
// openai_protocol.cpp when a field is added.
#pragma once

#include <string>

namespace ml4 {

// The document, JSON text (built once).
const std::string& openapi_json();

}  // namespace ml4
