"""LongVILA's vision tower (SigLIP-so400m-448, the 26 layers LongVILA keeps) on random weights:
bf16 through transformers' forward (what ``quantization=None`` runs), FP8 layers through
transformers' forward (the FP8 path before mminfer.models.siglip) and FP8 through
``siglip.Fp8Encoder`` (what ``quantization="fp8"`` runs now), side by side on the same input,
one batch of ``--frames`` frames (LongVILA's ``vision_batch`` is 32: 32K patch tokens).
CUDA events, median of ``--reps`` after a warm-up; relative error of each FP8 output
against bf16's.

    python benchmarks/siglip.py --out $OUT              # on the GPU
    python benchmarks/siglip.py --tiny --out /tmp/s     # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.models import fp8, siglip  # noqa: E402
from cuda_events import events_ms  # noqa: E402  (benchmarks/ is the script's folder)

SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26,
              num_attention_heads=16, image_size=448, patch_size=14,
              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            image_size=56, patch_size=14, hidden_act="gelu_pytorch_tanh")


def tower(cfg, device, dtype):
    from transformers import SiglipVisionConfig, SiglipVisionModel
    torch.manual_seed(0)
    with torch.device(device):
        m = SiglipVisionModel(SiglipVisionConfig(**cfg)).to(dtype).eval()
    return getattr(m, "vision_model", m)


def timed(fn, cuda, reps):
    if cuda:
        return events_ms(fn, reps)
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)[len(out) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg = TINY if a.tiny else SO400M
    bf16 = tower(cfg, dev, dtype)
    q = copy.deepcopy(bf16)
    fp8.convert(q, fp8.is_vision_linear)
    fused = siglip.Fp8Encoder(q.encoder)
    S = cfg["image_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.frames, 3, S, S, device=dev, dtype=dtype, generator=g)
    rows = {}
    with torch.inference_mode():
        h = bf16.embeddings(x)
        runs = {"bf16 (transformers)": lambda: bf16.encoder(inputs_embeds=h).last_hidden_state,
                "fp8 (transformers' forward)":
                    lambda: q.encoder(inputs_embeds=h).last_hidden_state,
                "fp8 (siglip.Fp8Encoder)": lambda: fused(h.clone())}
        ref = runs["bf16 (transformers)"]().float()
        for name, fn in runs.items():
            ms = timed(fn, cuda, a.reps)
            out = fn().float()
            rows[name] = {"ms": ms, "rel_error_vs_bf16": float((out - ref).norm() / ref.norm())}
            print(f"{name:<30} {ms:9.2f} ms  rel err vs bf16 {rows[name]['rel_error_vs_bf16']:.4f}",
                  flush=True)
    base = rows["bf16 (transformers)"]["ms"]
    for r in rows.values():
        r["speedup_vs_bf16"] = base / r["ms"]
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "frames": a.frames,
           "tokens": a.frames * (S // cfg["patch_size"]) ** 2, "layers": cfg["num_hidden_layers"],
           "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "siglip.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: round(v["speedup_vs_bf16"], 3) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
