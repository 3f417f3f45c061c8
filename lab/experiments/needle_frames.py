"""The needle frames a quality run got wrong, as the model saw them: a contact sheet.

    python3 lab/experiments/needle_frames.py QUALITY.json --look dots --out sheet.png

For every needle record of a ``benchmarks/quality.py --renderer eval`` JSON (optionally one
digit look), re-renders the video from its seed, takes the needle's last frame (the number in
place), resizes it with the adapter's own resize (``qwen2_5_vl.resize_frames``) to the frame
size the model read (``--size``: 84 x 112, what the adapter gives the embedded model's
videos at every benchmarked length), and tiles the frames, wrong answers first, each scaled
up ``--zoom`` times with nearest neighbours so the pixels stay the model's. Prints one line per
frame (index on the sheet, right or wrong, answer, what the model said). The question it
answers: is a wrong answer a model that cannot read, or a digit nobody could read?"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def needle_records(quality: dict, look: str | None, mode: str) -> list[dict]:
    """Needle records of ``quality`` (optionally of one look), wrong answers of ``mode`` first."""
    out = [e for e in quality["examples"] if e["task"] == "needle"
           and (look is None or e.get("look") == look) and mode in e["modes"]]
    return sorted(out, key=lambda e: bool(e["modes"][mode]["correct"]))


def model_frame(record: dict, size: tuple[int, int]):
    """The needle's last frame of ``record``'s video at ``size``, uint8 ``[h, w, 3]``."""
    import numpy as np
    import torch
    from mminfer.models.qwen2_5_vl import resize_frames
    from lab.toy import render_eval
    ex = render_eval.needle(record["seed"], record["n_frames"], depth=record["depth"])
    frame = ex.frames[ex.meta["needle_frames"][-1]]
    x = resize_frames(torch.from_numpy(np.ascontiguousarray(frame[None])), *size)
    return x[0].permute(1, 2, 0).to(torch.uint8).numpy()


def sheet(frames: list, columns: int, zoom: int):
    from PIL import Image
    h, w = frames[0].shape[:2]
    rows = -(-len(frames) // columns)
    out = Image.new("RGB", (columns * w * zoom, rows * h * zoom))
    for i, f in enumerate(frames):
        im = Image.fromarray(f).resize((w * zoom, h * zoom), Image.NEAREST)
        out.paste(im, ((i % columns) * w * zoom, (i // columns) * h * zoom))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("quality", type=Path, help="a quality.py JSON (renderer eval)")
    p.add_argument("--look", choices=("dots", "strokes"), help="only this digit look")
    p.add_argument("--mode", default="dense", help="whose answers (a mode of the run)")
    p.add_argument("--size", type=int, nargs=2, default=(84, 112), metavar=("H", "W"))
    p.add_argument("--columns", type=int, default=5)
    p.add_argument("--zoom", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    a = p.parse_args(argv)
    q = json.loads(a.quality.read_text())
    if q.get("renderer") != "eval":
        raise SystemExit(f"{a.quality}: renderer {q.get('renderer')!r}; this re-renders "
                         "render_eval videos, so it needs a --renderer eval run")
    recs = needle_records(q, a.look, a.mode)
    if not recs:
        raise SystemExit(f"{a.quality}: no needle records"
                         + (f" of look {a.look!r}" if a.look else "")
                         + f" with mode {a.mode!r}")
    frames = []
    for i, e in enumerate(recs):
        frames.append(model_frame(e, tuple(a.size)))
        m = e["modes"][a.mode]
        print(f"{i:3d} {'ok   ' if m['correct'] else 'WRONG'} answer {e['answer']:>3} "
              f"said {m['answer']:>3}  seed {e['seed']} look {e.get('look')}")
    sheet(frames, a.columns, a.zoom).save(a.out)
    print(f"wrote {a.out} ({len(frames)} frames, wrong first)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
