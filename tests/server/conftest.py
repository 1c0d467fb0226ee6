"""Fixtures for the server tests: a model directory and `ml4 serve` processes.

The binary comes from $ML4_BIN (CTest sets it), else the first of build*/ml4 that exists.
Each server listens on 127.0.0.1 on a free port and is stopped with SIGTERM (graceful
shutdown) at the end of its scope; its log is printed when a test fails.
"""
import glob
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ml4_bin():
    env = os.environ.get("ML4_BIN")
    if env and os.path.exists(env):
        return env
    for path in [os.path.join(ROOT, "build", "ml4")] + sorted(glob.glob(os.path.join(ROOT, "build*", "ml4"))):
        if os.path.exists(path):
            return path
    pytest.skip("no ml4 binary: set ML4_BIN")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, *args, name="ml4-tiny"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix="ml4-serve-", suffix=".log", delete=False)
        cmd = [ml4_bin(), "serve", "--model", model_dir, "--served-model-name", name, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become healthy: " + self.log_text())

    def log_text(self):
        with open(self.log.name, errors="replace") as f:
            return f.read()[-4000:]

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("model") / "ml4-tiny")
    subprocess.run([ml4_bin(), "make-model", "--preset", "ml4-tiny", "--seed", "0", "--out", out], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--max-model-len", "512", "--max-body-bytes", "65536", "--max-queue", "96",
               "--seed", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
