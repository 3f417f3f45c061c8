"""Timing one callable with CUDA events, for calls too long for do_bench's repetitions; and
profiling one call (its kernels by device time)."""

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


def kernels_table(fn, rows: int = 25) -> str:
    """``fn()`` once more (after a warm-up call) under torch.profiler: its ops and kernels by
    device time on CUDA (host time on the CPU), the costliest ``rows`` as a table."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ka = prof.key_averages()
    if not cuda:
        return ka.table(sort_by="self_cpu_time_total", row_limit=rows)
    try:
        return ka.table(sort_by="self_cuda_time_total", row_limit=rows)
    except (AttributeError, KeyError):          # newer profilers: "self_device_time_total"
        return ka.table(sort_by="self_device_time_total", row_limit=rows)
