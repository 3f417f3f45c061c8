"""Deepening a trained embedded model without changing what it computes.

Five fine-tunes of the 5.6 M-parameter model (lab/NOTES.md §4, ft5-ft9) left its reading of
unseen digit looks at about half; capacity is the lever left. Training a larger model from
scratch costs several sessions of device time, so the larger model starts as the trained one:
new vision blocks and decoder layers are inserted between the old ones with their output
projections zeroed. Each new block's residual branch then adds exactly zero (attention and MLP
outputs both pass through a zero matrix and a zero bias), so the deepened model gives the old
model's logits bit for bit until training moves those projections, and the old blocks keep
their weights and order. (The zeroed projections still get gradients: their inputs are not zero.)
"""

from __future__ import annotations

import re

from lab.toy import embedded as E

import copy

import torch

# per-block parameters whose zeroing turns a pre-norm residual block into the identity
_VISION_OUT = (".attn.proj.weight", ".attn.proj.bias", ".mlp.down_proj.weight",
               ".mlp.down_proj.bias")
_TEXT_OUT = (".self_attn.o_proj.weight", ".mlp.down_proj.weight")
_VISION_KEY = re.compile(r"^(.*\.visual\.blocks\.)(\d+)(\..*)$")
_TEXT_KEY = re.compile(r"^(.*\.language_model\.layers\.)(\d+)(\..*)$")


def shape_of(config) -> dict:
    """The ``embedded.SHAPE`` dict a Qwen2.5-VL config was built from."""
    t, v = config.text_config, config.vision_config
    return dict(hidden=t.hidden_size, layers=t.num_hidden_layers, heads=t.num_attention_heads,
                kv_heads=t.num_key_value_heads, intermediate=t.intermediate_size,
                vision_hidden=v.hidden_size, vision_depth=v.depth, vision_heads=v.num_heads,
                vision_intermediate=v.intermediate_size,
                max_position_embeddings=t.max_position_embeddings,
                rope_theta=float(t.rope_parameters["rope_theta"]))


def layout(old: int, new: int) -> list[int | None]:
    """Where each block of the deepened stack comes from: an old block's index, or None for
    a new (identity) block. The ``new`` blocks are spread evenly, each right after an old one:
    old 3 + new 3 -> [0, None, 1, None, 2, None]; old 4 + new 2 -> [0, 1, None, 2, 3, None]."""
    if old < 1 or new < 0:
        raise ValueError(f"cannot deepen {old} blocks by {new}")
    after = [0] * old
    for k in range(new):            # the k-th new block follows old block ceil((k+1) old/new) - 1
        after[min(old - 1, -(-(k + 1) * old // new) - 1)] += 1
    out: list[int | None] = []
    for i in range(old):
        out += [i] + [None] * after[i]
    return out


def deepen(model, vision: int = 0, text: int = 0, seed: int = 0):
    """A new model (fp32, on the CPU) with ``vision`` more vision blocks and ``text`` more
    decoder layers than ``model``, computing exactly what ``model`` computes."""
    shape = shape_of(model.config)
    grown, _ = E.new_model({**shape, "vision_depth": shape["vision_depth"] + vision,
                            "layers": shape["layers"] + text}, seed=seed)
    src = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    maps = ((_VISION_KEY, layout(shape["vision_depth"], vision), _VISION_OUT),
            (_TEXT_KEY, layout(shape["layers"], text), _TEXT_OUT))
    state = {}
    for k, fresh in grown.state_dict().items():
        for pattern, where, zeroed in maps:
            m = pattern.match(k)
            if m:
                old = where[int(m.group(2))]
                if old is not None:
                    state[k] = src[f"{m.group(1)}{old}{m.group(3)}"]
                else:
                    state[k] = torch.zeros_like(fresh) if m.group(3) in zeroed else fresh
                break
        else:
            state[k] = src[k]
    grown.load_state_dict(state, strict=True)
    return grown


def deepen_patterns(config: dict, text: int) -> dict:
    """A head-pattern config (``mminfer_patterns.json`` as a dict) for the model deepened by
    ``text`` decoder layers: each new layer takes the rule of the old layer before it (its
    place in ``layout``), the model identity gets the new layer count, the provenance says so.
    A config for the deepened model to start from; calibration is what fits it."""
    old = config["model"]["layers"]
    if len(config["layers"]) != old:
        raise ValueError(f"config has {len(config['layers'])} layers for a {old}-layer model")
    out = copy.deepcopy(config)
    rows, last = [], None
    for i in layout(old, text):
        last = config["layers"][i] if i is not None else last
        rows.append(copy.deepcopy(last))
    out["layers"] = rows
    out["model"]["layers"] = len(rows)
    prov = dict(out.get("provenance") or {})
    prov["deepened"] = (f"lab.toy.grow.deepen_patterns: {text} decoder layers inserted, "
                        f"each with the rule of the layer before it")
    out["provenance"] = prov
    return out


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path
    ap = argparse.ArgumentParser(description="a head-pattern config for a deepened model")
    ap.add_argument("config", help="mminfer_patterns.json of the model before deepening")
    ap.add_argument("--text", type=int, required=True, help="decoder layers inserted")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    Path(a.out).write_text(json.dumps(
        deepen_patterns(json.loads(Path(a.config).read_text()), a.text), indent=1) + "\n")
