"""The vision tower data-parallel over chunks of frames: with 2 gloo ranks each rank runs the
tower on its own chunks only (k % 2 == rank), and after the all-gather every rank holds the
same features as one process (fp32, within 1e-5), so the first-token logits and the answer
match too. Tiny Qwen2.5-VL and tiny LongVILA, chunks made small so a short video gives an odd
number of them (uneven shares: the gather's padding is exercised)."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch

QUESTION = "what is in the video?"
QWEN_CHUNKS = 5          # 10 frames at 2 fps -> 5 temporal pairs, one pair per chunk
VILA_BATCH = 3           # 8 frames in chunks of 3, 3, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _small_chunks(pipe):
    """Chunks of one temporal pair (Qwen) or 3 frames (LongVILA), and a count of the
    chunks this process ran through the tower."""
    ad, calls = pipe.adapter, []
    if ad.name == "qwen2_5_vl":
        ad.vision_chunk_patches = 1              # pairs_per_chunk floors at one pair

        class Counting:
            def __init__(self, tower):
                self.tower = tower

            def __getattr__(self, name):
                return getattr(self.tower, name)

            def __call__(self, pixels, n, h, w, **kw):
                calls.append(n)
                return self.tower(pixels, n, h, w, **kw)

        ad.tower = Counting(ad.tower)
    else:
        ad.vision_batch = VILA_BATCH
        encode = ad._encode
        ad._encode = lambda x: (calls.append(len(x)), encode(x))[1]
    return calls


def _answer(pipe, video, mode="dense"):
    """Answer once; the embeddings the prefill got, the first-token logits, the answer."""
    ad, seen = pipe.adapter, {}
    prefill_prefix = ad.prefill_prefix

    def spy(prep, embeds, **kw):
        seen["embeds"] = embeds.detach().clone()           # the prefill overwrites them
        return prefill_prefix(prep, embeds, **kw)

    ad.prefill_prefix = spy
    logits = []
    handle = ad.lm_head.register_forward_hook(
        lambda mod, args, out: logits.append(out[0, -1].detach().float().clone()))
    try:
        res = pipe.answer(video, QUESTION, attention=mode, max_new_tokens=4)
    finally:
        handle.remove()
        ad.prefill_prefix = prefill_prefix
    return seen["embeds"][0], logits[0], res


def _rank_main(rank, world, port, ckpts, video, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from mminfer.engine.pipeline import Pipeline
    out = {}
    for name, ckpt in ckpts.items():
        pipe = Pipeline(ckpt, attention="dense", device="cpu", tensor_parallel=world)
        calls = _small_chunks(pipe)
        embeds, logits, res = _answer(pipe, video)
        torch.save({"embeds": embeds, "logits": logits}, Path(out_dir, f"{name}{rank}.pt"))
        out[name] = {"calls": calls, "answer": res.answer, "vision_ms": res.timings_ms["vision"]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    from lab.toy.tiny_longvila import save_tiny_longvila
    root = tmp_path_factory.mktemp("tpvis")
    return {"qwen": str(save_tiny_qwen2_5_vl(root / "qwen", heads=4, kv_heads=2)),
            "longvila": str(save_tiny_longvila(root / "longvila"))}


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    from conftest import write_video
    return str(write_video(tmp_path_factory.mktemp("tpvisv") / "v.mp4", n_frames=50, fps=10.0,
                           noise=True))


def test_vision_tower_split_over_ranks_matches_one_process(ckpts, video, tmp_path):
    import torch.multiprocessing as mp
    from mminfer.engine.pipeline import Pipeline
    ref = {}
    for name, ckpt in ckpts.items():
        pipe = Pipeline(ckpt, attention="dense", device="cpu")
        calls = _small_chunks(pipe)
        ref[name] = (*_answer(pipe, video), calls)

    mp.spawn(_rank_main, args=(2, _free_port(), ckpts, video, str(tmp_path)), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in ckpts:
        embeds, logits, res, calls = ref[name]
        # one process runs every chunk; rank r runs chunks r, r+2, ...: an odd count, so
        # the shares are uneven
        assert len(calls) % 2 == 1 and len(calls) >= 3, (name, calls)
        for rank in (0, 1):
            got = ranks[rank][name]
            assert got["calls"] == calls[rank::2], (name, rank, got["calls"], calls)
            saved = torch.load(tmp_path / f"{name}{rank}.pt")
            diff = (saved["embeds"] - embeds).abs().max().item()
            assert diff <= 1e-5, (name, rank, "features", diff)
            diff = (saved["logits"] - logits).abs().max().item()
            assert diff <= 1e-5, (name, rank, "logits", diff)
            assert got["answer"] == res.answer
            assert got["vision_ms"] > 0
