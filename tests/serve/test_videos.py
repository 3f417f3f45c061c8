"""Upload once, ask many times: the video store (dedupe by content, byte and count budgets,
expiry, leases that outlive a delete, a restart) and ``/v1/videos`` on a live server with
the tiny Qwen2.5-VL checkpoint: the life cycle (upload, list, get, answer by id twice -> the
second a cache hit, chat by ``mminfer://videos/{id}``, delete -> 404), an upload and a data:
URL of the same bytes sharing one cache entry, the budgets and expiry over HTTP, auth."""

import base64
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from conftest import write_video

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.errors import TooLarge
from mminfer.serve.app import Settings, create_app
from mminfer.serve.videos import (INDEX, StoreFull, VideoNotFound, VideoStore, sha256_of,
                                  video_id_of)

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"


# ----------------------------------------------------------------------- the store

class Clock:
    def __init__(self):
        self.t = 1_000_000.0

    def __call__(self):
        return self.t


def temp_file(folder: Path, data: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    p = folder / f"upload-{len(list(folder.iterdir()))}.video"
    p.write_bytes(data)
    return str(p)


def add(store, tmp, data: bytes, name="v.mp4"):
    path = temp_file(tmp / "incoming", data)
    v = store.add(path, name, sha256_of(path))
    assert not os.path.exists(path)            # taken: moved in or dropped
    return v


def blobs(store) -> list:
    return sorted(f.name for f in store.folder.iterdir() if f.name != INDEX)


def test_store_dedupes_and_keeps_its_budgets(tmp_path):
    clock = Clock()
    store = VideoStore(tmp_path / "videos", max_bytes=2500, max_count=3, ttl_s=100, clock=clock)
    a, b = os.urandom(1000), os.urandom(1000)
    va = add(store, tmp_path, a, "a.mp4")
    assert va.id.startswith("video-") and va.bytes == 1000 and va.filename == "a.mp4"
    assert va.expires_at == int(clock.t) + 100 and len(va.sha256) == 64
    va2 = add(store, tmp_path, a, "again.mp4")          # the same bytes: a new id, one file
    assert va2.id != va.id and va2.sha256 == va.sha256
    assert blobs(store) == [f"{va.sha256}.video"] and store.used_bytes() == 1000
    vb = add(store, tmp_path, b)
    assert store.used_bytes() == 2000
    with pytest.raises(StoreFull, match="holds 3 videos"):      # the count budget
        add(store, tmp_path, a)
    store.delete(va2.id)
    with pytest.raises(StoreFull, match="store is full") as e:   # the byte budget
        add(store, tmp_path, os.urandom(1000))
    assert e.value.http_status == 507
    with pytest.raises(TooLarge) as e:                    # larger than the whole store
        add(store, tmp_path, os.urandom(3000))
    assert e.value.http_status == 413
    assert os.listdir(tmp_path / "incoming") == []        # refused uploads leave no file
    clock.t += 101                                        # a and b expire: room again
    vc = add(store, tmp_path, os.urandom(1000))
    assert [v.id for v in store.list()] == [vc.id]
    for gone in (va.id, vb.id):
        with pytest.raises(VideoNotFound):
            store.get(gone)
    assert blobs(store) == [f"{vc.sha256}.video"]         # expired files deleted


def test_a_leased_file_outlives_its_delete(tmp_path):
    store = VideoStore(tmp_path / "videos", max_bytes=10**6, max_count=10, ttl_s=None)
    data = os.urandom(500)
    v1, v2 = add(store, tmp_path, data), add(store, tmp_path, data)
    assert v1.expires_at is None                          # ttl 0/None: never expires
    lease = store.acquire(v1.id)
    assert Path(lease.path).read_bytes() == data
    store.delete(v1.id)
    store.delete(v2.id)
    with pytest.raises(VideoNotFound):                    # the id is gone at once ...
        store.acquire(v1.id)
    assert Path(lease.path).exists()                      # ... its file when the lease ends
    lease.release()
    lease.release()                                       # idempotent
    assert not Path(lease.path).exists() and blobs(store) == []
    v3, v4 = add(store, tmp_path, data), add(store, tmp_path, data)
    store.delete(v3.id)                                   # another id still holds the bytes
    assert Path(store.acquire(v4.id).path).read_bytes() == data


def test_store_survives_a_restart(tmp_path):
    clock = Clock()
    folder = tmp_path / "videos"
    store = VideoStore(folder, max_bytes=10**6, max_count=10, ttl_s=50, clock=clock)
    keep = add(store, tmp_path, b"x" * 100, "keep.mp4")
    clock.t += 30
    late = add(store, tmp_path, b"y" * 100, "late.mp4")
    (folder / "stray.video").write_bytes(b"left by a killed upload")
    clock.t += 30                                         # keep expired, late not
    again = VideoStore(folder, max_bytes=10**6, max_count=10, ttl_s=50, clock=clock)
    assert [v.id for v in again.list()] == [late.id]
    assert again.get(late.id).filename == "late.mp4"
    with pytest.raises(VideoNotFound):
        again.get(keep.id)
    assert blobs(again) == [f"{late.sha256}.video"]


def test_serve_flags_reach_the_settings():
    from mminfer.cli import build_parser
    from mminfer.serve.cli import settings_from
    argv = ["serve", "--kv-cache-gb", "12.5", "--kv-host-cache-gb", "64", "--no-video-cache",
            "--video-store-gb", "3", "--video-store-max", "7", "--video-ttl-s", "60"]
    s = settings_from(build_parser(argv).parse_args(argv))
    assert (s.kv_cache_gb, s.kv_host_cache_gb, s.video_cache) == (12.5, 64.0, False)
    assert (s.video_store_gb, s.video_store_max, s.video_ttl_s) == (3.0, 7, 60.0)
    d = settings_from(build_parser(["serve"]).parse_args(["serve"]))
    assert (d.kv_cache_gb, d.kv_host_cache_gb, d.video_cache) == (None, 0.0, True)
    help_ = build_parser(["serve"])._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--kv-cache-gb", "--kv-host-cache-gb", "--no-video-cache", "--video-store-gb",
                 "--video-store-max", "--video-ttl-s"):
        assert flag in help_


def test_video_urls():
    assert video_id_of("mminfer://videos/video-abc") == "video-abc"
    assert video_id_of("data:video/mp4;base64,AAAA") is None
    with pytest.raises(Exception, match="mminfer://videos/"):
        video_id_of("mminfer://videos/a/b")


# ----------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vid") / "tiny-qwen")


def app_with(ckpt, data_dir, **kw):
    return create_app(Settings(model=str(ckpt), device="cpu", data_dir=str(data_dir),
                               timeout_s=120, api_key=kw.pop("api_key", None), **kw))


def upload(url, raw: bytes, name="clip.mp4", headers=None):
    return httpx.post(f"{url}/v1/videos", files={"file": (name, raw, "video/mp4")},
                      headers=headers, timeout=60)


def ask(url, question="What number appears in the video?", headers=None, files=None, **form):
    files = files or {"dummy": ("x.bin", b"", "application/octet-stream")}
    return httpx.post(f"{url}/v1/answer", data={"question": question, "max_frames": "8",
                                                "max_new_tokens": "3", **form},
                      files=files, headers=headers, timeout=120)


def chat(url, video_url, text="What number appears in the video?", headers=None):
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_url}}, {"type": "text", "text": text}]}],
        "max_tokens": 3, "max_frames": 8}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_videos_life_cycle(ckpt, tmp_path, live_server):
    srv = live_server(app_with(ckpt, tmp_path))
    raw = NEEDLE.read_bytes()
    r = upload(srv.url, raw, "needle.mp4")
    assert r.status_code == 200, r.text
    v = r.json()
    assert set(v) == {"id", "object", "bytes", "created_at", "expires_at", "filename",
                      "sha256"}
    assert v["object"] == "video" and v["bytes"] == len(raw) and v["filename"] == "needle.mp4"
    assert v["expires_at"] == v["created_at"] + 86400 and v["id"].startswith("video-")
    listed = httpx.get(f"{srv.url}/v1/videos").json()
    assert listed["object"] == "list" and [x["id"] for x in listed["data"]] == [v["id"]]
    assert httpx.get(f"{srv.url}/v1/videos/{v['id']}").json() == v

    first = ask(srv.url, video_id=v["id"])
    assert first.status_code == 200, first.text
    second = ask(srv.url, "Which number is shown?", video_id=v["id"])
    assert second.status_code == 200, second.text
    d1, d2 = first.json(), second.json()
    assert (d1["cache"], d2["cache"]) == ("miss", "hit")
    assert d1["video"]["id"] == v["id"] and d1["video"]["filename"] == "needle.mp4"
    assert d1["video"]["sha256"] == v["sha256"]
    assert d2["tokens"]["cached"] > 0 and d1["tokens"]["cached"] == 0
    # a hit skips decode, vision and the prefix's prefill, and reports no decoding
    assert d2["timings_ms"]["vision"] == 0 and d1["timings_ms"]["vision"] > 0
    assert "restore" in d2["timings_ms"]
    assert d1["video"]["decode_wait_ms"] > 0 and d2["timings_ms"]["decode"] == 0
    assert d2["video"]["decode_wait_ms"] == d2["video"]["decode_hidden_ms"] == 0
    c = chat(srv.url, f"mminfer://videos/{v['id']}")
    assert c.status_code == 200, c.text
    ext = c.json()["mminfer"]
    assert ext["cache"] == "hit"
    # asked by id, a chat answer names the stored video as /v1/answer does
    assert (ext["video"]["filename"], ext["video"]["id"]) == ("needle.mp4", v["id"])

    both = ask(srv.url, video_id=v["id"], files={"video": ("a.mp4", raw, "video/mp4")})
    assert both.status_code == 400 and "both" in both.json()["error"]["message"]
    gone = httpx.delete(f"{srv.url}/v1/videos/{v['id']}")
    assert gone.json() == {"id": v["id"], "object": "video", "deleted": True}
    for r in (httpx.get(f"{srv.url}/v1/videos/{v['id']}"),
              httpx.delete(f"{srv.url}/v1/videos/{v['id']}"),
              ask(srv.url, video_id=v["id"]), chat(srv.url, f"mminfer://videos/{v['id']}")):
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "video_not_found"
    assert httpx.get(f"{srv.url}/v1/videos").json()["data"] == []
    # the answered requests gave their leases back: the file went with the id
    assert os.listdir(tmp_path / "videos") == [INDEX]
    # what an upload of a video must pass, a stored video passes too
    empty = upload(srv.url, b"")
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "bad_video"
    png = upload(srv.url, b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "x.png")
    assert png.status_code == 415
    broken = upload(srv.url, b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 500)   # the probe
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "bad_video"
    assert broken.json()["error"]["reason"] == "invalid"
    assert "/" not in broken.json()["error"]["message"]                     # no server path
    nofile = httpx.post(f"{srv.url}/v1/videos", files={"video": ("a.mp4", raw, "video/mp4")})
    assert nofile.status_code == 422 and nofile.json()["error"]["field"] == "file"
    assert httpx.get(f"{srv.url}/v1/videos").json()["data"] == []
    assert os.listdir(srv.app.state.upload_dir) == []


def test_upload_and_data_url_of_the_same_bytes_share_an_entry(ckpt, tmp_path, live_server):
    srv = live_server(app_with(ckpt, tmp_path))
    clip = write_video(tmp_path / "fresh.mp4", n_frames=12, fps=4.0, width=64, height=48)
    raw = Path(clip).read_bytes()
    up = ask(srv.url, files={"video": ("fresh.mp4", raw, "video/mp4")})
    assert up.status_code == 200, up.text
    assert up.json()["cache"] == "miss"
    url = f"data:video/mp4;base64,{base64.b64encode(raw).decode()}"
    c = chat(srv.url, url)
    assert c.status_code == 200, c.text
    ext = c.json()["mminfer"]
    assert ext["cache"] == "hit" and ext["video"]["sha256"] == up.json()["video"]["sha256"]
    stored = upload(srv.url, raw).json()
    assert stored["sha256"] == ext["video"]["sha256"]
    assert ask(srv.url, video_id=stored["id"]).json()["cache"] == "hit"


def test_store_budgets_expiry_and_auth_over_http(ckpt, tmp_path, live_server, monkeypatch):
    raw = NEEDLE.read_bytes()
    other = Path(write_video(tmp_path / "other.mp4", n_frames=8, fps=4.0)).read_bytes()
    srv = live_server(app_with(ckpt, tmp_path / "d", api_key="sesame", video_store_max=1,
                               video_ttl_s=2.0, video_store_gb=len(raw) * 1.5 / 2**30))
    key = {"Authorization": "Bearer sesame"}
    for r in (upload(srv.url, raw), httpx.get(f"{srv.url}/v1/videos"),
              httpx.get(f"{srv.url}/v1/videos/video-x"),
              httpx.delete(f"{srv.url}/v1/videos/video-x")):
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    big = upload(srv.url, raw + raw, headers=key)          # larger than the whole store
    assert big.status_code == 413, big.text
    a = upload(srv.url, raw, headers=key)
    assert a.status_code == 200, a.text
    full = upload(srv.url, other, headers=key)             # the count budget: 1
    assert full.status_code == 507 and full.json()["error"]["code"] == "video_store_full"
    # a expires after 2 s and the sweep (every 1 s here) deletes it unasked: polled, not a
    # fixed sleep, since on a busy machine the sweep's thread may run late
    folder = tmp_path / "d" / "videos"
    deadline = time.monotonic() + 60
    while json.loads((folder / INDEX).read_text()) != []:
        assert time.monotonic() < deadline, "the expired video was never swept"
        time.sleep(0.1)
    assert [f.name for f in folder.iterdir()] == [INDEX]
    r = httpx.get(f"{srv.url}/v1/videos/{a.json()['id']}", headers=key)
    assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
    b = upload(srv.url, other, headers=key)
    assert b.status_code == 200, b.text
    assert [v["id"] for v in httpx.get(f"{srv.url}/v1/videos", headers=key).json()["data"]] \
        == [b.json()["id"]]
