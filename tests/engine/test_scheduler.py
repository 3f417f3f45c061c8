"""The scheduler's policy, on threads that stand for requests (mminfer.engine.scheduler).

Each fake request records what it did in one shared log, in the order it happened; the
assertions read the order, never absolute times (the machine may be busy).
"""
from __future__ import annotations

import threading
import time

import pytest

from mminfer.engine.scheduler import Scheduler, Solo
from mminfer.engine.timing import StageTimer
from mminfer.errors import Cancelled


def _wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


class Log:
    def __init__(self):
        self.items = []
        self.lock = threading.Lock()

    def add(self, *item):
        with self.lock:
            self.items.append(item)

    def index(self, item):
        return self.items.index(item)


def long_request(s, log, name, layers=6, step_s=0.02, started=None, stop=None):
    t = s.turn(name, stop=stop)
    try:
        assert t.acquire()
        with t.long():
            if started is not None:
                started.set()
            for i in range(layers):
                if t.checkpoint():
                    log.add(name, "stopped", i)
                    raise Cancelled("stopped")
                log.add(name, "layer", i)
                time.sleep(step_s)
        log.add(name, "built")
    except Cancelled:
        pass
    finally:
        t.close()


def hit_request(s, log, name, tokens=3, step_s=0.002):
    t = s.turn(name)
    try:
        assert t.acquire()
        t.checkpoint()
        log.add(name, "suffix")
        t.decoding()
        for i in range(tokens):
            t.checkpoint()
            log.add(name, "token", i)
            time.sleep(step_s)
    finally:
        t.close()


def test_a_hit_passes_a_long_prefill_at_its_next_layer():
    s, log, started = Scheduler(decode_share=0.5), Log(), threading.Event()
    a = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=8, started=started))
    a.start()
    started.wait(10)
    _wait_for(lambda: ("long", "layer", 1) in log.items)
    b = threading.Thread(target=hit_request, args=(s, log, "hit"))
    b.start()
    a.join(10), b.join(10)
    # the hit's question ran between two layers of the prefill, long before it ended
    assert log.index(("hit", "suffix")) < log.index(("long", "layer", 7))
    assert log.index(("hit", "suffix")) < log.index(("long", "built"))
    layers = [x[2] for x in log.items if x[:2] == ("long", "layer")]
    assert layers == list(range(8))                  # resumed where it stopped, in order
    assert s.state()["active"] == 0 and s.switches >= 1


def test_the_long_prefill_is_not_starved_by_a_stream_of_hits():
    """Work arriving after the prefill paused waits for its next boundary: the prefill runs
    a layer between every batch of hits."""
    s, log, started = Scheduler(decode_share=0.0), Log(), threading.Event()
    a = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=5, step_s=0.03, started=started))
    a.start()
    started.wait(10)
    hits = []
    end = time.monotonic() + 30
    while a.is_alive() and time.monotonic() < end:
        h = threading.Thread(target=hit_request, args=(s, log, f"h{len(hits)}"),
                             kwargs=dict(tokens=1, step_s=0.001))
        h.start()
        hits.append(h)
        time.sleep(0.004)
    a.join(10)
    for h in hits:
        h.join(10)
    assert not a.is_alive() and ("long", "built") in log.items
    assert len(hits) > 5


def test_decode_waits_for_the_prefill_when_its_share_is_zero():
    s, log, started = Scheduler(decode_share=0.0), Log(), threading.Event()
    # an answer already decoding
    dec_go = threading.Event()

    def decoder():
        t = s.turn("dec")
        try:
            assert t.acquire()
            t.decoding()
            dec_go.set()
            for i in range(40):
                t.checkpoint()
                log.add("dec", "token", i)
                time.sleep(0.002)
        finally:
            t.close()

    d = threading.Thread(target=decoder)
    d.start()
    dec_go.wait(10)
    a = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=4, step_s=0.01, started=started))
    a.start()
    a.join(20), d.join(20)
    # once the prefill was admitted and ran, no decode step ran until it was built
    first = log.index(("long", "layer", 0))
    built = log.index(("long", "built"))
    assert not [x for x in log.items[first:built] if x[0] == "dec"]


def test_decode_gets_its_share_between_layers():
    s, log, started = Scheduler(decode_share=0.5), Log(), threading.Event()
    dec_go = threading.Event()

    def decoder():
        t = s.turn("dec")
        try:
            assert t.acquire()
            t.decoding()
            dec_go.set()
            for i in range(400):
                t.checkpoint()
                log.add("dec", "token", i)
                time.sleep(0.001)
        finally:
            t.close()

    d = threading.Thread(target=decoder)
    d.start()
    dec_go.wait(10)
    a = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=6, step_s=0.02, started=started))
    a.start()
    a.join(30), d.join(30)
    first = log.index(("long", "layer", 0))
    built = log.index(("long", "built"))
    between = [x for x in log.items[first:built] if x[0] == "dec"]
    assert between, "decode steps ran between the prefill's layers"


def test_one_long_prefill_at_a_time():
    s, log = Scheduler(), Log()
    started = threading.Event()
    a = threading.Thread(target=long_request, args=(s, log, "a"),
                         kwargs=dict(layers=4, started=started))
    a.start()
    started.wait(10)
    b = threading.Thread(target=long_request, args=(s, log, "b"), kwargs=dict(layers=4))
    b.start()
    _wait_for(lambda: s.state()["waiting_admission"] == 1)
    a.join(10), b.join(10)
    # b began only after a was built: never two prefixes in memory half-built
    assert log.index(("a", "built")) < log.index(("b", "layer", 0))


def test_a_paused_prefill_asked_to_stop_leaves_at_once():
    s, log, started = Scheduler(decode_share=0.0), Log(), threading.Event()
    stop = threading.Event()
    a = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=50, step_s=0.01, started=started,
                                     stop=stop.is_set))
    hold = threading.Event()
    release = threading.Event()

    def hog():                      # FIRST work that holds the turn while "long" is paused
        t = s.turn("hog")
        try:
            assert t.acquire()
            hold.set()
            release.wait(10)
        finally:
            t.close()

    a.start()
    started.wait(10)
    h = threading.Thread(target=hog)
    h.start()
    hold.wait(10)                   # the prefill is paused now (the hog holds the turn)
    assert s.state()["paused"] == 1
    stop.set()
    s.wake()
    a.join(5)
    assert not a.is_alive(), "the paused prefill left while someone else held the turn"
    assert any(x[:2] == ("long", "stopped") for x in log.items)
    # and its admission is free for the next prefill
    release.set()
    h.join(5)
    b = threading.Thread(target=long_request, args=(s, log, "b"), kwargs=dict(layers=1))
    b.start()
    b.join(5)
    assert ("b", "built") in log.items and s.state()["active"] == 0


def test_waits_are_cut_out_of_the_open_sections_and_reported():
    s, started = Scheduler(decode_share=0.0), threading.Event()
    timer = StageTimer("cpu")
    done = threading.Event()

    def long_timed():
        t = s.turn("long")
        t.timer = timer
        try:
            assert t.acquire()
            with t.long(), timer("prefill"):
                started.set()
                for _ in range(3):
                    t.checkpoint()
                    time.sleep(0.01)
        finally:
            t.close()
            done.set()

    def hog():
        t = s.turn("hog")
        try:
            assert t.acquire()
            time.sleep(0.3)
        finally:
            t.close()

    a = threading.Thread(target=long_timed)
    a.start()
    started.wait(10)
    h = threading.Thread(target=hog)
    h.start()
    a.join(10), h.join(10)
    ms = timer.totals_ms()
    assert ms["wait"] >= 250            # the hog's 0.3 s
    assert ms["prefill"] < ms["wait"]   # 3 x 10 ms of its own, the wait cut out


def test_solo_turn_never_waits():
    stop = threading.Event()
    t = Solo(stop.is_set)
    assert t.acquire() and not t.checkpoint()
    with t.long():
        pass
    stop.set()
    assert t.checkpoint()


def test_bad_share():
    with pytest.raises(ValueError):
        Scheduler(decode_share=1.0)


def test_decode_steps_of_answers_in_progress_go_together():
    """Four answers decoding at once: their steps run as batches of several (one call of
    ``run`` per batch), each gets its own result, in its own order."""
    s = Scheduler(gather_s=0.05)
    calls = []
    lock = threading.Lock()

    def run(items):
        with lock:
            calls.append(len(items))
        time.sleep(0.003)
        return [(name, i + 1) for name, i in items]

    got = {}

    def answer(name):
        t = s.turn(name)
        try:
            assert t.acquire()
            t.decoding()
            seq = []
            i = 0
            for _ in range(10):
                out = t.decode((name, i), run)
                assert out[0] == name
                i = out[1]
                seq.append(i)
            got[name] = seq
        finally:
            t.close()

    threads = [threading.Thread(target=answer, args=(f"a{k}",)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert all(got[f"a{k}"] == list(range(1, 11)) for k in range(4))
    assert sum(calls) == 40
    assert max(calls) == 4 and len(calls) < 20, calls      # batched, not one by one
    assert s.batches == len(calls) and s.state()["active"] == 0


def test_a_decode_batch_error_reaches_every_answer_in_it():
    s = Scheduler(gather_s=0.05)
    errors = []

    def run(items):
        raise MemoryError("no room")

    def answer():
        t = s.turn()
        try:
            assert t.acquire()
            t.decoding()
            t.decode(1, run)
        except MemoryError as e:
            errors.append(e)
        finally:
            t.close()

    threads = [threading.Thread(target=answer) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert len(errors) == 2 and s.state()["active"] == 0


def test_an_answer_in_a_running_batch_waits_for_it_even_when_asked_to_stop():
    """Its cache is being written by the batch's step: it may leave only after the step."""
    s = Scheduler(gather_s=0.2)
    stops = {"a": threading.Event(), "b": threading.Event()}
    in_run, events, leader = threading.Event(), [], []

    def run(items):
        leader.append(threading.current_thread().name)
        in_run.set()
        time.sleep(0.3)
        events.append("step done")
        return [x for x in items]

    out = {}
    both = threading.Barrier(2)

    def answer(name):
        t = s.turn(name, stop=stops[name].is_set)
        try:
            t.decoding()                   # both in their decode phase before either steps
            both.wait(10)
            out[name] = t.decode(name, run)
            events.append(f"{name} back")
        except Cancelled:
            events.append(f"{name} cancelled")
        finally:
            t.close()

    threads = {n: threading.Thread(target=answer, args=(n,), name=n) for n in "ab"}
    for th in threads.values():
        th.start()
    assert in_run.wait(10)
    rider = "b" if leader[0] == "a" else "a"
    stops[rider].set()                     # asked to stop while the batch holds its step
    s.wake()
    for th in threads.values():
        th.join(10)
    assert s.batches == 1 and s.batched_steps == 2
    # it came back only after the step, with its result
    assert events.index("step done") < events.index(f"{rider} back")
    assert out[rider] == rider


def test_a_batch_waits_for_nobody_once_every_decoding_answer_is_pending():
    """The last answer back to its step wakes the turn gathering the batch: with a gather
    window far longer than the test, every step still runs as soon as all four are pending
    (no gather ends by its timeout), and every batch holds all four."""
    s = Scheduler(gather_s=30.0)
    sizes, lock = [], threading.Lock()

    def run(items):
        with lock:
            sizes.append(len(items))
        return [i + 1 for i in items]

    got, both = {}, threading.Barrier(4)

    def answer(name):
        t = s.turn(name)
        try:
            t.decoding()                   # all four decoding before the first step
            both.wait(10)
            i = 0
            for _ in range(5):
                i = t.decode(i, run)
            got[name] = i
        finally:
            t.close()

    threads = [threading.Thread(target=answer, args=(f"a{k}",), daemon=True)
               for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert not any(th.is_alive() for th in threads), "a batch waited for its gather window"
    assert got == {f"a{k}": 5 for k in range(4)}
    assert sizes == [4] * 5 and s.gather_timeouts == 0


def test_every_wake_up_of_answers_decoding_together_is_a_notify():
    """Polling only looks for stops: with poll and gather windows far longer than the test,
    answers still get the turn, decode in batches and finish while other requests take turns
    for their first work — every hand-over wakes its thread (the granted turn, the gathering
    turn, the answers of a finished batch)."""
    s = Scheduler(poll_s=600.0, gather_s=600.0)
    done, lock = [], threading.Lock()

    def run(items):
        return [i + 1 for i in items]

    def answer(name):
        t = s.turn(name)
        try:
            assert t.acquire()              # first work: its question's rows
            t.checkpoint()
            t.decoding()
            i = 0
            for _ in range(6):
                t.checkpoint()
                i = t.decode(i, run)
            with lock:
                done.append((name, i))
        finally:
            t.close()

    def hit(name):
        t = s.turn(name)
        try:
            assert t.acquire()
            t.checkpoint()
            with lock:
                done.append((name, "first"))
        finally:
            t.close()

    threads = [threading.Thread(target=answer, args=(f"a{k}",), daemon=True) for k in range(4)]
    threads += [threading.Thread(target=hit, args=(f"h{k}",), daemon=True) for k in range(2)]
    for th in threads:
        th.start()
    end = time.monotonic() + 30
    for th in threads:
        th.join(max(end - time.monotonic(), 0.01))
    assert not any(th.is_alive() for th in threads), "a hand-over waited for a poll"
    assert sorted(done) == [(f"a{k}", 6) for k in range(4)] + [(f"h{k}", "first")
                                                              for k in range(2)]
    assert s.state()["active"] == 0 and s.batched_steps == 24


def test_a_batch_does_not_wait_for_an_answer_waiting_for_the_turn():
    """An answer in its decode phase that gave the turn up at a step boundary cannot join a
    batch before the batch has run: the batch goes without it, at once (not after its
    gather window)."""
    s = Scheduler(gather_s=15.0, poll_s=15.0)
    sizes, log = [], Log()

    def run(items):
        sizes.append(len(items))
        return list(items)

    a, b = s.turn("a"), s.turn("b")
    assert a.acquire()
    a.decoding()

    def answer_b():
        try:
            b.decoding()
            log.add("b", b.decode("b1", run))
        finally:
            b.close()

    th = threading.Thread(target=answer_b, daemon=True)
    th.start()
    _wait_for(lambda: b in s._pending)
    a.checkpoint()                         # hands the turn to b's step, waits to get it back
    log.add("a", a.decode("a1", run))
    a.close()
    th.join(20)
    assert not th.is_alive()
    assert log.items == [("b", "b1"), ("a", "a1")]
    assert sizes == [1, 1] and s.gather_timeouts == 0


def idle_work(s, log, layers=6, step_s=0.02, started=None, stop=None):
    """Idle work (a calibration step): its layers in order; "gave up" when evicted."""
    t = s.turn("idle", stop=stop)
    try:
        if not t.idle():
            log.add("idle", "never ran")
            return
        if started is not None:
            started.set()
        for i in range(layers):
            if t.checkpoint():
                log.add("idle", "gave up", i)
                return
            log.add("idle", "layer", i)
            time.sleep(step_s)
        log.add("idle", "done")
    finally:
        t.close()


def idle_work_around(sched, room, run, layers=60):
    """``run()`` (a request's long work on ``sched``) while idle work of ``layers`` layers
    holds the turn, on a device whose memory is measured: with ``room == "enough"`` the idle
    work paused and went on from the layer it stopped at, never evicted; short of room, it
    gave up (evicted once). Returns what ``run()`` returned."""
    log, started = Log(), threading.Event()
    a = threading.Thread(target=idle_work, args=(sched, log),
                         kwargs=dict(layers=layers, step_s=0.02, started=started))
    a.start()
    assert started.wait(30)
    _wait_for(lambda: ("idle", "layer", 0) in log.items)
    try:
        out = run()
    finally:
        a.join(30)
    assert not a.is_alive() and sched.idle_pauses >= 1
    if room == "enough":          # paused, resumed at the layer after the last it ran
        assert log.items[-1] == ("idle", "done") and sched.idle_evictions == 0
        assert [x[2] for x in log.items if x[:2] == ("idle", "layer")] == list(range(layers))
    else:
        assert log.items[-1][:2] == ("idle", "gave up") and sched.idle_evictions == 1
    return out


def test_idle_work_pauses_for_a_hit_and_resumes_where_it_stopped():
    s, log, started = Scheduler(), Log(), threading.Event()
    a = threading.Thread(target=idle_work, args=(s, log),
                         kwargs=dict(layers=40, step_s=0.03, started=started))
    a.start()
    started.wait(10)
    _wait_for(lambda: ("idle", "layer", 1) in log.items)
    b = threading.Thread(target=hit_request, args=(s, log, "hit"), kwargs=dict(tokens=3))
    b.start()
    b.join(10)
    a.join(10)
    # the hit ran whole (its question and every token) between two layers of the idle work,
    # which then went on from the layer it stopped at, not from its start
    at = log.index(("hit", "suffix"))
    assert all(log.index(("hit", "token", i)) < log.index(("idle", "layer", 39))
               for i in range(3))
    layers = [x[2] for x in log.items if x[:2] == ("idle", "layer")]
    assert layers == list(range(40)) and ("idle", "done") in log.items
    after = [x for x in log.items[at:] if x[0] == "idle"]
    assert after[0][:2] == ("idle", "layer") and after[0][2] >= 2
    # nothing of the idle work ran while the hit had its turn
    hit_items = [i for i, x in enumerate(log.items) if x[0] == "hit"]
    assert not any(x[0] == "idle" for x in log.items[hit_items[0]:hit_items[-1]])
    assert s.idle_pauses >= 1 and s.idle_evictions == 0


def test_idle_work_waits_while_any_request_has_a_turn():
    """Not granted between a request's steps: only once every request has gone."""
    s, log = Scheduler(), Log()
    t = s.turn("req")
    assert t.acquire()
    a = threading.Thread(target=idle_work, args=(s, log), kwargs=dict(layers=2))
    a.start()
    # the request lets go of the turn (waiting for another's work) but is still there
    gone = threading.Event()
    waiter = threading.Thread(target=t.wait_for, args=(gone,))
    waiter.start()
    time.sleep(0.3)
    assert log.items == []                  # nothing ran while the request was there
    gone.set()
    waiter.join(10)
    t.close()
    a.join(10)
    assert log.items[-1] == ("idle", "done")


def test_a_long_prefill_evicts_paused_idle_work_before_it_builds():
    s, log, started = Scheduler(), Log(), threading.Event()
    a = threading.Thread(target=idle_work, args=(s, log),
                         kwargs=dict(layers=50, step_s=0.02, started=started))
    a.start()
    started.wait(10)
    _wait_for(lambda: ("idle", "layer", 1) in log.items)
    built = threading.Event()
    b = threading.Thread(target=long_request, args=(s, log, "long"),
                         kwargs=dict(layers=3, started=built))
    b.start()
    b.join(10)
    a.join(10)
    # the idle work gave up (its memory freed) before the prefill's first layer
    gave_up = next(i for i, x in enumerate(log.items) if x[:2] == ("idle", "gave up"))
    assert gave_up < log.index(("long", "layer", 0))
    assert ("idle", "done") not in log.items and s.idle_evictions == 1
    assert s.state()["active"] == 0


def test_evict_idle_returns_at_once_without_idle_work():
    s = Scheduler()
    t0 = time.perf_counter()
    assert s.evict_idle() == 0
    assert time.perf_counter() - t0 < 1.0     # generous: no wait happens at all


def test_a_finished_decode_step_leaves_nothing_of_its_answer_on_the_turn():
    """A decode step's item holds its answer's cache; the turn sits in a reference cycle with
    its request (job -> turn -> stop check -> job), so whatever it keeps lives until a full
    garbage collection. Nothing may stay: not the item, nor the result, nor an error (whose
    traceback holds the batch's frames) — after a step, after a failed step, after close."""
    import gc
    import weakref

    class Cache:                                   # stands for the answer's KV cache
        pass

    s = Scheduler(gather_s=0.01)
    gc.disable()
    try:
        for fail in (False, True):
            cache = Cache()
            alive = weakref.ref(cache)
            t = s.turn("a")
            assert t.acquire()
            t.decoding()

            def run(items, fail=fail):
                if fail:
                    raise MemoryError("no room")
                return [("token", it) for it in items]

            try:
                out = t.decode(cache, run)
                assert out[1] is cache
                del out
            except MemoryError:
                assert fail
            del cache
            assert alive() is None, "the turn kept the answer's cache"
            t.close()
    finally:
        gc.enable()


def test_the_holder_drains_its_queued_work_at_each_step_boundary():
    """At every step boundary the turn's holder first waits for the work it queued (on a GPU
    the host runs ahead: a request handed the turn would queue behind every layer already
    launched); only then does the policy hand the turn over. Here the drain is a stand-in
    that logs: one per layer of a long prefill, and the hit's work comes after a drain."""
    log = Log()
    s = Scheduler(drain=lambda: log.add("drain"))
    started = threading.Event()
    long = threading.Thread(target=long_request, args=(s, log, "long"),
                            kwargs=dict(layers=6, step_s=0.03, started=started))
    long.start()
    assert started.wait(10)
    hit = threading.Thread(target=hit_request, args=(s, log, "hit"), kwargs=dict(tokens=1))
    hit.start()
    long.join(20)
    hit.join(20)
    items = log.items
    layers = [i for i, it in enumerate(items) if it[0] == "long" and it[1] == "layer"]
    assert len(layers) == 6
    # every layer after the first follows a drain of the one before
    assert all(items[i - 1] == ("drain",) or items[i - 1][0] == "hit" for i in layers[1:])
    first_hit = next(i for i, it in enumerate(items) if it[0] == "hit")
    assert ("drain",) in items[:first_hit]
    assert items[first_hit - 1] == ("drain",)


def test_a_cpu_device_has_nothing_to_drain():
    from mminfer.engine.scheduler import device_drain
    assert device_drain(None)() is None and device_drain("cpu")() is None


def test_the_gpu_drain_keeps_one_step_in_flight_per_thread(monkeypatch):
    """On a GPU each boundary records an event on the caller's stream and waits for the one
    before: the previous step is done, this one stays queued (the device never idles while
    the host prepares the next). Threads (requests) keep their own. No GPU here: the event and
    the stream are stand-ins that log."""
    import torch

    from mminfer.engine import scheduler as S

    log = []

    class Event:
        n = 0

        def __init__(self):
            Event.n += 1
            self.name = f"e{Event.n}"

        def record(self, stream):
            log.append(("record", self.name, stream))

        def synchronize(self):
            log.append(("wait", self.name))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    drain = S.device_drain(torch.device("cuda"))
    for _ in range(3):
        drain()
    assert log == [("record", "e1", "stream"), ("record", "e2", "stream"), ("wait", "e1"),
                   ("record", "e3", "stream"), ("wait", "e2")]
    log.clear()
    t = threading.Thread(target=drain)           # another request: nothing of this one's
    t.start()
    t.join(10)
    assert log == [("record", "e4", "stream")]


@pytest.fixture
def hooks(monkeypatch):
    """Triton's compile hooks as a server installs them (mminfer.kernels.compiles), restored
    after the test: ``_compile`` below calls them as Triton's launch does."""
    from triton import knobs

    from mminfer.kernels import compiles
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    for name, value in (("_installed", False), ("_counts", {}), ("_seconds", {}),
                        ("_started", {})):
        monkeypatch.setattr(compiles, name, value)
    compiles.install()
    return knobs.runtime


def _compile(rt, until):
    """What Triton's launch does around a compilation (JITFunction._do_compile): the cache
    hook, host work (here: until ``until`` is set), the post-compile hook."""
    kw = dict(key="k", repr="_k()", fn=None, compile={}, is_manual_warmup=False,
              already_compiled=False)
    rt.jit_cache_hook(**kw)
    assert until.wait(30)
    rt.jit_post_compile_hook(**kw)


def _compiling_idle(s, rt, log, compile_end):
    """Idle work whose one launch compiles until ``compile_end``, then runs."""
    t = s.turn("idle")
    try:
        assert t.idle()
        log.add("idle", "compile")
        _compile(rt, compile_end)
        log.add("idle", "launch", t.held)
    except Cancelled:
        log.add("idle", "stopped")
    finally:
        t.close()


def test_idle_work_hands_the_turn_over_while_a_kernel_compiles(hooks):
    """A compilation inside idle work's launch (seconds of host work where no checkpoint can
    be) is a pause: a request that comes meanwhile gets the turn at once, and the idle work
    takes it back, to launch, only once the request has gone. A request's own compilation
    keeps its turn."""
    s, log, compile_end = Scheduler(), Log(), threading.Event()
    a = threading.Thread(target=_compiling_idle, args=(s, hooks, log, compile_end))
    a.start()
    _wait_for(lambda: ("idle", "compile") in log.items)
    own_compile_end, hit_done = threading.Event(), threading.Event()

    def hit():
        t = s.turn("hit")
        try:
            assert t.acquire()
            log.add("hit", "acquired")
            own_compile_end.set()
            _compile(hooks, own_compile_end)          # its own: it keeps the turn
            log.add("hit", "compiled", t.held)
            assert hit_done.wait(30)
            log.add("hit", "closed")
        finally:
            t.close()

    b = threading.Thread(target=hit)
    b.start()
    try:
        _wait_for(lambda: ("hit", "compiled", True) in log.items)
        compile_end.set()                  # the idle work's compilation ends: it waits
        time.sleep(0.2)
        assert not any(x[:2] == ("idle", "launch") for x in log.items)
    finally:
        compile_end.set()
        hit_done.set()
        b.join(30)
        a.join(30)
    assert log.index(("hit", "closed")) < log.index(("idle", "launch", True))
    assert s.idle_compiles == 1 and s.state()["idle_compiles"] == 1


def test_idle_work_evicted_while_it_compiles_stops_after_the_compilation(hooks):
    """A request that needs the memory evicts idle work in the middle of a compilation: the
    launch raises Cancelled once the compilation ends, and the work's turn closes."""
    s, log, compile_end = Scheduler(), Log(), threading.Event()
    a = threading.Thread(target=_compiling_idle, args=(s, hooks, log, compile_end))
    a.start()
    _wait_for(lambda: ("idle", "compile") in log.items)
    t = s.turn("long")
    try:
        assert t.acquire()                 # at once: the idle work handed the turn over
        threading.Timer(0.2, compile_end.set).start()
        assert s.evict_idle() == 1         # waits for the idle work to unwind
    finally:
        compile_end.set()
        t.close()
        a.join(30)
    assert log.items[-1] == ("idle", "stopped") and s.idle_evictions == 1
    assert s.state()["idle"] == 0
