"""The decode sandbox (mminfer.video.sandbox): a file that crashes, starves or hangs
the C/C++ parsers costs one worker process, never the caller; the caller gets
UndecodableVideo (400 bad_video) naming the file, the next video decodes, the worker is replaced; frames
come back through shared memory, equal to in-process decoding."""

import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_video

from mminfer import video
from mminfer.errors import UndecodableVideo, VideoError
from mminfer.video import remote, sandbox

NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"


def crafted_stts(path: Path, count=2**31 - 1) -> Path:
    """The issue's 5 KB killer: the sample count of the first ``stts`` entry forged."""
    b = bytearray(NEEDLE.read_bytes())
    i = b.find(b"stts")
    b[i + 12:i + 16] = struct.pack(">I", count)
    path.write_bytes(bytes(b))
    return path


@pytest.fixture
def limits():
    """Restore the sandbox's settings after a test changes them."""
    before = sandbox.config()
    yield sandbox.configure
    sandbox.configure(**{f: getattr(before, f) for f in before.__dataclass_fields__})


def test_the_crafted_stts_file_kills_an_unsandboxed_process(tmp_path):
    """The premise: without the sandbox this file aborts the process (SIGABRT from
    std::bad_alloc), so a test that sees UndecodableVideo below tests the sandbox."""
    import subprocess
    import sys
    bad = crafted_stts(tmp_path / "c.mp4")
    code = f"from mminfer import video; video.probe({str(bad)!r}); print('survived')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MMINFER_DECODE_SANDBOX": "0",
                            "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode != 0 and "survived" not in r.stdout, (r.returncode, r.stderr[-500:])


def test_a_crashing_file_is_refused_and_the_next_video_decodes(tmp_path):
    bad = crafted_stts(tmp_path / "c.mp4")
    pool = sandbox.decoder_pool()
    retired = pool.retired
    for fn in (video.probe, video.decode, lambda p: list(video.open_stream(p).chunks(4))):
        t0 = time.perf_counter()
        with pytest.raises(UndecodableVideo) as e:
            fn(bad)
        took = time.perf_counter() - t0
        assert str(bad) in str(e.value) and "cannot be decoded" in str(e.value)
        assert e.value.http_status == 400 and e.value.code == "bad_video"
        assert e.value.details["reason"] in ("crashed", "memory"), e.value.details
        assert took < 30, took
    assert pool.retired >= retired + 3
    info = video.probe(NEEDLE)                   # the next request is served
    assert (info.frames, info.width) == (20, 224)
    assert len(video.decode(NEEDLE).frames) == 20


def test_a_worker_killed_mid_stream_fails_that_stream_only(tmp_path):
    path = write_video(tmp_path / "long.mp4", n_frames=240, fps=30, width=320, height=240,
                       noise=True)
    pool = sandbox.decoder_pool()
    retired = pool.retired
    with video.open_stream(path, fps=30, max_frames=240) as s:
        chunks = s.chunks(8)
        next(chunks)
        pid = s._session.worker.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(UndecodableVideo) as e:
            for _ in chunks:
                pass
    assert e.value.details["reason"] == "crashed" and "SIGKILL" in str(e.value)
    assert pool.retired == retired + 1
    assert len(video.decode(path, fps=30, max_frames=240).frames) == 240
    deadline = time.monotonic() + 60       # a started worker waits again (a replacement)
    while not pool.idle_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.idle_pids() and pid not in pool.idle_pids()


def test_an_overrun_is_a_timeout(tmp_path, limits):
    """A decoder that does not answer within the time limit is killed: opening any real
    file takes more than a millisecond, so it stands in for a parser stuck in a loop."""
    path = write_video(tmp_path / "v.mp4", n_frames=60, fps=30, width=640, height=480,
                       noise=True)
    video.probe(NEEDLE)                            # a started worker (start time not counted)
    limits(timeout_s=0.001)
    with pytest.raises(UndecodableVideo) as e:
        video.decode(path)
    assert e.value.details["reason"] == "timeout" and "longer than" in str(e.value)
    limits(timeout_s=60.0)
    assert len(video.decode(path).frames) > 0


def test_the_memory_limit_is_enforced(tmp_path, limits):
    """A worker may map its footprint, the frames in flight (sized from the header, at most
    ``max_frame_pixels`` a frame: a header may lie) and the margin. A 4K video whose frames
    are sized as 64x64 ones, with 1 MiB of margin, cannot be decoded under that RLIMIT_AS and
    is refused as this file's failure; with the real sizes the same call succeeds, so the
    limit is what refused it."""
    import av
    path = tmp_path / "uhd.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=4, options={"preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = 3840, 2160, "yuv420p"
        for i in range(2):
            img = np.random.default_rng(i).integers(0, 255, (2160, 3840, 3), np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, "rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    limits(memory_mb=1, per_core_mb=0, max_frame_pixels=64 * 64)
    # refused either way: the worker's MemoryError/ENOMEM (UndecodableVideo, "memory"), or,
    # where FFmpeg swallows the failed allocation, what is left of the file ("no frames")
    with pytest.raises(VideoError) as e:
        video.decode(path)
    assert str(path) in str(e.value)
    limits(memory_mb=1024, per_core_mb=256, max_frame_pixels=7680 * 4320)
    assert video.decode(path).frames.shape == (2, 2160, 3840, 3)


def test_an_ordinary_bad_file_is_a_video_error_and_keeps_the_worker(tmp_path):
    (tmp_path / "random.mp4").write_bytes(np.random.default_rng(0).bytes(20000))
    pool = sandbox.decoder_pool()
    video.probe(NEEDLE)
    retired = pool.retired
    with pytest.raises(VideoError) as e:
        video.decode(tmp_path / "random.mp4")
    assert not isinstance(e.value, UndecodableVideo)
    assert pool.retired == retired                  # nothing crashed: no worker was lost


def test_frames_come_through_shared_memory_and_equal_in_process_decoding(tmp_path, limits):
    """Bit-for-bit the in-process frames; the arrays are mappings of the worker's shared
    memory (not unpickled copies), and holding every chunk while the stream goes on never
    lets a slot be rewritten under them."""
    path = write_video(tmp_path / "v.mp4", n_frames=90, fps=30, width=96, height=64,
                       noise=True)
    limits(sandbox=False)
    ref = video.decode(path, fps=30, max_frames=90)
    limits(sandbox=True)
    got = video.decode(path, fps=30, max_frames=90)
    assert np.array_equal(got.frames, ref.frames)
    with video.open_stream(path, fps=30, max_frames=90) as s:
        held = list(s.chunks(3))                    # 30 chunks of 3 from batches of 8
    base = held[0]
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(base, (memoryview, __import__("mmap").mmap)), type(base)
    assert np.array_equal(np.concatenate(held), ref.frames)
    assert (s.fps, s.sampled_fps, s.duration) == (ref.fps, ref.sampled_fps, ref.duration)


def test_workers_are_fresh_interpreters_not_forks():
    s = remote.session()
    s.probe(str(NEEDLE), ("decord", "pyav"), "mp4")
    pids = sandbox.decoder_pool().idle_pids()
    assert pids
    cmd = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
    assert b"mminfer.video.worker" in cmd, cmd


def test_batch_records_a_crashing_file_as_bad_video_at_once(tmp_path):
    """In the batch job the crafted file is one bad_video record in the first run (before the
    sandbox it killed the process twice and was quarantined on the third run); the other
    video is answered in the same run."""
    import json
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    from mminfer.batch import run_batch
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny-qwen")
    root = tmp_path / "v"
    root.mkdir()
    crafted_stts(root / "c.mp4")
    write_video(root / "good.mp4", n_frames=4, fps=4.0)
    out = tmp_path / "out.jsonl"
    s = run_batch(root, ["what?"], out, model=str(ckpt), attention="dense", max_new_tokens=2,
                  progress=False)
    by = {r["video"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by["c.mp4"]["status"] == "error" and by["c.mp4"]["error"]["code"] == "bad_video"
    assert "cannot be decoded" in by["c.mp4"]["error"]["message"]
    assert by["good.mp4"]["status"] == "ok", by["good.mp4"]
    assert (s.done, s.errors, s.quarantined) == (1, 1, 0)


def test_a_hung_worker_is_timed_out_mid_stream(tmp_path, limits):
    """A worker that stops answering mid-video (frozen with SIGSTOP: a parser stuck in a
    loop) is killed after the time limit; the stream fails with a timeout, the next one
    decodes."""
    path = write_video(tmp_path / "long.mp4", n_frames=240, fps=30, width=320, height=240,
                       noise=True)
    limits(timeout_s=2.0)
    with video.open_stream(path, fps=30, max_frames=240) as s:
        chunks = s.chunks(8)
        next(chunks)
        os.kill(s._session.worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(UndecodableVideo) as e:
            for _ in chunks:
                pass
        took = time.monotonic() - t0
    assert e.value.details["reason"] == "timeout" and took < 2.0 + 10, took
    assert len(video.decode(path, fps=30, max_frames=240).frames) == 240


def test_closing_a_stream_does_not_wait_for_a_hung_worker(tmp_path):
    """A consumer that stops (a client gone) while the worker is stuck is free within a
    couple of seconds, not after the 30 s time limit."""
    path = write_video(tmp_path / "long.mp4", n_frames=240, fps=30, width=320, height=240,
                       noise=True)
    s = video.open_stream(path, fps=30, max_frames=240)
    next(s.chunks(8))
    pid = s._session.worker.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    s.close()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ProcessLookupError):       # killed, not left stopped
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)
    assert len(video.decode(path, fps=30, max_frames=240).frames) == 240


def test_concurrent_callers_on_short_lived_threads():
    """Fourteen uploads probed at once from threads that end (asyncio.to_thread's, a
    burst's): every one succeeds. (Workers started on such threads died with them, by the
    parent-death signal, and the probe after was refused as a crash.)"""
    import threading
    errors = []

    def go():
        try:
            video.probe(NEEDLE)
            with video.open_stream(NEEDLE) as s:
                list(s.chunks(4))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    for _ in range(2):
        threads = [threading.Thread(target=go) for _ in range(14)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
