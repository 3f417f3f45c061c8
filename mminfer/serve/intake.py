"""Receiving request bodies without letting a client hold the server.

Bodies being received are counted (at most ``max_concurrent_uploads`` at once; one more is
answered 503 before its body is read), and each must arrive within a deadline and, once past
a grace period, at a minimum average rate: a client trickling a byte every ten seconds is
answered 408 after the grace period, and its temp file removed, instead of holding a queue
slot and a file for as long as it likes.
"""

from __future__ import annotations

import asyncio
import time

from mminfer.errors import TooManyUploads, UploadTooSlow


class Intake:
    """The uploads in progress; all calls come from the event loop (no lock)."""

    def __init__(self, max_concurrent: int, deadline_s: float, min_bytes_per_s: float,
                 grace_s: float):
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self.deadline_s = deadline_s
        self.min_bytes_per_s = min_bytes_per_s
        self.grace_s = grace_s
        self.active = 0

    def begin(self) -> "UploadPlace":
        if self.active >= self.max_concurrent:
            raise TooManyUploads(f"{self.active} uploads are in progress, this server's limit; "
                                 f"retry later", max_concurrent_uploads=self.max_concurrent)
        self.active += 1
        return UploadPlace(self)

    def timed(self, source):
        return timed(source, deadline_s=self.deadline_s, min_bytes_per_s=self.min_bytes_per_s,
                     grace_s=self.grace_s)


class UploadPlace:
    """One upload's place among the concurrent ones; ``end`` it when the body is in."""

    def __init__(self, intake: Intake):
        self.intake = intake
        self.open = True

    def end(self):
        if self.open:
            self.open = False
            self.intake.active -= 1


async def timed(source, *, deadline_s: float, min_bytes_per_s: float, grace_s: float):
    """The chunks of ``source`` (an async iterator of bytes), raising UploadTooSlow when the
    whole has not arrived within ``deadline_s`` or when, past ``grace_s``, fewer than
    ``min_bytes_per_s`` bytes per second have arrived on average. Each wait is bounded by
    the moment the next of those would fail, so the refusal comes on time even while no byte
    arrives."""
    start = time.monotonic()
    n = 0
    it = source.__aiter__()
    while True:
        now = time.monotonic()
        rate_ok_until = start + max(grace_s, n / min_bytes_per_s if min_bytes_per_s > 0
                                    else float("inf"))
        until = min(start + deadline_s, rate_ok_until)
        try:
            chunk = await asyncio.wait_for(it.__anext__(), max(until - now, 0.0))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            elapsed = time.monotonic() - start
            if until >= start + deadline_s:
                raise UploadTooSlow(f"the request body did not arrive within this server's "
                                    f"upload deadline of {deadline_s:g} s ({n} bytes in "
                                    f"{elapsed:.1f} s)", deadline_s=deadline_s,
                                    received_bytes=n) from None
            raise UploadTooSlow(f"the request body arrives slower than this server's minimum "
                                f"of {min_bytes_per_s / 1024:g} KiB/s ({n} bytes in "
                                f"{elapsed:.1f} s)", min_bytes_per_s=min_bytes_per_s,
                                received_bytes=n) from None
        n += len(chunk)
        yield chunk
