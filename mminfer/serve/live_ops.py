"""The streams of the process that holds the model: what serve/live.py asks of them, as calls a
model worker's job runs (``call(pipeline, turn, cancel)``).

Every operation on a stream is a module-level function turned into a job's call with
``functools.partial``, so it pickles: on one server the model worker runs it; under
``--data-parallel`` it goes down the pipe to the engine process that holds the stream
(dp_engine.py) and runs there. Each process keeps its streams in a :class:`Live` (one per
pipeline, kept on it: ``attach``), which also pulls live sources (:class:`Pull`) and counts what the
streams took in for /metrics and /report (``report``).

Pull mode: a stream created with a ``source`` is fed by a thread of its own that reads the
source through a process of its own (mminfer.video.live.open_source: a crafted source that
crashes or hangs the demuxer or decoder takes that process down, never the server) and
submits each piece to the model worker as a job
(without a queue place of a request: when the queue is full it waits and tries again). Its
state: connecting, reading, ended (the source ended), failed (``error`` says why: it could not
be opened or read, it stalled past the timeout, its reading process died or hung, a piece was
refused), full (the stream's budget
or context), stopped (the stream was deleted).
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time

from mminfer.engine.streams import FULL, Streams
from mminfer.errors import (InputError, MMInferError, QueueFull, StreamBusy, StreamClosed,
                            StreamFull, VideoError, WorkerDead)
from mminfer.models.base import PrepareOptions
from mminfer.video.live import open_source

from .metrics import PIECE_BUCKETS
from .worker import Job

log = logging.getLogger("mminfer.serve")

PULL_PIECE_S = 2.0          # media (or wall) seconds a pulled piece covers
PULL_RETRY_S = 0.5          # the queue was full, or the streams' room busy: try again then

_LOCK = threading.Lock()
# the attribute of the pipeline its Live is kept in: it lives and dies with the model
ATTR = "_mminfer_live"


def attach(pipeline, worker, budget_bytes: int | None = None, source_timeout_s: float = 10.0,
           host_bytes: int = 0):
    """The pipeline's :class:`Live` (made on first use with the worker that runs its jobs;
    ``budget_bytes`` and ``host_bytes``: the streams' device and host tiers)."""
    with _LOCK:
        live = getattr(pipeline, ATTR, None)
        if live is None:
            live = Live(pipeline, worker, budget_bytes, source_timeout_s, host_bytes)
            setattr(pipeline, ATTR, live)
        return live


def live_of(pipeline) -> "Live":
    live = getattr(pipeline, ATTR, None)
    if live is None:
        raise WorkerDead("live streams are not set up on this model worker")
    return live


class Live:
    def __init__(self, pipeline, worker, budget_bytes, source_timeout_s, host_bytes=0):
        self.streams = Streams(pipeline, budget_bytes, host_bytes=host_bytes)
        self.worker = worker
        self.source_timeout_s = source_timeout_s
        self.pulls: dict[str, Pull] = {}
        self._lock = threading.Lock()
        self.piece_buckets = [0] * (len(PIECE_BUCKETS) + 1)
        self.piece_sum_s = 0.0
        self.tokens_ingested = 0

    def observe_piece(self, report: dict):
        s = (report.get("vision_ms", 0.0) + report.get("prefill_ms", 0.0)) / 1e3
        with self._lock:
            self.piece_buckets[bisect.bisect_left(PIECE_BUCKETS, s)] += 1
            self.piece_sum_s += s
            self.tokens_ingested += int(report.get("tokens", 0))
            self.streams.counts["pieces"] += 1

    def status(self, stream) -> dict:
        st = stream.status()
        pull = self.pulls.get(stream.id)
        st["source"] = pull.status() if pull is not None else None
        return st

    def report(self) -> dict:
        """What this process's streams hold and did: ``stats`` (counts, bytes, ingest rate,
        lag, the pieces' time histogram) and ``streams`` (each one's status and tenant)."""
        streams = self.streams.all()
        stats = self.streams.stats()
        with self._lock:
            stats.update(piece_buckets=list(self.piece_buckets),
                         piece_sum_s=round(self.piece_sum_s, 6),
                         tokens_ingested=self.tokens_ingested,
                         pulling=sum(p.state in ("connecting", "reading")
                                     for p in self.pulls.values()))
        return {"stats": stats, "streams": [{**self.status(s), "tenant": s.tenant}
                                            for s in streams]}


# ------------------------------------------------------------------ the operations

def create(stream_id, fps, min_pixels, max_pixels, tenant, source, attention, keep, pipeline,
           turn, cancel):
    """A new stream (``source``: a URL or path the server may read, pulled from now on;
    ``attention``: its pieces', None for the server's; ``keep``: "all" or "window")."""
    live = live_of(pipeline)
    s = live.streams.create(fps=fps, tenant=tenant, stream_id=stream_id, mode=attention,
                            keep=keep,
                            options=PrepareOptions(min_pixels=min_pixels,
                                                   max_pixels=max_pixels))
    if source is not None:
        pull = live.pulls[s.id] = Pull(live, s, source)
        pull.start()
    return live.status(s)


def append(stream_id, tenant, path, start, pipeline, turn, cancel):
    """A pushed piece (a file) appended: ``(piece report, stream status)``."""
    live = live_of(pipeline)
    s = live.streams.get(stream_id, tenant)
    if stream_id in live.pulls:
        raise InputError(f"stream {stream_id} is fed by its source; it takes no pushed "
                         "pieces", stream=stream_id)
    try:
        report = s.append_file(path, start=start, turn=turn, cancel=cancel)
    except (VideoError, StreamFull, StreamBusy) as e:
        s.refused(e)
        live.streams.counts["refused"] += 1
        raise
    live.observe_piece(report)
    return report, live.status(s)


def append_frames(stream_id, tenant, frames, media_end, next_sample, pipeline, turn, cancel):
    """A pulled piece (decoded frames) appended; its report."""
    live = live_of(pipeline)
    s = live.streams.get(stream_id, tenant)
    report = s.append_frames(frames, media_seconds=max(media_end - s.media_end, 0.0),
                             next_sample=next_sample, turn=turn, cancel=cancel)
    live.observe_piece(report)
    return report


def ask(stream_id, tenant, question, conversation, max_new_tokens, sampling_params, pipeline,
        turn, cancel, on_token=None):
    """The answer (an AnswerResult) over what the stream holds now."""
    live = live_of(pipeline)
    s = live.streams.get(stream_id, tenant)
    result = s.ask(question, conversation=conversation, max_new_tokens=max_new_tokens,
                   sampling_params=sampling_params, on_token=on_token, turn=turn,
                   cancel=cancel)
    live.streams.counts["questions"] += 1
    return result


def delete(stream_id, tenant, pipeline, turn, cancel):
    live = live_of(pipeline)
    s = live.streams.get(stream_id, tenant)          # another tenant's: not found
    pull = live.pulls.pop(s.id, None)
    if pull is not None:
        pull.stop()
    live.streams.delete(stream_id, tenant, turn)
    return {"id": s.id, "object": "stream", "deleted": True}


def report(pipeline) -> dict | None:
    live = getattr(pipeline, ATTR, None)
    return live.report() if live is not None else None


def call(fn, *args):
    """``fn(*args, pipeline, turn, cancel)`` as a job's call (it pickles)."""
    return functools.partial(fn, *args)


# ------------------------------------------------------------------ pull mode

class Pull:
    """The thread that reads a stream's source and appends its pieces (see the module doc)."""

    def __init__(self, live: Live, stream, source: str):
        self.live, self.stream, self.source = live, stream, source
        self.state = "connecting"
        self.error: dict | None = None
        self.pieces = 0
        self.reader = open_source(source, stream.fps, piece_seconds=PULL_PIECE_S,
                                  timeout_s=live.source_timeout_s)
        self._stop = threading.Event()
        self._job: Job | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mminfer-pull-{stream.id}")

    def start(self):
        self.thread.start()

    def stop(self):
        self._stop.set()
        if self.state in ("connecting", "reading"):
            self.state = "stopped"
        self.reader.close()
        job = self._job
        if job is not None:
            job.cancel(StreamClosed(f"stream {self.stream.id} was deleted",
                                    stream=self.stream.id))

    def status(self) -> dict:
        s = self.stream
        behind = None
        if s.first_piece_at is not None and self.state in ("connecting", "reading"):
            behind = round(max(0.0, time.time() - s.first_piece_at - s.seen_until), 3)
        return {"url": self.source, "state": self.state, "pieces": self.pieces,
                "frames_read": self.reader.frames_read,
                "frames_out_of_order": self.reader.backwards,
                "lag_seconds": behind, "error": self.error}

    def _run(self):
        try:
            for piece in self.reader.pieces(self._stop):
                if self.state == "connecting":
                    self.state = "reading"
                if not len(piece.frames):
                    continue
                self._append(piece)
                self.pieces += 1
            if not self._stop.is_set():
                self.state = "ended"
        except StreamFull as e:
            self._fail("full", e)
        except MMInferError as e:
            self._fail("stopped" if self._stop.is_set() else "failed", e)
        except Exception as e:  # noqa: BLE001 - a bug: the stream says so, the server lives
            log.exception("stream %s: reading its source failed", self.stream.id)
            self._fail("failed", MMInferError(f"internal error reading the source "
                                              f"({type(e).__name__})"))
        finally:
            self.reader.close()            # its process ends with the read

    def _fail(self, state: str, e: MMInferError):
        self.state = state
        if state != "stopped":
            self.error = e.to_dict()
            if self.stream.state != FULL:
                self.stream.refused(e)

    def _append(self, piece):
        fn = call(append_frames, self.stream.id, self.stream.tenant, piece.frames,
                  piece.media_end, piece.next_sample)
        while True:
            job = Job(video_path="", question="", params={"stream_id": self.stream.id},
                      request_id=f"pull-{self.stream.id}", call=fn)
            try:
                self.live.worker.submit(job)
            except QueueFull:
                if self._stop.wait(PULL_RETRY_S):
                    raise StreamClosed(f"stream {self.stream.id} was deleted",
                                       stream=self.stream.id) from None
                continue
            self._job = job
            try:
                return job.future.result()
            except StreamBusy:      # the room comes back when the questions end: retry
                if self._stop.wait(PULL_RETRY_S):
                    raise StreamClosed(f"stream {self.stream.id} was deleted",
                                       stream=self.stream.id) from None
            finally:
                self._job = None
