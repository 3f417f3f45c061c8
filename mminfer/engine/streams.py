"""Live video: a stream is a cached prefix that grows. Each appended piece of video is sampled at
the stream's rate, encoded, and prefilled on top of the stream's KV cache (positions continue,
the new rows attend to every earlier key and causally among themselves:
``models.prefill.prefill(append=True)``); a question is a suffix over whatever the stream holds
when it arrives, exactly as a question on a cached video (``Adapter.continue_on``), and its rows
are dropped after the answer. The prompt's layout (the head, each piece's rows, the question's
closing tokens) is the model's: mminfer.models.streaming.

Exact: after any number of pieces, a question sees the prompt (tokens, positions, K/V) that a
one-shot request on the same frames builds, so a dense stream answers as the dense one-shot
prefill does (tests/engine/test_streams.py).

Sparse pieces: a stream's attention mode (the pipeline's by default) decides per piece, as a
one-shot prefill decides per request (``hooks.choose_attention`` on the stream's length after
the piece), and a piece shorter than ``sparse_min_tokens`` rows is dense whatever the mode:
its rows are few, and the estimate and the plan would cost more than they save. A sparse
piece plans its rows from its own last queries against every key of the stream, with the
whole stream's ModalityIndex (positions, grid lines and modality groups absolute), and the
kernels take its queries at an offset into the stream's keys (mminfer.sparse.estimate).

Media time: a stream samples at ``fps`` from its first frame (sample ``k`` is media time
``k / fps``). A piece continues the media time the stream covers (or starts where the client
says, never before it: a piece that would go back in time is refused); its frames nearest to the
sample times inside it are kept. Qwen2.5-VL takes frames in temporal pairs: an odd last frame
waits for the next piece, and an answer reports ``seen_until``, the media time of the frames in
the cache.

Turns: a piece's vision and prefill are long work for the scheduler (``with turn.long()``,
checked between layers); a question is short work, its suffix then its decode steps. One piece
at a time appends to a stream (a second waits, its turn given away). A question forks the
stream's cache (mminfer.models.kv.ForkKV) at what it holds when the question starts: the
first ``length`` rows shared and read only, the question's and answer's rows in buffers of its
own. So any number of questions about one stream decode together in the scheduler's batched
steps, and a piece is ingested while they are answered: its rows go after every fork's shared
rows and never write them. A piece that grows the cache copies the rows into a larger buffer;
a fork reads the prefix through the stream's current buffer at each step (the rows it shares
are the same in both), and the old buffer lives until the forks' views of it are gone (a
step later). A question that arrives while a piece is prefilled forks the stream as it was
before the piece: the piece's state (rows, units, positions, media time) is published at
once when it ends.

Rows move in place only while no fork reads them: a window's drop (``keep="window"``) waits
for the questions in progress to end, and new questions wait for the drop (one pass over the
cache at memory speed); a stream with a question in progress is in use, never moved to the
host tier (as one with a piece in progress is not). A question about a stream on the host
tier brings it back first.

Memory: the streams of a :class:`Streams` registry share a device budget (every byte their
caches hold on the model's device, room included; default: the video cache's device budget,
``kv_cache_gb``) and a host budget (pinned host memory; default 0: none). A question's fork
holds its own rows on top until it ends, as a question's on a cached video does; a piece's
budget check keeps ``QUESTION_ROOM`` rows' bytes free for one. A stream is used
whole on the device (a piece's rows and a question's attend to every key it holds; keys left on
the host would cross PCIe on every layer of every question), so the tiers hold whole streams,
as the video cache holds whole prefixes: when a piece or a restore needs device room, the
least recently used idle streams move to the host (their rows alone, no room), and a stream
on the host comes back on its next piece or question. A move copies every byte as it is
(FP8 too), so a stream that went to the host and back answers exactly as one that never
moved. On a CPU device both tiers are the same memory, counted apart.

Past both budgets (a piece that would take the stream over what the device can give it once
the idle streams that fit on the host are there), or past the model's context, a piece is
refused: the stream becomes ``full`` (a clear error says why), stops ingesting and stays
answerable. Nothing is dropped, unless the stream was created with ``keep="window"``: then
the oldest whole units (after the prompt's head) are dropped to make the piece's room, and the
status and every answer say what is gone (``seen_from``: the media time of the oldest frame
held). A windowed stream's positions stay absolute, and the rows it keeps were computed with
the dropped ones in context (as ReKV's and StreamingVLM's evictions are): what a question sees
is not the prompt of the kept frames alone. Its room is made before the piece's prefill, so a
piece that then fails has moved the window on all the same. The cache grows geometrically
(room of half its length, within the budget), so appending N rows in pieces copies O(N) rows
in all; a windowed stream moves its kept rows down once per piece that drops (one pass over
the cache at memory speed).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from contextlib import contextmanager

import numpy as np
import torch

from mminfer import video as videolib
from mminfer.engine.cache import Tier
from mminfer.engine.pipeline import (VISION_WORKSPACE_BYTES, AnswerResult, _check_context,
                                     check_request)
from mminfer.engine.scheduler import DECODE, Solo
from mminfer.engine.timing import PIPELINE_STAGES, StageTimer
from mminfer.errors import (Cancelled, InputError, ServiceUnavailable, StreamBusy, StreamClosed,
                            StreamFull, StreamNotFound, VideoError)
from mminfer.kernels import sparsity
from mminfer.models.base import Conversation, PrepareOptions
from mminfer.models.hooks import MODES, choose_attention, sparse_refusal
from mminfer.models.kv import HEADROOM, ForkKV, PrefixKV
from mminfer.models.prefill import DEFAULT_CHUNK, prefill
from mminfer.sparse.modality import ModalityIndex
from mminfer.video.sampling import nearest

log = logging.getLogger(__name__)

MAX_FPS = 60.0
# rows kept free in the budget past a stream for a question and its answer (its fork's)
QUESTION_ROOM = 1024
# pieces' prefill times kept for the status and the metrics
RECENT = 32
# a piece of fewer rows than this prefills dense in every mode. A guess to be replaced by a
# measurement: at 2-4K rows the estimate (64 queries against every key) and the plan are a
# small share of a piece's attention once the stream holds ~10^5 keys, and one minute of
# LongVILA video is ~15K rows.
SPARSE_MIN_PIECE_TOKENS = 2048

OPEN, FULL, CLOSED = "open", "full", "closed"
# what a stream keeps past its budgets: everything (it becomes full), or the latest window
KEEPS = ("all", "window")


def _index(layout, units: int) -> ModalityIndex:
    """The ModalityIndex of a stream's rows once ``units`` units follow the head."""
    sp = layout.span
    return ModalityIndex.from_segments(
        [("text", len(layout.head_ids)), ("video", units, sp["grid_h"], sp["grid_w"],
                                          sp["separators"])])


class _Until:
    """What ``Turn.wait_for`` waits on: ``pred()`` under ``cond``, re-checked on each notify."""

    def __init__(self, cond: threading.Condition, pred):
        self.cond, self.pred = cond, pred

    def wait(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(self.pred, timeout)


def _check_fps(fps) -> float:
    try:
        fps = float(fps)
    except (TypeError, ValueError):
        raise InputError(f"fps must be a number, not {fps!r}") from None
    if not (math.isfinite(fps) and 0 < fps <= MAX_FPS):
        raise InputError(f"fps must be in (0, {MAX_FPS:g}], not {fps:g}")
    return fps


class Stream:
    """One live video on one pipeline (see the module doc). ``options``: the pixel budget
    (PrepareOptions; Qwen2.5-VL: ``max_pixels``/``min_pixels`` per frame); ``registry``: the
    :class:`Streams` whose budget it shares (None: its own ``budget_bytes``)."""

    def __init__(self, pipeline, *, fps: float = 2.0, options: PrepareOptions | None = None,
                 stream_id: str | None = None, tenant: str | None = None, registry=None,
                 budget_bytes: int | None = None, mode: str | None = None,
                 sparse_min_tokens: int = SPARSE_MIN_PIECE_TOKENS, keep: str = "all"):
        self.pipeline = pipeline
        self.ad = pipeline.adapter
        self.fps = _check_fps(fps)
        mode = pipeline.attention if mode is None else mode
        if mode not in MODES:
            raise InputError(f"attention must be one of {MODES}, not {mode!r}")
        if mode == "sparse":
            why = sparse_refusal(self.ad.patterns, pipeline.sparse_unavailable)
            if why:
                raise InputError(why)
        self.mode = mode
        if keep not in KEEPS:
            raise InputError(f"keep must be one of {KEEPS}, not {keep!r}")
        self.keep = keep
        self.sparse_min_tokens = int(sparse_min_tokens)
        self.options = options or PrepareOptions()
        self.id = stream_id or uuid.uuid4().hex[:16]
        self.tenant = tenant
        self.registry = registry
        self.budget_bytes = budget_bytes
        # only the turns before the video shape the stream's prompt: the model's default
        self.conversation = Conversation.single("?")
        self.layout = None            # models.streaming.StreamLayout, from the first piece
        self.kv = None                # models.kv.PrefixKV: the stream's rows
        self.length = 0               # rows of the stream in kv
        self.units = 0                # units (Qwen: temporal pairs; LongVILA: frames) taken in
        self.rope_delta = 0
        self.tier = Tier.GPU          # where kv lives (Tier.HOST: spilled, back when used)
        self.used_at = 0.0            # monotonic time of its last piece or question (LRU)
        self.dropped_units = 0        # keep="window": the oldest units dropped
        self.dropped_rows = 0         # and their rows
        self.unit_samples: list[int] = []   # the sample index of each held unit's first frame
        self.pending = None           # frames waiting for the rest of their unit
        self.pending_samples: list[int] = []
        self.next_sample = 0          # the next sample is media time next_sample / fps
        self.media_end = 0.0          # media time the pieces received cover
        self.state = OPEN
        self.reason = None            # why it is full / closed
        self.last_error = None        # the last refused piece's error (dict)
        self.pieces = 0
        self.sparse_pieces = 0        # pieces whose prefill was sparse
        self.created = time.time()
        self.first_piece_at = None    # wall clock (time.time) of the first piece
        self.recent: list[dict] = []  # the last pieces' reports
        self.ingest_s = 0.0           # time spent ingesting, all pieces
        self.questions = 0
        # guards the holder, the forks and the state a question snapshots; notified on each
        # change of them
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._holder = None           # the piece (or spill, restore, close) using the stream
        self._forks = 0               # questions reading the stream's rows (their forks)
        self._moving = False          # rows move in place (a drop, a spill): no new fork

    # ------------------------------------------------------------ facts
    @property
    def held_units(self) -> int:
        return self.units - self.dropped_units

    @property
    def frames(self) -> int:
        """Model frames in the cache."""
        return self.held_units * (self.layout.unit_frames if self.layout else 1)

    @property
    def seen_from(self) -> float:
        """Media time of the oldest frame the cache holds (0 until a window dropped any)."""
        if not self.dropped_units or not self.unit_samples:
            return 0.0
        return self.unit_samples[0] / self.fps

    def window(self) -> dict | None:
        """What a window dropped (None: the stream keeps everything)."""
        if self.keep != "window":
            return None
        uf = self.layout.unit_frames if self.layout else 1
        return {"dropped_frames": self.dropped_units * uf, "dropped_tokens": self.dropped_rows,
                "seen_from": round(self.seen_from, 3)}

    @property
    def seen_until(self) -> float:
        """Media time up to which the cache holds the stream's frames (seconds): the sample
        after the last one in the cache (a piece that starts after a gap moves the samples on;
        frames still waiting for their unit are not in the cache)."""
        waiting = 0 if self.pending is None else len(self.pending)
        return max(self.next_sample - waiting, 0) / self.fps

    @property
    def index(self) -> ModalityIndex | None:
        """The ModalityIndex of the rows in the cache."""
        if self.layout is None or not self.length:
            return None
        return _index(self.layout, self.held_units)

    @property
    def held_bytes(self) -> int:
        return self.kv.held_bytes if self.kv is not None else 0

    def status(self) -> dict:
        """What ``GET /v1/streams/{id}`` says."""
        now = time.time()
        lag = None
        if self.first_piece_at is not None:
            # how far the media taken in trails the wall clock since the first piece: a live
            # source keeps it near one piece's length; a growing lag means falling behind
            lag = round(max(0.0, (now - self.first_piece_at) - self.seen_until), 3)
        kv_where = None
        if self.kv is not None and self.kv.layers[0].k_buf is not None:
            kv_where = "host" if self.tier is Tier.HOST else \
                "gpu" if self.kv.layers[0].k_buf.is_cuda else "cpu"
        last = self.recent[-1] if self.recent else None
        return {
            "id": self.id, "object": "stream", "state": self.state, "reason": self.reason,
            "model": self.pipeline.model_id, "fps": self.fps, "attention": self.mode,
            "sparse_pieces": self.sparse_pieces,
            "pixels": {k: v for k, v in vars(self.options).items() if v is not None},
            "pieces": self.pieces, "frames": self.frames,
            "pending_frames": 0 if self.pending is None else len(self.pending),
            "tokens": self.length, "visual_tokens": self.held_units * (
                self.layout.unit_tokens if self.layout else 0),
            "keep": self.keep, "window": self.window(),
            "media_seconds": round(self.media_end, 3), "seen_until": round(self.seen_until, 3),
            "lag_seconds": lag, "ingest_seconds": round(self.ingest_s, 3),
            "last_piece": last, "last_error": self.last_error, "questions": self.questions,
            "questions_open": self._forks,
            "kv": {"where": kv_where, "tier": self.tier.value if kv_where else None,
                   "bytes": self.held_bytes, "dtype": self.pipeline.kv_cache_dtype},
            "created": int(self.created),
        }

    # ------------------------------------------------------------ who uses the cache
    @contextmanager
    def _hold(self, turn):
        """The stream for this block: one piece (or close) at a time, questions' forks going
        on beside it; a waiter gives its turn on the model away meanwhile."""
        while not self._try_hold():
            turn.wait_for(_Until(self._changed, lambda: self._holder is None))
        try:
            self.used_at = time.monotonic()
            yield
        finally:
            self._release()

    def _try_hold(self, unforked: bool = False) -> bool:
        """The stream taken if nobody holds it (else False at once); ``unforked``: only if no
        question reads it either, and none forks it until it is released (its rows move)."""
        with self._mutex:
            if self._holder is not None or (unforked and self._forks):
                return False
            self._holder = object()
            self._moving = unforked
            return True

    def _release(self) -> None:
        with self._mutex:
            self._holder = None
            self._moving = False
            self._changed.notify_all()

    @contextmanager
    def _rows_moving(self, turn):
        """Held: the block moves rows in place; new questions wait for it, and it waits for
        the questions reading the stream to end (their turns go on meanwhile)."""
        with self._mutex:
            self._moving = True
            forks = self._forks
        try:
            if forks:
                turn.wait_for(_Until(self._changed, lambda: not self._forks))
            yield
        finally:
            with self._mutex:
                self._moving = False
                self._changed.notify_all()

    def _fork(self, turn, headroom: int):
        """A fork of the stream's rows as they are now, counted open (:meth:`_unfork` after),
        and what it saw; a stream on the host tier comes back first, and a drop in progress
        is waited for."""
        while True:
            with self._mutex:
                if self.state == CLOSED:
                    raise StreamClosed(f"stream {self.id} is closed", stream=self.id)
                if self.kv is None or not self.length:
                    raise InputError(f"stream {self.id} has no video yet: append a piece "
                                     "first", stream=self.id)
                if not self._moving and self.tier is Tier.GPU:
                    fork = ForkKV(self.kv, self.length, headroom=headroom)
                    self._forks += 1
                    self.used_at = time.monotonic()
                    seen = {"frames": self.frames, "tokens": self.length,
                            "visual_tokens": self.held_units * self.layout.unit_tokens,
                            "seen_until": round(self.seen_until, 3),
                            "media_seconds": round(self.media_end, 3)}
                    if self.dropped_units:
                        seen["seen_from"] = round(self.seen_from, 3)
                    return fork, seen, self.rope_delta
            if self._try_hold():
                try:
                    self._on_device()
                finally:
                    self._release()
                continue
            turn.wait_for(_Until(self._changed, lambda: self.state == CLOSED or (
                not self._moving and (self.tier is Tier.GPU or self._holder is None))))

    def _unfork(self) -> None:
        with self._mutex:
            self._forks -= 1
            self.used_at = time.monotonic()
            self._changed.notify_all()

    def _on_device(self) -> None:
        """The stream's cache on the model's device (brought back from the host tier, its
        room made by the registry first); the stream is held."""
        if self.tier is Tier.GPU or self.kv is None:
            return
        need = self.kv.bytes_at(self.length + QUESTION_ROOM)
        if self.registry is not None and self.registry.make_room(self, need) < need:
            raise ServiceUnavailable(
                f"stream {self.id} is in the host tier and the streams' device budget has no "
                f"room for its {need} bytes now (the streams there are in use, or the host "
                "tier has no room for them): try again shortly", stream=self.id)
        self.kv.move(self.pipeline.device, headroom=QUESTION_ROOM)
        with self._mutex:
            self.tier = Tier.GPU
            self._changed.notify_all()
        if self.registry is not None:
            self.registry.counts["restores"] += 1

    def _spill(self, pin: bool) -> None:
        """The stream's rows (no room) to host memory (pinned with ``pin``); the stream is
        held with no fork (``_try_hold(unforked=True)``). All or nothing: a failed copy leaves
        it on the device."""
        self.kv.move("cpu", pin=pin, headroom=0)
        self.tier = Tier.HOST

    def _open_for_pieces(self):
        if self.state == CLOSED:
            raise StreamClosed(f"stream {self.id} is closed", stream=self.id)
        if self.state == FULL:
            raise StreamFull(f"stream {self.id} is full and takes no more video: "
                             f"{self.reason}", stream=self.id)

    # ------------------------------------------------------------ pieces
    def append_file(self, path, *, start: float | None = None, turn=None, cancel=None) -> dict:
        """A piece of video in a file any decoder reads (an MP4 fragment, an MPEG-TS segment, a
        short file): its frames nearest to the stream's sample times inside it, appended.
        ``start``: the piece's media time (None: right after what the stream covers; earlier
        than that is refused). Returns the piece's report (:meth:`append_frames`)."""
        self._open_for_pieces()
        info = videolib.probe(path)
        pts = info.timestamps
        if pts is None:
            pts = np.arange(info.frames) / info.fps
        pts = np.asarray(pts, dtype=np.float64)[:info.frames]
        if len(pts) > 1 and np.any(np.diff(pts) < 0):
            raise VideoError("the piece's timestamps go backwards", reason="timestamps")
        t0 = self.media_end if start is None else float(start)
        if not math.isfinite(t0) or t0 < self.media_end - 1e-6:
            raise VideoError(f"timestamps go backwards: the piece starts at {t0:g} s, the "
                             f"stream already covers up to {self.media_end:g} s",
                             reason="timestamps")
        duration = float(info.duration)
        k0 = max(self.next_sample, math.ceil(t0 * self.fps - 1e-9))
        k1 = math.ceil((t0 + duration) * self.fps - 1e-9)       # samples in [t0, t0 + D)
        picks = nearest(pts, np.arange(k0, k1) / self.fps - t0) if k1 > k0 else []
        frames = np.zeros((0, info.height, info.width, 3), np.uint8)
        if len(picks):
            with videolib.open_stream(path, sampling="uniform", num_frames=info.frames,
                                      max_frames=info.frames, min_frames=1) as s:
                if len(s) != info.frames or np.any(s.indices != np.arange(info.frames)):
                    raise VideoError("the piece's frames could not be read one by one")
                s.keep_samples(picks)
                chunks = list(s.chunks(max(len(picks), 1)))
            frames = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        return self.append_frames(frames, media_seconds=t0 + duration - self.media_end,
                                  next_sample=max(k1, k0), turn=turn, cancel=cancel)

    def append_frames(self, frames, *, media_seconds: float | None = None,
                      next_sample: int | None = None, turn=None, cancel=None) -> dict:
        """Decoded frames ``[n, H, W, 3]`` uint8 of the next samples (``media_seconds``: the
        media time they cover, default ``n / fps``), appended: encoded and prefilled on top of
        the stream's cache (whole units; the rest waits for the next piece). Returns the
        piece's report: frames, tokens, media time, timings (ms). A piece that fails leaves the
        stream as it was; one past the budget or the context makes the stream ``full``."""
        self._open_for_pieces()
        frames = torch.as_tensor(np.asarray(frames))
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != torch.uint8:
            raise VideoError(f"a piece is frames [n, H, W, 3] uint8, not {tuple(frames.shape)} "
                             f"{frames.dtype}")
        turn = turn if turn is not None else Solo()
        if self.layout is None and len(frames):
            layout = self.ad.stream_layout(self.conversation, self.fps,
                                           tuple(frames.shape[1:3]), self.options)
        else:
            layout = self.layout
        if layout is not None and len(frames):
            layout.check_frames(frames)
        t0 = time.perf_counter()
        if not turn.acquire():
            raise Cancelled("request cancelled while waiting for the model")
        ns = (self.next_sample + len(frames)) if next_sample is None else int(next_sample)
        samples = list(range(ns - len(frames), ns))   # the frames' sample indices
        media = len(frames) / self.fps if media_seconds is None \
            else max(float(media_seconds), 0.0)
        with self._hold(turn):
            self._open_for_pieces()            # it may have filled while this one waited
            self._on_device()
            report = self._ingest(layout, frames, samples, turn, cancel, media, ns)
            report.update(piece=self.pieces, media_seconds=round(self.media_end, 3),
                          seen_until=round(self.seen_until, 3),
                          total_ms=round((time.perf_counter() - t0) * 1e3, 3))
            self.recent = (self.recent + [report])[-RECENT:]
            self.last_error = None
            return report

    def refused(self, error) -> None:
        """Record a piece's refusal (the status says it); the stream is unchanged."""
        self.last_error = error.to_dict() if hasattr(error, "to_dict") else {
            "code": "error", "message": str(error)}

    def _ingest(self, layout, frames, samples, turn, cancel, media: float, ns: int) -> dict:
        """Units of ``pending + frames`` (``samples``: the frames' sample indices) encoded and
        prefilled (stream held, turn acquired); ``media``: the media time the piece covers,
        ``ns``: the next sample after it. What a question snapshots changes at once, at the
        end (:meth:`_commit`)."""
        if self.pending is not None and len(self.pending):
            frames = torch.cat([self.pending, frames]) if len(frames) else self.pending
            samples = self.pending_samples + samples
        n_units = len(frames) // layout.unit_frames if layout is not None else 0
        used = n_units * layout.unit_frames if layout is not None else 0
        rest = frames[used:]
        report = {"frames": int(used), "tokens": 0, "vision_ms": 0.0, "prefill_ms": 0.0}
        if n_units == 0:
            with self._mutex:
                self._commit(layout, media, ns, rest, samples[used:])
            return report
        head = len(layout.head_ids) if self.length == 0 else 0
        rows = head + n_units * layout.unit_tokens
        drop, room_rows = self._check_room(layout, self.length + rows, n_units)
        if drop:
            with self._rows_moving(turn):
                self._drop(layout, drop)
            report["dropped_frames"] = drop * layout.unit_frames
        new_len = self.length + rows

        def check():
            return turn.checkpoint() or (cancel is not None and bool(cancel()))

        ad = self.ad
        kv = self.kv
        if kv is None:
            kv = PrefixKV.for_model(ad.text_model, HEADROOM, dtype=ad.kv_cache_dtype)
        for layer in kv.layers:              # geometric growth: O(N) copies over a stream
            layer.headroom = min(max(QUESTION_ROOM, new_len // 2),
                                 max(room_rows - new_len, QUESTION_ROOM))
        before = self.length
        pipe = self.pipeline
        need, embed = self._piece_bytes(kv, rows, new_len)
        try:
            # paused idle work (a calibration step) keeps its memory while the device has
            # room for the piece: the room check asks it to give up only when short
            with turn.long(room_checked=pipe.video_cache.measures_room):
                if check():
                    raise Cancelled("request cancelled before the piece's vision")
                pipe.make_room(turn, need, ahead_bytes=embed + VISION_WORKSPACE_BYTES)
                t = time.perf_counter()
                embeds = layout.embed_units(frames[:used], cancel=check)
                if head:
                    embeds = torch.cat([layout.head_embeds(), embeds], dim=1)
                report["vision_ms"] = round((time.perf_counter() - t) * 1e3, 3)
                pipe.make_room(turn, need - embed)       # the embeddings are made
                # positions are absolute: the rows a window dropped still count
                pos = layout.positions(before + head + self.dropped_rows, self.units, n_units)
                if head:
                    pos = torch.cat([layout.head_positions(), pos], dim=-1)
                index = _index(layout, self.held_units + n_units)
                attention = self._piece_attention(rows, index)
                sparse = attention == "sparse"
                timer = StageTimer(self.pipeline.device)   # the prefill's index, attention
                ctx = self.pipeline.prefill_context(
                    index=index if sparse else None,
                    patterns=ad.patterns, mode=attention, cancel=check, keep_plans=sparse,
                    unavailable=self.pipeline.sparse_unavailable, timer=timer)
                t = time.perf_counter()
                with torch.inference_mode():
                    prefill(ad.text_model, embeds, kv, pos, ctx=ctx, kv_only_last=True,
                            append=before > 0, chunk=ad.prefill_chunk or DEFAULT_CHUNK)
                if kv.layers[0].k_buf is not None and kv.layers[0].k_buf.is_cuda:
                    torch.cuda.current_stream(kv.layers[0].k_buf.device).synchronize()
                report["prefill_ms"] = round((time.perf_counter() - t) * 1e3, 3)
                spent = timer.totals_ms()
                for stage in ("index", "attention"):
                    report[f"{stage}_ms"] = round(spent.get(stage, 0.0), 3)
                report["attention"] = attention
                counted = sparsity(ctx.densities) if sparse else None
                if counted is not None:     # pairs computed over the piece's causal pairs
                    report["density"] = round(counted["mean_density"], 6)
                del embeds
        except BaseException:
            for layer in kv.layers:          # every layer back to the rows before the piece
                if layer.k_buf is not None:
                    layer.crop(before)
            raise
        report["tokens"] = rows
        with self._mutex:
            self.kv = kv
            self.length = new_len
            self.units += n_units
            self.unit_samples += samples[:used:layout.unit_frames]
            self.sparse_pieces += attention == "sparse"
            self.rope_delta = layout.rope_delta(self.units, self.length + self.dropped_rows) + \
                self.dropped_rows
            self.ingest_s += (report["vision_ms"] + report["prefill_ms"]) / 1e3
            self._commit(layout, media, ns, rest, samples[used:])
        return report

    def _commit(self, layout, media: float, ns: int, rest, rest_samples) -> None:
        """The piece's media time and waiting frames (the mutex held: with its rows)."""
        self.layout = layout if self.layout is None else self.layout
        self.pending = rest if len(rest) else None
        self.pending_samples = rest_samples
        self.media_end += media
        self.next_sample = ns
        if self.first_piece_at is None:
            self.first_piece_at = time.time() - self.media_end
        self.pieces += 1

    def _piece_attention(self, rows: int, index: ModalityIndex) -> str:
        """"sparse" or "dense" for a piece of ``rows`` rows after which the stream's rows are
        ``index`` (see the module doc)."""
        if rows < self.sparse_min_tokens:
            return "dense"
        p = self.pipeline
        return choose_attention(self.mode, index.n, patterns=self.ad.patterns, index=index,
                                min_sparse_len=p.min_sparse_len, unavailable=p.sparse_unavailable)

    def _piece_bytes(self, kv, rows: int, new_len: int) -> tuple[int, int]:
        """Device bytes a piece of ``rows`` rows allocates at its peak, past what the stream
        already holds, and those of its embeddings: the larger buffers when the cache grows
        to ``new_len`` rows and its room (layer by layer, one layer's old buffer alive while
        its rows are copied), and the prefill's working memory for the piece's rows
        (Pipeline.prefill_bytes without their KV, which the buffers hold)."""
        pipe = self.pipeline
        per_row = pipe.kv_bytes_per_token
        cap = kv.capacity
        grow = 0
        if cap < new_len:
            grow = (new_len + kv.layers[0].headroom - cap) * per_row \
                + cap * per_row // max(len(kv.layers), 1)
        return grow + pipe.prefill_bytes(rows) - rows * per_row, pipe.embed_bytes(rows)

    def _check_room(self, layout, new_len: int, n_units: int) -> tuple[int, int]:
        """Room for the stream to hold ``new_len`` rows (``n_units`` units more) and a
        question's: ``(units to drop, rows the device budget leaves it)`` (the drop only with
        ``keep="window"``); else StreamFull (and the stream full) when they would pass the
        model's context or both byte budgets. Idle streams move to the host tier for it."""
        ad = self.ad
        window = self.keep == "window"
        ut = layout.unit_tokens
        drop = 0
        if new_len + QUESTION_ROOM > ad.max_context:
            if window:
                drop = -(-(new_len + QUESTION_ROOM - ad.max_context) // ut)
            if not window or drop > self.held_units:
                self._full(f"the stream would hold {new_len} tokens, and the model's context "
                           f"is {ad.max_context} (with {QUESTION_ROOM} kept for a question)",
                           tokens=new_len, limit=ad.max_context)
        if window:          # positions stay absolute: the next one must be in the model's
            units = self.units + n_units
            top = new_len + self.dropped_rows
            top += layout.rope_delta(units, top)
            if top + QUESTION_ROOM > ad.max_context:
                self._full(f"the stream's positions would reach {top}, and the model's "
                           f"context is {ad.max_context} (with {QUESTION_ROOM} kept for a "
                           "question)", position=top, limit=ad.max_context)
        bpt = self.pipeline.kv_bytes_per_token
        need = (new_len - drop * ut + QUESTION_ROOM) * bpt
        if self.registry is not None:
            budget = self.registry.make_room(self, need, force=window)
        else:
            budget = self.budget_bytes
        if budget is None:
            return drop, 1 << 62
        if need > budget and window:
            drop += -(-(need - budget) // (ut * bpt))
            need = (new_len - drop * ut + QUESTION_ROOM) * bpt
        if need > budget and not window and self.registry is not None and \
                self.registry.fits_when_idle(self, need):
            # the room is there once streams that questions read now are idle: this piece
            # waits for that (the client or the pull retries), the stream stays open
            raise StreamBusy(
                f"stream {self.id}: this piece needs {need} bytes of the streams' device "
                f"budget, {budget} are free and the rest is held by streams that questions are "
                f"reading; try again shortly", stream=self.id, bytes=need, limit=budget)
        if need > budget or drop > self.held_units:
            where = "the stream budget leaves it" if self.registry is None else \
                self.registry.budget_words()
            self._full(f"the stream's KV cache would need {need} bytes, over the {budget} "
                       f"bytes {where}", bytes=need, limit=budget)
        return drop, budget // bpt

    def _drop(self, layout, units: int) -> None:
        """The oldest ``units`` units (after the head) out of the cache (keep="window"; no
        fork reads the rows: :meth:`_rows_moving`)."""
        rows = units * layout.unit_tokens
        self.kv.cut(len(layout.head_ids), rows)
        self.length -= rows
        self.dropped_units += units
        self.dropped_rows += rows
        self.rope_delta += rows           # the rows after them keep their positions
        del self.unit_samples[:units]
        if self.registry is not None:
            self.registry.counts["dropped_units"] += units

    def _full(self, why: str, **details):
        self.state, self.reason = FULL, why
        raise StreamFull(f"stream {self.id} is full and takes no more video: {why}",
                         stream=self.id, **details)

    # ------------------------------------------------------------ questions
    def ask(self, question: str | None = None, *, conversation: Conversation | None = None,
            max_new_tokens: int = 32, sampling_params=None, on_token=None, turn=None,
            cancel=None) -> AnswerResult:
        """The answer to ``question`` (or the last user turn of ``conversation``, whose turns
        before the video are the stream's) over everything the stream holds now: a
        mminfer.engine.pipeline.AnswerResult whose ``video`` says ``seen_until`` (media
        time) and ``cache`` is "stream"."""
        t0 = time.perf_counter()
        timer = StageTimer(self.pipeline.device)
        gen, seen = self.generate(question, conversation=conversation,
                                  max_new_tokens=max_new_tokens,
                                  sampling_params=sampling_params, on_token=on_token,
                                  turn=turn, cancel=cancel, timer=timer)
        ms = timer.totals_ms()
        ms["ttft"] = (gen.first_token_s - t0) * 1e3
        ms["total"] = (time.perf_counter() - t0) * 1e3
        timings = {k: round(ms.get(k, 0.0), 3) for k in PIPELINE_STAGES}
        n, visual, length = gen.prefill_tokens, seen["visual_tokens"], seen["tokens"]
        return AnswerResult(
            answer=gen.text, model=self.pipeline.model_id,
            attention="sparse" if self.sparse_pieces else "dense",
            attention_requested=self.mode,
            video={"stream": self.id, "frames": seen["frames"], "sampled_fps": self.fps,
                   "seen_until": seen["seen_until"], "media_seconds": seen["media_seconds"],
                   **({"seen_from": seen["seen_from"]} if "seen_from" in seen else {})},
            tokens={"total": n, "visual": visual, "text": n - visual, "prefix": length,
                    "generated": len(gen.token_ids), "cached": length},
            sparsity=None, timings_ms=timings, cache="stream",
            finish_reason=gen.finish_reason, logprobs=gen.logprobs)

    def generate(self, question: str | None = None, *, conversation=None,
                 max_new_tokens: int = 32, sampling_params=None, on_token=None, turn=None,
                 cancel=None, timer=None):
        """The question's mminfer.models.base.Generated (its prompt's last logits too) and
        what it saw: ``{"frames", "tokens", "visual_tokens", "seen_until",
        "media_seconds"}`` and, once a window dropped frames, ``seen_from`` (the media time of
        the oldest frame held). Arguments as :meth:`ask`."""
        if conversation is None:
            conv = Conversation.single(check_request(question, self.fps, 1, max_new_tokens,
                                                     None, None, "dense"))
        else:
            conv = conversation.validate()
            check_request(conv.question, self.fps, 1, max_new_tokens, None, None, "dense")
        if self.state == CLOSED:
            raise StreamClosed(f"stream {self.id} is closed", stream=self.id)
        ad = self.ad
        turn = turn if turn is not None else Solo()
        turn.timer = timer

        def check():
            return turn.checkpoint() or (cancel is not None and bool(cancel()))

        def decode_check():
            if turn.kind != DECODE:
                turn.decoding()
            return check()

        if not turn.acquire():
            raise Cancelled("request cancelled while waiting for the model")
        fork, seen, rope_delta = self._fork(turn, max_new_tokens)
        try:
            suffix = self.layout.question_embeds(conv)
            _check_context(seen["tokens"] + suffix.shape[1], seen["visual_tokens"],
                           max_new_tokens, ad.max_context)
            if check():
                raise Cancelled("request cancelled before the question's prefill")
            gen = ad.continue_on(fork, suffix, rope_delta=rope_delta,
                                 max_new_tokens=max_new_tokens, cancel=decode_check,
                                 on_token=on_token, timer=timer,
                                 sampling_params=sampling_params,
                                 stepper=self.pipeline._stepper(turn))
        finally:
            del fork                  # its own rows go; the stream's are untouched
            self._unfork()
        with self._mutex:
            self.questions += 1
        return gen, seen

    # ------------------------------------------------------------ the end
    def close(self, turn=None) -> None:
        """Ends the stream: no more pieces or questions; its cache is freed once the piece or
        question in progress (if any) ends."""
        turn = turn if turn is not None else Solo()
        self.state, self.reason = CLOSED, "deleted"
        with self._hold(turn):
            self.kv = None
            self.pending = None


class Streams:
    """The live streams of one pipeline, sharing ``budget_bytes`` of the device (every byte
    their caches hold there; None: the video cache's device budget) and ``host_bytes`` of
    pinned host memory the least recently used idle streams move to (0: none; see the module
    doc). Each belongs to a tenant: another tenant's stream is not found."""

    def __init__(self, pipeline, budget_bytes: int | None = None, max_streams: int = 64,
                 host_bytes: int = 0):
        self.pipeline = pipeline
        if budget_bytes is None:
            budget_bytes = pipeline.video_cache.gpu_budget
        self.budget_bytes = int(budget_bytes)
        self.host_budget_bytes = max(int(host_bytes or 0), 0)
        self.max_streams = int(max_streams)
        self._streams: dict[str, Stream] = {}
        # guards the list and the tiers' accounting; a spill copies under it (as the video
        # cache's does), so two streams never plan on the same free bytes
        self._lock = threading.Lock()
        self.counts = dict(created=0, deleted=0, pieces=0, refused=0, questions=0, spills=0,
                           restores=0, dropped_units=0)

    def create(self, *, fps: float = 2.0, options: PrepareOptions | None = None,
               tenant: str | None = None, stream_id: str | None = None, **kw) -> Stream:
        """A new stream of this registry (``stream_id``: a name the caller chose, else a new
        one); ``kw``: the Stream's ``mode`` and ``sparse_min_tokens``."""
        with self._lock:
            if len(self._streams) >= self.max_streams:
                raise StreamFull(f"this server holds {self.max_streams} streams at most; "
                                 "delete one first", limit=self.max_streams)
            if stream_id is not None and stream_id in self._streams:
                raise InputError(f"a stream {stream_id!r} exists already", stream=stream_id)
            s = Stream(self.pipeline, fps=fps, options=options, tenant=tenant, registry=self,
                       stream_id=stream_id, **kw)
            self._streams[s.id] = s
            self.counts["created"] += 1
            return s

    def get(self, stream_id: str, tenant: str | None = None) -> Stream:
        with self._lock:
            s = self._streams.get(str(stream_id))
        if s is None or s.tenant != tenant:
            raise StreamNotFound(f"no stream {stream_id!r}", stream=str(stream_id))
        return s

    def delete(self, stream_id: str, tenant: str | None = None, turn=None) -> Stream:
        s = self.get(stream_id, tenant)
        with self._lock:
            self._streams.pop(s.id, None)
            self.counts["deleted"] += 1
        s.close(turn)
        return s

    def list(self, tenant: str | None = None) -> list[Stream]:
        with self._lock:
            return [s for s in self._streams.values() if s.tenant == tenant]

    def all(self) -> list[Stream]:
        """Every tenant's streams."""
        with self._lock:
            return list(self._streams.values())

    def _bytes(self, tier: Tier, but: Stream | None = None) -> int:
        return sum(s.held_bytes for s in self._streams.values()
                   if s.tier is tier and s is not but)

    def make_room(self, stream: Stream, need: int, force: bool = False) -> int:
        """Device bytes the budget can give ``stream`` (held by its caller) once the least
        recently used idle streams there (no piece or question in progress) have moved to the
        host tier, as many as it takes for
        ``need`` bytes and as fit there (``stream``'s own host copy counted as gone: it is
        coming back). Nothing moves unless that makes ``need`` fit, or ``force``."""
        pin = self.pipeline.device.type == "cuda"
        with self._lock:
            dev, plan, freed = self._moves(stream, need, idle_only=True)
            if dev + need <= self.budget_bytes:
                return self.budget_bytes - dev
            if not force and dev - freed + need > self.budget_bytes:
                return max(self.budget_bytes - dev, 0)
            for s in plan:
                if not s._try_hold(unforked=True):        # taken meanwhile: it stays
                    continue
                try:
                    held = s.held_bytes
                    if s.kv is not None and s.tier is Tier.GPU:
                        s._spill(pin)
                        dev -= held
                        self.counts["spills"] += 1
                except Exception as err:    # noqa: BLE001 - no host memory: it stays put
                    log.warning("stream %s: moving it to the host failed (%s)", s.id, err)
                finally:
                    s._release()
            return max(self.budget_bytes - dev, 0)

    def fits_when_idle(self, stream: Stream, need: int) -> bool:
        """Whether ``need`` device bytes for ``stream`` would fit once every other stream on
        the device were idle and moved to the host tier as far as it has room: what the
        streams in use hold now is held only for a while."""
        with self._lock:
            dev, _, freed = self._moves(stream, need, idle_only=False)
            return dev - freed + need <= self.budget_bytes

    def _moves(self, stream: Stream, need: int, idle_only: bool) -> tuple[int, list, int]:
        """(Lock held.) The other streams' device bytes, and the streams to move to the host
        tier for ``need`` bytes (least recently used first, as far as the host tier has
        room; ``idle_only``: none in use) with the bytes that frees."""
        others = [s for s in self._streams.values()
                  if s is not stream and s.tier is Tier.GPU and s.kv is not None]
        dev = sum(s.held_bytes for s in others)
        host = self._bytes(Tier.HOST, but=stream)
        plan, freed = [], 0
        for s in sorted(others, key=lambda s: s.used_at):
            if dev - freed + need <= self.budget_bytes:
                break
            size = s.kv.bytes_at(s.length)            # on the host: its rows alone
            idle = s._holder is None and not s._forks
            if (idle or not idle_only) and host + size <= self.host_budget_bytes:
                plan.append(s)
                host += size
                freed += s.held_bytes
        return dev, plan, freed

    def budget_words(self) -> str:
        """The budgets a full stream passed, for its error."""
        if self.host_budget_bytes:
            return (f"the streams' device budget leaves it with the idle streams moved to "
                    f"the host tier as far as its {self.host_budget_bytes} bytes take them "
                    "(--stream-kv-gb, --stream-host-kv-gb)")
        return "the streams' device budget leaves it (--stream-kv-gb; no host tier)"

    def stats(self) -> dict:
        with self._lock:
            streams = list(self._streams.values())
        recent = [r for s in streams for r in s.recent]
        tokens = sum(r["tokens"] for r in recent)
        secs = sum(r["vision_ms"] + r["prefill_ms"] for r in recent) / 1e3
        return {**self.counts, "active": len(streams),
                "full": sum(s.state == FULL for s in streams),
                "windowed": sum(s.keep == "window" for s in streams),
                "tokens": sum(s.length for s in streams),
                "bytes": sum(s.held_bytes for s in streams),
                "gpu_bytes": sum(s.held_bytes for s in streams if s.tier is Tier.GPU),
                "host_bytes": sum(s.held_bytes for s in streams if s.tier is Tier.HOST),
                "budget_bytes": self.budget_bytes, "host_budget_bytes": self.host_budget_bytes,
                "ingest_tokens_per_s": round(tokens / secs, 1) if secs > 0 else None,
                "max_lag_seconds": max((s.status()["lag_seconds"] or 0.0 for s in streams),
                                       default=0.0)}
