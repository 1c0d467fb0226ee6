"""Numeric helpers shared by the golden references: the cache and indexer emulation.

ml4 stores attention state in a paged KV cache and reads it back before attending (MODEL.md
section 3, src/runtime/cpu_attention.cpp). Two of those stores round values, and the
references can reproduce both exactly so that CI compares against f32-level tolerances
instead of cache-rounding ones:

* the BF16 latent cache (`--kv-cache-dtype bf16`): every latent row `c` (after kv_a_norm)
  and rotated `kr` is rounded to bf16, round-to-nearest-even (`bf16_round`);
* the indexer path of DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp inference/model.py,
  `Indexer.forward`): q and k pass a Hadamard transform (scale d^-0.5, Sylvester order,
  `rotate_activation`) and are quantized to FP8 e4m3 with one fp32 scale per 128 values
  (`act_quant`: s = max(amax, 1e-4) / 448). ml4 does the same (MODEL.md 3.5);
  transformers' deepseek_v32 skips both ("FP8 quantization is a precision optimization"),
  see `indexer_scores` and docs/ARCHITECTURE.md.

FP8 emulation runs in float32 exactly as ml4's C++ does (amax, scale and x / s in f32,
RNE to e4m3 through torch's float8_e4m3fn cast), so that both sides round the same
inputs the same way; the rest of the reference runs in float64.
"""

import math

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (RNE) and returned in x's dtype."""
    return x.to(torch.bfloat16).to(x.dtype)


def fp8_group_roundtrip(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """DeepSeek act_quant followed by dequantization, per `group` values of the last dim.

    Mirrors ml4 cpu::quantize_fp8_groups / dequantize_fp8_groups (and the indexer cache
    write in src/kv/indexer_layout.cpp): f32 amax, s = max(amax, 1e-4) / 448 in f32,
    e4m3(x / s) * s.
    """
    shape, dtype = x.shape, x.dtype
    d = shape[-1]
    assert d % group == 0, f"last dim {d} is not a multiple of {group}"
    xf = x.to(torch.float32).reshape(-1, d // group, group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = torch.clamp(amax, min=AMAX_FLOOR) / torch.tensor(E4M3_MAX, dtype=torch.float32)
    q = torch.clamp(xf / s, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * s).reshape(shape).to(dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H_n * n^-0.5 on the last dim, H_n in Sylvester order (scipy.linalg.hadamard)."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"Hadamard size {n} is not a power of two"
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x.to(torch.float64) @ h * (1.0 / math.sqrt(n))).to(x.dtype)


def select_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int):
    """Top-k of causal indexer scores, ties to the lower key index (as ml4 cpu::topk).

    scores [S, T] (query rows, key columns), positions [S] absolute positions of the
    rows; keys t > position are not visible. Returns (selection [S, min(topk, T)] int64
    where slots past a row's min(topk, p+1) visible keys point at masked keys, and the
    masked scores [S, T] with -inf at invisible keys).
    """
    S, T = scores.shape
    keys = torch.arange(T, device=scores.device)
    visible = keys[None, :] <= positions[:, None]
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(-masked, dim=-1, stable=True).indices  # stable: lower index first on ties
    return order[:, : min(topk, T)], masked


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, fp8: bool) -> torch.Tensor:
    """score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t]) (DSA lightning indexer).

    q [S, H, D] and k [T, D] after rotary; w [S, H] already scaled by H^-0.5 * D^-0.5.
    fp8=True applies the DeepSeek path first (Hadamard, then FP8 per 128 on q and k;
    relu(sq * q.k) = sq * relu(q.k) for sq > 0, so scoring dequantized values equals
    DeepSeek's fp8_index). fp8=False is transformers' deepseek_v32 math.
    """
    if fp8:
        q = fp8_group_roundtrip(hadamard(q.to(torch.float32)).to(q.dtype))
        k = fp8_group_roundtrip(hadamard(k.to(torch.float32)).to(k.dtype))
    dots = torch.einsum("shd,td->sht", q.to(torch.float64), k.to(torch.float64))
    return torch.einsum("sh,sht->st", w.to(torch.float64), torch.relu(dots))


def attach_route_hooks(gates: dict, store: dict):
    """Records each MoE router's chosen experts (sorted) per layer into store[layer].

    gates: layer -> a transformers TopkRouter (Mistral4TopkRouter, DeepseekV32TopkRouter),
    whose forward returns (router_logits, topk_weights, topk_indices). Returns the hook
    handles.
    """
    def hook(layer):
        def f(module, inputs, out):
            store[layer] = out[2].sort(-1).values.clone()
        return f
    return [g.register_forward_hook(hook(l)) for l, g in gates.items()]
