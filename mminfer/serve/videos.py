"""Upload a video once, ask about it many times: ``/v1/videos``, shaped like OpenAI's Files.

    POST   /v1/videos          multipart ``file`` -> {"id": "video-...", "object": "video",
                               "bytes", "created_at", "expires_at", "filename", "sha256"}
    GET    /v1/videos          {"object": "list", "data": [...]} (newest first)
    GET    /v1/videos/{id}     the object; 404 when unknown or expired
    DELETE /v1/videos/{id}     {"id", "object": "video", "deleted": true}

``/v1/answer`` then takes the form field ``video_id`` instead of a ``video`` file, and chat a
``video_url`` of ``mminfer://videos/{id}``. The engine's video cache is keyed by the video's
content hash, so a question about an id, an upload and a data: URL of the same bytes share one
cached prefix.

Storage (``VideoStore``, under ``--data-dir``/videos): each distinct content is one file
named by its sha256 (two uploads of the same bytes are two ids over one file); the ids are in
``index.json``, rewritten atomically on every change, so the store survives a restart. The
budgets are the bytes of the distinct files (``--video-store-gb``) and the number of ids
(``--video-store-max``); an upload over them gets 507 (a single video larger than the whole
store: 413) after expired ids have been deleted to make room. Ids expire ``--video-ttl-s``
after their upload: an expired id is deleted when it is next looked up and by the periodic
sweep. A request answering about an id holds a lease on its file, so deleting or expiring the
id while the request runs or waits removes the id at once and the file when the last lease
ends.

Every id belongs to a tenant (serve/tenants.py): another tenant's id is not found, as an
unknown one. A tenant's quota is charged the size of each distinct content among its ids, so
the same bytes stored by two tenants are one file on disk and count for each. An upload takes
the upload places and per-address share an /v1/answer body does (no queue place: storing runs
no model), is probed and has its first and last frames decoded before it is stored, and a
failed write (a full disk: 507) leaves neither an id nor a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.requests import ClientDisconnect

from mminfer import video as videolib
from mminfer.engine.cache import file_digest
from mminfer.errors import InputError, MMInferError, MissingField, TooLarge

from . import guard, media
from .errors import describe, error_body, json_response
from .tenants import DEFAULT as DEFAULT_TENANT

log = logging.getLogger("mminfer.serve")

router = APIRouter()

SCHEME = "mminfer://videos/"     # a chat video_url naming a stored video
ID_PREFIX = "video-"
INDEX = "index.json"
BLOB_SUFFIX = ".video"


class VideoNotFound(MMInferError):
    code = "video_not_found"
    http_status = 404


class StoreFull(MMInferError):
    """The video store's byte or count budget is spent (HTTP 507 Insufficient Storage)."""
    code = "video_store_full"
    http_status = 507


class QuotaFull(StoreFull):
    """The tenant's share of the video store is spent (its own videos; others' are not
    counted)."""
    code = "video_quota_exceeded"


@dataclass
class StoredVideo:
    id: str
    bytes: int
    created_at: int                  # unix seconds
    expires_at: int | None           # unix seconds; None: never
    filename: str | None
    sha256: str
    tenant: str = DEFAULT_TENANT     # whose it is (ids of an index from before tenants: the
                                     # default tenant's)

    def public(self) -> dict:
        return {"id": self.id, "object": "video", **{k: v for k, v in asdict(self).items()
                                                     if k not in ("id", "tenant")}}


def sha256_of(path) -> str:
    """The content hash the engine keys its video cache by (and memoises by the file's
    identity, so hashing the stored file here spares the first question the work)."""
    return file_digest(path)


class FileLease:
    """A stored video's file, kept on disk until ``release`` (idempotent)."""

    def __init__(self, store: "VideoStore", video: StoredVideo):
        self.store, self.video = store, video
        self.path = str(store.blob_path(video.sha256))
        self._held = True

    def release(self):
        if self._held:
            self._held = False
            self.store._unpin(self.video.sha256)


class VideoStore:
    """The stored videos; every method is thread-safe (the event loop lists and looks up,
    threads add)."""

    def __init__(self, folder, *, max_bytes: int, max_count: int, ttl_s: float | None,
                 clock=time.time):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_count = int(max_bytes), int(max_count)
        self.ttl_s = ttl_s if ttl_s and ttl_s > 0 else None
        self.clock = clock
        self._lock = threading.RLock()
        self._videos: dict[str, StoredVideo] = {}
        self._pins: dict[str, int] = {}          # sha256 -> leases held
        self._load()

    # ------------------------------------------------------------ disk
    def blob_path(self, sha: str) -> Path:
        return self.folder / f"{sha}{BLOB_SUFFIX}"

    def _load(self):
        path = self.folder / INDEX
        try:
            rows = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        except (OSError, ValueError) as e:
            log.error("the video store index %s is unreadable (%s): starting empty", path, e)
            rows = []
        for row in rows if isinstance(rows, list) else []:
            try:
                v = StoredVideo(**row)
            except TypeError:
                continue
            if self.blob_path(v.sha256).is_file():
                self._videos[v.id] = v
        keep = {f"{v.sha256}{BLOB_SUFFIX}" for v in self._videos.values()}
        for f in self.folder.iterdir():          # files of ids that are gone, temp files
            if f.name != INDEX and f.name not in keep:
                media.remove(str(f))
        self.sweep()
        self._save()

    def _save(self):
        """Write the index (atomically: a failed write, ENOSPC included, leaves the old one
        and raises)."""
        tmp = self.folder / (INDEX + ".tmp")
        try:
            tmp.write_text(json.dumps([asdict(v) for v in self._videos.values()]),
                           encoding="utf-8")
            os.replace(tmp, self.folder / INDEX)
        except BaseException:
            media.remove(str(tmp))
            raise

    def _drop_blob_if_unused(self, sha: str):
        if self._pins.get(sha, 0) == 0 and not any(v.sha256 == sha
                                                   for v in self._videos.values()):
            media.remove(str(self.blob_path(sha)))

    # ------------------------------------------------------------ budget
    def used_bytes(self) -> int:
        """Bytes of the distinct files on disk (those of deleted ids still leased count)."""
        with self._lock:
            shas = {v.sha256 for v in self._videos.values()} | set(self._pins)
            return sum(self.blob_path(s).stat().st_size for s in shas
                       if self.blob_path(s).exists())

    def stats(self) -> dict:
        with self._lock:
            return {"videos": len(self._videos), "bytes": self.used_bytes(),
                    "max_bytes": self.max_bytes, "max_videos": self.max_count}

    def usage(self, tenant: str) -> tuple[int, int]:
        """(ids, bytes) a tenant is charged: its ids, and the size of each distinct content
        among them (the same bytes stored by two tenants count for each)."""
        with self._lock:
            mine = [v for v in self._videos.values() if v.tenant == tenant]
            return len(mine), sum({v.sha256: v.bytes for v in mine}.values())

    def sweep(self) -> int:
        """Delete the expired ids; returns how many."""
        now = self.clock()
        with self._lock:
            gone = [v for v in self._videos.values()
                    if v.expires_at is not None and v.expires_at <= now]
            for v in gone:
                del self._videos[v.id]
            for sha in {v.sha256 for v in gone}:
                self._drop_blob_if_unused(sha)
            if gone:
                self._save()
        return len(gone)

    # ------------------------------------------------------------ ids
    def add(self, temp_path: str, filename: str | None, sha: str, tenant: str = DEFAULT_TENANT,
            max_videos: int | None = None, max_bytes: int | None = None) -> StoredVideo:
        """Store the file at ``temp_path`` (taken: moved in, or deleted when the same bytes
        are already stored) under a new id of ``tenant``; TooLarge (413) or StoreFull (507)
        when it does not fit the store's budget, or the tenant's quota (``max_videos`` ids,
        ``max_bytes``), once expired ids are gone. A failed write (a full disk) leaves
        neither an id nor a file behind."""
        try:
            size = os.path.getsize(temp_path)
            if size > self.max_bytes:
                raise TooLarge(f"the video ({size} bytes) is larger than this server's whole "
                               f"video store ({self.max_bytes} bytes, --video-store-gb)",
                               limit_bytes=self.max_bytes)
            if max_bytes is not None and size > max_bytes:
                raise TooLarge(f"the video ({size} bytes) is larger than your share of this "
                               f"server's video store ({max_bytes} bytes)",
                               limit_bytes=max_bytes)
            with self._lock:
                self.sweep()
                self._check_quota(tenant, sha, size, max_videos, max_bytes)
                if len(self._videos) >= self.max_count:
                    raise StoreFull(f"the video store holds {len(self._videos)} videos, this "
                                    f"server's limit (--video-store-max); delete some "
                                    f"(DELETE /v1/videos/{{id}}) or wait for them to expire",
                                    limit=self.max_count)
                blob = self.blob_path(sha)
                if not blob.exists():
                    used = self.used_bytes()
                    if used + size > self.max_bytes:
                        raise StoreFull(f"the video store is full: {used} of {self.max_bytes} "
                                        f"bytes used, the video is {size} (--video-store-gb); "
                                        f"delete some (DELETE /v1/videos/{{id}}) or wait for "
                                        f"them to expire", limit_bytes=self.max_bytes,
                                        used_bytes=used)
                    os.replace(temp_path, blob)
                now = self.clock()
                v = StoredVideo(id=ID_PREFIX + secrets.token_hex(12), bytes=size,
                                created_at=int(now),
                                expires_at=int(now + self.ttl_s) if self.ttl_s else None,
                                filename=filename, sha256=sha, tenant=tenant)
                self._videos[v.id] = v
                try:
                    self._save()
                except BaseException:       # not in the index: no id, and no file for it
                    del self._videos[v.id]
                    self._drop_blob_if_unused(sha)
                    raise
            return v
        finally:
            media.remove(temp_path)         # gone already when it was moved in

    def _check_quota(self, tenant, sha, size, max_videos, max_bytes):
        n, used = self.usage(tenant)
        if max_videos is not None and n >= max_videos:
            raise QuotaFull(f"you have {n} stored videos, your limit on this server; delete "
                            f"some (DELETE /v1/videos/{{id}}) or wait for them to expire",
                            limit=max_videos)
        mine = any(v.sha256 == sha and v.tenant == tenant for v in self._videos.values())
        if max_bytes is not None and not mine and used + size > max_bytes:
            raise QuotaFull(f"your stored videos take {used} of your {max_bytes} bytes on "
                            f"this server and this one is {size}; delete some (DELETE "
                            f"/v1/videos/{{id}}) or wait for them to expire",
                            limit_bytes=max_bytes, used_bytes=used)

    def get(self, vid: str, tenant: str | None = None) -> StoredVideo:
        """The id's video; ``tenant``'s alone (another tenant's id is not found, as an
        unknown one), None: anyone's."""
        with self._lock:
            v = self._videos.get(vid)
            if v is not None and v.expires_at is not None and v.expires_at <= self.clock():
                self.sweep()
                v = None
            if v is not None and tenant is not None and v.tenant != tenant:
                v = None
        if v is None:
            raise VideoNotFound(f"no video {vid!r} on this server (unknown, deleted or "
                                f"expired); upload it again with POST /v1/videos", id=vid)
        return v

    def list(self, tenant: str | None = None) -> list[StoredVideo]:
        """``tenant``'s videos (None: everyone's), newest first."""
        self.sweep()
        with self._lock:
            return sorted((v for v in self._videos.values()
                           if tenant is None or v.tenant == tenant),
                          key=lambda v: (-v.created_at, v.id))

    def delete(self, vid: str, tenant: str | None = None) -> StoredVideo:
        with self._lock:
            v = self.get(vid, tenant)
            del self._videos[vid]
            try:
                self._save()
            except BaseException:
                self._videos[vid] = v
                raise
            self._drop_blob_if_unused(v.sha256)
        return v

    def acquire(self, vid: str, tenant: str | None = None) -> FileLease:
        """The id's file, kept until the lease is released even if the id goes meanwhile."""
        with self._lock:
            v = self.get(vid, tenant)
            self._pins[v.sha256] = self._pins.get(v.sha256, 0) + 1
            return FileLease(self, v)

    def _unpin(self, sha: str):
        with self._lock:
            n = self._pins.get(sha, 0) - 1
            if n > 0:
                self._pins[sha] = n
            else:
                self._pins.pop(sha, None)
                self._drop_blob_if_unused(sha)


def video_id_of(url: str) -> str | None:
    """The id of a ``mminfer://videos/{id}`` URL, None for a URL of another scheme; any
    other ``mminfer:`` URL is a 400 saying what the URL must be."""
    if not url[:8].lower() == "mminfer:":
        return None
    vid = url[len(SCHEME):] if url.lower().startswith(SCHEME) else ""
    if not vid or "/" in vid or "?" in vid or "#" in vid:
        raise InputError(f"a stored video's URL is {SCHEME}{{id}} with the id POST "
                         f"/v1/videos gave (video-...), not {url[:80]!r}", field="video_url")
    return vid


async def sweeper(store: VideoStore, every_s: float):
    """The periodic sweep of expired ids (the app's lifespan runs it)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(store.sweep)
        except Exception:               # noqa: BLE001 - a full disk must not end the sweeps
            log.exception("sweeping the video store failed")


# ------------------------------------------------------------------ routes

UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file"],
    "properties": {"file": {"type": "string", "format": "binary",
                            "description": "the video file (mp4, webm, mkv, ...)"}}}}}}


@router.post("/v1/videos", openapi_extra={"requestBody": UPLOAD_BODY},
             summary="Store a video once; ask about it by id (video_id, mminfer://videos/{id})")
async def upload(request: Request):
    svc = request.app.state.service
    path, places, status, label = None, [], 200, "the uploaded video"
    try:
        tenant = svc.check_auth(request)
        # the places an /v1/answer body takes, but the queue's: storing runs no model.
        # Refused here, the 503/429 goes out before a byte of the body is read.
        places.append(svc.intake.begin())
        places.append(svc.clients.begin(guard.client_host(request)))
        places.append(svc.tenant_uploads.begin(tenant.name, svc.quota(tenant).max_uploads))
        up = await media.read_multipart(request, svc.intake.timed(request.stream()),
                                        svc.upload_dir, svc.s.max_upload_bytes,
                                        file_field="file")
        for place in places:
            place.end()
        path = up.video
        if up.filename:
            label = f"the uploaded video {up.filename!r}"
        if path is None:
            raise MissingField("the form has no `file` part (the video)", field="file")
        media.check_file(path, label)
        await asyncio.to_thread(svc.budget.check_video, path, "",
                                {"fps": svc.s.fps, "max_frames": svc.s.max_frames,
                                 "max_new_tokens": svc.s.max_new_tokens}, None)
        await asyncio.to_thread(check_decodable, path)
        sha = await asyncio.to_thread(sha256_of, path)
        quota = svc.quota(tenant)
        video = await asyncio.to_thread(svc.videos.add, path, up.filename, sha, tenant.name,
                                        quota.max_videos, quota.max_video_bytes)
        path = None
        svc.storage.ok()
        # the move gave the file a new identity: hash it under its stored one now, so the
        # first question about it does not
        try:
            await asyncio.to_thread(sha256_of, svc.videos.blob_path(sha))
        except OSError:                 # deleted meanwhile: nothing to spare
            pass
        body = video.public()
    except ClientDisconnect:
        svc.metrics.count(499, "client_disconnected")
        return json_response(499, error_body("client_disconnected", "the client disconnected",
                                             499))
    except MMInferError as e:
        status, code, body = describe(e, path, label)
        svc.metrics.count(status, code)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status in (503, 429):
            headers = {"Retry-After": "1"}
        return json_response(status, body, headers)
    except Exception as e:  # noqa: BLE001 - a bug, not bad input: the service lives on
        full = svc.storage.failed(e)
        if full is not None:            # a full disk is not a bug: 507, /health says so
            log.warning("storing a video: no space left under the data folder")
            status, code, body = describe(full)
        else:                           # the log has the exception, not the client
            log.exception("storing a video failed")
            status, code = 500, "internal"
            body = error_body("internal", f"internal error ({type(e).__name__}); the server "
                              f"log has the details", 500)
        svc.metrics.count(status, code)
        return json_response(status, body)
    finally:
        for place in places:
            place.end()
        media.remove(path)
    svc.metrics.count(status)
    return json_response(status, body)


def check_decodable(path: str):
    """Decode the first and the last frame, so a file whose header reads well but whose
    frames no question could decode (a chunk offset of 0, say) is refused at upload, not at
    every question; VideoError (in the decode sandbox: UndecodableVideo) when they fail."""
    videolib.decode(path, num_frames=2, size=(64, 64))


@router.get("/v1/videos", summary="Your stored videos, newest first")
async def list_videos(request: Request):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    videos = await asyncio.to_thread(svc.videos.list, tenant.name)
    return {"object": "list", "data": [v.public() for v in videos]}


@router.get("/v1/videos/{video_id}", summary="A stored video of yours")
async def get_video(request: Request, video_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    return svc.videos.get(video_id, tenant.name).public()


@router.delete("/v1/videos/{video_id}", summary="Delete a stored video of yours")
async def delete_video(request: Request, video_id: str):
    svc = request.app.state.service
    tenant = svc.check_auth(request)
    v = await asyncio.to_thread(svc.videos.delete, video_id, tenant.name)
    return {"id": v.id, "object": "video", "deleted": True}
