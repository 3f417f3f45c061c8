"""Getting a video from a request onto disk, safely.

Uploads are parsed as they stream (python-multipart's push parser) straight into a temporary
file under the service's own upload folder, counting bytes, so an upload over the limit is
refused while it arrives, never after. Temporary names come from ``tempfile``; a filename the
client sends is kept only as a label and never touches a path. Whoever creates a temporary
file hands its path to exactly one owner that deletes it (see ``worker.Job.cleanup``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

import httpx
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from mminfer.video import sniff
from mminfer.errors import (Forbidden, InputError, MissingField, MMInferError, RemoteRefused,
                            RemoteTimeout, TooLarge, UnsupportedMedia, VideoError)

MAX_FIELD_BYTES = 64 * 1024      # a question, a number: never more than this
MAX_PARTS = 32
DRAIN_BYTES = 64 * 1024 * 1024   # read (and drop) at most this much after refusing an upload
DRAIN_SECONDS = 5.0              # ... and for at most this long
DATA_URL_CHUNK = 1 << 20         # base64 characters decoded at a time (a multiple of 4)
TEMP_PREFIX = "upload-"

# Part content types accepted for a video; anything else is refused with 415 before decoding.
VIDEO_TYPES = ("application/octet-stream", "binary/octet-stream", "application/mp4",
               "application/x-matroska", "application/ogg", "application/vnd.rn-realmedia")


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


def check_file(path: str, label: str = "the uploaded video"):
    """Empty (400) or clearly not a video by its first bytes (415)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        raise VideoError(f"{label} is empty (0 bytes)")
    kind = sniff(head)
    if kind is not None and not kind.video:
        raise UnsupportedMedia(f"{label} is {kind.what}, not a video (judged by its first "
                               f"bytes)", detected=kind.what)


# ------------------------------------------------------------------- multipart

@dataclass
class Form:
    """A multipart body as received: its text fields, and the video part in a temp file."""
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


async def drain(stream, cap: int = DRAIN_BYTES, seconds: float = DRAIN_SECONDS):
    """Read and drop what the client is still sending, so it reads our 4xx instead of a reset
    connection; a client sending more than ``cap`` bytes or for longer than ``seconds`` gets
    the connection closed."""
    n, end = 0, time.monotonic() + seconds
    it = stream.__aiter__()
    try:
        while n <= cap:
            left = end - time.monotonic()
            if left <= 0:
                break
            n += len(await asyncio.wait_for(it.__anext__(), left))
    except (StopAsyncIteration, asyncio.TimeoutError):
        pass
    except Exception:               # noqa: BLE001 - client went away: nothing to drain
        pass


def _too_large(size_desc: str | None, max_bytes: int) -> TooLarge:
    size = f" ({size_desc})" if size_desc else ""
    return TooLarge(f"the video{size} is larger than this server's upload limit of "
                    f"{max_bytes / 2**20:g} MiB", limit_bytes=max_bytes)


async def read_multipart(request, stream, folder, max_bytes: int,
                         file_field: str = "video") -> Form:
    """Parse a multipart/form-data body read from ``stream`` (the request's, timed by the
    intake): the ``file_field`` part (the video) goes to a temp file, other parts (at most
    64 KiB each) to ``fields``. On any error the temp file is gone."""

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

    up = Form()
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
        if name == file_field:
            if up.video is not None:
                raise InputError(f"the form has more than one `{file_field}` part; send one "
                                 f"video")
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


async def read_body(request, stream, max_bytes: int) -> bytes:
    """The whole body (read from ``stream``), refusing (413) as soon as it passes
    ``max_bytes``."""
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise TooLarge(f"the request body is {declared} bytes, over this server's limit of "
                       f"{max_bytes} bytes", limit_bytes=max_bytes)
    buf = bytearray()
    async for chunk in stream:
        buf += chunk
        if len(buf) > max_bytes:
            await drain(stream)
            raise TooLarge(f"the request body is over this server's limit of {max_bytes} "
                           f"bytes", limit_bytes=max_bytes)
    return bytes(buf)


# ------------------------------------------------------------------ form values

def text_field(up: Form, name: str, required: bool = False) -> str | None:
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


# ------------------------------------------------------------------- media URLs

def parse_url(url: str):
    """``urlparse``, its ValueError (a malformed IPv6 literal such as ``http://[::1/x``, a
    bracketed non-address) as a 400 naming the URL's problem."""
    try:
        parts = urlparse(url)
        parts.hostname                 # noqa: B018 - validates a bracketed host
    except ValueError as e:
        raise InputError(f"the video URL is malformed ({e})") from None
    return parts


B64_WHITESPACE = str.maketrans("", "", " \t\r\n")


def _b64_pieces(payload: str, chunk: int):
    """``payload`` in pieces of base64 characters whose lengths are multiples of 4 (the last
    excepted), whitespace removed: RFC 2045 (MIME) base64 breaks lines every 76 characters,
    and a data: URL may carry it so. Each piece is cleaned on its own, so a long payload is
    never copied whole."""
    carry = ""
    for i in range(0, len(payload), chunk):
        piece = carry + payload[i:i + chunk].translate(B64_WHITESPACE)
        cut = len(piece) - len(piece) % 4
        carry = piece[cut:]
        if cut:
            yield piece[:cut], i + chunk >= len(payload) and not carry
    if carry:
        yield carry, True

def save_data_url(url: str, folder, max_bytes: int) -> str:
    """``data:[type][;base64],...`` into a temp file; returns its path. Run it off the event
    loop: the payload is decoded and written a chunk at a time, so the thread gives up the
    GIL between chunks and the loop keeps answering."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise InputError("malformed data: URL (no comma before the data)")
    meta = head[5:].split(";")
    check_video_type(meta[0] or None, "the data: URL")
    if "base64" not in meta[1:]:
        raise InputError("data: URLs must be base64-encoded (data:video/mp4;base64,...)")
    spaces = (payload.count("\n") + payload.count("\r") + payload.count(" ")
              + payload.count("\t"))
    size = (len(payload) - spaces) * 3 // 4
    if size > max_bytes + 3:
        raise TooLarge(f"the video in the data: URL (about {size} bytes) is larger than this "
                       f"server's data: URL limit of {max_bytes / 2**20:g} MiB; upload it to "
                       f"/v1/answer instead", limit_bytes=max_bytes)
    path = new_temp(folder)
    try:
        with open(path, "wb") as f:
            pieces = (_b64_pieces(payload, DATA_URL_CHUNK) if spaces else
                      ((payload[i:i + DATA_URL_CHUNK], i + DATA_URL_CHUNK >= len(payload))
                       for i in range(0, len(payload), DATA_URL_CHUNK)))
            for chunk, last in pieces:
                if "=" in chunk and not last:
                    raise InputError("the data: URL is not valid base64 (padding before "
                                     "the end)")
                try:
                    f.write(base64.b64decode(chunk, validate=True))
                except (binascii.Error, ValueError) as e:
                    raise InputError(f"the data: URL is not valid base64 ({e})") from None
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
    if url[:5].lower() == "file:":           # schemes are case-insensitive (RFC 3986)
        parts = parse_url(url)
        host = (parts.netloc or "").lower()
        if host not in ("", "localhost"):
            raise Forbidden(f"file:// URLs name files on this server only; the host "
                            f"{parts.netloc!r} is not this server (use file:///path)")
        raw = unquote(parts.path)
    else:
        raw = url
    if "\x00" in raw:
        raise InputError("the media path contains a NUL byte")
    root = os.path.realpath(allowed_dir)
    real = os.path.realpath(raw)
    if os.path.commonpath([root, real]) != root:
        raise Forbidden("the media path is outside the allowed local media folder")
    if not os.path.isfile(real):
        raise VideoError("the media path does not name a file in the allowed folder")
    return real


def _non_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What an address is when it is not on the public internet, else None."""
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for what, flag in (("loopback", ip.is_loopback), ("private", ip.is_private),
                       ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                       ("unspecified", ip.is_unspecified), ("reserved", ip.is_reserved),
                       ("non-global", not ip.is_global)):
        if flag:
            return what
    return None


async def _resolve(host: str, port: int, allow_private: bool) -> str:
    """The address to connect to: an IP literal as it is (the operator listed it), a name
    resolved once here, refused when it points inside (loopback, private, link-local...),
    so the allow-list cannot be turned against the server's own network."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except OSError as e:
        raise VideoError(f"the media host {host!r} cannot be resolved ({e.strerror or e})",
                         reason="fetch", host=host) from None
    addrs = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not allow_private:
        for ip in addrs:
            what = _non_public(ip)
            if what:
                raise RemoteRefused(f"the media host {host!r} resolves to a {what} address "
                                    f"({ip}); this server fetches only from public addresses",
                                    host=host)
    return str(addrs[0])


async def fetch_remote(url: str, folder, max_bytes: int, allowed_domains, timeout: float,
                       deadline: float = 120.0, allow_private: bool = False) -> str:
    """Download an http(s) URL whose host is allow-listed: no redirects (they could lead
    anywhere), the resolved address pinned (no second lookup that could answer otherwise),
    size checked while downloading, the whole download within ``deadline`` seconds."""
    parts = parse_url(url)
    host = (parts.hostname or "").lower()
    if not allowed_domains:
        raise RemoteRefused("remote media URLs are disabled on this server; send the video as "
                            "a data: URL or upload it to /v1/answer (or start the server with "
                            "--allowed-media-domains)")
    if host not in allowed_domains:
        raise RemoteRefused(f"the media host {host!r} is not in this server's allowed media "
                            f"domains", host=host)
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise InputError("the video URL has a bad port") from None
    path = new_temp(folder)

    async def download():
        ip = await _resolve(host, port, allow_private)
        netloc = f"[{ip}]" if ":" in ip else ip
        pinned = parts._replace(netloc=f"{netloc}:{port}").geturl()
        headers = {"Host": parts.netloc.rpartition("@")[2]}
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
            async with client.stream("GET", pinned, headers=headers,
                                     extensions={"sni_hostname": host}) as r:
                if r.status_code != 200:
                    raise VideoError(f"fetching the video URL answered HTTP {r.status_code}",
                                     reason="fetch")
                check_video_type(r.headers.get("content-type"), "the fetched video")
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise _too_large(f"{declared} bytes declared by the media host", max_bytes)
                n = 0
                with open(path, "wb") as f:
                    async for chunk in r.aiter_bytes():
                        n += len(chunk)
                        if n > max_bytes:
                            raise _too_large(None, max_bytes)
                        f.write(chunk)

    try:
        await asyncio.wait_for(download(), deadline)
    except asyncio.TimeoutError:
        remove(path)
        raise RemoteTimeout(f"the video URL did not deliver the whole video within this "
                            f"server's fetch deadline of {deadline:g} s",
                            deadline_s=deadline) from None
    except httpx.HTTPError as e:
        remove(path)
        raise VideoError(f"fetching the video URL failed: {type(e).__name__}",
                         reason="fetch") from None
    except BaseException:
        remove(path)
        raise
    return path
