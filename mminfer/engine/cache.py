"""The video cache: a video's prefix, prefilled once, answers every later question about it.

An entry is the KV cache of a prompt's prefix (everything up to and including the video:
mminfer.models.base.Conversation) plus what a suffix needs to continue it (the prefix length,
the M-RoPE offset, the prefix's ModalityIndex) and what the answer reports of the video. Its
key (:class:`PrefixKey`) is the video's content hash and everything that changes the prefix's
tokens or values: the model and its revision, dtype, what the KV cache stores (the model's
dtype or FP8: ``--kv-cache-dtype``), the sampling (fps, max_frames, start, end), the pixel
budget, the attention mode and its threshold, the head-pattern config, the quantization of
the linear layers (fp8 or none), and the turns before the video. A changed byte, model or
config is another key: a miss, never a stale hit. An FP8 entry holds half of bf16's bytes
and moves between the tiers as it is.

Memory: an entry is charged every byte it keeps (``PrefixKV.held_bytes``: its rows, the FP8
scales and, on the device, its tail: ``tail_rows`` rows of room past them, at most
mminfer.models.kv.TAIL_ROWS; built and restored with it, spilled to the host without it).
An entry's rows are read only: every question about it, its builder's too, forks it
(mminfer.models.kv.ForkKV: the prefix's rows shared). One of them at a time claims the tail
and writes its question's and answer's rows there in place, so that lone reader decodes over
a cache in one piece (the split attention over two segments is slower); the others write
theirs into buffers of the request's own. So any number of questions read one entry at
once and none changes its bytes or rows. So the tensors of idle entries stay within
``gpu_bytes`` and ``host_bytes``; a request being answered outside the tail holds its own
question's and answer's rows on top until it ends, and a prefix being built or restored has
its room reserved (other entries spilled) before it is kept or moved in. An entry is pinned
while read, so one whose tail is claimed is never moved.

Tiers (vLLM's v1 KV offload, at entry granularity): entries live on the model's device within
``gpu_bytes`` (``--kv-cache-gb``); the least recently used spill to pinned host memory within
``host_bytes`` (``--kv-host-cache-gb``; 0: no host tier, they are dropped) and come back on a
hit. A move is all or nothing (``PrefixKV.move``): a restore that fails (out of memory, an
interrupt) leaves the entry on the host, counted and evictable, for a later hit to restore;
a spill that fails for want of host memory drops the entry, and one that is interrupted
leaves it on the device.

Requests (threads): every lookup holds a :class:`Lease` for the block of :meth:`VideoCache.use`.
An entry being read is pinned (never moved or evicted) by each of its readers, who read it
at once (several questions on one video decode in the same batched steps); of the readers of
an entry on the host, one restores it and the others wait for that. A miss registers a
:class:`PendingBuild`; another request for the key waits for it
(:meth:`VideoCache.wait_for_build`) and then reads the kept entry, or builds it itself if the
first build failed, was cancelled or was not kept: ten first requests for one video cost one
prefill. Every wait goes through :meth:`VideoCache.wait`, which a scheduler overrides to give
its GPU turn away while it waits. One lock guards the bookkeeping; no lock is held while a
prefix is built or restored from the host, nor while a spill copies: the entries that a
built or restored prefix puts over the device budget are copied to the host on a thread of
their own, off the budget from the moment they leave (a restore waits for them only when the
device's free memory cannot take it meanwhile). A prefill that needs the memory asks
:meth:`VideoCache.make_room` first: idle entries are copied to the host on a thread of their
own, with no lock held and the turn given away (other questions are answered meanwhile; a
question about an entry on its way waits for it, then restores it; the copies may go on
behind the vision tower, the prefill waiting for them), and while the room is still short
and other requests are in the cache (their entries pinned, their own rows held), it waits a
bounded time for them to end. Only a finished prefix is kept: a cancelled or
failed prefill leaves nothing behind.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from mminfer.models.kv import PrefixKV, tail_rows
from mminfer.sparse.modality import ModalityIndex

log = logging.getLogger(__name__)

# Default GPU budget: this share of the device's memory (H200: 70 of 141 GB, room for one
# 1M-token LongVILA-7B prefix, 60 GB, beside the 16 GB of weights; a new long prefill first
# spills what it needs room for: make_room); on the CPU, 2 GiB.
GPU_SHARE = 0.5
CPU_DEFAULT_BYTES = 2 << 30
# A prefill's working memory past the estimate its caller gives (Pipeline.prefill_bytes):
# the allocator's rounding and fragmentation, the sparse plans, small temporaries.
PREFILL_MARGIN = 0.10
# how often a plain wait looks up from its event (an interrupt lands within this)
WAIT_POLL_S = 0.1

_digests: dict = {}
_digest_lock = threading.Lock()


def file_digest(path) -> str:
    """sha256 of the file's bytes, hex. Memoised by the file's identity and change stamps
    (device, inode, size, mtime and ctime in ns): any write through the filesystem changes
    ctime, which no user can set back, so a changed file is hashed again."""
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
             st.st_ctime_ns)
    with _digest_lock:
        hit = _digests.get(stamp)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    with _digest_lock:
        if len(_digests) > 4096:
            _digests.clear()
        _digests[stamp] = digest
    return digest


def cache_key(**parts) -> str:
    """A key from named parts (JSON-able values): sorted, so their order never matters."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class PrefixKey:
    """Everything a prefix's KV cache depends on: its :meth:`digest` is the cache's key. A
    field that changes the prefix's tokens or values and is missing here is a stale hit."""
    # the pipeline
    model: str
    revision: str | None
    adapter: str
    dtype: str                  # the model's
    kv_cache: str               # what the cache stores: the model's dtype or FP8
    quantization: str | None    # of the linear layers
    device: str
    sampling: str               # the adapter's frame-sampling rule
    frame_limit: int | None     # frames the model takes at most
    patterns: str | None        # digest of the head-pattern config (and its calibrated flag)
    min_sparse_len: int         # where "auto" goes sparse
    # the request
    video: str                  # sha256 of the bytes
    fps: float
    max_frames: int
    start: float | None
    end: float | None
    mode: str                   # attention: auto | sparse | dense
    options: dict               # PrepareOptions: the pixel budget
    turns: str                  # digest of the turns before the video
    # the tenant's or request's cache_salt (vLLM's): entries are shared only under one salt
    salt: str | None = None

    def digest(self) -> str:
        return cache_key(**asdict(self))


class Tier(str, enum.Enum):
    GPU = "gpu"       # the model's device (its memory: the GPU's, or the CPU's on a CPU)
    HOST = "host"     # pinned host memory, brought back to the device on a hit


@dataclass(frozen=True)
class PrefixFacts:
    """What an answer reports of the prefix it continued, known once it is built."""
    attention: str              # what its prefill ran: "sparse" or "dense"
    visual_tokens: int
    video: dict                 # frames, sampled_fps, fps, duration, width, height, sha256, ...


@dataclass(eq=False)
class Entry:
    """A prefix ready to be continued: ``kv`` holds its ``length`` rows, read only (each
    question forks it: mminfer.models.kv.ForkKV)."""
    kv: PrefixKV | None                # None once evicted
    length: int                        # prefix tokens
    rope_delta: int                    # position of token i after the video: i + rope_delta
    index: ModalityIndex               # of the prefix
    facts: PrefixFacts
    # its sparse prefill's density, counted by its builder after its answer (never in the
    # time to first token) and before it is kept
    sparsity: dict | None = None
    tier: Tier = Tier.GPU
    nbytes: int = 0                    # what it is charged: kv.held_bytes, kept current
    readers: set[Lease] = field(default_factory=set, repr=False)     # leases pinning it
    # set while one of its readers brings it back from the host (the others wait for it)
    restoring: threading.Event | None = field(default=None, repr=False)
    # set while make_room copies it to the host with no lock held (a reader waits for it)
    moving: threading.Event | None = field(default=None, repr=False)


@dataclass(eq=False)
class PendingBuild:
    """A prefix one request is building; ``done`` is set when its lease ends (``kept``: the
    entry is in the cache now; else a waiter builds it itself)."""
    key: str
    done: threading.Event = field(default_factory=threading.Event)
    kept: bool = False


class Lease:
    """What :meth:`VideoCache.use` yields, for its block: ``entry`` (None on a miss until
    :meth:`store`), ``status`` ("hit", "host", "miss" or "off"), ``restore_ms`` and
    ``wait_ms`` (waiting for another request's build or restore of this prefix)."""

    def __init__(self, cache: VideoCache | None, key: str | None, status: str = "off"):
        self.cache, self.key, self.status = cache, key, status
        self.entry: Entry | None = None
        self.built = False                    # store()d: kept when the block ends
        self.pending: PendingBuild | None = None
        self.restore_ms = self.wait_ms = 0.0
        self.reserved = 0                     # device bytes reserved for this lease's entry

    def store(self, entry: Entry) -> None:
        """The prefix this request built: it continues it now, and it is kept under the key
        when the block ends (within the budget; its room is made now)."""
        self.entry, self.built = entry, True
        if self.cache is not None:
            self.cache._reserve_built(self, entry)


class VideoCache:
    def __init__(self, device, gpu_bytes: int | None = None, host_bytes: int = 0):
        self.device = torch.device(device)
        if gpu_bytes is None:
            if self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                gpu_bytes = int(total * GPU_SHARE)
            else:
                gpu_bytes = CPU_DEFAULT_BYTES
        self.gpu_budget = max(int(gpu_bytes), 0)
        self.host_budget = max(int(host_bytes), 0)
        self._entries: OrderedDict[str, Entry] = OrderedDict()   # LRU first
        self._pending: dict[str, PendingBuild] = {}
        # leases holding device room for a prefix they built or restore (a set: releasing is
        # idempotent, whatever interrupts it)
        self._reserving: set[Lease] = set()
        self._lock = threading.RLock()
        self._in_use = 0                      # requests inside use() (leases open)
        self._room_waiters: set[threading.Event] = set()   # make_room: set when one leaves
        self._host_moving = 0                 # host bytes of the entries make_room copies now
        self._copying: set[threading.Event] = set()   # those copies' done events
        self.counts = dict(queries=0, hits=0, host_hits=0, misses=0, evictions_gpu=0,
                           evictions_host=0, inserted=0, rejected=0, build_waits=0,
                           room_waits=0, tail_reads=0, idle_spills=0, spilled_bytes=0,
                           spill_seconds=0.0)

    @property
    def _reserved(self) -> int:
        """Device bytes reserved for prefixes being built or restored."""
        return sum(lease.reserved for lease in self._reserving)

    # ------------------------------------------------------------ waiting
    def wait(self, event: threading.Event, own: bool = False) -> None:
        """Block until ``event`` is set: every wait of the cache (for another request's build
        of a prefix, or its restore from the host; ``own``: for the copies of the request's
        own room) goes through here. A plain ``Event.wait`` loop; a scheduler whose requests
        take turns on the GPU overrides it to give its turn away while it waits (else the
        request it waits for cannot run). It may raise (a cancelled request): the lease is
        then released as on any error."""
        while not event.wait(WAIT_POLL_S):
            pass

    def release_idle(self) -> int:
        """Ask idle-time work that holds device memory (a paused self-calibration step) to
        give it up, and wait for it; returns how many were asked. :meth:`make_room` calls it
        when the device is short, before it spills entries; a scheduler overrides it
        (Scheduler.evict_idle). Without one there is no such work."""
        return 0

    @property
    def measures_room(self) -> bool:
        """Whether :meth:`make_room` can measure the device's free memory (CUDA), so it can
        tell when paused idle work must give its memory up."""
        return self.device.type == "cuda"

    def wait_for_build(self, pending: PendingBuild) -> None:
        """Until the build of ``pending.key`` another request runs has ended (kept or not)."""
        self.wait(pending.done)

    # ------------------------------------------------------------ reading
    @property
    def enabled(self) -> bool:
        return self.gpu_budget > 0

    @contextmanager
    def use(self, key: str | None):
        """The entry under ``key`` for the duration of the block, pinned (back on the device
        if it was on the host), read by this lease and any others at once; a miss yields a
        lease to :meth:`Lease.store` into. ``key`` None: the cache is off for this
        request."""
        with self._lock:
            self._in_use += 1
        try:
            if key is None or not self.enabled:
                yield Lease(None, None, "off")
                return
            lease = Lease(self, key)
            try:
                self._open(lease)
                yield lease
            finally:
                self._close(lease)
        finally:
            with self._lock:        # whoever waits for room looks again
                self._in_use -= 1
                for waiter in self._room_waiters:
                    waiter.set()

    def _open(self, lease: Lease) -> None:
        t0 = time.perf_counter()
        with self._lock:
            self.counts["queries"] += 1
        waited = False
        while True:
            with self._lock:
                entry = self._entries.get(lease.key)
                moving = entry.moving if entry is not None else None
                if entry is not None and moving is None:
                    # a set of leases, not a count: releasing is idempotent, so an interrupt
                    # anywhere in here leaves no pin behind (_close discards it)
                    lease.entry = entry
                    entry.readers.add(lease)
                    self._entries.move_to_end(lease.key)
                    break
                pending = self._pending.get(lease.key)
                if pending is None and moving is None:     # nobody builds it: this one does
                    lease.pending = PendingBuild(lease.key)
                    self._pending[lease.key] = lease.pending
                    lease.status = "miss"
                    self.counts["misses"] += 1
                    lease.wait_ms = (time.perf_counter() - t0) * 1e3
                    return
                if not waited and moving is None:
                    self.counts["build_waits"] += 1
                    waited = True
            if moving is not None:       # on its way to the host: then restored from there
                self.wait(moving)
                continue
            self.wait_for_build(pending)
        status = "hit"
        while True:        # on the host: one reader restores it, the others wait for that
            with self._lock:
                if entry.tier is not Tier.HOST:
                    break
                busy, mine = entry.restoring, entry.restoring is None
                if mine:
                    busy = entry.restoring = threading.Event()
            if not mine:       # restored by then, or failed: then this one tries
                self.wait(busy)
                continue
            t1 = time.perf_counter()
            try:
                self._restore(lease, entry)
            finally:
                with self._lock:
                    entry.restoring = None
                busy.set()
            lease.restore_ms = (time.perf_counter() - t1) * 1e3
            status = "host"
            break
        lease.wait_ms = (time.perf_counter() - t0) * 1e3 - lease.restore_ms
        with self._lock:
            self.counts["hits"] += 1
            self.counts["host_hits"] += status == "host"
        lease.status = status

    def _close(self, lease: Lease) -> None:
        entry = lease.entry
        with self._lock:
            try:
                if lease.built:
                    self._keep(lease)
            finally:
                self._reserving.discard(lease)
                lease.reserved = 0
                if entry is not None:
                    entry.readers.discard(lease)
                if lease.pending is not None:
                    if self._pending.get(lease.key) is lease.pending:
                        del self._pending[lease.key]
                    lease.pending.done.set()
            # a prefix just kept stays (the most recently used) even while the entries
            # still over the budget are pinned: they go when their leases end
            self._fit_gpu(self.gpu_budget, keep=entry if lease.built else None)

    # ------------------------------------------------------------ tiers
    def _reserve_built(self, lease: Lease, entry: Entry) -> None:
        """A built prefix's room on the device, made now (it is kept when its lease ends)."""
        with self._lock:
            need = entry.kv.held_bytes            # what it is charged once kept
            if need > self.gpu_budget:
                return                            # served, never kept: _keep says so
            lease.reserved = need
            self._reserving.add(lease)
            self._fit_gpu(self.gpu_budget)

    def _keep(self, lease: Lease) -> None:
        """A built entry into the cache (lock held)."""
        entry = lease.entry
        if entry.kv is None:
            return
        entry.tier, entry.nbytes = Tier.GPU, entry.kv.held_bytes
        if entry.nbytes > self.gpu_budget:
            self.counts["rejected"] += 1          # served, never kept: over the budget
            return
        old = self._entries.pop(lease.key, None)
        if old is not None and old is not entry and not old.readers:
            old.kv = None
        self._entries[lease.key] = entry
        self.counts["inserted"] += 1
        if lease.pending is not None:
            lease.pending.kept = True

    def _restore(self, lease: Lease, entry: Entry) -> None:
        """A host entry back on the device, its room made first. All or nothing: if the move
        raises, the entry is still on the host, counted there."""
        room = tail_rows(entry.length)            # the tail a lone reader writes in
        need = entry.kv.bytes_at(entry.length + room)
        with self._lock:
            lease.reserved = need
            self._reserving.add(lease)
            copying = self._fit_gpu(self.gpu_budget)
        if copying is not None:          # the device's memory, not only the budget: wait for
            free = self.free_bytes()     # the copies out when it is short of this entry
            if free is not None and free < need * (1 + PREFILL_MARGIN):
                self.wait(copying, own=True)
        entry.kv.move(self.device, headroom=room)
        with self._lock:
            entry.tier, entry.nbytes = Tier.GPU, entry.kv.held_bytes
            self._reserving.discard(lease)
            lease.reserved = 0
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _fit_gpu(self, budget: int, keep: Entry | None = None) -> threading.Event | None:
        """(Lock held.) Spill idle device entries (but ``keep``), least recently used first,
        until they and the room reserved for builds and restores hold at most ``budget``
        bytes: copied to the host on a thread of their own (:meth:`_copy_out`), off the
        budget from the moment they are on their way, so nobody waits for the copies here
        (a question about one waits for it, then restores it). Returns the copies' done
        event, None when nothing is copied."""
        over = self._bytes(Tier.GPU) - self._leaving() + self._reserved - budget
        if over <= 0:
            return None
        moves, _ = self._pick_spills(over, keep=keep)
        return self._copy_out(moves) if moves else None

    def _leaving(self) -> int:
        """(Lock held.) Device bytes of the entries on their way to the host."""
        return sum(e.nbytes for e in self._entries.values()
                   if e.moving is not None and e.tier is Tier.GPU)

    def _spill(self, key: str, e: Entry) -> None:
        """An idle device entry to the host tier (room made there, least recently used host
        entries first), else dropped (lock held)."""
        need = e.kv.bytes_at(e.length)            # the host copy holds the rows alone
        if self._host_room(need):
            t0 = time.perf_counter()
            try:
                e.kv.move("cpu", pin=self.device.type == "cuda")
            except Exception as err:      # no host memory for it: dropped instead
                log.warning("video cache: spilling %d bytes to the host failed (%s); "
                            "the entry is dropped", need, err)
            else:
                e.tier, e.nbytes = Tier.HOST, e.kv.held_bytes
                self.counts["evictions_gpu"] += 1
                self._spilled(need, time.perf_counter() - t0)
                return
        self._drop(key, e)
        self.counts["evictions_gpu"] += 1

    def _spilled(self, nbytes: int, seconds: float) -> None:
        """(Lock held.) A spill that landed on the host: counted, and logged with its time
        (pinned host memory is slow to allocate: /metrics has the totals)."""
        self.counts["spilled_bytes"] += nbytes
        self.counts["spill_seconds"] += seconds
        log.info("video cache: %.2f GiB spilled to the host in %.2f s", nbytes / 2**30,
                 seconds)

    @staticmethod
    def _idle(e: Entry) -> bool:
        """On the device, read by nobody, not on its way out: free to move or drop."""
        return e.tier is Tier.GPU and not e.readers and e.moving is None

    def _host_room(self, need: int) -> bool:
        """(Lock held.) Room for ``need`` bytes on the host tier, its least recently used
        entries dropped for it, beside the copies make_room has under way."""
        if need + self._host_moving > self.host_budget:
            return False
        self._fit_host(self.host_budget - need - self._host_moving)
        return self._bytes(Tier.HOST) + self._host_moving + need <= self.host_budget

    def _fit_host(self, budget: int) -> None:
        for key, e in list(self._entries.items()):
            if self._bytes(Tier.HOST) <= budget:
                break
            if e.tier is Tier.HOST and not e.readers:
                self._drop(key, e)
                self.counts["evictions_host"] += 1

    def _drop(self, key: str, e: Entry) -> None:
        del self._entries[key]
        e.kv = None

    def _bytes(self, tier: Tier) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.tier is tier)

    def make_room(self, need_bytes: int, wait_s: float = 0.0,
                  ahead_bytes: int | None = None) -> int:
        """Before a prefill that will hold ``need_bytes`` (its KV cache and working memory):
        spill idle entries, least recently used first, until the device has that much free
        (plus a margin) or none is left; copies to the host already on their way (this
        request's or another's) are waited for before more is spilled. While memory is still
        short and other requests are in the cache (their entries pinned, their own rows held),
        wait for one of them to end and try again, for up to ``wait_s`` seconds (through
        :meth:`wait`, so a scheduler gives the turn away meanwhile: the others finish their
        work). Returns the bytes still missing that other requests hold: 0 when there is room,
        on a device it cannot measure, or when nobody else holds memory (the prefill then
        runs, and fails out of memory by itself if it must).

        ``ahead_bytes``: what the work before the prefill needs (the vision tower: the
        embeddings and its activations). When the idle entries this call sends to the host
        cover the whole need, it returns as soon as that much is free and their copies go on
        meanwhile, overlapping that work; the call before the prefill, without it, waits for
        what is left of them.

        Paused idle work (a calibration step) that holds memory gives it up first, once the
        device is short (:meth:`release_idle`): a user's cached prefix outranks it."""
        want = int(need_bytes * (1 + PREFILL_MARGIN))
        ahead = None if ahead_bytes is None else int(ahead_bytes * (1 + PREFILL_MARGIN))
        deadline = time.monotonic() + wait_s
        rounds = None       # of spills: an entry a question brought back meanwhile is not
        idle_asked = False  # chased around forever
        while True:
            woken = threading.Event()      # a request leaving the cache, or the deadline
            copying, moves, ask_idle = None, None, False
            with self._lock:
                free = self.free_bytes()
                if free is None:
                    return 0
                if rounds is None:
                    rounds = len(self._entries) + 1
                short = want - free
                if short > 0 and self._copying:      # memory on its way out: wait for it
                    copying = next(iter(self._copying))
                elif short > 0 and not idle_asked:
                    ask_idle = idle_asked = True
                elif short > 0 and rounds > 0:
                    moves, freed = self._pick_spills(short)
                rounds -= moves is not None
                covered = moves is not None and freed >= short
                moved = [e.moving for _, e, _ in moves or ()]
                others = self._in_use > 1
                left = deadline - time.monotonic()
                if copying is None and moves is None and short > 0 and others and left > 0:
                    self._room_waiters.add(woken)
                    self.counts["room_waits"] += 1
            if copying is not None:
                self.wait(copying, own=True)
                continue
            if ask_idle:                   # no lock held: the idle work unwinds meanwhile
                self.release_idle()
                continue
            if moves is not None:          # entries dropped or on their way: measure again
                if moves:
                    done = self._copy_out(moves)
                    if ahead is not None and covered:
                        self._wait_free(ahead, moved)
                        return 0
                    self.wait(done, own=True)
                continue
            if woken not in self._room_waiters:
                if short > 0 and not others:
                    log.warning("video cache: %.2f GiB short of the %.2f GiB a prefill needs "
                                "and no other request holds memory; it runs anyway",
                                short / 2**30, want / 2**30)
                    return 0
                return max(short, 0)
            timer = threading.Timer(left, woken.set)
            timer.daemon = True
            timer.start()
            try:
                self.wait(woken)
            finally:
                timer.cancel()
                with self._lock:
                    self._room_waiters.discard(woken)

    def _wait_free(self, want: int, moved: list) -> None:
        """Until ``want`` bytes are free on the device or every entry whose ``moved`` event
        is listed has left it (one at a time, in the order they are copied)."""
        for event in moved:
            if self.free_bytes() >= want:
                return
            self.wait(event, own=True)

    def _pick_spills(self, short: int, keep: Entry | None = None) -> tuple[list | None, int]:
        """(Lock held.) Idle device entries (but ``keep``), least recently used first, until
        their bytes cover ``short``: each that fits the host tier is marked moving (its host
        room reserved) and listed as ``(key, entry, host bytes)``, any other dropped. Returns
        the list (None when no entry is idle) and the device bytes of all of them."""
        moves, freed, found = [], 0, False
        for key, e in list(self._entries.items()):
            if freed >= short:
                break
            if not self._idle(e) or e is keep:
                continue
            found = True
            freed += e.nbytes
            need = e.kv.bytes_at(e.length)
            if self._host_room(need):
                e.moving = threading.Event()
                self._host_moving += need
                moves.append((key, e, need))
            else:
                self._drop(key, e)
                self.counts["evictions_gpu"] += 1
        return (moves if found else None), freed

    def _copy_out(self, moves: list) -> threading.Event:
        """Start copying the entries :meth:`_pick_spills` marked to the host, on a thread of
        their own and with no lock held; returns the event set when all are done. The caller
        waits through :meth:`wait` (a scheduler gives its turn away: other requests'
        questions are answered meanwhile; pinning the host memory is most of a spill's time;
        the wait is the request's own, its ``room`` stage) or does its own work meanwhile
        (``make_room(ahead_bytes=)``). Each entry leaves the device once its copy is whole.
        A copy that fails drops its entry (no host memory) and the rest go on; a wait that
        raises (the request cancelled) leaves the thread to finish them."""
        done = threading.Event()
        with self._lock:
            self._copying.add(done)
        threading.Thread(target=self._copy_out_run, args=(moves, done), daemon=True,
                         name="mminfer-spill").start()
        return done

    def _copy_out_run(self, moves: list, done: threading.Event) -> None:
        cuda = self.device.type == "cuda"
        left = list(moves)
        try:
            stream = torch.cuda.Stream(self.device) if cuda else None
            while left:
                key, e, need = left[0]
                t0 = time.perf_counter()
                copies, err = None, None
                try:
                    if stream is not None:     # after the work queued on it so far
                        stream.wait_stream(torch.cuda.current_stream(self.device))
                        with torch.cuda.stream(stream):
                            copies = e.kv.copies("cpu", pin=True)
                        stream.synchronize()
                    else:
                        copies = e.kv.copies("cpu")
                except Exception as ex:        # noqa: BLE001 - no host memory: dropped
                    err = ex
                except BaseException as ex:    # noqa: BLE001 - interrupted: left where it is
                    log.warning("video cache: a spill to the host was interrupted (%r); the "
                                "entries stay on the device", ex)
                    break
                with self._lock:
                    self._host_moving -= need
                    kept = self._entries.get(key) is e and e.kv is not None
                    if kept and copies is not None:
                        e.kv.adopt("cpu", copies)
                        e.tier, e.nbytes = Tier.HOST, e.kv.held_bytes
                        self._spilled(need, time.perf_counter() - t0)
                    elif kept:
                        self._drop(key, e)
                    self.counts["evictions_gpu"] += kept
                    moved, e.moving = e.moving, None
                    left.pop(0)
                moved.set()
                if err is not None:
                    log.warning("video cache: spilling %d bytes to the host failed (%s); "
                                "the entry is dropped", need, err)
        finally:
            with self._lock:             # whatever stopped the loop: the rest stay where
                for _, e, need in left:  # they are, free again
                    self._host_moving -= need
                    moved, e.moving = e.moving, None
                    moved.set()
                self._copying.discard(done)
            done.set()

    def settle(self, timeout: float | None = None) -> bool:
        """Until no copy to the host is on its way (the spills that keep the device within its
        budget finish on their own; whoever needs them done, such as an operator's offload or
        a test reading the tiers, waits here). False if ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                copying = next(iter(self._copying), None)
            if copying is None:
                return True
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            copying.wait(left)

    def read_in_tail(self) -> None:
        """A question decodes in its entry's tail (ForkKV ``claim=True``): counted."""
        with self._lock:
            self.counts["tail_reads"] += 1

    def free_bytes(self) -> int | None:
        """Bytes new tensors can take on the device now: the driver's free memory once the
        allocator has handed back its wholly free segments. Free blocks inside segments still
        in use are not counted: fragments that a large tensor cannot use (measured on an H100:
        10 GB reserved past the allocated, and a 1.85 GB allocation failing). None where it
        cannot be measured (the CPU)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

    def spill_idle(self) -> int:
        """Move every idle device entry off the device (to the host tier where it fits, else
        dropped) and hand the allocator's free segments back; returns the device bytes the
        entries held. What a request that ran out of memory gets before it runs again: the
        room check before a prefill counts free memory, but an allocation can still fail
        where freed blocks lie in pieces a large tensor cannot use. Copies already on their
        way are waited for first (their memory is not free until they land)."""
        self.settle()
        with self._lock:
            idle = [(k, e) for k, e in self._entries.items() if self._idle(e)]
            freed = sum(e.nbytes for _, e in idle)
            for key, e in idle:
                self._spill(key, e)
            if idle:
                self.counts["idle_spills"] += 1
        self.free_bytes()            # empty the allocator's cache (a no-op off CUDA)
        return freed

    def offload(self) -> int:
        """Move every idle device entry to the host tier (within its budget); returns how
        many moved. For an operator freeing the device, and for measuring the host tier."""
        self.settle()
        moved = 0
        with self._lock:
            for key, e in list(self._entries.items()):
                if self._idle(e) and e.kv.bytes_at(e.length) <= self.host_budget:
                    self._spill(key, e)
                    moved += e.tier is Tier.HOST
        return moved

    def clear(self) -> None:
        with self._lock:
            for key, e in list(self._entries.items()):
                if not e.readers and e.moving is None:
                    self._drop(key, e)

    def videos(self) -> set[str]:
        """The content hashes (sha256) of the videos with an entry in either tier."""
        with self._lock:
            return {e.facts.video.get("sha256") for e in self._entries.values()} - {None}

    def stats(self) -> dict:
        with self._lock:
            tiers = [e.tier for e in self._entries.values()]
            return {**self.counts,
                    "gpu_entries": tiers.count(Tier.GPU), "host_entries": tiers.count(Tier.HOST),
                    "gpu_bytes": self._bytes(Tier.GPU), "host_bytes": self._bytes(Tier.HOST),
                    "gpu_budget_bytes": self.gpu_budget, "host_budget_bytes": self.host_budget}
