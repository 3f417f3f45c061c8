"""Where the engine's batched decode step goes on the GPU: benchmarks/step_gap.py's N answers
about one cached video (``Pipeline.answer`` on N threads, steps batched by the scheduler),
with torch.profiler over 10 batched steps of all N (the 8th to the 17th): wall ms a step
against the kernels' device ms a step, and the top operators by device and by host time.

On an H100 at ``db6bcb7`` (8 answers over a 115K-token video, 7B random weights) a step took
13.9 ms of kernels under ~23 ms of wall time: the step was host-bound. Each layer's flash
attention call cost ~90 us of CPU, and the reader in the prefix's tail attended alone (a
second flash call a layer); ``fc3b578`` puts it in the group (results/2026-12-06-h100-stepgap/).

    python -m lab.experiments.profile_gap --device cuda --model CKPT --clip VIDEO.mp4 \\
        --max-frames 320 --tokens 32 --answers 8 --repeat 1                        # GPU
    python -m lab.experiments.profile_gap --tokens 24 --answers 8 --repeat 1       # CPU
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mminfer.engine import pipeline as P  # noqa: E402

FIRST, STEPS = 8, 10           # the profiled batched steps: after warm-up, all N in each


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None):
    import step_gap
    argv = list(sys.argv[1:] if argv is None else argv)
    n = int(argv[argv.index("--answers") + 1]) if "--answers" in argv else 8
    real, count, state = P.step_batch, [0], {}

    def step_batch(adapter, items):
        if len(items) == n:
            count[0] += 1
            if count[0] == FIRST:
                _sync()
                acts = [ProfilerActivity.CPU] + \
                    ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
                state["prof"] = profile(activities=acts)
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()
            elif count[0] == FIRST + STEPS:
                _sync()
                state["wall_ms"] = (time.perf_counter() - state["t0"]) * 1e3 / STEPS
                state["prof"].__exit__(None, None, None)
        return real(adapter, items)

    P.step_batch = step_batch
    try:
        step_gap.main(argv)
    finally:
        P.step_batch = real
    if "wall_ms" not in state:
        print(f"fewer than {FIRST + STEPS} batched steps of {n}: raise --tokens")
        return
    ka = state["prof"].key_averages()
    print(f"wall ms a step {state['wall_ms']:.2f} (under the profiler)")
    if torch.cuda.is_available():
        print(ka.table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=70))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
