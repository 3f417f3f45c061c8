"""`torchrun --nproc-per-node 2 -m mminfer serve --tensor-parallel 2` on the CPU (gloo): rank 0
serves HTTP and rank 1 follows; a request over HTTP gets the answer one process's server
gives; a sparse request whose client leaves mid-prefill is stopped on both ranks and the
next request still gets that answer; SIGTERM to rank 0 alone ends both ranks with status 0
(the follower is told to stop, it neither waits nor is killed)."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, write_video

from mminfer.serve.app import Settings, create_app

QUESTION = "what is in the video?"
FIELDS = {"question": QUESTION, "fps": "2", "max_frames": "16", "max_new_tokens": "6",
          "attention": "dense"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"RANK="):
            return int(kv[5:])
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _post(url, video: Path):
    return httpx.post(f"{url}/v1/answer", files={"video": ("v.mp4", video.read_bytes(),
                                                           "video/mp4")},
                      data=FIELDS, timeout=120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    # 4 layers: a stop asked for seconds into the sparse prefill lands before a later one
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tpsrv") / "tiny-qwen", heads=4,
                                kv_heads=2, layers=4)


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("tpsrvv") / "v.mp4", n_frames=40, fps=10.0)


@pytest.fixture(scope="module")
def long_video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("tpsrvl") / "long.mp4", n_frames=200, fps=10.0)


def test_two_rank_server_answers_as_one_process_and_stops_both(ckpt, video, long_video,
                                                               tmp_path):
    app = create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(tmp_path / "one"),
                              api_key=None))
    with LiveServer(app) as one:
        ref = _post(one.url, video)
    assert ref.status_code == 200, ref.text

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMINFER_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), "-m", "mminfer", "serve", "--model", str(ckpt),
         "--device", "cpu", "--port", "0", "--data-dir", str(tmp_path / "tp"),
         "--log-level", "info", "--tensor-parallel", "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)         # its own process group: a failed test ends the ranks too
    lines, url = [], []

    def read():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"mminfer serving .* at (http://127\.0\.0\.1:\d+)", line)
            if m:
                url.append(m.group(1))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not url and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert url, "".join(lines)[-3000:]
        ranks = {_rank_of(p): p for p in _children(proc.pid)}
        assert set(ranks) == {0, 1}, (ranks, "".join(lines)[-2000:])

        got = _post(url[0], video)
        assert got.status_code == 200, got.text
        a, b = got.json(), ref.json()
        assert a["answer"] == b["answer"]
        assert a["tokens"] == b["tokens"] and a["attention"] == b["attention"] == "dense"
        assert httpx.get(f"{url[0]}/health", timeout=10).status_code == 200

        # the Triton interpreter takes seconds per sparse layer here: the client gives up
        # inside the prefill, rank 0 asks the job to stop, every rank stops at one check
        slow = {**FIELDS, "attention": "sparse", "fps": "8", "max_frames": "128"}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url[0]}/v1/answer", data=slow, timeout=3,
                       files={"video": ("long.mp4", long_video.read_bytes(), "video/mp4")})
        again = _post(url[0], video)                 # queued until the stopped job ends
        assert again.status_code == 200, again.text
        assert again.json()["answer"] == b["answer"]
        metrics = httpx.get(f"{url[0]}/metrics", timeout=10).text
        stops = re.search(r"^mminfer:request_stop_seconds_count\{[^}]*\} (\S+)$", metrics,
                          re.M)
        assert stops and float(stops.group(1)) == 1.0, metrics[-2000:]
        assert any(re.search(r"rank 1: job \d+ stopped on every rank \(request cancelled "
                             r"during the prefill", ln) for ln in lines), "".join(lines)[-3000:]

        os.kill(ranks[0], signal.SIGTERM)        # rank 0 only: rank 1 must be told
        deadline = time.monotonic() + 90
        while any(_alive(p) for p in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in ranks.values()), "".join(lines)[-3000:]
        assert proc.wait(60) == 0, "".join(lines)[-3000:]   # both ranks exited 0
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
