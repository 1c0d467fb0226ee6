#!/usr/bin/env python3
"""Needle in a haystack through the engine, with and without HiSparse (SYSTEM.md S12).

    python3 bench/hisparse_needle.py --ml4 build/ml4 --model assets/ml4-small \
        --filler val_novels.txt [--lengths 1024 4096 16384 32768] [--n 5] [--device cuda] \
        [--hot-slots 512] [--host-pool-gb 2]

Each prompt is filler text (a window of --filler, a validation split the model did not train
on) with the needle "The pass key is NNNNN. Remember it. NNNNN is the pass key." at depth
(i + 0.5) / n, more filler, then "What is the pass key? The pass key is" (bench/passkey.py's
template). `ml4 generate` decodes 8 greedy tokens twice: as is, and with
--kv-transfer-config HiSparseConnector. Printed per length: prompt tokens, how many answers
hold the five digits (retrieval, a property of the model), and how many HiSparse answers equal
the plain ones token for token (the offload's claim: the same rows are read). Exit status 1
when any pair differs.
"""

import argparse
import json
import random
import re
import subprocess
import sys


def generate(a, prompt, hisparse):
    cmd = [a.ml4, "generate", "--model", a.model, "--prompt", prompt, "--max-tokens", "8", "--device", a.device,
           "--kv-cache-dtype", a.kv]
    if a.device == "cuda":
        cmd += ["--gpu-memory-utilization", "0.2"]
    if hisparse:
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "HiSparseConnector",
            "kv_connector_extra_config": {"host_pool_gb": a.host_pool_gb, "hot_slots_per_request": a.hot_slots}})]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed: {p.stderr[-2000:]}")
    ids = re.search(r"^ids: (.*)$", p.stdout, re.M).group(1)
    tokens = int(re.search(r"prefill: (\d+) tokens", p.stdout).group(1))
    text = p.stdout[:p.stdout.find("\nids: ")]
    return ids, tokens, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ml4", default="build/ml4")
    ap.add_argument("--model", default="assets/ml4-small")
    ap.add_argument("--filler", required=True)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--hot-slots", type=int, default=512)
    ap.add_argument("--host-pool-gb", type=float, default=2.0)
    ap.add_argument("--chars-per-token", type=float, default=3.6)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    filler = re.sub(r"\s+", " ", open(a.filler, encoding="utf-8").read())
    rng = random.Random(a.seed)
    differ = 0
    for length in a.lengths:
        found_plain = found_hs = same = 0
        toks = []
        for i in range(a.n):
            key = f"{rng.randrange(10000, 100000)}"
            chars = int(length * a.chars_per_token)
            start = rng.randrange(0, max(1, len(filler) - chars))
            hay = (filler * (1 + chars // max(1, len(filler))))[start:start + chars]
            at = int(len(hay) * (i + 0.5) / a.n)
            needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
            prompt = hay[:at] + needle + hay[at:] + " What is the pass key? The pass key is"
            ids_p, n_tok, text_p = generate(a, prompt, False)
            ids_h, _, text_h = generate(a, prompt, True)
            toks.append(n_tok)
            found_plain += key in text_p.replace(" ", "")
            found_hs += key in text_h.replace(" ", "")
            same += ids_p == ids_h
            if ids_p != ids_h:
                differ += 1
                print(f"  DIFFER len {length} sample {i}: plain [{ids_p}] hisparse [{ids_h}]")
        print(f"NEEDLE length={length} prompt_tokens={min(toks)}..{max(toks)} retrieved_plain={found_plain}/{a.n} "
              f"retrieved_hisparse={found_hs}/{a.n} identical={same}/{a.n}", flush=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
