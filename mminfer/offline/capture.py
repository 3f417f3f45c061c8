"""Capture one model's prefill q/k/v per layer on real inputs, for `mminfer calibrate`.

What is captured is what serving prefills sparse: the prompt's *prefix* (up to and including
the video), prefilled on its own as the video cache builds it, with the prefix's ModalityIndex
(a sparse prefix estimates from its own last queries; the question's rows are computed dense
over its cache, ``served_policy.py``). The prefill runs dense through the ordinary adapter
(same preprocessing as serving); the attention hook copies each layer's rotated q and cached
k/v to the CPU. One ``.pt`` file per video, in the format
``mminfer.offline.calibrate.load_captures`` reads.

A video may also be a synthetic source ``synth:TASK:FRAMES:SEED`` (:mod:`.synthetic`, drawn
at 224 x 224 and 2 fps in-process, asked its own task question): the embedded model is
calibrated that way on machines without a video decoder, on seeds no training or
evaluation uses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from mminfer.errors import InputError
from mminfer.models.base import PrepareOptions
from mminfer.models.hooks import PrefillContext
from mminfer.offline import synthetic as synth


def capture_qkv(model, videos, question: str, out_dir, *, fps: float = 2.0,
                max_frames: int = 768, device=None, progress=None) -> list[Path]:
    pipe = model if isinstance(model, Pipeline) else Pipeline(model=model, attention="dense",
                                                              device=device)
    ad = pipe.adapter
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for v in videos:
        decoded, q_text, name = load_video(v, ad, question, fps=fps, max_frames=max_frames)
        prep = ad.prepare(decoded, q_text, PrepareOptions())
        ctx = PrefillContext(index=prep.prefix_index, patterns=None, mode="dense", capture={})
        with torch.inference_mode():
            ad.prefill_prefix(prep, ad.embed(prep), ctx=ctx)
        path = out_dir / (name + ".pt")
        torch.save({"name": name, "index": prep.prefix_index.to_dict(),
                    "layers": {i: {"q": q, "k": k, "v": vv}
                               for i, (q, k, vv) in sorted(ctx.capture.items())}}, path)
        paths.append(path)
        if progress:
            progress(path, prep.prefix_len)
    return paths


def load_video(v, adapter, question: str, *, fps: float = 2.0, max_frames: int = 768):
    """One calibration video for ``adapter``: a file (decoded at ``fps``, at most
    ``max_frames`` and the model's own frame limit, asked ``question``) or a synthetic source
    (asked its own task's question). Returns ``(DecodedVideo, question, name)``."""
    if str(v).startswith("synth:"):
        return synthetic_video(str(v))
    decoded = videolib.decode(str(v), sampling=adapter.sampling, fps=fps,
                              max_frames=min(max_frames, adapter.frame_limit or max_frames))
    return decoded, question, Path(v).stem


def synthetic_video(spec: str):
    """``synth:TASK:FRAMES:SEED`` -> (DecodedVideo at 2 fps, the task's question, a file stem)."""
    parts = spec.split(":")
    try:
        _, task, frames, seed = parts
        n, seed = int(frames), int(seed)
        if n < 2:
            raise ValueError
    except ValueError:
        raise InputError(f"bad synthetic video {spec!r}: use synth:TASK:FRAMES:SEED "
                         f"(FRAMES >= 2), e.g. synth:needle:2048:900000") from None
    if task not in synth.TASKS:
        raise InputError(f"bad synthetic video {spec!r}: task must be one of "
                         f"{', '.join(synth.TASKS)}")
    ex = synth.make_example(task, seed, n_frames=n, height=224, width=224)
    return videolib.DecodedVideo.from_frames(ex.frames), ex.question, f"synth-{task}-{n}-{seed}"
