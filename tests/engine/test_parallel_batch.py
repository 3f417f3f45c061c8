"""`torchrun --nproc-per-node 2 -m mminfer batch DIR --tensor-parallel 2` on the CPU (gloo):
rank 0 scans the folder and writes the results, both ranks run every item; the records are
those of a one-process batch (answers, errors), each written once; a rerun with nothing left
to do loads, finds nothing, and ends both ranks instead of leaving rank 1 waiting."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import write_video

from mminfer.batch import run_batch

QUESTION = "what is in the video?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path) -> dict:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        assert r["custom_id"] not in out, "a record written twice"
        out[r["custom_id"]] = r
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    return str(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tpb") / "tiny", heads=4,
                                    kv_heads=2))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tpbv")
    write_video(d / "a.mp4", n_frames=20, fps=10.0)
    (d / "sub").mkdir()
    write_video(d / "sub" / "b.mp4", n_frames=30, fps=10.0, noise=True)
    (d / "broken.mp4").write_bytes(b"not a video" * 100)      # an error record, on both ranks
    return d


def _torchrun(ckpt, folder, out):
    """Run the job; a rank still running after 300 s fails the test (and is ended: the
    ranks get a process group of their own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "mminfer", "batch", str(folder),
         "--question", QUESTION, "--out", str(out), "--model", ckpt, "--device", "cpu",
         "--attention", "dense", "--max-new-tokens", "4", "--no-progress",
         "--tensor-parallel", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.wait(30), stdout, stderr)


def test_two_rank_batch_writes_what_one_process_writes(ckpt, folder, tmp_path):
    one = tmp_path / "one.jsonl"
    run_batch(folder, [QUESTION], one, model=ckpt, attention="dense", max_new_tokens=4,
              device="cpu", progress=False)
    ref = _records(one)
    assert sorted(r["status"] for r in ref.values()) == ["error", "ok", "ok"]

    out = tmp_path / "tp.jsonl"
    first = _torchrun(ckpt, folder, out)
    assert first.returncode == 1, first.stderr[-3000:]          # the broken video's error
    summary = json.loads(first.stdout.strip().splitlines()[-1])["summary"]
    assert (summary["items"], summary["done"], summary["errors"]) == (3, 2, 1), first.stdout
    got = _records(out)
    assert set(got) == set(ref)
    for cid, r in ref.items():
        assert got[cid]["status"] == r["status"]
        assert got[cid]["video"] == r["video"]
        if r["status"] == "ok":
            assert got[cid]["response"]["answer"] == r["response"]["answer"]
            assert got[cid]["response"]["tokens"] == r["response"]["tokens"]
        else:
            assert got[cid]["error"]["code"] == r["error"]["code"] == "bad_video"

    again = _torchrun(ckpt, folder, out)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])["summary"]
    assert (summary["done"], summary["skipped"]) == (0, 3)
    assert len(out.read_text().splitlines()) == 3
