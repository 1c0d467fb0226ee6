"""tools/train/gen_drafter_data.py (issue 13: on-policy data for the DSpark drafter) against a
real `ml4 serve`: every row is its prompt (a slice of the token stream) plus gen-len tokens of the
target, two runs give the same rows (greedy: the engine's greedy path is deterministic; T = 1: each
request carries its own seed, whatever the batch around it), and the metadata describes the
file."""
import json
import lzma
import os
import subprocess
import sys

import numpy as np

from conftest import ROOT, ml4_bin

SCRIPT = os.path.join(ROOT, "tools", "train", "gen_drafter_data.py")


def generate(data_dir, out, n=6, gen_len=10, extra=()):
    subprocess.run([sys.executable, SCRIPT, "--data", data_dir, "--out", out, "--ml4", ml4_bin(), "--model",
                    data_dir + "/model", "--n-seqs", str(n), "--prompt-len", "12", "--gen-len", str(gen_len),
                    "--concurrency", "3", "--temperatures", "0", "1", *extra], check=True, timeout=300,
                   capture_output=True, text=True)
    meta = json.load(open(out + ".json"))
    rows = np.frombuffer(lzma.decompress(open(out, "rb").read()), dtype=np.uint16).reshape(meta["rows"],
                                                                                           meta["row_len"])
    return rows, meta


def make_data(d):
    subprocess.run([ml4_bin(), "make-model", "--preset", "ml4-tiny", "--seed", "3", "--out", d + "/model"],
                   check=True, capture_output=True)
    rng = np.random.default_rng(5)
    stream = rng.integers(3, 500, size=4000).astype(np.uint16)  # ml4-tiny's vocabulary is 512
    with open(d + "/train.tok.xz", "wb") as f:
        f.write(lzma.compress(stream.tobytes()))
    return stream


def test_rows_are_prompts_plus_the_targets_tokens(tmp_path):
    d = str(tmp_path)
    stream = make_data(d)
    a, meta = generate(d, d + "/a.tok.xz")
    b, _ = generate(d, d + "/b.tok.xz")
    assert a.shape == (6, 22) and meta["prompt_len"] == 12 and meta["gen_len"] == 10
    assert meta["temperatures"] == [0.0, 1.0] * 3
    s = stream.tobytes()
    for row in a:  # each prompt is 12 consecutive tokens of the stream
        assert row[:12].tobytes() in s
    assert (a < 512).all()
    assert (a == b).all()  # the same prompts (same --seed), the same tokens


def test_max_seconds_keeps_the_finished_rows(tmp_path):
    """--max-seconds (the GPU call's time box): the file holds only rows that finished, each the
    same row as a run without the limit (same prompt index, same tokens), and the metadata
    lists their indices and temperatures."""
    d = str(tmp_path)
    make_data(d)
    n = 300  # far more than 3 in flight finish in 1.5 s on ml4-tiny
    full, fmeta = generate(d, d + "/full.tok.xz", n=n, gen_len=24)
    part, pmeta = generate(d, d + "/part.tok.xz", n=n, gen_len=24, extra=("--max-seconds", "1.5"))
    idx = pmeta["row_index"]
    assert fmeta["row_index"] == list(range(n))
    assert 0 < len(idx) < n and pmeta["rows"] == len(idx) == part.shape[0]
    assert idx == sorted(set(idx))
    assert pmeta["temperatures"] == [fmeta["temperatures"][i] for i in idx]
    assert (part == full[idx]).all()
