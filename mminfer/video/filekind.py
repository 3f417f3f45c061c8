"""What a file is, told from its first bytes and the file system before any demuxer sees it."""
from __future__ import annotations

import os
from dataclasses import dataclass

from mminfer.errors import VideoError


@dataclass(frozen=True)
class FileKind:
    """What a file's first bytes say it is."""
    name: str       # "mp4", "matroska", "PNG", "PDF", "text", ...
    what: str       # for messages: "a PNG image", "MP3 audio", ...
    video: bool     # a video container; False: clearly not a video
    image: bool = False


def _kind(name, what, image=False):
    return FileKind(name, what, False, image)


# The one table of magic numbers (the service and the decoder both sniff with it). Still
# images are listed because ffmpeg would happily open them as a one-frame "video".
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", _kind("PNG", "a PNG image", True)),
    (b"\xff\xd8\xff", _kind("JPEG", "a JPEG image", True)),
    (b"II*\x00", _kind("TIFF", "a TIFF image", True)),
    (b"MM\x00*", _kind("TIFF", "a TIFF image", True)),
    (b"%PDF", _kind("PDF", "a PDF document")),
    (b"PK\x03\x04", _kind("ZIP", "a ZIP archive")),
    (b"\x1f\x8b", _kind("gzip", "a gzip archive")),
    (b"ID3", _kind("MP3", "MP3 audio")),
    (b"fLaC", _kind("FLAC", "FLAC audio")),
    (b"\x7fELF", _kind("ELF", "an executable")),
    (b"\x1a\x45\xdf\xa3", FileKind("matroska", "a Matroska/WebM file", True)),
)
_TEXT = _kind("text", "a text file")


def sniff(head: bytes) -> FileKind | None:
    """What the first bytes (64 are enough) of a file say it is, or None when they do not
    say: an unknown container is left to the demuxer."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _kind("WEBP", "a WEBP image", True)
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _kind("WAV", "WAV audio")
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":
        return _kind("BMP", "a BMP image", True)   # the reserved bytes: "BM" alone is too weak
    if head[4:8] == b"ftyp":
        return FileKind("mp4", "an MP4 file", True)
    if head.startswith((b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff")):
        return _TEXT
    for cut in range(4):        # the 64-byte window may split a multi-byte character
        try:
            text = head[:len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c.isprintable() or c in "\r\n\t" for c in text):
            return _TEXT
        break
    return None


def check_file(path: str) -> str | None:
    """Raise for what can be told without a demuxer; return the sniffed kind's name."""
    if not os.path.exists(path):
        raise VideoError(f"video file not found: {path}", path=path)
    if not os.path.isfile(path):
        raise VideoError(f"not a regular file: {path}", path=path)
    if os.path.getsize(path) == 0:
        raise VideoError(f"video file is empty (0 bytes): {path}", path=path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise VideoError(f"cannot read {path}: {e.strerror or e}", path=path) from None
    kind = sniff(head)
    if kind is not None and kind.image:
        raise VideoError(f"{path} is {kind.what}, not a video; send it as an image",
                         path=path, detected=kind.name)
    if kind is not None and kind.name == "text":
        raise VideoError(f"{path} is a text file, not a video", path=path, detected="text")
    return kind.name if kind is not None else None
