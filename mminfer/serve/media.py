"""Getting a video from a request onto disk, safely.

Uploads are parsed as they stream (python-multipart's push parser) straight into a temporary
file under the service's own upload folder, counting bytes, so an upload over the limit is
refused while it arrives, never after. Temporary names come from ``tempfile``; a filename the
client sends is kept only as a label and never touches a path. Whoever creates a temporary
file hands its path to exactly one owner that deletes it (see ``worker.Job.cleanup``).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import tempfile
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from mminfer.errors import InputError, MMInferError, VideoError

MAX_FIELD_BYTES = 64 * 1024      # a question, a number: never more than this
MAX_PARTS = 32
DRAIN_BYTES = 64 * 1024 * 1024   # read (and drop) at most this much after refusing an upload
TEMP_PREFIX = "upload-"

# Part content types accepted for a video; anything else is refused with 415 before decoding.
VIDEO_TYPES = ("application/octet-stream", "binary/octet-stream", "application/mp4",
               "application/x-matroska", "application/ogg", "application/vnd.rn-realmedia")


class UnsupportedMedia(MMInferError):
    code = "unsupported_media_type"
    http_status = 415


class TooLarge(MMInferError):
    code = "too_large"
    http_status = 413


class MissingField(MMInferError):
    code = "missing_field"
    http_status = 422


class Forbidden(MMInferError):
    code = "forbidden"
    http_status = 403


class RemoteRefused(InputError):
    code = "remote_media_refused"


def new_temp(folder) -> str:
    fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".video", dir=folder)
    os.close(fd)
    return path


def remove(path: str | None):
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# ------------------------------------------------------------------------ types

def check_video_type(ctype: str | None, what: str = "the video part"):
    """Refuse a declared content type that is not a video (415)."""
    base = (ctype or "").split(";")[0].strip().lower()
    if not base or base.startswith("video/") or base in VIDEO_TYPES:
        return
    kind = base.split("/")[0]
    hint = {"image": "an image", "audio": "audio", "text": "text"}.get(kind, base)
    raise UnsupportedMedia(f"{what} is declared as {base} ({hint}), not a video; send a video "
                           f"file (video/mp4, video/webm, ...)", content_type=base)


_NOT_VIDEO_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"),
    (b"II*\x00", "a TIFF image"), (b"MM\x00*", "a TIFF image"), (b"%PDF", "a PDF document"),
    (b"PK\x03\x04", "a ZIP archive"), (b"\x1f\x8b", "a gzip archive"), (b"ID3", "MP3 audio"),
    (b"fLaC", "FLAC audio"), (b"\x7fELF", "an executable"),
)


def sniff(head: bytes) -> str | None:
    """What the first bytes say a file is when that is clearly not a video, else None."""
    for magic, what in _NOT_VIDEO_MAGIC:
        if head.startswith(magic):
            return what
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "a WEBP image"
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV audio"
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":
        return "a BMP image"
    if head.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return "a text file"
    for cut in range(4):        # the 64-byte window may split a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c.isprintable() or c in "\r\n\t" for c in text):
            return "a text file"
        break
    return None


def check_file(path: str, label: str = "the uploaded video"):
    """Empty (400) or clearly not a video by its first bytes (415)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        raise VideoError(f"{label} is empty (0 bytes)")
    what = sniff(head)
    if what:
        raise UnsupportedMedia(f"{label} is {what}, not a video (judged by its first bytes)",
                               detected=what)


# ------------------------------------------------------------------- multipart

@dataclass
class Upload:
    fields: dict[str, bytes] = field(default_factory=dict)
    video: str | None = None             # temp file path (owned by the caller)
    video_type: str | None = None
    filename: str | None = None          # a label only
    size: int = 0


def _declared_length(request) -> int | None:
    v = request.headers.get("content-length")
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        raise InputError("Content-Length is not a number") from None
    if n < 0:
        raise InputError("Content-Length is negative")
    return n


async def drain(stream, cap: int = DRAIN_BYTES):
    """Read and drop what the client is still sending, so it reads our 4xx instead of a reset
    connection; a client sending more than ``cap`` gets the connection closed."""
    n = 0
    try:
        async for chunk in stream:
            n += len(chunk)
            if n > cap:
                break
    except Exception:               # noqa: BLE001 - client went away: nothing to drain
        pass


def _too_large(size_desc: str | None, max_bytes: int) -> TooLarge:
    size = f" ({size_desc})" if size_desc else ""
    return TooLarge(f"the video{size} is larger than this server's upload limit of "
                    f"{max_bytes / 2**20:g} MiB", limit_bytes=max_bytes)


async def read_multipart(request, folder, max_bytes: int) -> Upload:
    """Parse a multipart/form-data body: the ``video`` part goes to a temp file, other parts
    (at most 64 KiB each) to ``fields``. On any error the temp file is gone."""
    from python_multipart import MultipartParser
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import parse_options_header

    ctype, opts = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data":
        raise UnsupportedMedia(
            f"send multipart/form-data (a `video` file part and a `question` field), not "
            f"{ctype.decode('latin-1') or 'a body without Content-Type'}",
            content_type=ctype.decode("latin-1"))
    boundary = opts.get(b"boundary")
    if not boundary:
        raise InputError("the multipart Content-Type has no boundary")
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes + MAX_PARTS * MAX_FIELD_BYTES:
        raise _too_large(f"{declared} bytes declared", max_bytes)

    up = Upload()
    st = {"headers": {}, "field": b"", "value": b"", "name": None, "file": None, "buf": None,
          "parts": 0, "ended": False}

    def on_part_begin():
        st["parts"] += 1
        if st["parts"] > MAX_PARTS:
            raise InputError(f"too many parts in the form (at most {MAX_PARTS})")
        st["headers"], st["name"], st["file"], st["buf"] = {}, None, None, None

    def on_header_field(data, start, end):
        st["field"] += data[start:end]

    def on_header_value(data, start, end):
        st["value"] += data[start:end]

    def on_header_end():
        st["headers"][st["field"].strip().lower()] = st["value"].strip()
        st["field"], st["value"] = b"", b""

    def on_headers_finished():
        disp, params = parse_options_header(st["headers"].get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        st["name"] = name
        if name == "video":
            if up.video is not None:
                raise InputError("the form has more than one `video` part; send one video")
            up.video_type = st["headers"].get(b"content-type", b"").decode("latin-1")
            check_video_type(up.video_type)
            fn = params.get(b"filename")
            up.filename = os.path.basename(fn.decode("utf-8", "replace"))[:200] if fn else None
            up.video = new_temp(folder)
            st["file"] = open(up.video, "wb")
        elif b"filename" in params:
            st["buf"] = None      # a file part we have no use for: its bytes are dropped
        else:
            st["buf"] = bytearray()

    def on_part_data(data, start, end):
        n = end - start
        if st["file"] is not None:
            up.size += n
            if up.size > max_bytes:
                raise _too_large(None, max_bytes)
            st["file"].write(data[start:end])
        elif st["buf"] is not None:
            if len(st["buf"]) + n > MAX_FIELD_BYTES:
                raise InputError(f"the form field `{st['name']}` is over "
                                 f"{MAX_FIELD_BYTES // 1024} KiB")
            st["buf"] += data[start:end]

    def on_part_end():
        if st["file"] is not None:
            st["file"].close()
            st["file"] = None
        elif st["buf"] is not None and st["name"]:
            up.fields.setdefault(st["name"], bytes(st["buf"]))

    def on_end():
        st["ended"] = True

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_header_field": on_header_field,
        "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data,
        "on_part_end": on_part_end, "on_end": on_end})
    stream = request.stream()
    try:
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
        if not st["ended"]:
            raise InputError("the multipart body ended early (no closing boundary): the "
                             "upload was cut off")
    except BaseException as e:
        if st["file"] is not None:
            st["file"].close()
        remove(up.video)
        up.video = None
        if isinstance(e, FormParserError):
            raise InputError(f"malformed multipart body: {e}") from None
        if isinstance(e, MMInferError):
            await drain(stream)
        raise
    return up


async def read_body(request, max_bytes: int) -> bytes:
    """The whole body, refusing (413) as soon as it passes ``max_bytes``."""
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise TooLarge(f"the request body is {declared} bytes, over this server's limit of "
                       f"{max_bytes} bytes", limit_bytes=max_bytes)
    buf = bytearray()
    stream = request.stream()
    async for chunk in stream:
        buf += chunk
        if len(buf) > max_bytes:
            await drain(stream)
            raise TooLarge(f"the request body is over this server's limit of {max_bytes} "
                           f"bytes", limit_bytes=max_bytes)
    return bytes(buf)


# ------------------------------------------------------------------ form values

def text_field(up: Upload, name: str, required: bool = False) -> str | None:
    raw = up.fields.get(name)
    if raw is None:
        if required:
            raise MissingField(f"the form field `{name}` is missing", field=name)
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"the form field `{name}` is not valid UTF-8 (byte {e.start})",
                         field=name) from None


def number(value, name: str, kind=float):
    """A request number from a form string or JSON value; InputError when it is not one."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise InputError(f"{name} must be a number, not {value!r}", field=name)
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise InputError(f"{name} must be an integer, not {value!r}", field=name)
    if isinstance(value, (int, float)):
        x = float(value)
    else:
        try:
            x = float(str(value).strip())
        except ValueError:
            raise InputError(f"{name} must be a number, not {value!r}", field=name) from None
    if not math.isfinite(x):
        raise InputError(f"{name} must be a finite number, not {value!r}", field=name)
    return x


# ------------------------------------------------------------------- media URLs

def save_data_url(url: str, folder, max_bytes: int) -> str:
    """``data:[type][;base64],...`` into a temp file; returns its path."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise InputError("malformed data: URL (no comma before the data)")
    meta = head[5:].split(";")
    check_video_type(meta[0] or None, "the data: URL")
    if "base64" not in meta[1:]:
        raise InputError("data: URLs must be base64-encoded (data:video/mp4;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _too_large(f"about {len(payload) * 3 // 4} bytes", max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InputError(f"the data: URL is not valid base64 ({e})") from None
    path = new_temp(folder)
    try:
        with open(path, "wb") as f:
            f.write(data)
    except BaseException:
        remove(path)
        raise
    return path


def local_media(url: str, allowed_dir: str | None) -> str:
    """A ``file://`` URL or absolute path, only inside the allow-listed folder (symlinks and
    ``..`` resolved before the check)."""
    if not allowed_dir:
        raise Forbidden("local media paths are disabled on this server (start it with "
                        "--allowed-local-media-path DIR to allow a folder)")
    raw = unquote(urlparse(url).path) if url.startswith("file:") else url
    if "\x00" in raw:
        raise InputError("the media path contains a NUL byte")
    root = os.path.realpath(allowed_dir)
    real = os.path.realpath(raw)
    if os.path.commonpath([root, real]) != root:
        raise Forbidden("the media path is outside the allowed local media folder")
    if not os.path.isfile(real):
        raise VideoError("the media path does not name a file in the allowed folder")
    return real


async def fetch_remote(url: str, folder, max_bytes: int, allowed_domains, timeout: float) -> str:
    """Download an http(s) URL whose host is allow-listed; no redirects (they could lead
    anywhere), size checked while downloading."""
    import httpx

    host = (urlparse(url).hostname or "").lower()
    if not allowed_domains:
        raise RemoteRefused("remote media URLs are disabled on this server; send the video as "
                            "a data: URL or upload it to /v1/answer (or start the server with "
                            "--allowed-media-domains)")
    if host not in allowed_domains:
        raise RemoteRefused(f"the media host {host!r} is not in this server's allowed media "
                            f"domains", host=host)
    path = new_temp(folder)
    try:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            async with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise VideoError(f"fetching the video URL answered HTTP {r.status_code}")
                check_video_type(r.headers.get("content-type"), "the fetched video")
                n = 0
                with open(path, "wb") as f:
                    async for chunk in r.aiter_bytes():
                        n += len(chunk)
                        if n > max_bytes:
                            raise _too_large(None, max_bytes)
                        f.write(chunk)
    except httpx.HTTPError as e:
        remove(path)
        raise VideoError(f"fetching the video URL failed: {type(e).__name__}") from None
    except BaseException:
        remove(path)
        raise
    return path
