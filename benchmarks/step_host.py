"""The host's share of one batched decode step, measured on the CPU: what the host runs
between the CUDA-graph replays of ``BatchGraphs.step`` (mminfer.models.decode) for 8 answers
— each layer's K/V writes into the answers' caches and their attention — with the token-wise
work (the graphs' share) taken out.

Three batches of 8 answers (``--answers``):

- ``fork8``: 8 questions forked from one kept prefix (ForkKV), their attention one group call a
  layer (``fork_group_attention``: the prefix read once for all);
- ``fork8_each``: the same forks attending one by one (``prefix_groups`` switched off: what
  ``benchmarks/decode_step.py`` reports as ``each8``);
- ``own8``: 8 answers over caches of their own (PrefixKV).

The step is ``BatchGraphs.step`` itself, its graphs replaced by replays that do nothing (the
segments ran once at "capture", so the q/k/v buffers the host reads hold real values). Two
attention paths (``--path``):

- ``gpu``: the launchers a GPU runs (``shared_prefix_attention``, ``split_attention``,
  ``fp8_attention``: plans, checks, scratch, views), with each Triton kernel launch counted and
  not run (the CPU has no GPU to run it on; the launch's own cost in Triton's launcher is not
  in the times: it is ``triton launches`` x the launcher's few µs on the GPU). The attention
  outputs are then garbage, which nothing reads: the replays do nothing.
- ``cpu``: what runs on the CPU (PyTorch's CPU flash attention for the group and the forks),
  real outputs.

Reported per batch: the median, p10 and p90 of ``--steps`` steps in ms (after ``--warm``),
one thread (``torch.set_num_threads(1)``), and a step's launches on a GPU: Triton launches and
PyTorch ops that run a kernel (every aten op but views and empty allocations; a
``_foreach_copy_`` counts once: one launch on a GPU for tensors of one size, dtype and
layout; a tensor made from a Python list counts once: its copy to the GPU).

    PYTHONPATH=$PWD python benchmarks/step_host.py                  # ~1 min
    PYTHONPATH=$PWD python benchmarks/step_host.py --path cpu --out host.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from decode_step import Bare, filled_cache, text_model  # noqa: E402
from mminfer.kernels import fp8_attention as fa  # noqa: E402
from mminfer.models import decode, hooks  # noqa: E402
from mminfer.models.kv import ForkKV  # noqa: E402

# 28 layers and 28/4 heads as Qwen2.5-VL-7B (the host's work is per layer and per answer),
# everything else small so the CPU's arithmetic stays out of the way
SHAPE = dict(vocab_size=256, hidden_size=448, intermediate_size=64, num_hidden_layers=28,
             num_attention_heads=28, num_key_value_heads=4)
PREFIX = 256          # the kept prefix's rows
QUESTION = 12         # a question's own rows before its answer (each answer j: + 3 j)


class _NoReplay:
    def replay(self):
        pass


def _no_capture(dev, fns, pool=None):
    for fn in fns:        # the segments once: q/k/v and the residual hold real values
        fn()
    return [_NoReplay() for _ in fns]


class _Launches:
    """A Triton kernel whose launches are counted, not run."""

    def __init__(self, counter):
        self.counter = counter

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.counter[0] += 1
        return launch


class _Ops(TorchDispatchMode):
    """Counts the aten ops that run a kernel on a GPU (not views, not empty allocations)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if not (func.is_view or name.startswith("aten::empty")
                or name in ("aten::detach", "aten::_unsafe_view", "aten::alias")):
            self.n += 1
        return func(*args, **(kwargs or {}))


def gpu_launchers(counter):
    """The GPU's attention launchers on the CPU, their Triton kernels counted, not run."""
    saved = []

    def put(mod, name, value):
        if hasattr(mod, name):
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)

    for mod in (hooks, fa):
        put(mod, "compiled_gpu", lambda is_cuda: True)
    put(fa, "available", lambda device: True)
    for name in dir(fa):
        # a kernel compiled for the GPU, or run by the interpreter (TRITON_INTERPRET=1)
        if isinstance(getattr(fa, name), fa.triton.runtime.jit.KernelInterface):
            put(fa, name, _Launches(counter))
    return saved


def caches(ad, kind, n_answers):
    tm = ad.text_model
    attn = tm.layers[0].self_attn
    hkv = attn.k_proj.out_features // attn.head_dim
    g = torch.Generator().manual_seed(1)
    if kind == "own8":
        out = [filled_cache(tm, PREFIX + QUESTION + 3 * j, 1024, ad.device, torch.float32,
                            seed=j) for j in range(n_answers)]
        return out, None
    kv = filled_cache(tm, PREFIX, 0, ad.device, torch.float32)
    forks = []
    for j in range(n_answers):          # a question's rows after the prefix, then the answer
        f = ForkKV(kv, PREFIX)
        for layer in f.layers:
            rows = QUESTION + 3 * j
            layer.update(torch.randn(1, hkv, rows, attn.head_dim, generator=g),
                         torch.randn(1, hkv, rows, attn.head_dim, generator=g))
        forks.append(f)
    return forks, kv


def measure(ad, kind, n_answers, steps, warm, counter):
    dec = decode.decoder_of(ad)
    cs, keep = caches(ad, kind, n_answers)
    pos = [ad.positions_after(7, c.get_seq_length(), 1) for c in cs]
    graphs = dec.batch_graphs(n_answers, pos[0])
    tokens = [3 + j for j in range(n_answers)]
    groups = decode.prefix_groups
    if kind == "fork8_each":
        decode.prefix_groups = lambda caches: []
    try:
        times = []
        with torch.inference_mode():
            for s in range(warm + steps):
                pos = [ad.positions_after(7, c.get_seq_length(), 1) for c in cs]
                t0 = time.perf_counter()
                graphs.step(tokens, pos, cs)
                times.append(time.perf_counter() - t0)
            # one more step, its launches counted
            pos = [ad.positions_after(7, c.get_seq_length(), 1) for c in cs]
            counter[0] = 0
            with _Ops() as ops:
                graphs.step(tokens, pos, cs)
        times = sorted(t * 1e3 for t in times[warm:])
    finally:
        decode.prefix_groups = groups
    del keep
    q = statistics.quantiles(times, n=10)
    return dict(median_ms=round(statistics.median(times), 3), p10_ms=round(q[0], 3),
                p90_ms=round(q[-1], 3), triton_launches=counter[0], torch_ops=ops.n,
                layers=len(dec.layers))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--answers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--batches", default="fork8,fork8_each,own8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    decode._warm_up = lambda dev, fn: fn()
    decode._capture = _no_capture
    decode.LeanDecoder.graph_unsupported = lambda self: None
    counter = [0]
    if args.path == "gpu":
        gpu_launchers(counter)
    tm, head = text_model(SHAPE, torch.device("cpu"), torch.float32)
    ad = Bare(tm, head)
    report = dict(path=args.path, shape=SHAPE, prefix=PREFIX, answers=args.answers,
                  steps=args.steps, torch=torch.__version__, rows={})
    for kind in args.batches.split(","):
        r = measure(ad, kind, args.answers, args.steps, args.warm, counter)
        if args.path == "gpu" and kind.startswith("fork") and not r["triton_launches"]:
            raise SystemExit("the GPU's attention launchers were not reached: the names this "
                             "script replaces (gpu_launchers) moved")
        report["rows"][kind] = r
        print(f"{kind:>11}: {r['median_ms']:8.3f} ms a step (p10 {r['p10_ms']:.3f}, "
              f"p90 {r['p90_ms']:.3f}); a step's GPU launches: {r['triton_launches']} Triton "
              f"+ {r['torch_ops']} torch ops ({r['layers']} layers)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
