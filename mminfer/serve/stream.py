"""Answers streamed as server-sent events (``text/event-stream``), as OpenAI and vLLM send them.

The worker thread makes the tokens; the event loop sends them. ``TokenFeed`` is the
``on_token`` the pipeline calls on the worker thread: each text piece crosses to the loop with
``call_soon_threadsafe`` (in order, and before the job's future completes: both go through the
same call queue). The route waits for the first token with the service's usual wait (the
deadline and a client leaving stop the job; every error until then is a JSON answer with its
status), then hands back a ``StreamReply``:

    one ``data: {...}`` event per chunk the route's ``chunks`` object builds (its first,
    then one per text piece, then its last ones with the finished answer), ``data: [DONE]``

An error after the first event (the job failed, the deadline passed, the server is shutting
down) is sent as an ``data: {"error": ...}`` event, then ``[DONE]``. A client that leaves
mid-stream is seen by Starlette, which cancels the response; closing it stops the job as a
disconnect does before the answer (worker.Job.cancel), so the worker is free again. However
the stream ends, the request is released and recorded once, with the status it would have
been answered with (200, 499, 504, ...).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.responses import StreamingResponse

from mminfer.errors import ClientGone, MMInferError

from .errors import describe, error_body

log = logging.getLogger("mminfer.serve")

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


class TokenFeed:
    """``on_token(text, token_id)`` for Pipeline.answer, called on the worker thread; the
    pieces arrive on the event loop in ``queue``; ``first`` is done at the first token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first = loop.create_future()
        self.signal = loop.create_future()       # done when something arrived since taken
        self.tokens = 0                          # calls with a token (not the final flush)

    def __call__(self, text: str, token_id):
        try:
            self.loop.call_soon_threadsafe(self._put, text, token_id, time.monotonic())
        except RuntimeError:        # the loop is closed: nobody is listening any more
            pass

    def _put(self, text, token_id, t):
        if token_id is not None:
            self.tokens += 1
        self.queue.put_nowait(text)
        if not self.first.done():
            self.first.set_result(t)
        if not self.signal.done():
            self.signal.set_result(None)

    def take(self) -> list[str]:
        """Every piece that arrived, in order; re-arms ``signal``."""
        out = []
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        if self.signal.done():
            self.signal = self.loop.create_future()
        return out


class EventStream(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however it ends (sent to the end, the
    client gone, the server stopping)."""

    def __init__(self, events, on_close, headers: dict | None = None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class StreamReply:
    """The streamed rest of a request whose first token exists. ``chunks`` builds the
    events: ``start()`` (a dict), ``delta(text)``, ``end(result, timings)`` (a list)."""

    def __init__(self, svc, req, endpoint: str, job, fut, feed: TokenFeed, chunks,
                 upload_ms: float):
        self.svc, self.req, self.endpoint = svc, req, endpoint
        self.job, self.fut, self.feed, self.chunks = job, fut, feed, chunks
        self.upload_ms = upload_ms
        self.outcome: tuple[int, dict] | None = None
        self._closed = False

    def response(self, headers: dict) -> EventStream:
        return EventStream(self._events(), self._close, headers)

    async def _events(self):
        svc, req, feed = self.svc, self.req, self.feed
        yield sse(self.chunks.start())
        while True:
            for text in feed.take():
                if text:
                    yield sse(self.chunks.delta(text))
            if self.fut.done():
                break
            left = req.deadline - time.monotonic()
            if left <= 0:
                err = svc.timeout_error(self.job)
                stop_job(self.job, self.fut, err)
                for event in self._error(err):
                    yield event
                return
            await asyncio.wait({self.fut, feed.signal}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)
        for text in feed.take():        # what arrived with the end (the final flush)
            if text:
                yield sse(self.chunks.delta(text))
        try:
            result = self.fut.result()
        except MMInferError as e:
            for event in self._error(e):
                yield event
            return
        except Exception as e:  # noqa: BLE001 - a bug, not bad input: the service lives on
            log.error("request %s failed while streaming", req.id, exc_info=e)
            self.outcome = (500, {"code": "internal"})
            yield sse(error_body("internal", f"internal error: {type(e).__name__}: {e}", 500,
                                 request_id=req.id))
            yield DONE
            return
        timings = svc.timings(result, self.job, self.upload_ms, req.arrival)
        self.outcome = (200, {"result": result, "timings": timings})
        for chunk in self.chunks.end(result, timings):
            yield sse(chunk)
        yield DONE

    def _error(self, e: MMInferError):
        status, code, body = describe(e, self.req.path, self.req.label)
        body["error"]["request_id"] = self.req.id
        body["error"]["status"] = status            # no HTTP status says it any more
        self.outcome = (status, {"code": code})
        yield sse(body)
        yield DONE

    def _close(self):
        if self._closed:
            return
        self._closed = True
        if self.outcome is None:        # the client left (or the server dropped the stream)
            stop_job(self.job, self.fut,
                  ClientGone("the client disconnected while the answer was streaming"))
            self.outcome = (499, {"code": "client_disconnected"})
        self.req.release()
        status, info = self.outcome
        self.svc.finish(self.req.id, self.endpoint, status, info, self.req.arrival,
                        tenant=self.req.tenant)


def stop_job(job, fut, reason: MMInferError):
    """Stop a job nobody will wait for: dropped from the queue or asked to stop."""
    job.cancel(reason)
    fut.add_done_callback(_quiet)


def _quiet(fut):
    """Collect an abandoned future's exception so asyncio does not log it as unretrieved."""
    if not fut.cancelled():
        fut.exception()
