"""Crafted media against a real `mminfer serve` process (CPU, the tiny Qwen2.5-VL checkpoint):
a seeded generator mutates the sample MP4's container headers (sample counts, sizes,
durations, timescales, dimensions, edit lists, chunk offsets past the end, box sizes),
truncates it at many points, and adds a small codec zoo (whatever the local PyAV encodes:
WebM VP8/VP9, Matroska, MPEG-TS, GIF, MJPEG), sent through multipart upload, a chat `data:`
URL and a local file path. Every case must be a JSON 4xx or an answer, the process must
live, `/health` must stay fast throughout, and no temp file may be left.

Nothing binary is committed: the cases are made here from samples/videos/needle_0.mp4."""

import base64
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lab.toy.tiny import save_tiny_qwen2_5_vl

NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
SEED = 32
CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta"}


def boxes(data: bytes, start=0, end=None, out=None):
    """(type, offset of the box) of every box, descending into the containers and stsd."""
    out = [] if out is None else out
    end = len(data) if end is None else end
    at = start
    while at + 8 <= end:
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if size < 8 or at + size > end:
            break
        out.append((kind, at))
        if kind in CONTAINERS:
            boxes(data, at + 8, at + size, out)
        elif kind == b"stsd":
            boxes(data, at + 16, at + size, out)
        at += size
    return out


# (box, byte offset of the field from the box start, width) of the fields worth forging
FIELDS = [
    (b"stts", 12, 4), (b"stts", 16, 4), (b"stts", 20, 4),           # entries, count, delta
    (b"stsz", 12, 4), (b"stsz", 16, 4), (b"stsz", 20, 4),           # size, count, first size
    (b"stco", 12, 4), (b"stco", 16, 4),                             # entries, first offset
    (b"stsc", 12, 4), (b"stsc", 16, 4), (b"stsc", 20, 4),           # entries, chunk, samples
    (b"stss", 12, 4), (b"ctts", 12, 4), (b"ctts", 16, 4),
    (b"mdhd", 20, 4), (b"mdhd", 24, 4), (b"mvhd", 20, 4), (b"mvhd", 24, 4),   # timescale, dur
    (b"tkhd", 28, 4), (b"tkhd", 84, 4), (b"tkhd", 88, 4),           # duration, width, height
    (b"tkhd", 48, 4), (b"tkhd", 52, 4),                             # display matrix a, b
    (b"elst", 12, 4), (b"elst", 16, 4), (b"elst", 20, 4),           # entries, duration, media time
    (b"avc1", 32, 2), (b"avc1", 34, 2), (b"avcC", 8 + 5, 1), (b"avcC", 8 + 6, 2),
]
VALUES = [0, 1, 2, 0x7FFF, 0xFFFF, 2**30, 2**31 - 1, 2**32 - 1]


def mutants(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    base = NEEDLE.read_bytes()
    where = {}
    for kind, at in boxes(base):
        where.setdefault(kind, at)
    out = []
    # the killer first, then random forged fields (one to three per file)
    b = bytearray(base)
    i = where[b"stts"]
    b[i + 12 + 4:i + 12 + 8] = struct.pack(">I", 2**31 - 1)
    out.append(("stts_count_2^31", bytes(b)))
    fields = [f for f in FIELDS if f[0] in where]
    while len(out) < n:
        b = bytearray(base)
        names = []
        for box, off, width in rng.sample(fields, rng.randint(1, 3)):
            v = rng.choice(VALUES + [rng.getrandbits(8 * width)]) % (1 << 8 * width)
            at = where[box] + off
            b[at:at + width] = v.to_bytes(width, "big")
            names.append(f"{box.decode()}+{off}={v}")
        if rng.random() < 0.2:                  # and a box size forged
            kind, at = rng.choice(boxes(base))
            v = rng.choice([0, 1, 7, 9, 2**31, 2**32 - 1, len(base) * 4])
            b[at:at + 4] = struct.pack(">I", v)
            names.append(f"{kind.decode()}.size={v}")
        out.append(("+".join(names), bytes(b)))
    return out


def truncations(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    base = NEEDLE.read_bytes()
    cuts = sorted({8, 64, len(base) - 1, *(rng.randrange(9, len(base) - 1) for _ in range(n))})
    return [(f"cut@{c}", base[:c]) for c in cuts[:n]]


def zoo(tmp: Path) -> list[tuple[str, bytes]]:
    """Small clips in what the local PyAV can encode."""
    import av
    import numpy as np
    specs = [("webm", "libvpx", "yuv420p", "v.webm"), ("webm", "libvpx-vp9", "yuv420p", "v9.webm"),
             ("matroska", "libx264", "yuv420p", "v.mkv"), ("mpegts", "mpeg2video", "yuv420p",
                                                            "v.ts"),
             ("gif", "gif", "rgb8", "v.gif"), ("avi", "mjpeg", "yuvj420p", "v.avi")]
    out = []
    for fmt, codec, pix, name in specs:
        path = tmp / name
        try:
            with av.open(str(path), "w", format=fmt) as c:
                s = c.add_stream(codec, rate=4)
                s.width, s.height, s.pix_fmt = 64, 48, pix
                for i in range(8):
                    img = np.full((48, 64, 3), 20 * i + 30, np.uint8)
                    for p in s.encode(av.VideoFrame.from_ndarray(img, "rgb24").reformat(
                            format=pix)):
                        c.mux(p)
                for p in s.encode():
                    c.mux(p)
        except Exception:  # noqa: BLE001 (an encoder this PyAV build lacks)
            continue
        out.append((f"zoo:{name}", path.read_bytes()))
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    ckpt = save_tiny_qwen2_5_vl(tmp / "tiny-qwen", max_position_embeddings=4096)
    media, data = tmp / "media", tmp / "data"
    media.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("MMINFER_API_KEY", None)
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", "serve", "--model", str(ckpt),
                          "--port", "0", "--data-dir", str(data), "--device", "cpu",
                          "--log-level", "warning", "--allowed-local-media-path", str(media),
                          "--decode-timeout-s", "20",
                          # every answered case decodes (a cache hit would skip the decoder,
                          # and the /health baseline's good uploads would cost nothing)
                          "--no-video-cache"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url, lines = None, []
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline and p.poll() is None:
        line = p.stdout.readline()
        lines.append(line)
        if " at http://" in line:
            url = line.split(" at ", 1)[1].split()[0]
    assert url, "the server did not start:\n" + "".join(lines[-30:])
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()   # drain
    while httpx.get(f"{url}/health", timeout=10).json().get("status") != "ok":
        time.sleep(0.2)
    yield url, p, media, data
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


def send(url, media: Path, how: str, name: str, raw: bytes) -> httpx.Response:
    q = {"max_tokens": 1}
    if how == "upload":
        return httpx.post(f"{url}/v1/answer", timeout=120, data={"question": "what?",
                          "max_new_tokens": "1"}, files={"video": ("v.mp4", raw, "video/mp4")})
    if how == "data":
        ref = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    else:
        path = media / f"case-{abs(hash(name)) % 10**9}.mp4"
        path.write_bytes(raw)
        ref = f"file://{path}"
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": ref}}, {"type": "text", "text": "what?"}]}],
        **q}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def p95(xs) -> float:
    return sorted(xs)[int(0.95 * (len(xs) - 1))]


def health_latencies(url, stop: threading.Event, out: list):
    while not stop.is_set():
        t0 = time.monotonic()
        httpx.get(f"{url}/health", timeout=30)
        out.append(time.monotonic() - t0)
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_crafted_media_never_take_the_server_down(server, tmp_path):
    url, proc, media, data = server
    rng = random.Random(SEED)
    cases = mutants(rng, 36) + truncations(rng, 14) + zoo(tmp_path)
    ways = ("upload", "data", "file")
    # The baseline, in this run: /health while the server answers good uploads (the model's
    # CPU work, on a machine that may be shared). The bound is 0.5 s; on a machine so loaded
    # that benign traffic alone comes near it (a shared 2-core box at a load of 8 measured a
    # p95 of 0.49 s and a worst of 0.54 s), it scales with what benign traffic measured then:
    # p95 x 1.5 and worst x 2.5 (crafted cases restart workers, which costs CPU the benign
    # ones do not). A stall of the server's own (a blocked event loop: seconds) or its death
    # still fails.
    base, stop = [], threading.Event()
    th = threading.Thread(target=health_latencies, args=(url, stop, base))
    th.start()
    try:
        # at least 4 answers and enough probes for a p95 (a fast machine answers 4 in 0.5 s)
        for n in range(60):
            if n >= 4 and len(base) >= 12:
                break
            assert send(url, media, "upload", "needle", NEEDLE.read_bytes()).status_code == 200
    finally:
        stop.set()
        th.join()
    lat, stop = [], threading.Event()
    th = threading.Thread(target=health_latencies, args=(url, stop, lat))
    th.start()
    seen = {}
    try:
        plan = [(name, raw, ways[i % 3]) for i, (name, raw) in enumerate(cases)]
        plan += [(cases[0][0], cases[0][1], w) for w in ways[1:]]   # the killer, every way
        for name, raw, how in plan:
            r = send(url, media, how, name, raw)
            assert proc.poll() is None, f"the server died on {name} ({how})"
            assert r.headers.get("content-type", "").startswith("application/json"), \
                (name, how, r.status_code, r.text[:200])
            body = r.json()
            if r.status_code == 200:
                seen.setdefault("answered", []).append(name)
            else:
                assert 400 <= r.status_code < 500, (name, how, r.status_code, body)
                assert body["error"]["message"], (name, how, body)
                # refusals by kind: what the decoder said (invalid) or did (crashed...)
                kind = body["error"].get("reason", r.status_code)
                seen.setdefault(kind, []).append(name)
            if name == cases[0][0]:
                assert r.status_code == 400 and "cannot be decoded" in \
                    body["error"]["message"] and body["error"]["reason"] == "crashed", body
                ok = send(url, media, "upload", "needle", NEEDLE.read_bytes())
                assert ok.status_code == 200, ok.text   # and the next request is answered
    finally:
        stop.set()
        th.join()
    print({k: len(v) for k, v in seen.items()}, f"{len(plan)} cases;",
          f"/health: good uploads p95 {p95(base):.3f} s worst {max(base):.3f} s; crafted "
          f"p95 {p95(lat):.3f} s worst {max(lat):.3f} s over {len(lat)} probes")
    assert len(seen.get("answered", [])) >= 3 and len(seen) >= 3, seen   # both kinds met
    assert len(lat) > 20 and len(base) >= 12
    assert p95(lat) <= max(0.5, 1.5 * p95(base)), (p95(lat), p95(base))
    assert max(lat) <= max(0.5, 2.5 * max(base)), (max(lat), max(base))
    # no temp file left behind: uploads and data: URLs are deleted, and nothing in /dev/shm
    deadline = time.monotonic() + 10
    while os.listdir(data / "uploads") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(data / "uploads") == []
    assert not [f for f in os.listdir("/dev/shm") if "mminfer" in f]
    assert proc.poll() is None
