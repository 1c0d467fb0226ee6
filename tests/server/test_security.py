"""Issue 21's two holes, closed: request bodies are bounded whatever their framing, and image
URLs cannot read server files.

Bodies: a chunked body is cut at the limit with 413 (and the connection closed), a chunked body
that never ends is refused within the limit's worth of bytes while the process does not grow, a
Content-Length above the limit is refused from the header before any body is sent, duplicate or
non-numeric Content-Length and Content-Length with Transfer-Encoding get 400, an unknown route
or a wrong method with a chunked body is answered without reading it (404 / 405).

Media: file:// URLs are refused by default with one message for every path (existing, missing,
a directory, /dev/zero, /proc/self/environ), so nothing tells which files exist; with
--allowed-local-media-path DIR only regular files under DIR (links resolved) up to
--max-media-bytes are read; data: URLs over the cap are refused before decoding.
"""
import base64
import json
import os
import socket
import struct
import time
import zlib

import pytest

from conftest import Server

LIMIT = 65536  # the module server's --max-body-bytes (conftest)


def connect(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    return s


def read_response(s, timeout=20):
    """Reads until the peer closes or a full response with Content-Length / chunked end arrived."""
    s.settimeout(timeout)
    data = b""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep and (b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")):
            break
        if sep and b"content-length:" in head.lower():
            n = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0].split(b":")[1])
            if len(body) >= n:
                break
    return data


def status_and_json(resp):
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    return status, head, json.loads(body) if body.strip() else None


def peer_closed(s):
    s.settimeout(5)
    try:
        while True:
            d = s.recv(65536)
            if not d:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def rss_kib(server):
    return server.rss_kib()


def still_serves(server):
    s = connect(server)
    body = json.dumps({"prompt": "ok", "max_tokens": 2}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    status, _, js = status_and_json(read_response(s))
    s.close()
    assert status == 200 and js["usage"]["completion_tokens"] >= 1


def test_chunked_body_over_the_limit_is_413_and_closed(server):
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b'{"prompt": "' + b"a" * 16000
    sent = 0
    try:
        while sent < 3 * LIMIT:
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
            piece = b"a" * 16000
    except (BrokenPipeError, ConnectionResetError):
        pass
    resp = read_response(s)
    status, head, js = status_and_json(resp)
    assert status == 413, resp[:300]
    assert "too large" in js["error"]["message"]
    assert b"connection: close" in head.lower()
    assert peer_closed(s)
    s.close()
    still_serves(server)


def test_endless_chunked_body_is_cut_at_the_limit_without_growing(server):
    rss0 = rss_kib(server)
    s = connect(server)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    sent = 0
    refused = False
    t0 = time.time()
    # A client that would send forever: the server must stop it within about the limit.
    while time.time() - t0 < 20 and sent < 200 * 1024 * 1024:
        try:
            s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            refused = True
            break
    s.close()
    assert refused, f"the server accepted {sent} bytes of a chunked body"
    # Socket buffers on both sides hold a few MB at most: far below 200 MB.
    assert sent < 32 * 1024 * 1024, sent
    assert rss_kib(server) - rss0 < 20 * 1024, (rss0, rss_kib(server))
    still_serves(server)


def test_content_length_over_the_limit_is_refused_from_the_header(server):
    s = connect(server)
    # Headers only: the answer must come without the body being sent.
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 12000000\r\n\r\n")
    t0 = time.time()
    status, head, js = status_and_json(read_response(s, timeout=10))
    assert status == 413 and time.time() - t0 < 5
    assert "12000000" in js["error"]["message"]
    assert peer_closed(s)
    s.close()


@pytest.mark.parametrize("headers,fragment", [
    (b"Content-Length: 10\r\nContent-Length: 10\r\n", "duplicate Content-Length"),
    (b"Content-Length: 1e3\r\n", "decimal"),
    (b"Content-Length: -5\r\n", "decimal"),
    (b"Content-Length: 99999999999999999999999\r\n", "decimal"),
    (b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n", "together"),
    (b"Transfer-Encoding: gzip\r\n", "Transfer-Encoding"),
])
def test_bad_framing_is_400(server, headers, fragment):
    s = connect(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + b'{"prompt": "a"}')
    status, _, js = status_and_json(read_response(s))
    assert status == 400 and fragment in js["error"]["message"], js
    s.close()
    still_serves(server)


def test_unknown_route_and_wrong_method_do_not_read_the_body(server):
    for line, status in [(b"POST /v1/nothing HTTP/1.1", 404), (b"PUT /v1/completions HTTP/1.1", 405),
                         (b"DELETE /health HTTP/1.1", 405)]:
        s = connect(server)
        s.sendall(line + b"\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(64):
                s.sendall(b"10000\r\n" + b"z" * 65536 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        got, head, js = status_and_json(read_response(s))
        assert got == status and js["error"]["code"] == status
        if status == 405:
            assert b"allow:" in head.lower()
        s.close()


def png_bytes(w=32, h=16):
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    raw = b"".join(b"\x00" + b"\x80" * (w * 3) for _ in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def chat_with_image(srv, url):
    import urllib.error
    import urllib.request
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                       {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 2}
    req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_file_urls_are_refused_by_default_with_one_message(server, tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(png_bytes())
    answers = set()
    for url in ["file:///etc/passwd", "file:///proc/self/environ", "file:///dev/zero", "file:///nonexistent/x.png",
                f"file://{real}", f"file://{tmp_path}", "file://relative.png", "file:///etc/%70asswd"]:
        status, js = chat_with_image(server, url)
        assert status == 400, (url, js)
        answers.add(js["error"]["message"])
    assert len(answers) == 1, answers  # nothing tells an existing file from a missing one
    assert "--allowed-local-media-path" in answers.pop()
    rss = server.rss_kib()
    assert rss < 2 * 1024 * 1024  # /dev/zero was never read


def test_allowed_local_media_path(model_dir, tmp_path):
    media = tmp_path / "media"
    (media / "sub").mkdir(parents=True)
    outside = tmp_path / "outside.png"
    outside.write_bytes(png_bytes())
    (media / "ok.png").write_bytes(png_bytes())
    (media / "sub" / "deep.png").write_bytes(png_bytes(8, 8))
    (media / "big.png").write_bytes(png_bytes() + b"\x00" * 5000)
    os.symlink(outside, media / "link_out.png")
    os.symlink(media / "ok.png", media / "link_in.png")
    os.symlink("/dev/zero", media / "zero")
    srv = Server(model_dir, "--allowed-local-media-path", str(media), "--max-media-bytes", "4096",
                 "--max-model-len", "2048", name="media")
    try:
        # ml4-tiny's tokenizer has no image config: an image that was read and decoded reaches
        # the encoder, which refuses it with its own message (a model with images answers 200).
        def read_and_decoded(status, js):
            return status == 200 or "no image config" in js["error"]["message"]
        for good in ["ok.png", "sub/deep.png", "link_in.png"]:
            status, js = chat_with_image(srv, f"file://{media / good}")
            assert read_and_decoded(status, js), (good, js)
        (media / "garbage.png").write_bytes(b"not an image at all")
        status, js = chat_with_image(srv, f"file://{media / 'garbage.png'}")
        assert status == 400 and "Invalid image" in js["error"]["message"], js  # read, then its header refused
        refusals = set()
        for bad in [f"file://{outside}", f"file://{media / 'link_out.png'}", f"file://{media / 'zero'}",
                    f"file://{media / 'big.png'}", f"file://{media}/../outside.png", f"file://{media / 'sub'}",
                    f"file://{media / 'missing.png'}", "file:///etc/passwd"]:
            status, js = chat_with_image(srv, bad)
            assert status == 400, (bad, js)
            refusals.add(js["error"]["message"])
        assert len(refusals) == 1, refusals
        # data: URLs share the cap, checked before decoding.
        big = base64.b64encode(png_bytes() + b"\x00" * 8000).decode()
        status, js = chat_with_image(srv, "data:image/png;base64," + big)
        assert status == 400 and "too large" in js["error"]["message"]
        small = base64.b64encode(png_bytes()).decode()
        status, js = chat_with_image(srv, "data:image/png;base64," + small)
        assert read_and_decoded(status, js), js
    finally:
        srv.stop()
