"""Timing one callable with CUDA events, for calls too long for do_bench's repetitions."""

import torch


def events_ms(fn, reps: int = 3) -> float:
    """One warm-up call, then the median of ``reps`` event-timed calls (ms)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]
