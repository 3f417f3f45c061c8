"""The lab experiments' timer: CUDA events around each call, the median of ``reps`` after one
warm-up call; on a machine without CUDA (the interpreter checks) one wall-clock call."""

from __future__ import annotations

import time

import torch


def ms(fn, reps: int = 20) -> float:
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]
