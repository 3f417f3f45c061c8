"""What one client or tenant can do to another (issue 42, items 1, 5, 6): against a real
uvicorn server running the guarded protocol with the tiny Qwen2.5-VL checkpoint.

* ``POST /v1/videos`` keeps the per-address upload share, as /v1/answer and chat do: one
  address holding 8 slow bodies leaves another answered (real slow sockets on loopback).
* Tenants (one per API key): another tenant's videos are 404 to list, get, ask about and
  delete; its cache entries are its own (a salt in the key) unless the operator shares them;
  per-tenant quotas on the store, upload places and queue places; its latency history is its
  own, the admin reads all.
* ``/login`` gives a browser a session cookie for ``/report``; ``/metrics`` takes the admin's
  key or a metrics token; API clients keep their JSON 401.
* The smaller list: 507 and no id on a full disk, undecodable uploads refused, the chat
  template's tokens counted, no Python internals in 422s, no model path in /v1/models, no
  redirect to the client's Host, clear errors for malformed ``mminfer:`` URLs.
Each test fails without its fix.
"""

import base64
import errno
import json
import os
import socket
import struct
import time
from pathlib import Path

import httpx
import pytest

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.errors import ConfigError
from mminfer.serve import media, tenants
from mminfer.serve.app import Settings, create_app
from mminfer.serve.videos import INDEX, VideoStore

from conftest import read_response, write_video
from test_fuzz import boxes
from test_robust import GuardedServer

SAMPLES = Path(__file__).resolve().parents[2] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"
QUESTION = "What number appears in the video?"
KEYS = """# key            tenant  rights and quotas
alice-key-0001     alice
bob-key-0002       bob     max_videos=1
root-key-0003      ops     admin
"""
ALICE = {"Authorization": "Bearer alice-key-0001"}
BOB = {"Authorization": "Bearer bob-key-0002"}
ADMIN = {"Authorization": "Bearer root-key-0003"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("ten") / "tiny-qwen",
                                max_position_embeddings=4096)


@pytest.fixture
def serve(ckpt, tmp_path):
    started = []

    def start(keys: str | None = None, **settings):
        settings.setdefault("api_key", None)
        settings.setdefault("api_keys", ())
        if keys is not None:
            (tmp_path / "keys").write_text(keys)
            settings["api_keys_file"] = str(tmp_path / "keys")
        s = GuardedServer(create_app(Settings(model=str(ckpt), device="cpu", timeout_s=120,
                                              data_dir=str(tmp_path / f"d{len(started)}"),
                                              **settings)))
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def upload(url, raw: bytes, headers=None, name="clip.mp4", transport=None):
    with httpx.Client(transport=transport, timeout=60) as c:
        return c.post(f"{url}/v1/videos", files={"file": (name, raw, "video/mp4")},
                      headers=headers)


def ask(url, headers=None, raw=None, **form):
    files = {"video": ("v.mp4", raw, "video/mp4")} if raw is not None else \
        {"dummy": ("x.bin", b"", "application/octet-stream")}
    return httpx.post(f"{url}/v1/answer", data={"question": QUESTION, "max_frames": "8",
                                                "max_new_tokens": "2", **form},
                      files=files, headers=headers, timeout=120)


def chat(url, video_url, headers=None, **extra):
    body = {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_url}},
        {"type": "text", "text": QUESTION}]}], "max_tokens": 2, "max_frames": 8, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def slow_upload(port, source: str, path="/v1/videos", headers=b"") -> socket.socket:
    """A multipart body that starts and then stalls, from ``source``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30,
                                    source_address=(source, 0))
    sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"multipart/form-data; boundary=BB\r\nContent-Length: 1000000\r\n" + headers +
                 b"\r\n--BB\r\nContent-Disposition: form-data; name=\"file\"; "
                 b"filename=\"v.mp4\"\r\nContent-Type: video/mp4\r\n\r\n\x00")
    return sock


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------- item 1: the upload share

def test_slow_uploads_to_videos_from_one_address_leave_others_answered(serve):
    """8 slow bodies to /v1/videos from 127.0.0.1: its share (4 of the 8 upload places) is
    held, the rest 429 with Retry-After before their body is read; 127.0.0.2 uploads.
    Before: the 8 held every place and the other client got 503 too_many_uploads."""
    s = serve(queue_size=8, upload_grace_s=60, min_upload_kbps=0)
    svc = s.app.state.service
    held = [slow_upload(s.port, "127.0.0.1") for _ in range(8)]
    wait_for(lambda: svc.intake.active >= 4)
    refused = []
    for sock in held[4:]:
        status, headers, body = read_response(sock, timeout=10)
        refused.append((status, body["error"]["code"], int(headers["retry-after"])))
    assert refused == [(429, "too_many_requests", 1)] * 4
    assert svc.intake.active == 4
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    r = upload(s.url, NEEDLE.read_bytes(), transport=other)
    assert r.status_code == 200, r.text
    for sock in held:
        sock.close()
    wait_for(lambda: svc.intake.active == 0 and not svc.clients.active)


def test_a_tenants_slow_uploads_leave_another_tenant_answered(serve):
    """One tenant's slow bodies from many addresses take at most its upload places (here 1);
    the other tenant, from an address of its own, is answered and uploads."""
    s = serve(KEYS, queue_size=4, upload_grace_s=60, min_upload_kbps=0)
    svc = s.app.state.service
    auth = b"Authorization: Bearer bob-key-0002\r\n"
    first = slow_upload(s.port, "127.0.0.3", headers=auth)
    wait_for(lambda: svc.intake.active == 1)
    assert svc.quota(svc.keys.lookup("bob-key-0002")).max_uploads == 2
    second = slow_upload(s.port, "127.0.0.4", "/v1/answer", headers=auth)
    wait_for(lambda: svc.intake.active == 2)
    third = slow_upload(s.port, "127.0.0.5", headers=auth)
    status, headers, body = read_response(third, timeout=10)
    assert status == 429 and body["error"]["code"] == "too_many_requests" and \
        "max_uploads" in body["error"]["message"] and int(headers["retry-after"]) >= 1
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=other, timeout=120) as c:
        r = c.post(f"{s.url}/v1/answer", headers=ALICE,
                   data={"question": QUESTION, "max_new_tokens": "2", "max_frames": "8"},
                   files={"video": ("v.mp4", NEEDLE.read_bytes(), "video/mp4")})
    assert r.status_code == 200, r.text
    assert upload(s.url, NEEDLE.read_bytes(), ALICE, transport=other).status_code == 200
    for sock in (first, second, third):
        sock.close()


# ---------------------------------------------------------------- item 5: tenants

def test_keys_file_and_env_entries():
    s = Settings(api_key="op-key", api_keys=(("carol", "carol-key"),),
                 api_keys_file=None, metrics_token=None)
    keys = tenants.load(s)
    assert keys.lookup("op-key") == tenants.Tenant("default", admin=True)
    assert keys.lookup("carol-key").name == "carol" and not keys.lookup("carol-key").admin
    assert keys.lookup("nope") is None and keys.lookup("") is None
    assert tenants.env_keys({"MMINFER_API_KEY_DAVE": "k1", "MMINFER_API_KEY": "k0",
                             "MMINFER_API_KEY_": "x"}) == (("dave", "k1"),)


@pytest.mark.parametrize("text, match", [
    ("k1 alice\nk1 bob\n", "twice"),
    ("k1 alice max_videos=1\nk2 alice\n", "different"),
    ("k1 alice speed=3\n", "unknown setting"),
    ("k1\n", "a line is"),
    ("k1 al/ice\n", "tenant name"),
    ('[{"key": "k1"}]', "string `key` and `tenant`"),
])
def test_a_bad_keys_file_is_refused_at_start(tmp_path, text, match):
    (tmp_path / "keys").write_text(text)
    with pytest.raises(ConfigError, match=match):
        tenants.load(Settings(api_key=None, api_keys=(), api_keys_file=str(tmp_path / "keys")))


def test_json_keys_file_and_default_quotas(tmp_path):
    (tmp_path / "keys.json").write_text(json.dumps({"keys": [
        {"key": "k1", "tenant": "a", "max_video_gb": 0.5},
        {"key": "k2", "tenant": "b"}, {"key": "k3", "tenant": "root", "admin": True}]}))
    s = Settings(api_key=None, api_keys=(), api_keys_file=str(tmp_path / "keys.json"),
                 video_store_max=300, video_store_gb=3.0, queue_size=8)
    keys = tenants.load(s)
    a, b = keys.lookup("k1"), keys.lookup("k2")
    assert keys.lookup("k3").admin and not a.admin
    qa, qb = keys.quota(a, s), keys.quota(b, s)
    # an equal share of the store among three tenants; half the places each
    assert (qb.max_videos, qb.max_video_bytes) == (100, 2**30)
    assert qa.max_video_bytes == 2**29 and (qa.max_uploads, qa.max_queue) == (4, 4)
    one = Settings(api_key="solo", api_keys=(), api_keys_file=None)
    solo = tenants.load(one)
    q = solo.quota(solo.lookup("solo"), one)     # one tenant: the server's own limits
    assert q == tenants.Quota(None, None, None, None)


def test_store_quota_per_tenant_counts_shared_bytes_for_each(tmp_path):
    store = VideoStore(tmp_path / "videos", max_bytes=10_000, max_count=10, ttl_s=None)
    data = os.urandom(1000)

    def put(tenant, raw, **quota):
        p = tmp_path / f"in-{time.monotonic_ns()}"
        p.write_bytes(raw)
        from mminfer.serve.videos import sha256_of
        return store.add(str(p), "v.mp4", sha256_of(p), tenant, **quota)

    va = put("a", data, max_bytes=1500)
    put("b", data, max_bytes=1500)
    assert len([f for f in os.listdir(store.folder) if f != INDEX]) == 1   # on disk once
    assert store.usage("a") == (1, 1000) and store.usage("b") == (1, 1000)
    put("a", data, max_bytes=1500)               # the same bytes again: charged once
    with pytest.raises(Exception, match="your stored videos take 1000 of your 1500"):
        put("a", os.urandom(1000), max_bytes=1500)
    with pytest.raises(Exception, match="2 stored videos"):
        put("a", os.urandom(10), max_videos=2)
    assert [v.id for v in store.list("b")] != [] and va.id not in {v.id for v in store.list("b")}
    with pytest.raises(Exception, match="no video"):
        store.get(va.id, "b")
    with pytest.raises(Exception, match="no video"):
        store.delete(va.id, "b")
    assert store.get(va.id, "a") == va


def test_tenants_see_only_their_own_videos_cache_and_history(serve):
    s = serve(KEYS)
    raw = NEEDLE.read_bytes()
    a = upload(s.url, raw, ALICE)
    assert a.status_code == 200, a.text
    vid = a.json()["id"]
    # bob: alice's video does not exist for him
    assert httpx.get(f"{s.url}/v1/videos", headers=BOB).json()["data"] == []
    for r in (httpx.get(f"{s.url}/v1/videos/{vid}", headers=BOB),
              httpx.delete(f"{s.url}/v1/videos/{vid}", headers=BOB),
              ask(s.url, BOB, video_id=vid), chat(s.url, f"mminfer://videos/{vid}", BOB)):
        assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found", r.text
    assert [v["id"] for v in httpx.get(f"{s.url}/v1/videos", headers=ALICE).json()["data"]] \
        == [vid]
    # the cache: alice's second question is a hit; bob's about the same bytes is not (his
    # "hit" would tell him alice asked); a request's own cache_salt is a key of its own
    assert ask(s.url, ALICE, video_id=vid).json()["cache"] == "miss"
    assert ask(s.url, ALICE, video_id=vid).json()["cache"] == "hit"
    assert ask(s.url, BOB, raw=raw).json()["cache"] == "miss"
    assert ask(s.url, BOB, raw=raw).json()["cache"] == "hit"
    assert ask(s.url, ALICE, video_id=vid, cache_salt="s1").json()["cache"] == "miss"
    salted = chat(s.url, f"mminfer://videos/{vid}", ALICE, cache_salt="s1")
    assert salted.json()["mminfer"]["cache"] == "hit", salted.text
    bad = chat(s.url, f"mminfer://videos/{vid}", ALICE, cache_salt="")
    assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
    # bob's quota: one video; alice's uploads go on
    other = Path(write_video(s.app.state.upload_dir.parent / "o.mp4", n_frames=8)).read_bytes()
    assert upload(s.url, raw, BOB).status_code == 200
    full = upload(s.url, other, BOB)
    assert full.status_code == 507 and full.json()["error"]["code"] == "video_quota_exceeded"
    assert upload(s.url, other, ALICE).status_code == 200
    # history: each tenant its own, the admin everyone's
    rep = lambda h, q="": httpx.get(f"{s.url}/v1/latency-report{q}", headers=h).json()  # noqa
    ra, rb, rall = rep(ALICE), rep(BOB), rep(ADMIN)
    assert (ra["succeeded"], rb["succeeded"]) == (4, 2) and rall["succeeded"] == 6
    assert ra["tenant"] == "alice" and rall["tenant"] is None and ra["shadow"] is None
    assert rep(ADMIN, "?tenant=bob")["succeeded"] == 2
    assert httpx.get(f"{s.url}/v1/latency-report?tenant=bob", headers=ALICE).status_code \
        == 403
    assert httpx.get(f"{s.url}/v1/latency-report").status_code == 401


def test_sharing_the_cache_across_tenants_is_the_operators_choice(serve):
    s = serve(KEYS, share_cache_across_tenants=True)
    raw = NEEDLE.read_bytes()
    assert ask(s.url, ALICE, raw=raw).json()["cache"] == "miss"
    assert ask(s.url, BOB, raw=raw).json()["cache"] == "hit"
    assert ask(s.url, BOB, raw=raw, cache_salt="mine").json()["cache"] == "miss"


def test_a_tenants_queue_places(serve):
    """max_queue: a tenant's requests at once (waiting, uploading or running); past it 429
    and the other tenants are not touched."""
    s = serve(KEYS, queue_size=8, upload_grace_s=60, min_upload_kbps=0, tenant_max_queue=1,
              max_uploads_per_client=0)
    auth = b"Authorization: Bearer bob-key-0002\r\n"
    held = slow_upload(s.port, "127.0.0.3", "/v1/answer", headers=auth)
    svc = s.app.state.service
    wait_for(lambda: svc.tenant_requests.active.get("bob") == 1)
    r = ask(s.url, BOB, raw=NEEDLE.read_bytes())
    assert r.status_code == 429 and "max_queue" in r.json()["error"]["message"]
    assert ask(s.url, ALICE, raw=NEEDLE.read_bytes()).status_code == 200
    held.close()
    wait_for(lambda: "bob" not in svc.tenant_requests.active)
    assert ask(s.url, BOB, raw=NEEDLE.read_bytes()).status_code == 200


# ---------------------------------------------------------------- the report and metrics

def test_login_gives_a_browser_the_report_and_metrics_take_a_token(serve):
    s = serve(KEYS, metrics_token="scrape-me")
    html = {"Accept": "text/html,application/xhtml+xml"}
    with httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.get("/report?since=0", headers=html)
        assert r.status_code == 303 and r.headers["location"] == "/login?next=%2Freport%3Fsince%3D0"
        api = c.get("/report")                       # an API client: JSON 401, as before
        assert api.status_code == 401 and api.json()["error"]["code"] == "unauthorized"
        assert c.get("/login").status_code == 200 and 'name="key"' in c.get("/login").text
        wrong = c.post("/login", data={"key": "nope", "next": "/report"}, headers=html)
        assert wrong.status_code == 401 and "not one of" in wrong.text and not c.cookies
        ok = c.post("/login", data={"key": "alice-key-0001", "next": "/report?since=0"})
        assert ok.status_code == 303 and ok.headers["location"] == "/report?since=0"
        cookie = ok.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=lax" in cookie and "path=/" in cookie
        page = c.get("/report?since=0", headers=html)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert c.get("/v1/latency-report").json()["tenant"] == "alice"
        # the cookie is for reading pages: a request that spends or changes anything needs
        # the key
        assert c.get("/v1/videos").status_code == 401
        assert ask(s.url, raw=NEEDLE.read_bytes(),
                   headers={"Cookie": f"mminfer_session={c.cookies['mminfer_session']}"}
                   ).status_code == 401
        assert c.get("/metrics").status_code == 403       # a tenant's session: not the server's
        assert c.post("/logout").status_code == 303
        assert c.get("/v1/latency-report").status_code == 401
        # somewhere else after signing in: never another host
        away = c.post("/login", data={"key": "alice-key-0001", "next": "//evil.example/x"})
        assert away.headers["location"] == "/report"
    # /metrics: the admin's key or the metrics token; a tenant's key 403, none 401
    assert httpx.get(f"{s.url}/metrics").status_code == 401
    assert httpx.get(f"{s.url}/metrics", headers=ALICE).status_code == 403
    for h in (ADMIN, {"Authorization": "Bearer scrape-me"}):
        m = httpx.get(f"{s.url}/metrics", headers=h)
        assert m.status_code == 200 and "mminfer:" in m.text
    # the metrics token is no API key
    assert httpx.get(f"{s.url}/v1/videos", headers={"Authorization": "Bearer scrape-me"}
                     ).status_code == 401


def test_single_key_keeps_working_as_one_tenant(serve):
    s = serve(api_key="only-key")
    h = {"Authorization": "Bearer only-key"}
    assert upload(s.url, NEEDLE.read_bytes(), h).status_code == 200
    assert len(httpx.get(f"{s.url}/v1/videos", headers=h).json()["data"]) == 1
    assert httpx.get(f"{s.url}/metrics", headers=h).status_code == 200
    assert httpx.get(f"{s.url}/v1/videos").status_code == 401
    open_server = serve()                        # no key at all: everything open
    assert httpx.get(f"{open_server.url}/metrics").status_code == 200
    assert httpx.get(f"{open_server.url}/report").status_code == 200


# ---------------------------------------------------------------- item 6: the smaller list

def test_a_full_disk_on_videos_is_507_and_leaves_no_id(serve, monkeypatch):
    """The index write fails with ENOSPC: 507 (no exception text), no id listed, no file
    left, index.json as it was, /health storage_full. Before: a 500 and an id in memory
    that was not in index.json (gone after a restart)."""
    s = serve()
    store = s.app.state.service.videos
    index_before = (store.folder / INDEX).read_text()

    def no_space(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(VideoStore, "_save", no_space)
    r = upload(s.url, NEEDLE.read_bytes())
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_storage" and "Errno" not in err["message"]
    assert httpx.get(f"{s.url}/v1/videos").json()["data"] == []
    assert sorted(os.listdir(store.folder)) == [INDEX]
    assert (store.folder / INDEX).read_text() == index_before
    assert httpx.get(f"{s.url}/health").json()["status"] == "storage_full"
    monkeypatch.undo()
    # the body itself written where every write fails (/dev/full): 507 too, no temp file
    real_new_temp = media.new_temp

    def full_temp(folder):
        path = real_new_temp(folder)
        os.unlink(path)
        os.symlink("/dev/full", path)
        return path

    monkeypatch.setattr(media, "new_temp", full_temp)
    r = upload(s.url, NEEDLE.read_bytes())
    assert r.status_code == 507 and "Errno" not in r.text, r.text
    monkeypatch.undo()
    ok = upload(s.url, NEEDLE.read_bytes())
    assert ok.status_code == 200
    assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
    assert json.loads((store.folder / INDEX).read_text())[0]["id"] == ok.json()["id"]
    assert os.listdir(s.app.state.upload_dir) == []


def stco_zero() -> bytes:
    """The sample with its chunk offsets set to 0: its header reads well, no frame decodes."""
    b = bytearray(NEEDLE.read_bytes())
    at = dict((k, i) for k, i in reversed(boxes(bytes(b))))[b"stco"]
    n = struct.unpack(">I", b[at + 12:at + 16])[0]
    b[at + 16:at + 16 + 4 * n] = bytes(4 * n)
    return bytes(b)


def hdlr_zero() -> bytes:
    """A track whose handler box is broken: PyAV finds a stream with no codec context
    (once "AttributeError: 'NoneType' object has no attribute 'width'" in a 422)."""
    b = bytearray(NEEDLE.read_bytes())
    where = dict((k, i) for k, i in reversed(boxes(bytes(b))))
    b[where[b"tkhd"] + 88:where[b"tkhd"] + 92] = (65535).to_bytes(4, "big")
    b[where[b"hdlr"]:where[b"hdlr"] + 4] = bytes(4)
    return bytes(b)


def test_undecodable_uploads_are_refused_with_a_real_message(serve):
    s = serve()
    r = upload(s.url, stco_zero())
    assert r.status_code in (400, 422) and r.json()["error"]["code"] == "bad_video", r.text
    assert "decod" in r.json()["error"]["message"] and "/" not in r.json()["error"]["message"]
    assert httpx.get(f"{s.url}/v1/videos").json()["data"] == []
    for send in (lambda: upload(s.url, hdlr_zero()), lambda: ask(s.url, raw=hdlr_zero())):
        r = send()
        assert r.status_code in (400, 422), r.text
        msg = r.json()["error"]["message"]
        assert "Error" not in msg and "NoneType" not in msg and "codec" in msg, msg


def test_question_tokens_count_the_template_and_empty_turns(serve):
    """3,300 empty turns are ~10K template tokens: over the 2048-token limit. Before: the
    empty turns counted nothing and the prompt was accepted."""
    s = serve()
    video = "data:video/mp4;base64," + base64.b64encode(NEEDLE.read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "video_url",
                                              "video_url": {"url": video}}]}]
    messages += [{"role": "user", "content": ""}] * 3300
    messages += [{"role": "user", "content": QUESTION}]
    r = httpx.post(f"{s.url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "over_limit" and "chat template" in err["message"]
    assert err["tokens_counted"] > 3300 * 3 and err["limit"] == 2048
    # the template's own tokens count for one question too: a limit under them refuses it
    s.app.state.service.s.max_question_tokens = 12
    r = ask(s.url, raw=NEEDLE.read_bytes())
    assert r.status_code == 413 and r.json()["error"]["tokens_counted"] > 12


def test_models_redirects_and_mminfer_urls(serve, ckpt):
    s = serve()
    models = httpx.get(f"{s.url}/v1/models")
    assert models.status_code == 200 and str(ckpt) not in models.text \
        and str(ckpt.parent) not in models.text
    vid = upload(s.url, NEEDLE.read_bytes()).json()["id"]
    r = httpx.get(f"{s.url}/v1/videos/{vid}/", headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    for url in ("mminfer:foo", "mminfer://videos/", "mminfer://other/x", "MMINFER://videos",
                f"mminfer://videos/{vid}?x=1"):
        r = chat(s.url, url)
        assert r.status_code == 400, (url, r.text)
        msg = r.json()["error"]["message"]
        assert "mminfer://videos/{id}" in msg and "None" not in msg, msg
