"""`--decode-backend latency_specialized` fails closed at start-up (runtime/latency_decode.h):
on a configuration it does not support the command exits non-zero before loading anything,
listing every reason at once; the default `standard` serves; an unknown backend is refused by
name. (The supported configuration runs on the GPU: tests/cuda/cuda_runner_test.cpp.)"""
import subprocess

from conftest import ml4_bin


def run(model_dir, *flags, timeout=120):
    return subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "3",
                           "--temperature", "0", *flags], capture_output=True, text=True, timeout=timeout)


def test_latency_specialized_lists_every_reason(model_dir):
    p = run(model_dir, "--decode-backend", "latency_specialized", "-tp", "2", "--batch-invariant")
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    for reason in ["--device cpu", "--batch-invariant", "--tensor-parallel-size 2", "weights are bf16"]:
        assert reason in out, (reason, out)
    assert "refused (4 reasons)" in out, out
    assert "ids:" not in out  # nothing generated: no fallback


def test_standard_backend_generates(model_dir):
    p = run(model_dir, "--decode-backend", "standard")
    assert p.returncode == 0, p.stdout + p.stderr
    assert any(ln.startswith("ids:") for ln in p.stdout.splitlines())


def test_unknown_backend_is_refused(model_dir):
    p = run(model_dir, "--decode-backend", "fast")
    assert p.returncode != 0 and "fast" in p.stdout + p.stderr
