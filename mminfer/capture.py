"""Capture one model's prefill q/k/v per layer on real inputs, for `mminfer calibrate`.

The prefill runs dense through the ordinary adapter (same preprocessing, same ModalityIndex
as serving); the attention hook copies each layer's rotated q and cached k/v to the CPU. One
``.pt`` file per video, in the format ``mminfer.calibrate.load_captures`` reads.
"""

from __future__ import annotations

from pathlib import Path


def capture_qkv(model, videos, question: str, out_dir, *, fps: float = 2.0,
                max_frames: int = 768, device=None, progress=None) -> list[Path]:
    import torch

    from mminfer import video as videolib
    from mminfer.models.base import PrepareOptions
    from mminfer.models.hooks import PrefillContext
    from mminfer.pipeline import Pipeline

    pipe = model if isinstance(model, Pipeline) else Pipeline(model=model, attention="dense",
                                                              device=device)
    ad = pipe.adapter
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for v in videos:
        decoded = videolib.decode(str(v), sampling=ad.sampling, fps=fps, max_frames=max_frames)
        prep = ad.prepare(decoded, question, PrepareOptions())
        ctx = PrefillContext(index=prep.index, patterns=None, mode="dense", capture={})
        ad.generate(prep, max_new_tokens=1, ctx=ctx)
        path = out_dir / (Path(v).stem + ".pt")
        torch.save({"name": Path(v).name, "index": prep.index.to_dict(),
                    "layers": {i: {"q": q, "k": k, "v": vv}
                               for i, (q, k, vv) in sorted(ctx.capture.items())}}, path)
        paths.append(path)
        if progress:
            progress(path, prep.total_tokens)
    return paths
