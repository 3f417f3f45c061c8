"""Decoding: probe, decode and the stream against the source frames, both backends, bad
files and arguments as VideoError, rotation and variable frame rates."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mminfer.errors import VideoError
from mminfer.video import decode, probe, sample_indices

BACKENDS = ["decord", "pyav"]


# ------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_qwen_sampling(make_video, frame_index, backend):
    path = make_video(n_frames=30, fps=10)
    v = decode(path, backend=backend)
    expected = np.array([0, 6, 12, 17, 23, 29])  # 3 s at 2 fps: 6 frames
    assert v.backend == backend
    assert v.frames.shape == (6, 48, 64, 3) and v.frames.dtype == np.uint8
    assert v.indices.tolist() == expected.tolist()
    assert [frame_index(f, 30) for f in v.frames] == expected.tolist()
    np.testing.assert_allclose(v.timestamps, expected / 10, atol=1e-3)
    assert (v.fps, v.sampled_fps, v.duration, v.width, v.height) == (10.0, 2.0, 3.0, 64, 48)
    assert v.processor_metadata() == {"fps": 2.0, "total_num_frames": 6,
                                      "frames_indices": list(range(6))}


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_window_and_uniform(make_video, frame_index, backend):
    path = make_video(n_frames=30, fps=10)
    v = decode(path, start=1.0, end=2.0, backend=backend)
    assert v.indices.tolist() == [10, 13, 17, 20]
    assert [frame_index(f, 30) for f in v.frames] == [10, 13, 17, 20]
    assert 1.0 - 1e-6 <= v.timestamps.min() and v.timestamps.max() <= 2.0 + 1e-6
    assert v.sampled_fps == pytest.approx(4 / 11 * 10)
    u = decode(path, sampling="uniform", num_frames=5, backend=backend)
    assert [frame_index(f, 30) for f in u.frames] == [0, 7, 14, 22, 29]


def test_backends_agree_and_seek_lands_on_the_right_frames(make_video, frame_index):
    # 120 frames, keyframe every 10: the PyAV reader seeks between the sparse samples
    path = make_video(n_frames=120, fps=10, gop=10)
    a = decode(path, sampling="uniform", num_frames=4, backend="decord")
    b = decode(path, sampling="uniform", num_frames=4, backend="pyav")
    assert a.indices.tolist() == b.indices.tolist() == [0, 40, 79, 119]
    assert np.array_equal(a.frames, b.frames)
    np.testing.assert_allclose(a.timestamps, b.timestamps, atol=1e-3)
    assert all(abs(frame_index(f, 120) - i) <= 1 for f, i in zip(b.frames, b.indices))


def test_fallback_to_pyav_when_decord_cannot_read(make_video, frame_index):
    # decord 0.6 fails on MPEG-TS (EOF handling); the default path must still decode it,
    # and MPEG-TS starts at a non-zero timestamp, which must not leak into timestamps.
    path = make_video("clip.ts", n_frames=40, fps=10, container="mpegts")
    v = decode(path, sampling="uniform", num_frames=4)
    assert v.backend == "pyav"
    assert [frame_index(f, 40) for f in v.frames] == [0, 13, 26, 39]
    np.testing.assert_allclose(v.timestamps, [0.0, 1.3, 2.6, 3.9], atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_probe(make_video, backend):
    info = probe(make_video(n_frames=25, fps=5, width=32, height=24), backend=backend)
    assert (info.frames, info.fps, info.duration) == (25, 5.0, 5.0)
    assert (info.width, info.height, info.codec, info.backend) == (32, 24, "h264", backend)


def test_pyav_counts_frames_when_container_has_no_count(make_video):
    # Matroska headers carry no frame count
    path = make_video("clip.mkv", n_frames=25, fps=10, container="matroska")
    assert probe(path, backend="pyav").frames == 25
    assert len(decode(path, backend="pyav", sampling="uniform", num_frames=25).frames) == 25


def test_single_frame_video(make_video, frame_index):
    v = decode(make_video(n_frames=1, fps=1))
    assert v.indices.tolist() == [0, 0] and v.frames.shape[0] == 2


# -------------------------------------------------------------------------- errors

def _bad_files(tmp_path, make_video):
    from PIL import Image

    out = {}
    out["missing"] = (tmp_path / "nope.mp4", "not found")
    (tmp_path / "empty.mp4").write_bytes(b"")
    out["empty"] = (tmp_path / "empty.mp4", "empty")
    (tmp_path / "notes.mp4").write_text("this is a text file, not a video\n" * 20)
    out["text"] = (tmp_path / "notes.mp4", "text file")
    (tmp_path / "random.mp4").write_bytes(np.random.default_rng(0).bytes(20000))
    out["random"] = (tmp_path / "random.mp4", "not a readable video")
    for name, fast in (("cut", False), ("cut_faststart", True)):
        full = make_video(f"{name}_full.mp4", n_frames=40, width=96, height=64, noise=True,
                          faststart=fast)
        data = full.read_bytes()
        (tmp_path / f"{name}.mp4").write_bytes(data[: len(data) // 2])
        out[name] = (tmp_path / f"{name}.mp4", "truncated")
    out["audio_only"] = (make_video("sound.m4a", n_frames=0, audio=True), "no video stream")
    img = Image.fromarray(np.zeros((32, 32, 3), np.uint8))
    img.save(tmp_path / "pic.png")
    img.save(tmp_path / "pic.jpg")
    (tmp_path / "pic.png").rename(tmp_path / "png_as.mp4")
    out["png"] = (tmp_path / "png_as.mp4", "PNG image")
    out["jpeg"] = (tmp_path / "pic.jpg", "JPEG image")
    img.save(tmp_path / "pic.ppm")  # no magic number we know: caught by the demuxer's kind
    out["ppm"] = (tmp_path / "pic.ppm", "still image")
    # a well-formed index whose frame data is all zeros: nothing decodes
    data = bytearray(make_video("z.mp4", n_frames=10, faststart=True).read_bytes())
    at = data.find(b"mdat") + 4
    data[at:] = bytes(len(data) - at)
    (tmp_path / "zeroed.mp4").write_bytes(bytes(data))
    out["no_frames"] = (tmp_path / "zeroed.mp4", "no decodable video frames")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", [None, "pyav"])
def test_bad_files_raise_video_error(tmp_path, make_video, backend):
    for kind, (path, words) in _bad_files(tmp_path, make_video).items():
        for fn in (decode, probe) if kind in ("missing", "png", "audio_only") else (decode,):
            with pytest.raises(VideoError) as e:
                fn(path, backend=backend)
            assert words in str(e.value), (kind, str(e.value))
            assert str(path) in str(e.value)  # says which file


@pytest.mark.parametrize("kw, words", [
    (dict(fps=0), "fps"), (dict(fps=-2.0), "fps"), (dict(fps=float("nan")), "fps"),
    (dict(fps=float("inf")), "fps"), (dict(start=2.0, end=1.0), "before end"),
    (dict(start=1.0, end=1.0), "before end"), (dict(start=-1.0), "start"),
    (dict(max_frames=0), "max_frames"), (dict(min_frames=0), "min_frames"),
    (dict(num_frames=0), "num_frames"), (dict(sampling="random"), "sampling"),
    (dict(backend="opencv"), "backend"), (dict(start=50.0), "window"),
    (dict(start=2.95, end=3.0), "window"),
])
def test_bad_arguments_raise_video_error(make_video, kw, words):
    path = make_video(n_frames=30, fps=10)
    with pytest.raises(VideoError) as e:
        decode(path, **kw)
    assert words in str(e.value)


def test_memory_error_while_decoding_is_not_called_corrupt(tmp_path):
    """Decoding out of memory (here: an address-space limit) says MemoryError, which the
    worker answers as out_of_memory ("lower fps or max_frames"), not "truncated or
    corrupt"."""
    code = f"""
import resource, sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from conftest import write_video
from mminfer import video
p = write_video({str(tmp_path / 'big.mp4')!r}, n_frames=90, fps=30, width=1280, height=720)
size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 150 * 2**20,) * 2)
try:
    video.decode(str(p), fps=30, max_frames=90, backend='pyav')
    print('decoded')
except MemoryError:
    print('MemoryError')
except Exception as e:
    print(type(e).__name__, e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]),
                              # in-process decoding (the sandbox bounds a worker instead:
                              # tests/video/test_sandbox.py)
                              "MMINFER_DECODE_SANDBOX": "0"})
    assert out.stdout.strip().splitlines()[-1] == "MemoryError", out.stdout + out.stderr


# ------------------------------------------------------------------------ streaming

def _textured(path, n=6, width=1280, height=720, fps=10):
    """Smooth colour waves with sharp-edged rectangles (where resize filters differ most),
    written fast (x264 ultrafast)."""
    import av

    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "18"})
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(n):
            img = np.stack([128 + 100 * np.sin(xx / (width / 7) + i) * np.cos(yy / (height / 5)),
                            128 + 90 * np.cos((xx + yy) / (width / 11) - i / 2),
                            (xx / width * 200 + yy / height * 55 + 10 * i) % 256], -1)
            for k in range(6):
                x0, y0 = int((k * 0.15 + 0.05 * i) % 0.8 * width), int(k * 0.13 * height)
                img[y0:y0 + height // 8, x0:x0 + width // 10] = (255 * (k % 2), 40 * k,
                                                                  255 - 40 * k)
            frame = av.VideoFrame.from_ndarray(np.clip(img, 0, 255).astype(np.uint8), "rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_equals_decode(make_video, backend):
    """Streamed frames (any chunk size, after narrowing the samples) are decode()'s frames,
    bit for bit, when the source is not much larger than the size asked for."""
    from mminfer.video import open_stream
    path = make_video(n_frames=120, fps=10, gop=10, noise=True)
    ref = decode(path, backend=backend, fps=4)
    for n in (1, 5, 100):
        with open_stream(path, backend=backend, fps=4) as s:
            assert len(s) == len(ref.frames) and s.shape == ref.frames.shape
            assert s.request_size(24, 32) == (48, 64)           # 4x the pixels: not scaled
            chunks = list(s.chunks(n))
        assert [len(c) for c in chunks[:-1]] == [n] * (len(chunks) - 1)
        assert np.array_equal(np.concatenate(chunks), ref.frames)
        assert s.backend == backend and s.decode_ms > 0
        assert (s.fps, s.sampled_fps, s.duration) == (ref.fps, ref.sampled_fps, ref.duration)
    keep = [0, 3, 3, 7, len(ref.frames) - 1]                     # repeats allowed, in order
    with open_stream(path, backend=backend, fps=4) as s:
        s.keep_samples(keep)
        got = np.concatenate(list(s.chunks(2)))
    assert np.array_equal(got, ref.frames[keep])
    with open_stream(path, backend=backend, fps=4) as s, pytest.raises(ValueError):
        s.keep_samples([3, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_scaled_by_the_decoder_is_close_to_the_reference_resize(tmp_path, backend):
    """A source with over 4x the wanted pixels is scaled by the decoder (720p -> 252x448):
    within about a level of decoding at full size and resizing with the adapter's
    antialiased bicubic; only pixels on saturated colour edges differ by more (the decoder
    scales the chroma planes before converting to RGB)."""
    import torch
    from mminfer.video import open_stream
    from mminfer.models.qwen2_5_vl import resize_frames
    path = _textured(tmp_path / "tex.mp4")
    ref = decode(path, backend=backend, fps=10)
    want = resize_frames(torch.from_numpy(ref.frames), 252, 448).permute(0, 2, 3, 1).numpy()
    with open_stream(path, backend=backend, fps=10) as s:
        assert s.request_size(252, 448) == (252, 448) and s.decode_size == (252, 448)
        got = np.concatenate(list(s.chunks(4))).astype(np.float32)
    assert got.shape == want.shape == (6, 252, 448, 3)
    # decode(size=...) is the same decoder-side scaling, all frames at once
    assert np.array_equal(decode(path, backend=backend, fps=10, size=(252, 448)).frames, got)
    d = np.abs(got - want)
    print(f"{backend}: mean {d.mean():.2f} levels, p99 {np.percentile(d, 99):.0f}, "
          f"{(d > 20).mean():.2%} over 20")
    assert d.mean() < 2.0 and np.percentile(d, 99) <= 8 and (d > 20).mean() < 0.01


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_oversized_video_decodes_with_bounded_memory(tmp_path, backend):
    """A 4K upload streamed at the model's size never holds a full-size frame: every array
    the stream hands out is the target size, and numpy's peak traced memory stays under one
    4K frame (decode() at full size holds all of them)."""
    import av
    import tracemalloc
    from mminfer.video import open_stream
    path = tmp_path / "uhd.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=4, options={"preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = 3840, 2160, "yuv420p"
        for i in range(4):
            img = np.full((2160, 3840, 3), 40 * i + 20, np.uint8)
            img[:, :1920, 0] = 200
            for p in s.encode(av.VideoFrame.from_ndarray(img, "rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    full_frame = 3840 * 2160 * 3
    tracemalloc.start()
    try:
        with open_stream(path, backend=backend, fps=4) as s:
            assert s.shape == (4, 2160, 3840, 3)
            assert s.request_size(280, 504) == (280, 504)
            chunks = list(s.chunks(2))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [c.shape for c in chunks] == [(2, 280, 504, 3)] * 2
    print(f"{backend}: peak traced {peak / 2**20:.1f} MiB (one 4K frame "
          f"{full_frame / 2**20:.1f} MiB)")
    assert peak < full_frame
    # and they are the right frames: left half red, the rest gray at 20, 60, 100, 140
    frames = np.concatenate(chunks).astype(np.float32)
    assert np.all(np.abs(frames[:, :, :200, 0] - 200) < 4)
    assert np.all(np.abs(frames[:, :, -200:, 1].mean((1, 2)) - [20, 60, 100, 140]) < 4)


def test_stream_falls_back_to_pyav_mid_read(make_video, frame_index):
    """decord opens MPEG-TS but fails reading it: the stream hands the samples to PyAV."""
    from mminfer.video import open_stream
    path = make_video("clip.ts", n_frames=40, fps=10, container="mpegts")
    with open_stream(path, sampling="uniform", num_frames=4) as s:
        got = np.concatenate(list(s.chunks(3)))
    assert s.backend == "pyav"
    assert [frame_index(f, 40) for f in got] == [0, 13, 26, 39]


@pytest.mark.timeout(60)
def test_stream_errors_are_video_errors(tmp_path, make_video):
    """What decode() says about a bad file, the stream says too: when opened or, for data
    that breaks while decoding, from chunks()."""
    from mminfer.video import open_stream
    for kind, (path, words) in _bad_files(tmp_path, make_video).items():
        with pytest.raises(VideoError) as e:
            with open_stream(path, backend="pyav") as s:
                list(s.chunks(4))
        assert words in str(e.value), (kind, str(e.value))


def test_stream_decodes_ahead_and_stops_on_close(make_video):
    """The decoder thread works while the consumer is busy (after the first chunk the
    consumer waits for nothing), and close() stops it mid-video."""
    import time
    from mminfer.video import open_stream
    path = make_video(n_frames=60, fps=10)
    with open_stream(path, fps=10) as s:
        chunks = s.chunks(15)
        next(chunks)
        first_wait = s.wait_ms
        for _ in chunks:
            time.sleep(0.3)                         # "the vision tower" on the last chunk
    assert s.wait_ms - first_wait < 150 and s.decode_ms > 0
    s = open_stream(path, fps=10, num_frames=60)
    next(s.chunks(1))
    thread = s._thread
    s.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        next(s.chunks(1))
    with pytest.raises(RuntimeError):
        s.request_size(10, 10)


def test_rendered_frames_make_a_video_sampled_at_its_rate():
    from mminfer.video import DecodedVideo
    frames = np.zeros((6, 84, 112, 3), np.uint8)
    v = DecodedVideo.from_frames(frames, fps=2.0, backend="eval")
    assert (v.width, v.height, v.num_frames, v.backend) == (112, 84, 6, "eval")
    assert v.timestamps.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert v.indices.tolist() == list(range(6)) and v.duration == 3.0
    assert v.processor_metadata()["fps"] == 2.0


# ------------------------------------------------- rotation and variable frame rate (#32)

def _marked(path, rotation=None, pts=None, container="mp4", n=6, h=48, w=96):
    """A landscape clip with a white block in its top-left corner; ``rotation`` writes a
    display matrix (PyAV: degrees counter-clockwise, as FFmpeg reads it back), ``pts`` the
    presentation times in seconds (a variable frame rate)."""
    import av
    from fractions import Fraction
    with av.open(str(path), "w", format=container) as c:
        s = c.add_stream("libx264", rate=30, options={"preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if pts is not None:
            s.time_base = s.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            s.set_display_rotation(rotation)
        for i in range(n if pts is None else len(pts)):
            a = np.full((h, w, 3), 40, np.uint8)
            a[: h // 2, : w // 4] = 255
            f = av.VideoFrame.from_ndarray(a, format="rgb24")
            if pts is not None:
                f.pts, f.time_base = int(round(pts[i] * 1000)), Fraction(1, 1000)
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _block(frame):
    ys, xs = np.nonzero(frame[:, :, 0] > 150)
    return frame.shape[:2], (ys.mean() < frame.shape[0] / 2, xs.mean() < frame.shape[1] / 2)


@pytest.mark.parametrize("backend", [None, "pyav"])   # decord's own turning breaks on sizes
def test_display_rotation_is_applied(tmp_path, backend):
    """A phone's portrait video (stored landscape with a 90 degree display matrix) is read
    portrait, as FFmpeg's players show it: turned counter-clockwise, the stored top-left
    corner comes to the bottom-left. probe and the stream report the displayed size."""
    from mminfer.video import open_stream
    plain = _marked(tmp_path / "plain.mp4")
    assert _block(decode(plain, backend=backend).frames[0]) == ((48, 96), (True, True))
    for deg, want in ((90, ((96, 48), (False, True))), (270, ((96, 48), (True, False))),
                      (180, ((48, 96), (False, False)))):
        path = _marked(tmp_path / f"r{deg}.mp4", rotation=deg)
        v = decode(path, backend=backend)
        assert _block(v.frames[0]) == want, deg
        assert (v.height, v.width) == want[0]
        info = probe(path, backend=backend)
        assert (info.height, info.width) == want[0]
        with open_stream(path, backend=backend) as s:
            assert s.shape[1:3] == want[0]
            assert _block(next(s.chunks(2))[0]) == want


@pytest.mark.parametrize("container", ["mp4", "matroska"])
def test_variable_frame_rate_is_sampled_by_timestamps(tmp_path, container):
    """Ten frames at 30 fps, then ten spread over an hour: the duration is the hour (not
    20 frames at 30 fps, 0.67 s), and the samples are spread over it in time, each frame's
    timestamp its own."""
    pts = np.concatenate([np.arange(10) / 30, np.linspace(600, 3600, 10)])
    path = _marked(tmp_path / f"vfr.{'mp4' if container == 'mp4' else 'mkv'}", pts=pts,
                   container=container)
    info = probe(path)
    assert info.frames == 20 and 3600 <= info.duration < 3601, info
    v = decode(path, fps=2.0, max_frames=16)
    assert 3600 <= v.duration < 3601
    np.testing.assert_allclose(v.timestamps, pts[v.indices], atol=2e-3)
    # evenly spaced in time: 16 samples over the hour, about 240 s apart; most from the
    # sparse part (a frame-number rule would take 8 of the first 10 frames, all in 0.3 s)
    assert len(v.indices) == 16 and (v.timestamps > 300).sum() >= 13, v.timestamps
    assert v.sampled_fps == pytest.approx(16 / 3600.033, rel=1e-3)
    u = decode(path, sampling="uniform", num_frames=4)
    np.testing.assert_allclose(u.timestamps, [0.0, 1266.7, 2266.7, 3600.0], atol=1.0)
    w = decode(path, start=1000.0, end=3000.0, num_frames=4)   # a window, in seconds
    assert w.timestamps.min() >= 1000 and w.timestamps.max() <= 3000, w.timestamps


def test_constant_rate_sampling_is_unchanged_by_timestamps(make_video):
    """A constant-rate file's timestamps change nothing: the frame-number rules hold."""
    path = make_video(n_frames=300, fps=30)
    from mminfer.video import is_variable_rate
    assert not is_variable_rate(np.arange(300) / 30 + 1e-4, 30.0)
    assert decode(path).indices.tolist() == sample_indices(300, 30).tolist()
