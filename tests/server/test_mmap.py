"""`--mmap` / `--no-mmap` (llama.cpp's flags; model/weight_memory.h): both run the same weights,
so greedy generation gives the same text; `--no-mmap` says what it copied; the two together
are refused."""
import subprocess

from conftest import ml4_bin


def generate(model_dir, *flags):
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "The capital of France is",
                        "--max-tokens", "12", "--temperature", "0", *flags],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_mmap_and_copy_generate_the_same(model_dir):
    mapped = generate(model_dir, "--mmap")
    copied = generate(model_dir, "--no-mmap")
    ids = [[ln for ln in p.stdout.splitlines() if ln.startswith("ids:")] for p in (mapped, copied)]
    assert ids[0] == ids[1] and len(ids[0]) == 1 and len(ids[0][0].split(",")) == 12
    assert "of linear weights in memory" in copied.stdout + copied.stderr
    assert "of linear weights in memory" not in mapped.stdout + mapped.stderr


def test_mmap_and_no_mmap_together_are_refused(model_dir):
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--mmap", "--no-mmap"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "excludes" in (p.stdout + p.stderr)
