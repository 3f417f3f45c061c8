"""LongVILA's vision stage as ``Pipeline.answer`` runs it, on random weights: the tower
(SigLIP-so400m-448 built as benchmarks/e2e.py writes it, 27 layers cut to the 26 of
``mm_vision_select_layer`` -2 by the adapter's own ``_truncate_tower``, sdpa), the
``mlp_downsample`` projector, and ``LongVILA.embed`` itself, ``--frames`` frames per tower
call (``LongVILA.vision_batch``, 32: 32K patch tokens). Three variants side by side:
bf16 through transformers' forward (what ``quantization=None`` runs), FP8 layers through
transformers' forward (the FP8 path before mminfer.models.siglip) and FP8 through
``siglip.Fp8Encoder`` (what ``quantization="fp8"`` runs now).

Per variant, CUDA events, median of ``--reps`` after a warm-up:
  * ``ms``: the encoder alone on one batch (the figure this script always printed), and the
    relative error of each FP8 output against bf16's;
  * ``stage_ms``: one batch of the e2e's "vision" section, ``LongVILA._encode`` (patch
    embeddings + encoder + projector);
  * ``video_vision_ms`` / ``video_preprocess_ms``: ``LongVILA.embed`` over ``--video-frames``
    frames (default the 1.05M case's 4096: 128 batches back to back), timed by the
    pipeline's own StageTimer: the e2e's "vision" and "preprocess" stages for that video.

Inputs (``--input``): ``video`` (default) the frames of the e2e's video
(``e2e.synthetic_frames``, 640x360, before its H.264 round trip) through the adapter's squash
and normalisation, as the pipeline does; ``noise`` uniform random uint8 frames (what e2e.py's
transformers baseline feeds its tower); ``randn`` the N(0, 1) encoder input this script fed
before (its video run then uses noise frames). Measured on the H200 (2026-12-04,
``benchmarks/results/2026-12-04-fp8-vision/siglip_*.log``): video and noise frames time within
1 % of each other (bf16 stage 67.8 / 68.3 ms a batch, 8.68 / 8.74 s a video, against the e2e's
8.76 s): this script now reconciles with the e2e. The earlier 84.5 ms a batch came from the
old script (``randn`` input, its own tower construction; not re-run), not from the stage.

    python benchmarks/siglip.py --out $OUT                      # on the GPU
    python benchmarks/siglip.py --input randn --video-frames 0  # the old measurement
    python benchmarks/siglip.py --tiny --out /tmp/s             # CPU smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.engine.timing import StageTimer  # noqa: E402
from mminfer.models import fp8, siglip  # noqa: E402
from mminfer.models.base import Prepared  # noqa: E402
from mminfer.models.longvila import (Layout, LongVILA, Projector, _truncate_tower,  # noqa: E402
                                     longvila_7b_llm_config, tokens_per_frame)
from cuda_events import events_ms, kernels_table  # noqa: E402  (benchmarks/: the script folder)
import e2e  # noqa: E402  (the e2e's tower config, video and cases: one source)

SELECT_LAYER = -2                  # lab/toy/tiny_longvila.write_longvila's, LongVILA's own
SO400M = e2e.SIGLIP_SO400M_448     # 27 layers; the adapter keeps 26
TINY = e2e.SIGLIP_TINY             # 3 layers; 2 kept
LLM_HIDDEN = longvila_7b_llm_config().hidden_size
TINY_LLM_HIDDEN = e2e.LONGVILA_TINY_LLM["hidden_size"]
NAMES = ("bf16 (transformers)", "fp8 (transformers' forward)", "fp8 (siglip.Fp8Encoder)")


class _Embedding(nn.Module):
    """The LLM's input embeddings, all ``embed`` reads of the text model (2 ids)."""

    def __init__(self, hidden, device, dtype):
        super().__init__()
        self.emb = nn.Embedding(2, hidden, device=device, dtype=dtype)

    def get_input_embeddings(self):
        return self.emb


def adapter(cfg, llm_hidden, batch, device, dtype) -> LongVILA:
    """A LongVILA adapter holding what ``LongVILA.load`` builds for the vision stage of
    e2e.py's checkpoint (same config, seed and construction as ``e2e.write_longvila``)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel
    vcfg = SiglipVisionConfig(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        vision = SiglipVisionModel._from_config(vcfg, dtype=dtype,
                                                attn_implementation="sdpa").eval()
        proj = Projector(vcfg.hidden_size, llm_hidden).to(dtype).eval()
    ad = LongVILA()
    ad.layout = Layout(root=Path("."), config={}, projector_type="mlp_downsample",
                       select_layer=SELECT_LAYER, num_video_frames=0,
                       image_size=vcfg.image_size, patch_size=vcfg.patch_size,
                       image_mean=(0.5,) * 3, image_std=(0.5,) * 3,   # its preprocessor's
                       pad_to_square=False, chat_template=None)       # "resize"
    ad.device, ad.dtype = torch.device(device), dtype
    ad.image_size = vcfg.image_size
    ad.tokens_per_frame = tokens_per_frame(vcfg.image_size, vcfg.patch_size)
    ad.tower = _truncate_tower(vision, SELECT_LAYER)
    ad.projector = proj
    ad.vision_batch = batch
    ad.video_token_id, ad.newline_id = 1, 0
    ad.text_model = _Embedding(llm_hidden, device, dtype)
    return ad


def variants(bf16: LongVILA) -> dict:
    """The three adapters, as ``LongVILA.load`` sets them up per ``quantization``."""
    q = copy.copy(bf16)
    q.tower = copy.deepcopy(bf16.tower)
    fp8.convert(q.tower, fp8.is_vision_linear)
    fused = copy.copy(q)
    fused.fp8_encoder = siglip.Fp8Encoder(q.tower.encoder)
    return dict(zip(NAMES, (bf16, q, fused)))


class Frames:
    """uint8 ``[n, H, W, 3]`` chunks of a video as the decoder's stream hands them over
    (``chunks``): e2e.py's synthetic video, or uniform noise."""

    def __init__(self, kind: str, n: int, height: int, width: int):
        self.kind, self.n, self.height, self.width = kind, n, height, width

    def chunks(self, k: int):
        if self.kind == "video":
            it = e2e.synthetic_frames(self.n, self.height, self.width)
            for s in range(0, self.n, k):
                yield np.stack([next(it) for _ in range(min(k, self.n - s))])
        else:
            rng = np.random.default_rng(0)
            for s in range(0, self.n, k):
                yield rng.integers(0, 256, (min(k, self.n - s), self.height, self.width, 3),
                                   dtype=np.uint8)


def prepared(ad: LongVILA, frames: Frames) -> Prepared:
    """The video's span of the prompt (no text around it: ``embed`` only needs the span)."""
    F, P = frames.n, ad.tokens_per_frame
    ids = torch.tensor([([ad.video_token_id] * P + [ad.newline_id]) * F])
    return Prepared(input_ids=ids, index=None, n_frames=F, visual_tokens=F * (P + 1),
                    text_tokens=0, prefix_len=F * (P + 1), tensors={"frames": frames})


class Clocks:
    """SM clock and board power sampled by nvidia-smi while the block runs (None without
    nvidia-smi); the power cap throttles the clock, so these say whether input data did."""

    def __init__(self, cuda: bool):
        self.on = cuda and shutil.which("nvidia-smi") is not None
        self.result = None

    def __enter__(self):
        if self.on:
            idx = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            self.p = subprocess.Popen(
                ["nvidia-smi", "-i", idx, "--query-gpu=clocks.sm,power.draw",
                 "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if not self.on:
            return
        self.p.terminate()
        out, _ = self.p.communicate()
        rows = []
        for line in out.splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:
                pass
        if rows:
            self.result = {"sm_mhz_median": statistics.median(r[0] for r in rows),
                           "power_w_mean": round(statistics.fmean(r[1] for r in rows), 1),
                           "samples": len(rows)}


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


def video_stage(ad: LongVILA, frames: Frames, cuda: bool) -> dict:
    """``LongVILA.embed`` over the whole video, timed as Pipeline.answer times it."""
    timer = StageTimer(ad.device)
    with Clocks(cuda) as clk, torch.inference_mode():
        t0 = time.perf_counter()
        embeds = ad.embed(prepared(ad, frames), timer=timer)
        ms = timer.totals_ms()                      # synchronises
        wall = (time.perf_counter() - t0) * 1e3
    del embeds
    return {"video_vision_ms": ms.get("vision", 0.0),
            "video_preprocess_ms": ms.get("preprocess", 0.0), "video_wall_ms": wall,
            **({"clocks": clk.result} if clk.result else {})}


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=LongVILA.vision_batch,
                    help="frames per tower call (default LongVILA.vision_batch)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--input", choices=("video", "noise", "randn"), default="video")
    ap.add_argument("--video-frames", type=int, default=None,
                    help="frames of the video run (default: the longvila1m case's 4096, "
                         "tiny-longvila's 16 with --tiny; 0 skips it)")
    ap.add_argument("--variants", nargs="+", choices=("bf16", "fp8", "fused"),
                    default=["bf16", "fp8", "fused"])
    ap.add_argument("--profile", action="store_true",
                    help="also profile one encoder call of each variant: its kernels by "
                         "device time (torch.profiler), tables in --out/siglip_profile.txt")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.tiny
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    case = e2e.tiny_cases()["tiny-longvila"] if a.tiny else e2e.full_cases()["longvila1m"]
    n_video = case.frames if a.video_frames is None else a.video_frames
    cfg = TINY if a.tiny else SO400M
    base = adapter(cfg, TINY_LLM_HIDDEN if a.tiny else LLM_HIDDEN, a.frames, dev, dtype)
    want = {NAMES[0]} | {dict(zip(("bf16", "fp8", "fused"), NAMES))[v] for v in a.variants}
    runs = {n: ad for n, ad in variants(base).items() if n in want}   # bf16: the reference
    S = base.image_size
    frame_kind = "video" if a.input == "video" else "noise"
    if a.input == "randn":
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(a.frames, 3, S, S, device=dev, dtype=dtype, generator=g)
    else:   # the first batch of the video, squashed and normalised as embed does
        chunk = next(Frames(frame_kind, a.frames, case.height, case.width).chunks(a.frames))
        x = base._normalise(base._squash(torch.as_tensor(chunk)))
    rows, profiles = {}, []
    with torch.inference_mode():
        h = base.tower.embeddings(x)
        ref = base.tower.encoder(inputs_embeds=h).last_hidden_state.float()
        for name, ad in runs.items():
            def enc(ad=ad):                # the encoder alone, on the same embeddings
                if ad.fp8_encoder is not None:
                    return ad.fp8_encoder(h.clone())              # it overwrites its input
                return ad.tower.encoder(inputs_embeds=h).last_hidden_state
            ms = timed(enc, cuda, a.reps)
            out = enc().float()
            stage = timed(lambda ad=ad: ad._encode(x), cuda, a.reps)
            rows[name] = {"ms": ms, "stage_ms": stage,
                          "rel_error_vs_bf16": float((out - ref).norm() / ref.norm())}
            print(f"{name:<30} encoder {ms:9.2f} ms  stage (embeddings+encoder+projector) "
                  f"{stage:9.2f} ms  rel err vs bf16 {rows[name]['rel_error_vs_bf16']:.4f}",
                  flush=True)
            del out
            if a.profile:
                profiles.append(f"== {name}: one encoder call of {a.frames} frames ==\n"
                                + kernels_table(enc))
    if profiles:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "siglip_profile.txt"), "w") as f:
            f.write("\n\n".join(profiles) + "\n")
        print("\n\n".join(profiles), flush=True)
    batches = -(-n_video // a.frames) if n_video else 0
    if n_video:
        for name, ad in runs.items():
            r = video_stage(ad, Frames(frame_kind, n_video, case.height, case.width), cuda)
            rows[name].update(r)
            clk = r.get("clocks")
            print(f"{name:<30} video: vision {r['video_vision_ms'] / 1e3:7.2f} s "
                  f"({r['video_vision_ms'] / batches:7.2f} ms/batch), preprocess "
                  f"{r['video_preprocess_ms'] / 1e3:6.2f} s"
                  + (f"; SM {clk['sm_mhz_median']:.0f} MHz, {clk['power_w_mean']:.0f} W"
                     if clk else ""), flush=True)
    ref_row = rows[NAMES[0]]
    for r in rows.values():
        r["speedup_vs_bf16"] = ref_row["ms"] / r["ms"]
        r["stage_speedup_vs_bf16"] = ref_row["stage_ms"] / r["stage_ms"]
        if n_video:
            r["video_speedup_vs_bf16"] = ref_row["video_vision_ms"] / r["video_vision_ms"]
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "frames": a.frames,
           "tokens": a.frames * (S // cfg["patch_size"]) ** 2,
           "layers": len(base.tower.encoder.layers), "image_size": S, "input": a.input,
           "video": {"case": case.name, "frames": n_video, "batches": batches,
                     "height": case.height, "width": case.width, "source": frame_kind},
           "env": {"torch": torch.__version__, "python": platform.python_version(),
                   "commit": _commit()},
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
    try:
        import transformers
        res["env"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "siglip.json"), "w") as f:
        json.dump(res, f, indent=1)
    if n_video:
        print(f"per video ({case.name}: {n_video} frames = {batches} batches of {a.frames}; "
              f"e2e 'vision' stage): " + ", ".join(
                  f"{n} {r['video_vision_ms'] / 1e3:.2f} s" for n, r in rows.items()))
    print(json.dumps({k: round(v["speedup_vs_bf16"], 3) for k, v in rows.items()}))


if __name__ == "__main__":
    main()
