"""A PyTorch reference of MODEL.md section 3 (ML4), built on transformers' modules.

transformers has no ML4 model: KV sharing, NoPE layers, SSMax, LeRoPE and indexer reuse
are ML4's own (MODEL.md section 1). This file assembles one from transformers 5.17 parts,
reading a Mistral-native checkpoint (params.json + consolidated.safetensors) as
`ml4 make-model` writes it:

  Mistral4RMSNorm, Mistral4MLP (dense layer, shared expert), Mistral4MoE (softmax router
  with groups, renormalisation, routed_scaling_factor; fused Mistral4Experts),
  Mistral4RotaryEmbedding (YaRN inverse frequencies and cos/sin factor),
  apply_rotary_pos_emb_interleave (MLA rope), get_llama_4_attn_scale and yarn_apply_mscale
  (query temperature and softmax scale) from models/mistral4; DeepseekV32Indexer's
  parameters (wq_b, wk, k_norm LayerNorm, weights_proj) and its NeoX rope from
  models/deepseek_v32.

What is written here (MODEL.md section 3, step by step), in float64, unabsorbed MLA
(k_nope / v from wkv_b, as transformers does; ml4 uses the absorbed form, MODEL.md 3.6
says they must agree):

  * the layer spec from params.json: NoPE every `nope_layer_interval`-th layer (or
    `nope_layers`), `kv_sharing` {source: consumers}, `indexer.reuse` {layer: source},
    `ssmax.layers`, dense layers below `moe.first_k_dense_replace`;
  * LeRoPE: positions p' = p below the window, window + (p - window) / leak beyond, fed
    to the rotary embedding as (fractional) positions; NoPE layers rotate nothing, their
    indexer neither;
  * the indexer of owning layers (q from the attention input: ML4 has no query LoRA),
    scored the DeepSeek way (numerics.indexer_scores, fp8 per `fp8_indexer`), top-k of
    min(topk, p+1) with ties to the lower index; reusers take their source's selection;
  * KV consumers attend over their source layer's (c, kr) with their own wq / wkv_b / wo;
  * llama4 temperature on q, SSMax: logits of head h times s_h * log(n), n the number of
    keys the softmax covers.

`bf16_cache=True` rounds every stored latent row (c, rotated kr) to bf16 as ml4's bf16
KV cache does (numerics.py).
"""

import json
import math
import os

import torch
from torch import nn

from numerics import attach_route_hooks, bf16_round, indexer_scores, select_topk


def _tf():
    from transformers import DeepseekV32Config, Mistral4Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds
    from transformers.models.mistral4 import modeling_mistral4 as m4

    return Mistral4Config, DeepseekV32Config, m4, ds


def rope_parameters(p: dict) -> dict:
    """transformers' rope_parameters for params.json's rope_theta / yarn (Mistral4Config)."""
    yarn = p.get("yarn")
    rope_params = {"rope_type": "default", "rope_theta": float(p["rope_theta"])}
    if yarn:
        mscale_all_dim = float(yarn.get("mscale_all_dim", 1.0))
        mscale = float(yarn.get("mscale", 1.0))
        if not yarn.get("apply_scale", True):
            mscale = mscale_all_dim  # no cos/sin magnitude, softmax mscale^2 stays (config_loader.cpp)
        rope_params = {"rope_type": "yarn", "rope_theta": float(p["rope_theta"]), "factor": float(yarn["factor"]),
                       "original_max_position_embeddings": int(yarn["original_max_position_embeddings"]),
                       "beta_fast": float(yarn.get("beta", 32.0)), "beta_slow": float(yarn.get("alpha", 1.0)),
                       "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    return rope_params


def mistral4_config(p: dict):
    """(Mistral4Config, rope_parameters) of an ML4 params.json without query LoRA.

    Shared by Ml4Reference and tools/train (the training model takes its rotary tables and
    softmax scale from the same transformers objects).
    """
    Mistral4Config, _, _, _ = _tf()
    moe = p.get("moe", {})
    rope_params = rope_parameters(p)
    dn, dr = p["qk_nope_head_dim"], p["qk_rope_head_dim"]
    cfg = Mistral4Config(
        vocab_size=p["vocab_size"], hidden_size=p["dim"], intermediate_size=p["hidden_dim"],
        moe_intermediate_size=moe.get("expert_hidden_dim", 1), num_hidden_layers=p["n_layers"],
        num_attention_heads=p["n_heads"], num_key_value_heads=p["n_heads"], n_shared_experts=moe.get("num_shared_experts", 0),
        n_routed_experts=moe.get("num_experts", 1), routed_scaling_factor=float(moe.get("routed_scale", 1.0)),
        kv_lora_rank=p["kv_lora_rank"], q_lora_rank=None, qk_rope_head_dim=dr, v_head_dim=p["v_head_dim"],
        qk_nope_head_dim=dn, n_group=moe.get("num_expert_groups", 1),
        topk_group=moe.get("num_expert_groups_per_tok", 1), num_experts_per_tok=moe.get("num_experts_per_tok", 1),
        first_k_dense_replace=moe.get("first_k_dense_replace", 0), norm_topk_prob=moe.get("norm_topk_prob", True),
        rms_norm_eps=p["norm_eps"], max_position_embeddings=p["max_position_embeddings"],
        rope_parameters=dict(rope_params, partial_rotary_factor=dr / (dn + dr)),
    )
    return cfg, rope_params


def indexer_rotary_config(p: dict):
    """The Mistral4Config whose rotary embedding is the indexer's: ix rope_head_dim dims with
    the same theta / YaRN (ml4: one inverse-frequency table per rope width, CpuModel)."""
    Mistral4Config, _, _, _ = _tf()
    ix = p["indexer"]
    ixr, ixd = ix["rope_head_dim"], ix["head_dim"]
    return Mistral4Config(hidden_size=p["dim"], num_attention_heads=p["n_heads"], num_key_value_heads=p["n_heads"],
                          q_lora_rank=None, kv_lora_rank=p["kv_lora_rank"], qk_rope_head_dim=ixr,
                          qk_nope_head_dim=ixd - ixr, v_head_dim=p["v_head_dim"],
                          max_position_embeddings=p["max_position_embeddings"],
                          rope_parameters=dict(rope_parameters(p), partial_rotary_factor=ixr / ixd))


def dequantize_fp8_blocks(t: dict) -> dict:
    """FP8 128x128 block weights (docs/MODEL-FORMAT.md section 3) -> float32, scales dropped.

    `X.weight` e4m3 [N, K] with `X.weight_scale_inv` f32 [ceil(N/128), ceil(K/128)], a
    multiplier (DeepSeek layout): each value is e4m3 * its block's scale, rounded once to f32
    as ml4's decode_weight_rows does.
    """
    out = {}
    for k, v in t.items():
        if k.endswith(".weight_scale_inv"):
            continue
        s = t.get(k[: -len(".weight")] + ".weight_scale_inv") if k.endswith(".weight") else None
        if s is not None:
            N, K = v.shape
            full = s.to(torch.float32).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
            v = v.to(torch.float32) * full
        out[k] = v
    return out


class LayerSpec:
    def __init__(self, index):
        self.index = index
        self.rope = True
        self.ssmax = False
        self.kv_source = index
        self.indexer = "none"  # none | owner | reuser
        self.indexer_source = -1
        self.dense = False


def layer_specs(p: dict):
    n = p["n_layers"]
    specs = [LayerSpec(i) for i in range(n)]
    if "nope_layer_interval" in p:
        k = p["nope_layer_interval"]
        for i in range(n):
            if i % k == k - 1:
                specs[i].rope = False
    for i in p.get("nope_layers", []):
        specs[i].rope = False
    for i in p.get("ssmax", {}).get("layers", []):
        specs[i].ssmax = True
    for src, consumers in p.get("kv_sharing", {}).items():
        for c in consumers:
            specs[c].kv_source = int(src)
    if "indexer" in p:
        reuse = {int(k): int(v) for k, v in p["indexer"].get("reuse", {}).items()}
        for s in specs:
            if s.index in reuse:
                s.indexer, s.indexer_source = "reuser", reuse[s.index]
            else:
                s.indexer, s.indexer_source = "owner", s.index
    first_dense = p.get("moe", {}).get("first_k_dense_replace", n if "moe" not in p else 0)
    for s in specs:
        s.dense = s.index < first_dense
    return specs


def lerope_positions(positions: torch.Tensor, p: dict) -> torch.Tensor:
    pos = positions.to(torch.float64)
    le = p.get("lerope")
    if not le:
        return pos
    w, leak = float(le["window"]), float(le["leak"])
    return torch.where(pos < w, pos, w + (pos - w) / leak)


class Ml4Reference(nn.Module):
    def __init__(self, model_dir: str, bf16_cache: bool = True, fp8_indexer: bool = True):
        super().__init__()
        from safetensors.torch import load_file

        Mistral4Config, DeepseekV32Config, m4, ds = _tf()
        self.m4, self.ds = m4, ds
        with open(os.path.join(model_dir, "params.json")) as f:
            p = json.load(f)
        self.p = p
        self.bf16_cache, self.fp8_indexer = bf16_cache, fp8_indexer
        self.specs = layer_specs(p)
        if p.get("q_lora_rank"):
            raise NotImplementedError("the ML4 reference covers wq (no query LoRA), as ML4 has")
        D, H = p["dim"], p["n_heads"]
        self.H, self.dn, self.dr, self.dv, self.r = H, p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"], p["kv_lora_rank"]
        moe = p.get("moe", {})
        self.cfg, rope_params = mistral4_config(p)
        qk = self.dn + self.dr
        self.rotary = m4.Mistral4RotaryEmbedding(self.cfg)
        assert self.rotary.inv_freq.numel() * 2 == self.dr, "MLA rotary width"
        self.scale = m4.yarn_apply_mscale(self.cfg.rope_parameters, qk**-0.5)
        l4 = p.get("llama_4_scaling")
        self.l4 = (float(l4["beta"]), int(l4["original_max_position_embeddings"])) if l4 else None

        ix = p.get("indexer")
        self.ix_rotary = None
        if ix:
            self.topk = ix["topk"]
            self.ix_cfg = DeepseekV32Config(
                hidden_size=D, q_lora_rank=D, index_n_heads=ix["n_heads"], index_head_dim=ix["head_dim"],
                index_topk=ix["topk"], qk_rope_head_dim=ix["rope_head_dim"], num_hidden_layers=1,
                num_attention_heads=H, qk_nope_head_dim=self.dn, kv_lora_rank=self.r, v_head_dim=self.dv,
                vocab_size=p["vocab_size"], rope_parameters=dict(rope_params),
            )
            # The indexer rotates ix rope_head_dim dims with the same theta / YaRN (ml4: one
            # inverse-frequency table per rope width, CpuModel).
            ixr = ix["rope_head_dim"]
            rc = indexer_rotary_config(p)
            self.ix_rotary = m4.Mistral4RotaryEmbedding(rc)
            assert self.ix_rotary.inv_freq.numel() * 2 == ixr, "indexer rotary width"

        t = dequantize_fp8_blocks(load_file(os.path.join(model_dir, "consolidated.safetensors")))
        t = {k: v.to(torch.float64) for k, v in t.items()}
        used = set()

        def take(name):
            used.add(name)
            return t[name]

        def linear(name, bias=False):
            w = take(name)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
            lin.weight.data.copy_(w)
            return lin

        def rms(name, dim, eps=p["norm_eps"]):
            n = m4.Mistral4RMSNorm(dim, eps=eps).to(torch.float64)
            n.weight.data.copy_(take(name))
            return n

        def mlp(prefix, inter):
            m = m4.Mistral4MLP(self.cfg, intermediate_size=inter).to(torch.float64)
            m.gate_proj.weight.data.copy_(take(prefix + "w1.weight"))
            m.down_proj.weight.data.copy_(take(prefix + "w2.weight"))
            m.up_proj.weight.data.copy_(take(prefix + "w3.weight"))
            return m

        self.embed = take("tok_embeddings.weight")
        self.norm = rms("norm.weight", D)
        if p.get("tied_embeddings"):
            self.output = nn.Linear(D, p["vocab_size"], bias=False, dtype=torch.float64)
            self.output.weight.data.copy_(self.embed)
        else:
            self.output = linear("output.weight")
        self.layers = nn.ModuleList()
        for s in self.specs:
            pre = f"layers.{s.index}."
            L = nn.Module()
            L.attention_norm = rms(pre + "attention_norm.weight", D)
            L.ffn_norm = rms(pre + "ffn_norm.weight", D)
            L.wq = linear(pre + "attention.wq.weight")
            L.wkv_b = linear(pre + "attention.wkv_b.weight")
            L.wo = linear(pre + "attention.wo.weight")
            if s.kv_source == s.index:
                L.wkv_a = linear(pre + "attention.wkv_a_with_mqa.weight")
                L.kv_a_norm = rms(pre + "attention.kv_a_norm.weight", self.r)
            if s.ssmax:
                L.ssmax_s = take(pre + "attention.ssmax_s")
            if s.indexer == "owner":
                ixm = ds.DeepseekV32Indexer(self.ix_cfg, s.index).to(torch.float64)
                ixm.wq_b.weight.data.copy_(take(pre + "attention.indexer.wq.weight"))
                ixm.wk.weight.data.copy_(take(pre + "attention.indexer.wk.weight"))
                ixm.k_norm.weight.data.copy_(take(pre + "attention.indexer.k_norm.weight"))
                ixm.k_norm.bias.data.copy_(take(pre + "attention.indexer.k_norm.bias"))
                ixm.weights_proj.weight.data.copy_(take(pre + "attention.indexer.weights_proj.weight"))
                L.indexer = ixm
            if s.dense:
                L.ffn = mlp(pre + "feed_forward.", p["hidden_dim"])
            else:
                E, I = moe["num_experts"], moe["expert_hidden_dim"]
                ffn = m4.Mistral4MoE(self.cfg).to(torch.float64)
                ffn.gate.weight.data.copy_(take(pre + "gate.weight"))
                gate_up = torch.stack([torch.cat([take(f"{pre}experts.{e}.w1.weight"), take(f"{pre}experts.{e}.w3.weight")], 0)
                                       for e in range(E)])
                down = torch.stack([take(f"{pre}experts.{e}.w2.weight") for e in range(E)])
                ffn.experts.gate_up_proj.data.copy_(gate_up)
                ffn.experts.down_proj.data.copy_(down)
                sh = ffn.shared_experts
                sh.gate_proj.weight.data.copy_(take(pre + "shared_experts.w1.weight"))
                sh.down_proj.weight.data.copy_(take(pre + "shared_experts.w2.weight"))
                sh.up_proj.weight.data.copy_(take(pre + "shared_experts.w3.weight"))
                L.ffn = ffn
            self.layers.append(L)
        left = sorted(k for k in t if k not in used and not k.startswith("mtp_dspark."))
        if left:
            raise RuntimeError(f"checkpoint tensors the reference does not use: {left}")
        self.record = {}
        self.routes = {}
        attach_route_hooks({s.index: L.ffn.gate for s, L in zip(self.specs, self.layers) if not s.dense}, self.routes)

    def _cos_sin(self, rotary, x, pos):
        cos, sin = rotary(x, pos[None, :])  # f32 cos/sin (transformers forces fp32), cast to x's dtype
        return cos, sin

    @torch.no_grad()
    def logits(self, tokens):
        """Logits [len, vocab] (f64) of one sequence, all positions."""
        m4 = self.m4
        self.record = {}
        self.routes.clear()
        T = len(tokens)
        positions = torch.arange(T)
        pp = lerope_positions(positions, self.p)
        x = self.embed[torch.tensor(tokens)][None]  # [1, T, D]
        cos, sin = self._cos_sin(self.rotary, x, pp)
        ix_cs = self._cos_sin(self.ix_rotary, x, pp) if self.ix_rotary is not None else None
        H, dn, dr, dv, r = self.H, self.dn, self.dr, self.dv, self.r
        causal = positions[None, :] <= positions[:, None]  # [T(query), T(key)]
        latent = {}  # owning layer -> (c [T, r], kr [T, dr])
        selection = {}  # indexer-owning layer -> selection mask [T, T]
        temp = torch.ones(T, dtype=torch.float64)
        if self.l4:
            temp = m4.get_llama_4_attn_scale(positions[None].to(torch.float64), self.l4[0], self.l4[1])[0, 0, :, 0]
        for s, L in zip(self.specs, self.layers):
            a = L.attention_norm(x)
            q = L.wq(a).view(1, T, H, dn + dr).transpose(1, 2)  # [1, H, T, dn+dr]
            q_nope, q_rope = torch.split(q, [dn, dr], dim=-1)
            if s.kv_source == s.index:
                ckv = L.wkv_a(a)
                c, kr = torch.split(ckv, [r, dr], dim=-1)
                c = L.kv_a_norm(c)
                kr = kr.view(1, 1, T, dr)
                if s.rope:
                    q_rope, kr = m4.apply_rotary_pos_emb_interleave(q_rope, kr, cos, sin)
                if self.bf16_cache:
                    c, kr = bf16_round(c), bf16_round(kr)
                latent[s.index] = (c[0], kr[0, 0])
            elif s.rope:
                dummy = torch.zeros(1, 1, T, dr, dtype=q.dtype)
                q_rope, _ = m4.apply_rotary_pos_emb_interleave(q_rope, dummy, cos, sin)
            c, kr = latent[s.kv_source]
            # Sparse selection (MODEL.md 3.5).
            allowed = causal
            n_keys = positions.to(torch.float64) + 1
            if s.indexer == "owner":
                allowed = self._indexer(s, L.indexer, a, ix_cs, positions)
                selection[s.index] = allowed
            elif s.indexer == "reuser":
                allowed = selection[s.indexer_source]
                self.record[s.index] = self.record[s.indexer_source]
            if s.indexer != "none":
                n_keys = torch.clamp(n_keys, max=float(self.topk))
            # Unabsorbed MLA: k_nope / v per head from the latent.
            kv = L.wkv_b(c).view(T, H, dn + dv).transpose(0, 1)  # [H, T, dn+dv]
            k_nope, v = torch.split(kv, [dn, dv], dim=-1)
            logit = (q_nope[0] @ k_nope.transpose(1, 2) + q_rope[0] @ kr.T[None]) * self.scale  # [H, Tq, Tk]
            logit = logit * temp[None, :, None]
            if s.ssmax:
                logit = logit * (L.ssmax_s[:, None, None] * torch.log(n_keys)[None, :, None])
            logit = logit.masked_fill(~allowed[None], float("-inf"))
            o = torch.softmax(logit, dim=-1) @ v  # [H, T, dv]
            x = x + L.wo(o.transpose(0, 1).reshape(1, T, H * dv))
            x = x + L.ffn(L.ffn_norm(x))
        return self.output(self.norm(x))[0]

    def _indexer(self, s, ix, a, ix_cs, positions):
        """Selection mask [T, T] of an indexer-owning layer; records (selection, scores)."""
        ds = self.ds
        T = a.shape[1]
        q = ix.wq_b(a).view(1, T, ix.n_heads, ix.head_dim)
        q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        k = ix.k_norm(ix.wk(a)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
        if s.rope:
            q_rot, k_rot = ds.apply_rotary_pos_emb(q_rot, k_rot, ix_cs[0], ix_cs[1], unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)[0]
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)[0]
        w = ix.weights_proj(a)[0] * (ix.n_heads**-0.5) * ix.softmax_scale
        scores = indexer_scores(q, k, w, fp8=self.fp8_indexer)
        sel, masked = select_topk(scores, positions, ix.index_topk)
        self.record[s.index] = (sel, masked)
        allowed = torch.zeros(T, T, dtype=torch.bool)
        for t in range(T):
            n = min(ix.index_topk, t + 1)
            allowed[t, sel[t, :n]] = True
        return allowed

    def sparse_layers(self):
        return [s.index for s in self.specs if s.indexer != "none"]

    def topk_value(self):
        return self.topk if self.ix_rotary is not None else 0
