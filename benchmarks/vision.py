"""Vision tower benchmark: transformers' Qwen2.5-VL tower (``sdpa``, what
``get_video_features`` runs) against ours (:mod:`mminfer.models.vision`, chunks of temporal
pairs as batches), side by side in one run, on the Qwen2.5-VL-7B vision config with random
bf16 weights built from the config (no download) and frames of 40x72 patches (560x1008 px,
720 LLM tokens per pair).

    python benchmarks/vision.py --pairs 256 1024 --out out     # on the GPU
    python benchmarks/vision.py --pairs 256 --variants plain fused compiled --out out
    python benchmarks/vision.py --pairs 256 --compare-compile --out out
    python benchmarks/vision.py --tiny --out /tmp/vision       # CPU smoke (tiny config)
    python benchmarks/vision.py --ops                          # CPU: ops and bytes per block

Variants of our tower (``--variants``; ``--compile 1`` makes the default ``compiled``,
``--compare-compile`` runs ``fused`` and ``compiled`` side by side):

* ``plain``: transformers' modules block by block in our batched layout (``fused=False``;
  the tower as it was before the fused block, BENCHMARKS.md §6);
* ``fused``: the fused block (padded MLP width, gate/up in one GEMM, the Triton elementwise
  kernels of ``mminfer/kernels/vision_elementwise.py``): the product's default;
* ``compiled``: the fused block's torch ops through ``torch.compile(dynamic=False)``, the last
  chunk padded to the chunk's shape. ``first_chunk_ms`` in the JSON: each variant's first
  chunk ever (Triton JIT; for ``compiled`` the compilation), timed before anything else;
* ``fp8``: the fused block with the blocks' qkv/proj/MLP as FP8 layers (what
  ``--quantization fp8`` serves), converted from the same bf16 weights;
* ``name@backend`` (e.g. ``fused@cudnn``): that variant with every layer's attention through
  SDPA held to one backend (flash, cudnn, efficient, math), or ``@sdpa``: SDPA as it picks;
  both without the window-attention kernel (mminfer.kernels.window_attention), i.e. the tower
  before it, to measure against.

Rows per size N (pairs):

* ``transformers``: ``visual(pixels, grid_thw)`` over the whole video at once, only where
  ``N <= --hf-max-pairs`` (it needs tens of GB at 256 pairs);
* ``ours[variant]``: the tower over chunks of ``--chunk-patches`` patches, pixels sliced from
  the same input tensor where transformers runs (so both see the same input), else generated
  chunk by chunk on the device (the whole input never exists, as in the product);
* ``ours[variant]+preprocess`` (first variant only): the product's per-chunk path from uint8
  frames in host memory (pinned copy, normalise, patchify, tower), i.e.
  ``Qwen2_5_VLAdapter.embed`` minus the text embedding.

``--ops`` (no GPU needed: meta tensors) lists every op one window block and one full block
run per variant at ``--ops-pairs`` pairs of the grid, with the bytes it reads and writes and
the GEMM/attention FLOPs, and the totals per pair; JSON to ``--out``/vision_ops.json.

Time: CUDA events, median of ``--reps`` runs after a warm-up (CPU: wall clock). Memory:
``peak`` is the device's peak allocation during the call; ``work`` is that minus what was
allocated before it (weights, input) and minus the output features: the tower's own
working memory, which for ours is set by the chunk. Accuracy: the largest absolute
difference between ours and transformers (bf16, same input), and both against an fp32
transformers tower on ``--check-pairs`` pairs. JSON goes to ``--out``/vision.json.
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

from mminfer.kernels import fp8_gemm, fp8_quant, window_attention  # noqa: E402
from mminfer.models import fp8  # noqa: E402
from mminfer.models.vision import CHUNK_PATCHES, QwenVisionTower  # noqa: E402
from cuda_events import kernels_table  # noqa: E402  (benchmarks/ is the script's folder)

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


VARIANTS = {"plain": dict(fused=False), "fused": dict(), "compiled": dict(compile=True),
            "fp8": dict()}   # fp8: the fused block on a copy with FP8 layers (--quantization fp8)
# ``@sdpa``: the window layers as before mminfer.kernels.window_attention (rotary kernel,
# then SDPA as it picks); a named SDPA backend also runs every layer through SDPA
SDPA = ("flash", "cudnn", "efficient", "math", "sdpa")


def variant_name(v: str) -> str:
    """``name`` or ``name@backend`` (SDPA restricted to that backend in our tower)."""
    name, _, backend = v.partition("@")
    if name not in VARIANTS or (backend and backend not in SDPA):
        raise argparse.ArgumentTypeError(
            f"{v!r}: a variant is one of {sorted(VARIANTS)}, optionally @ one of {SDPA}")
    return v


def _sdpa_context(backend):
    import contextlib
    if backend in ("", "sdpa"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "math": SDPBackend.MATH}[backend])


class Tower:
    """A tower variant's call with its SDPA backend, if one was named."""

    def __init__(self, tower, backend):
        self.tower, self.backend = tower, backend

    def __call__(self, *args, **kw):
        if not self.backend:
            return self.tower(*args, **kw)
        keep = window_attention.MAX_WINDOW
        window_attention.MAX_WINDOW = 0          # every layer through rotary + SDPA
        try:
            with _sdpa_context(self.backend):
                return self.tower(*args, **kw)
        finally:
            window_attention.MAX_WINDOW = keep

    def __getattr__(self, name):
        return getattr(self.tower, name)


class Ours:
    """Our tower over chunks of pairs; ``pixels_of(p0, p1)`` gives a chunk's patches."""

    def __init__(self, visual, h, w, chunk_patches, variant="fused"):
        name, _, backend = variant.partition("@")
        if name == "fp8":     # the product's conversion of the same weights
            visual = copy.deepcopy(visual)
            fp8.convert(visual, fp8.is_vision_linear)
        self.tower = Tower(QwenVisionTower(visual, **VARIANTS[name]), backend)
        self.variant = variant
        self.h, self.w = h, w
        self.per_chunk = self.tower.pairs_per_chunk(h, w, chunk_patches)
        self.units = h * w // self.tower.unit
        self.out_dim = visual.merger.mlp[-1].out_features

    def __call__(self, pixels_of, n_pairs, device, dtype):
        out = torch.empty(n_pairs * self.units, self.out_dim, device=device, dtype=dtype)
        for p0 in range(0, n_pairs, self.per_chunk):
            p1 = min(p0 + self.per_chunk, n_pairs)
            out[p0 * self.units:p1 * self.units] = self.tower(
                pixels_of(p0, p1), p1 - p0, self.h, self.w, pad_to=self.per_chunk)
        return out


def random_patches(p0, p1, patches_per_pair, width, device, dtype):
    g = torch.Generator(device=device).manual_seed(1000 + p0)
    return torch.randn((p1 - p0) * patches_per_pair, width, generator=g, device=device,
                       dtype=dtype)


def first_chunk(ours, S, width, device, dtype):
    """Wall ms of one chunk through a tower that has never run."""
    pix = random_patches(0, ours.per_chunk, S, width, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours.tower(pix, ours.per_chunk, ours.h, ours.w, pad_to=ours.per_chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def timed(fn, device, reps, first=None):
    """(median ms, peak bytes, bytes allocated before, result of the last call); the warm-up
    call's ms (kernels, cuBLAS, torch.compile) go to ``first["ms"]``."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()                                                  # warm-up (kernels, cuBLAS)
    if cuda:
        torch.cuda.synchronize()
    if first is not None:
        first["ms"] = (time.perf_counter() - t0) * 1e3
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
    ap.add_argument("--gemms", action="store_true",
                    help="also time the block's GEMM shapes alone (MLP width as the model "
                         "has it and padded) and print their TFLOP/s")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one chunk of each variant: top kernels by device "
                         "time (torch.profiler), tables in --out/vision_profile.txt")
    ap.add_argument("--no-preprocess", action="store_true",
                    help="skip the uint8-frames (preprocess + tower) row")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny config on the CPU in fp32 (smoke test)")
    ap.add_argument("--variants", nargs="+", type=variant_name, default=None,
                    help=f"our tower's variants, in this order: {sorted(VARIANTS)}, each "
                         f"optionally @{'/'.join(SDPA)} (SDPA held to that backend); default "
                         f"fused, or compiled with --compile 1")
    ap.add_argument("--compile", type=int, choices=(0, 1), default=0,
                    help="1: the default variant is the torch.compile'd block")
    ap.add_argument("--compare-compile", action="store_true",
                    help="run fused and compiled side by side (after any --variants)")
    ap.add_argument("--ops", action="store_true",
                    help="list ops, bytes and FLOPs per block (meta tensors, any machine)")
    ap.add_argument("--ops-pairs", type=int, default=None,
                    help="pairs per chunk for --ops (default: what --chunk-patches gives)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    variants = list(a.variants or ([] if a.compare_compile else
                                   ["compiled" if a.compile else "fused"]))
    if a.compare_compile:
        variants += [v for v in ("fused", "compiled") if v not in variants]

    if a.ops:
        vision = TINY_VISION if a.tiny else QWEN_7B_VISION
        h, w = a.grid or ((10, 14) if a.tiny else (40, 72))
        pairs = a.ops_pairs or max(1, a.chunk_patches // (h * w))
        os.makedirs(a.out, exist_ok=True)
        # compiled: inductor's kernels are not known before it runs (its fusions are at
        # least those of the fused variant's kernels)
        res = op_listing(vision, pairs, h, w,
                         [v for v in dict.fromkeys(x.partition("@")[0] for x in
                                                   a.variants or ["plain", "fused"])
                          if v != "compiled"])
        with open(os.path.join(a.out, "vision_ops.json"), "w") as f:
            json.dump(res, f, indent=1)
        return

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
    towers = [Ours(visual, h, w, a.chunk_patches, v) for v in variants]
    ours = towers[0]
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": _version("transformers"),
            "config": "tiny" if a.tiny else "Qwen2.5-VL-7B vision", "params": n_params,
            "grid": [h, w], "dtype": str(dtype).replace("torch.", ""),
            "chunk_patches": a.chunk_patches, "pairs_per_chunk": ours.per_chunk,
            "variants": variants,
            "window_groups": [list(g) for g in ours.tower.layout(h, w, device).groups]}
    print(f"{info['config']} ({n_params / 1e9:.3f} B params) on {info['device']}, torch "
          f"{info['torch']}, transformers {info['transformers']}; {h}x{w} patches per pair, "
          f"{ours.per_chunk} pairs per chunk; variants {variants}; built in "
          f"{time.time() - t0:.0f} s", flush=True)
    rows = []

    def dump():
        with open(os.path.join(a.out, "vision.json"), "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)

    # the first chunk each variant ever runs: Triton JIT, cuBLAS handles, torch.compile; a
    # variant that cannot run here (an SDPA backend without a kernel for these shapes) is
    # reported and left out, so one failure does not lose the other rows of the run
    info["first_chunk_ms"], info["failed"] = {}, {}
    with torch.inference_mode():
        for tw in list(towers):
            try:
                info["first_chunk_ms"][tw.variant] = round(first_chunk(tw, S, width, device,
                                                                       dtype), 1)
            except Exception as e:  # noqa: BLE001
                info["failed"][tw.variant] = f"{type(e).__name__}: {e}"[:500]
                towers.remove(tw)
    print(json.dumps({"first_chunk_ms": info["first_chunk_ms"], "failed": info["failed"]}),
          flush=True)
    if not towers:
        dump()
        raise SystemExit("no variant of our tower ran")
    if a.check_pairs:
        info["fp32_check"] = fp32_check(visual, vision, towers, a.check_pairs, h, w, width,
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
            hf_ms = rows[-1]["ms"] if hf is not None else None
            for k, tw in enumerate(towers):
                first = {}
                ms, peak, before, got = timed(lambda: tw(pixels_of, n, device, dtype), device,
                                              a.reps, first)
                extra = {"input": source, "variant": tw.variant,
                         "first_ms": round(first["ms"], 1)}
                if hf is not None:
                    diff = (got.float() - hf.float()).abs()
                    extra.update(max_abs_diff=float(diff.max()),
                                 rel_max_diff=float(diff.max() / hf.float().abs().max()),
                                 mean_abs_diff=float(diff.mean()), speedup=hf_ms / ms)
                rows.append(row(f"ours[{tw.variant}]", n, ms, peak, before, got, **extra))
                print(json.dumps(rows[-1]), flush=True)
                dump()
                del got
                if k == 0 and not a.no_preprocess:
                    rows.append(with_preprocess(tw, vision, n, h, w, device, dtype, a.reps))
                    print(json.dumps(rows[-1]), flush=True)
                    dump()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del hf, full
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if a.gemms:
            info["gemms"] = gemm_rates(visual, ours.per_chunk * S, device, dtype, a.reps)
            dump()
        if a.profile:
            with open(os.path.join(a.out, "vision_profile.txt"), "w") as f:
                for tw in towers:
                    f.write(profile_chunk(tw, S, width, device, dtype) + "\n")
            print(f"profiles in {os.path.join(a.out, 'vision_profile.txt')}", flush=True)
    print_table(rows)


def gemm_rates(visual, tokens, device, dtype, reps):
    """Each GEMM of a block alone on ``tokens`` rows (one chunk), the MLP at the model's
    width and padded to ``INTER_ALIGN``: what the GEMM floor of the tower is on this device,
    and whether the width's alignment matters."""
    from mminfer.models.vision import INTER_ALIGN
    C = visual.blocks[0].attn.qkv.in_features
    inter = visual.blocks[0].mlp.gate_proj.out_features
    pad = -(-inter // INTER_ALIGN) * INTER_ALIGN
    shapes = {"qkv": (C, 3 * C), "proj": (C, C), "gate (model width)": (C, inter),
              "gate+up (padded)": (C, 2 * pad), "down (model width)": (inter, C),
              "down (padded)": (pad, C)}
    out = {}
    print(f"GEMMs alone, {tokens} rows:", flush=True)
    with torch.inference_mode():
        for name, (k, n) in shapes.items():
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            wt = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
            b = torch.randn(n, device=device, dtype=dtype)
            ms = timed(lambda: torch.nn.functional.linear(x, wt, b), device, max(reps, 5))[0]
            out[name] = {"k": k, "n": n, "ms": ms, "tflops": 2 * tokens * k * n / ms / 1e9}
            fp8_txt = ""
            if device.type == "cuda" and k % fp8_gemm.ALIGN == 0 and n % fp8_gemm.ALIGN == 0:
                # the FP8 layer's GEMM on operands already quantised, and its own
                # quantisation pass (what a producer kernel that quantises saves)
                lin = fp8.Fp8Linear(*fp8_quant.quantize_weight(wt), b)
                xq = fp8_quant.quantize_rows(x)
                ms8 = timed(lambda: lin(xq), device, max(reps, 5))[0]
                msq = timed(lambda: fp8_quant.quantize_rows(x), device, max(reps, 5))[0]
                out[name].update(fp8_ms=ms8, fp8_tflops=2 * tokens * k * n / ms8 / 1e9,
                                 quantize_ms=msq)
                fp8_txt = (f" | fp8 {ms8:8.3f} ms {out[name]['fp8_tflops']:7.1f} TFLOP/s, "
                           f"quantise {msq:6.3f} ms")
                del lin, xq
            print(f"  {name:<20} K={k:<5} N={n:<5} {ms:8.3f} ms {out[name]['tflops']:7.1f} "
                  f"TFLOP/s{fp8_txt}", flush=True)
            del x, wt, b
    return out


def profile_chunk(ours, S, width, device, dtype):
    """One chunk of a (warm) variant under torch.profiler: its kernels by device time."""
    pix = random_patches(0, ours.per_chunk, S, width, device, dtype)
    with torch.inference_mode():
        table = kernels_table(lambda: ours.tower(pix, ours.per_chunk, ours.h, ours.w,
                                                 pad_to=ours.per_chunk))
    text = f"== {ours.variant}: one chunk of {ours.per_chunk} pairs ==\n{table}"
    print(text, flush=True)
    return text


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
    return row(f"ours[{ours.variant}]+preprocess", n, ms, peak, before, out,
               input="uint8 frames on the host", variant=ours.variant)


def fp32_check(visual, vision, towers, n, h, w, width, device, dtype):
    """Ours (each variant) and transformers in ``dtype`` against transformers in fp32 on the
    same input; ours in fp32 with the fused (eager) tower."""
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
            got = {tw.variant: tw(lambda p0, p1: pix[p0 * S:p1 * S].to(dtype), n, device,
                                  dtype).float() for tw in towers}
            ours32 = QwenVisionTower(ref_visual)(pix, n, h, w).float()
    finally:
        del ref_visual
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    scale = float(ref.abs().max())
    err = lambda x: float((x - ref).abs().max())                          # noqa: E731
    out = {"pairs": n, "max_abs_feature": scale, "transformers_max_abs_err": err(hf),
           "ours_fp32_max_abs_err": err(ours32)}
    for v, x in got.items():
        out[f"ours_{v}_max_abs_err"] = err(x)
    out["ours_max_abs_err"] = out[f"ours_{towers[0].variant}_max_abs_err"]
    return out


# ---------------------------------------------------------------------- --ops
def _touched(t) -> int:
    """Bytes of the distinct elements a tensor addresses (a broadcast dim counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


# ops that write their output without reading it first, when called in place
_WRITE_ONLY = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_"}
# a custom op that touches part of a mutated argument: the fraction it reads and writes
_PART = {"vision_rotary_": 2 / 3}          # q and k of the qkv buffer, not v
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "linear"}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class _OpLog:
    """Every aten (and custom) op a forward dispatches, with its memory traffic; views,
    allocations and metadata ops cost nothing; SDPA is one op (as flash runs it)."""

    def __init__(self):
        self.ops = []

    def record(self, func, args, kwargs, out):
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        schema = getattr(func, "_schema", None)
        if schema is None or name in _FREE:
            return
        if name == "vision_window_attention":     # reads q, k, v once, writes o once
            qkv, groups, S, heads, d = args[0], args[3], args[4], args[5], args[6]
            P = qkv.shape[0] // S
            gflop = sum(4 * P * n * L * L * d * heads for n, L in
                        zip(groups[1::3], groups[2::3])) / 1e9
            self.ops.append({"op": name, "shape": [qkv.shape[0], heads * d],
                             "read_mb": _touched(qkv) / 1e6, "write_mb": _touched(out) / 1e6,
                             "gflop": gflop, "kind": "attention"})
            return
        rets = schema.returns
        if any(r.alias_info is not None and not r.alias_info.is_write for r in rets):
            return                                                         # a view
        bound = list(zip(schema.arguments, list(args) + [None] * len(schema.arguments)))
        for i, (arg, _) in enumerate(bound):
            if arg.name in kwargs:
                bound[i] = (arg, kwargs[arg.name])
        part = _PART.get(name, 1.0)
        reads = writes = 0
        for arg, val in bound:
            for t in (val if isinstance(val, (list, tuple)) else [val]):
                if not isinstance(t, torch.Tensor):
                    continue
                mutated = arg.alias_info is not None and arg.alias_info.is_write
                if not mutated or (arg.name != "out" and name not in _WRITE_ONLY):
                    reads += _touched(t) * (part if mutated else 1.0)
                if mutated:
                    writes += _touched(t) * part
        outs = out if isinstance(out, (list, tuple)) else [out]
        if not any(r.alias_info is not None for r in rets):
            writes += sum(_touched(t) for t in outs if isinstance(t, torch.Tensor))
        flops = 0
        if name == "linear":                                  # x @ weight.T
            flops = 2 * args[0].numel() * args[1].shape[0]
        elif name in _GEMMS:
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            flops = 2 * a.numel() * b.shape[-1]
        shape = next((list(t.shape) for t in outs if isinstance(t, torch.Tensor)), None)
        self.ops.append({"op": name,
                         "shape": shape, "read_mb": reads / 1e6, "write_mb": writes / 1e6,
                         "gflop": flops / 1e9,
                         "kind": "gemm" if flops else "elementwise"})

    def sdpa(self, q, k, v):
        B, H, L, d = q.shape
        S = k.shape[-2]
        io = sum(_touched(t) for t in (q, k, v)) + B * H * L * v.shape[-1] * q.element_size()
        self.ops.append({"op": "sdpa(flash)", "shape": [B, H, L, d], "read_mb": 0.75 * io / 1e6,
                         "write_mb": 0.25 * io / 1e6, "gflop": 4 * B * H * L * S * d / 1e9,
                         "kind": "attention"})


def _traced(log, fn):
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            log.record(func, args, kwargs, out)
            return out

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                q, k, v = args[:3]
                log.sdpa(q, k, v)
                B, H, L, _ = q.shape           # flash's output layout: [B, L, H, d] in memory
                return q.new_empty(B, L, H, v.shape[-1]).transpose(1, 2)
            return func(*args, **kwargs)

    with Functions(), Dispatch():
        return fn()


def op_listing(vision, pairs, h, w, variants):
    """Ops, bytes and FLOPs of the tower's forward over one chunk of ``pairs`` pairs of an
    ``h x w`` grid in bf16, on meta tensors (no device, no values), per variant."""
    visual = build_visual(vision, "meta", torch.bfloat16)
    hd = vision["hidden_size"] // vision["num_heads"]
    visual.rotary_pos_emb.inv_freq = torch.ones(hd // 4)       # values do not matter here
    S = h * w
    width = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    full = set(vision["fullatt_block_indexes"])
    res = {"config": vision, "grid": [h, w], "pairs": pairs, "tokens": pairs * S,
           "dtype": "bfloat16", "variants": {}}
    print(f"ops of one chunk: {pairs} pairs x {S} patches x {vision['hidden_size']} "
          f"(bf16, meta tensors; MB = 1e6 bytes)")
    for v in variants:
        tower = QwenVisionTower(visual, **VARIANTS[v], kernels="triton")
        lay = tower.layout(h, w, "meta")
        pix = torch.empty(pairs * S, width, device="meta", dtype=torch.bfloat16)
        log, marks = _OpLog(), []
        if v != "plain":
            tower.block_weights()          # made once per model, not per chunk: not counted
        fwd = tower._forward_fused if v != "plain" else tower._forward_modules
        with torch.no_grad():      # not inference_mode: composite ops decompose (aten.to...)
            _traced(log, lambda: fwd(pix, pairs, S, lay,
                                     trace=lambda i, x: marks.append(len(log.ops))))
        spans = [(0, marks[0])] + list(zip(marks, marks[1:])) + [(marks[-1], len(log.ops))]
        win = next(i for i in range(len(marks)) if i not in full and i > 0)
        ful = next(i for i in range(len(marks)) if i in full)
        blocks = {"window": log.ops[spans[win][0]:spans[win][1]],
                  "full": log.ops[spans[ful][0]:spans[ful][1]]}
        tot = _totals(log.ops, pairs)
        res["variants"][v] = {"window_block": blocks["window"], "full_block": blocks["full"],
                              "per_block": {k: _totals(o, pairs) for k, o in blocks.items()},
                              "whole_tower": tot}
        for kind, ops in blocks.items():
            print(f"\n[{v}] one {kind} block: {len(ops)} kernels")
            print(f"  {'op':<26} {'output':<22} {'read MB':>9} {'write MB':>9} {'GFLOP':>8}")
            for o in ops:
                print(f"  {o['op']:<26} {str(o['shape']):<22} {o['read_mb']:9.0f} "
                      f"{o['write_mb']:9.0f} {o['gflop']:8.0f}")
            t = _totals(ops, pairs)
            print(f"  non-GEMM traffic {t['elementwise_gb']:.2f} GB in {t['elementwise_ops']} "
                  f"kernels; GEMM {t['gemm_tflop']:.2f} TFLOP ({t['gemm_gb']:.2f} GB); "
                  f"attention {t['attention_gflop']:.0f} GFLOP ({t['attention_gb']:.2f} GB)")
        print(f"[{v}] whole tower, per pair: non-GEMM {tot['elementwise_gb_per_pair']:.3f} GB "
              f"in {tot['elementwise_ops']} kernels a chunk, GEMM "
              f"{tot['gemm_tflop_per_pair']:.3f} TFLOP, attention "
              f"{tot['attention_gflop_per_pair']:.1f} GFLOP")
    return res


def _totals(ops, pairs):
    ew = [o for o in ops if o["kind"] == "elementwise"]
    gm = [o for o in ops if o["kind"] == "gemm"]
    at = [o for o in ops if o["kind"] == "attention"]
    gb = lambda os_: sum(o["read_mb"] + o["write_mb"] for o in os_) / 1e3   # noqa: E731
    t = {"elementwise_ops": len(ew), "elementwise_gb": gb(ew), "gemm_ops": len(gm),
         "gemm_tflop": sum(o["gflop"] for o in gm) / 1e3, "gemm_gb": gb(gm),
         "attention_ops": len(at), "attention_gflop": sum(o["gflop"] for o in at),
         "attention_gb": gb(at)}
    t.update(elementwise_gb_per_pair=t["elementwise_gb"] / pairs,
             gemm_tflop_per_pair=t["gemm_tflop"] / pairs,
             attention_gflop_per_pair=t["attention_gflop"] / pairs)
    return t


def print_table(rows):
    print(f"{'impl':>26} {'pairs':>6} {'ms':>10} {'ms/pair':>8} {'peak GiB':>9} "
          f"{'work GiB':>9} {'speedup':>8} {'max|diff|':>10}")
    for r in rows:
        print(f"{r['impl']:>26} {r['pairs']:>6} {r['ms']:10.1f} {r['ms_per_pair']:8.2f} "
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
