"""The listen backlog (src/server/http_listen.h): a burst of clients must not overflow the
accept queue. With httplib's own backlog of 5 (Debian's prebuilt library), 24 clients connecting
at once saw connections reset. Deterministic check: the server is stopped (SIGSTOP), so it
accepts nothing; 64 clients connect without blocking; the kernel completes a handshake only
while the accept queue has room (backlog + 1 with tcp_abort_on_overflow = 0), so all 64 are
connected only if the backlog is at least 64. Then the server resumes and answers every one of
them.
"""
import os
import select
import signal
import socket
import time

from conftest import Server

CLIENTS = 64


def connected(s):
    _, w, _ = select.select([], [s], [], 0)
    return bool(w) and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


def test_a_burst_of_clients_is_queued_not_dropped(model_dir):
    srv = Server(model_dir, name="backlog")
    socks = []
    try:
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(CLIENTS):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", srv.port))
                socks.append(s)
            deadline = time.time() + 10
            while time.time() < deadline and sum(connected(s) for s in socks) < CLIENTS:
                time.sleep(0.05)
            n = sum(connected(s) for s in socks)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        assert n == CLIENTS, f"{n} of {CLIENTS} connections completed while the server was stopped"
        # Every queued client is then served.
        for s in socks:
            s.setblocking(True)
            s.settimeout(60)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for s in socks:
            got = b""
            while b"\r\n" not in got:
                d = s.recv(4096)
                if not d:
                    break
                got += d
            assert got.startswith(b"HTTP/1.1 200"), got[:100]
    finally:
        for s in socks:
            s.close()
        srv.stop()
