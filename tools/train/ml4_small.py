"""The trainable ML4 model (MODEL.md section 3) and its DSpark drafter (section 5), in PyTorch.

One forward written against the layer spec of params.json, as the engine's: the spec, the
LeRoPE position map, the rotary tables, the softmax scale and the rope / norm / router maths
are taken from tools/reference/ml4_model.py and the transformers modules it is built on
(`layer_specs`, `lerope_positions`, `mistral4_config`, `Mistral4RotaryEmbedding`,
`apply_rotary_pos_emb_interleave`, deepseek_v32's NeoX `apply_rotary_pos_emb`,
`get_llama_4_attn_scale`, `yarn_apply_mscale`), so the definition is shared; what is written
here is the batched, trainable form (stacked experts, SDPA attention, a top-k mask) and the
training-only parts (indexer KL, FP8 fake quantization, load-balancing loss).
tools/train/check_reference.py checks the exported checkpoint against Ml4Reference.

Parameter names are the native checkpoint's (docs/MODEL-FORMAT.md section 4), so export is a
rename of the stacked experts plus FP8 quantization (export.py).

Indexer training follows DeepSeek-V3.2 (arXiv 2512.02556, section 2.1): the indexer reads a
detached copy of the attention input, and its loss is KL(p || softmax(indexer scores)) with p
the main attention's probabilities summed over heads and L1-normalised; in the dense warm-up
the attention covers every causal key and the KL runs over all of them, in the sparse stage the
attention covers only the indexer's top-k and the KL runs over the selected set.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))

from ml4_model import _tf, indexer_rotary_config, layer_specs, lerope_positions, mistral4_config  # noqa: E402
from numerics import fp8_group_roundtrip  # noqa: E402

E4M3_MAX = 448.0
BLOCK = 128


def fp8_block_quantize(w: torch.Tensor):
    """w [..., N, K] -> (e4m3 [..., N, K], scale_inv f32 [..., ceil(N/128), ceil(K/128)]), DeepSeek's layout.

    scale = amax(block) / 448 in f32 (a multiplier: w ~ e4m3 * scale), e4m3 = RNE(w / scale).
    Leading dims are independent matrices (the stacked experts: one call for all of them).
    """
    *lead, N, K = w.shape
    nb, kb = -(-N // BLOCK), -(-K // BLOCK)
    wp = w.float()
    if nb * BLOCK != N or kb * BLOCK != K:
        wp = F.pad(wp, (0, kb * BLOCK - K, 0, nb * BLOCK - N))
    blocks = wp.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)
    q = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K].contiguous(), scale


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = q.shape[-2:]
    full = scale.repeat_interleave(BLOCK, -2)[..., :N, :].repeat_interleave(BLOCK, -1)[..., :K]
    return q.to(torch.float32) * full


def fp8_fake(w: torch.Tensor) -> torch.Tensor:
    """Straight-through FP8 block rounding of a weight [..., N, K] (quantization-aware training)."""
    with torch.no_grad():
        q, s = fp8_block_quantize(w.detach())
        wq = fp8_block_dequantize(q, s).to(w.dtype)
    return w + (wq - w).detach()


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """numerics.hadamard (Sylvester order, scale n^-0.5, f64 product) on x's device."""
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64, device=x.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x.to(torch.float64) @ h * (1.0 / math.sqrt(n))).to(x.dtype)


def up(t: torch.Tensor) -> torch.Tensor:
    """At least f32 (training runs in bf16 autocast; the reference check in f64)."""
    return t if t.dtype == torch.float64 else t.float()


class QLinear(nn.Linear):
    """nn.Linear whose weight is stored as FP8 blocks in the export (`fp8` set), and can be
    rounded so during training (`qat`)."""

    def __init__(self, i, o, fp8=True):
        super().__init__(i, o, bias=False)
        self.fp8 = fp8
        self.qat = False

    def forward(self, x):
        w = fp8_fake(self.weight) if (self.qat and self.fp8) else self.weight
        return F.linear(x, w.to(x.dtype) if not torch.is_autocast_enabled() else w)


class RMSNorm(nn.Module):
    """Mistral4RMSNorm: normalised in f32, cast back, times the weight."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dt) * h.to(dt)


class Indexer(nn.Module):
    def __init__(self, D, HI, dI):
        super().__init__()
        self.wq = QLinear(D, HI * dI)
        self.wk = QLinear(D, dI)
        self.k_norm = nn.LayerNorm(dI)
        self.weights_proj = QLinear(D, HI, fp8=False)  # unquantized, as vLLM / transformers keep it
        self.HI, self.dI = HI, dI


class Attention(nn.Module):
    def __init__(self, p, spec, ix):
        super().__init__()
        D, H = p["dim"], p["n_heads"]
        dn, dr, dv, r = p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"], p["kv_lora_rank"]
        self.wq = QLinear(D, H * (dn + dr))
        if spec.kv_source == spec.index:
            self.wkv_a_with_mqa = QLinear(D, r + dr)
            self.kv_a_norm = RMSNorm(r, p["norm_eps"])
        self.wkv_b = QLinear(r, H * (dn + dv))
        self.wo = QLinear(H * dv, D)
        if spec.ssmax:
            self.ssmax_s = nn.Parameter(torch.full((H,), 1.0 / math.log(ix["topk"] if ix else 4096)))
        if spec.indexer == "owner":
            self.indexer = Indexer(D, ix["n_heads"], ix["head_dim"])


class DenseFFN(nn.Module):
    def __init__(self, D, F_):
        super().__init__()
        self.w1, self.w2, self.w3 = QLinear(D, F_), QLinear(F_, D), QLinear(D, F_)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """The routed experts stacked: w1/w3 [E, I, D], w2 [E, D, I] (exported per expert)."""

    def __init__(self, E, D, I):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, I, D))
        self.w2 = nn.Parameter(torch.empty(E, D, I))
        self.w3 = nn.Parameter(torch.empty(E, I, D))
        self.qat = False

    def weights(self):
        if not self.qat:
            return self.w1, self.w2, self.w3
        return tuple(fp8_fake(w) for w in (self.w1, self.w2, self.w3))  # per expert: [e] is its own matrix


class Layer(nn.Module):
    def __init__(self, p, spec, ix):
        super().__init__()
        D = p["dim"]
        self.attention_norm = RMSNorm(D, p["norm_eps"])
        self.ffn_norm = RMSNorm(D, p["norm_eps"])
        self.attention = Attention(p, spec, ix)
        if spec.dense:
            self.feed_forward = DenseFFN(D, p["hidden_dim"])
        else:
            moe = p["moe"]
            E, I = moe["num_experts"], moe["expert_hidden_dim"]
            self.gate = QLinear(D, E, fp8=False)
            self.experts = Experts(E, D, I)
            self.shared_experts = DenseFFN(D, I * moe.get("num_shared_experts", 1))


class Ml4Small(nn.Module):
    def __init__(self, p: dict):
        super().__init__()
        _, _, m4, ds = _tf()
        self.m4, self.ds = m4, ds
        self.p = p
        self.specs = layer_specs(p)
        ix = p.get("indexer")
        self.ix = ix
        D, V = p["dim"], p["vocab_size"]
        self.H, self.dn, self.dr, self.dv, self.r = (p["n_heads"], p["qk_nope_head_dim"], p["qk_rope_head_dim"],
                                                     p["v_head_dim"], p["kv_lora_rank"])
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer(p, s, ix) for s in self.specs])
        self.norm = RMSNorm(D, p["norm_eps"])
        self.tied = bool(p.get("tied_embeddings"))
        if not self.tied:
            self.output = QLinear(D, V, fp8=False)
        cfg, _ = mistral4_config(p)
        self.rotary = m4.Mistral4RotaryEmbedding(cfg)
        self.scale = m4.yarn_apply_mscale(cfg.rope_parameters, (self.dn + self.dr) ** -0.5)
        self.ix_rotary = m4.Mistral4RotaryEmbedding(indexer_rotary_config(p)) if ix else None
        l4 = p.get("llama_4_scaling")
        self.l4 = (float(l4["beta"]), int(l4["original_max_position_embeddings"])) if l4 else None
        moe = p.get("moe", {})
        self.E, self.K = moe.get("num_experts", 0), moe.get("num_experts_per_tok", 0)
        self.routed_scale = float(moe.get("routed_scale", 1.0))
        self.renorm = moe.get("norm_topk_prob", True)
        self._tables = {}
        self.reset_parameters()

    # ------------------------------------------------------------------ setup
    def reset_parameters(self, std=0.02):
        n = len(self.specs)
        for name, prm in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("k_norm.weight"):
                nn.init.ones_(prm)
            elif name.endswith("k_norm.bias"):
                nn.init.zeros_(prm)
            elif name.endswith("ssmax_s"):
                continue
            elif any(name.endswith(s) for s in (".wo.weight", ".w2.weight", "experts.w2")):
                nn.init.normal_(prm, std=std / math.sqrt(2 * n))
            else:
                nn.init.normal_(prm, std=std)

    def set_qat(self, on: bool):
        for m in self.modules():
            if isinstance(m, (QLinear, Experts)):
                m.qat = on

    def tables(self, T, device):
        """cos/sin of MLA and indexer rotaries at LeRoPE'd positions 0..T-1 (f32), llama4
        temperature [T] and SSMax log(n) [T]."""
        key = (T, str(device))
        if key not in self._tables:
            pos = torch.arange(T)
            pp = lerope_positions(pos, self.p).to(torch.float32)
            dummy = torch.zeros(1, dtype=torch.float32)
            cos, sin = self.rotary(dummy, pp[None])
            out = {"cos": cos.to(device), "sin": sin.to(device)}
            if self.ix_rotary is not None:
                c2, s2 = self.ix_rotary(dummy, pp[None])
                out["ix_cos"], out["ix_sin"] = c2.to(device), s2.to(device)
            temp = torch.ones(T, dtype=torch.float64)
            if self.l4:
                temp = self.m4.get_llama_4_attn_scale(pos[None].to(torch.float64), self.l4[0], self.l4[1])[0, 0, :, 0]
            out["temp"] = temp.to(device)
            n = (pos.to(torch.float64) + 1)
            if self.ix:
                n = n.clamp(max=float(self.ix["topk"]))
            out["logn"] = torch.log(n).to(device)
            self._tables[key] = out
        return self._tables[key]

    def output_weight(self):
        return self.tok_embeddings.weight if self.tied else self.output.weight

    # ------------------------------------------------------------------ pieces
    def indexer_scores(self, ix, a, tb, rope, rows=None, fp8=False):
        """score[b, t, s] = sum_h w[b,t,h] relu(qI[b,t,h] . kI[b,s]) (causal mask not applied).

        rows: query positions to score (None: all). fp8: DeepSeek's Hadamard + FP8 per 128 on
        q and k, as ml4 runs it (numerics.indexer_scores).
        """
        B, T, _ = a.shape
        HI, dI = ix.HI, ix.dI
        ixr = self.ix["rope_head_dim"]
        k = ix.k_norm(up(ix.wk(a)))  # [B, T, dI] (LayerNorm in f32)
        aq = a if rows is None else a[:, rows]
        R = aq.shape[1]
        q = up(ix.wq(aq).view(B, R, HI, dI))
        if rope:
            cos, sin = tb["ix_cos"], tb["ix_sin"]
            qc, qs = (cos, sin) if rows is None else (cos[:, rows], sin[:, rows])
            q_rot, k_rot = q[..., :ixr], k[..., :ixr].unsqueeze(2)
            q_rot, _ = self.ds.apply_rotary_pos_emb(q_rot, q_rot[:, :, :1], qc, qs, unsqueeze_dim=2)
            _, k_rot = self.ds.apply_rotary_pos_emb(k_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q[..., ixr:]], -1)
            k = torch.cat([k_rot.squeeze(2), k[..., ixr:]], -1)
        if fp8:
            q = fp8_group_roundtrip(hadamard(q))
            k = fp8_group_roundtrip(hadamard(k))
        w = up(ix.weights_proj(aq)) * (HI ** -0.5) * (dI ** -0.5)  # [B, R, HI]
        if torch.is_autocast_enabled() and not fp8:
            # Training / bf16 evaluation: every head in one bf16 GEMM, the head sum as a batched
            # matrix-vector product ([B*R, 1, HI] @ [B*R, HI, T]); the exact f32 / f64 path
            # below (head by head, as numerics.indexer_scores) is what the evaluation and the
            # reference check run.
            dt = torch.bfloat16
            dots = torch.matmul(q.to(dt).reshape(B, R * HI, dI), k.to(dt).transpose(1, 2))  # [B, R*HI, T]
            dots = torch.relu(dots).view(B * R, HI, -1)
            return torch.bmm(w.to(dt).reshape(B * R, 1, HI), dots).view(B, R, -1).float()
        scores = None
        for h in range(HI):
            s = torch.relu(torch.einsum("brd,btd->brt", q[:, :, h], k)) * w[:, :, h, None]
            scores = s if scores is None else scores + s
        return scores

    def moe(self, L, x):
        """Mistral4MoE on x [N, D]: softmax router (f32), top-k, renormalised, routed_scale;
        plus the shared expert. Returns (y, load-balancing loss, routed ids).

        Every expert is computed for every token and weighted by the router weights with the
        unselected experts' weights zero: the same function as running only the top-k experts
        (an unselected expert adds exactly 0), but three GEMMs with no per-expert launches and
        no host sync. At expert hidden 128 and 16 experts this is 4x the routed FLOPs of a
        gather, which the H200 spends in less time than the gather's small launches.
        """
        N, D = x.shape
        logits = F.linear(up(x), up(L.gate.weight))
        scores = logits.softmax(-1)
        topw, topi = torch.topk(scores, self.K, dim=-1)
        if self.renorm:
            topw = topw / (topw.sum(-1, keepdim=True) + 1e-20)
        topw = topw * self.routed_scale
        route = torch.zeros_like(scores).scatter(1, topi, topw)  # [N, E], zero off the top-k
        w1, w2, w3 = L.experts.weights()  # [E, I, D], [E, D, I], [E, I, D]
        E, I = w1.shape[0], w1.shape[1]
        w13 = torch.cat([w1.reshape(E * I, D), w3.reshape(E * I, D)], 0)
        h = F.linear(x, w13 if torch.is_autocast_enabled() else w13.to(x.dtype))
        g, u = h.split(E * I, dim=-1)
        act = (F.silu(g) * u).view(N, E, I) * route[:, :, None].to(h.dtype)
        w2c = w2.permute(1, 0, 2).reshape(D, E * I)  # column e*I + i = w2[e][:, i]
        y = F.linear(act.view(N, E * I), w2c if torch.is_autocast_enabled() else w2c.to(x.dtype)).to(x.dtype)
        y = y + L.shared_experts(x)
        counts = torch.zeros(self.E, dtype=torch.float32, device=x.device).scatter_add_(
            0, topi.reshape(-1), torch.ones(topi.numel(), dtype=torch.float32, device=x.device))
        frac = counts / topi.numel()
        aux = self.E * (frac * scores.mean(0)).sum()
        return y, aux, topi

    # ------------------------------------------------------------------ forward
    def forward(self, tokens, sparse=True, kl_rows=0, hidden_layers=(), fp8_indexer=False, bf16_latent=False,
                query_chunk=0, dense_attention=False, record=None, stable_ties=None, kl_tail=0, kl_dense=True):
        """tokens [B, T] -> dict(logits [B, T, V], aux, kl, hidden {layer: [B, T, D]}).

        sparse: attention restricted to the indexer's top-k (False: dense warm-up, every causal
        key); dense_attention: evaluation with the indexer off (a dense comparison).
        kl_rows: query rows per sequence that carry the indexer KL (0: no KL); the last kl_tail
        of them are the sequence's last rows (a passkey sample's question and answer), the rest
        random. The KL of an indexer owner is to the mean attention distribution of the layers
        that attend over its selection (the owner and its reusers). kl_dense: that distribution
        and the indexer's cover every causal key (otherwise, in the sparse stage, only the
        selected keys, as DeepSeek-V3.2's second stage).
        fp8_indexer / bf16_latent: emulate ml4's indexer quantization and bf16 latent cache.
        query_chunk: attention in query chunks (long evaluation sequences).
        record: dict filled with {layer: top-k ids [B, T, k]} of owner layers (goldens).
        stable_ties: top-k ties to the lower key index (default: when not training).
        """
        B, T = tokens.shape
        dev = tokens.device
        tb = self.tables(T, dev)
        H, dn, dr, dv, r = self.H, self.dn, self.dr, self.dv, self.r
        m4 = self.m4
        x = self.tok_embeddings(tokens)
        cos, sin = tb["cos"], tb["sin"]
        latent, selection = {}, {}
        aux = x.new_zeros((), dtype=torch.float32)
        kl = x.new_zeros((), dtype=torch.float32)
        hidden = {}
        causal = None
        rows = None
        do_kl = bool(kl_rows) and self.training and self.ix is not None
        if do_kl:
            lo = min(16, T - 1)
            tail = min(kl_tail, kl_rows, T - lo)
            rand = torch.randperm(T - lo - tail, device=dev)[:kl_rows - tail].sort().values + lo
            rows = torch.cat([rand, torch.arange(T - tail, T, device=dev)])
        kl_groups = {}  # owner -> [log q (grad to the indexer), allowed, summed target, layers]
        topk = self.ix["topk"] if self.ix else 0
        use_sparse = sparse and not dense_attention and self.ix is not None and topk < T
        if use_sparse or do_kl or record is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        for s, L in zip(self.specs, self.layers):
            A = L.attention
            a = L.attention_norm(x)
            q = A.wq(a).view(B, T, H, dn + dr).transpose(1, 2)
            q_nope, q_rope = torch.split(q, [dn, dr], dim=-1)
            if s.kv_source == s.index:
                c, kr = torch.split(A.wkv_a_with_mqa(a), [r, dr], dim=-1)
                c = A.kv_a_norm(c)
                kr = kr.reshape(B, 1, T, dr)
                if s.rope:
                    q_rope, kr = m4.apply_rotary_pos_emb_interleave(q_rope, kr, cos.to(q.dtype), sin.to(q.dtype))
                if bf16_latent:
                    c, kr = c.to(torch.bfloat16).to(c.dtype), kr.to(torch.bfloat16).to(kr.dtype)
                latent[s.index] = (c, kr)
            elif s.rope:
                q_rope, _ = m4.apply_rotary_pos_emb_interleave(q_rope, q_rope[:, :1], cos.to(q.dtype), sin.to(q.dtype))
            c, kr = latent[s.kv_source]
            # Selection (MODEL.md 3.5).
            mask = None
            if s.indexer == "owner" and self.ix is not None:
                ai = a.detach()
                if use_sparse or record is not None:
                    with torch.no_grad():
                        sc = self.indexer_scores(A.indexer, ai, tb, s.rope, fp8=fp8_indexer)
                        sc = sc.masked_fill(~causal, float("-inf"))
                        kk = min(topk, T)
                        if not (stable_ties if stable_ties is not None else not self.training):
                            idx = torch.topk(sc, kk, dim=-1).indices  # [B, T, kk]
                        else:  # ties (relu zeros) to the lower key index, as ml4 and the reference
                            idx = torch.sort(-sc, dim=-1, stable=True).indices[..., :kk]
                        del sc
                        sel = torch.zeros(B, T, T, dtype=torch.bool, device=dev)
                        sel.scatter_(2, idx, True)
                        sel &= causal
                        if record is not None:
                            record[s.index] = idx
                    selection[s.index] = sel
                if do_kl:
                    sr = self.indexer_scores(A.indexer, ai, tb, s.rope, rows=rows)  # [B, R, T], grad to the indexer
                    if use_sparse and not kl_dense:
                        allowed = selection[s.index][:, rows]
                    else:
                        allowed = causal[rows][None].expand(B, -1, -1)
                    logq = sr.masked_fill(~allowed, float("-inf")).log_softmax(-1)
                    kl_groups[s.index] = [logq, allowed, None, 0]
            if do_kl and s.indexer_source in kl_groups:
                g = kl_groups[s.indexer_source]
                with torch.no_grad():  # this layer's attention distribution on the KL rows
                    qf = up(torch.cat([q_nope, q_rope.to(q_nope.dtype)], -1)[:, :, rows])
                    kvr = A.wkv_b(c).view(B, T, H, dn + dv)
                    kf = up(torch.cat([kvr[..., :dn], kr.transpose(1, 2).expand(B, T, H, dr).to(kvr.dtype)], -1))
                    lg = torch.einsum("bhrd,bthd->bhrt", qf, kf) * self.scale
                    lg = lg * tb["temp"][rows][None, None, :, None].to(lg.dtype)
                    if s.ssmax:
                        lg = lg * (up(A.ssmax_s)[None, :, None, None] * tb["logn"][rows][None, None, :, None].to(lg.dtype))
                    lg = lg.masked_fill(~g[1][:, None], float("-inf"))
                    tgt = lg.softmax(-1).mean(1)  # [B, R, T]: summed over heads, L1-normalised
                g[2] = tgt if g[2] is None else g[2] + tgt
                g[3] += 1
            if use_sparse:
                mask = selection[s.indexer_source]
            # Unabsorbed MLA (as the reference): k_nope / v per head from the latent.
            kv = A.wkv_b(c).view(B, T, H, dn + dv).transpose(1, 2)
            k_nope, v = torch.split(kv, [dn, dv], dim=-1)
            k = torch.cat([k_nope, kr.expand(B, H, T, dr).to(k_nope.dtype)], -1)
            qf = torch.cat([q_nope, q_rope.to(q_nope.dtype)], -1)
            fac = tb["temp"][None, None, :, None].to(up(qf).dtype)
            if s.ssmax:
                fac = fac * (up(A.ssmax_s)[None, :, None, None] * tb["logn"][None, None, :, None].to(fac.dtype))
            qf = qf * fac.to(qf.dtype)
            vp = F.pad(v, (0, qf.shape[-1] - dv)) if qf.shape[-1] > dv else v
            o = self._attend(qf, k, vp, mask, query_chunk)[..., :dv]
            x = x + A.wo(o.transpose(1, 2).reshape(B, T, H * dv))
            hn = L.ffn_norm(x)
            if s.dense:
                x = x + L.feed_forward(hn)
            else:
                y, a_l, _ = self.moe(L, hn.reshape(B * T, -1))
                x = x + y.view(B, T, -1)
                aux = aux + a_l
            if s.index in hidden_layers:
                hidden[s.index] = x
        for logq, allowed, tsum, n in kl_groups.values():
            target = tsum / n
            kl = kl + (target * (torch.log(target.clamp_min(1e-20)) - logq.clamp_min(-1e4))).masked_fill(
                ~allowed, 0).sum(-1).mean()
        logits = F.linear(self.norm(x), self.output_weight().to(x.dtype))
        return {"logits": logits, "aux": aux, "kl": kl, "hidden": hidden}

    def _attend(self, q, k, v, mask, query_chunk):
        T = q.shape[2]
        if mask is None and not query_chunk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        if mask is None:
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None]
        step = query_chunk or T
        outs = []
        for i in range(0, T, step):
            m = mask[:, i:i + step, :][:, None]
            outs.append(F.scaled_dot_product_attention(q[:, :, i:i + step], k, v, attn_mask=m, scale=self.scale))
        return torch.cat(outs, 2)


# ------------------------------------------------------------------------------ DSpark drafter

class DraftLayer(nn.Module):
    def __init__(self, p):
        super().__init__()
        D, H = p["dim"], p["n_heads"]
        dn, dr, dv, r = p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"], p["kv_lora_rank"]
        self.attention_norm = RMSNorm(D, p["norm_eps"])
        self.ffn_norm = RMSNorm(D, p["norm_eps"])
        self.attention = nn.Module()
        self.attention.wq = QLinear(D, H * (dn + dr), fp8=False)
        self.attention.wkv_a_with_mqa = QLinear(D, r + dr, fp8=False)
        self.attention.kv_a_norm = RMSNorm(r, p["norm_eps"])
        self.attention.wkv_b = QLinear(r, H * (dn + dv), fp8=False)
        self.attention.wo = QLinear(H * dv, D, fp8=False)
        self.feed_forward = DenseFFN(D, p["hidden_dim"])
        for m in self.feed_forward.modules():
            if isinstance(m, QLinear):
                m.fp8 = False


class Markov(nn.Module):
    def __init__(self, V, D, r):
        super().__init__()
        self.embed = nn.Embedding(V, r)
        self.cell = nn.GRUCell(D + r, r)
        self.out = QLinear(r, V, fp8=False)


class DSparkDrafter(nn.Module):
    """MODEL.md section 5, as exported under `mtp_dspark.` (docs/MODEL-FORMAT.md section 4).

    Context: ctx = rms(fc(concat_l h_l), fc_norm), h_l the target's residual stream after layer
    l in target_layers; each draft layer computes K/V of ctx with its own wkv_a_with_mqa
    (kv_a_norm on the latent, rope at the context token's position), no attention_norm (ctx
    is normalised by fc_norm). Block: slot 0 = the target's embedding of the last accepted token
    at position P, slots j = 1..B-1 = mask_embed[j-1] at positions P+j; block queries attend,
    without a causal mask, to the context keys at positions [P - window, P) and to the block's
    own keys (from attention_norm of the block states). Output: norm, then the target's output
    head (base logits) plus the Markov bias: s_j = GRUCell([o_j ; markov.embed(t_{j-1})], s_{j-1}),
    s_0 = 0, t_0 the accepted token, t_{j-1} the token drafted at slot j-1; bias = markov.out(s_j).
    Slot j's logits predict the token at position P+j (j = 1..B-1: B-1 drafts per forward).
    """

    def __init__(self, p):
        super().__init__()
        mtp = p["mtp"]
        D = p["dim"]
        self.p = p
        self.B = mtp.get("block_size", 16)
        self.window = mtp.get("window", 2048)
        self.target_layers = list(mtp["target_layers"])
        self.fc = QLinear(D * len(self.target_layers), D, fp8=False)
        self.fc_norm = RMSNorm(D, p["norm_eps"])
        self.mask_embed = nn.Parameter(torch.randn(self.B - 1, D) * 0.02)
        self.layers = nn.ModuleList([DraftLayer(p) for _ in range(mtp["n_layers"])])
        self.norm = RMSNorm(D, p["norm_eps"])
        self.markov = Markov(p["vocab_size"], D, mtp.get("rnn_rank", 512))
        for name, prm in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(prm)
            elif "cell" in name or name == "mask_embed":
                continue
            else:
                nn.init.normal_(prm, std=0.02)
        nn.init.zeros_(self.markov.out.weight)

    def context(self, hidden):
        return self.fc_norm(self.fc(torch.cat([hidden[l] for l in self.target_layers], -1)))

    def forward(self, target, ctx, anchors, slot0, prev_tokens):
        """Block logits for a batch of anchors.

        target: the frozen Ml4Small (embeddings, rotary tables, output head, scale).
        ctx [B, T, D] context of every position of B sequences; anchors [B, A] positions P;
        slot0 [B, A] the token at P; prev_tokens [B, A, Bk-1] the tokens fed to the Markov head
        at slots 1..Bk-1 (t_0..t_{Bk-2}: teacher forcing, or the drafted ones).
        Returns logits [B, A, Bk-1, V] for slots 1..Bk-1.
        """
        Bs, T, D = ctx.shape
        A = anchors.shape[1]
        Bk = self.B
        m4 = target.m4
        H, dn, dr, dv, r = target.H, target.dn, target.dr, target.dv, target.r
        Tmax = T + Bk
        tb = target.tables(Tmax, ctx.device)
        cos, sin = tb["cos"], tb["sin"]
        emb0 = target.tok_embeddings(slot0)  # [B, A, D]
        h = torch.cat([emb0[:, :, None], self.mask_embed[None, None].expand(Bs, A, -1, -1).to(emb0.dtype)], 2)
        h = h.reshape(Bs, A * Bk, D)
        bpos = (anchors[:, :, None] + torch.arange(Bk, device=ctx.device)).reshape(Bs, A * Bk)  # [B, A*Bk]
        # key mask [B, A*Bk, T + A*Bk]: context keys s in [P - window, P); own block's keys
        ctx_pos = torch.arange(T, device=ctx.device)
        P = anchors[:, :, None, None].expand(Bs, A, Bk, 1).reshape(Bs, A * Bk, 1)
        m_ctx = (ctx_pos[None, None] < P) & (ctx_pos[None, None] >= P - self.window)
        blk = torch.arange(A, device=ctx.device).repeat_interleave(Bk)
        m_blk = (blk[:, None] == blk[None, :])[None].expand(Bs, -1, -1)
        mask = torch.cat([m_ctx, m_blk], -1)[:, None]  # [B, 1, Q, K]
        ccos, csin = cos[0, :T][None, None], sin[0, :T][None, None]
        bcos, bsin = cos[0][bpos][:, None], sin[0][bpos][:, None]
        for L in self.layers:
            At = L.attention
            a = L.attention_norm(h)
            q = At.wq(a).view(Bs, A * Bk, H, dn + dr).transpose(1, 2)
            q_nope, q_rope = torch.split(q, [dn, dr], -1)
            ck, ckr = torch.split(At.wkv_a_with_mqa(ctx), [r, dr], -1)
            bk, bkr = torch.split(At.wkv_a_with_mqa(a), [r, dr], -1)
            ck, bk = At.kv_a_norm(ck), At.kv_a_norm(bk)
            _, ckr = m4.apply_rotary_pos_emb_interleave(ckr[:, None], ckr[:, None], ccos.to(ckr.dtype)[0], csin.to(ckr.dtype)[0])
            q_rope, bkr = m4.apply_rotary_pos_emb_interleave(q_rope, bkr[:, None], bcos.to(q.dtype)[:, 0], bsin.to(q.dtype)[:, 0])
            c = torch.cat([ck, bk], 1)
            kr = torch.cat([ckr, bkr], 2)  # [B, 1, K, dr]
            kv = At.wkv_b(c).view(Bs, -1, H, dn + dv).transpose(1, 2)
            k_nope, v = torch.split(kv, [dn, dv], -1)
            k = torch.cat([k_nope, kr.expand(-1, H, -1, -1).to(k_nope.dtype)], -1)
            qf = torch.cat([q_nope, q_rope.to(q_nope.dtype)], -1)
            vp = F.pad(v, (0, qf.shape[-1] - dv))
            o = F.scaled_dot_product_attention(qf, k, vp, attn_mask=mask, scale=target.scale)[..., :dv]
            h = h + At.wo(o.transpose(1, 2).reshape(Bs, A * Bk, H * dv))
            h = h + L.feed_forward(L.ffn_norm(h))
        o = self.norm(h).view(Bs, A, Bk, D)[:, :, 1:]  # slots 1..Bk-1
        base = F.linear(o, target.output_weight().to(o.dtype))
        return base + self.markov_bias(o, prev_tokens)

    def markov_bias(self, o, prev_tokens):
        Bs, A, S, D = o.shape
        e = self.markov.embed(prev_tokens).to(o.dtype)  # [B, A, S, r]
        s = o.new_zeros(Bs * A, self.markov.cell.hidden_size, dtype=torch.float32)
        outs = []
        for j in range(S):
            inp = torch.cat([o[:, :, j], e[:, :, j]], -1).reshape(Bs * A, -1).float()
            s = self.markov.cell(inp, s)
            outs.append(s)
        st = torch.stack(outs, 1).view(Bs, A, S, -1)
        return self.markov.out(st.to(o.dtype))

    @torch.no_grad()
    def draft(self, target, ctx, anchors, slot0, greedy=True, generator=None):
        """Drafts Bk-1 tokens per anchor (the Markov head fed the drafted tokens).
        Returns (tokens [B, A, Bk-1], the drafter's distributions q [B, A, Bk-1, V])."""
        Bs, A = anchors.shape
        S = self.B - 1
        # base logits do not depend on the drafted tokens: one forward, then the Markov chain
        prev = torch.zeros(Bs, A, S, dtype=torch.long, device=ctx.device)
        prev[:, :, 0] = slot0
        toks = torch.zeros_like(prev)
        qs = []
        # the block's own attention does not see drafted tokens, so o is fixed; recompute the bias step by step
        o, base = self._block_outputs(target, ctx, anchors, slot0)
        s = o.new_zeros(Bs * A, self.markov.cell.hidden_size, dtype=torch.float32)
        for j in range(S):
            e = self.markov.embed(prev[:, :, j]).to(o.dtype)
            s = self.markov.cell(torch.cat([o[:, :, j], e], -1).reshape(Bs * A, -1).float(), s)
            lg = base[:, :, j] + self.markov.out(s.to(o.dtype)).view(Bs, A, -1)
            pr = lg.float().softmax(-1)
            t = pr.argmax(-1) if greedy else torch.multinomial(pr.view(-1, pr.shape[-1]), 1, generator=generator).view(Bs, A)
            toks[:, :, j] = t
            if j + 1 < S:
                prev[:, :, j + 1] = t
            qs.append(pr)
        return toks, torch.stack(qs, 2)

    def _block_outputs(self, target, ctx, anchors, slot0):
        captured = {}
        orig = self.markov_bias

        def grab(o, prev_tokens):
            captured["o"] = o
            return torch.zeros((), dtype=o.dtype, device=o.device)

        self.markov_bias = grab
        try:
            base = self.forward(target, ctx, anchors, slot0, None)
        finally:
            self.markov_bias = orig
        return captured["o"], base
