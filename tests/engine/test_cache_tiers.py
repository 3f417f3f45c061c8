"""The video cache's tiers and leases under failure and concurrency: a tier move that raises
(out of memory, an interrupt) leaves the entry in one tier, counted, unpinned and evictable,
and a later request restores or rebuilds it; a host entry being restored is never evicted;
the host tier evicts its least recently used entry; an interrupted wait pins nothing;
concurrent first requests for one prefix share one build (and a failed build is rebuilt); a
new prefill makes its room: idle entries spill, what other requests pin is waited for a bounded
time, and a prefill still short is refused (503) before its vision tower runs."""

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.engine import pipeline as pipeline_mod
from mminfer.engine.cache import (PREFILL_MARGIN, Entry, PrefixFacts, Tier, VideoCache,
                                  cache_key)
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.scheduler import Scheduler
from mminfer.errors import Cancelled, MemoryBusy
from mminfer.models.kv import ForkKV, PrefixKV, tail_rows
from mminfer.sparse.modality import ModalityIndex
from tests.engine.test_scheduler import idle_work_around

from conftest import write_video

ROWS = 16


def _entry(rows=ROWS):
    """A prefix of ``rows`` random rows (2 layers) and its tail (as a build keeps)."""
    kv = PrefixKV(2, headroom=tail_rows(rows))
    for layer in range(2):
        kv.update(torch.randn(1, 2, rows, 8), torch.randn(1, 2, rows, 8), layer)
    return Entry(kv=kv, length=rows, rope_delta=0,
                 index=ModalityIndex.from_segments([("text", rows)]),
                 facts=PrefixFacts(attention="dense", visual_tokens=0, video={}))


DEVICE_BYTES = _entry().kv.held_bytes          # an entry on the device: rows and tail
HOST_BYTES = _entry().kv.nbytes                # on the host: its rows alone
K = [cache_key(v=i) for i in range(8)]


def _cache(n_device, n_host):
    """Room for ``n_device`` entries on the device and ``n_host`` on the host (and a half)."""
    return VideoCache("cpu", gpu_bytes=int(DEVICE_BYTES * (n_device + 0.5)),
                      host_bytes=int(HOST_BYTES * (n_host + 0.5)))


def _put(cache, key):
    """A prefix built and kept, and the spills that keep the budget landed."""
    with cache.use(key) as lease:
        assert lease.status == "miss"
        lease.store(_entry())
    assert cache.settle(30)
    return cache._entries.get(key)


def _tiers(cache):
    """Each entry's tier once the copies to the host on their way have landed."""
    assert cache.settle(30)
    return {k: e.tier for k, e in cache._entries.items()}


def _consistent(cache):
    """Counts are the entries' bytes per tier, nothing pinned, nothing reserved or pending,
    and every kept entry holds what it is charged."""
    assert cache.settle(30)
    s = cache.stats()
    for tier in Tier:
        mine = [e for e in cache._entries.values() if e.tier is tier]
        assert s[f"{tier.value}_entries"] == len(mine)
        assert s[f"{tier.value}_bytes"] == sum(e.kv.held_bytes for e in mine)
    assert all(not e.readers and e.restoring is None for e in cache._entries.values())
    assert cache._reserved == 0 and not cache._pending


def _rows(entry):
    return [layer.keys.clone() for layer in entry.kv.layers]


def _same_rows(entry, rows):
    return all(torch.equal(layer.keys, r) for layer, r in zip(entry.kv.layers, rows))


# ------------------------------------------------------------------ tiers


def test_a_spill_evicts_the_least_recently_used_host_entry():
    cache = _cache(1, 2)
    for k in K[:4]:
        _put(cache, k)
    assert _tiers(cache) == {K[1]: Tier.HOST, K[2]: Tier.HOST, K[3]: Tier.GPU}
    assert cache.stats()["evictions_host"] == 1
    # K[1] back: K[3] spills, and the host evicts its least recently used entry, K[2] (K[1]
    # is pinned by its restore)
    with cache.use(K[1]) as lease:
        assert lease.status == "host"
    assert _tiers(cache) == {K[3]: Tier.HOST, K[1]: Tier.GPU}
    _put(cache, K[4])
    assert _tiers(cache) == {K[3]: Tier.HOST, K[1]: Tier.HOST, K[4]: Tier.GPU}
    assert cache.stats()["evictions_host"] == 2
    _consistent(cache)


def test_a_host_entry_being_restored_is_never_evicted():
    """Device and host full: bringing K[0] back spills K[1], for which the host has room
    only if it evicts K[0] itself, which is pinned by its restore: K[1] is dropped."""
    cache = _cache(1, 1)
    first = _put(cache, K[0])
    rows = _rows(first)
    _put(cache, K[1])
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.GPU}
    with cache.use(K[0]) as lease:
        assert lease.status == "host" and lease.entry is first
        assert _same_rows(first, rows)
    assert _tiers(cache) == {K[0]: Tier.GPU}
    assert cache.stats()["evictions_host"] == 0 and cache.stats()["evictions_gpu"] == 2
    _consistent(cache)


def test_a_move_is_all_or_nothing(monkeypatch):
    """PrefixKV.move fills every layer's new buffers before any layer takes them: a failure
    copying the second layer leaves the first where it was."""
    kv = _entry().kv
    before = [(layer.k_buf, layer.v_buf) for layer in kv.layers]

    def fail(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(kv.layers[1], "_copied", fail)
    with pytest.raises(MemoryError):
        kv.move("cpu", headroom=0)
    assert all(layer.k_buf is k and layer.v_buf is v
               for layer, (k, v) in zip(kv.layers, before))


@pytest.mark.parametrize("error", [MemoryError, KeyboardInterrupt])
def test_a_failed_restore_leaves_the_entry_on_the_host(error, monkeypatch):
    cache = _cache(1, 2)
    first = _put(cache, K[0])
    rows = _rows(first)
    _put(cache, K[1])
    assert _tiers(cache)[K[0]] is Tier.HOST

    def fail(*a, **kw):
        raise error("no memory for it")

    monkeypatch.setattr(first.kv, "move", fail)
    with pytest.raises(error):
        with cache.use(K[0]):
            pass
    assert first.tier is Tier.HOST and first.kv is not None and _same_rows(first, rows)
    assert cache.stats()["host_bytes"] >= first.nbytes == first.kv.held_bytes
    _consistent(cache)
    monkeypatch.undo()
    # a later request restores it properly
    with cache.use(K[0]) as lease:
        assert lease.status == "host" and _same_rows(lease.entry, rows)
    assert first.tier is Tier.GPU
    _consistent(cache)
    # and it is evictable like any other entry
    for k in K[2:6]:
        _put(cache, k)
    assert K[0] not in cache._entries and first.kv is None
    _consistent(cache)


def test_a_spill_that_fails_for_memory_drops_the_entry(monkeypatch):
    cache = _cache(1, 2)
    first = _put(cache, K[0])
    monkeypatch.setattr(first.kv, "copies", lambda *a, **kw: (_ for _ in ()).throw(
        MemoryError("no pinned memory")))
    _put(cache, K[1])                          # K[0] cannot go to the host: dropped
    assert _tiers(cache) == {K[1]: Tier.GPU} and first.kv is None
    assert cache.stats()["evictions_gpu"] == 1
    _consistent(cache)
    monkeypatch.undo()
    with cache.use(K[0]) as lease:             # a later request rebuilds it
        assert lease.status == "miss"
        lease.store(_entry())
    assert _tiers(cache) == {K[1]: Tier.HOST, K[0]: Tier.GPU}
    _consistent(cache)


def test_an_interrupted_spill_leaves_the_entry_on_the_device(monkeypatch):
    """The copy out stopped by something other than a want of memory (its thread
    interrupted): the entry stays on the device, whole and counted."""
    cache = _cache(1, 2)
    first = _put(cache, K[0])
    rows = _rows(first)

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(first.kv, "copies", interrupt)
    _put(cache, K[1])
    # K[1] was built: kept; K[0] is whole on the device, counted, and nothing is pinned
    assert _tiers(cache) == {K[0]: Tier.GPU, K[1]: Tier.GPU} and _same_rows(first, rows)
    _consistent(cache)
    monkeypatch.undo()
    with cache.use(K[0]) as lease:             # a hit; its end brings the budget back
        assert lease.status == "hit"
    assert _tiers(cache) == {K[1]: Tier.HOST, K[0]: Tier.GPU}
    assert cache.stats()["gpu_bytes"] <= cache.gpu_budget
    _consistent(cache)


def test_an_interrupted_wait_pins_nothing(monkeypatch):
    cache = _cache(1, 1)
    _put(cache, K[1])

    def interrupt(*a, **kw):
        raise KeyboardInterrupt

    with cache.use(K[0]) as building:          # a build in progress ...
        monkeypatch.setattr(cache, "wait_for_build", interrupt)
        with pytest.raises(KeyboardInterrupt):  # ... another request interrupted waiting
            with cache.use(K[0]):
                pass
        monkeypatch.undo()
        assert cache._pending[K[0]] is building.pending
        building.store(_entry())
    _consistent(cache)
    assert _tiers(cache) == {K[1]: Tier.HOST, K[0]: Tier.GPU}


def test_readers_share_an_entry_and_never_change_it():
    """Several leases read one entry at once (each forks it), it is charged its rows and
    its tail, and the readers' own rows leave its bytes and its tensors as they were."""
    cache = _cache(2, 1)
    entry = _put(cache, K[0])
    assert entry.nbytes == DEVICE_BYTES == entry.kv.bytes_at(ROWS + tail_rows(ROWS))
    assert DEVICE_BYTES == 2 * HOST_BYTES      # a short prefix: a tail as long as its rows
    rows = _rows(entry)
    with cache.use(K[0]) as a, cache.use(K[0]) as b:
        assert (a.status, b.status) == ("hit", "hit") and entry.readers == {a, b}
        for lease in (a, b):
            fork = ForkKV(lease.entry.kv, lease.entry.length, headroom=4)
            for layer in range(2):            # a long question: the fork grows, not the entry
                fork.update(torch.randn(1, 2, 500, 8), torch.randn(1, 2, 500, 8), layer)
            assert fork.get_seq_length() == ROWS + 500
        assert entry.kv.held_bytes == DEVICE_BYTES and _same_rows(entry, rows)
    assert entry.nbytes == entry.kv.held_bytes == DEVICE_BYTES
    _consistent(cache)


def test_an_entry_spills_without_its_tail_and_comes_back_with_it():
    """On the host an entry keeps its rows alone; restored, its tail again, which a reader
    claims (its rows written after the entry's, which stay as they were)."""
    cache = _cache(1, 2)
    first = _put(cache, K[0])
    rows = _rows(first)
    _put(cache, K[1])
    assert first.tier is Tier.HOST and first.kv.capacity == ROWS
    assert first.nbytes == first.kv.held_bytes == HOST_BYTES
    with cache.use(K[0]) as lease:
        assert lease.status == "host" and first.tier is Tier.GPU
        assert first.kv.capacity == ROWS + tail_rows(ROWS) and first.nbytes == DEVICE_BYTES
        fork = ForkKV(first.kv, ROWS, headroom=2, claim=True)
        assert fork.in_tail
        for layer in range(2):
            k, _ = fork.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), layer)
            assert k.shape[-2] == ROWS + 3 and k.data_ptr() == \
                first.kv.layers[layer].k_buf.data_ptr()
        fork.release()
    assert _same_rows(first, rows) and first.kv.length == ROWS
    _consistent(cache)


def test_readers_of_a_host_entry_restore_it_once(monkeypatch):
    """Two readers of an entry on the host at once: one brings it back, the other waits for
    that (pinned meanwhile) and reads it on the device."""
    cache = _cache(1, 1)
    entry = _put(cache, K[0])
    rows = _rows(entry)
    _put(cache, K[1])
    assert _tiers(cache)[K[0]] is Tier.HOST
    gate, moving, moves = threading.Event(), threading.Event(), []
    real = entry.kv.move

    def move(device, **kw):
        moves.append(device)
        moving.set()
        gate.wait(5)
        real(device, **kw)

    monkeypatch.setattr(entry.kv, "move", move)
    got = {}

    def read(name):
        with cache.use(K[0]) as lease:
            got[name] = (lease.status, lease.entry.tier)

    first = threading.Thread(target=read, args=("first",))
    first.start()
    assert moving.wait(5)
    second = threading.Thread(target=read, args=("second",))
    second.start()
    second.join(0.3)
    assert second.is_alive() and entry.restoring is not None   # waiting for the restore
    gate.set()
    first.join(5)
    second.join(5)
    assert got == {"first": ("host", Tier.GPU), "second": ("hit", Tier.GPU)}
    assert moves == [cache.device] and _same_rows(entry, rows)
    _consistent(cache)


# ------------------------------------------------------------------ room for a prefill


def _device_of(cache, capacity):
    """The cache measures free memory as a device of ``capacity`` bytes holding its device
    entries and nothing else."""
    cache.free_bytes = lambda: capacity - cache._bytes(Tier.GPU)


@pytest.mark.parametrize("ahead", [None, 0])
def test_make_room_spills_idle_entries_then_waits_for_a_reader_to_end(ahead):
    """(``ahead``: the idle entry does not cover the need, so it is copied out before the
    vision tower; the entry the reader leaves is copied behind the tower, and the prefill's
    own call waits for that copy.)"""
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    _device_of(cache, 3 * DEVICE_BYTES)          # one entry's room is free
    pinned, ended, done = threading.Event(), threading.Event(), {}

    def reader():                                # another request reading K[1]
        with cache.use(K[1]) as lease:
            assert lease.status == "hit"
            pinned.set()
            while cache.counts["room_waits"] == 0:
                threading.Event().wait(0.01)
            ended.set()

    t = threading.Thread(target=reader)
    t.start()
    assert pinned.wait(30)
    with cache.use(K[2]) as lease:               # the prefill's own request
        assert lease.status == "miss"
        # room for all three entries' bytes: both must go, one is pinned until its reader ends
        short = cache.make_room(int(2.5 * DEVICE_BYTES / 1.1), wait_s=60, ahead_bytes=ahead)
        done["ended_first"] = ended.is_set()
        if ahead is not None:                    # the tower ran: the prefill's call
            short += cache.make_room(int(2.5 * DEVICE_BYTES / 1.1), wait_s=60)
    t.join(30)
    assert short == 0 and done["ended_first"]
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.HOST}
    assert cache.counts["room_waits"] >= 1
    _consistent(cache)


def test_make_room_asks_paused_idle_work_for_its_memory_first_and_only_when_short():
    """A paused calibration step's memory goes before a user's cached entry leaves the
    device, and only when the device is short: with room to spare the step keeps it."""
    cache = _cache(4, 4)
    _put(cache, K[0])
    held = {"idle": DEVICE_BYTES}               # what the paused step holds
    cache.free_bytes = lambda: 3 * DEVICE_BYTES - cache._bytes(Tier.GPU) - held["idle"]
    asked = []

    def release():                              # Scheduler.evict_idle's part
        asked.append(cache._entries[K[0]].tier)
        n, held["idle"] = int(held["idle"] > 0), 0
        return n

    cache.release_idle = release
    one = int(DEVICE_BYTES / (1 + PREFILL_MARGIN))    # one entry's bytes with the margin
    with cache.use(K[1]) as lease:
        assert lease.status == "miss"
        assert cache.make_room(one) == 0 and asked == []       # free already: kept
        assert cache.make_room(2 * one) == 0                   # the step's memory covers it
        assert asked == [Tier.GPU] and _tiers(cache) == {K[0]: Tier.GPU}
        assert cache.make_room(3 * one) == 0                   # then the idle entry goes
        assert asked == [Tier.GPU, Tier.GPU] and _tiers(cache) == {K[0]: Tier.HOST}
    _consistent(cache)


def test_make_room_lets_a_prefill_run_when_nobody_else_holds_memory():
    cache = _cache(4, 4)
    _put(cache, K[0])
    _device_of(cache, 2 * DEVICE_BYTES)
    with cache.use(K[0]) as lease:               # its own entry: nobody else to wait for
        assert lease.status == "hit"
        short = cache.make_room(2 * DEVICE_BYTES, wait_s=60)
    assert short == 0 and cache.counts["room_waits"] == 0
    assert _tiers(cache) == {K[0]: Tier.GPU}


@contextmanager
def _another_request(cache, key):
    """Another request inside ``cache.use(key)`` on a thread of its own for the block (it
    leaves when the block ends): ``still_in()`` says it has not left yet."""
    inside, leave = threading.Event(), threading.Event()

    def other():
        with cache.use(key):
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(30)
    try:
        yield lambda: not leave.is_set()
    finally:
        leave.set()
        t.join(30)


def test_make_room_waits_no_longer_than_it_is_given():
    cache = _cache(4, 4)
    _put(cache, K[0])
    _device_of(cache, 2 * DEVICE_BYTES)
    with _another_request(cache, K[0]) as still_in:      # it reads K[0]: pinned
        with cache.use(K[1]):
            short = cache.make_room(2 * DEVICE_BYTES, wait_s=0.2)
            still_reading = still_in()
    assert short > 0 and still_reading and cache.counts["room_waits"] >= 1
    assert _tiers(cache) == {K[0]: Tier.GPU}


@contextmanager
def _gated_copies(monkeypatch, fail=None):
    """PrefixKV.copies (a spill's host allocation and copy) held until ``gate`` is set;
    ``fail``: an entry's cache whose copy raises instead (no host memory)."""
    gate, started = threading.Event(), threading.Event()
    real = PrefixKV.copies

    def copies(kv, device, **kw):
        started.set()
        assert gate.wait(30)
        if kv is fail:
            raise RuntimeError("no host memory")
        return real(kv, device, **kw)

    monkeypatch.setattr(PrefixKV, "copies", copies)
    try:
        yield gate, started
    finally:
        gate.set()


def _room_in_thread(cache, key, need, out):
    """A prefill's request (a miss on ``key``) making room on a thread of its own."""
    def run():
        try:
            with cache.use(key):
                out["short"] = cache.make_room(need)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    return t


def test_make_room_copies_out_with_no_lock_held_while_others_read(monkeypatch):
    """The spill make_room asks for copies on a thread of its own while its request waits
    through ``cache.wait`` (a scheduler gives the turn away there): a question about another
    video is answered meanwhile, one about the video on its way out waits for it and then
    restores it, whole."""
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    rows = _rows(cache._entries[K[0]])
    _device_of(cache, 3 * DEVICE_BYTES)          # one entry's room free: K[0] (LRU) must go
    waits, real_wait = [], cache.wait
    cache.wait = lambda ev, own=False: (waits.append((ev, own)), real_wait(ev))[1]
    out, got = {}, {}
    with _gated_copies(monkeypatch) as (gate, started):
        t = _room_in_thread(cache, K[2], int(1.5 * DEVICE_BYTES / 1.1), out)
        assert started.wait(30)
        for _ in range(3000):                    # its request reaches its wait
            if waits:
                break
            threading.Event().wait(0.01)
        assert cache._entries[K[0]].moving is not None and len(waits) == 1
        assert waits[0][1] is True               # its own work: timed as its room
        with cache.use(K[1]) as lease:           # the lock is free: another video's question
            assert lease.status == "hit"

        def read_moving():
            with cache.use(K[0]) as lease:
                got["status"], got["tier"] = lease.status, lease.entry.tier
                got["same"] = _same_rows(lease.entry, rows)

        r = threading.Thread(target=read_moving)
        r.start()
        r.join(0.3)
        assert r.is_alive() and t.is_alive()     # it waits for the copy, as does the prefill
        gate.set()
        t.join(30)
        r.join(30)
    assert out == {"short": 0}
    assert got == {"status": "host", "tier": Tier.GPU, "same": True}
    # K[0] is read back onto the device at once: if that lands before the prefill measures
    # again, its room is made by a second spill (K[1], or K[0] once its reader has left)
    assert cache.counts["spilled_bytes"] in (HOST_BYTES, 2 * HOST_BYTES)
    assert cache.counts["spill_seconds"] > 0
    assert cache._host_moving == 0 and cache._entries[K[0]].moving is None
    _consistent(cache)


def test_make_room_ahead_returns_once_the_towers_share_is_free_and_the_prefill_waits(
        monkeypatch):
    """``ahead_bytes`` (what the vision tower needs): the idle entries picked cover the whole
    need, so make_room returns once the tower's share is free (the first entry's copy done)
    while the second one's copy goes on behind the tower; the call before the prefill waits
    for that copy (its own work: timed as its room), then has its room."""
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    _device_of(cache, 2 * DEVICE_BYTES)          # nothing free: both entries must go
    first, second = cache._entries[K[0]], cache._entries[K[1]]
    gate, real = threading.Event(), PrefixKV.copies

    def copies(kv, device, **kw):                # the second entry's copy held
        if kv is second.kv:
            assert gate.wait(30)
        return real(kv, device, **kw)

    monkeypatch.setattr(PrefixKV, "copies", copies)
    waits, real_wait = [], cache.wait
    cache.wait = lambda ev, own=False: (waits.append(own), real_wait(ev))[1]
    need = int(1.9 * DEVICE_BYTES / 1.1)
    out = {}
    try:
        with cache.use(K[2]):
            assert cache.make_room(need, ahead_bytes=int(0.5 * DEVICE_BYTES / 1.1)) == 0
            assert first.tier is Tier.HOST and second.moving is not None   # the tower runs
            t = threading.Thread(target=lambda: out.update(short=cache.make_room(need)))
            t.start()
            t.join(0.3)
            assert t.is_alive() and second.moving is not None
            gate.set()
            t.join(30)
    finally:
        gate.set()
    assert out == {"short": 0} and waits and all(waits)
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.HOST}
    assert cache.counts["spilled_bytes"] == 2 * HOST_BYTES and not cache._copying
    _consistent(cache)


def test_make_room_ahead_returns_at_once_when_the_tower_fits(monkeypatch):
    """The tower's share already free: make_room(ahead_bytes=) returns with every copy it
    started still held; a question about another request's entry meanwhile is answered."""
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    _device_of(cache, 2 * DEVICE_BYTES)
    with _gated_copies(monkeypatch) as (gate, started):
        with cache.use(K[2]):
            assert cache.make_room(int(0.9 * DEVICE_BYTES / 1.1), ahead_bytes=0) == 0
            assert started.wait(30) and cache._entries[K[0]].moving is not None
            with cache.use(K[1]) as lease:       # not picked: read meanwhile
                assert lease.status == "hit"
            gate.set()
            assert cache.make_room(int(0.9 * DEVICE_BYTES / 1.1)) == 0
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.GPU}
    _consistent(cache)


def test_keeping_the_budget_copies_out_while_the_store_and_others_go_on(monkeypatch):
    """A built prefix over the device budget: the least recently used idle entry is copied to
    the host on a thread of its own; the store returns at once, another video's question is
    answered meanwhile, and a question about the entry on its way waits for it, then
    restores it, whole."""
    cache = _cache(2, 4)
    for k in K[:2]:
        _put(cache, k)
    rows = _rows(cache._entries[K[0]])
    out, got = {}, {}
    with _gated_copies(monkeypatch) as (gate, started):
        def build():
            with cache.use(K[2]) as lease:
                lease.store(_entry())
                out["stored"] = True
                assert gate.wait(30)             # its answer goes on; the lease ends later
        t = threading.Thread(target=build)
        t.start()
        assert started.wait(30)
        for _ in range(500):
            if out:
                break
            threading.Event().wait(0.01)
        assert out == {"stored": True} and cache._entries[K[0]].moving is not None
        with cache.use(K[1]) as lease:           # the lock is free: another video's question
            assert lease.status == "hit"

        def read_moving():
            with cache.use(K[0]) as lease:
                got["status"], got["same"] = lease.status, _same_rows(lease.entry, rows)

        r = threading.Thread(target=read_moving)
        r.start()
        r.join(0.3)
        assert r.is_alive()                      # it waits for the copy
        gate.set()
        t.join(30)
        r.join(30)
    assert got == {"status": "host", "same": True}
    assert cache.counts["spilled_bytes"] >= HOST_BYTES
    _consistent(cache)


@pytest.mark.parametrize("device_short", [True, False])
def test_a_restore_waits_for_its_copies_out_only_when_the_device_is_short(device_short,
                                                                          monkeypatch):
    """Bringing K[0] back puts the budget over: K[1] is copied out. The restore waits for
    that copy when the device's free memory cannot take K[0] meanwhile, else not."""
    cache = _cache(1, 4)
    for k in K[:2]:
        _put(cache, k)
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.GPU}
    _device_of(cache, int(1.5 * DEVICE_BYTES) if device_short else 100 * DEVICE_BYTES)
    out, spilled = {}, cache._entries[K[1]]
    gate, started, real = threading.Event(), threading.Event(), PrefixKV.copies

    def copies(kv, device, **kw):                # K[1]'s copy out held (not the restore's)
        if kv is spilled.kv:
            started.set()
            assert gate.wait(30)
        return real(kv, device, **kw)

    monkeypatch.setattr(PrefixKV, "copies", copies)

    def restore():
        with cache.use(K[0]) as lease:
            out["status"] = lease.status

    t = threading.Thread(target=restore)
    t.start()
    try:
        assert started.wait(30)
        t.join(0.5)
        assert t.is_alive() == device_short and spilled.moving is not None
    finally:
        gate.set()
        t.join(30)
    assert out == {"status": "host"}
    assert _tiers(cache) == {K[1]: Tier.HOST, K[0]: Tier.GPU}
    _consistent(cache)


def test_make_room_does_not_chase_entries_brought_back_meanwhile():
    """Each entry make_room sends to the host is asked about at once and restored (a busy
    video): the prefill spills at most one round per entry it found (plus one), then returns
    what is still short (after its bounded wait for others, none here)."""
    cache = _cache(4, 4)
    for k in K[:3]:
        _put(cache, k)
    cache.free_bytes = lambda: 0                  # never room
    real, rounds = cache._copy_out, []

    def copy_out(moves):
        done = real(moves)
        assert done.wait(30)
        rounds.append([key for key, _, _ in moves])
        for key, _, _ in moves:                   # a question brings it straight back
            with cache.use(key) as lease:
                assert lease.status == "host"
        return done

    cache._copy_out = copy_out
    out = {}
    with _another_request(cache, K[7]):           # someone else in the cache: it may wait
        t = _room_in_thread(cache, K[6], DEVICE_BYTES, out)
        t.join(30)
        alive = t.is_alive()
    assert not alive and out["short"] > 0
    assert len(rounds) == 4
    _consistent(cache)


def test_a_spill_that_fails_drops_its_entry_and_room_is_made(monkeypatch):
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    _device_of(cache, 3 * DEVICE_BYTES)
    out = {}
    with _gated_copies(monkeypatch, fail=cache._entries[K[0]].kv) as (gate, started):
        t = _room_in_thread(cache, K[2], int(1.5 * DEVICE_BYTES / 1.1), out)
        assert started.wait(30)
        gate.set()
        t.join(30)
    assert out == {"short": 0} and _tiers(cache) == {K[1]: Tier.GPU}
    assert cache.counts["evictions_gpu"] == 1 and cache._host_moving == 0
    _consistent(cache)


def test_a_request_stopped_while_its_spill_copies_leaves_the_spill_to_finish(monkeypatch):
    """The request asked to stop while its room is being copied out returns at once (its wait
    raises); the copy finishes on its own thread and the entry lands on the host, counted."""
    cache = _cache(4, 4)
    for k in K[:2]:
        _put(cache, k)
    rows = _rows(cache._entries[K[0]])
    _device_of(cache, 3 * DEVICE_BYTES)

    def stopped(ev, own=False):
        raise Cancelled("request cancelled while waiting")

    cache.wait = stopped
    out = {}
    with _gated_copies(monkeypatch) as (gate, started):
        t = _room_in_thread(cache, K[2], int(1.5 * DEVICE_BYTES / 1.1), out)
        t.join(30)
        assert isinstance(out.get("error"), Cancelled)
        assert cache._entries[K[0]].moving is not None     # still on its way
        gate.set()
        for _ in range(300):
            if cache._entries[K[0]].moving is None:
                break
            threading.Event().wait(0.01)
    assert _tiers(cache) == {K[0]: Tier.HOST, K[1]: Tier.GPU}
    assert _same_rows(cache._entries[K[0]], rows) and cache._host_moving == 0
    _consistent(cache)


# ------------------------------------------------------------------ one build, many waiters


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiers") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


def _count_builds(pipe, before=None):
    """Count the prefix prefills (``before``: called first, in the building thread)."""
    real, builds = pipe.adapter.prefill_prefix, []

    def counted(*a, **kw):
        builds.append(threading.current_thread().name)
        if before is not None:
            before()
        return real(*a, **kw)

    pipe.adapter.prefill_prefix = counted
    return builds


def test_ten_first_requests_cost_one_prefill(qwen, mp4):
    pipe = Pipeline(str(qwen), attention="dense", device="cpu")
    cache = pipe.video_cache
    n = 10

    def all_waiting():              # the build goes on once the nine others wait for it
        for _ in range(600):
            if cache.stats()["build_waits"] == n - 1:
                return
            threading.Event().wait(0.05)

    builds = _count_builds(pipe, before=all_waiting)
    start, results, errors = threading.Barrier(n), [None] * n, []
    sched = Scheduler()                     # turns on the model, as the server's requests

    def ask(i):
        turn = sched.turn(f"ask{i}")
        try:
            start.wait()
            results[i] = pipe.answer(mp4, "where does the red square move?", fps=4.0,
                                     max_new_tokens=4, turn=turn)
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            turn.close()

    threads = [threading.Thread(target=ask, args=(i,), name=f"ask{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(builds) == 1
    assert sorted(r.cache for r in results) == ["hit"] * (n - 1) + ["miss"]
    assert len({r.answer for r in results}) == 1
    s = cache.stats()
    assert (s["misses"], s["hits"], s["build_waits"], s["gpu_entries"]) == (1, n - 1, n - 1, 1)
    # the nine readers of the one entry decoded together: batches of several answers' steps
    assert sched.batched_steps > sched.batches
    _consistent(cache)


def test_a_cancelled_build_is_built_again_by_its_waiter(qwen, mp4, monkeypatch):
    pipe = Pipeline(str(qwen), attention="dense", device="cpu")
    cache = pipe.video_cache
    builds = _count_builds(pipe)
    started, waiting, out = threading.Event(), threading.Event(), {}
    real_wait = cache.wait_for_build

    def wait_for_build(pending):         # the hook a scheduler overrides
        waiting.set()
        real_wait(pending)

    monkeypatch.setattr(cache, "wait_for_build", wait_for_build)

    def cancel():                        # the first request: cancelled once the second waits
        started.set()
        return waiting.wait(60)

    def first():
        try:
            pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2, cancel=cancel)
        except Cancelled as e:
            out["first"] = e

    def second():
        out["second"] = pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2)

    a = threading.Thread(target=first)
    a.start()
    assert started.wait(60)
    b = threading.Thread(target=second)
    b.start()
    a.join(120)
    b.join(120)
    assert isinstance(out.get("first"), Cancelled) and out["second"].cache == "miss"
    assert len(builds) == 1          # the first was cancelled before its prefill
    s = cache.stats()
    assert (s["misses"], s["build_waits"], s["gpu_entries"]) == (2, 1, 1)
    _consistent(cache)
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "hit"


def test_a_prefill_whose_memory_others_hold_is_refused_then_served(qwen, mp4, monkeypatch):
    """A new video's prefill that finds its device memory held by another request past the
    wait is refused with a 503 (MemoryBusy) before its vision tower runs, and served once
    the other request has left."""
    monkeypatch.setattr(pipeline_mod, "ROOM_WAIT_S", 0.2)
    pipe = Pipeline(str(qwen), attention="dense", device="cpu")
    cache = pipe.video_cache
    room = {"free": 0}
    cache.free_bytes = lambda: room["free"]
    builds = _count_builds(pipe)
    with _another_request(cache, K[7]):
        with pytest.raises(MemoryBusy, match="held by other requests"):
            pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2)
    assert builds == [] and cache.counts["room_waits"] >= 1
    room["free"] = 1 << 40
    assert pipe.answer(mp4, "where?", fps=4.0, max_new_tokens=2).cache == "miss"
    assert len(builds) == 1
    _consistent(cache)


def test_a_hit_is_answered_while_a_new_videos_room_is_copied_out(qwen, mp4, tmp_path,
                                                                  monkeypatch):
    """Through Pipeline.answer and the scheduler: a new video's prefill needs room, so an idle
    cached video is copied to the host tier; while that copy is held, a question about
    another cached video is answered (the prefill's request gave its turn away), and the
    spilled video's next question restores it from the host with the same answer."""
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_host_cache_gb=1.0)
    cache = pipe.video_cache
    other = write_video(tmp_path / "other.mp4", n_frames=12, fps=8.0, width=96, height=64)
    new = write_video(tmp_path / "new.mp4", n_frames=20, fps=8.0, width=96, height=64,
                      noise=True)
    q = dict(fps=4.0, max_new_tokens=3)
    first = pipe.answer(mp4, "where?", **q)
    assert pipe.answer(other, "where?", **q).cache == "miss"
    spilled = next(iter(cache._entries.values()))       # mp4's: the least recently used
    room = {}
    real_room = cache.make_room

    def make_room(need, wait_s=0.0, ahead_bytes=None):
        room.setdefault("want", int(need * 1.1) + 1)   # the first call: the whole need
        return real_room(need, wait_s)

    monkeypatch.setattr(cache, "make_room", make_room)
    # the device is short by exactly mp4's entry while it is there
    cache.free_bytes = lambda: room.get("want", 1 << 40) - (
        spilled.nbytes if spilled.tier is Tier.GPU and spilled.kv is not None else 0)
    sched, out, order = Scheduler(), {}, []

    def ask(name, path):
        turn = sched.turn(name)
        try:
            out[name] = pipe.answer(path, "where?", turn=turn, **q)
            order.append(name)
        except BaseException as e:          # noqa: BLE001 - the test reads it
            out[name] = e
        finally:
            turn.close()

    with _gated_copies(monkeypatch) as (gate, started):
        a = threading.Thread(target=ask, args=("new", new))
        a.start()
        assert started.wait(60)                         # its room being copied out
        held = time.perf_counter()
        b = threading.Thread(target=ask, args=("hit", other))
        b.start()
        b.join(60)
        assert not b.is_alive() and a.is_alive() and spilled.moving is not None
        gate.set()
        held = time.perf_counter() - held
        a.join(60)
    assert out["hit"].cache == "hit" and out["new"].cache == "miss"
    assert order == ["hit", "new"] and spilled.tier is Tier.HOST
    # the copies are the new video's own work: its room stage, not a wait for others
    t = out["new"].timings_ms
    assert t["room"] >= held * 1e3 > t["wait"], t
    again = pipe.answer(mp4, "where?", **q)
    assert again.cache == "host" and again.answer == first.answer
    _consistent(cache)


@pytest.mark.parametrize("room", ["enough", "short"])
def test_a_new_video_leaves_a_paused_calibration_step_its_memory_while_room_allows(
        qwen, mp4, tmp_path, monkeypatch, room):
    """Through Pipeline.answer and the scheduler, on a device whose memory the cache measures:
    a new video's prefix build pauses the idle work (a calibration step) and, with room to
    spare, leaves it its memory, so it goes on from where it stopped afterwards instead of
    running again from its start; short of room, it gives its memory up before the prefill."""
    monkeypatch.setattr(VideoCache, "measures_room", property(lambda self: True))
    pipe = Pipeline(str(qwen), attention="dense", device="cpu")
    new = write_video(tmp_path / "new.mp4", n_frames=20, fps=8.0, width=96, height=64,
                      noise=True)
    sched = Scheduler()
    # short: the device has room only once the paused step's memory is freed
    pipe.video_cache.free_bytes = lambda: (1 << 40) if room == "enough" or \
        sched.idle_evictions else 0

    def new_video():
        turn = sched.turn("new")
        try:
            return pipe.answer(new, "where?", turn=turn, fps=4.0, max_new_tokens=2)
        finally:
            turn.close()

    assert idle_work_around(sched, room, new_video).cache == "miss"


def test_a_new_videos_room_is_copied_out_while_its_vision_tower_runs(qwen, mp4, tmp_path,
                                                                     monkeypatch):
    """Through Pipeline.answer: the idle cached video a new video's prefill needs the room of
    is still being copied to the host while the new video's vision tower runs (the tower's
    share of memory is free at once); the prefill then waits for the copy, timed as its
    room, and the answer is the one a pipeline with room to spare gives."""
    monkeypatch.setattr(pipeline_mod, "VISION_WORKSPACE_BYTES", 0)
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_host_cache_gb=1.0)
    cache, ad = pipe.video_cache, pipe.adapter
    new = write_video(tmp_path / "new.mp4", n_frames=20, fps=8.0, width=96, height=64,
                      noise=True)
    q = dict(fps=4.0, max_new_tokens=3)
    pipe.answer(mp4, "where?", **q)
    spilled = next(iter(cache._entries.values()))
    state = {"free0": 1 << 40, "embeds": 0}
    real_room, real_embed = cache.make_room, ad.embed

    def make_room(need, wait_s=0.0, ahead_bytes=None):
        if ahead_bytes is not None:   # short by the entry for the whole need, not the tower's
            state["free0"] = max(int(need * 1.1), int(ahead_bytes * 1.1) + spilled.nbytes) + 1
        else:                         # the prefill's: its "room" timer started before this
            state["room_t0"] = time.perf_counter()
        return real_room(need, wait_s, ahead_bytes)

    def embed(prep, **kw):
        out = real_embed(prep, **kw)
        state["embeds"] = pipe.embed_bytes(prep.total_tokens)
        state["copying_in_tower"] = spilled.moving is not None
        tower_done.set()
        return out

    # the device holds the cached entry while it is there and the embeddings once made
    cache.free_bytes = lambda: state["free0"] - state["embeds"] - (
        spilled.nbytes if spilled.tier is Tier.GPU and spilled.kv is not None else 0)
    monkeypatch.setattr(cache, "make_room", make_room)
    monkeypatch.setattr(ad, "embed", embed)
    tower_done, out = threading.Event(), {}
    with _gated_copies(monkeypatch) as (gate, started):
        a = threading.Thread(target=lambda: out.update(r=pipe.answer(new, "where?", **q)))
        a.start()
        assert tower_done.wait(120)
        a.join(0.3)
        assert a.is_alive() and spilled.moving is not None    # the prefill waits for it
        deadline = time.monotonic() + 120
        while "room_t0" not in state and time.monotonic() < deadline:
            time.sleep(0.01)
        # the room the prefill waited for lasts at least from its call until the copy may
        # end (measured from the call, not from this thread's wake-up: on a busy machine the
        # answering thread may reach the call later than this one wakes)
        held = time.perf_counter() - state["room_t0"]
        gate.set()
        a.join(120)
    r = out["r"]
    assert state["copying_in_tower"] and r.cache == "miss" and spilled.tier is Tier.HOST
    assert r.timings_ms["room"] >= held * 1e3 > r.timings_ms["wait"], r.timings_ms
    roomy = Pipeline(str(qwen), attention="dense", device="cpu")
    assert r.answer == roomy.answer(new, "where?", **q).answer
    _consistent(cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_make_room_copies_out_on_cuda_into_pinned_memory():
    """On the GPU the copy thread queues the copies on a stream of its own after the work
    queued so far (here: the rows just written) and lands the entry in pinned host memory,
    its rows unchanged; the device memory goes back."""
    cache = VideoCache("cuda", gpu_bytes=1 << 30, host_bytes=1 << 30)
    kv = PrefixKV(2, headroom=8)
    for layer in range(2):
        kv.update(torch.zeros(1, 2, 4096, 64, device="cuda"),
                  torch.zeros(1, 2, 4096, 64, device="cuda"), layer)
    with cache.use(K[0]) as lease:
        lease.store(Entry(kv=kv, length=4096, rope_delta=0,
                          index=ModalityIndex.from_segments([("text", 4096)]),
                          facts=PrefixFacts(attention="dense", visual_tokens=0, video={})))
        for layer in kv.layers:                  # queued just before the spill
            layer.keys.add_(1.0)
    entry = cache._entries[K[0]]
    cache.free_bytes = lambda: (1 << 20) - (entry.nbytes if entry.tier is Tier.GPU else 0)
    with cache.use(K[1]):
        assert cache.make_room(1 << 19) == 0
    assert entry.tier is Tier.HOST and entry.moving is None and cache._host_moving == 0
    for layer in entry.kv.layers:
        assert layer.keys.device.type == "cpu" and layer.k_buf.is_pinned()
        assert bool((layer.keys == 1.0).all())
    _consistent(cache)
