#!/usr/bin/env python3
"""Writes tests/golden/<case>/{golden.safetensors, manifest.json} for the three oracle cases.

Usage (normally through make_goldens.sh, which first writes the checkpoints with
`ml4 make-model`):
  python3 tools/reference/make_goldens.py --models DIR --out tests/golden [--cases ...]

DIR holds one `ml4 make-model --layout both --dtype bf16` directory per case, named like
the preset (mistral4-tiny, dsv32-tiny: the HF copy in DIR/<case>/hf is what transformers
loads; ml4-tiny: the native files, read by ml4_model.py).

Per case, prompts of PROMPT_LENGTHS random tokens (torch generator, fixed seed; some
longer than the index top-k) each get a 32-token greedy continuation from the reference,
then one forward over prompt + continuation records:
  p{i}.tokens      int32 [n+32]    prompt then greedy tokens
  p{i}.logits      f32   [n+32, V] logits at every position (row j predicts token j+1)
  p{i}.margin      f32   [n+32]    top-1 minus top-2 logit per row (greedy robustness)
  p{i}.L{l}.topk   int32 [n+32, K] indexer selection of sparse layer l, best first, -1 pad
  p{i}.L{l}.scores f32   [n+32, n+32] indexer scores (-inf at invisible keys)
  p{i}.L{l}.experts int32 [n+32, k] routed experts of MoE layer l, ascending
  pure.p{i}.*      the same logits / topk from the unpatched model ("pure" mode, see
                   hf_models.py), on the same tokens, for the docs' disagreement numbers
The manifest holds seed, preset, command, versions, the emulation in force, a fingerprint
of the weights (FNV-1a 64 over every tensor's bytes, names sorted) and the measured
emulated-vs-pure differences.
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hf_models import HfRun, load_hf_model  # noqa: E402
from ml4_model import Ml4Reference  # noqa: E402

SEED = 1234          # model seed, `ml4 make-model --seed`
PROMPT_SEED = 4321   # prompt tokens
PROMPT_LENGTHS = [6, 19, 40]
CONTINUATION = 32
CASES = {
    "mistral4-tiny": {"kind": "hf", "model_type": "mistral4"},
    "dsv32-tiny": {"kind": "hf", "model_type": "deepseek_v32"},
    "ml4-tiny": {"kind": "ml4"},
    # The trained default model shipped in the repo (not written by make-model): FP8 weights,
    # a text prompt. With 8,192 logits per row a golden row costs 32 KB, so the case is one
    # short prompt (52 rows, 2 MB) without the "pure" copies; the indexer's top-k (256) does
    # not bite at that length (ml4-tiny's golden covers the selection; the 4,096-token
    # perplexity comparison in docs/ML4-SMALL.md covers it on this model).
    "ml4-small": {"kind": "ml4", "model_dir": "assets/ml4-small", "pure": False},
}
ML4_SMALL_PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
]


def fnv1a64_tensors(path):
    """FNV-1a 64 over the raw bytes of every tensor of a safetensors file, names sorted.

    The drafter (`mtp_dspark.*`) is left out: no golden forward reads it.
    """
    from safetensors import safe_open
    import numpy as np

    h = 0xCBF29CE484222325
    prime = 0x100000001B3
    mask = (1 << 64) - 1
    with safe_open(path, framework="pt") as f:
        for name in sorted(f.keys()):
            if name.startswith("mtp_dspark."):
                continue
            t = f.get_tensor(name).contiguous()
            data = t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()
            for b in np.frombuffer(data, dtype=np.uint8).tolist():
                h = ((h ^ b) * prime) & mask
    return f"{h:016x}"


def prompts(vocab, case=None, model_dir=None, out_root=None):
    if case == "ml4-small":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
        from tekken_tiktoken import Tekken
        tk = Tekken(os.path.join(model_dir, "tekken.json"))
        return [[tk.bos] + tk.encode(text) for text in ML4_SMALL_PROMPTS]
    g = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def greedy(run, prompt):
    tokens = list(prompt)
    for _ in range(CONTINUATION):
        tokens.append(int(torch.argmax(run.logits(tokens)[-1])))
    return tokens


def record_tensors(prefix, run, logits, T):
    out = {f"{prefix}.logits": logits.to(torch.float32).contiguous()}
    K = run.topk_value()
    for l in run.sparse_layers():
        sel, masked = run.record[l]
        topk = torch.full((T, K), -1, dtype=torch.int32)
        for t in range(T):
            n = min(K, t + 1)
            topk[t, :n] = sel[t, :n].to(torch.int32)
        out[f"{prefix}.L{l}.topk"] = topk
        out[f"{prefix}.L{l}.scores"] = masked.to(torch.float32).contiguous()
    for l, ids in run.routes.items():
        out[f"{prefix}.L{l}.experts"] = ids.to(torch.int32).contiguous()
    return out


def compare(ref, other):
    d = (other - ref).to(torch.float64)
    return {"rel_l2": float(d.norm() / ref.norm()), "max_abs": float(d.abs().max()),
            "ref_max_abs": float(ref.abs().max())}


def topk_agreement(run_a, run_b, T):
    """Rows whose selected sets differ between two runs of the same tokens, per layer."""
    out = {}
    K = run_a.topk_value()
    for l in run_a.sparse_layers():
        sa, _ = run_a.record[l]
        sb, _ = run_b.record[l]
        diff = sum(1 for t in range(T)
                   if set(sa[t, :min(K, t + 1)].tolist()) != set(sb[t, :min(K, t + 1)].tolist()))
        out[str(l)] = diff
    return out


def make_runs(case, models_dir):
    spec = CASES[case]
    if spec["kind"] == "hf":
        d = os.path.join(models_dir, case, "hf")
        model, warnings = load_hf_model(d)
        if model.config.model_type != spec["model_type"]:
            raise RuntimeError(f"{d}: model_type {model.config.model_type}, expected {spec['model_type']}")
        # Each HfRun applies its patches (module- and class-level) until close().
        return d, os.path.join(d, "model.safetensors"), \
            (lambda: HfRun(model, "emulated")), (lambda: HfRun(model, "pure")), model.config.vocab_size, warnings
    d = spec["model_dir"] if "model_dir" in spec else os.path.join(models_dir, case)
    emu = Ml4Reference(d, bf16_cache=True, fp8_indexer=True)
    pure = Ml4Reference(d, bf16_cache=False, fp8_indexer=False)

    class Fixed:
        def __init__(self, m):
            self.m = m

        def __call__(self):
            return _NoClose(self.m)

    return d, os.path.join(d, "consolidated.safetensors"), Fixed(emu), Fixed(pure), emu.p["vocab_size"], []


class _NoClose:
    def __init__(self, m):
        self.m = m

    def __getattr__(self, name):
        return getattr(self.m, name)

    def close(self):
        pass


def run_case(case, models_dir, out_root, command):
    from safetensors.torch import save_file
    import transformers
    import safetensors

    model_dir, weights, make_emulated, make_pure, vocab, load_warnings = make_runs(case, models_dir)
    tensors = {}
    summary = {"prompts": [], "pure_vs_emulated": []}
    plist = prompts(vocab, case, model_dir, out_root)
    for i, prompt in enumerate(plist):
        run = make_emulated()
        try:
            tokens = greedy(run, prompt)
            logits = run.logits(tokens)
            T = len(tokens)
            # The recorded forward must reproduce the greedy choices made step by step.
            for j in range(len(prompt), T):
                assert int(torch.argmax(logits[j - 1])) == tokens[j], f"{case} p{i}: greedy not reproduced at {j}"
            tensors[f"p{i}.tokens"] = torch.tensor(tokens, dtype=torch.int32)
            tensors[f"p{i}.margin"] = margins(logits).to(torch.float32)
            tensors.update(record_tensors(f"p{i}", run, logits, T))
            m = margins(logits)[len(prompt) - 1: T - 1]
            summary["prompts"].append({"length": len(prompt), "greedy_min_margin": float(m.min())})
            emulated_record = dict(run.record)
            emulated_routes = dict(run.routes)
        finally:
            run.close()
        if not CASES[case].get("pure", True):
            continue
        pure = make_pure()
        try:
            pl = pure.logits(tokens)
            tensors.update(record_tensors(f"pure.p{i}", pure, pl, T))
            emu_view = type("R", (), {"record": emulated_record, "sparse_layers": pure.sparse_layers,
                                      "topk_value": pure.topk_value})()
            summary["pure_vs_emulated"].append({
                "logits": compare(logits, pl),
                "argmax_rows_differing": int((pl.argmax(-1) != logits.argmax(-1)).sum()),
                "routing_rows_differing": {str(l): int((pure.routes[l] != emulated_routes[l]).any(-1).sum())
                                           for l in sorted(pure.routes)},
                "topk_rows_differing": topk_agreement(emu_view, pure, T),
                "rows": T,
            })
        finally:
            pure.close()
    out_dir = os.path.join(out_root, case)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "golden.safetensors"), metadata={"case": case})
    shipped = "model_dir" in CASES[case]
    manifest = {
        "case": case,
        "preset": case,
        "seed": SEED,
        "weight_dtype": "bf16",
        "make_model": f"ml4 make-model --preset {case} --seed {SEED} --layout {'both' if CASES[case]['kind'] == 'hf' else 'native'} --dtype bf16 --out DIR/{case}",
        "reference": ("transformers " + CASES[case]["model_type"] + " (from_pretrained on DIR/" + case + "/hf)")
        if CASES[case]["kind"] == "hf" else "tools/reference/ml4_model.py on transformers mistral4/deepseek_v32 modules",
        "command": command,
        "weights_file": os.path.relpath(weights, os.path.join(models_dir, case)),
        "weights_fnv1a64": fnv1a64_tensors(weights),
        "prompt_seed": PROMPT_SEED,
        "prompt_lengths": [len(q) for q in plist],
        "continuation": CONTINUATION,
        "kv_cache_dtype": "bf16",
        "emulation": ["latent rows (c, rotated kr) rounded to bf16 (ml4 bf16 KV cache)"]
        + (["indexer: Hadamard + FP8 e4m3 per 128 on q and k (DeepSeek-V3.2 inference/model.py)"]
           if any(".L" in k for k in tensors) else []),
        "reference_dtype": "float64 (rotary cos/sin float32, as transformers computes them)",
        "sparse_layers": sorted({int(k.split(".L")[1].split(".")[0]) for k in tensors
                                 if k.startswith("p0.L") and k.endswith(".topk")}),
        "index_topk": next((int(t.shape[1]) for k, t in tensors.items() if k.endswith(".topk")), 0),
        "summary": summary,
        "load_warnings": load_warnings,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__},
        "device": "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if shipped:
        # The shipped, trained checkpoint: the test reads it from the repo (model_dir), not
        # from make-model; its prompts are text (prompt_text), tokenized with its tekken.json.
        manifest.update({"model_dir": CASES[case]["model_dir"], "weight_dtype": "fp8_e4m3 blocks (experts, attention)",
                         "make_model": "none: the trained model shipped in the repo (tools/train/train.py)",
                         "prompt_text": ML4_SMALL_PROMPTS})
        manifest.pop("seed")
        manifest.pop("prompt_seed")
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(f"{case}: wrote {out_dir} ({sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6:.2f} MB)")
    print(json.dumps(summary, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="directory with one make-model output per case")
    ap.add_argument("--out", required=True, help="golden root, normally tests/golden")
    ap.add_argument("--cases", nargs="*", default=[c for c in CASES if "model_dir" not in CASES[c]],
                    help="default: the make-model cases; ml4-small (the shipped model) is asked for by name")
    ap.add_argument("--command", default=" ".join(sys.argv), help="the command recorded in the manifests")
    a = ap.parse_args()
    torch.manual_seed(0)
    for case in a.cases:
        run_case(case, a.models, a.out, a.command)


if __name__ == "__main__":
    main()
