#!/usr/bin/env python3
"""Trains ml4-small and its DSpark drafter, exports them, and measures them. One GPU call.

    python3 tools/train/train.py --data DIR --tekken tekken.json --out OUT \
        [--target-seconds 370] [--drafter-seconds 40] [--resume OUT_OF_AN_EARLIER_RUN]

Phases, each bounded in wall time (the whole command must fit one 10-minute GPU call):

1. target: AdamW, bf16 autocast, a schedule driven by elapsed time (linear warm-up, cosine to
   10%), --tokens-per-step tokens per optimizer step (one micro-batch). A curriculum in sequence
   length: --seq-short tokens first, --seq-long for the last --long-frac of the time. Sequences
   are drawn at random offsets of the train stream; --passkey-frac of them are synthetic passkey
   samples (a 5-digit key stated at a random depth of filler text, asked for at the end), whose
   six answer tokens weigh --answer-weight in the loss. The first --dense-frac of the time is the
   indexer's dense warm-up (attention over every causal key, the indexer learning KL(attention ||
   indexer) on --kl-rows query rows), then sparse training (attention over the indexer's top-k),
   DeepSeek-V3.2's two stages. The last --qat-frac runs with FP8 block rounding of the weights
   that ship as FP8 (straight-through), so the exported FP8 checkpoint is the model that was
   trained. Every --eval-every seconds: validation NLL per group (one 1,024-token chunk each)
   and passkey retrieval on fixed 1k / 4k samples, logged with the training loss, the text-only
   loss and the passkey answer loss. A resumable checkpoint every --ckpt-every seconds.
2. export (export.py): OUT/consolidated.safetensors + params.json, and a resumable checkpoint
   (f32 weights of target and drafter, in shards under 16 MiB: ckpt.N.pt).
3. evaluation on the exported weights (FP8 decoded, f32, TF32 off, ml4's bf16 latent cache and
   FP8 indexer emulated): validation NLL / perplexity / bits per byte per group, with the
   indexer's top-k and with dense attention; the same chunks `ml4 perplexity` reads
   (<s> + ctx-1 tokens of val_<group>.txt, every predicted token scored).
4. drafter: the frozen target's hidden states, --drafter-seconds of training distilling the
   target's next-token distribution at every block slot; export again with mtp_dspark.*. With
   --drafter-data (gen_drafter_data.py), --drafter-data-frac of the batches are the target's own
   continuations, anchored in their generated part (on-policy, as the engine meets them).
5. acceptance length on held-out text, greedy and at temperature 1 (verification as the
   engine does it: greedy = longest matching prefix + 1; T=1 = rejection sampling with drafts
   sampled from the drafter, accept with min(1, p/q)).
6. greedy and sampled continuations; passkey retrieval at 1k/4k/16k/32k on the exported
   weights, top-k and dense (bench/passkey.py runs the same function).
Everything lands in OUT/results.json and OUT/train_log.jsonl.
"""

import time

T0 = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import lzma  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from export import dequantized_state, export, load_into  # noqa: E402
from ml4_small import DSparkDrafter, Ml4Small  # noqa: E402
from tekken_tiktoken import Tekken  # noqa: E402

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PROMPTS = ["It is a truth universally acknowledged, that", "def fibonacci(n):", "In the beginning God created",
           "The quick brown fox", "To be, or not to be,"]
ANSWER = 6  # a passkey answer: " " and five digits


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
            self.train_np = np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16).astype(np.int64)
        self.train = torch.from_numpy(self.train_np)
        self.meta = json.load(open(os.path.join(d, "meta.json")))
        self.groups = sorted(self.meta["groups"])
        self.val_text = {g: open(os.path.join(d, f"val_{g}.txt"), encoding="utf-8").read() for g in self.groups}
        self.tk = tk
        self.device = device
        self.filler_np = np.array(tk.encode(PASSKEY_FILLER), dtype=np.int64)
        self.space = tk.encode(" ")[0]

    def batch(self, B, T, rng, passkey_frac, grass_frac=0.3, answer_weight=1.0):
        """B sequences of T + 1 tokens (numpy rng) -> (tokens [B, T+1] on the device, loss weights
        [B, T] of the predicted tokens, passkey flags [B])."""
        starts = rng.integers(0, len(self.train_np) - T - 1, size=B)
        x = self.train_np[starts[:, None] + np.arange(T + 1)]
        w = np.ones((B, T), dtype=np.float32)
        pk = rng.random(B) < passkey_frac
        for b in np.nonzero(pk)[0]:
            toks, at, _ = self.passkey_np(T + 1, rng, corpus_filler=rng.random() >= grass_frac)
            x[b] = toks
            w[b, at - 1:at - 1 + ANSWER] = answer_weight
        dev = self.device
        pin = dev.type == "cuda"
        xt, wt, pt = torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(pk)
        if pin:
            xt, wt, pt = xt.pin_memory(), wt.pin_memory(), pt.pin_memory()
        return xt.to(dev, non_blocking=True), wt.to(dev, non_blocking=True), pt.to(dev, non_blocking=True)

    def passkey_np(self, n, rng, corpus_filler=True, depth=None, key=None, offset=None):
        """A passkey sample of exactly n tokens (numpy): <s> filler, the needle at `depth`,
        filler, the question; returns (tokens, index of the first answer token, the key).
        key, filler offset and depth are drawn from rng (numpy) unless given."""
        key = int(rng.integers(10000, 100000)) if key is None else key
        tk = self.tk
        needle = tk.encode(f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n")
        question = tk.encode("\n\nWhat is the pass key? The pass key is") + tk.encode(f" {key}.")
        m = n - 1 - len(needle) - len(question)
        assert m > 0, n
        if corpus_filler:
            s = int(rng.integers(0, len(self.train_np) - m - 1)) if offset is None else offset
            fill = self.train_np[s:s + m].copy()
            fill[fill < tk.num_special] = self.space
        else:
            fill = np.resize(self.filler_np, m)
        d = float(rng.random()) if depth is None else depth
        cut = int(d * m)
        toks = np.concatenate([[tk.bos], fill[:cut], needle, fill[cut:], question]).astype(np.int64)
        answer_at = len(toks) - 7  # " " + 5 digits + "."
        return toks, answer_at, key

    def passkey(self, n, rng, corpus_filler=True, depth=None):
        """passkey_np with a torch.Generator (bench/passkey.py and the final evaluation): the
        key, the filler offset and the depth drawn from it; returns (token list, answer index, key)."""
        key = int(torch.randint(10000, 100000, (), generator=rng))
        off = int(torch.randint(0, len(self.train_np) - n - 1, (), generator=rng))
        d = float(torch.rand((), generator=rng)) if depth is None else depth
        toks, at, key = self.passkey_np(n, None, corpus_filler, d, key, off)
        assert toks[at:].tolist() == self.tk.encode(f" {key}."), "the answer is ' ', five digits, '.'"
        return toks.tolist(), at, key


# ------------------------------------------------------------------------------ helpers

def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(progress, peak, warm, floor=0.1):
    if progress < warm:
        return peak * progress / warm
    x = (progress - warm) / max(1e-9, 1 - warm)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, x))))


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
    tmp = []
    for i, s in enumerate(shards):
        path = os.path.join(out, f"ckpt.{i}.pt.tmp")
        torch.save({"tensors": s, "extra": extra, "shard": i, "shards": len(shards)}, path)
        tmp.append(path)
    for f in os.listdir(out):
        if f.startswith("ckpt.") and f.endswith(".pt"):
            os.remove(os.path.join(out, f))
    for path in tmp:
        os.replace(path, path[:-4])


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


def autocast(dev):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


class Probe:
    """Fixed held-out batches measured during training: the first 1,024 tokens of each
    validation group, and passkey samples (corpus filler, depths spread) at the probe lengths."""

    def __init__(self, data, ctx, passkey_lengths, n_passkey, seed):
        tk = data.tk
        self.data = data
        rows, self.val_n = [], []
        for g in data.groups:
            ids = tk.encode(data.val_text[g][:20 * ctx])[:ctx]
            rows.append([tk.bos] + ids + [tk.bos] * (ctx - len(ids)))
            self.val_n.append(len(ids))
        self.val = torch.tensor(rows, device=data.device)  # [G, ctx + 1]: ctx inputs, ctx predicted
        rng = np.random.default_rng(seed + 12345)
        self.pk = {}
        for L in passkey_lengths:
            s = [data.passkey_np(L + 1, rng, True, (i + 0.5) / n_passkey) for i in range(n_passkey)]
            self.pk[L] = (torch.tensor(np.stack([t for t, _, _ in s]), device=data.device), s[0][1])

    @torch.no_grad()
    def __call__(self, model, max_len):
        was = model.training
        model.eval()
        dev = self.data.device
        out = {}
        with autocast(dev):
            lg = model(self.val[:, :-1], stable_ties=False)["logits"].float()
        nll = F.cross_entropy(lg.transpose(1, 2), self.val[:, 1:], reduction="none")
        per = {g: float(nll[i, :self.val_n[i]].mean()) for i, g in enumerate(self.data.groups)}
        out["val"] = per
        out["val_mean"] = float(np.mean(list(per.values())))
        for L, (x, at) in self.pk.items():
            if L > max_len:
                continue
            with autocast(dev):
                lg = model(x[:, :-1], stable_ties=False, query_chunk=2048 if L > 2048 else 0)["logits"][:, at - 1:at - 1 + ANSWER].float()
            tgt = x[:, at:at + ANSWER]
            out[f"passkey_{L}"] = float((lg.argmax(-1) == tgt).all(-1).float().mean())
            out[f"passkey_{L}_nll"] = float(F.cross_entropy(lg.transpose(1, 2), tgt))
        model.train(was)
        return out


# ------------------------------------------------------------------------------ phases

def train_target(a, p, data, model, logger, out_dir, results):
    dev = data.device
    opt = torch.optim.AdamW(param_groups(model, a.wd), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    n_moe = sum(1 for s in model.specs if not s.dense)
    n_own = sum(1 for s in model.specs if s.indexer == "owner")
    rng = np.random.default_rng(a.seed)
    probe = Probe(data, min(1024, a.seq_short), a.probe_lengths, a.probe_n, a.seed)
    start = time.time()
    step, tokens, qat = 0, 0, False
    last_log = last_eval = last_ckpt = start
    eval_time = 0.0
    acc = None  # running sums on the device, read at log time (no per-step host sync)
    n_acc = 0
    cur_T = None
    ev = None
    failures, cfg_steps = 0, {}
    model.train()
    while True:
        el = time.time() - start
        progress = el / a.target_seconds
        if progress >= 1.0 or step >= a.max_steps:
            break
        sparse = progress >= a.dense_frac
        T = a.seq_long if progress >= 1 - a.long_frac else a.seq_short
        if T != cur_T:
            log(f"sequence length {T}, micro-batch {max(1, a.tokens_per_step // T)}")
            cur_T = T
        Bm = max(1, a.tokens_per_step // T)
        if progress >= 1 - a.qat_frac and not qat:
            model.set_qat(True)
            qat = True
            log("QAT on (FP8 block rounding of the exported linears)")
        lr = lr_at(progress, a.lr, a.warmup_frac)
        for g in opt.param_groups:
            g["lr"] = lr
        x, w, pk = data.batch(Bm, T, rng, a.passkey_frac, a.grass_frac, a.answer_weight)
        prof = None
        cfg = f"T{T}-{'sparse' if sparse else 'dense'}"
        cfg_steps[cfg] = cfg_steps.get(cfg, 0) + 1
        if (dev.type == "cuda" or os.environ.get("ML4_PROFILE_CPU")) and a.profile_steps and cfg_steps[cfg] == 20:
            t_prof = time.time()
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        try:
            with autocast(dev):
                out = model(x[:, :-1], sparse=sparse, kl_rows=a.kl_rows, kl_tail=a.kl_tail, kl_dense=a.kl_dense)
            ce_tok = F.cross_entropy(out["logits"].float().reshape(-1, p["vocab_size"]), x[:, 1:].reshape(-1),
                                     reduction="none").view(Bm, T)
            ce = (ce_tok * w).sum() / w.sum()
            loss = ce + a.aux_weight * out["aux"] / n_moe + a.kl_weight * out["kl"] / n_own
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        except Exception as e:  # keep what was trained: a failing long phase falls back to the short length
            failures += 1
            log(f"step {step} (T {T}, sparse {sparse}) failed: {e!r}\n{traceback.format_exc()}")
            results.setdefault("target_step_errors", []).append(f"step {step} T {T}: {e!r}")
            out = ce_tok = loss = None
            if prof is not None:
                prof.__exit__(None, None, None)
            opt.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if T == a.seq_long and a.seq_long != a.seq_short:
                a.long_frac = 0.0
            if failures >= 3:
                break
            continue
        if prof is not None:
            for _ in range(a.profile_steps - 1):  # the same step shape again, inside the profile
                with autocast(dev):
                    o2 = model(x[:, :-1], sparse=sparse, kl_rows=a.kl_rows, kl_tail=a.kl_tail, kl_dense=a.kl_dense)
                l2 = F.cross_entropy(o2["logits"].float().reshape(-1, p["vocab_size"]), x[:, 1:].reshape(-1))
                (l2 + a.kl_weight * o2["kl"] / n_own).backward()
                opt.zero_grad(set_to_none=True)
                del o2, l2
            if dev.type == "cuda":
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            try:
                table = prof.key_averages().table(sort_by="self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total", row_limit=25)
                print(f"profile {cfg}, {a.profile_steps} steps of {Bm} x {T}:\n{table}", flush=True)
                ka = prof.key_averages()
                results.setdefault("profile", {})[cfg] = {"steps": a.profile_steps, "T": T, "batch": Bm, "sparse": sparse,
                                      "top": [{"name": e.key[:80], "count": e.count,
                                               "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
                                               "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
                                              for e in sorted(ka, key=lambda e: -getattr(e, "self_device_time_total", 0))[:40]]}
            except Exception as e:
                log(f"profile table failed: {e!r}")
            eval_time += time.time() - t_prof
        with torch.no_grad():
            pkf = pk.float()
            txt = ((ce_tok.mean(1) * (1 - pkf)).sum(), (1 - pkf).sum())
            ans = ce_tok[:, -ANSWER - 1:-1]  # rows predicting " " and the five digits (passkey rows)
            pred_ok = (out["logits"][:, T - ANSWER - 1:T - 1].argmax(-1) == x[:, T - ANSWER:T]).all(-1)
            vals = torch.stack([ce.detach(), out["kl"].detach() / n_own, out["aux"].detach() / n_moe, gn.detach().float(),
                                txt[0], txt[1], (ans.mean(1) * pkf).sum(), pkf.sum(), (pred_ok.float() * pkf).sum()])
            acc = vals if acc is None else acc + vals
            n_acc += 1
        del out, ce_tok, loss
        step += 1
        tokens += Bm * T
        now = time.time()
        if now - last_log > a.log_every or step == 1:
            v = (acc / n_acc).tolist()
            s = acc.tolist()
            tps = tokens / (now - start - eval_time)
            row = dict(phase="target", step=step, tokens=tokens, seq=T, progress=round(progress, 4), lr=lr, sparse=sparse,
                       qat=qat, ce=v[0], kl=v[1], aux=v[2], grad_norm=v[3], text_ce=s[4] / max(s[5], 1),
                       passkey_answer_ce=s[6] / max(s[7], 1), passkey_train_acc=s[8] / max(s[7], 1), tok_s=tps)
            logger(**row)
            log(f"step {step} tok {tokens / 1e6:.1f}M T {T} ce {v[0]:.3f} text {row['text_ce']:.3f} "
                f"pk-ans {row['passkey_answer_ce']:.3f} ({row['passkey_train_acc']:.2f}) kl {v[1]:.3f} aux {v[2]:.3f} "
                f"lr {lr:.2e} {'sparse' if sparse else 'dense'}{' qat' if qat else ''} {tps / 1e3:.0f}k tok/s")
            acc, n_acc = None, 0
            last_log = now
        if now - last_eval > a.eval_every:
            t1 = time.time()
            ev = probe(model, T)
            eval_time += time.time() - t1
            logger(phase="eval", step=step, tokens=tokens, **ev)
            log(f"eval: val mean {ev['val_mean']:.3f} " + " ".join(f"{k} {v:.2f}" for k, v in ev.items()
                                                                    if k.startswith("passkey")) + f" ({time.time() - t1:.1f}s)")
            last_eval = time.time()
        if now - last_ckpt > a.ckpt_every:
            t1 = time.time()
            save_ckpt(out_dir, model, None, {"phase": "target", "step": step, "tokens": tokens, "progress": progress})
            eval_time += time.time() - t1
            last_ckpt = time.time()
    secs = time.time() - start
    ev = probe(model, a.seq_long)
    logger(phase="eval", step=step, tokens=tokens, **ev)
    log(f"final probe: {ev}")
    logger(phase="target_done", step=step, tokens=tokens, seconds=secs)
    return {"steps": step, "tokens": tokens, "seconds": secs, "tok_s": tokens / max(secs - eval_time, 1e-9),
            "final_probe": ev, "failures": failures,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}


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


class GeneratedRows:
    """The target's own continuations (gen_drafter_data.py): uint16 rows of prompt + generated
    tokens; batch() draws whole rows."""

    def __init__(self, paths, device):
        parts, shape = [], None
        for path in paths.split(","):  # several files of one row shape: their rows in order
            meta = json.load(open(path + ".json"))
            if shape is not None and shape != (meta["row_len"], meta["prompt_len"]):
                raise SystemExit(f"{path}: rows of {meta['row_len']} / prompt {meta['prompt_len']}, the others {shape}")
            shape = (meta["row_len"], meta["prompt_len"])
            with open(path, "rb") as f:
                flat = np.frombuffer(lzma.decompress(f.read()), dtype=np.uint16).astype(np.int64)
            parts.append(flat.reshape(meta["rows"], meta["row_len"]))
        rows = np.concatenate(parts)
        self.prompt_len = shape[1]
        self.device = device
        # The last tenth (at least one row) is held out: acceptance on the target's own text.
        n_out = max(1, rows.shape[0] // 10) if rows.shape[0] > 1 else 0
        self.rows, self.held_out = rows[:rows.shape[0] - n_out], rows[rows.shape[0] - n_out:]

    def batch(self, B, rng):
        x = torch.from_numpy(self.rows[rng.integers(0, self.rows.shape[0], size=B)])
        return x.to(self.device, non_blocking=True)

    def held_out_positions(self, S):
        """Anchors in the generated part: its start, middle and last full block."""
        L = self.held_out.shape[1]
        return sorted({self.prompt_len + 16, (self.prompt_len + L) // 2, L - S - 2})


def train_drafter(a, p, data, model, drafter, logger, gen=None):
    dev = data.device
    opt = torch.optim.AdamW(param_groups(drafter, 0.0), lr=a.drafter_lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    model.eval()
    for q in model.parameters():
        q.requires_grad_(False)
    rng = np.random.default_rng(a.seed + 1)
    trng = torch.Generator().manual_seed(a.seed + 1)
    S = drafter.B - 1
    slot_w = a.drafter_slot_decay ** torch.arange(S, dtype=torch.float32, device=dev)
    slot_w = slot_w / slot_w.sum()  # early slots decide the acceptance length: they weigh more
    if gen is not None:
        log(f"drafter data: {gen.rows.shape[0]} rows of {gen.rows.shape[1]} tokens (prompt {gen.prompt_len}) "
            f"from {a.drafter_data}, {a.drafter_data_frac:.0%} of the batches")
    start, step = time.time(), 0
    last_log = start
    while time.time() - start < a.drafter_seconds and step < a.max_steps:
        progress = (time.time() - start) / a.drafter_seconds
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, a.drafter_lr, 0.05)
        if step % a.drafter_reuse == 0:  # one target forward feeds --drafter-reuse drafter steps
            if gen is not None and rng.random() < a.drafter_data_frac:
                # The target's own continuations (gen_drafter_data.py): anchors in the generated part.
                x = gen.batch(a.drafter_batch, rng)
                T, lo = x.shape[1] - 1, gen.prompt_len
            else:
                T, lo = a.drafter_seq, 16
                x, _, _ = data.batch(a.drafter_batch, T, rng, a.passkey_frac / 4)
            with torch.no_grad(), autocast(dev):
                out = model(x, sparse=True, hidden_layers=tuple(drafter.target_layers), stable_ties=False)
                tprob = out["logits"].float().softmax(-1)  # row i predicts token i+1
        anchors = torch.randint(lo, T - S, (a.drafter_batch, a.drafter_anchors), generator=trng).to(dev)
        slot0 = torch.gather(x, 1, anchors)
        idx = anchors[:, :, None] + torch.arange(S, device=dev)  # tokens at P..P+S-1 feed slots 1..S
        prev = torch.gather(x, 1, idx.view(a.drafter_batch, -1)).view(a.drafter_batch, -1, S)
        with autocast(dev):
            ctx = drafter.context({l: h.detach() for l, h in out["hidden"].items()})
            lg = drafter(model, ctx, anchors, slot0, prev).float()  # slot j predicts P+j from row P+j-1
        tgt = torch.gather(tprob, 1, idx.reshape(a.drafter_batch, -1, 1).expand(-1, -1, tprob.shape[-1]))
        tgt = tgt.view(a.drafter_batch, -1, S, tprob.shape[-1])
        per_slot = -(tgt * torch.log_softmax(lg, -1)).sum(-1).mean(dim=(0, 1))  # [S]
        loss = (per_slot * slot_w).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if time.time() - last_log > a.log_every or step == 1:
            with torch.no_grad():
                acc = (lg.argmax(-1) == tgt.argmax(-1)).float().mean(dim=(0, 1))
            logger(phase="drafter", step=step, loss=loss.item(), slot_top1=[round(float(v), 4) for v in acc])
            log(f"drafter step {step} loss {loss.item():.3f} slot top-1 agreement {[round(float(v), 2) for v in acc]}")
            last_log = time.time()
    return {"steps": step, "seconds": time.time() - start}


@torch.no_grad()
def acceptance(model, drafter, data, n_seq, positions, seed):
    """Mean acceptance length (tokens per target step: accepted drafts + 1) on val text."""
    tk = data.tk
    seqs = []
    for grp in data.groups:
        ids = tk.encode(data.val_text[grp])
        L = max(positions) + 1
        for i in range(n_seq):
            if (i + 1) * L <= len(ids):
                seqs.append([tk.bos] + ids[i * L:(i + 1) * L - 1])
    return acceptance_on(model, drafter, torch.tensor(seqs, device=data.device), positions, seed)


@torch.no_grad()
def acceptance_on(model, drafter, x, positions, seed):
    """acceptance() over the rows x [N, L] at the given positions (each < L)."""
    dev = x.device
    g = torch.Generator(device=dev).manual_seed(seed)
    S = drafter.B - 1
    res = {}
    for mode in ("greedy", "t1"):
        acc_all, per_slot = [], torch.zeros(S, device=dev)
        for P in positions:
            with autocast(dev):
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
def passkey_eval(model, data, lengths, n, seed, budget_end, modes=("topk", "dense")):
    """Accuracy per length and mode: 10 samples, needle at depths (i + 0.5) / n, corpus filler;
    a hit when the greedy choice is right for the space and all five digits."""
    rng = torch.Generator().manual_seed(seed)
    res = {}
    model.eval()
    for L in lengths:
        samples = [data.passkey(L, rng, corpus_filler=True, depth=(i + 0.5) / n) for i in range(n)]
        for mode in modes:
            hits, done = 0, 0
            for toks, at, key in samples:
                if time.time() > budget_end:
                    break
                x = torch.tensor([toks], device=data.device)
                with autocast(data.device):
                    lg = model(x[:, :-1], dense_attention=(mode == "dense"), query_chunk=2048, stable_ties=False)["logits"][0]
                pred = lg[at - 1:at + 5].argmax(-1)
                hits += int(torch.equal(pred, x[0, at:at + 6]))
                done += 1
            res[f"{L}/{mode}"] = {"accuracy": hits / max(done, 1), "hits": hits, "samples": done}
            log(f"passkey {L} {mode}: {hits}/{done}")
    return res


@torch.no_grad()
def continuations(model, tk, dev, n_new, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    model.eval()
    for prompt in PROMPTS:
        row = {"prompt": prompt}
        for mode in ("greedy", "t0.8"):
            ids = [tk.bos] + tk.encode(prompt)
            for _ in range(n_new):
                x = torch.tensor([ids], device=dev)
                with autocast(dev):
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
    ap.add_argument("--target-from", default="", help="a shipped consolidated.safetensors: the frozen target (FP8 "
                    "decoded) for drafter-only runs (--target-seconds 0); exported verbatim")
    ap.add_argument("--skip-target-eval", action="store_true", help="no validation perplexity / continuations")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-seconds", type=float, default=370)
    ap.add_argument("--drafter-seconds", type=float, default=40)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seq-short", type=int, default=1024)
    ap.add_argument("--seq-long", type=int, default=4096)
    ap.add_argument("--long-frac", type=float, default=0.25, help="last fraction of the time at --seq-long")
    ap.add_argument("--tokens-per-step", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--dense-frac", type=float, default=0.2)
    ap.add_argument("--qat-frac", type=float, default=0.12)
    ap.add_argument("--passkey-frac", type=float, default=0.25)
    ap.add_argument("--grass-frac", type=float, default=0.3, help="share of passkey samples with the repeated filler")
    ap.add_argument("--answer-weight", type=float, default=3.0, help="loss weight of a passkey sample's answer tokens")
    ap.add_argument("--kl-rows", type=int, default=64)
    ap.add_argument("--kl-tail", type=int, default=8)
    ap.add_argument("--kl-dense", type=int, default=1, help="1: KL over every causal key in both stages")
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--drafter-seq", type=int, default=2048)
    ap.add_argument("--drafter-batch", type=int, default=16)
    ap.add_argument("--drafter-anchors", type=int, default=128)
    ap.add_argument("--drafter-slot-decay", type=float, default=0.8, help="loss weight of slot j ~ decay^(j-1)")
    ap.add_argument("--drafter-reuse", type=int, default=2, help="drafter steps (fresh anchors) per target forward")
    ap.add_argument("--drafter-data", default="",
                    help="gen_drafter_data.py's file (or files, comma-separated): the target's own continuations")
    ap.add_argument("--drafter-data-frac", type=float, default=0.75, help="share of drafter batches from --drafter-data")
    ap.add_argument("--drafter-from-target", action="store_true", help="with --target-from: start the drafter from "
                    "that file's mtp_dspark.* tensors (continue training the shipped drafter)")
    ap.add_argument("--drafter-layers", type=int, default=0,
                    help="draft layers (0: params.json's mtp.n_layers; ML4 has 3). With --drafter-from-target a "
                    "drafter of more layers than the file's starts as that drafter: its layers are loaded, the new "
                    "ones appended with zero output projections (each an identity on the residual stream)")
    ap.add_argument("--eval-ctx", type=int, default=4096)
    ap.add_argument("--eval-chunks", type=int, default=2)
    ap.add_argument("--eval-every", type=float, default=30)
    ap.add_argument("--ckpt-every", type=float, default=100)
    ap.add_argument("--probe-lengths", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--probe-n", type=int, default=16)
    ap.add_argument("--passkey-lengths", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--passkey-n", type=int, default=10)
    ap.add_argument("--accept-seqs", type=int, default=8)
    ap.add_argument("--accept-positions", type=int, nargs="*", default=[256, 768, 1536])
    ap.add_argument("--accept-generated-rows", type=int, default=128, help="held-out rows of --drafter-data measured")
    ap.add_argument("--sample-tokens", type=int, default=40)
    ap.add_argument("--deadline", type=float, default=560, help="seconds after start when optional work stops")
    ap.add_argument("--log-every", type=float, default=10)
    ap.add_argument("--profile-steps", type=int, default=3, help="CUDA: profile this many steps at step 30 (0: off)")
    ap.add_argument("--topk-override", type=int, default=0, help="smoke tests: a smaller indexer top-k")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)
    p = json.load(open(a.params))
    if a.topk_override:
        p["indexer"]["topk"] = a.topk_override
    tk = Tekken(a.tekken)
    assert tk.vocab_size == p["vocab_size"], (tk.vocab_size, p["vocab_size"])
    logger = Logger(os.path.join(a.out, "train_log.jsonl"))
    results = {"args": vars(a), "params": p}
    data = Data(a.data, tk, dev)
    log(f"data: {len(data.train_np) / 1e6:.1f}M train tokens, device {dev}"
        + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else "") + f", torch {torch.__version__}")
    if a.drafter_layers:
        p["mtp"]["n_layers"] = a.drafter_layers
    model = Ml4Small(p).to(dev)
    drafter = DSparkDrafter(p).to(dev)
    if a.resume:
        results["resumed_from"] = load_ckpt(a.resume, model, drafter)
        log(f"resumed from {a.resume}: {results['resumed_from']}")
    n_params = sum(x.numel() for x in model.parameters())
    results["target_parameters"] = n_params
    results["drafter_parameters"] = sum(x.numel() for x in drafter.parameters())
    log(f"target {n_params / 1e6:.2f}M parameters, drafter {results['drafter_parameters'] / 1e6:.2f}M")
    deadline = T0 + a.deadline

    def write_results():
        results["seconds"] = time.time() - T0
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)

    def phase(name, fn):
        try:
            return fn()
        except Exception as e:
            results[name + "_error"] = repr(e)
            log(f"{name} failed: {e!r}\n{traceback.format_exc()}")
            write_results()
            return None

    if a.target_from:
        state = {k: v.to(dev) for k, v in dequantized_state(a.target_from).items()}
        load_into(model, drafter if a.drafter_from_target else None,
                  state if a.drafter_from_target else {k: v for k, v in state.items() if not k.startswith("mtp_dspark.")})
        log(f"target from {a.target_from} (FP8 decoded)" + (", drafter too" if a.drafter_from_target else ""))
    if a.target_seconds > 0:
        results["target_training"] = train_target(a, p, data, model, logger, a.out, results)
        write_results()
    model.set_qat(False)
    size = export(model, None, p, None, a.out, target_file=a.target_from or None)
    save_ckpt(a.out, model, None, {"phase": "target", "time": time.time() - T0})
    log(f"exported target: {size / 2**20:.2f} MiB")
    # Evaluate exactly what ships: FP8 decoded into a fresh f32 model.
    ev = Ml4Small(p).to(dev)
    load_into(ev, None, {k: v.to(dev) for k, v in dequantized_state(os.path.join(a.out, "consolidated.safetensors")).items()})
    ev.eval()
    if a.target_from:
        model = ev  # the drafter learns the target as it ships

    def val():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        try:
            results["val_topk"] = evaluate_ppl(ev, data, a.eval_ctx, a.eval_chunks)
            log("val (exported, top-k): " + ", ".join(f"{g} {r['ppl']:.2f}" for g, r in results["val_topk"].items()))
            results["val_dense"] = evaluate_ppl(ev, data, a.eval_ctx, a.eval_chunks, dense=True)
            log("val (exported, dense): " + ", ".join(f"{g} {r['ppl']:.2f}" for g, r in results["val_dense"].items()))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    if not a.skip_target_eval:
        phase("val", val)
        write_results()
    if a.drafter_seconds > 0:
        def draft():
            gen = GeneratedRows(a.drafter_data, dev) if a.drafter_data else None
            results["drafter_training"] = train_drafter(a, p, data, model, drafter, logger, gen)
            size = export(model, drafter, p, None, a.out, target_file=a.target_from or None)
            save_ckpt(a.out, model, drafter, {"phase": "drafter", "time": time.time() - T0})
            log(f"exported target + drafter: {size / 2**20:.2f} MiB")
            drafter.eval()
            results["acceptance"] = acceptance(model, drafter, data, a.accept_seqs, a.accept_positions, a.seed)
            log(f"acceptance: {results['acceptance']}")
            if gen is not None and len(gen.held_out):
                pos = gen.held_out_positions(drafter.B - 1)
                x = torch.from_numpy(gen.held_out[:a.accept_generated_rows]).to(dev)
                results["acceptance_generated"] = dict(acceptance_on(model, drafter, x, pos, a.seed),
                                                       rows=int(x.shape[0]), positions=pos)
                log(f"acceptance on the target's own held-out text: {results['acceptance_generated']}")
        phase("drafter", draft)
        write_results()

    def cont():
        results["continuations"] = continuations(ev, tk, dev, a.sample_tokens, a.seed)
        for r in results["continuations"]:
            log(f"{r['prompt']!r} -> greedy {r['greedy']!r} | t0.8 {r['t0.8']!r}")
    if not a.skip_target_eval:
        phase("continuations", cont)
        write_results()

    def pk():
        results["passkey"] = passkey_eval(ev, data, a.passkey_lengths, a.passkey_n, a.seed, deadline)
    phase("passkey", pk)
    write_results()
    log("done")


if __name__ == "__main__":
    main()
