"""Turns on the model for many requests at once: short work passes a long prefill between its
layers, and a paused prefill resumes exactly where it stopped.

Every request runs ``Pipeline.answer`` in a thread of its own, and holds a :class:`Turn`. Only
the thread holding the scheduler's one turn touches the model (the GPU, the video cache's
bookkeeping, the Triton interpreter). Work has natural boundaries where a request checks for
cancellation anyway — before every decoder layer of a prefill, between chunks of frames in the
vision tower, before the question's rows, before every decode step — and there
(``Turn.checkpoint``) the holder may hand the turn to someone else and wait to get it back.
A paused prefill keeps its Python frame, its residual stream, its plans and the K/V written so
far; nothing is copied or recomputed, and it resumes with the same operations in the same
order, so its answer is bit for bit the one it gives alone.

Work comes in three classes:

* ``FIRST``: a request's work up to its first token that is not a long prefill — the cache
  lookup, a restore from the host tier, the question's rows over a cached prefix. Short, and
  what a user waits on: it goes first, oldest first.
* ``DECODE``: a decode step (one generated token) of an answer in progress.
* ``LONG``: building a video's prefix (video decoding, vision, the prefix's prefill). One
  request at a time is *admitted* to do this (two halve each other on one GPU, and a paused one
  keeps its memory: a second would need room for both); the others wait for admission in
  arrival order.

The policy, between steps: with no long prefill waiting to resume, FIRST work runs first, then
decode steps (round robin). When the admitted long prefill pauses at a layer boundary, the FIRST
work that was already waiting when it paused runs (work arriving later waits for the next
boundary — so the prefill is never starved, and a cache hit waits at most one layer of it),
then decode steps for up to ``decode_share`` of the time (in proportion to the prefill's last
step), then the prefill resumes.

``IDLE`` work (self-calibration's steps, serve/selfcal.py) runs only while no request holds a
turn at all, and pauses at its checkpoints as soon as one does: it keeps its frame and resumes
where it stopped once every request has gone, so a long calibration step is not thrown away by
each cache hit or follow-up question between its layers. A paused step still holds its memory,
so a long prefill admitted to build a prefix (or a stream's piece) whose room check comes up
short, or a request out of memory (``evict_idle``), first makes the paused idle work give up:
it unwinds, its memory freed, before the prefill goes on, and runs again from its start later.
Where the room check cannot measure the device (the CPU), every long prefill makes it give up
at its start. A Triton compilation inside idle work's launch (seconds of host work, no GPU, no
checkpoint possible) is a pause too: the turn is handed over as it starts and taken back, as
idle work, once it ends (mminfer.kernels.compiles' listeners).

Decode steps go together: an answer's step (``Turn.decode``) joins the batch of pending
steps and gives the turn up; whichever of them is granted the turn first waits for the other
answers in their decode phase to join (they come back within microseconds of their last token,
and the last one wakes it; ``gather_s`` bounds the wait for one that is late), runs every
pending step as one batched step (the caller's ``run``: one pass of the decoder layers over all
of them, attention per answer over its own cache), hands each its result, waking only those
answers, and gives the turn back. A batch of one is an answer decoding alone, on its own path.

Time spent waiting for others before the first token is reported as a stage of its own
(``wait``): the turn records a gap in the request's StageTimer, which subtracts it from the
sections that were open (on CUDA, events recorded on the stream where the request left off and
where it resumed measure the others' work in between).

A request asked to stop while it waits returns at once, without the turn: it unwinds (freeing
its tensors, leaving the cache) while another request may run, which touches nothing shared
but the cache, whose bookkeeping has its own lock.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from mminfer.errors import Cancelled
from mminfer.kernels import compiles

FIRST, DECODE, LONG, IDLE = "first", "decode", "long", "idle"


def device_drain(device):
    """What a turn does at each of its step boundaries while it holds the model: on a GPU,
    keep the host at most one step ahead of the device. The host runs ahead of the GPU: a
    dense prefill or a calibration step queues many layers without waiting, so a boundary
    that looked at once would hand the turn to a request whose kernels then queue behind all
    of them. A self-calibration step did that on an H100 (requests waited up to 15 s for it:
    TTFT 2.67x dense's; with a full synchronize at each check, 1.04x). Each call records an
    event on the caller's stream and waits for the previous call's: the step before this one
    is done, this one stays queued, so the GPU is never left idle while the host prepares the
    next step (a full synchronize at every layer would leave it idle that long). Per thread:
    each request runs on its own. Copies on a stream of their own go on. On a CPU the work
    is done when the call returns: nothing to wait for."""
    if getattr(device, "type", device) != "cuda":
        return lambda: None
    last = threading.local()

    def drain():
        prev = getattr(last, "event", None)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        last.event = ev
        if prev is not None:
            prev.synchronize()
    return drain


# per thread: the idle turn it runs (Turn.idle), and the one handed over for a compilation
_here = threading.local()


def _compile_started() -> None:
    """A Triton compilation starts in this thread (mminfer.kernels.compiles): idle work that
    holds the turn here hands it over for it. A compilation is seconds of host work (LLVM,
    ptxas) inside one launch, where no checkpoint can be, and touches no GPU; requests waited
    for a calibration step's (17 of 2-8 s on an H100: TTFT up to 3.16x dense's). Triton's
    compile hooks run in the launching thread around a synchronous compilation; its async
    compile mode (never entered here) would end the compilation on another thread."""
    t = getattr(_here, "idle", None)
    if t is not None and t.held and not t.closed and t.kind == IDLE:
        t._hand_over_for_compile()
        _here.compiling = t


def _compile_done() -> None:
    """The compilation ended: the idle work takes the turn back before its launch runs, or
    stops (Cancelled) if it was evicted or asked to stop meanwhile."""
    t = getattr(_here, "compiling", None)
    if t is None:
        return
    _here.compiling = None
    if not t._back_from_compile():
        raise Cancelled("idle work stopped while a kernel compiled")


compiles.add_listener(_compile_started, _compile_done)


class Scheduler:
    """The one turn on the model. ``decode_share``: the fraction of the GPU's time decode steps
    get while an admitted long prefill waits to resume (FIRST work is not limited: it is
    bounded by what arrived before the prefill paused)."""

    def __init__(self, decode_share: float = 0.25, poll_s: float = 0.05,
                 gather_s: float = 0.002, max_batch: int = 64, drain=None):
        if not 0.0 <= decode_share < 1.0:
            raise ValueError(f"decode_share must be in [0, 1), not {decode_share}")
        self.decode_share = decode_share
        # at every step boundary of the turn's holder (device_drain: the GPU's queue)
        self.drain = drain or (lambda: None)
        self.poll_s = poll_s
        self.gather_s = gather_s                 # how long a batch waits for its answers
        self.max_batch = max_batch
        self._pending: dict[Turn, int] = {}      # decode steps waiting for a batch -> seq
        self.batches = 0                         # batched decode steps run
        self.batched_steps = 0                   # answers' steps in them
        # one lock; each turn waits on a condition of its own over it, so a wake-up reaches
        # the threads it concerns (a batch's answers, the turn granted), not every waiter
        self._lock = threading.RLock()
        self._gathering: Turn | None = None      # the turn gathering a decode batch
        self.gather_timeouts = 0                 # batches that waited all of gather_s
        self._holder: Turn | None = None
        self._granted_at = 0.0
        self._waiting: dict[Turn, int] = {}      # turn -> seq when it began to wait
        self._long: Turn | None = None           # the admitted long prefill
        self._admission: list[Turn] = []         # waiting to be admitted, arrival order
        self._turns: set[Turn] = set()
        self._seq = itertools.count()
        self._idle_gone = threading.Condition(self._lock)   # idle work closed (evict_idle)
        self._round = 0                          # FIRST work older than this runs before LONG
        self._short_used = 0.0
        self._short_allow = 0.0
        self.switches = 0                        # turns handed from one request to another
        self.idle_pauses = 0                     # idle work paused for requests
        self.idle_evictions = 0                  # paused idle work made to give up its memory
        self.idle_compiles = 0                   # turns idle work handed over to compile

    # ------------------------------------------------------------ requests
    def turn(self, name: str = "", stop=None) -> "Turn":
        """A new request's turn (not yet holding it: ``acquire`` first). ``stop()`` (True:
        the request was asked to stop) is checked while it waits."""
        return Turn(self, name, stop)

    def evict_idle(self, timeout_s: float = 10.0) -> int:
        """Make paused (or waiting) idle work give up and wait, up to ``timeout_s``, for it to
        unwind (its memory freed). The caller must not hold the turn in a way the idle work
        needs: it unwinds without the turn. Returns how many idle turns were told to go."""
        with self._lock:
            idle = [t for t in self._turns if t.kind == IDLE and not t.closed]
            if not idle:
                return 0
            for t in idle:
                if not t.evicted:
                    t.evicted = True
                    self.idle_evictions += 1
                t._cond.notify()
            end = time.perf_counter() + timeout_s
            while any(not t.closed for t in idle):
                left = end - time.perf_counter()
                if left <= 0:
                    break
                self._idle_gone.wait(left)
        return len(idle)

    def state(self) -> dict:
        """Counts for /health and /metrics."""
        with self._lock:
            turns = list(self._turns)
            held = self._holder
        paused = sum(1 for t in turns if t.kind == LONG and t is not held)
        return {"active": sum(1 for t in turns if t.kind != IDLE),
                "idle": sum(1 for t in turns if t.kind == IDLE),
                "idle_pauses": self.idle_pauses, "idle_evictions": self.idle_evictions,
                "idle_compiles": self.idle_compiles,
                "prefilling": sum(1 for t in turns if t.kind == LONG),
                "paused": paused,
                "decoding": sum(1 for t in turns if t.kind == DECODE),
                "waiting_admission": len(self._admission),
                "switches": self.switches,
                "decode_batches": self.batches,
                "decode_batched_steps": self.batched_steps,
                "decode_gather_timeouts": self.gather_timeouts}

    def wake(self):
        """Someone was asked to stop: let waiting threads look."""
        with self._lock:
            for t in self._turns:
                t._cond.notify()

    # ------------------------------------------------------------ the choice (under the lock)
    def _pick(self) -> "Turn | None":
        w = self._waiting
        if not w:
            return None
        long = self._long if self._long in w else None
        first = [t for t in w if t.kind == FIRST]
        decode = [t for t in w if t.kind == DECODE]
        if long is not None:
            due = [t for t in first if t.arrival < self._round]
            if due:
                return min(due, key=lambda t: t.arrival)
            if decode and self._short_used < self._short_allow:
                return min(decode, key=w.get)
            return long
        if first:
            return min(first, key=lambda t: t.arrival)
        if decode:
            return min(decode, key=w.get)
        idle = [t for t in w if t.kind == IDLE]
        if not idle or self._requests_present():
            return None
        return min(idle, key=w.get)

    def _requests_present(self) -> bool:
        """(Under the lock.) A request has a turn, held or not: idle work may not run."""
        return any(t.kind != IDLE and not t.closed for t in self._turns)

    def _grant(self):
        """(Under the lock, nobody holding.) Give the turn to the next one, if any."""
        t = self._pick()
        if t is None:
            return
        del self._waiting[t]
        self._holder = t
        self._granted_at = time.perf_counter()
        t._cond.notify()

    def _step_done(self, t: "Turn", now: float):
        """(Under the lock, ``t`` holding.) ``t`` reached a step boundary: when it is the long
        prefill, the FIRST work waiting now is due before it goes on, and decode steps get
        their share of the step it just ran; other work's time is counted against that
        share."""
        if t is self._long:
            held = now - self._granted_at
            self._round = next(self._seq)
            self._short_used = 0.0
            share = self.decode_share
            self._short_allow = held * share / (1.0 - share) if share else 0.0
        elif self._long is not None:        # short work's time counts while it goes on
            self._short_used += now - self._granted_at
        self._granted_at = now

    def _leave_holder(self, t: "Turn", now: float):
        """(Under the lock.) ``t`` stops holding: account for its time."""
        if t is not self._long and self._long is not None:
            self._short_used += now - self._granted_at
        self._holder = None

    def _admit(self):
        """(Under the lock.) The next long prefill, if none is admitted."""
        while self._long is None and self._admission:
            t = self._admission.pop(0)
            if t.closed:
                continue
            self._long = t
            self._new_round()
            t._cond.notify()

    def _new_round(self):
        """(Under the lock.) A prefill was admitted: the FIRST work waiting now goes before its
        first step; decode gets its share once the prefill has run a step."""
        self._round = next(self._seq)
        self._short_used = 0.0
        self._short_allow = 0.0

    def _wait_for_turn(self, t: "Turn") -> bool:
        """(Under the lock, ``t`` in the waiting set.) Block until ``t`` holds the turn (True),
        or it is asked to stop (False: it left the set)."""
        while self._holder is not t:
            if t.stopping():
                self._waiting.pop(t, None)
                if self._holder is None:
                    self._grant()
                return False
            if self._holder is None:
                self._grant()
                if self._holder is not None:
                    continue
            t._cond.wait(self.poll_s)          # idle work waits here while requests run
        return True

    def _batch_ready(self) -> bool:
        """(Under the lock.) Every answer in its decode phase waits: its step pending, or it
        waits for the turn at a step boundary (it cannot come before the batch has run); or
        the batch is full. A batch gathered now waits for nobody."""
        if len(self._pending) >= self.max_batch:
            return True
        return all(t in self._pending or t in self._waiting
                   for t in self._turns if t.kind == DECODE and not t.closed)

    def _poke_gatherer(self):
        """(Under the lock.) The set of pending or decoding answers changed: the turn gathering
        a batch runs it now if nobody else is to come."""
        g = self._gathering
        if g is not None and self._batch_ready():
            g._cond.notify()


class Turn:
    """One request's place with the scheduler. Not thread-safe: used by its request's thread.

    ``acquire()`` (as FIRST work) before touching the model; ``checkpoint()`` at every step
    boundary; ``long()`` around building a prefix; ``decoding()`` before the decode steps;
    ``close()`` at the end (any state). ``timer``: the request's StageTimer, for ``wait``."""

    def __init__(self, sched: Scheduler, name: str = "", stop=None):
        self.sched = sched
        self.name = name
        self._stop = stop
        self.kind = FIRST
        self.arrival = next(sched._seq)
        self.held = False
        self.held_since: float | None = None
        self.closed = False
        self.timer = None
        self.wait_s = 0.0                   # waited for others, before its first token
        self.waits = 0
        self._first_token = False
        self._item, self._result, self._error = None, _NONE, None
        self._in_batch = False              # its step is in a batch being run
        self.evicted = False                # idle work told to give up (Scheduler.evict_idle)
        self.pauses = 0                     # idle work: times it paused for requests
        self._cond = threading.Condition(sched._lock)     # this turn's wake-ups
        with sched._lock:
            sched._turns.add(self)

    # ------------------------------------------------------------ state
    def stopping(self) -> bool:
        return self.evicted or (self._stop is not None and bool(self._stop()))

    def first_token(self):
        """Waits from now on are part of generating the answer, not of its first token."""
        self._first_token = True

    # ------------------------------------------------------------ taking and giving
    def acquire(self) -> bool:
        """Wait for the turn as FIRST work; False if asked to stop meanwhile."""
        return self._enter(FIRST)

    def idle(self) -> bool:
        """Wait for the turn as IDLE work (granted only while no request has a turn); False if
        asked to stop or evicted meanwhile. The calling thread is the work's: a compilation
        in it hands the turn over (:func:`_compile_started`)."""
        _here.idle = self
        return self._enter(IDLE)

    def _hand_over_for_compile(self) -> None:
        """(Idle work holding the turn, a compilation starting in its thread.)"""
        s = self.sched
        with s._lock:
            s._leave_holder(self, time.perf_counter())
            s.idle_compiles += 1          # not a switch: the turn may go to nobody
            self.held = False
            s._grant()

    def _back_from_compile(self) -> bool:
        """The compilation ended: the turn again, as idle work (once no request has one);
        False if evicted or asked to stop meanwhile."""
        with self.sched._lock:
            return self._queue_for_turn()

    def _enter(self, kind: str) -> bool:
        s = self.sched
        gap = self._gap_start()
        with s._lock:
            self.kind = kind
            s._poke_gatherer()              # an answer that stops decoding is not waited for
            ok = self._queue_for_turn()
        self._gap_end(gap)
        return ok

    def _queue_for_turn(self) -> bool:
        """(Under the lock.) Join the waiting and block until this turn holds the model (True)
        or is asked to stop (False)."""
        s = self.sched
        s._waiting[self] = next(s._seq)
        if s._holder is None:
            s._grant()
        ok = s._wait_for_turn(self)
        self.held = ok
        self.held_since = time.perf_counter() if ok else None
        return ok

    def checkpoint(self) -> bool:
        """A step boundary: hand the turn over if the policy says so, and wait to get it back.
        Returns True when the request was asked to stop (then it may not hold the turn)."""
        if self.stopping():
            return True
        if not self.held:
            return False
        self.sched.drain()       # what it queued runs now, not ahead of whoever comes next
        if self.kind == IDLE:
            return self._idle_checkpoint()
        s = self.sched
        with s._lock:
            now = time.perf_counter()
            s._step_done(self, now)
            if not s._waiting:
                return False
            s._waiting[self] = next(s._seq)
            # would the policy pick someone else?
            nxt = s._pick()
            if nxt is self:
                del s._waiting[self]
                return False
            s._leave_holder(self, now)
            s.switches += 1
            self.held = False
            gap = self._gap_start()
            s._grant()
            ok = s._wait_for_turn(self)
        self.held = ok
        self.held_since = time.perf_counter() if ok else None
        self._gap_end(gap)
        return not ok

    def _idle_checkpoint(self) -> bool:
        """Idle work's step boundary: go on while no request has a turn; else pause (the turn
        handed over, the frame kept) until every request has gone. True: stop (asked to, or
        evicted while paused)."""
        s = self.sched
        with s._lock:
            if not s._requests_present():
                return False
            s._leave_holder(self, time.perf_counter())
            s.switches += 1
            s.idle_pauses += 1
            self.pauses += 1
            self.held = False
            s._grant()
            ok = self._queue_for_turn()
        return not ok

    def long(self, room_checked: bool = False) -> "_Phase":
        """``with turn.long():`` — building a prefix: admitted as the one long prefill (waiting
        for the one before to finish), paused at its checkpoints by the policy; afterwards FIRST
        work again (its question's rows come right after). Paused idle work gives up its
        memory at the start, unless ``room_checked``: the work measures the device's free
        memory before it allocates and evicts idle work only when that comes up short
        (VideoCache.make_room), so a calibration step paused by a new video resumes after it
        instead of running again from its start."""
        return _Phase(self, room_checked)

    def _begin_long(self) -> bool:
        s = self.sched
        with s._lock:
            if s._long is None and not s._admission:
                s._long = self
                s._new_round()
                self.kind = LONG
                return True
            s._admission.append(self)
            s._admit()
        if s._long is self:
            self.kind = LONG
            return True
        # another prefill is admitted: give the turn up until this one is
        gap = self._gap_start()
        with s._lock:
            if s._holder is self:
                s._leave_holder(self, time.perf_counter())
                s.switches += 1
            self.held = False
            s._grant()
            while s._long is not self:
                if self.stopping():
                    if self in s._admission:
                        s._admission.remove(self)
                    self._gap_end(gap)
                    return False
                self._cond.wait(s.poll_s)
            self.kind = LONG
            ok = self._queue_for_turn()
        self._gap_end(gap)
        return ok

    def _end_long(self):
        s = self.sched
        with s._lock:
            if s._long is self:
                s._long = None
                s._admit()
            if self.kind == LONG:
                self.kind = FIRST

    def decoding(self):
        """From here on, the request's steps are decode steps."""
        self.kind = DECODE
        self.first_token()

    def decode(self, item, run):
        """One decode step of this answer, batched with the other answers' pending steps:
        ``run(items) -> results`` (one per item, in order) runs a batch. Returns this answer's
        result; raises what ``run`` raised, or Cancelled when asked to stop while waiting."""
        s = self.sched
        gap = self._gap_start()
        with s._lock:
            self.kind = DECODE
            self._first_token = True
            self._item, self._result, self._error = item, _NONE, None
            now = time.perf_counter()
            if self.held and s._holder is self:
                s._step_done(self, now)
                s._leave_holder(self, now)
                self.held = False
            s._pending[self] = next(s._seq)
            s._waiting[self] = s._pending[self]
            if s._holder is None:
                s._grant()
            else:
                s._poke_gatherer()
            while True:
                if self._result is not _NONE or self._error is not None:
                    break
                if s._holder is self:
                    break
                # asked to stop: leave, unless a batch in flight holds this answer's cache (it
                # must not be released under that step: the result comes in microseconds)
                if self.stopping() and not self._in_batch:
                    s._pending.pop(self, None)
                    s._waiting.pop(self, None)
                    if s._holder is None:
                        s._grant()
                    self._gap_end(gap)
                    raise Cancelled("request cancelled while waiting for its decode step")
                # in a running batch, the batch's end wakes it (and nothing else may): no
                # polling that would take the GIL from the thread launching the step
                self._cond.wait(None if self._in_batch else s.poll_s)
            if s._holder is self and self._result is _NONE and self._error is None:
                batch = self._gather()
            else:
                batch = None
        if batch is not None:
            self.held = True
            error, results = None, None
            try:
                results = run([t._item for t in batch])
            except BaseException as e:     # noqa: BLE001 - each answer raises it
                error = e
            with s._lock:
                s.batches += 1
                s.batched_steps += len(batch)
                for i, t in enumerate(batch):
                    t._in_batch = False
                    if error is not None:
                        t._error = error
                    else:
                        t._result = results[i]
                    t._cond.notify()
                now = time.perf_counter()
                s._leave_holder(self, now)
                s.switches += 1
                self.held = False
                s._grant()
        self._gap_end(gap)
        # the step's state goes with the step: its item holds the answer's cache, an error
        # the frames of the batch that raised it. Left on the turn (which the request's job
        # and its stop check keep in a reference cycle), a finished request's cache outlived
        # it until a full garbage collection: on an H100, eight 115K-token caches (52 GB)
        # that the video cache had dropped long before, and a request out of memory
        result, error = self._result, self._error
        self._item, self._result, self._error = None, _NONE, None
        batch = results = None
        if error is not None:
            try:
                raise error
            finally:            # this frame is in its traceback: no cycle through its locals
                error = None
        return result

    def _gather(self) -> list:
        """(Under the lock, holding the turn.) The batch: every pending decode step, after
        waiting up to ``gather_s`` for the answers in their decode phase to be pending."""
        s = self.sched
        end = time.perf_counter() + s.gather_s
        s._gathering = self
        try:
            while not s._batch_ready():
                left = end - time.perf_counter()
                # the last answer to come back wakes this one (Scheduler._poke_gatherer); a
                # window that ran out counts even if that answer came back meanwhile
                if left <= 0 or not self._cond.wait(left):
                    s.gather_timeouts += 1
                    break
        finally:
            s._gathering = None
        batch = sorted(s._pending, key=s._pending.get)[:s.max_batch]
        if self not in batch:
            batch = [self] + batch[:-1]
        for t in batch:
            s._pending.pop(t, None)
            s._waiting.pop(t, None)
            t._in_batch = True
        return batch

    def wait_for(self, event, own: bool = False) -> None:
        """Wait for ``event`` (another request's work: the build of the prefix this one needs,
        its question on the entry this one reads) with the turn given to others meanwhile;
        holds the turn again on return. Raises Cancelled when asked to stop meanwhile.
        ``own``: the event is this request's own work done off the turn (its room's copies
        to the host): the time stays in the sections open now instead of ``wait``."""
        s = self.sched
        gap = None if own else self._gap_start()
        with s._lock:
            if s._holder is self:
                now = time.perf_counter()
                s._step_done(self, now)
                s._leave_holder(self, now)
                s.switches += 1
                s._grant()
            self.held = False
        try:
            while not event.wait(s.poll_s):
                if self.stopping():
                    raise Cancelled("request cancelled while waiting for another request's "
                                    "work on its video")
            with s._lock:
                ok = self._queue_for_turn()
            if not ok:
                raise Cancelled("request cancelled while waiting for the model")
        finally:
            self._gap_end(gap)

    def close(self):
        """The request is done (answered, failed or stopped): give everything back."""
        s = self.sched
        with s._lock:
            self.closed = True
            self._item, self._result, self._error = None, _NONE, None    # (decode's note)
            s._pending.pop(self, None)
            s._waiting.pop(self, None)
            if self in s._admission:
                s._admission.remove(self)
            if s._long is self:
                s._long = None
                s._admit()
            if s._holder is self:
                s._leave_holder(self, time.perf_counter())
            self.held = False
            s._turns.discard(self)
            if s._holder is None:
                s._grant()
            s._poke_gatherer()
            if self.kind == IDLE:
                s._idle_gone.notify_all()
        if getattr(_here, "idle", None) is self:
            _here.idle = None

    # ------------------------------------------------------------ the wait stage
    def _gap_start(self):
        if self._first_token or self.timer is None:
            return None
        return self.timer.mark()

    def _gap_end(self, start):
        if start is None:
            return
        self.waits += 1
        self.wait_s += self.timer.gap(start)


_NONE = object()


class _Phase:
    def __init__(self, turn: Turn, room_checked: bool):
        self.turn, self.room_checked = turn, room_checked

    def __enter__(self):
        if not self.turn._begin_long():
            raise Cancelled("request cancelled while waiting to build its video's prefix")
        if not self.room_checked:          # the prefix needs room: paused idle work goes
            self.turn.sched.evict_idle()
        return self.turn

    def __exit__(self, *exc):
        self.turn._end_long()
        return False


class Solo:
    """The turn of a request that has the model to itself (the CLI, a video's first question
    in the batch job, benchmarks): every call is free and nothing is ever handed over."""
    kind = FIRST
    timer = None
    held = True
    wait_s = 0.0
    waits = 0

    def __init__(self, stop=None):
        self._stop = stop

    def stopping(self) -> bool:
        return self._stop is not None and bool(self._stop())

    def acquire(self) -> bool:
        return True

    def checkpoint(self) -> bool:
        return self.stopping()

    def long(self, room_checked: bool = False):
        return _SoloPhase()

    def decoding(self):
        pass

    def wait_for(self, event, own: bool = False):
        while not event.wait(0.05):
            if self.stopping():
                raise Cancelled("request cancelled while waiting")


class _SoloPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
