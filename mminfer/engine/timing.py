"""The stages of a request, and their timings without a synchronisation per layer.

On CUDA each section records a pair of events; nothing waits until ``totals_ms()`` is read
(once, at the end of a request). On the CPU, sections use ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

# Every stage of a served request, in the order it happens: the one list. ``upload`` and
# ``queue`` exist only in the service; ``restore`` brings a cached video prefix back from the
# host tier (0 on a miss and on a GPU hit); ``decode`` .. ``llm_other`` build the prefix on a
# miss (``index`` + ``attention`` + ``llm_other`` are its LLM prefill) and are 0 on a hit;
# ``suffix`` prefills the question's rows over the prefix's cache; everything before
# ``generate`` adds up to the time to first token; ``density`` is counting a sparse prefill's
# density from its plans (no launch), after the last token.
STAGES = ("upload", "queue", "restore", "decode", "preprocess", "vision", "index", "attention",
          "llm_other", "suffix", "generate", "density")
TOTALS = ("ttft", "total")                      # sums reported after the stages
SERVICE_STAGES = ("upload", "queue")
PREFILL_STAGES = ("index", "attention", "llm_other")
TTFT_STAGES = STAGES[:STAGES.index("generate")]
# What Pipeline.answer reports, and what the service reports (its own stages first).
PIPELINE_STAGES = STAGES[len(SERVICE_STAGES):] + TOTALS
SERVED_STAGES = STAGES + TOTALS


class StageTimer:
    def __init__(self, device=None):
        # lazy: torch takes seconds to import, and `mminfer --help` imports this module
        import torch
        self._torch = torch
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.cuda = dev.type == "cuda" and torch.cuda.is_available()
        self._events = defaultdict(list)   # name -> [(start_event, end_event)]
        self._cpu = defaultdict(float)     # name -> seconds

    @contextmanager
    def __call__(self, name: str):
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

    def totals_ms(self) -> dict:
        out = {k: v * 1e3 for k, v in self._cpu.items()}
        if self._events:
            self._torch.cuda.synchronize()
            for name, pairs in self._events.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs)
        return out
