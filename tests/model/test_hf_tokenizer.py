"""The HF layout `ml4 make-model` writes opens in transformers unchanged (issue 22).

For each tekken vocabulary the repo ships (Mistral's real 131,072-token tekken_240911.json,
and the 512 / 1,500-token ones `ml4 tokenizer train` made), a model directory is written in
the HF layout and `transformers.AutoTokenizer.from_pretrained(dir)` must give exactly the
ids of `ml4 tokenize --bos` (tekken, itself checked against mistral-common's goldens) on
varied text, and decode them back to the text. Special-token names are kept out of the
text: HF tokenizers match them as specials, tekken encodes them as text (documented in
docs/MODEL-FORMAT.md).

Needs transformers (scripts/setup.sh installs it from PyPI) and the ml4 binary ($ML4_BIN).
"""
import glob
import json
import os
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZERS = os.path.join(ROOT, "tests", "golden", "tokenizer")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\tand\nnewlines\n\n\nand trailing   ",
    "Numbers: 1234567890, 3.14159, -42, 1e-9; dates 2026-12-03.",
    "Ünïcödé: naïve café, Straße, ½ ¼, ñ; Ελληνικά; русский текст; 日本語のテキスト; 한국어; عربى",
    "Emoji 🙂🚀👩‍💻 and symbols ∑∫√∞ ≠ ≤ ≥ → ← ★",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code\n",
    "URLs https://example.com/path?q=1&r=2 and e-mail a.b@c.de",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbbbbbbbb",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
]


def ml4_bin():
    env = os.environ.get("ML4_BIN")
    if env and os.path.exists(env):
        return env
    for path in [os.path.join(ROOT, "build", "ml4")] + sorted(glob.glob(os.path.join(ROOT, "build*", "ml4"))):
        if os.path.exists(path):
            return path
    raise RuntimeError("no ml4 binary: set ML4_BIN")


def tekken_ids(tekken, text):
    out = subprocess.run([ml4_bin(), "tokenize", "-t", tekken, "--bos", "--text", text], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def transformers():
    import transformers  # a hard dependency of this test: scripts/setup.sh installs it
    return transformers


@pytest.mark.parametrize("tekken_file", ["tekken_240911.json", "tekken_trained_v15_512.json",
                                         "tekken_trained_v13_1500.json"])
def test_auto_tokenizer_matches_tekken(transformers, tekken_file):
    tekken = os.path.join(TOKENIZERS, tekken_file)
    vocab = json.load(open(tekken))["config"]["default_vocab_size"]
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "model")
        # A small HF-layout model (mistral4-tiny, narrowed) with this vocabulary.
        subprocess.run([ml4_bin(), "make-model", "--preset", "mistral4-tiny", "--set",
                        f"vocab_size={vocab},hidden_size=64", "--layout", "hf", "--tokenizer", tekken,
                        "--out", model], check=True, capture_output=True)
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "tekken.json"):
            assert os.path.exists(os.path.join(model, f)), f
        tok = transformers.AutoTokenizer.from_pretrained(model)
        assert len(tok) == vocab
        assert tok.bos_token_id == 1 and tok.eos_token_id == 2
        for text in TEXTS:
            want = tekken_ids(os.path.join(model, "tekken.json"), text)
            got = tok(text)["input_ids"]
            assert got == want, (tekken_file, text, got[:20], want[:20])
            assert tok.decode(got, skip_special_tokens=True) == text, (tekken_file, text)
