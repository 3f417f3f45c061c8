"""One question about a small video on each tiny checkpoint (Qwen2.5-VL, LongVILA): the
prepared prompt and its embeddings, for the decode and KV-cache tests."""
from lab.toy.tiny import save_tiny_qwen2_5_vl
from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer.engine import video as videolib
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
