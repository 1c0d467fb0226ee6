"""`--quantization mxfp4` (vLLM's flag, -q): an FP8 checkpoint's routed experts re-quantized to
MXFP4 at load. The flag changes the model's weights (greedy ids differ from the FP8 run on a
random model, where MXFP4's coarser grid moves the logits), generation still runs, and a
checkpoint that is not FP8 is refused with a message, not served unchanged."""
import re
import subprocess

import pytest

from conftest import ml4_bin


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("model") / "ml4-tiny-fp8")
    subprocess.run([ml4_bin(), "make-model", "--preset", "ml4-tiny", "--seed", "0", "--dtype", "fp8", "--out", out],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def generate_ids(model, *extra):
    p = subprocess.run([ml4_bin(), "generate", "--model", model, "--prompt", "The quick brown fox", "--max-tokens",
                        "12", "--ignore-eos", *extra], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"ids: ([\d,]+)", p.stdout + p.stderr)
    assert m, p.stdout + p.stderr
    return [int(t) for t in m.group(1).split(",")]


def test_mxfp4_requantizes_fp8_experts(fp8_model):
    plain = generate_ids(fp8_model)
    mx = generate_ids(fp8_model, "--quantization", "mxfp4")
    assert len(plain) == len(mx) == 12
    assert plain != mx, "the flag did not change the weights"
    assert generate_ids(fp8_model, "-q", "mxfp4") == mx  # deterministic, short form


def test_mxfp4_refused_on_a_bf16_checkpoint(model_dir):
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "2",
                        "--quantization", "mxfp4"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--quantization mxfp4 re-quantizes the routed experts of an FP8 checkpoint" in p.stdout + p.stderr
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--quantization", "awq"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "awq" in p.stdout + p.stderr
