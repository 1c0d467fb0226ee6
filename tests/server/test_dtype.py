"""`--dtype bfloat16` (vLLM's flag) on the CPU backend: a server with it answers the openai
client, and the flag is refused where it does not apply (with a message naming it)."""
import subprocess

import pytest

from conftest import Server, ml4_bin


def bf16_supported():
    flags = open("/proc/cpuinfo").read()
    return " avx512_bf16" in flags and " avx512vbmi" in flags


@pytest.mark.skipif(not bf16_supported(), reason="the CPU lacks AVX512_BF16 / AVX512_VBMI")
def test_serve_bfloat16_answers(model_dir):
    import openai
    s = Server(model_dir, "--max-model-len", "256", "--dtype", "bfloat16", "--seed", "0")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="ml4-tiny", prompt="The capital of France is", max_tokens=8,
                                 temperature=0)
        assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
        assert isinstance(r.choices[0].text, str)
    finally:
        assert s.stop() == 0


def test_dtype_refused_where_it_does_not_apply(model_dir):
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--max-tokens", "2",
                        "--device", "cuda", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--dtype bfloat16 applies to --device cpu" in p.stdout + p.stderr
    p = subprocess.run([ml4_bin(), "generate", "--model", model_dir, "--prompt", "hi", "--dtype", "float16"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "float16" in p.stdout + p.stderr
