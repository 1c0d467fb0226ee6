#!/usr/bin/env python3
"""Trains ml4-small and its DSpark drafter, exports them, and measures them. One GPU call.

    python3 tools/train/train.py --data DIR --tekken tekken.json --out OUT \
        [--target-seconds 240] [--drafter-seconds 60] [--resume OUT_OF_AN_EARLIER_RUN]

Phases, each bounded in wall time (the whole command must fit one 10-minute GPU call):

1. target: AdamW, bf16 autocast, a schedule driven by elapsed time (warm-up, cosine to 10%).
   Sequences of --seq tokens drawn at random offsets of the train stream; --passkey-frac of
   them are synthetic passkey samples (a 5-digit key stated at a random depth of corpus text,
   asked for at the end). The first --dense-frac of the time is the indexer's dense warm-up
   (attention over every causal key, the indexer learning KL(attention || indexer) on
   --kl-rows sampled query rows), then sparse training (attention over the indexer's top-k,
   KL restricted to the selected keys), DeepSeek-V3.2's two stages. The last --qat-frac runs
   with FP8 block rounding of the weights that ship as FP8 (straight-through), so the exported
   FP8 checkpoint is the model that was trained.
2. export (export.py): OUT/consolidated.safetensors + params.json, and a resumable checkpoint
   (f32 weights of target and drafter, in shards under 16 MiB: ckpt.N.pt).
3. evaluation on the exported weights (FP8 decoded, f32, TF32 off, ml4's bf16 latent cache and
   FP8 indexer emulated): validation NLL / perplexity / bits per byte per group, with the
   indexer's top-k and with dense attention; the same chunks `ml4 perplexity` reads
   (<s> + ctx-1 tokens of val_<group>.txt, every predicted token scored).
4. drafter: the frozen target's hidden states, --drafter-seconds of training distilling the
   target's next-token distribution at every block slot; export again with mtp_dspark.*.
5. acceptance length on held-out text, greedy and at temperature 1 (verification as the
   engine does it: greedy = longest matching prefix + 1; T=1 = rejection sampling with drafts
   sampled from the drafter, accept with min(1, p/q)).
6. passkey retrieval at 1k/4k/16k/32k, top-k and dense; greedy and sampled continuations.
Everything lands in OUT/results.json and OUT/train_log.jsonl.
"""

import argparse
import json
import lzma
import math
import os
import random
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from export import dequantized_state, export, load_into  # noqa: E402
from ml4_small import DSparkDrafter, Ml4Small  # noqa: E402
from tekken_tiktoken import Tekken  # noqa: E402

T0 = time.time()
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PROMPTS = ["It is a truth universally acknowledged, that", "def fibonacci(n):", "In the beginning God created",
           "The quick brown fox", "To be, or not to be,"]


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


class Logger:
    def __init__(self, path):
        self.f = open(path, "a")

    def __call__(self, **kw):
        kw["t"] = round(time.time() - T0, 2)
        self.f.write(json.dumps(kw) + "\n")
        self.f.flush()


# ------------------------------------------------------------------------------ data

class Data:
    def __init__(self, d, tk, device):
        with open(os.path.join(d, "train.tok.xz"), "rb") as f:
            self.train = torch.from_numpy(np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16).astype(np.int32))
        self.meta = json.load(open(os.path.join(d, "meta.json")))
        self.groups = sorted(self.meta["groups"])
        self.val_text = {g: open(os.path.join(d, f"val_{g}.txt"), encoding="utf-8").read() for g in self.groups}
        self.tk = tk
        self.device = device
        self.filler_ids = tk.encode(PASSKEY_FILLER)
        self.space = tk.encode(" ")[0]

    def batch(self, B, T, rng, passkey_frac):
        starts = torch.randint(0, len(self.train) - T - 1, (B,), generator=rng)
        x = torch.stack([self.train[s:s + T + 1] for s in starts.tolist()])
        for b in range(B):
            if torch.rand((), generator=rng) < passkey_frac:
                x[b] = torch.tensor(self.passkey(T + 1, rng, corpus_filler=bool(torch.rand((), generator=rng) < 0.5))[0])
        return x.to(self.device, non_blocking=True).long()

    def passkey(self, n, rng, corpus_filler=True, depth=None):
        """A passkey sample of exactly n tokens: <s> filler, the needle at `depth`, filler, the
        question; returns (tokens, index of the first answer digit, the key)."""
        key = int(torch.randint(10000, 100000, (), generator=rng))
        tk = self.tk
        needle = tk.encode(f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n")
        question = tk.encode("\n\nWhat is the pass key? The pass key is") + tk.encode(f" {key}.")
        m = n - 1 - len(needle) - len(question)
        assert m > 0, n
        if corpus_filler:
            s = int(torch.randint(0, len(self.train) - m - 1, (), generator=rng))
            fill = [t for t in self.train[s:s + m].tolist()]
            fill = [t if t >= tk.num_special else self.space for t in fill]
        else:
            reps = m // len(self.filler_ids) + 1
            fill = (self.filler_ids * reps)[:m]
        d = float(torch.rand((), generator=rng)) if depth is None else depth
        cut = int(d * m)
        toks = [tk.bos] + fill[:cut] + needle + fill[cut:] + question
        answer_at = len(toks) - 7  # " " + 5 digits + "."
        assert toks[answer_at:] == tk.encode(f" {key}."), "the answer is ' ', five digits, '.'"
        return toks, answer_at, key


# ------------------------------------------------------------------------------ helpers

def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(progress, peak, warm):
    if progress < warm:
        return peak * progress / warm
    x = (progress - warm) / max(1e-9, 1 - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, x))))


def save_ckpt(out, model, drafter, extra):
    """f32 weights in shards under 15 MiB (the GPU call returns files of at most 16 MiB)."""
    sd = {"target." + k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if drafter is not None:
        sd.update({"drafter." + k: v.detach().float().cpu() for k, v in drafter.state_dict().items()})
    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        b = sd[k].numel() * 4
        if cur and size + b > 15 * 2**20:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += b
    shards.append(cur)
    for f in os.listdir(out):
        if f.startswith("ckpt.") and f.endswith(".pt"):
            os.remove(os.path.join(out, f))
    for i, s in enumerate(shards):
        torch.save({"tensors": s, "extra": extra, "shard": i, "shards": len(shards)}, os.path.join(out, f"ckpt.{i}.pt"))


def load_ckpt(d, model, drafter):
    sd, extra = {}, {}
    for f in sorted(os.listdir(d)):
        if f.startswith("ckpt.") and f.endswith(".pt"):
            c = torch.load(os.path.join(d, f), map_location="cpu")
            sd.update(c["tensors"])
            extra = c["extra"]
    model.load_state_dict({k[7:]: v for k, v in sd.items() if k.startswith("target.")}, strict=False)
    if drafter is not None and any(k.startswith("drafter.") for k in sd):
        drafter.load_state_dict({k[8:]: v for k, v in sd.items() if k.startswith("drafter.")})
    return extra


# ------------------------------------------------------------------------------ phases

def train_target(a, p, data, model, logger, rng):
    dev = data.device
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    n_moe = sum(1 for s in model.specs if not s.dense)
    n_own = sum(1 for s in model.specs if s.indexer == "owner")
    start = time.time()
    step, tokens, qat = 0, 0, False
    last_log = start
    hist = []
    model.train()
    while True:
        el = time.time() - start
        progress = el / a.target_seconds
        if progress >= 1.0 or step >= a.max_steps:
            break
        sparse = progress >= a.dense_frac
        if progress >= 1 - a.qat_frac and not qat:
            model.set_qat(True)
            qat = True
            log("QAT on (FP8 block rounding of the exported linears)")
        lr = lr_at(progress, a.lr, a.warmup_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        tot = {"ce": 0.0, "kl": 0.0, "aux": 0.0}
        for _ in range(a.accum):
            x = data.batch(a.micro_batch, a.seq, rng, a.passkey_frac)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(x[:, :-1], sparse=sparse, kl_rows=a.kl_rows)
                ce = F.cross_entropy(out["logits"].float().reshape(-1, p["vocab_size"]), x[:, 1:].reshape(-1))
            loss = ce + a.aux_weight * out["aux"] / n_moe + a.kl_weight * out["kl"] / n_own
            (loss / a.accum).backward()
            tot["ce"] += float(ce) / a.accum
            tot["kl"] += float(out["kl"]) / n_own / a.accum
            tot["aux"] += float(out["aux"]) / n_moe / a.accum
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += a.accum * a.micro_batch * a.seq
        hist.append(tot["ce"])
        now = time.time()
        if now - last_log > a.log_every or step == 1:
            tps = tokens / (now - start)
            logger(phase="target", step=step, tokens=tokens, progress=round(progress, 4), lr=lr, sparse=sparse, qat=qat,
                   ce=tot["ce"], kl=tot["kl"], aux=tot["aux"], grad_norm=float(gn), tok_s=tps)
            log(f"step {step} tok {tokens / 1e6:.1f}M ce {tot['ce']:.3f} kl {tot['kl']:.3f} aux {tot['aux']:.3f} "
                f"lr {lr:.2e} {'sparse' if sparse else 'dense'}{' qat' if qat else ''} {tps / 1e3:.0f}k tok/s")
            last_log = now
    logger(phase="target_done", step=step, tokens=tokens, seconds=time.time() - start)
    return {"steps": step, "tokens": tokens, "seconds": time.time() - start, "final_ce": float(np.mean(hist[-10:]))}


def chunks_of(tk, text, ctx, n_chunks):
    ids = tk.encode(text)
    out = []
    for i in range(n_chunks):
        c = ids[i * (ctx - 1):(i + 1) * (ctx - 1)]
        if len(c) < ctx - 1:
            break
        out.append([tk.bos] + c)
    return out


@torch.no_grad()
def evaluate_ppl(model, data, ctx, n_chunks, dense=False):
    """Per group: tokens, mean NLL (nats), perplexity, bits per byte of the scored text."""
    tk = data.tk
    res = {}
    model.eval()
    for g in data.groups:
        chunks = chunks_of(tk, data.val_text[g], ctx, n_chunks)
        nll, n, nbytes = 0.0, 0, 0
        for c in chunks:
            x = torch.tensor([c], device=data.device)
            lg = model(x, fp8_indexer=True, bf16_latent=True, dense_attention=dense, query_chunk=1024)["logits"][0]
            lp = torch.log_softmax(lg.double(), -1)
            nll += float(-lp[:-1].gather(1, x[0, 1:, None]).sum())
            n += len(c) - 1
            nbytes += sum(len(tk.token_bytes(t)) for t in c[1:])
        if n:
            res[g] = {"tokens": n, "chunks": len(chunks), "mean_nll": nll / n, "ppl": math.exp(nll / n),
                      "bits_per_byte": nll / math.log(2) / nbytes}
    return res


def train_drafter(a, p, data, model, drafter, logger, rng):
    dev = data.device
    opt = torch.optim.AdamW(param_groups(drafter, 0.0), lr=a.drafter_lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    model.eval()
    for q in model.parameters():
        q.requires_grad_(False)
    S = drafter.B - 1
    start, step = time.time(), 0
    T = a.drafter_seq
    last_log = start
    while time.time() - start < a.drafter_seconds and step < a.max_steps:
        progress = (time.time() - start) / a.drafter_seconds
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, a.drafter_lr, 0.05)
        x = data.batch(a.drafter_batch, T, rng, a.passkey_frac)
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model(x, sparse=True, hidden_layers=tuple(drafter.target_layers))
            tprob = out["logits"].float().softmax(-1)  # row i predicts token i+1
        anchors = torch.randint(16, T - S, (a.drafter_batch, a.drafter_anchors), generator=rng).to(dev)
        slot0 = torch.gather(x, 1, anchors)
        idx = anchors[:, :, None] + torch.arange(S, device=dev)  # tokens at P..P+S-1 feed slots 1..S
        prev = torch.gather(x, 1, idx.view(a.drafter_batch, -1)).view(a.drafter_batch, -1, S)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            ctx = drafter.context({l: h.detach() for l, h in out["hidden"].items()})
            lg = drafter(model, ctx, anchors, slot0, prev).float()  # slot j predicts P+j from row P+j-1
        tgt = torch.gather(tprob, 1, idx.reshape(a.drafter_batch, -1, 1).expand(-1, -1, tprob.shape[-1]))
        tgt = tgt.view(a.drafter_batch, -1, S, tprob.shape[-1])
        loss = -(tgt * torch.log_softmax(lg, -1)).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if time.time() - last_log > a.log_every or step == 1:
            with torch.no_grad():
                acc = (lg.argmax(-1) == tgt.argmax(-1)).float().mean(dim=(0, 1))
            logger(phase="drafter", step=step, loss=float(loss), slot_top1=[round(float(v), 4) for v in acc])
            log(f"drafter step {step} loss {float(loss):.3f} slot top-1 agreement {[round(float(v), 2) for v in acc]}")
            last_log = time.time()
    return {"steps": step, "seconds": time.time() - start}


@torch.no_grad()
def acceptance(model, drafter, data, n_seq, positions, seed):
    """Mean acceptance length (tokens per target step: accepted drafts + 1) on val text."""
    tk = data.tk
    dev = data.device
    g = torch.Generator(device=dev).manual_seed(seed)
    S = drafter.B - 1
    seqs = []
    for grp in data.groups:
        ids = tk.encode(data.val_text[grp])
        L = max(positions) + 1
        for i in range(n_seq):
            if (i + 1) * L <= len(ids):
                seqs.append([tk.bos] + ids[i * L:(i + 1) * L - 1])
    x = torch.tensor(seqs, device=dev)
    res = {}
    for mode in ("greedy", "t1"):
        acc_all, per_slot = [], torch.zeros(S, device=dev)
        for P in positions:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = model(x[:, :P], sparse=True, hidden_layers=tuple(drafter.target_layers))
                ctx = drafter.context(out["hidden"])
                anchors = torch.full((x.shape[0], 1), P, device=dev)
                slot0 = x[:, P:P + 1]
                # context rows < P exist; the drafter's mask keeps keys < P
                ctx = F.pad(ctx, (0, 0, 0, 1))
                drafts, q = drafter.draft(model, ctx, anchors, slot0, greedy=(mode == "greedy"), generator=g)
                ver = torch.cat([x[:, :P + 1], drafts[:, 0]], 1)
                lp = model(ver, sparse=True)["logits"][:, P:].float()  # rows P..P+S: predict P+1..P+S+1
            pt = lp.softmax(-1)
            d = drafts[:, 0]  # [N, S]
            if mode == "greedy":
                ok = (pt[:, :S].argmax(-1) == d)
            else:
                pd = pt[:, :S].gather(-1, d[..., None])[..., 0]
                qd = q[:, 0].gather(-1, d[..., None])[..., 0]
                u = torch.rand(pd.shape, device=dev, generator=g)
                ok = u < torch.clamp(pd / qd.clamp_min(1e-20), max=1.0)
            run = torch.cumprod(ok.float(), 1)
            acc_all.append(run.sum(1) + 1)
            per_slot += run.sum(0)
        acc = torch.cat(acc_all)
        res[mode] = {"mean_acceptance_length": float(acc.mean()), "samples": int(acc.numel()),
                     "per_slot_acceptance": [round(float(v), 4) for v in per_slot / acc.numel()]}
    return res


@torch.no_grad()
def passkey_eval(model, data, lengths, n, seed, budget_end):
    rng = torch.Generator().manual_seed(seed)
    res = {}
    for L in lengths:
        for mode in ("topk", "dense"):
            hits, done = 0, 0
            for i in range(n):
                if time.time() > budget_end:
                    break
                toks, at, key = data.passkey(L, rng, corpus_filler=True, depth=(i + 0.5) / n)
                x = torch.tensor([toks], device=data.device)
                with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=data.device.type == "cuda"):
                    lg = model(x[:, :-1], dense_attention=(mode == "dense"), query_chunk=2048, stable_ties=False)["logits"][0]
                pred = lg[at - 1:at + 5].argmax(-1)
                hits += int(torch.equal(pred, x[0, at:at + 6]))
                done += 1
            res[f"{L}/{mode}"] = {"accuracy": hits / max(done, 1), "samples": done}
            log(f"passkey {L} {mode}: {hits}/{done}")
    return res


@torch.no_grad()
def continuations(model, tk, dev, n_new, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for prompt in PROMPTS:
        row = {"prompt": prompt}
        for mode in ("greedy", "t0.8"):
            ids = [tk.bos] + tk.encode(prompt)
            for _ in range(n_new):
                x = torch.tensor([ids], device=dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                    lg = model(x)["logits"][0, -1].float()
                t = int(lg.argmax()) if mode == "greedy" else int(torch.multinomial((lg / 0.8).softmax(-1), 1, generator=g))
                if t == tk.eos:
                    break
                ids.append(t)
            row[mode] = tk.decode(ids[1 + len(tk.encode(prompt)):])
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=os.path.join(HERE, "params_ml4_small.json"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--tekken", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default="")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-seconds", type=float, default=240)
    ap.add_argument("--drafter-seconds", type=float, default=60)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--dense-frac", type=float, default=0.15)
    ap.add_argument("--qat-frac", type=float, default=0.15)
    ap.add_argument("--passkey-frac", type=float, default=0.05)
    ap.add_argument("--kl-rows", type=int, default=64)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--drafter-seq", type=int, default=2048)
    ap.add_argument("--drafter-batch", type=int, default=16)
    ap.add_argument("--drafter-anchors", type=int, default=64)
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--eval-chunks", type=int, default=2)
    ap.add_argument("--passkey-lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--passkey-n", type=int, default=10)
    ap.add_argument("--accept-seqs", type=int, default=8)
    ap.add_argument("--accept-positions", type=int, nargs="*", default=[256, 768, 1536])
    ap.add_argument("--sample-tokens", type=int, default=40)
    ap.add_argument("--deadline", type=float, default=560, help="seconds after start when optional work stops")
    ap.add_argument("--log-every", type=float, default=10)
    ap.add_argument("--vocab-override", type=int, default=0, help="smoke tests: a smaller params vocab")
    ap.add_argument("--topk-override", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)
    p = json.load(open(a.params))
    if a.vocab_override:
        p["vocab_size"] = a.vocab_override
    if a.topk_override:
        p["indexer"]["topk"] = a.topk_override
    tk = Tekken(a.tekken)
    assert tk.vocab_size == p["vocab_size"], (tk.vocab_size, p["vocab_size"])
    logger = Logger(os.path.join(a.out, "train_log.jsonl"))
    results = {"args": vars(a), "params": p}
    data = Data(a.data, tk, dev)
    log(f"data: {len(data.train) / 1e6:.1f}M train tokens, device {dev}"
        + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""))
    rng = torch.Generator().manual_seed(a.seed)
    model = Ml4Small(p).to(dev)
    drafter = DSparkDrafter(p).to(dev)
    if a.resume:
        results["resumed_from"] = load_ckpt(a.resume, model, drafter)
        log(f"resumed from {a.resume}")
    n_params = sum(x.numel() for x in model.parameters())
    results["target_parameters"] = n_params
    log(f"target {n_params / 1e6:.2f}M parameters, drafter {sum(x.numel() for x in drafter.parameters()) / 1e6:.2f}M")

    def write_results():
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    if a.target_seconds > 0:
        results["target_training"] = train_target(a, p, data, model, logger, rng)
        write_results()
    model.set_qat(False)
    size = export(model, None, p, None, a.out)
    save_ckpt(a.out, model, None, {"phase": "target", "time": time.time() - T0})
    log(f"exported target: {size / 2**20:.2f} MiB")
    # Evaluate exactly what ships: FP8 decoded into a fresh f32 model.
    ev = Ml4Small(p).to(dev)
    load_into(ev, None, {k: v.to(dev) for k, v in dequantized_state(os.path.join(a.out, "consolidated.safetensors")).items()})
    ev.eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results["val_topk"] = evaluate_ppl(ev, data, a.eval_ctx, a.eval_chunks)
    log("val (exported, top-k): " + ", ".join(f"{g} {r['ppl']:.2f}" for g, r in results["val_topk"].items()))
    results["val_dense"] = evaluate_ppl(ev, data, a.eval_ctx, a.eval_chunks, dense=True)
    log("val (exported, dense): " + ", ".join(f"{g} {r['ppl']:.2f}" for g, r in results["val_dense"].items()))
    torch.backends.cuda.matmul.allow_tf32 = True
    write_results()
    del ev
    if a.drafter_seconds > 0:
        try:
            results["drafter_training"] = train_drafter(a, p, data, model, drafter, logger, rng)
            size = export(model, drafter, p, None, a.out)
            save_ckpt(a.out, model, drafter, {"phase": "drafter", "time": time.time() - T0})
            log(f"exported target + drafter: {size / 2**20:.2f} MiB")
            drafter.eval()
            results["acceptance"] = acceptance(model, drafter, data, a.accept_seqs, a.accept_positions, a.seed)
            log(f"acceptance: {results['acceptance']}")
        except Exception as e:  # keep the target's results
            results["drafter_error"] = repr(e)
            log(f"drafter failed: {e!r}")
        write_results()
    model.eval()
    try:
        results["continuations"] = continuations(model, tk, dev, a.sample_tokens, a.seed)
        for r in results["continuations"]:
            log(f"{r['prompt']!r} -> greedy {r['greedy']!r} | t0.8 {r['t0.8']!r}")
    except Exception as e:
        results["continuations_error"] = repr(e)
    write_results()
    try:
        results["passkey"] = passkey_eval(model, data, a.passkey_lengths, a.passkey_n, a.seed, T0 + a.deadline)
    except Exception as e:
        results["passkey_error"] = repr(e)
        log(f"passkey failed: {e!r}")
    results["seconds"] = time.time() - T0
    write_results()
    log("done")


if __name__ == "__main__":
    main()
