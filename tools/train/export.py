"""Writes a trained Ml4Small (+ DSpark drafter) as a native ML4 model directory.

    params.json                the training params (tools/train/params_ml4_small.json)
    consolidated.safetensors   docs/MODEL-FORMAT.md names: FP8 128x128 blocks (e4m3 +
                               weight_scale_inv f32) for every linear except the router gate,
                               indexer.weights_proj and the output head; bf16 embeddings and
                               norms; f32 ssmax_s and indexer k_norm; the drafter (mtp_dspark.*)
                               all bf16
    tekken.json                copied from the tokenizer

`dequantized_state(path)` reads the file back as the f32 tensors ml4 computes with (e4m3 *
scale rounded once to f32, bf16 widened), for the PyTorch evaluation of exactly what ships.
"""

import json
import os
import shutil

import torch

from ml4_small import fp8_block_dequantize, fp8_block_quantize


def drafter_tensor_names(p: dict):
    """The exact mtp_dspark.* list (docs/MODEL-FORMAT.md section 4), with shapes."""
    D, V, H = p["dim"], p["vocab_size"], p["n_heads"]
    dn, dr, dv, r = p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["v_head_dim"], p["kv_lora_rank"]
    m = p["mtp"]
    R, B, Tn = m.get("rnn_rank", 512), m.get("block_size", 16), len(m["target_layers"])
    out = [("fc.weight", [D, Tn * D]), ("fc_norm.weight", [D]), ("mask_embed", [B - 1, D])]
    for i in range(m["n_layers"]):
        lp = f"layers.{i}."
        out += [(lp + "attention_norm.weight", [D]), (lp + "attention.wq.weight", [H * (dn + dr), D]),
                (lp + "attention.wkv_a_with_mqa.weight", [r + dr, D]), (lp + "attention.kv_a_norm.weight", [r]),
                (lp + "attention.wkv_b.weight", [H * (dn + dv), r]), (lp + "attention.wo.weight", [D, H * dv]),
                (lp + "ffn_norm.weight", [D]), (lp + "feed_forward.w1.weight", [p["hidden_dim"], D]),
                (lp + "feed_forward.w2.weight", [D, p["hidden_dim"]]), (lp + "feed_forward.w3.weight", [p["hidden_dim"], D])]
    out += [("norm.weight", [D]), ("markov.embed.weight", [V, R]), ("markov.weight_ih", [3 * R, D + R]),
            ("markov.weight_hh", [3 * R, R]), ("markov.bias_ih", [3 * R]), ("markov.bias_hh", [3 * R]),
            ("markov.out.weight", [V, R])]
    return [("mtp_dspark." + n, s) for n, s in out]


def target_tensors(model, fp8=True):
    """Native name -> tensor for the target model."""
    from ml4_small import QLinear
    out = {}
    fp8_names = set()
    for name, mod in model.named_modules():
        if isinstance(mod, QLinear) and mod.fp8:
            fp8_names.add(name + ".weight")
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        if ".experts.w" in name:
            pre, w = name.rsplit(".experts.", 1)
            for e in range(t.shape[0]):
                n = f"{pre}.experts.{e}.{w}.weight"
                out[n] = t[e]
                fp8_names.add(n)
            continue
        if name.endswith("rotary.inv_freq") or name.endswith("original_inv_freq"):
            continue
        out[name] = t
    typed = {}
    for n, t in out.items():
        if fp8 and n in fp8_names:
            q, s = fp8_block_quantize(t)
            typed[n] = q
            typed[n[: -len(".weight")] + ".weight_scale_inv"] = s
        elif n.endswith("ssmax_s") or ".k_norm." in n:
            typed[n] = t.to(torch.float32)
        else:
            typed[n] = t.to(torch.bfloat16)
    return typed


def drafter_tensors(drafter, p):
    sd = {k: v.detach().float().cpu() for k, v in drafter.state_dict().items()}
    ren = {"markov.cell.weight_ih": "markov.weight_ih", "markov.cell.weight_hh": "markov.weight_hh",
           "markov.cell.bias_ih": "markov.bias_ih", "markov.cell.bias_hh": "markov.bias_hh"}
    out = {"mtp_dspark." + ren.get(k, k): v.to(torch.bfloat16) for k, v in sd.items()}
    want = dict(drafter_tensor_names(p))
    got = {k: list(v.shape) for k, v in out.items()}
    if got != want:
        raise RuntimeError(f"drafter tensors differ from the documented list: {sorted(set(got) ^ set(want))} "
                           f"{[(k, got[k], want[k]) for k in got if k in want and got[k] != want[k]]}")
    return out


def export(model, drafter, p, tekken, out_dir, fp8=True, target_file=None):
    """target_file: take the target's tensors verbatim from this consolidated.safetensors (a
    drafter trained on a shipped target: re-quantizing decoded FP8 could move a block scale by
    an ulp)."""
    from safetensors.torch import load_file, save_file
    os.makedirs(out_dir, exist_ok=True)
    if target_file:
        t = {k: v for k, v in load_file(target_file).items() if not k.startswith("mtp_dspark.")}
    else:
        t = target_tensors(model, fp8=fp8)
    if drafter is not None:
        t.update(drafter_tensors(drafter, p))
    pj = dict(p)
    if not fp8:
        pj.pop("quantization", None)
    if drafter is None:
        pj.pop("mtp", None)
    save_file({k: v.contiguous() for k, v in sorted(t.items())}, os.path.join(out_dir, "consolidated.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "params.json"), "w") as f:
        json.dump(pj, f, indent=2)
        f.write("\n")
    if tekken:
        shutil.copyfile(tekken, os.path.join(out_dir, "tekken.json"))
    return os.path.getsize(os.path.join(out_dir, "consolidated.safetensors"))


def dequantized_state(path):
    """The checkpoint as f32 tensors, FP8 blocks decoded (what ml4 computes with)."""
    from safetensors.torch import load_file
    t = load_file(path)
    out = {}
    for k, v in t.items():
        if k.endswith(".weight_scale_inv"):
            continue
        s = t.get(k[: -len(".weight")] + ".weight_scale_inv") if k.endswith(".weight") else None
        out[k] = fp8_block_dequantize(v, s) if s is not None else v.to(torch.float32)
    return out


def load_into(model, drafter, state):
    """Loads native-named tensors (dequantized_state) into an Ml4Small and a drafter."""
    sd = model.state_dict()
    new = {}
    for name in sd:
        if ".experts.w" in name:
            pre, w = name.rsplit(".experts.", 1)
            E = sd[name].shape[0]
            new[name] = torch.stack([state[f"{pre}.experts.{e}.{w}.weight"] for e in range(E)])
        elif name.endswith("inv_freq"):
            new[name] = sd[name]
        else:
            new[name] = state[name]
    model.load_state_dict(new)
    if drafter is not None:
        grow_drafter(drafter, drafter_state(state))


def drafter_state(state):
    """The mtp_dspark.* tensors of native-named `state` under DSparkDrafter's parameter names."""
    ren = {"markov.weight_ih": "markov.cell.weight_ih", "markov.weight_hh": "markov.cell.weight_hh",
           "markov.bias_ih": "markov.cell.bias_ih", "markov.bias_hh": "markov.cell.bias_hh"}
    dsd = {}
    for k, v in state.items():
        if k.startswith("mtp_dspark."):
            n = k[len("mtp_dspark."):]
            dsd[ren.get(n, n)] = v
    return dsd


def grow_drafter(drafter, dsd):
    """Loads a drafter's tensors (dsd) into `drafter`, which may have more draft layers than
    dsd holds (train.py --drafter-layers): the file's layers load as they are, the others keep
    their initialisation but for zero output projections (attention.wo, feed_forward.w2), so
    each added layer adds nothing to the residual stream and the grown drafter starts as the
    file's. Anything else missing or unexpected is an error."""
    have = {int(k.split(".")[1]) for k in dsd if k.startswith("layers.")}
    n = len(drafter.layers)
    if have != set(range(len(have))) or len(have) > n:
        raise ValueError(f"drafter file holds layers {sorted(have)}, the drafter has {n}")
    missing, unexpected = drafter.load_state_dict(dsd, strict=False)
    bad = [k for k in missing if not (k.startswith("layers.") and int(k.split(".")[1]) >= len(have))]
    if bad or unexpected:
        raise ValueError(f"drafter tensors: missing {bad}, unexpected {list(unexpected)}")
    with torch.no_grad():
        for i in range(len(have), n):
            drafter.layers[i].attention.wo.weight.zero_()
            drafter.layers[i].feed_forward.w2.weight.zero_()
