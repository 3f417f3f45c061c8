"""Rank 0 leads, rank 1 follows (engine.lockstep), 2 gloo processes on a tiny Qwen2.5-VL:
every job runs on both ranks with rank 0's inputs (by path and by bytes), a cancellation
stops both at the same check and the next job still answers as one process does, a bad
video is refused on both without breaking the group, ``close`` returns the follower, and a
follower whose rank 0 dies returns with an error instead of waiting."""

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from mminfer.errors import Cancelled, VideoError

QUESTION = "what is in the video?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)


def _cancel_on(call: int):
    """A cancel callable that says stop on its ``call``-th check (rank 0's client leaving)."""
    n = [0]

    def cancel():
        n[0] += 1
        return n[0] >= call
    return cancel


def _rank_main(rank, world, port, ckpt, video, bad, out_dir):
    _env(rank, world, port)
    from mminfer.engine import lockstep, parallel
    from mminfer.engine.pipeline import Pipeline
    pipe = Pipeline(ckpt, attention="dense", device="cpu", tensor_parallel=world)
    log = []
    answer = pipe.answer

    def recorded(path, question, **kw):        # what this rank ran, and how it ended
        try:
            res = answer(path, question, **kw)
            log.append({"path": str(path), "answer": res.answer})
            return res
        except Exception as e:
            log.append({"path": str(path), "error": type(e).__name__, "message": str(e)})
            raise

    pipe.answer = recorded
    if rank == 0:
        leader = lockstep.Leader(pipe)
        out = {"one_host": leader.channel.one_host, "warmup": leader.warmup()}
        out["first"] = leader.answer(video, QUESTION, max_new_tokens=4).answer
        try:
            leader.answer(video, QUESTION, max_new_tokens=4, cancel=_cancel_on(4))
        except Cancelled as e:
            out["cancelled"] = str(e)
        leader.send_bytes = True
        out["by_bytes"] = leader.answer(video, QUESTION, max_new_tokens=4).answer
        try:
            leader.answer(bad, QUESTION, max_new_tokens=4)
        except VideoError as e:
            out["bad"] = type(e).__name__
        leader.send_bytes = False
        out["after"] = leader.answer(video, QUESTION, max_new_tokens=4).answer
        out["closed"] = leader.close()
    else:
        out = {"jobs": lockstep.follow(pipe)}
    out["log"] = log
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    parallel.leave()        # what the CLI's exit does


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    return str(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("lock") / "tiny", heads=4,
                                    kv_heads=2))


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    from conftest import write_video
    return str(write_video(tmp_path_factory.mktemp("lockv") / "v.mp4", n_frames=20, fps=10.0))


def test_follower_runs_rank0_jobs_cancels_with_it_and_stops(ckpt, video, tmp_path):
    import torch.multiprocessing as mp
    from mminfer.engine.pipeline import Pipeline
    ref = Pipeline(ckpt, attention="dense", device="cpu").answer(video, QUESTION,
                                                                 max_new_tokens=4).answer
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"this is not a video at all" * 40)
    mp.spawn(_rank_main, args=(2, _free_port(), ckpt, video, str(bad), str(tmp_path)),
             nprocs=2, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["one_host"] is True and r0["warmup"]["ran"] is False
    assert r0["first"] == r0["by_bytes"] == r0["after"] == ref
    assert "prefill" in r0["cancelled"]                 # the 4th check is decoder layer 0
    assert r0["bad"] == "VideoError"
    assert r0["closed"] is True
    assert r1["jobs"] == 6                               # warmup + 5 answers
    # the follower ran every answer rank 0 ran, with the same outcome, the bytes job from
    # its own copy of the file
    assert len(r1["log"]) == len(r0["log"]) == 5
    for a, b in zip(r0["log"], r1["log"]):
        assert a.get("answer") == b.get("answer")
        assert a.get("error") == b.get("error")
    assert r1["log"][1]["error"] == "Cancelled"
    assert r1["log"][1]["message"] == r0["log"][1]["message"]    # stopped at the same check
    assert r1["log"][0]["path"] == os.path.abspath(video)
    assert r1["log"][2]["path"] != video and "mminfer-tp-" in r1["log"][2]["path"]
    assert not Path(r1["log"][2]["path"]).exists()               # its copy is gone
    assert r1["log"][3]["error"] == "VideoError"


class _NoModel:
    rank = 1

    def answer(self, *a, **kw):
        raise AssertionError("rank 0 sent no job")


def _vanishing_main(rank, world, port, out_dir):
    _env(rank, world, port)
    import torch.distributed as dist
    from mminfer.engine import lockstep
    dist.init_process_group("gloo")
    channel = lockstep.Channel()
    if rank == 0:
        time.sleep(1.0)
        os._exit(0)              # gone without a word: killed, crashed
    t0 = time.monotonic()
    try:
        lockstep.follow(_NoModel(), channel)
        how = "returned"
    except Exception as e:       # noqa: BLE001
        how = type(e).__name__
    Path(out_dir, "follower.json").write_text(json.dumps(
        {"how": how, "seconds": time.monotonic() - t0}))


def test_follower_does_not_wait_for_a_rank0_that_died(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_vanishing_main, args=(r, 2, port, str(tmp_path)))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, "a rank still runs 120 s after rank 0 died"
    got = json.loads((tmp_path / "follower.json").read_text())
    assert got["how"] not in ("returned",) and got["seconds"] < 60, got
