"""The tensor-parallel paths on 2 GPUs (NCCL; skipped with fewer): the same code the gloo
tests run on the CPU, with the backend chosen by the device. Two ranks, tiny Qwen2.5-VL and
LongVILA in fp32 on cuda:0/cuda:1: the vision tower split over chunks (features all-gathered
on the GPU), the sharded decoder, dense and sparse (the Triton kernels compiled for real),
and one job led by rank 0 through engine.lockstep (gloo groups beside the NCCL one) — the
features, first-token logits and answers as one GPU's."""

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

QUESTION = "what is in the video?"
TOL = 1e-4               # fp32 on the GPU; the all-reduce sums in another order


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# sparse on the Qwen checkpoint (head_dim 64, a size the kernels are tested at); the tiny
# LongVILA's head_dim is 16
MODES = {"qwen": ("dense", "sparse"), "longvila": ("dense",)}


def _rank_main(rank, world, port, ckpts, video, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from test_parallel_vision import _answer, _small_chunks
    from mminfer.engine import lockstep
    from mminfer.engine.pipeline import Pipeline
    out = {}
    for name, ckpt in ckpts.items():
        pipe = Pipeline(ckpt, attention="dense", device="cuda", dtype="float32",
                        tensor_parallel=world)
        assert pipe.device == torch.device("cuda", rank)
        calls = _small_chunks(pipe)
        for mode in MODES[name]:
            embeds, logits, res = _answer(pipe, video, mode)
            torch.save({"embeds": embeds.cpu(), "logits": logits.cpu()},
                       Path(out_dir, f"{name}-{mode}{rank}.pt"))
            out[f"{name}-{mode}"] = {"answer": res.answer, "attention": res.attention,
                                     "calls": len(calls)}
    if rank == 0:
        leader = lockstep.Leader(pipe)
        out["led"] = leader.answer(video, QUESTION, attention="dense", max_new_tokens=4).answer
        assert leader.close()
    else:
        out["followed"] = lockstep.follow(pipe)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def test_two_gpus_match_one(tmp_path):
    pytest.importorskip("av")                   # the test clip is written with PyAV
    import torch.multiprocessing as mp
    from conftest import write_video
    from test_parallel_vision import _answer, _small_chunks
    from mminfer.engine.pipeline import Pipeline
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    from lab.toy.tiny_longvila import save_tiny_longvila
    ckpts = {"qwen": str(save_tiny_qwen2_5_vl(tmp_path / "qwen", hidden=256, heads=4,
                                              kv_heads=2)),
             "longvila": str(save_tiny_longvila(tmp_path / "longvila"))}
    video = str(write_video(tmp_path / "v.mp4", n_frames=50, fps=10.0, noise=True))
    ref = {}
    for name, ckpt in ckpts.items():
        pipe = Pipeline(ckpt, attention="dense", device="cuda", dtype="float32")
        _small_chunks(pipe)
        for mode in MODES[name]:
            ref[f"{name}-{mode}"] = _answer(pipe, video, mode)
        del pipe
    torch.cuda.empty_cache()
    mp.spawn(_rank_main, args=(2, _free_port(), ckpts, video, str(tmp_path)), nprocs=2,
             join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for key, (embeds, logits, res) in ref.items():
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{key}{rank}.pt")
            assert (got["embeds"] - embeds.cpu()).abs().max() <= TOL, (key, rank)
            assert (got["logits"] - logits.cpu()).abs().max() <= TOL, (key, rank)
            assert ranks[rank][key]["answer"] == res.answer
            assert ranks[rank][key]["attention"] == res.attention == key.split("-")[1]
    assert ranks[0]["led"] == ref["longvila-dense"][2].answer
    assert ranks[1]["followed"] == 1
