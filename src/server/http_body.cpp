// Request-body limits for httplib servers (design in http_body.h).
#include "server/http_body.h"

#include <algorithm>
#include <cctype>
#include <iterator>
#include <memory>

#include <fmt/format.h>

namespace ml4 {

void respond_and_close(httplib::Response& res, int status, const std::string& body) {
  res.status = status;
  res.set_header("Connection", "close");
  auto payload = std::make_shared<std::string>(body);
  res.set_chunked_content_provider("application/json", [payload](size_t, httplib::DataSink& sink) {
    sink.write(payload->data(), payload->size());
    sink.done();
    return false;
  });
}

Framing check_framing(const httplib::Request& req, size_t limit) {
  Framing f;
  auto [cl_begin, cl_end] = req.headers.equal_range("Content-Length");
  auto [te_begin, te_end] = req.headers.equal_range("Transfer-Encoding");
  const size_t n_cl = static_cast<size_t>(std::distance(cl_begin, cl_end));
  const size_t n_te = static_cast<size_t>(std::distance(te_begin, te_end));
  if (n_cl > 1) return {400, "duplicate Content-Length headers", true};
  if (n_te > 1) return {400, "duplicate Transfer-Encoding headers", true};
  if (n_te == 1) {
    if (n_cl == 1) return {400, "Content-Length and Transfer-Encoding together are not accepted", true};
    std::string te = te_begin->second;
    for (auto& c : te) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    while (!te.empty() && (te.back() == ' ' || te.back() == '\t')) te.pop_back();
    if (te != "chunked") return {400, "unsupported Transfer-Encoding (only chunked is accepted)", true};
    f.has_body = f.chunked = true;
    return f;
  }
  if (n_cl == 1) {
    std::string v = cl_begin->second;
    while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.pop_back();
    if (v.empty() || v.size() > 19 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return {400, "Content-Length must be a decimal number", true};
    f.content_length = std::stoull(v);
    f.has_body = f.content_length > 0;
    if (f.content_length > limit)
      return {413, fmt::format("request body too large: Content-Length {} exceeds the limit of {} bytes",
                               f.content_length, limit), true};
  }
  return f;
}

int read_body(const Framing& framing, const httplib::ContentReader& reader, size_t limit, std::string* body) {
  if (!framing.has_body) return 0;  // no Content-Length nor Transfer-Encoding: no body (RFC 9112 6.3)
  if (framing.content_length > 0) body->reserve(framing.content_length);
  bool too_large = false;
  const bool ok = reader([&](const char* data, size_t n) {
    if (body->size() + n > limit) {
      too_large = true;
      return false;
    }
    body->append(data, n);
    return true;
  });
  if (too_large) return 413;
  return ok ? 0 : 400;
}

}  // namespace ml4
