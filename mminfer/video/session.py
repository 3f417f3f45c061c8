"""The decoding side of one video: the backends tried in order, the rest of the samples handed
to the next one when a backend fails mid-read, and what a failure tells the user."""
from __future__ import annotations

import numpy as np

from mminfer.errors import VideoError
from mminfer.video.readers import BACKENDS, open_reader, probe_av


def backend_order(backend: str | None) -> tuple[str, ...]:
    if backend is None:
        return BACKENDS
    if backend not in BACKENDS:
        raise VideoError(f"unknown video backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return (backend,)


def explain(path: str, failures) -> VideoError:
    for _, _, e in failures:
        if isinstance(e, VideoError):
            return e
    if all(stage == "missing" for _, stage, _ in failures):
        names = " or ".join(n for n, _, _ in failures)
        return VideoError(f"no video backend available: install {names}")
    if any(stage == "read" for _, stage, _ in failures):
        return VideoError(f"{path} is truncated or corrupt: its frames cannot be decoded",
                          path=path)
    return VideoError(f"{path} cannot be opened as a video (corrupt or unsupported format)",
                      path=path)


# FFmpeg's answers when an address-space limit stops it: ENOMEM, and EAGAIN from a
# decoder thread whose stack cannot be mapped (PyAV raises them as OSErrors)
_OUT_OF_MEMORY = (12, 11)


class Session:
    """The decoding side of one video: opens it with the first backend that can, then reads
    sorted distinct frame numbers in batches, handing the rest to the next backend when one
    fails mid-read. Everything here runs C/C++ parsers on the file, so by default it runs in
    a decode worker process (``mminfer.video.worker``, started by ``mminfer.video.sandbox``)
    that a crafted file may crash, starve of memory or hang without harm to the caller;
    ``sandbox.configure(sandbox=False)`` runs it in this process instead."""

    def __init__(self):
        self.reader = None
        self.backend = None
        self._gen = None
        self._cur = None          # the reader decoding now
        self._out = None

    def probe(self, path: str, order, kind) -> dict:
        try:
            return self.open(path, order, kind)
        finally:
            self.close()

    def open(self, path: str, order, kind) -> dict:
        """Facts of the video (as the backend that opened it sees them): ``backend``,
        ``total`` frames, ``fps`` (the container's average), ``pts`` (every frame's
        presentation time in seconds from the first), display ``width``/``height`` (after
        rotation), ``codec``, ``rotation``."""
        self.close()
        facts = probe_av(path, kind)
        if (facts or {}).get("rotation") and "pyav" in order:
            # decord turns frames itself, but breaks on some sizes (a buffer size check fails
            # for 96x48 at 90 degrees, and with scaling at 180): PyAV first for these
            order = ("pyav", *(o for o in order if o != "pyav"))
        failures: list[tuple[str, str, BaseException]] = []
        reader = None
        for i, name in enumerate(order):
            try:
                reader = open_reader(name, path, facts)
            except ImportError as e:
                failures.append((name, "missing", e))
                continue
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 (decord raises DECORDError/RuntimeError)
                failures.append((name, "open", e))
                continue
            order = order[i + 1:]
            break
        if reader is None:
            raise explain(path, failures)
        self.path, self.facts, self.reader, self.rest = path, facts, reader, list(order)
        self.failures, self.backend = failures, reader.name
        rotation = (facts or {}).get("rotation", 0)
        if reader.total < 1:
            h = w = 0
            codec = (facts or {}).get("codec", "unknown")
        elif facts is not None:
            h, w, codec = facts["height"], facts["width"], facts["codec"]
            if rotation in (90, 270):
                h, w = w, h
        else:   # no PyAV to read the headers: one decoded frame tells
            h, w = reader.read(np.array([0]))[0].shape[1:3]
            codec = "unknown"
        return {"backend": reader.name, "total": int(reader.total), "fps": float(reader.fps),
                "pts": np.asarray(reader.pts, dtype=np.float64), "width": int(w),
                "height": int(h), "codec": codec, "rotation": rotation}

    def start(self, targets, size, batch: int) -> None:
        """Decode the sorted distinct frame numbers ``targets``, ``batch`` at a time, at
        display size ``size`` (h, w) or the source's (None): see :meth:`next`."""
        self._gen = self._produce(np.asarray(targets, dtype=np.int64),
                                  None if size is None else tuple(int(v) for v in size),
                                  int(batch))

    def next(self, out: np.ndarray | None = None) -> np.ndarray | None:
        """The next batch of frames (uint8 ``[k, h, w, 3]``, C order), None at the end;
        decoded into ``out`` (flat uint8) where the backend can (then a view of it)."""
        self._out = out
        if self._cur is not None:
            self._cur.out_buffer = out
        return next(self._gen, None)

    def close(self):
        if self._gen is not None:
            self._gen.close()
            self._gen = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _produce(self, targets, size, batch):
        pos = 0
        reader, self.reader = self.reader, None
        if size is None:
            want_hw = None
        rest = self.rest
        try:
            while True:
                name = reader.name
                try:
                    reader = reader.resized(size)
                    self.backend = reader.name
                    self._cur = reader
                    reader.out_buffer = self._out
                    for frames, _ in reader.batches(targets[pos:], batch):
                        k = len(frames)
                        want_hw = size or want_hw or frames.shape[1:3]
                        want = (k, *want_hw, 3)
                        if frames.shape != want or frames.dtype != np.uint8:
                            raise RuntimeError(f"backend returned frames of shape "
                                               f"{frames.shape}, expected {want}")
                        pos += k
                        yield np.ascontiguousarray(frames)
                    return
                except VideoError:
                    raise
                except MemoryError:
                    raise
                except OSError as e:
                    if e.errno in _OUT_OF_MEMORY:
                        raise MemoryError(f"decoding {self.path}: {e}") from None
                    self.failures.append((name, "read", e))
                except Exception as e:  # noqa: BLE001 (the next backend gets the rest)
                    self.failures.append((name, "read", e))
                finally:
                    reader.close()
                    self._cur = None
                reader = None
                while rest and reader is None:
                    nxt = rest.pop(0)
                    try:
                        reader = open_reader(nxt, self.path, self.facts)
                    except ImportError as e:
                        self.failures.append((nxt, "missing", e))
                    except Exception as e:  # noqa: BLE001
                        self.failures.append((nxt, "open", e))
                if reader is None:
                    raise explain(self.path, self.failures)
        finally:
            if reader is not None:
                reader.close()

