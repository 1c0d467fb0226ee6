#!/usr/bin/env python3
"""PyTorch peer for the ml4-slice-4 decode-step benchmark (issue 6).

Design
------
The peer is the same 4-layer slice of ML4 (MODEL.md sections 2-3, `ml4_params` in
src/model/presets.cpp) built from transformers' own `deepseek_v32` classes, so the ratio
reported next to `bench/decode_step_bench.cu` compares our engine with the stock PyTorch
implementation of the same architecture on the same GPU:

* dim 6144, 64 heads, MLA kv_lora 512 / rope 64 / nope 128 / v 128, layer 0 dense SwiGLU
  16384, layers 1-3 MoE (128 experts, top-4, one shared expert, expert hidden 5632), DSA
  indexer 32 heads x 128, top-k 2048, vocab 131072, untied lm_head; bf16 weights.
* ML4 has no query LoRA (q = wq(a), indexer qI = indexer.wq(a)), but transformers'
  DeepseekV32Attention always runs `q_b_proj(q_a_layernorm(q_a_proj(x)))` and feeds the
  indexer that latent. Setting q_lora_rank = dim and replacing q_a_proj / q_a_layernorm with
  nn.Identity gives exactly ML4's shapes: q_b_proj is wq [6144 -> 64*192] and indexer.wq_b is
  indexer.wq [6144 -> 32*128].
* Left out (small elementwise work, no effect on the byte/flop budget): LeRoPE, llama-4 query
  scaling, SSMax, NoPE on layer 3, indexer reuse (transformers runs the indexer in every
  layer), the softmax router (transformers uses DeepSeek's sigmoid router; 1 group).
* Weights are random (N(0, 0.02), norms 1), allocated on the meta device and materialised
  straight on the GPU with `to_empty`, so no slow init pass and no host copy.
* Decode: a StaticCache (transformers' StaticIndexedLayer: per-head K [B,64,T,192], V
  [B,64,T,128] and indexer keys [B,T,128], all bf16 -- transformers caches the expanded K/V,
  not MLA's latent) of max_cache_len = ctx + 1, pre-filled with random values and its length
  counters set to ctx; the step is one new token per sequence through the whole model incl.
  lm_head. The counters are reset to ctx inside the step so every replay writes the same slot.
  The step is captured in a torch.cuda.CUDAGraph when capture works (else eager), timed with
  CUDA events: warm-up 3, timed 10, median. Eager time is reported beside the graph time.
* Configs whose KV cache does not fit in free memory are skipped with the reason printed.
  After timing, one replay's logits are compared with one eager step's (graph_vs_eager).
* Prefill: one sequence of 4096 and of 8192 tokens, eager, DynamicCache, logits of the last
  token only (as generate does); warm-up 3, timed 10, median.

Output: `PEER ...`, `PEER_SKIP ...`, `PEER_PREFILL ...` lines and $OUT/peer.json (or --out).
`--tiny` runs a toy config on CPU to check the plumbing.
"""

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn as nn
import transformers
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.cache_utils import StaticCache

MODEL_NAME = "deepseek_v32"


def slice_config(tiny: bool) -> DeepseekV32Config:
    """The ml4-slice-4 shapes (or a toy with the same structure) as a DeepseekV32Config."""
    max_pos = 4096 if tiny else 1048576  # = factor * original length, as YaRN expects
    if tiny:
        dims = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                    num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                    v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4,
                    index_head_dim=64, index_topk=16, orig_len=1024, yarn_factor=4.0)
    else:
        dims = dict(vocab_size=131072, hidden_size=6144, intermediate_size=16384, moe_intermediate_size=5632,
                    num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128, n_routed_experts=128, num_experts_per_tok=4, index_n_heads=32,
                    index_head_dim=128, index_topk=2048, orig_len=8192, yarn_factor=128.0)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": dims.pop("yarn_factor"),
            "original_max_position_embeddings": dims.pop("orig_len"), "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    return DeepseekV32Config(
        num_hidden_layers=4,
        num_key_value_heads=dims["num_attention_heads"],
        q_lora_rank=dims["hidden_size"],  # replaced by identities below: plain wq as in ML4
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters=rope,
        **dims,
    )


@torch.no_grad()
def build_model(cfg: DeepseekV32Config, device: torch.device) -> DeepseekV32ForCausalLM:
    """Builds the model on the meta device, drops the query LoRA, materialises it on `device`."""
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM._from_config(
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa", experts_implementation="grouped_mm")
    for layer in model.model.layers:
        layer.self_attn.q_a_proj = nn.Identity()
        layer.self_attn.q_a_layernorm = nn.Identity()
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1234)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or "k_norm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    # ML4 (as DeepSeek-V3.2) keeps the indexer head weights and the router bias in fp32.
    for layer in model.model.layers:
        layer.self_attn.indexer.weights_proj.float()
        mlp = layer.mlp
        if hasattr(mlp, "gate"):
            mlp.gate.e_score_correction_bias.data = torch.zeros(
                cfg.n_routed_experts, dtype=torch.float32, device=device)
    # to_empty left the rotary buffers uninitialised: rebuild them.
    rot = model.model.rotary_emb
    fresh = type(rot)(config=cfg)
    rot.inv_freq = fresh.inv_freq.to(device)
    rot.original_inv_freq = fresh.original_inv_freq.to(device)
    rot.attention_scaling = fresh.attention_scaling
    model.eval()
    return model


def tensor_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(cfg: DeepseekV32Config) -> int:
    """Per token, all layers: expanded K and V per head plus the indexer key, bf16."""
    per_layer = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    per_layer += cfg.index_head_dim
    return per_layer * 2 * cfg.num_hidden_layers


def scratch_bytes(cfg: DeepseekV32Config, batch: int, tlen: int) -> int:
    """Rough upper bound of one decode step's temporaries: the indexer's fp32 copy of its keys
    and per-head scores, index scores, masks, the attention's fp32 logits (math SDPA)."""
    per_tok = cfg.index_head_dim * 4 + cfg.index_n_heads * 4 * 2 + 8 + cfg.num_attention_heads * 4 * 3 + 16
    return batch * tlen * per_tok + (2 << 30)


@torch.no_grad()
def make_cache(model, cfg, batch: int, ctx: int, device, gen) -> StaticCache:
    """A StaticCache of ctx+1 slots per sequence, the first ctx filled with random K/V."""
    cache = StaticCache(config=cfg, max_cache_len=ctx + 1)
    H = cfg.num_attention_heads
    dk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    k0 = torch.empty(batch, H, 1, dk, dtype=torch.bfloat16, device=device)
    v0 = torch.empty(batch, H, 1, cfg.v_head_dim, dtype=torch.bfloat16, device=device)
    i0 = torch.empty(batch, 1, cfg.index_head_dim, dtype=torch.bfloat16, device=device)
    for layer in cache.layers:
        layer.lazy_initialization(k0, v0)
        layer.lazy_initialization_indexer(i0)
        layer.keys.normal_(generator=gen)
        layer.values.normal_(generator=gen)
        layer.indexer_keys.normal_(generator=gen)
        layer.cumulative_length.fill_(ctx)
        layer.indexer_cumulative_length.fill_(ctx)
    return cache


class Timer:
    """CUDA events on a GPU, perf_counter on the CPU; returns milliseconds."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn) -> float:
        if self.cuda:
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def median_ms(timer: Timer, fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    if timer.cuda:
        torch.cuda.synchronize()
    return statistics.median(timer.time(fn) for _ in range(iters))


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_config(model, cfg, batch, ctx, device, args, state, gen):
    """Measures one (batch, ctx) decode step; returns the result dict."""
    timer = Timer(device)
    cache = make_cache(model, cfg, batch, ctx, device, gen)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device, generator=gen)
    pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)
    out = {}

    def step():
        for layer in cache.layers:  # every call writes slot ctx (graph replays included)
            layer.cumulative_length.fill_(ctx)
            layer.indexer_cumulative_length.fill_(ctx)
        out["logits"] = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits

    res = {"model": MODEL_NAME, "batch": batch, "ctx": ctx}
    if device.type == "cuda" and not args.no_graphs and state.get("graphs_ok", True):
        # Warm up on a side stream (as torch.cuda.graphs asks), then capture.
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(args.warmup):
                step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        res["eager_ms"] = round(median_ms(timer, step, 0, args.iters), 3)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                step()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- any capture failure means: stay eager
            state["graphs_ok"] = False
            state["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"# CUDA graph capture failed, eager from now on: {state['graph_error']}", flush=True)
            graph = None
            torch.cuda.synchronize()
        if graph is not None:
            graph_logits = out["logits"]  # the graph's static output
            res["ms"] = round(median_ms(timer, graph.replay, args.warmup, args.iters), 3)
            res["graphs"] = 1
            # The replay must compute what the eager step computes (same inputs, same cache slot).
            g = graph_logits.float().clone()
            step()
            e = out["logits"].float()
            res["graph_vs_eager"] = float(f"{float((g - e).norm() / e.norm()):.2e}")
            del graph, graph_logits, g, e
        else:
            res["ms"] = res["eager_ms"]
            res["graphs"] = 0
    else:
        res["ms"] = round(median_ms(timer, step, args.warmup, args.iters), 3)
        res["eager_ms"] = res["ms"]
        res["graphs"] = 0
    res["logits_finite"] = bool(torch.isfinite(out["logits"].float()).all().item())
    del out, cache
    return res


def prefill(model, cfg, tokens, device, args, gen):
    timer = Timer(device)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=device, generator=gen)

    def run():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    ms = median_ms(timer, run, args.prefill_warmup, args.prefill_iters)
    return {"model": MODEL_NAME, "tokens": tokens, "ms": round(ms, 2), "tok_s": round(tokens / ms * 1e3, 1)}


@torch.no_grad()
def check_decode(model, cfg, device, ctx: int = 48, batch: int = 2) -> float:
    """The benchmarked step is the model's real decode: a static cache filled by a prefill of
    ctx tokens, then `step`'s counter reset and one token at position ctx, must give the
    logits of a plain forward over ctx+1 tokens (fp32, so top-k ties cannot differ)."""
    model = model.float()
    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), device=device, generator=gen)
    ref = model(input_ids=ids, use_cache=False).logits[:, -1].double()
    cache = StaticCache(config=cfg, max_cache_len=ctx + 1)
    model(input_ids=ids[:, :ctx], past_key_values=cache, use_cache=True)
    for layer in cache.layers:
        layer.cumulative_length.fill_(ctx)
        layer.indexer_cumulative_length.fill_(ctx)
    pos = torch.full((batch, 1), ctx, dtype=torch.long, device=device)
    got = model(input_ids=ids[:, ctx:], position_ids=pos, past_key_values=cache, use_cache=True).logits[:, -1]
    return float((got.double() - ref).norm() / ref.norm())


def fmt(prefix, d):
    return prefix + " " + " ".join(f"{k}={v}" for k, v in d.items())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy config on CPU (plumbing check)")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,32,64; tiny 1,2)")
    ap.add_argument("--ctx", default=None, help="comma list (default 8192,61440; tiny 64,256)")
    ap.add_argument("--prefill", default=None, help="comma list (default 4096,8192; tiny 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--prefill-warmup", type=int, default=3)
    ap.add_argument("--prefill-iters", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="with --tiny: decode step == full forward, then exit")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--time-budget", type=float, default=210.0, help="seconds; later configs are skipped")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for peer.json (default $OUT)")
    args = ap.parse_args()
    t_start = time.time()

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    batches = [int(x) for x in (args.batches or ("1,2" if args.tiny else "1,8,32,64")).split(",")]
    ctxs = [int(x) for x in (args.ctx or ("64,256" if args.tiny else "8192,61440")).split(",")]
    pre = [int(x) for x in (args.prefill or ("64" if args.tiny else "4096,8192")).split(",") if x]

    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu"
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": gpu,
            "cuda": torch.version.cuda, "python": platform.python_version()}
    print(fmt("PEER_ENV", {k: str(v).replace(" ", "_") for k, v in info.items()}), flush=True)

    cfg = slice_config(args.tiny)
    t0 = time.time()
    model = build_model(cfg, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.time() - t0
    wbytes = tensor_bytes(model)
    kv_tok = kv_bytes_per_token(cfg)
    print(f"# model built in {build_s:.1f} s: {wbytes / 1e9:.2f} GB of weights, "
          f"KV {kv_tok} B/token over {cfg.num_hidden_layers} layers; experts={cfg._experts_implementation} "
          f"attn={cfg._attn_implementation}", flush=True)
    if args.check:
        # fp32 throughout, so the only differences are summation order: expect ~1e-6.
        err = check_decode(model, cfg, device)
        print(f"PEER_CHECK rel_err={err:.3e} {'ok' if err < 1e-4 else 'FAIL'}", flush=True)
        return 0 if err < 1e-4 else 1
    gen = torch.Generator(device=device).manual_seed(42)

    state = {}
    results, skips, prefills = [], [], []
    with torch.no_grad():
        for ctx in ctxs:
            for b in batches:
                kv = b * (ctx + 1) * kv_tok
                tag = {"model": MODEL_NAME, "batch": b, "ctx": ctx}
                if device.type == "cuda":
                    free, _ = torch.cuda.mem_get_info()
                    need = kv + scratch_bytes(cfg, b, ctx + 1)
                    if need > free:
                        why = f"memory:kv_{kv / 1e9:.1f}GB+scratch>{free / 1e9:.1f}GB_free"
                        skips.append({**tag, "reason": why})
                        print(fmt("PEER_SKIP", skips[-1]), flush=True)
                        continue
                if time.time() - t_start > args.time_budget:
                    skips.append({**tag, "reason": "time_budget"})
                    print(fmt("PEER_SKIP", skips[-1]), flush=True)
                    continue
                try:
                    r = decode_config(model, cfg, b, ctx, device, args, state, gen)
                except torch.OutOfMemoryError as e:
                    free_memory()
                    skips.append({**tag, "reason": "memory:OOM_" + str(e).split(".")[0].replace(" ", "_")[:80]})
                    print(fmt("PEER_SKIP", skips[-1]), flush=True)
                    continue
                r["weights_gb"] = round(wbytes / 1e9, 2)
                r["kv_gb"] = round(kv / 1e9, 2)
                results.append(r)
                print(fmt("PEER", r), flush=True)
                free_memory()
        for n in pre:
            if time.time() - t_start > args.time_budget + 30:
                print(f"# PEER_PREFILL tokens={n} skipped: time budget", flush=True)
                continue
            try:
                p = prefill(model, cfg, n, device, args, gen)
            except torch.OutOfMemoryError:
                free_memory()
                print(f"# PEER_PREFILL tokens={n} skipped: OOM", flush=True)
                continue
            prefills.append(p)
            print(fmt("PEER_PREFILL", p), flush=True)
            free_memory()

    report = {"env": info, "model": MODEL_NAME, "preset": "ml4-slice-4" if not args.tiny else "tiny",
              "weights_gb": round(wbytes / 1e9, 2), "kv_bytes_per_token": kv_tok,
              "build_s": round(build_s, 1), "graphs_ok": state.get("graphs_ok", device.type == "cuda"),
              "graph_error": state.get("graph_error"), "decode": results, "skipped": skips,
              "prefill": prefills, "warmup": args.warmup, "iters": args.iters,
              "wall_s": round(time.time() - t_start, 1)}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peer.json"), "w") as f:
            json.dump(report, f, indent=1)
    print(f"# done in {report['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
