"""Where a batched decode step's time goes on the GPU: torch.profiler over the product's
batched step (decode.step_batch, as benchmarks/decode_step.py times it) of 8 questions about
one cached 115K-token video (fork8: the prefix read once for all) and of 8 answers over caches
of their own, on the 7B text shape with random weights. On an H100 at 3519d5b fork8 took 32.2
ms a step where its kernels' arithmetic says ~8 ms (weights 4.3 ms, the prefix once ~1.4 ms):
this says how much of a step is kernels, which ones, and how much is host work between them.

    python -m lab.experiments.profile_step --out $OUT/profile_step       # GPU
    python -m lab.experiments.profile_step --tiny                         # CPU, seconds

Writes, per case, the wall ms a step, the kernels' summed device ms a step, and the top
operators by device time and by host time (profiler tables) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_step as ds  # noqa: E402

from mminfer.models.kv import ForkKV  # noqa: E402


def case_fork8(ad, kv, n, first, vocab):
    forks = [ForkKV(kv, n, 64) for _ in range(ds.READERS)]
    state = {"toks": [(first + j) % vocab for j in range(ds.READERS)]}

    def items(_):
        return [(t, ad.positions_after(7, f.get_seq_length(), 1), f, False)
                for t, f in zip(state["toks"], forks)]

    def step(k):
        for _ in range(k):
            state["toks"] = ds.decode.step_batch(ad, items(None))
    return step, lambda: [f.release() for f in forks]


def case_own8(ad, caches, first):
    state = {"toks": list(first)}

    def step(k):
        for _ in range(k):
            items = [(t, ad.positions_after(7, c.get_seq_length(), 1), c, False)
                     for t, c in zip(state["toks"], caches)]
            state["toks"] = ds.decode.step_batch(ad, items)
    return step, lambda: None


def measure(name, step, dev, steps, out_dir):
    step(3)                                   # warm: graphs captured, kernels compiled
    ds.sync(dev)
    t0 = time.perf_counter()
    step(steps)
    ds.sync(dev)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step(steps)
        ds.sync(dev)
    ka = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in ka) if dev.type == "cuda" else 0.0
    row = {"case": name, "wall_ms_per_step": round(wall, 3),
           "device_ms_per_step": round(dev_us / 1e3 / steps, 3),
           "steps": steps}
    by_dev = ka.table(sort_by="self_device_time_total" if dev.type == "cuda"
                      else "self_cpu_time_total", row_limit=25)
    by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=25)
    if out_dir is not None:
        (out_dir / f"{name}_by_device.txt").write_text(by_dev)
        (out_dir / f"{name}_by_host.txt").write_text(by_cpu)
    print(json.dumps(row), flush=True)
    print(by_dev[:4000], flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--length", type=int, default=115000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    tiny = dev.type == "cpu"
    dtype = torch.float32 if tiny else torch.bfloat16
    shape = ds.SHAPE_TINY if tiny else ds.SHAPE_7B
    n = 300 if tiny else a.length
    out_dir = Path(a.out) if a.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    tm, head = ds.text_model(shape, dev, dtype)
    ad = ds.Bare(tm, head)
    vocab = shape["vocab_size"]
    rows = []
    kv = ds.filled_cache(tm, n, 64, dev, dtype)
    step, done = case_fork8(ad, kv, n, 11, vocab)
    rows.append(measure("fork8", step, dev, a.steps, out_dir))
    done()
    del kv
    caches = [ds.filled_cache(tm, n, 64, dev, dtype, seed=j) for j in range(ds.READERS)]
    step, _ = case_own8(ad, caches, [(13 + j) % vocab for j in range(ds.READERS)])
    rows.append(measure("own8", step, dev, a.steps, out_dir))
    if out_dir is not None:
        (out_dir / "profile_step.json").write_text(json.dumps(
            {"device": str(dev), "gpu": torch.cuda.get_device_name(dev) if not tiny else None,
             "length": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
