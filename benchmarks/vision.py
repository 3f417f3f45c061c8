"""Vision tower benchmark: transformers' Qwen2.5-VL tower (``sdpa``, what
``get_video_features`` runs) against ours (:mod:`mminfer.models.vision`, chunks of temporal
pairs as batches), side by side in one run, on the Qwen2.5-VL-7B vision config with random
bf16 weights built from the config (no download) and frames of 40x72 patches (560x1008 px,
720 LLM tokens per pair).

    python benchmarks/vision.py --pairs 256 1024 --out out     # on the GPU
    python benchmarks/vision.py --tiny --out /tmp/vision       # CPU smoke (tiny config)

Rows per size N (pairs):

* ``transformers``: ``visual(pixels, grid_thw)`` over the whole video at once, only where
  ``N <= --hf-max-pairs`` (it needs tens of GB at 256 pairs);
* ``ours``: the tower over chunks of ``--chunk-patches`` patches, pixels sliced from the same
  input tensor where transformers runs (so both see the same input), else generated chunk by
  chunk on the device (the whole input never exists, as in the product);
* ``ours+preprocess``: the product's per-chunk path from uint8 frames in host memory
  (pinned copy, normalise, patchify, tower), i.e. ``Qwen2_5_VLAdapter.embed`` minus the
  text embedding.

Time: CUDA events, median of ``--reps`` runs after a warm-up (CPU: wall clock). Memory:
``peak`` is the device's peak allocation during the call; ``work`` is that minus what was
allocated before it (weights, input) and minus the output features: the tower's own
working memory, which for ours is set by the chunk. Accuracy: the largest absolute
difference between ours and transformers (bf16, same input), and both against an fp32
transformers tower on ``--check-pairs`` pairs. JSON goes to ``--out``/vision.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.models.vision import CHUNK_PATCHES, QwenVisionTower  # noqa: E402

QWEN_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                      out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112,
                      fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
                      hidden_act="silu", in_channels=3)
TINY_VISION = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4,
                   out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                   tokens_per_second=2, hidden_act="silu", in_channels=3)


def build_visual(vision: dict, device, dtype):
    """transformers' vision tower from a config, random weights, on ``device``."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    vcfg = Qwen2_5_VLConfig(vision_config=vision).vision_config
    cls = m.Qwen2_5_VisionTransformerPretrainedModel
    with torch.device(device):
        try:
            visual = cls._from_config(vcfg, attn_implementation="sdpa", dtype=dtype)
        except TypeError:   # older signature: torch_dtype
            visual = cls._from_config(vcfg, attn_implementation="sdpa", torch_dtype=dtype)
    return visual.eval()


def transformers_features(visual, pixels, n_pairs, h, w):
    grid = torch.tensor([[n_pairs, h, w]], device=pixels.device)
    out = visual(pixels.to(visual.dtype), grid_thw=grid)
    return getattr(out, "pooler_output", out)


class Ours:
    """Our tower over chunks of pairs; ``pixels_of(p0, p1)`` gives a chunk's patches."""

    def __init__(self, visual, h, w, chunk_patches):
        self.tower = QwenVisionTower(visual)
        self.h, self.w = h, w
        self.per_chunk = self.tower.pairs_per_chunk(h, w, chunk_patches)
        self.units = h * w // self.tower.unit
        self.out_dim = visual.merger.mlp[-1].out_features

    def __call__(self, pixels_of, n_pairs, device, dtype):
        out = torch.empty(n_pairs * self.units, self.out_dim, device=device, dtype=dtype)
        for p0 in range(0, n_pairs, self.per_chunk):
            p1 = min(p0 + self.per_chunk, n_pairs)
            out[p0 * self.units:p1 * self.units] = self.tower(pixels_of(p0, p1), p1 - p0,
                                                              self.h, self.w)
        return out


def random_patches(p0, p1, patches_per_pair, width, device, dtype):
    g = torch.Generator(device=device).manual_seed(1000 + p0)
    return torch.randn((p1 - p0) * patches_per_pair, width, generator=g, device=device,
                       dtype=dtype)


def timed(fn, device, reps):
    """(median ms, peak bytes, bytes allocated before, result of the last call)."""
    cuda = device.type == "cuda"
    fn()                                                  # warm-up (kernels, cuBLAS)
    times, peak, before, out = [], 0, 0, None
    for _ in range(reps):
        out = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
            peak = max(peak, torch.cuda.max_memory_allocated())
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2], peak, before, out


def row(impl, n, ms, peak, before, out, **kw):
    out_bytes = out.numel() * out.element_size()
    r = {"impl": impl, "pairs": n, "ms": ms, "ms_per_pair": ms / n}
    if peak:
        r.update(peak_gib=peak / 2**30, work_gib=max(peak - before - out_bytes, 0) / 2**30,
                 output_gib=out_bytes / 2**30)
    r.update(kw)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, nargs="+", default=None)
    ap.add_argument("--grid", type=int, nargs=2, default=None, metavar=("H", "W"),
                    help="patches per frame (default 40 72: 560x1008 px)")
    ap.add_argument("--chunk-patches", type=int, default=CHUNK_PATCHES)
    ap.add_argument("--hf-max-pairs", type=int, default=256,
                    help="run transformers' tower only up to this many pairs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-reps", type=int, default=1)
    ap.add_argument("--check-pairs", type=int, default=2,
                    help="pairs for the fp32 reference comparison (0: skip)")
    ap.add_argument("--no-preprocess", action="store_true",
                    help="skip the uint8-frames (preprocess + tower) row")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny config on the CPU in fp32 (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()

    if a.tiny:
        device, dtype, vision = torch.device("cpu"), torch.float32, TINY_VISION
        pairs, (h, w) = a.pairs or [3, 5], a.grid or (10, 14)
        a.chunk_patches = min(a.chunk_patches, 2 * h * w)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for the CPU smoke test")
        device, dtype, vision = torch.device("cuda"), torch.bfloat16, QWEN_7B_VISION
        pairs, (h, w) = a.pairs or [256, 1024], a.grid or (40, 72)
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    t0 = time.time()
    visual = build_visual(vision, device, dtype)
    n_params = sum(p.numel() for p in visual.parameters())
    S = h * w
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    ours = Ours(visual, h, w, a.chunk_patches)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": _version("transformers"),
            "config": "tiny" if a.tiny else "Qwen2.5-VL-7B vision", "params": n_params,
            "grid": [h, w], "dtype": str(dtype).replace("torch.", ""),
            "chunk_patches": a.chunk_patches, "pairs_per_chunk": ours.per_chunk,
            "window_groups": [list(g) for g in ours.tower.layout(h, w, device).groups]}
    print(f"{info['config']} ({n_params / 1e9:.3f} B params) on {info['device']}, torch "
          f"{info['torch']}, transformers {info['transformers']}; {h}x{w} patches per pair, "
          f"{ours.per_chunk} pairs per chunk; built in {time.time() - t0:.0f} s", flush=True)
    rows = []

    def dump():
        with open(os.path.join(a.out, "vision.json"), "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)

    if a.check_pairs:
        info["fp32_check"] = fp32_check(visual, vision, ours, a.check_pairs, h, w, width,
                                        device, dtype)
        print(json.dumps({"fp32_check": info["fp32_check"]}), flush=True)
        dump()
    with torch.inference_mode():
        for n in pairs:
            hf = None
            full = None
            if n <= a.hf_max_pairs:
                full = random_patches(0, n, S, width, device, dtype)
                ms, peak, before, hf = timed(
                    lambda: transformers_features(visual, full, n, h, w), device, a.hf_reps)
                rows.append(row("transformers", n, ms, peak, before, hf, input="whole video"))
                print(json.dumps(rows[-1]), flush=True)
                dump()
                pixels_of = lambda p0, p1: full[p0 * S:p1 * S]            # noqa: E731
                source = "slices of the whole-video tensor"
            else:
                pixels_of = lambda p0, p1: random_patches(p0, p1, S, width,  # noqa: E731
                                                          device, dtype)
                source = "generated per chunk"
            ms, peak, before, got = timed(lambda: ours(pixels_of, n, device, dtype), device,
                                          a.reps)
            extra = {"input": source}
            if hf is not None:
                diff = (got.float() - hf.float()).abs()
                extra.update(max_abs_diff=float(diff.max()),
                             rel_max_diff=float(diff.max() / hf.float().abs().max()),
                             mean_abs_diff=float(diff.mean()),
                             speedup=rows[-1]["ms"] / ms)
            rows.append(row("ours", n, ms, peak, before, got, **extra))
            print(json.dumps(rows[-1]), flush=True)
            dump()
            del hf, full, got
            if not a.no_preprocess:
                rows.append(with_preprocess(ours, vision, n, h, w, device, dtype, a.reps))
                print(json.dumps(rows[-1]), flush=True)
                dump()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)


def with_preprocess(ours, vision, n, h, w, device, dtype, reps):
    """The product's chunk loop from uint8 frames on the host (already at the model size)."""
    from mminfer.models.qwen2_5_vl import frames_to_patches
    from mminfer.models.vision import to_device
    T, p = vision["temporal_patch_size"], vision["patch_size"]
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (n * T, h * p, w * p, 3), dtype=torch.uint8, generator=g)

    def run():
        def pixels_of(p0, p1):
            chunk = to_device(frames[p0 * T:p1 * T], device)
            return frames_to_patches(chunk, (h * p, w * p), patch=p, temporal=T,
                                     merge=vision["spatial_merge_size"], device=device,
                                     dtype=dtype)
        return ours(pixels_of, n, device, dtype)

    ms, peak, before, out = timed(run, device, reps)
    return row("ours+preprocess", n, ms, peak, before, out, input="uint8 frames on the host")


def fp32_check(visual, vision, ours, n, h, w, width, device, dtype):
    """Ours and transformers in ``dtype`` against transformers in fp32 on the same input."""
    import copy
    S = h * w
    ref_visual = copy.deepcopy(visual).float()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            pix = random_patches(0, n, S, width, device, torch.float32)
            ref = transformers_features(ref_visual, pix, n, h, w).float()
            hf = transformers_features(visual, pix.to(dtype), n, h, w).float()
            got = ours(lambda p0, p1: pix[p0 * S:p1 * S].to(dtype), n, device, dtype).float()
            ours32 = QwenVisionTower(ref_visual)(pix, n, h, w).float()
    finally:
        del ref_visual
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    scale = float(ref.abs().max())
    err = lambda x: float((x - ref).abs().max())                          # noqa: E731
    return {"pairs": n, "max_abs_feature": scale, "transformers_max_abs_err": err(hf),
            "ours_max_abs_err": err(got), "ours_fp32_max_abs_err": err(ours32)}


def print_table(rows):
    print(f"{'impl':>16} {'pairs':>6} {'ms':>10} {'ms/pair':>8} {'peak GiB':>9} "
          f"{'work GiB':>9} {'speedup':>8} {'max|diff|':>10}")
    for r in rows:
        print(f"{r['impl']:>16} {r['pairs']:>6} {r['ms']:10.1f} {r['ms_per_pair']:8.2f} "
              f"{r.get('peak_gib', float('nan')):9.2f} {r.get('work_gib', float('nan')):9.2f} "
              f"{r.get('speedup', float('nan')):8.2f} {r.get('max_abs_diff', float('nan')):10.3g}")


def _version(name):
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    main()
