"""One question about a small video on each tiny checkpoint (Qwen2.5-VL, LongVILA): the
prepared prompt and its embeddings, for the decode and KV-cache tests."""
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from mminfer.models.base import Conversation

QUESTION = "where does the red square move?"


def prepared_pair(root, mp4) -> dict:
    """kind ("qwen", "longvila") -> (adapter, Prepared, embeds), checkpoints under ``root``."""
    out = {}
    for kind in ("qwen", "longvila"):
        ckpt = (save_tiny_qwen2_5_vl(root / "tiny-qwen") if kind == "qwen"
                else save_tiny_longvila(root / "tiny-longvila"))
        ad = Pipeline(str(ckpt), attention="dense", device="cpu").adapter
        decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=4.0,
                                  max_frames=min(8, ad.frame_limit or 8))
        prep = ad.prepare(decoded, Conversation.single(QUESTION))
        out[kind] = (ad, prep, ad.embed(prep))
    return out


def random_frames(n, h=56, w=84, seed=0):
    """``n`` random RGB frames ``[n, h, w, 3]`` uint8 (for prepare without a video file)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


class FrameVideo:
    """What Qwen2.5-VL's prepare reads of a decoded video: ``frames``, ``sampled_fps``."""

    def __init__(self, frames, fps=2.0):
        self.frames, self.sampled_fps = frames, fps
