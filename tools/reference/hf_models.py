"""transformers' own mistral4 and deepseek_v32 on ml4's HF-layout checkpoints.

`load_hf_model` calls `from_pretrained` strictly: any missing, unexpected or mismatched key
(or an error message) in the loading info is an error, so the HF names and shapes that
`ml4 make-model --layout both` writes are checked against transformers on every run. The
model runs in float64 with eager attention (the checkpoint is bf16; the cast is exact).

Two modes (`HfRun.mode`):

* "pure": transformers unmodified. The indexer's choice is recorded by wrapping
  `DeepseekV32Indexer.forward`; the wrapper also recomputes the scores with
  numerics.indexer_scores(fp8=False) and asserts that they select the same keys (so the
  recorded scores are the ones transformers ranked by).
* "emulated": the same modules with ml4's cache stores reproduced (numerics.py): latent
  rows rounded to bf16 (a forward hook on every kv_a_layernorm, and the module's
  `apply_rotary_pos_emb_interleave` rounding its rotated key), and the indexer scored the
  DeepSeek-V3.2 way (Hadamard + FP8 per 128 on q and k). This is what CI holds the CPU
  backend to at f32-level tolerances; "pure" measures how far that emulation moves
  transformers' own numbers (docs/ARCHITECTURE.md).
"""

import importlib
import logging

import torch

from numerics import attach_route_hooks, bf16_round, indexer_scores, select_topk


class LoadError(RuntimeError):
    pass


def load_hf_model(model_dir: str):
    import transformers
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    # Collect every warning transformers logs while loading: a silent re-init of a tensor
    # would be a wrong golden.
    records = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = _Collect(level=logging.WARNING)
    hf_logger = hf_logging.get_logger("transformers")
    hf_logger.addHandler(handler)
    # The class named by config.json's `architectures` (transformers 5.17 does not register
    # Mistral4ForCausalLM with AutoModelForCausalLM).
    cls = getattr(transformers, AutoConfig.from_pretrained(model_dir).architectures[0])
    try:
        model, info = cls.from_pretrained(
            model_dir, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
    finally:
        hf_logger.removeHandler(handler)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise LoadError(f"{model_dir}: from_pretrained loading info not clean: {problems}")
    bad = [r for r in records if "not initialized" in r or "not used" in r or "newly initialized" in r]
    if bad:
        raise LoadError(f"{model_dir}: from_pretrained warned: {bad}")
    model.eval()
    return model, records


class HfRun:
    """One transformers model with the recording / emulation patches of `mode`."""

    def __init__(self, model, mode: str):
        assert mode in ("pure", "emulated")
        self.model = model
        self.mode = mode
        self.record = {}  # layer -> (selection [S, k] int64, masked scores [S, T] f64)
        self.routes = {}  # layer -> routed experts [S, k] sorted
        self._undo = []
        gates = {l: layer.mlp.gate for l, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")}
        self._undo += [h.remove for h in attach_route_hooks(gates, self.routes)]
        mt = model.config.model_type
        self.module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt.replace('-', '_')}")
        if mode == "emulated":
            self._patch_latent_rounding()
        if hasattr(self.module, "DeepseekV32Indexer"):
            self._patch_indexer()

    def close(self):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _patch_latent_rounding(self):
        mod = self.module
        orig = mod.apply_rotary_pos_emb_interleave

        def rounded(q, k, cos, sin, *args, **kwargs):
            q_embed, k_embed = orig(q, k, cos, sin, *args, **kwargs)
            return q_embed, bf16_round(k_embed)

        mod.apply_rotary_pos_emb_interleave = rounded
        self._undo.append(lambda: setattr(mod, "apply_rotary_pos_emb_interleave", orig))
        for layer in self.model.model.layers:
            h = layer.self_attn.kv_a_layernorm.register_forward_hook(lambda m, i, out: bf16_round(out))
            self._undo.append(h.remove)

    def _patch_indexer(self):
        mod = self.module
        cls = mod.DeepseekV32Indexer
        orig_forward = cls.forward
        run = self

        def scores_of(ix, hidden_states, q_resid, position_embeddings, fp8):
            # transformers' DeepseekV32Indexer.forward up to the scores, with its own modules.
            B, S, _ = hidden_states.shape
            cos, sin = position_embeddings
            q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
            q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
            k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
            q_rot, k_rot = mod.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)[0]
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)[0]
            w = ix.weights_proj(hidden_states)[0] * (ix.n_heads**-0.5) * ix.softmax_scale
            return indexer_scores(q, k, w, fp8=fp8)

        def forward(ix, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                    past_key_values=None):
            if hidden_states.shape[0] != 1 or past_key_values is not None:
                raise RuntimeError("the golden runs use batch 1 without a cache")
            positions = position_ids[0]
            if run.mode == "emulated":
                scores = scores_of(ix, hidden_states, q_resid, position_embeddings, fp8=True)
                sel, masked = select_topk(scores, positions, ix.index_topk)
                run.record[ix.layer_idx] = (sel, masked)
                return sel[None].to(torch.int32)
            out = orig_forward(ix, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                               past_key_values)
            scores = scores_of(ix, hidden_states, q_resid, position_embeddings, fp8=False)
            sel, masked = select_topk(scores, positions, ix.index_topk)
            # transformers' own choice (its torch.topk) must be the keys these scores rank
            # first, up to exact ties.
            theirs = out[0].long()
            for s in range(theirs.shape[0]):
                n = min(ix.index_topk, int(positions[s]) + 1)
                a = sorted(int(t) for t in theirs[s] if int(t) <= int(positions[s]))
                b = sorted(int(t) for t in sel[s, :n])
                if a != b:
                    kth = masked[s, sel[s, n - 1]]
                    diff = set(a) ^ set(b)
                    if any(masked[s, t] != kth for t in diff):
                        raise RuntimeError(f"layer {ix.layer_idx} row {s}: recomputed indexer scores do not "
                                           f"reproduce transformers' top-k ({a} vs {b})")
            # Record transformers' selection, visible keys only, in its order of scores.
            fixed = sel.clone()
            for s in range(theirs.shape[0]):
                n = min(ix.index_topk, int(positions[s]) + 1)
                chosen = [int(t) for t in theirs[s] if int(t) <= int(positions[s])][:n]
                chosen.sort(key=lambda t: (-float(masked[s, t]), t))
                fixed[s, :n] = torch.tensor(chosen, dtype=fixed.dtype)
            run.record[ix.layer_idx] = (fixed, masked)
            return out

        cls.forward = forward
        self._undo.append(lambda: setattr(cls, "forward", orig_forward))

    @torch.no_grad()
    def logits(self, tokens):
        """Logits [len, vocab] (f64) of one sequence, all positions, no cache."""
        self.record = {}
        self.routes.clear()
        ids = torch.tensor([tokens], dtype=torch.long)
        return self.model(input_ids=ids, use_cache=False).logits[0].to(torch.float64)

    def sparse_layers(self):
        n = self.model.config.num_hidden_layers
        return list(range(n)) if hasattr(self.module, "DeepseekV32Indexer") else []

    def topk_value(self):
        return getattr(self.model.config, "index_topk", 0)
