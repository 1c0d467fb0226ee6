// See http_listen.h.
#include "server/http_listen.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <memory>

namespace ml4 {

Result<int> bind_http(httplib::Server& http, const std::string& host, int port) {
  // The last socket httplib created is the one that bound (it closes the failed ones).
  auto fd = std::make_shared<socket_t>(-1);
  http.set_socket_options([fd](socket_t sock) {
    httplib::default_socket_options(sock);
    *fd = sock;
  });
  int bound = port;
  if (port == 0) {
    bound = http.bind_to_any_port(host);
    if (bound <= 0) return io_error("cannot bind {} on any port", host);
  } else if (!http.bind_to_port(host, port)) {
    return io_error("cannot bind {}:{} (in use, or not a local address)", host, port);
  }
  if (*fd < 0) return internal_error("bind {}:{}: httplib did not report its listening socket", host, bound);
  if (::listen(*fd, kListenBacklog) != 0)
    return io_error("listen backlog {} on {}:{}: {}", kListenBacklog, host, bound, std::strerror(errno));
  return bound;
}

}  // namespace ml4
