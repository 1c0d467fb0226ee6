// Request-body limits for an httplib 0.11 server (the OpenAI server; the P/D proxy can use the
// same): the framing checked from the headers before any body byte is read, the body read
// through httplib's content reader counting bytes whatever the framing, and an answer that
// closes the connection when a body is left unread. Why each: docs/SERVER.md "Request bodies".
//
// Use: a pre-routing handler calls check_framing and answers a non-zero status at once (with
// respond_and_close when has_body); POST routes are registered with a ContentReader and call
// read_body, answering 413 / 400 with respond_and_close.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ml4 {

// The body's framing, from the headers alone. status 0: acceptable.
struct Framing {
  int status = 0;
  std::string message;
  bool has_body = false;  // bytes follow the headers
  uint64_t content_length = 0;
  bool chunked = false;
};

// Duplicate or non-numeric Content-Length, Content-Length with Transfer-Encoding, a
// Transfer-Encoding other than chunked: 400; a Content-Length above `limit`: 413.
Framing check_framing(const httplib::Request& req, size_t limit);

// Reads a POST body, stopping as soon as it passes `limit` bytes whatever the framing. 0 when
// read, else the status to answer (413 too large, 400 broken framing). No Content-Length and no
// Transfer-Encoding: no body (RFC 9112 6.3).
int read_body(const Framing& framing, const httplib::ContentReader& reader, size_t limit, std::string* body);

// Answers `status` with the JSON `body` and closes the connection afterwards (httplib 0.11
// closes a connection whose content provider fails: the provider writes the whole answer,
// ends the chunked body, then reports failure), so an unread body is never parsed as the
// next request.
void respond_and_close(httplib::Response& res, int status, const std::string& body);

}  // namespace ml4
