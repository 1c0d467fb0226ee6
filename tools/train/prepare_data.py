#!/usr/bin/env python3
"""Tokenizes the corpus (tools/corpus/build_corpus.py output) for training.

    python3 tools/train/prepare_data.py --corpus build-h12/corpus --tekken T/tekken.json --out DIR

Writes to DIR:
  train.tok.xz     uint16 tokens, every train document as <s> text </s>, documents in a fixed
                   shuffled order (seed 0), LZMA-compressed (the GPU machine gets at most 64 MiB
                   of working tree per call, so the stream travels compressed)
  val_<group>.txt  the group's held-out sections joined by blank lines: the file that both
                   `ml4 perplexity --file` and the PyTorch evaluation (train.py) read
  meta.json        token / byte counts per group and split, the tokenizer's sha256
"""

import argparse
import hashlib
import json
import lzma
import os
import random

import numpy as np

from tekken_tiktoken import Tekken


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tekken", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tk = Tekken(a.tekken)
    assert tk.vocab_size <= 65536
    groups = sorted(f[:-len(".train.jsonl")] for f in os.listdir(a.corpus) if f.endswith(".train.jsonl"))
    docs = []
    meta = {"groups": {}, "tekken_sha256": hashlib.sha256(open(a.tekken, "rb").read()).hexdigest()}
    for g in groups:
        with open(os.path.join(a.corpus, f"{g}.train.jsonl"), encoding="utf-8") as f:
            texts = [json.loads(l)["text"] for l in f]
        ids = tk.encode_batch(texts)
        n_tok = sum(len(i) for i in ids)
        n_bytes = sum(len(t.encode()) for t in texts)
        docs += ids
        with open(os.path.join(a.corpus, f"{g}.val.jsonl"), encoding="utf-8") as f:
            val = "\n\n".join(json.loads(l)["text"] for l in f)
        with open(os.path.join(a.out, f"val_{g}.txt"), "w", encoding="utf-8") as f:
            f.write(val)
        vt = len(tk.encode(val))
        meta["groups"][g] = {"train_tokens": n_tok, "train_bytes": n_bytes, "train_bytes_per_token": n_bytes / max(n_tok, 1),
                             "val_tokens": vt, "val_bytes": len(val.encode())}
        print(f"{g:10s} train {n_tok / 1e6:6.2f} M tokens ({n_bytes / max(n_tok, 1):.2f} B/token)  val {vt / 1e3:7.1f} k tokens",
              flush=True)
    random.Random(0).shuffle(docs)
    total = sum(len(d) + 2 for d in docs)
    arr = np.empty(total, dtype=np.uint16)
    pos = 0
    for d in docs:
        arr[pos] = tk.bos
        arr[pos + 1: pos + 1 + len(d)] = d
        arr[pos + 1 + len(d)] = tk.eos
        pos += len(d) + 2
    raw = arr.tobytes()
    with open(os.path.join(a.out, "train.tok.xz"), "wb") as f:
        f.write(lzma.compress(raw, preset=6))
    meta["train_tokens"] = int(total)
    meta["train_sha256"] = hashlib.sha256(raw).hexdigest()
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"train stream {total / 1e6:.2f} M tokens, {os.path.getsize(os.path.join(a.out, 'train.tok.xz')) / 2**20:.1f} MiB "
          "compressed")


if __name__ == "__main__":
    main()
