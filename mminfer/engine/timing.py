"""The stages of a request, and their timings without a synchronisation per layer.

On CUDA each section records a pair of events; nothing waits until ``totals_ms()`` is read
(once, at the end of a request). On the CPU, sections use ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

# Every stage of a served request, in the order it happens: the one list. ``upload``, ``queue``
# and ``retry`` exist only in the service (``retry``: an attempt that ran out of memory before
# its first token and the spill of idle cached prefixes after it, the request then run again:
# mminfer.serve.worker; 0 otherwise); ``wait`` is the time a running request spent waiting for
# others' steps before its first token (engine/scheduler.py: a long prefill paused for a cache
# hit, or a hit waiting for the layer in progress), wherever in its work it fell; ``restore``
# brings a cached video prefix back from the host tier (0 on a miss and on a GPU hit); ``room``
# makes the device memory a miss's prefill needs (idle cached prefixes moved to the host tier,
# others' questions answered meanwhile; before the vision tower, and before the prefill for
# the copies still on their way; the time it waits for others to give theirs back is
# ``wait``); ``decode`` (the video's
# frames) .. ``llm_other`` build the prefix on a miss (``index`` + ``attention`` + ``llm_other``
# are its LLM prefill) and are 0 on a hit; ``suffix`` prefills the question's rows over the
# prefix's cache; everything before ``generate`` adds up to the time to first token;
# ``density`` is counting a sparse prefill's density from its plans (no launch), after the
# last token.
STAGES = ("upload", "queue", "retry", "wait", "restore", "room", "decode", "preprocess", "vision",
          "index", "attention", "llm_other", "suffix", "generate", "density")
TOTALS = ("ttft", "total")                      # sums reported after the stages
SERVICE_STAGES = ("upload", "queue", "retry")
PREFILL_STAGES = ("index", "attention", "llm_other")
TTFT_STAGES = STAGES[:STAGES.index("generate")]
# What Pipeline.answer reports, and what the service reports (its own stages first).
PIPELINE_STAGES = STAGES[len(SERVICE_STAGES):] + TOTALS
SERVED_STAGES = STAGES + TOTALS


class StageTimer:
    """Sections of a request's work by name; ``mark``/``gap`` cut the time it spent waiting for
    other requests out of the sections open meanwhile and report it as ``wait``."""

    def __init__(self, device=None):
        self._torch = torch
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda" and torch.cuda.is_available()
        self._events = defaultdict(list)   # name -> [(start_event, end_event)]
        self._cpu = defaultdict(float)     # name -> seconds
        self._open: list[str] = []         # sections entered and not left, innermost last
        self._gaps = []                    # (start, end, open sections): waits for others

    @contextmanager
    def __call__(self, name: str):
        self._open.append(name)
        try:
            with self._section(name):
                yield
        finally:
            self._open.pop()

    @contextmanager
    def _section(self, name: str):
        if self.cuda:
            start = self._torch.cuda.Event(enable_timing=True)
            end = self._torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._cpu[name] += time.perf_counter() - t0

    def add_ms(self, name: str, ms: float):
        self._cpu[name] += ms / 1e3

    def mark(self):
        """Where the request stops to let others run (an event on the stream, on CUDA)."""
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev, time.perf_counter()
        return None, time.perf_counter()

    def gap(self, start) -> float:
        """The request resumes after waiting since ``mark()`` gave ``start``: the wait is cut out
        of every section open now. Returns the wall seconds waited."""
        ev0, t0 = start
        now = time.perf_counter()
        ev1 = None
        if self.cuda:
            ev1 = self._torch.cuda.Event(enable_timing=True)
            ev1.record()
        self._gaps.append((ev0, ev1, now - t0, tuple(self._open)))
        return now - t0

    def totals_ms(self) -> dict:
        out = {k: v * 1e3 for k, v in self._cpu.items()}
        if self._events or self._gaps and self.cuda:
            self._torch.cuda.synchronize()
        for name, pairs in self._events.items():
            out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs)
        for ev0, ev1, wall_s, sections in self._gaps:
            # on the GPU, the others' work between the two events (the request's own kernels
            # queued before it paused run first, and are its own); on the CPU, the wall clock
            ms = ev0.elapsed_time(ev1) if ev0 is not None else wall_s * 1e3
            out["wait"] = out.get("wait", 0.0) + ms
            for name in set(sections):
                out[name] = max(out.get(name, 0.0) - ms, 0.0)
        return out
