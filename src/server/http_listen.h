// Binding an httplib 0.11 server (the OpenAI server and the P/D proxy) with a listen backlog
// that takes a burst of clients.
//
// httplib listens with CPPHTTPLIB_LISTEN_BACKLOG pending connections, 5 unless the library was
// compiled otherwise, and the build links Debian's prebuilt libcpp-httplib (compiled with 5),
// so defining the macro in our build changes nothing. With 5, a burst of 24 clients connecting
// at once overflowed the accept queue (the kernel's ListenOverflows counter rose) and some of
// them saw their connection reset (`ml4 bench serve`: "transport: Read"; the TP 2 load test).
// bind_http captures the listening socket through httplib's socket-options hook and calls
// listen() on it again after the bind with kListenBacklog (Linux resizes the queue of a
// listening socket; the kernel caps it at net.core.somaxconn).
#pragma once

#include <httplib.h>

#include <string>

#include "core/status.h"

namespace ml4 {

inline constexpr int kListenBacklog = 1024;

// Binds `http` to host:port (port 0: any free port) and returns the port bound.
Result<int> bind_http(httplib::Server& http, const std::string& host, int port);

}  // namespace ml4
