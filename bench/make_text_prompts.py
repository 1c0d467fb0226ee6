#!/usr/bin/env python3
"""Text prompts for `ml4 bench serve --dataset` from held-out corpus text (issue 13).

    python3 bench/make_text_prompts.py --val-dir DATA --out bench/data/ml4-small-val-prompts.jsonl

DATA is tools/train/prepare_data.py's output: val_<group>.txt, the sections of each corpus group
held out from training. Random-token prompts (the `random` dataset, vllm bench serve's default)
say little about a drafter: the target's continuation of noise is not the text either model
learned. These prompts are real held-out text: per group, --per-group prompts of about --chars
characters, each a run of whole paragraphs starting at evenly spaced paragraphs of the file.
Lines interleave the groups. Deterministic: the same files give the same lines ({"prompt": ..., "source": group}).
"""
import argparse
import glob
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--val-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--chars", type=int, default=600)
    a = ap.parse_args()
    groups = []
    for path in sorted(glob.glob(os.path.join(a.val_dir, "val_*.txt"))):
        group = os.path.basename(path)[4:-4]
        paras = [p.strip() for p in open(path, encoding="utf-8").read().split("\n\n") if p.strip()]
        if not paras:
            continue
        starts = [i * len(paras) // a.per_group for i in range(a.per_group)]
        groups.append([])
        for s in starts:
            text, i = "", s
            while len(text) < a.chars and i < len(paras):
                text += ("\n\n" if text else "") + paras[i]
                i += 1
            if len(text) > 2 * a.chars:  # one long paragraph: cut at a space
                cut = text.rfind(" ", 0, a.chars)
                text = text[: cut if cut > 0 else a.chars]
            groups[-1].append({"prompt": text, "source": group})
    # Groups interleaved, so that any first n prompts (bench serve takes them in order) mix them.
    lines = [g[i] for i in range(a.per_group) for g in groups if i < len(g)]
    with open(a.out, "w", encoding="utf-8") as f:
        for l in lines:
            f.write(json.dumps(l, ensure_ascii=False) + "\n")
    print(f"{len(lines)} prompts from {a.val_dir} -> {a.out}")


if __name__ == "__main__":
    main()
