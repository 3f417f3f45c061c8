"""End-to-end benchmark through ``Pipeline.answer``: the object the CLI, the server and the
batch job use, on full-size random-weight checkpoints written in the real layouts and
synthetic long video files, on one GPU (issue 11, item 4).

    python benchmarks/e2e.py --out out/e2e                       # the three issue-11 cases
    python benchmarks/e2e.py --cases qwen276k --frames qwen276k=512
    python benchmarks/e2e.py --tiny --out /tmp/e2e                # CPU smoke test, < 60 s
    python benchmarks/e2e.py --out out/e2e-fp8 --quantization fp8  # the FP8 rows (same cases)
    bash benchmarks/run_e2e_h200.sh                               # one device call (H200)

Cases (issue 11 targets; ``--cases`` picks, ``--frames CASE=N`` shortens):

  ``qwen115k``   Qwen2.5-VL-7B, 768 frames of a 1120x840 (4:3) H.264 file at 2 fps under
                 qwen-vl-utils' default pixel budget: each frame is resized to 560x420 = 300
                 merged tokens per frame pair (the most that budget gives 768 frames), 115,200
                 visual tokens; ``max_position_embeddings`` 128,000 as the real checkpoint.
                 Target: TTFT (all stages after decode) >= 3.5x the transformers default.
  ``qwen276k``   the same weights with a long-context config (``max_position_embeddings``
                 327,680 and a whole-video pixel budget of 768 frames x 768 tokens in
                 ``video_preprocessor_config.json``, both in a sibling checkpoint folder whose
                 weights are symbolic links to the first), 768 frames of a 1008x560 file kept
                 at 1008x560: 720 tokens per pair, 276,480 visual tokens.
                 Targets: >= 4x the transformers default, >= 2.5x our own dense mode.
  ``longvila1m`` LongVILA-7B (Qwen2-7B + SigLIP-so400m-448 + mlp_downsample projector) written
                 with the project's layout writer (``lab.toy.tiny_longvila.write_longvila``),
                 4096 frames of a 640x360 file at 2 fps, 257 tokens per frame: 1,052,672 visual
                 tokens (``max_position_embeddings`` raised to 1,064,960: 4096 frames are a
                 little over the real 1,048,576; ``--frames longvila1m=4076`` stays inside it).
                 Targets: answered on one H200 with peak GPU memory <= 110 GiB, TTFT >= 10x dense.

What each case does, in one process, on one Pipeline per checkpoint:

  1. warm-up: one sparse request (``--warmup``: the case's own video and length, ``short``:
     ``--warmup-frames`` frames of it, ``none``), excluded from the figures and reported as
     ``first_request`` (kernel compilation happens there);
  2. ``sparse`` and ``dense`` requests to ``Pipeline.answer`` on the same Pipeline: every stage
     from ``AnswerResult.timings_ms`` (decode, preprocess, vision, index, attention, llm_other,
     generate, ttft, total), peak GPU memory (``torch.cuda.max_memory_allocated``, reset per
     request) and peak host RSS (sampled every 10 ms during the request);
  3. a dense probe (benchmarks/dense_probe.py): decoder layers of the product's dense
     prefill (``prefill(..., layers=[i])``, the call a dense request makes: all heads, the
     attention hook's SDPA call and backend, the request's cache, headroom and precision) at
     the request's prefix length, one untimed call at that shape first, then CUDA-event timed
     calls (``--dense-layers`` layers spread over the model, or one layer
     ``--probe-repeats`` times; medians); on a GPU up to ``--cudnn-max-tokens``, a
     standalone cuDNN SDPA call at the same shape beside it (TFLOP/s over the causal
     triangle, target: ours within 5 % of cuDNN);
  4. the baseline, **transformers' default path**: our decode and preprocessing, then the
     transformers vision tower with ``sdpa`` attention over the whole video in one call
     (Qwen: ``get_video_features``; LongVILA: the SigLIP tower and projector 32 frames per
     call) and one one-shot dense prefill of the language model with transformers' ``sdpa``
     attention, the KV cache it makes (``use_cache=True``) and last-token logits: what
     ``generate`` does for its first token.

Where a run does not fit (length over ``--dense-max-tokens`` / ``--baseline-max-tokens``, or
an out-of-memory error), its TTFT is **extrapolated** and marked so (``"measured": false``):
dense = the sparse request's TTFT with its index and attention stages replaced by the dense
prefix's attention calls (the layers but the last, which writes K/V only) x the probe's
layer; the baseline = its measured decode, preprocess and vision (``--baseline-vision-frames``
frames, scaled per frame) + the sparse request's llm_other + layers x the probe's layer.
Where the dense request is measured, the probe is validated against it in the same run
(``probe_validation``: measured / probe attention, within 5 % or not); with ``--probe-factor
auto`` the run's longest validated case that disagrees corrects every extrapolated row by its
factor (marked, the uncorrected figure kept). Our rows run in ``--dtype`` or, with
``--quantization fp8`` / ``--kv-cache-dtype fp8``, FP8 for sparse and dense alike; the
transformers baseline stays in ``--dtype``: every row names its precision, and a ratio of
rows in different precisions is marked. Ratios are taken within the one run; the table at
the end prints them side by side, the JSON (``--out``/e2e.json, rewritten after every step)
has everything.

Device time on one H200, from the committed runs (benchmarks/results: 767efc9, the three
cases with ``--warmup short``, 329 s; 659a489, 1.05M with two sparse requests, 142 s) and one
dense layer's call there (~0.25 s at 115K, ~1.1 s at 276K, 15-20 s at 1.05M; the probe makes
1 + max(``--probe-repeats``, ``--dense-layers``) of them, cuDNN's comparison 1 + repeats):

  setup        Qwen checkpoint ~27 s, LongVILA's 21-30 s (videos written meanwhile by child
               processes); each Pipeline load ~3 s.
  qwen115k     first request (compiles the kernels) ~22 s, sparse ~7 s, probe and cuDNN ~3 s,
               dense ~10 s, transformers ~25 s: ~70 s.
  qwen276k     first request ~9 s, sparse ~13 s, probe and cuDNN ~12 s, dense ~42 s,
               transformers ~64 s: ~145 s.
  longvila1m   first request ~9 s, sparse 44-58 s, probe of 4 layers 75-100 s (dense and the
               baseline's prefill extrapolated), baseline vision on 512 frames ~3 s: ~170 s.
  total        ~7.5 min with ``--follow-ups 0`` (the repeated-questions step adds 20-90 s a
               case: the 1.05M host-tier offload alone took 68 s). ``--deadline-s`` skips
               (and marks) a step that would not end in time, and a TERM signal still writes
               the table, so the JSON and the table always come back.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import signal
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))      # dense_probe, when a probe runs

STAGES = ("restore", "decode", "preprocess", "vision", "index", "attention", "llm_other",
          "suffix", "generate",
          "ttft", "total")
GIB = 1024 ** 3
QUESTION = "what is moving in the video ?"
# the follow-ups of the repeated-questions step (multiple choice: short answers)
FOLLOW_UPS = ("what colour is the ball ?", "how many times does it bounce ?",
              "where is it at the end ?", "is there any text ?", "what is in the background ?",
              "which way does it move first ?", "is the camera moving ?",
              "how fast does it move ?", "does it leave the frame ?", "what shape is it ?",
              "is there more than one object ?", "what happens in the middle ?",
              "what happens at the start ?", "what is the last thing that moves ?",
              "is it day or night ?")

# Qwen2.5-VL-7B-Instruct's published config (config.json of the hub repo).
QWEN_7B_TEXT = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
    max_position_embeddings=128000, rms_norm_eps=1e-6, use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
QWEN_7B_VISION = dict(
    depth=32, hidden_size=1280, hidden_act="silu", intermediate_size=3420, num_heads=16,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    tokens_per_second=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
    out_hidden_size=3584)
# LongVILA-7B's SigLIP tower (paligemma-siglip-so400m-patch14-448; research/models.md).
SIGLIP_SO400M_448 = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    image_size=448, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
# qwen-vl-utils: at most 768 merged tokens (768 * 28 * 28 pixels) per frame.
QWEN_MAX_FRAME_PIXELS = 768 * 28 * 28


@dataclass
class Case:
    name: str
    model: str                      # "qwen" | "longvila"
    frames: int                     # frames the request asks for (max_frames)
    height: int                     # of the video file
    width: int
    video_fps: float = 2.0          # of the file; requests sample at ``fps``
    fps: float = 2.0
    checkpoint: str = ""            # key of the checkpoint it uses (one write per key)
    max_position: int = 128000
    total_pixels: int | None = None  # qwen: the checkpoint's whole-video pixel budget
    dense_max_tokens: int | None = None      # None: the command line's
    baseline_max_tokens: int | None = None
    warmup: str | None = None                # None: the command line's
    targets: dict = field(default_factory=dict)

    @property
    def video_name(self) -> str:
        return f"{self.name}_{self.frames}f_{self.width}x{self.height}.mp4"


def full_cases() -> dict:
    return {c.name: c for c in (
        Case("qwen115k", "qwen", 768, 840, 1120, checkpoint="qwen7b", max_position=128000,
             targets={"transformers_over_sparse_excl_decode": 3.5}),
        Case("qwen276k", "qwen", 768, 560, 1008, checkpoint="qwen7b-long",
             max_position=327680, total_pixels=768 * QWEN_MAX_FRAME_PIXELS // 2,
             targets={"transformers_over_sparse_excl_decode": 4.0,
                      "dense_over_sparse_excl_decode": 2.5}),
        Case("longvila1m", "longvila", 4096, 360, 640, checkpoint="longvila7b",
             max_position=1064960, warmup="short",
             targets={"dense_over_sparse": 10.0, "peak_gpu_gib_max": 110.0}),
    )}


def tiny_cases() -> dict:
    # tiny-longvila runs dense and the baseline only as extrapolations, so the smoke test
    # covers both kinds of figure; one short warm-up keeps the Triton interpreter's share
    # of the smoke test small.
    return {c.name: c for c in (
        Case("tiny-qwen", "qwen", 16, 112, 112, checkpoint="tiny-qwen", warmup="short"),
        Case("tiny-longvila", "longvila", 16, 112, 112, checkpoint="tiny-longvila",
             dense_max_tokens=0, baseline_max_tokens=0, warmup="none"),
    )}


# ============================================================================ small tools
class Events:
    """Named sections timed with CUDA events (read once, at the end) or the CPU clock."""

    def __init__(self, cuda: bool):
        import torch
        self.torch, self.cuda = torch, cuda
        self.pairs, self.cpu = {}, {}

    def __call__(self, name):
        return _Section(self, name)

    def ms(self) -> dict:
        out = {k: v * 1e3 for k, v in self.cpu.items()}
        if self.pairs:
            self.torch.cuda.synchronize()
            for k, pairs in self.pairs.items():
                out[k] = out.get(k, 0.0) + sum(s.elapsed_time(e) for s, e in pairs)
        return out


class _Section:
    def __init__(self, ev, name):
        self.ev, self.name = ev, name

    def __enter__(self):
        if self.ev.cuda:
            self.s = self.ev.torch.cuda.Event(enable_timing=True)
            self.s.record()
        else:
            self.t = time.perf_counter()

    def __exit__(self, *exc):
        if self.ev.cuda:
            e = self.ev.torch.cuda.Event(enable_timing=True)
            e.record()
            self.ev.pairs.setdefault(self.name, []).append((self.s, e))
        else:
            self.ev.cpu[self.name] = self.ev.cpu.get(self.name, 0.0) + time.perf_counter() - self.t


class RssPeak:
    """Peak resident set size of this process while the block runs (sampled every 10 ms)."""

    def __enter__(self):
        self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class GpuPeak:
    def __init__(self, device):
        import torch
        self.torch, self.cuda = torch, device.type == "cuda"
        self.allocated = self.reserved = None

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.allocated = self.torch.cuda.max_memory_allocated() / GIB
            self.reserved = self.torch.cuda.max_memory_reserved() / GIB


def free_memory():
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": traceback.format_exc(limit=6)[-3000:],
            "oom": type(e).__name__ == "OutOfMemoryError" or "out of memory" in str(e)}


class Clock:
    """The run's deadline: a step whose estimate does not fit is skipped and marked."""

    def __init__(self, deadline_s: float | None):
        self.t0, self.deadline = time.perf_counter(), deadline_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, estimate_s: float) -> bool:
        return self.deadline is None or self.elapsed() + estimate_s <= self.deadline


# ============================================================================ the video file
def synthetic_frames(n: int, height: int, width: int, seed: int = 0):
    """``n`` RGB frames: a drifting colour gradient, a fixed coarse texture and six boxes
    bouncing at their own speeds. Cheap to make and to encode, never flat."""
    import numpy as np
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / max(width - 1, 1), yy / max(height - 1, 1),
                     (xx + yy) / max(width + height - 2, 1)], -1) * 200
    cell = max(min(height, width) // 16, 1)
    tex = rng.integers(0, 48, (height // cell + 1, width // cell + 1, 3))
    base = (base + tex.repeat(cell, 0).repeat(cell, 1)[:height, :width]).astype(np.uint8)
    boxes = []
    for _ in range(6):
        bh, bw = int(rng.integers(height // 10 + 1, height // 4 + 2)), \
            int(rng.integers(width // 10 + 1, width // 4 + 2))
        boxes.append((bh, bw, rng.uniform(0, height - bh), rng.uniform(0, width - bw),
                      rng.uniform(-0.03, 0.03) * height, rng.uniform(-0.03, 0.03) * width,
                      rng.integers(0, 256, 3).astype(np.uint8)))
    shift = max(width // 97, 1)
    for i in range(n):
        f = np.roll(base, (i * shift) % width, axis=1)
        for bh, bw, y0, x0, vy, vx, colour in boxes:
            y = int(_bounce(y0 + vy * i, height - bh))
            x = int(_bounce(x0 + vx * i, width - bw))
            f[y:y + bh, x:x + bw] = colour
        yield f


def _bounce(p: float, span: float) -> float:
    if span <= 0:
        return 0.0
    p = p % (2 * span)
    return p if p <= span else 2 * span - p


def write_video(path, n: int, height: int, width: int, fps: float) -> dict:
    """H.264 (yuv420p, x264 ultrafast) with PyAV; MPEG-4 Part 2 with OpenCV where PyAV is
    missing (the GPU machine has opencv-python-headless; decord reads both)."""
    from fractions import Fraction
    path = Path(path)
    t0 = time.perf_counter()
    tmp = path.with_name(path.stem + ".partial" + path.suffix)
    try:
        import av
    except ImportError:
        av = None
    if av is not None:
        with av.open(str(tmp), "w", format="mp4") as c:
            s = c.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001),
                             options={"preset": "ultrafast", "crf": "23"})
            s.width, s.height, s.pix_fmt = width, height, "yuv420p"
            s.thread_type = "AUTO"
            for f in synthetic_frames(n, height, width):
                for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        codec, writer = "h264", "pyav"
    else:
        import cv2
        w = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        if not w.isOpened():
            raise RuntimeError(f"OpenCV cannot write {tmp}")
        for f in synthetic_frames(n, height, width):
            w.write(f[:, :, ::-1])
        w.release()
        codec, writer = "mpeg4", "opencv"
    tmp.replace(path)
    return {"path": str(path), "frames": n, "width": width, "height": height, "fps": fps,
            "codec": codec, "writer": writer, "bytes": path.stat().st_size,
            "write_s": round(time.perf_counter() - t0, 2)}


class VideoJobs:
    """Videos written by child processes (no CUDA, no GIL shared with the benchmark) while
    the parent writes checkpoints; ``get`` waits for one."""

    def __init__(self, work: Path, cases, background: bool):
        self.work, self.jobs, self.info = work, {}, {}
        for c in cases:
            path = work / c.video_name
            if path.name in self.jobs or path.name in self.info:
                continue
            args = [str(path), str(c.frames), str(c.height), str(c.width), str(c.video_fps)]
            if path.exists():
                self.info[path.name] = {"path": str(path), "reused": True,
                                        "bytes": path.stat().st_size}
            elif background:
                self.jobs[path.name] = subprocess.Popen(
                    [sys.executable, __file__, "--write-video", *args], stdout=subprocess.PIPE,
                    text=True)
            else:
                self.info[path.name] = write_video(path, c.frames, c.height, c.width,
                                                   c.video_fps)

    def get(self, case) -> dict:
        name = case.video_name
        if name in self.jobs:
            p = self.jobs.pop(name)
            out, _ = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"writing {name} failed (exit {p.returncode})")
            self.info[name] = json.loads(out.strip().splitlines()[-1])
        return self.info[name]

    def close(self, wait: bool = True):
        """Collect the finished writers' records; with ``wait`` False, stop the rest."""
        for name in list(self.jobs):
            p = self.jobs.pop(name)
            if not wait and p.poll() is None:
                p.kill()
                self.info[name] = {"killed": True}
                continue
            out, _ = p.communicate()
            if p.returncode == 0:
                self.info[name] = json.loads(out.strip().splitlines()[-1])


# ============================================================================ checkpoints
# --tiny goes through the same writers with these shapes (the tiny test checkpoints' sizes).
QWEN_TINY_TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
    max_position_embeddings=128000, rms_norm_eps=1e-6, use_sliding_window=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
QWEN_TINY_VISION = dict(
    depth=2, hidden_size=32, hidden_act="silu", intermediate_size=64, num_heads=2,
    in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    tokens_per_second=2, window_size=112, fullatt_block_indexes=[1], out_hidden_size=64)
QWEN_TINY_PIXELS = (28 * 28 * 4, 28 * 28 * 16)     # per frame: 4..16 tokens per frame pair
LONGVILA_TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
SIGLIP_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=2, image_size=56, patch_size=14)


def _dtype_for(device):
    import torch
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def write_qwen(path: Path, device, *, tiny: bool) -> None:
    """Qwen2.5-VL-7B's shapes (tiny: the test checkpoints'), random weights made on
    ``device`` (bf16 on a GPU), saved by the tiny checkpoint's writer (word tokenizer, chat
    template, processor configs; the tiny one with its small per-frame pixel range)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration
    from lab.toy.tiny import qwen2_5_vl_config, word_tokenizer, write_qwen2_5_vl

    tok = word_tokenizer()
    text = {**QWEN_TINY_TEXT, "vocab_size": -(-len(tok) // 64) * 64} if tiny else QWEN_7B_TEXT
    cfg = qwen2_5_vl_config(tok, text=text, vision=QWEN_TINY_VISION if tiny else QWEN_7B_VISION)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, dtype=_dtype_for(device))
    lo, hi = QWEN_TINY_PIXELS if tiny else (None, None)
    write_qwen2_5_vl(path, model.eval(), tok, min_pixels=lo, max_pixels=hi)
    del model


def long_context_variant(base: Path, path: Path, max_position: int,
                         total_pixels: int | None) -> None:
    """A checkpoint folder with ``base``'s weights (symbolic links) and a long-context config:
    ``max_position_embeddings`` raised, and the whole-video pixel budget in
    ``video_preprocessor_config.json`` (what ``mminfer answer --model`` then uses); the
    per-frame range stays ``base``'s (qwen-vl-utils' defaults when it has none)."""
    from mminfer.models.qwen2_5_vl import VIDEO_MIN_PIXELS
    from lab.toy.tiny import write_video_preprocessor_config

    path.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        dst = path / f.name
        if f.name in ("config.json", "video_preprocessor_config.json") or dst.exists():
            continue
        dst.symlink_to(f.resolve())
    cfg = json.loads((base / "config.json").read_text())
    found = [sec for sec in (cfg, cfg.get("text_config") or {}) if "max_position_embeddings" in sec]
    if not found:
        raise RuntimeError(f"{base}/config.json has no max_position_embeddings to raise")
    for section in found:
        section["max_position_embeddings"] = max_position
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    own = base / "video_preprocessor_config.json"
    size = json.loads(own.read_text()).get("size", {}) if own.is_file() else {}
    write_video_preprocessor_config(
        path, min_pixels=size.get("shortest_edge", VIDEO_MIN_PIXELS),
        max_pixels=size.get("longest_edge", QWEN_MAX_FRAME_PIXELS), total_pixels=total_pixels)


def write_longvila(path: Path, device, *, tiny: bool, max_position: int,
                   num_frames: int) -> None:
    """LongVILA-7B's shapes (Qwen2-7B LLM of the 1M stage, SigLIP-so400m-448, 2x2
    ``mlp_downsample`` projector; tiny: the test checkpoints'), random weights made on
    ``device``, saved in the real layout by the project's LongVILA writer."""
    import torch
    from transformers import Qwen2ForCausalLM, SiglipVisionConfig, SiglipVisionModel
    from mminfer.models.longvila import Projector, longvila_7b_llm_config
    from lab.toy.tiny_longvila import tiny_tokenizer, write_longvila as write_layout

    tok = tiny_tokenizer()
    lcfg = longvila_7b_llm_config(**(LONGVILA_TINY_LLM if tiny else {}),
                                  max_position_embeddings=max_position,
                                  bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    vcfg = SiglipVisionConfig(**(SIGLIP_TINY if tiny else SIGLIP_SO400M_448))
    dtype = _dtype_for(device)
    torch.manual_seed(0)
    with torch.device(device):
        vision = SiglipVisionModel._from_config(vcfg, dtype=dtype).eval()
        llm = Qwen2ForCausalLM._from_config(lcfg, dtype=dtype).eval()
        proj = Projector(vcfg.hidden_size, lcfg.hidden_size).to(dtype)
    write_layout(path, vision, llm, proj, tok, num_video_frames=num_frames,
                 model_dtype=str(dtype))
    del vision, llm, proj


def ensure_checkpoint(case: Case, work: Path, device, tiny: bool, done: dict) -> tuple[Path, dict]:
    """The case's checkpoint folder, written once per key (a folder already holding a
    config.json is used as it is); returns (path, what it cost)."""
    key = case.checkpoint
    path = work / key
    if key in done:
        return path, {"reused_in_run": key}
    info = {}
    t0 = time.perf_counter()
    if (path / "config.json").is_file():
        info["reused_on_disk"] = True
    elif case.model == "longvila":
        write_longvila(path, device, tiny=tiny, max_position=case.max_position,
                       num_frames=case.frames)
    elif case.total_pixels is None and \
            case.max_position == QWEN_7B_TEXT["max_position_embeddings"]:
        write_qwen(path, device, tiny=tiny)
    else:
        base = work / ("tiny-qwen" if tiny else "qwen7b")
        if not (base / "config.json").is_file():
            write_qwen(base, device, tiny=tiny)
            info["base_write_s"] = round(time.perf_counter() - t0, 2)
        long_context_variant(base, path, case.max_position, case.total_pixels)
        info["weights_from"] = str(base)
    free_memory()
    info["write_s"] = round(time.perf_counter() - t0, 2)
    info["bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()
                        and not f.is_symlink())
    info["path"] = str(path)
    done[key] = info
    return path, info


# ============================================================================ requests
def request(pipe, case: Case, video: str, mode: str, args, *, frames: int | None = None,
            question: str = QUESTION, use_cache: bool = False,
            max_new_tokens: int | None = None) -> dict:
    """One ``Pipeline.answer``: its stages, tokens, sparsity and peak memory. The video cache
    is off unless ``use_cache`` (each first-question figure builds its prefix)."""
    entry = {"mode": mode, "measured": True, "path": "Pipeline.answer",
             "precision": precision(args)}
    t0 = time.perf_counter()
    try:
        with RssPeak() as rss, GpuPeak(pipe.device) as gpu:
            res = pipe.answer(video, question, fps=case.fps, max_frames=frames or case.frames,
                              max_new_tokens=max_new_tokens or args.max_new_tokens,
                              attention=mode, use_cache=use_cache)
    except Exception as e:     # an OOM or an input error is a result; the run goes on
        entry.update(_error(e), wall_s=round(time.perf_counter() - t0, 2))
    if "error" in entry:       # outside the handler: its traceback holds the request's tensors
        free_memory()
        return entry
    t = {k: _num(res.timings_ms.get(k)) for k in STAGES}
    sp = res.sparsity or {}
    entry.update(
        timings_ms=t, ttft_excl_decode_ms=_sub(t["ttft"], t["decode"]),
        attention_ran=res.attention, tokens=dict(res.tokens), video=dict(res.video),
        sparsity={k: sp[k] for k in ("mean_density", "mean_tile_work", "uncalibrated")
                  if k in sp} or None,
        peak_gpu_gib=_r(gpu.allocated), peak_gpu_reserved_gib=_r(gpu.reserved),
        peak_rss_gib=_r(rss.peak / GIB), wall_s=round(time.perf_counter() - t0, 2),
        answer=str(res.answer)[:120], cache=res.cache)
    return entry


def profiled(fn, path: Path):
    """``fn()`` under cProfile (Python functions, Triton's compiler included, by cumulative
    time) and torch.profiler (ops by host time, then by CUDA time), the costliest 30 of
    each to ``path``: where a follow-up's time goes."""
    import cProfile
    import io
    import pstats

    import torch   # lazy: as everywhere in this script, torch loads after the video work
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    py = cProfile.Profile()
    with torch.profiler.profile(activities=acts) as prof:
        py.enable()
        out = fn()
        py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("cumulative").print_stats(40)
    ka = prof.key_averages()
    path.write_text(text.getvalue() + "\n\n" +
                    ka.table(sort_by="cpu_time_total", row_limit=30) + "\n\n" +
                    (ka.table(sort_by="cuda_time_total", row_limit=30)
                     if torch.cuda.is_available() else ""))
    return out


def repeated_questions(pipe, case: Case, video: str, mode: str, args) -> dict:
    """Questions about one video on one Pipeline with the video cache on (8 new tokens each,
    as for multiple choice): the first builds the prefix (a miss), the follow-ups continue it
    from the GPU tier (``--follow-ups`` of them), then one from the host tier (the entry
    offloaded to pinned host memory first). Throughput of k questions per video: with the
    cache, the first question's total + the next k-1 follow-ups' totals as measured; from
    scratch (every question a miss, as before the cache), k x the first question's total."""
    out = {"mode": mode, "max_new_tokens": 8}
    cache = pipe.video_cache
    cache.clear()
    first = request(pipe, case, video, mode, args, question=QUESTION, use_cache=True,
                    max_new_tokens=8)
    out["first"] = first
    if "timings_ms" not in first:
        return out
    hits = []
    for i, q in enumerate(FOLLOW_UPS[:max(args.follow_ups, 2)]):
        if i == 0 and args.profile_follow_up:
            hits.append(profiled(lambda: request(pipe, case, video, mode, args, question=q,
                                                 use_cache=True, max_new_tokens=8),
                                 Path(args.out) / f"profile_follow_up_{case.name}.txt"))
            continue
        hits.append(request(pipe, case, video, mode, args, question=q, use_cache=True,
                            max_new_tokens=8))
    out["follow_ups"] = hits
    ok = [h for h in hits if "timings_ms" in h]
    if ok:
        ttfts = sorted(h["timings_ms"]["ttft"] for h in ok)
        out["follow_up_ttft_ms"] = {"median": ttfts[(len(ttfts) - 1) // 2], "min": ttfts[0],
                                    "max": ttfts[-1], "n": len(ttfts)}
        out["cache_statuses"] = [h.get("cache") for h in ok]
    first_total = first["timings_ms"]["total"]
    tp = {}
    for k in (1, 3, 15):
        if k - 1 > len(ok):
            continue
        cached = first_total + sum(h["timings_ms"]["total"] for h in ok[:k - 1])
        scratch = k * first_total
        tp[str(k)] = {"cached_s": round(cached / 1e3, 3), "scratch_s": round(scratch / 1e3, 3),
                      "questions_per_s_cached": round(k / (cached / 1e3), 4),
                      "questions_per_s_scratch": round(k / (scratch / 1e3), 4),
                      "speedup": round(scratch / cached, 3)}
    out["throughput"] = tp
    out["kv_bytes"] = cache.stats()["gpu_bytes"]
    if args.host_tier:
        t0 = time.perf_counter()
        try:
            cache.host_budget = max(cache.host_budget, out["kv_bytes"] + (1 << 30))
            moved = cache.offload()
            out["offload_s"] = round(time.perf_counter() - t0, 2)
            out["offloaded"] = moved
            out["host"] = request(pipe, case, video, mode, args, question=FOLLOW_UPS[0],
                                  use_cache=True, max_new_tokens=8)
        except Exception as e:     # pinned host memory can run out: a result too
            out["host"] = _error(e)
    out["stats"] = cache.stats()
    cache.clear()
    free_memory()
    return out


def _num(v):
    return None if v is None else round(float(v), 3)


def _sub(a, b):
    return None if a is None or b is None else round(a - b, 3)


def _r(v, n=3):
    return None if v is None else round(float(v), n)


# ---------------------------------------------------------------- transformers' default path
TIMED_SDPA = "e2e_timed_sdpa"     # never "flash" in the name: transformers treats it as FA
_sdpa_timer = threading.local()


def _timed_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' own ``sdpa_attention_forward``, with CUDA events around it so the
    baseline prefill splits into attention and the rest."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    ev = getattr(_sdpa_timer, "events", None)
    if ev is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with ev("attention"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_timed_sdpa():
    from transformers import AttentionInterface
    AttentionInterface.register(TIMED_SDPA, _timed_sdpa)
    try:   # the causal mask sdpa gets (None for one unpadded prompt: is_causal)
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        AttentionMaskInterface.register(TIMED_SDPA, sdpa_mask)
    except ImportError:
        pass


class attn_impl:
    """Temporarily run a (sub)model's attention through another registered implementation."""

    def __init__(self, config, name):
        self.config, self.name = config, name

    def __enter__(self):
        self.old = self.config._attn_implementation
        self.config._attn_implementation = self.name

    def __exit__(self, *exc):
        self.config._attn_implementation = self.old


def _is_transformers(module) -> bool:
    return type(module).__module__.startswith("transformers.")


def baseline(pipe, case: Case, video: str, args, *, run_prefill: bool, vision_frames: int,
             sparse: dict | None, probe: dict | None) -> dict:
    """transformers' default path on this Pipeline's weights (see the module docstring).
    The prefill is measured when ``run_prefill``, else extrapolated from the probe; then a
    LongVILA request decodes and encodes only ``vision_frames`` frames (its tokens per frame
    are fixed) and takes decode and preprocess from the sparse request (the same code)."""
    import torch
    from mminfer import video as videolib

    ad = pipe.adapter
    dev = pipe.device
    entry = {"mode": "transformers", "path": "transformers default (sdpa tower, one-shot "
             "sdpa prefill)", "measured": True, "extrapolated": [],
             "precision": precision(args, ours=False)}
    if not run_prefill and _extrapolated_prefill(sparse, probe) is None:
        entry["error"] = "prefill not run and nothing to extrapolate it from (no sparse " \
                         "request or probe)"
        return entry
    subset = case.model == "longvila" and not run_prefill and vision_frames < case.frames
    ev = Events(dev.type == "cuda")
    t0 = time.perf_counter()
    try:
        with RssPeak() as rss, GpuPeak(dev) as gpu:
            t = time.perf_counter()
            decoded = videolib.decode(video, sampling=ad.sampling, fps=case.fps,
                                      max_frames=vision_frames if subset else case.frames)
            decode_ms = (time.perf_counter() - t) * 1e3
            with ev("preprocess"):
                prep = ad.prepare(decoded, QUESTION)
            del decoded
            L = int(prep.input_ids.shape[1])
            tokens = {"total": L, "visual": prep.visual_tokens, "text": prep.text_tokens}
            with torch.inference_mode():
                if case.model == "qwen":
                    embeds, note = _qwen_vision(ad, prep, ev, run_prefill, sparse)
                else:
                    embeds, note = _longvila_vision(ad, prep, ev, run_prefill)
                entry["vision_inputs"] = note
                if run_prefill:
                    pos = ad.positions(prep, 0, L)
                    register_timed_sdpa()
                    _sdpa_timer.events = ev
                    try:
                        with attn_impl(ad.text_model.config, TIMED_SDPA), ev("prefill"):
                            kw = {} if pos is None else {"position_ids": pos}
                            out = ad.text_model(inputs_embeds=embeds, use_cache=True, **kw)
                            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") \
                                else out[0]
                            ad.lm_head(hidden[:, -1:]).argmax(-1)
                    finally:
                        _sdpa_timer.events = None
                    del out, hidden
                del embeds
                prep.tensors.clear()   # the patches on the GPU
        ms = ev.ms()
    except Exception as e:
        entry.update(_error(e), wall_s=round(time.perf_counter() - t0, 2))
    free_memory()
    if "error" in entry:
        return entry
    t = {"decode": decode_ms, "preprocess": ms.get("preprocess"), "vision": ms.get("vision"),
         "index": 0.0, "generate": None, "total": None}
    if subset:
        frames = int(prep.n_frames)
        entry.update(vision_measured_frames=frames, vision_scale=case.frames / frames)
        t["vision"] *= case.frames / frames
        s = sparse["timings_ms"]
        t["decode"], t["preprocess"] = s["decode"], s["preprocess"]
        tokens = sparse.get("tokens") or tokens
        entry["extrapolated"] += ["vision (per frame)", "decode and preprocess (the sparse "
                                  "request's)"]
    if run_prefill:
        t["attention"] = ms.get("attention", 0.0)
        t["llm_other"] = max(ms["prefill"] - t["attention"], 0.0)
    else:
        # the one-shot prefill attends over the whole prompt in every layer
        t.update(_extrapolated_prefill(sparse, probe, probe["layers"]))
        entry["extrapolated"] += ["attention (our dense probe's layer x layers)",
                                  "llm_other (the sparse request's)"]
    entry["measured"] = not entry["extrapolated"]
    t["ttft"] = sum(t[k] for k in ("decode", "preprocess", "vision", "attention", "llm_other"))
    entry.update(timings_ms={k: _num(t.get(k)) for k in STAGES},
                 ttft_excl_decode_ms=_num(t["ttft"] - t["decode"]), tokens=tokens,
                 peak_gpu_gib=_r(gpu.allocated), peak_gpu_reserved_gib=_r(gpu.reserved),
                 peak_rss_gib=_r(rss.peak / GIB), wall_s=round(time.perf_counter() - t0, 2))
    if not entry["measured"]:
        entry["peak_note"] = "peak memory of the part that ran"
    return entry


def _qwen_vision(ad, prep, ev, need_embeds: bool, sparse: dict | None):
    """``get_video_features`` of transformers' Qwen2.5-VL tower (sdpa), whole video, one call,
    then the splice into the text embeddings (what our vision stage also covers); a fresh
    transformers tower of the same config when the adapter's is not transformers'."""
    import torch
    ids = prep.input_ids
    tens = prep.tensors
    pix, grid = tens.get("pixel_values_videos"), tens.get("video_grid_thw")
    note = "prepared"
    if pix is None or grid is None:
        # preprocessing no longer hands over all patches at once (streamed into the tower):
        # the tower's time does not depend on pixel values, so patches of the request's shape
        pix, grid = _qwen_patches_like(ad, sparse)
        note = "synthetic patches of the sparse request's shape"
    model = getattr(getattr(ad, "model", None), "model", None)
    visual = getattr(model, "visual", None)
    if visual is not None and _is_transformers(visual):
        run = lambda: model.get_video_features(pix, grid)      # noqa: E731
    else:
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
        with torch.device(pix.device):
            visual = m.Qwen2_5_VisionTransformerPretrainedModel._from_config(
                ad.vcfg, dtype=ad.dtype).eval()
        run = lambda: visual(pix, grid_thw=grid)               # noqa: E731
        note += "; fresh transformers tower (the adapter's is not transformers')"
    embeds = None
    with attn_impl(visual.config, "sdpa"), ev("vision"):
        out = run()
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (tuple, list)):
            feats = torch.cat(list(feats), 0)
        if need_embeds:
            embeds = ad.text_model.get_input_embeddings()(ids)
            mask = (ids == ad.video_token_id).unsqueeze(-1)
            if feats.shape[0] == prep.visual_tokens:
                embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
            else:
                note += f"; tower gave {feats.shape[0]} rows for {prep.visual_tokens} tokens"
    return embeds, note


def _qwen_patches_like(ad, sparse: dict | None):
    import torch
    video = (sparse or {}).get("video") or {}
    if not video.get("resized") or not video.get("model_frames"):
        raise RuntimeError("the adapter's Prepared has no pixel_values_videos and the sparse "
                           "request gave no resized frame size to rebuild their shape")
    v = ad.vcfg
    t = int(video["model_frames"]) // v.temporal_patch_size
    h, w = (int(x) // v.patch_size for x in video["resized"])
    pix = torch.randn(t * h * w, 3 * v.temporal_patch_size * v.patch_size ** 2,
                      device=ad.device, dtype=ad.dtype)
    return pix, torch.tensor([[t, h, w]], device=ad.device)


def _longvila_vision(ad, prep, ev, need_embeds: bool):
    """transformers' SigLIP tower (sdpa, truncated at VILA's feature layer) + the projector,
    32 frames per call (the adapter's batching before issue 11), then the splice."""
    import torch
    import numpy as np
    pixels = prep.tensors.get("pixels")                 # [F, 3, S, S] uint8
    note = "prepared"
    if pixels is None:       # frames streamed elsewhere: the time does not depend on values
        S = int(ad.layout.image_size)
        rng = np.random.default_rng(0)
        pixels = torch.from_numpy(rng.integers(0, 256, (prep.n_frames, 3, S, S), np.uint8))
        note = "synthetic frames of the prepared count and size"
    tower = getattr(ad, "tower", None)
    if tower is None or not _is_transformers(tower):
        from transformers import SiglipVisionConfig, SiglipVisionModel
        vcfg = SiglipVisionConfig.from_pretrained(ad.layout.root / "vision_tower")
        with torch.device(ad.device):
            tower = SiglipVisionModel._from_config(vcfg, dtype=ad.dtype).eval()
        tower = getattr(tower, "vision_model", tower)   # older transformers nest it
        n = len(tower.encoder.layers)
        sel = ad.layout.select_layer
        tower.encoder.layers = tower.encoder.layers[:sel if sel >= 0 else n + 1 + sel]
        note += "; fresh transformers tower (the adapter's is not transformers')"
    projector = getattr(ad, "projector", None)
    if projector is None:
        from mminfer.models.longvila import load_projector
        projector = load_projector(ad.layout.root / "mm_projector", tower.config.hidden_size,
                                   ad.text_model.config.hidden_size).to(ad.device, ad.dtype)
    mean = torch.tensor(ad.layout.image_mean, device=ad.device).view(1, 3, 1, 1)
    std = torch.tensor(ad.layout.image_std, device=ad.device).view(1, 3, 1, 1)
    embeds = None
    with attn_impl(tower.config, "sdpa"), ev("vision"):
        outs = []
        for chunk in pixels.split(32):
            x = ((chunk.to(ad.device).float().div_(255) - mean) / std).to(ad.dtype)
            h = tower.embeddings(x)
            h = tower.encoder(inputs_embeds=h)
            h = h[0] if isinstance(h, tuple) else h.last_hidden_state
            outs.append(projector(h))
        visual = torch.cat(outs)
        if need_embeds:
            ids = prep.input_ids.to(ad.device)
            is_vis = ids == ad.video_token_id
            embeds = ad.text_model.get_input_embeddings()(ids.masked_fill(is_vis, 0))
            embeds[is_vis] = visual.reshape(-1, visual.shape[-1]).to(embeds.dtype)
    return embeds, note


# ---------------------------------------------------------------- dense attention probe
def _dense_probe():
    import dense_probe    # benchmarks/dense_probe.py; imports torch, so loaded when used
    return dense_probe


def precision(args, ours: bool = True) -> str:
    """What a row computes in: our rows follow --quantization / --kv-cache-dtype, the
    transformers baseline stays in --dtype."""
    p = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        args.dtype, args.dtype or "default dtype")
    if ours and args.quantization:
        p = f"{args.quantization} linear"
    if ours and args.kv_cache_dtype not in (None, "auto"):
        p += " + fp8 KV"
    return p


def probe_dense(pipe, entry: dict, args) -> dict:
    """Our dense prefill's cost per layer at ``entry``'s length (a request of this case), on
    the call a dense request makes (benchmarks/dense_probe.py): the prefix's length, the
    request's cache, headroom and precision, ``--dense-layers`` layers spread over the model
    (each timed once; one layer ``--probe-repeats`` times) after one untimed call at that
    shape. On a GPU up to ``--cudnn-max-tokens``, a standalone cuDNN SDPA call at the same
    shape beside it."""
    dp = _dense_probe()
    tok = entry.get("tokens") or {}
    n = int(tok.get("prefix") or tok["total"])
    from mminfer.models.kv import tail_rows
    # the Pipeline's: a prefix is built with a tail where a lone question's rows go: a kept
    # one tail_rows, one kept by nobody (cache off) its own question's and answer's rows
    headroom = tail_rows(n) if entry.get("cache") != "off" else \
        int(tok["total"]) - n + int(args.max_new_tokens)
    ad = pipe.adapter
    try:
        out = dp.probe_layers(ad.text_model, n, layers=args.dense_layers,
                              repeats=args.probe_repeats, chunk=ad.prefill_chunk,
                              kv_dtype=ad.kv_cache_dtype, headroom=headroom,
                              context=pipe.prefill_context)
    except Exception as e:
        out = {"tokens": n, **_error(e)}
    free_memory()
    out["precision"] = precision(args)
    if "error" in out or pipe.device.type != "cuda" or n > args.cudnn_max_tokens:
        return out
    ref = dp.cudnn_reference(n, out["heads"], out["kv_heads"], out["head_dim"],
                             device=pipe.device, dtype=pipe.dtype,
                             scale=ad.text_model.layers[0].self_attn.scaling,
                             repeats=args.probe_repeats)
    out["cudnn"] = ref
    out["versus_cudnn"] = dp.versus_cudnn(out, ref)
    free_memory()
    return out


def _extrapolated_prefill(sparse: dict | None, probe: dict | None,
                          calls: int | None = None) -> dict | None:
    """A dense prefill from measured parts: ``calls`` attention calls (default: a dense
    prefix's, the model's layers but the last) x the probe's per-layer attention, and the
    sparse request's llm_other (the same projections, MLPs and cache writes, measured in
    full)."""
    if not sparse or "timings_ms" not in sparse or not probe or "attention_ms" not in probe:
        return None
    calls = probe["attention_calls"] if calls is None else calls
    return {"attention": round(probe["attention_ms"] * calls, 3),
            "llm_other": sparse["timings_ms"]["llm_other"] or 0.0}


def extrapolated_dense(sparse: dict | None, probe: dict | None) -> dict:
    """The dense request's row from the sparse request's and the probe: the sparse TTFT with
    its index and attention stages replaced by the dense prefix's attention calls x the
    probe's layer (every other stage, decoding's overlap with vision included, is the same
    code in both modes)."""
    x = _extrapolated_prefill(sparse, probe)
    entry = {"mode": "dense", "measured": False, "path": "extrapolated",
             "extrapolated": ["attention", "llm_other", "decode", "preprocess", "vision"]}
    if x is None:
        entry["error"] = "no sparse request or probe to extrapolate from"
        return entry
    entry["how"] = (f"the sparse request's TTFT - its index and attention + "
                    f"{probe['attention_calls']} attention calls x the probe's layer "
                    f"({len(probe['layers_timed'])} of {probe['layers']} layers measured in "
                    f"full through the product's dense prefill)")
    entry["layers_measured"] = probe["layers_timed"]
    entry["precision"] = sparse.get("precision")
    s = sparse["timings_ms"]
    t = {k: s.get(k) for k in STAGES}
    t.update(index=0.0, **x)
    t["ttft"] = (s["ttft"] - (s.get("index") or 0.0) - (s.get("attention") or 0.0)
                 + x["attention"] + x["llm_other"] - (s.get("llm_other") or 0.0))
    t["total"] = t["ttft"] + ((s.get("total") or s["ttft"]) - s["ttft"])
    entry.update(timings_ms={k: _num(t.get(k)) for k in STAGES},
                 ttft_excl_decode_ms=_num(t["ttft"] - (t["decode"] or 0.0)),
                 tokens=sparse.get("tokens"))
    return entry


def validate_probe(dense: dict | None, sparse: dict | None, probe: dict | None) -> dict | None:
    """The probe's dense row against the dense request measured in the same run: their
    attention stages' ratio (``factor`` = measured / probe; agreement within 5 %) and
    TTFTs'."""
    if not dense or "timings_ms" not in dense or not dense.get("measured", True):
        return None
    x = extrapolated_dense(sparse, probe)
    if "timings_ms" not in x:
        return None
    m, e = dense["timings_ms"], x["timings_ms"]
    if not m.get("attention") or not e.get("attention"):
        return None
    f = m["attention"] / e["attention"]
    within = _dense_probe().WITHIN
    return {"tokens": probe["tokens"], "measured_attention_ms": m["attention"],
            "probe_attention_ms": e["attention"], "factor": round(f, 4),
            "within": abs(f - 1) <= within, "tolerance": within,
            "measured_ttft_ms": m["ttft"], "probe_ttft_ms": e["ttft"],
            "ttft_factor": round(m["ttft"] / e["ttft"], 4),
            "measured_llm_other_ms": m.get("llm_other"),
            "sparse_llm_other_ms": sparse["timings_ms"].get("llm_other"),
            "probe_rest_x_layers_ms": _num(probe["rest_ms"] * probe["layers"])}


def probe_correction(report: dict, setting) -> dict | None:
    """The factor extrapolated rows are multiplied by: ``--probe-factor X``; ``auto`` (the
    default): the validation of this run's longest case whose probe and measured dense run
    disagree by more than 5 %, nothing when they agree or none ran; ``none``: never."""
    if setting in (None, "none"):
        return None
    if setting != "auto":
        return {"factor": float(setting), "from": "--probe-factor"}
    vals = [(v["tokens"], name, v) for name, rec in report["cases"].items()
            if (v := rec.get("probe_validation"))]
    if not vals:
        return None
    _, name, v = max(vals, key=lambda x: x[0])
    if v["within"]:
        return None
    return {"factor": v["factor"], "from": f"{name} in this run (measured / probe)"}


def correct_extrapolated(R: dict, corr: dict | None) -> None:
    """Multiply the probe-derived attention of every extrapolated row by ``corr``'s factor
    (once), keeping the uncorrected figure and saying so in the row."""
    if not corr:
        return
    for e in R.values():
        if e.get("measured", True) or "timings_ms" not in e or "probe_factor" in e:
            continue
        t = e["timings_ms"]
        if t.get("attention") is None:
            continue
        d = t["attention"] * (corr["factor"] - 1)
        e["attention_uncorrected_ms"] = t["attention"]
        for k in ("attention", "ttft", "total"):
            if t.get(k) is not None:
                t[k] = _num(t[k] + d)
        if e.get("ttft_excl_decode_ms") is not None:
            e["ttft_excl_decode_ms"] = _num(e["ttft_excl_decode_ms"] + d)
        e["probe_factor"] = corr


# ============================================================================ one case
def run_case(case: Case, args, work: Path, videos: VideoJobs, ckpts: dict, clock: Clock,
             report: dict, save) -> None:
    import torch
    from mminfer.engine.pipeline import Pipeline

    rec = report["cases"].setdefault(case.name, {})
    rec["case"] = asdict(case)
    rec["requests"] = {}
    dense_max = case.dense_max_tokens if case.dense_max_tokens is not None else args.dense_max_tokens
    base_max = case.baseline_max_tokens if case.baseline_max_tokens is not None \
        else args.baseline_max_tokens
    warm = args.warmup or case.warmup or "full"
    device = torch.device(args.device)
    est = CASE_ESTIMATES_S.get(case.name, {})

    if not clock.fits(est.get("setup", 0) + est.get("sparse", 0)):
        rec["skipped"] = f"deadline: {clock.elapsed():.0f} s used of {clock.deadline} s"
        save()
        return
    path, info = ensure_checkpoint(case, work, device, args.tiny, ckpts)
    rec["checkpoint"] = info
    rec["video"] = videos.get(case)
    video = rec["video"]["path"]
    save()

    t0 = time.perf_counter()
    pipe = Pipeline(str(path), attention="auto", device=args.device, dtype=args.dtype,
                    min_sparse_len=args.min_sparse_len, kv_cache_dtype=args.kv_cache_dtype,
                    quantization=args.quantization)
    rec["load_s"] = round(time.perf_counter() - t0, 2)
    if args.pipeline_warmup:      # what `mminfer serve` does before it reports ready
        rec["pipeline_warmup"] = pipe.warmup()
        print(f"[{clock.elapsed():6.0f} s] {case.name}: Pipeline.warmup {rec['pipeline_warmup']}",
              flush=True)
    print(f"[{clock.elapsed():6.0f} s] {case.name}: checkpoint {info.get('write_s')} s, "
          f"video {rec['video'].get('write_s')} s, load {rec['load_s']} s", flush=True)
    sparse_ok = pipe.sparse_unavailable is None and pipe.adapter.patterns is not None
    rec["sparse_available"] = sparse_ok
    rec["patterns_uncalibrated"] = bool(getattr(pipe.adapter.patterns, "uncalibrated", True))
    save()
    R = rec["requests"]
    try:
        if warm != "none":
            wf = case.frames if warm == "full" else min(args.warmup_frames, case.frames)
            R["first_request"] = request(pipe, case, video, "sparse" if sparse_ok else "dense",
                                         args, frames=wf)
            R["first_request"]["warmup_frames"] = wf
            R["first_request"]["full_length"] = wf == case.frames
            progress(clock, case, f"first request ({wf} frames)", R["first_request"])
            save()
        if sparse_ok:
            R["sparse"] = timed_step(clock, est.get("sparse"), lambda: request(
                pipe, case, video, "sparse", args))
        else:
            R["sparse"] = {"mode": "sparse", "skipped": pipe.sparse_unavailable
                           or "no head patterns"}
        progress(clock, case, "sparse", R["sparse"])
        save()
        n = _tokens(R) or 0
        probe = None
        if n:
            probe = rec["probe"] = timed_step(clock, probe_estimate_s(case, args),
                                              lambda: probe_dense(pipe, _token_entry(R), args))
            progress(clock, case, "probe", probe)
            save()
        if not n and not sparse_ok:      # dense is the only mode here: it gives the length
            R["dense"] = request(pipe, case, video, "dense", args)
            n = _tokens(R) or 0
        elif not n:
            # a full-length request failed (out of memory, say): the same length dense
            # would too, or run for minutes unbounded; record why instead
            why = "no full-length request succeeded, so the length is unknown: " + \
                str((R.get("sparse") or {}).get("error", ""))[:300]
            R["dense"] = {"mode": "dense", "skipped": why}
            if args.baseline:
                R["transformers"] = {"mode": "transformers", "skipped": why}
        elif n > dense_max or not args.dense:
            R["dense"] = extrapolated_dense(R.get("sparse"), probe)
            R["dense"]["why"] = f"{n} tokens > --dense-max-tokens {dense_max}" \
                if n > dense_max else "--no-dense"
        else:
            R["dense"] = timed_step(clock, est.get("dense"), lambda: request(
                pipe, case, video, "dense", args))
            if R["dense"].get("oom"):
                measured = R["dense"]
                R["dense"] = extrapolated_dense(R.get("sparse"), probe)
                R["dense"]["why"], R["dense"]["failed_run"] = "out of memory", measured
        progress(clock, case, "dense", R["dense"])
        v = validate_probe(R.get("dense"), R.get("sparse"), probe)
        if v:
            rec["probe_validation"] = v
            print(f"[{clock.elapsed():6.0f} s] {case.name} probe vs measured dense: attention "
                  f"{_s(v['probe_attention_ms'])} vs {_s(v['measured_attention_ms'])} s, "
                  f"measured / probe {v['factor']:.3f}"
                  f"{'' if v['within'] else ' (outside 5 %)'}", flush=True)
        save()
        if args.follow_ups and n:
            mode = "sparse" if sparse_ok else "dense"
            rec["repeated"] = timed_step(clock, est.get("repeated", est.get("sparse")),
                                         lambda: repeated_questions(pipe, case, video, mode,
                                                                    args))
            progress(clock, case, "repeated questions", rec["repeated"].get("first"))
            print(f"[{clock.elapsed():6.0f} s] {case.name}: follow-ups "
                  f"{rec['repeated'].get('follow_up_ttft_ms')}, host "
                  f"{(rec['repeated'].get('host') or {}).get('timings_ms')}, throughput "
                  f"{rec['repeated'].get('throughput')}", flush=True)
            save()
        for i in range(1, args.repeats):
            for mode in (("sparse", "dense") if sparse_ok else ("dense",)):
                if R.get(mode, {}).get("measured"):
                    R[f"{mode}_{i + 1}"] = timed_step(clock, est.get(mode), lambda m=mode:
                                                      request(pipe, case, video, m, args))
                    save()
        if args.baseline and n:
            run_prefill = n <= base_max
            R["transformers"] = timed_step(clock, est.get("transformers"), lambda: baseline(
                pipe, case, video, args, run_prefill=run_prefill,
                vision_frames=(case.frames if run_prefill else args.baseline_vision_frames),
                sparse=R.get("sparse"), probe=probe))
            if not run_prefill:
                R["transformers"]["why"] = f"{n} tokens > --baseline-max-tokens {base_max}"
            elif R["transformers"].get("oom"):
                measured = R["transformers"]
                R["transformers"] = baseline(pipe, case, video, args, run_prefill=False,
                                             vision_frames=args.baseline_vision_frames,
                                             sparse=R.get("sparse"), probe=probe)
                R["transformers"]["why"], R["transformers"]["failed_run"] = \
                    "out of memory", measured
            progress(clock, case, "transformers", R["transformers"])
            save()
    finally:
        pipe = None     # the requests' closures hold the name, not the object
        free_memory()
    rec["summary"] = summarise(case, R, rec.get("probe"), rec.get("probe_validation"))
    save()


def progress(clock: Clock, case: Case, label: str, e: dict | None):
    """One line per finished step, so a cut-short log still says how far it got."""
    if not e:
        return
    if "timings_ms" in e:
        t = e["timings_ms"]
        parts = " ".join(f"{k} {_s(t.get(k))}" for k in ("decode", "preprocess", "vision",
                                                          "index", "attention", "llm_other"))
        what = (f"ttft {_s(t.get('ttft'))} s ({parts}) tokens {(e.get('tokens') or {}).get('total')}"
                f" GPU {_g(e.get('peak_gpu_gib'))} GiB RSS {_g(e.get('peak_rss_gib'))} GiB"
                + ("" if e.get("measured", True) else " [extrapolated]"))
    elif "attention_ms" in e:
        vc = e.get("versus_cudnn") or {}
        what = (f"dense layers {e['layers_timed']} at {e['tokens']} tokens: attention "
                f"{e['attention_ms'] / 1e3:.3f} s a layer (first call "
                f"{e['first_call']['attention_ms'] / 1e3:.3f} s), rest {e['rest_ms'] / 1e3:.3f} s;"
                f" x {e['attention_calls']} = {e['attention_total_ms'] / 1e3:.2f} s; SDPA backend "
                f"{(e.get('sdpa') or {}).get('backend')}"
                + (f"; {vc['ours_tflops']} vs cuDNN {vc['cudnn_tflops']} TFLOP/s" if vc else ""))
    else:
        what = str(e.get("skipped") or e.get("error"))[:200]
    print(f"[{clock.elapsed():6.0f} s] {case.name} {label}: {what}", flush=True)


def timed_step(clock: Clock, estimate_s, fn) -> dict:
    if estimate_s is not None and not clock.fits(estimate_s):
        return {"skipped": f"deadline: {clock.elapsed():.0f} s used, this step is estimated "
                f"at {estimate_s} s, limit {clock.deadline} s"}
    return fn()


def _token_entry(R: dict) -> dict | None:
    """The request of the case's full length that says how many tokens it has."""
    for key in ("sparse", "first_request", "dense"):
        e = R.get(key) or {}
        if e.get("tokens") and (key != "first_request" or e.get("full_length")):
            return e
    return None


def _tokens(R: dict) -> int | None:
    e = _token_entry(R)
    return int(e["tokens"]["total"]) if e else None


# Paper estimates (seconds, after issue 11's targets, with margin) for the deadline check.
# "layer": one dense layer's call (its attention dominates) at the case's "tokens", for the
# probe's estimate.
CASE_ESTIMATES_S = {
    "qwen115k": {"setup": 60, "sparse": 25, "dense": 25, "transformers": 30, "layer": 0.4,
                 "tokens": 115_223},
    "qwen276k": {"setup": 25, "sparse": 40, "dense": 70, "transformers": 70, "layer": 1.8,
                 "tokens": 276_503},
    "longvila1m": {"setup": 75, "sparse": 75, "dense": 0, "transformers": 15, "layer": 22,
                   "tokens": 1_052_758},
}


def probe_estimate_s(case: Case, args) -> float | None:
    """The probe's calls (one untimed, then the timed ones) and, up to --cudnn-max-tokens,
    cuDNN's (one untimed, then --probe-repeats)."""
    est = CASE_ESTIMATES_S.get(case.name, {})
    if "layer" not in est:
        return None
    calls = 1 + max(args.probe_repeats, args.dense_layers)
    cudnn = 1 + args.probe_repeats if est["tokens"] <= args.cudnn_max_tokens else 0
    return est["layer"] * (calls + cudnn)


# ============================================================================ report
def summarise(case: Case, R: dict, probe: dict | None = None,
              validation: dict | None = None) -> dict:
    rows = {}
    for m in ("sparse", "dense", "transformers"):
        runs = [e for k, e in R.items() if (k == m or k.startswith(m + "_"))
                and "timings_ms" in e and e["timings_ms"].get("ttft") is not None]
        if runs:     # --repeats: the run with the median TTFT
            rows[m] = sorted(runs, key=lambda e: e["timings_ms"]["ttft"])[(len(runs) - 1) // 2]
    out = {"tokens": _tokens(R), "rows": {}, "ratios": {}, "targets": {}}
    for m, e in rows.items():
        out["rows"][m] = {"ttft_ms": e["timings_ms"]["ttft"],
                          "ttft_excl_decode_ms": e["ttft_excl_decode_ms"],
                          "measured": e.get("measured", True),
                          "peak_gpu_gib": e.get("peak_gpu_gib"),
                          "peak_rss_gib": e.get("peak_rss_gib"),
                          "precision": e.get("precision")}

    def ratio(a, b, key):
        ra, rb = out["rows"].get(a), out["rows"].get(b)
        if ra and rb and ra[key] and rb[key]:
            return float(f"{ra[key] / rb[key]:.4g}")      # 4 significant digits, any size
        return None

    out["same_precision"] = {}
    for a, b in (("dense", "sparse"), ("transformers", "sparse"), ("transformers", "dense")):
        out["ratios"][f"{a}_over_{b}"] = ratio(a, b, "ttft_ms")
        out["ratios"][f"{a}_over_{b}_excl_decode"] = ratio(a, b, "ttft_excl_decode_ms")
        if a in out["rows"] and b in out["rows"]:
            out["same_precision"][f"{a}_over_{b}"] = \
                out["rows"][a]["precision"] == out["rows"][b]["precision"]
    for name, want in case.targets.items():
        if name == "peak_gpu_gib_max":
            got = (out["rows"].get("sparse") or {}).get("peak_gpu_gib")
            ok = None if got is None else got <= want
        else:
            got = out["ratios"].get(name)
            ok = None if got is None else got >= want
        out["targets"][name] = {"want": want, "got": got, "met": ok}
    # assertions on the dense baseline itself: its attention at cuDNN's speed, and the probe
    # that extrapolates it within 5 % of a measured run
    vc = (probe or {}).get("versus_cudnn")
    if vc:
        tol = 1 - _dense_probe().WITHIN
        out["targets"]["dense_attention_over_cudnn"] = {
            "want": tol, "got": vc["ours_over_cudnn"], "met": vc["ours_over_cudnn"] >= tol}
    if validation:
        out["targets"]["probe_over_measured_dense"] = {
            "want": f"1 +- {validation['tolerance']}", "got": validation["factor"],
            "met": validation["within"]}
    fr = R.get("first_request") or {}
    if "timings_ms" in fr:
        out["first_request_ttft_ms"] = fr["timings_ms"]["ttft"]
        out["first_request_frames"] = fr.get("warmup_frames")
    return out


def table(report: dict) -> str:
    lines = []
    hdr = (f"{'case':<13} {'tokens':>9} {'mode':<13} {'src':<5} {'precision':<17} " +
           " ".join(f"{s[:9]:>9}" for s in STAGES) + f" {'ttft-dec':>9} {'GPU GiB':>8} "
           f"{'RSS GiB':>8}")
    title = "Stages (seconds; src: m = measured, x = extrapolated)"
    if report.get("quantization"):       # our rows FP8, the transformers baseline not
        title += (f"; linear layers {report['quantization']} (transformers row: "
                  f"{report.get('dtype')})")
    if report.get("kv_cache_dtype") not in (None, "auto"):
        title += f"; KV cache {report['kv_cache_dtype']}"
    lines += [title, hdr, "-" * len(hdr)]
    for name, rec in report["cases"].items():
        R = rec.get("requests") or {}
        if rec.get("skipped"):
            lines.append(f"{name:<13} skipped: {rec['skipped']}")
            continue
        for m in ("first_request", "sparse", "dense", "transformers"):
            e = R.get(m)
            if not e:
                continue
            label = "first(warm)" if m == "first_request" else m
            if "timings_ms" not in e:
                why = e.get("skipped") or e.get("error", "")
                lines.append(f"{name:<13} {'':>9} {label:<13} {'-':<5} {'':<17} {why[:90]}")
                continue
            tok = (e.get("tokens") or {}).get("total")
            src = "m" if e.get("measured", True) else "x"
            cells = " ".join(f"{_s(e['timings_ms'].get(s)):>9}" for s in STAGES)
            lines.append(f"{name:<13} {tok or '':>9} {label:<13} {src:<5} "
                         f"{e.get('precision') or '':<17} {cells} "
                         f"{_s(e.get('ttft_excl_decode_ms')):>9} "
                         f"{_g(e.get('peak_gpu_gib')):>8} {_g(e.get('peak_rss_gib')):>8}")
    rep = [(n, r["repeated"]) for n, r in report["cases"].items() if r.get("repeated")]
    if rep:
        lines += ["", "Repeated questions (video cache on, 8 new tokens; TTFT s; throughput: "
                  "k questions per video, cached vs every question from scratch)"]
        hdr3 = (f"{'case':<13} {'first':>8} {'follow-up':>10} {'host':>8} {'restore':>8} "
                f"{'k=3 x':>7} {'k=15 x':>7}  cache")
        lines += [hdr3, "-" * len(hdr3)]
        for name, r in rep:
            f = (r.get("first") or {}).get("timings_ms") or {}
            h = (r.get("host") or {}).get("timings_ms") or {}
            tp = r.get("throughput") or {}
            lines.append(
                f"{name:<13} {_s(f.get('ttft')):>8} "
                f"{_s((r.get('follow_up_ttft_ms') or {}).get('median')):>10} "
                f"{_s(h.get('ttft')):>8} {_s(h.get('restore')):>8} "
                f"{_x((tp.get('3') or {}).get('speedup')):>7} "
                f"{_x((tp.get('15') or {}).get('speedup')):>7}  "
                f"{(r.get('first') or {}).get('cache')}/{','.join(sorted(set(r.get('cache_statuses') or [])))}"
                f"/{(r.get('host') or {}).get('cache')}")
    lines += ["", "TTFT ratios, one run (excl. decode = all stages after decode; "
              "* = extrapolated; + = rows of different precision)"]
    hdr2 = (f"{'case':<13} {'tokens':>9} {'sparse s':>9} {'dense s':>9} {'transf. s':>9} "
            f"{'dense/sp':>9} {'tf/sp':>9} {'tf/dense':>9} | {'excl. decode:':<13} "
            f"{'dense/sp':>9} {'tf/sp':>9} {'tf/dense':>9}  targets")
    lines += [hdr2, "-" * len(hdr2)]
    for name, rec in report["cases"].items():
        s = rec.get("summary")
        if not s:
            continue
        rows, r = s["rows"], s["ratios"]

        def t(m):
            row = rows.get(m)
            return "-" if not row else _s(row["ttft_ms"]) + ("" if row["measured"] else "*")

        def x(key):
            same = (s.get("same_precision") or {}).get(key.replace("_excl_decode", ""), True)
            return _x(r[key]) + ("" if same or r[key] is None else "+")

        tg = "; ".join(f"{k} {v['got']} vs {v['want']}: "
                       f"{'met' if v['met'] else 'missed' if v['met'] is False else '?'}"
                       for k, v in s["targets"].items())
        lines.append(
            f"{name:<13} {s['tokens'] or '':>9} {t('sparse'):>9} {t('dense'):>9} "
            f"{t('transformers'):>9} {x('dense_over_sparse'):>9} "
            f"{x('transformers_over_sparse'):>9} {x('transformers_over_dense'):>9} | "
            f"{'':<13} {x('dense_over_sparse_excl_decode'):>9} "
            f"{x('transformers_over_sparse_excl_decode'):>9} "
            f"{x('transformers_over_dense_excl_decode'):>9}  {tg}")
    lines += probe_table(report)
    return "\n".join(lines)


def probe_table(report: dict) -> list[str]:
    """The dense probe of each case against its measured dense run and cuDNN, and how each
    extrapolated row was made."""
    probes = [(n, r) for n, r in report["cases"].items()
              if (r.get("probe") or {}).get("attention_ms") is not None]
    if not probes:
        return []
    lines = ["", "Dense probe: the product's dense prefill layer by layer (one untimed call at "
             "the shape first; medians; attention s per layer x the dense prefix's attention "
             "calls), against the dense request measured in the same run"]
    hdr = (f"{'case':<13} {'tokens':>9} {'layers timed':<14} {'first':>7} {'attn':>7} "
           f"{'rest':>7} {'calls':>5} {'x calls':>8} {'measured':>9} {'meas/probe':>10}  "
           f"SDPA backend")
    lines += [hdr, "-" * len(hdr)]
    for name, rec in probes:
        p, v = rec["probe"], rec.get("probe_validation") or {}
        layers = ",".join(str(i) for i in p["layers_timed"])
        f = "-" if not v else f"{v['factor']:.3f}" + ("" if v["within"] else " !")
        lines.append(
            f"{name:<13} {p['tokens']:>9} {layers:<14} "
            f"{_s(p['first_call']['attention_ms']):>7} {p['attention_ms'] / 1e3:>7.3f} "
            f"{p['rest_ms'] / 1e3:>7.3f} {p['attention_calls']:>5} "
            f"{_s(p['attention_total_ms']):>8} {_s(v.get('measured_attention_ms')):>9} "
            f"{f:>10}  {(p.get('sdpa') or {}).get('backend')}")
    vcs = [(n, r["probe"]["versus_cudnn"]) for n, r in probes if r["probe"].get("versus_cudnn")]
    if vcs:
        lines += ["", "Dense attention, one layer at the case's length: our dense prefill's "
                  "call against a standalone cuDNN SDPA call (TFLOP/s over the causal "
                  "triangle)"]
        hdr = (f"{'case':<13} {'tokens':>9} {'ours ms':>9} {'TFLOP/s':>8} {'cuDNN ms':>9} "
               f"{'TFLOP/s':>8} {'ours/cuDNN':>10}  cuDNN's GQA")
        lines += [hdr, "-" * len(hdr)]
        for name, vc in vcs:
            lines.append(f"{name:<13} {vc['tokens']:>9} {vc['ours_ms']:>9.1f} "
                         f"{vc['ours_tflops']:>8.1f} {vc['cudnn_ms']:>9.1f} "
                         f"{vc['cudnn_tflops']:>8.1f} {vc['ours_over_cudnn']:>10.3f}  "
                         f"{vc['cudnn_gqa']}")
    for name, rec in report["cases"].items():
        for m, e in (rec.get("requests") or {}).items():
            if e.get("measured", True) or "timings_ms" not in e:
                continue
            lines.append(f"{name} {m} extrapolated: {e.get('how') or '; '.join(e['extrapolated'])}"
                         + (f"; attention x {e['probe_factor']['factor']} "
                            f"({e['probe_factor']['from']})" if e.get("probe_factor") else ""))
    return lines


def _s(ms):
    return "-" if ms is None else f"{ms / 1e3:.2f}"


def _g(v):
    return "-" if v is None else f"{v:.1f}"


def _x(v):
    return "-" if v is None else f"{v:.2f}x"


def environment(args) -> dict:
    import torch
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cpu_count": os.cpu_count(), "host": platform.node()}
    for mod in ("transformers", "triton", "decord", "av", "cv2"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            env[mod] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_gib=round(p.total_memory / GIB, 1),
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    env["commit"] = args.commit or os.environ.get("E2E_COMMIT") or _git_commit()
    return env


def _git_commit():
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except Exception:
        return None


# ============================================================================ main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/e2e", help="folder for e2e.json and table.txt")
    p.add_argument("--work-dir", default=None,
                   help="checkpoints and videos (default /tmp/mminfer_e2e, tiny: <out>/work)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny checkpoints, 16-frame videos, CPU (sparse only with "
                   "TRITON_INTERPRET=1)")
    p.add_argument("--cases", nargs="+", help="cases to run (default: all of the mode's)")
    p.add_argument("--frames", nargs="+", default=[], metavar="CASE=N",
                   help="frames per request of a case (the video is written with that many)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="Pipeline(quantization=): FP8 linear layers in every mode we run (the "
                   "transformers baseline stays in --dtype); run once without and once with it "
                   "for the bf16 and FP8 rows")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="Pipeline(kv_cache_dtype=): fp8 stores the KV cache in e4m3 (compare "
                   "peak_gpu_gib and ttft with a run without it)")
    p.add_argument("--min-sparse-len", type=int, default=None,
                   help="Pipeline(min_sparse_len=) (requests name their mode explicitly)")
    p.add_argument("--warmup", choices=("full", "short", "none"), default=None,
                   help="warm-up request before each case (default: full; longvila1m short)")
    p.add_argument("--warmup-frames", type=int, default=512)
    p.add_argument("--pipeline-warmup", action="store_true",
                   help="call Pipeline.warmup() after loading, as the server does at start")
    p.add_argument("--repeats", type=int, default=1, help="measured requests per mode")
    p.add_argument("--dense-max-tokens", type=int, default=400_000,
                   help="longer dense requests are extrapolated, not run")
    p.add_argument("--baseline-max-tokens", type=int, default=400_000,
                   help="longer one-shot baseline prefills are extrapolated, not run")
    p.add_argument("--baseline-vision-frames", type=int, default=512,
                   help="frames the baseline tower runs on when the prefill is extrapolated")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--follow-ups", type=int, default=14,
                   help="repeated questions: follow-ups after the first (0: skip the step)")
    p.add_argument("--profile-follow-up", action="store_true",
                   help="repeated questions: the first follow-up under torch.profiler, its "
                   "costliest ops written to OUT/profile_follow_up_CASE.txt")
    p.add_argument("--no-host-tier", dest="host_tier", action="store_false",
                   help="repeated questions: skip the follow-up from the host tier")
    p.add_argument("--no-dense", dest="dense", action="store_false",
                   help="extrapolate dense from the probe instead of running it")
    p.add_argument("--dense-layers", type=int, default=1,
                   help="decoder layers the dense probe runs in full through the product's "
                   "dense prefill, spread over the model (4: layers 0, 9, 18, 27 of 28)")
    p.add_argument("--probe-repeats", type=int, default=3,
                   help="timed calls of the probe's layer when it runs one (and of cuDNN's)")
    p.add_argument("--cudnn-max-tokens", type=int, default=400_000,
                   help="up to this length the probe's attention is compared with a "
                   "standalone cuDNN SDPA call at the same shape (GPU only)")
    p.add_argument("--probe-factor", default="auto", metavar="auto|none|X",
                   help="extrapolated rows' attention x this factor: auto = measured / probe "
                   "of this run's longest validated case where they differ by more than 5 %%; "
                   "X: a factor from another run")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="skip steps estimated not to end within this many seconds of start")
    p.add_argument("--no-background-videos", dest="background_videos", action="store_false")
    p.add_argument("--commit", default=None, help="recorded in the JSON (else E2E_COMMIT, git)")
    p.add_argument("--write-video", nargs=5, metavar=("PATH", "N", "H", "W", "FPS"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_video:
        path, n, h, w, fps = args.write_video
        print(json.dumps(write_video(path, int(n), int(h), int(w), float(fps))))
        return 0
    import torch
    cases = tiny_cases() if args.tiny else full_cases()
    args.device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available()
                                  else "cuda")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.tiny:
        args.max_new_tokens = min(args.max_new_tokens, 4)
        args.warmup_frames = min(args.warmup_frames, 8)
    for spec in args.frames:
        name, _, n = spec.partition("=")
        if name not in cases or not n.isdigit() or int(n) < 2:
            raise SystemExit(f"--frames {spec}: want CASE=N with CASE one of {list(cases)}")
        cases[name] = replace(cases[name], frames=int(n))
    chosen = args.cases or list(cases)
    unknown = [c for c in chosen if c not in cases]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(cases)}")
    chosen = [cases[c] for c in chosen]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or (out / "work" if args.tiny else "/tmp/mminfer_e2e"))
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.deadline_s)
    report = {"benchmark": "e2e (Pipeline.answer)", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "argv": sys.argv[1:] if argv is None else list(argv), "env": environment(args),
              "device": args.device, "dtype": args.dtype, "quantization": args.quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "question": QUESTION,
              "max_new_tokens": args.max_new_tokens, "setup": {}, "cases": {}}
    du = shutil.disk_usage(work)
    report["setup"]["work_dir"] = {"path": str(work), "free_gib": round(du.free / GIB, 1)}

    def save():
        report["elapsed_s"] = round(clock.elapsed(), 1)
        tmp = out / "e2e.json.partial"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(out / "e2e.json")

    t = time.perf_counter()
    videos = VideoJobs(work, chosen, background=args.background_videos and not args.tiny)
    report["setup"]["videos_started_s"] = round(time.perf_counter() - t, 2)
    save()
    ckpts = {}

    def interrupted(signum, frame):   # timeout(1) sends TERM: still write the table
        raise KeyboardInterrupt(f"signal {signum} after {clock.elapsed():.0f} s")

    signal.signal(signal.SIGTERM, interrupted)
    rc = 0
    try:
        for case in chosen:
            print(f"[{clock.elapsed():6.0f} s] case {case.name}: {case.frames} frames "
                  f"{case.width}x{case.height}", flush=True)
            try:
                run_case(case, args, work, videos, ckpts, clock, report, save)
            except Exception as e:      # one case failing (load, write) must not lose the rest
                report["cases"].setdefault(case.name, {}).update(_error(e))
                free_memory()
            save()
            rec = report["cases"].get(case.name, {})
            s = rec.get("summary")
            print(f"[{clock.elapsed():6.0f} s] case {case.name} done: "
                  + (json.dumps(s["ratios"]) if s else
                     str(rec.get("error") or rec.get("skipped"))[:300]), flush=True)
    except KeyboardInterrupt as e:
        report["interrupted"] = str(e)
        rc = 130
    finally:
        # every case's extrapolated rows take the run's probe correction, then the rows
        # and ratios are summed up (a case cut short gets them too)
        corr = probe_correction(report, args.probe_factor)
        report["probe_correction"] = corr
        for case in chosen:
            rec = report["cases"].get(case.name)
            if rec and rec.get("requests"):
                correct_extrapolated(rec["requests"], corr)
                rec["summary"] = summarise(case, rec["requests"], rec.get("probe"),
                                           rec.get("probe_validation"))
        videos.close(wait=rc == 0)
        report["setup"]["checkpoints"] = ckpts
        report["setup"]["videos"] = videos.info
        report["table"] = table(report)
        save()
        (out / "table.txt").write_text(report["table"] + "\n")
        print(report["table"], flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
