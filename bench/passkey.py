#!/usr/bin/env python3
"""Passkey retrieval (needle in a haystack) of an ML4 model directory, in PyTorch.

    python3 bench/passkey.py --model assets/ml4-small --data build-h12/data \
        [--lengths 1024 4096 16384 32768] [--n 10] [--device cuda]

Each sample is <s>, corpus text (a random window of the training stream, special tokens
replaced by a space), the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key."
at depth (i + 0.5) / n, more text, then "What is the pass key? The pass key is"; a sample
counts when the model's greedy choice is right for the space and all five digits (teacher
forced, which equals greedy decoding when every step is right). Run twice per length: with
the indexer's top-k (the model as it serves) and with dense attention (every causal key).
The model is the exported checkpoint (FP8 decoded) in tools/train/ml4_small.py, bf16 autocast
on a GPU. tools/train/train.py runs the same function at the end of training; numbers are in
docs/BENCHMARKS.md.
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "train"))

from export import dequantized_state, load_into  # noqa: E402
from ml4_small import Ml4Small  # noqa: E402
from tekken_tiktoken import Tekken  # noqa: E402
from train import Data, passkey_eval  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True, help="tools/train/prepare_data.py output (filler text)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="", help="write the results here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    with open(os.path.join(a.model, "params.json")) as f:
        p = json.load(f)
    tk = Tekken(os.path.join(a.model, "tekken.json"))
    m = Ml4Small(p).to(dev)
    load_into(m, None, {k: v.to(dev) for k, v in dequantized_state(os.path.join(a.model, "consolidated.safetensors")).items()
                        if not k.startswith("mtp_dspark.")})
    m.eval()
    res = passkey_eval(m, Data(a.data, tk, dev), a.lengths, a.n, a.seed, time.time() + 1e9)
    res = {"model": a.model, "topk": p.get("indexer", {}).get("topk"), "results": res}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
