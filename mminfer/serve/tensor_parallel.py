"""``mminfer serve --tensor-parallel N`` under torchrun: rank 0 serves HTTP, the others follow.

    torchrun --nproc-per-node N -m mminfer serve --model M --tensor-parallel N

Rank 0 is the service as ever, except that its model worker holds an
``engine.lockstep.Leader`` where it held the Pipeline: each request's ``Pipeline.answer``
(and the warm-up before the socket opens) runs on every rank. The other ranks load the same
model, open no socket, and follow rank 0's jobs until it stops them, after its last answer
at shutdown. Two things differ from one process:

- the worker never interrupts a request mid-kernel (``interrupt_after_s=None``): a request
  asked to stop stops at its next check (stage, vision chunk, decoder layer, generated token),
  which every rank agrees on; a long Triton-interpreter launch on a CPU is waited for;
- if the ranks stop running the same collectives (a rank ran out of memory, a device
  error), the group is broken: the worker dies, the service shuts down (SIGTERM to itself,
  the usual graceful stop) and exits 1, and torchrun ends the other ranks.
"""

from __future__ import annotations

import logging
import os
import signal

from mminfer.engine.lockstep import LockstepBroken, lead_or_follow
from mminfer.engine.parallel import check_launch
from mminfer.engine.pipeline import Pipeline

from .worker import ModelWorker

log = logging.getLogger("mminfer.serve")


def is_leader(n: int) -> bool:
    """Rank 0 of the ``n`` processes torchrun started (ConfigError when it started others)."""
    return check_launch(n) == 0


def _pipeline(settings, n: int):
    return Pipeline(settings.model, attention=settings.attention, device=settings.device,
                    dtype=settings.dtype, min_sparse_len=settings.min_sparse_len,
                    kv_cache_dtype=settings.kv_cache_dtype, tensor_parallel=n,
                    quantization=settings.quantization)


def leader_worker(settings, n: int) -> ModelWorker:
    """Rank 0's model worker: it loads the sharded model, warms it up on every rank and
    answers through the Leader."""
    def load():
        leader = lead_or_follow(lambda: _pipeline(settings, n), on_broken=_shut_down)
        warm = leader.warmup()
        if warm.get("ran"):
            log.info("warm-up: %s", warm)
        return leader

    # every rank replays the leader's calls in order: one request at a time
    return ModelWorker(load, queue_size=settings.queue_size, interrupt_after_s=None,
                       max_active=1)


def _shut_down():
    """A broken group: stop serving the way SIGTERM does (queued requests answered 503)."""
    os.kill(os.getpid(), signal.SIGTERM)


def follow(settings, n: int) -> int:
    """A rank other than 0: load, follow rank 0 until it stops; the exit status."""
    try:
        lead_or_follow(lambda: _pipeline(settings, n))
    except (LockstepBroken, RuntimeError) as e:     # RuntimeError: gloo lost rank 0
        log.error("tensor-parallel rank %s: %s", os.environ.get("RANK"), e)
        return 1
    return 0


def exit_quietly(server):
    """SIGINT/SIGTERM stop ``server`` (uvicorn's graceful stop) and nothing else: uvicorn
    re-raises the signal once it has stopped, which would end this process before
    :func:`finish` tells the followers, and a rank 0 dead of a signal makes torchrun kill
    the others and report a failure."""
    def stop(signum, frame):
        server.should_exit = True

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, stop)


def finish(worker: ModelWorker, code: int) -> int:
    """After the server stopped: send the followers home. The exit status: ``code``, or 1
    when the group broke or the followers could not be told (torchrun then ends them)."""
    leader = worker.pipeline
    if leader is None:
        return code or 1
    if not leader.close() or leader.broken is not None:
        log.error("the tensor-parallel followers were not stopped cleanly%s",
                  f": {leader.broken}" if leader.broken is not None else "")
        return 1
    return code
