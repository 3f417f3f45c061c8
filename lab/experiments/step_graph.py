"""B answers' decode steps as ONE function over static buffers, capturable in one CUDA graph:
the product's token-wise segments (mminfer.models.decode.LeanDecoder: embedding, rotary,
each layer's projections and MLP, the head) around lab/experiments/ragged_decode.py's
attention, which reads every length from the device.

The product's batched step (BatchGraphs) replays graphs of the token-wise work and attends on
the host between them, per layer and per answer; here the step's tokens, positions, cache
lengths and the record of the chosen tokens all live in device tensors the step itself
advances, so a replay is the whole step and the host only reads the tokens (here: once at
the end). Greedy only; each answer's caches (mminfer.models.kv: a PrefixKV, a ForkKV over a
kept prefix, or one in its prefix's tail) get room for ``steps`` more rows before the tables
are made, and their Python-side lengths are brought up to date by :meth:`WholeStep.sync`.

    python -m lab.experiments.step_graph --out $OUT/step_graph.json      # GPU: 7B shape

times it against the product's batched step (benchmarks/decode_step.py's fork8 / each8 set-up)
in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lab.experiments import ragged_decode as rd
from mminfer.models.kv import ForkLayer, SlabLayer


def _room(layer: SlabLayer, rows: int, like: SlabLayer | None = None) -> None:
    """``rows`` more rows of room in a SlabLayer's buffers (moved if they must grow; made
    like ``like``'s where it has none yet)."""
    if layer.length + rows > layer.capacity:
        src = layer if layer.k_buf is not None else like
        layer._grow(layer.length + rows, src.k_buf, src.v_buf)
        layer.device, layer.is_initialized = src.k_buf.device, True
        layer._set_length(layer.length)


def _segments(layer, steps):
    """(k0, v0, k1, v1, own, len0, len1, group key, scales) of one answer's layer."""
    scales = (layer.k_scale, layer.v_scale) if layer.quantized else None
    if isinstance(layer, ForkLayer):
        tail = layer.tail
        if tail is not None and tail.length + steps > tail.capacity:
            layer._leave_tail()            # the tail has no room for them: its own rows
            tail = None
        if tail is not None:
            return (tail.k_buf, tail.v_buf, None, None, False, tail.length, 0, None, scales)
        _room(layer.own, steps, like=layer.base)
        layer._views()
        b = layer.base
        return (b.k_buf, b.v_buf, layer.own.k_buf, layer.own.v_buf, True, layer.shared,
                layer.own.length, (b.k_buf.data_ptr(), layer.shared), scales)
    _room(layer, steps)
    return (layer.k_buf, layer.v_buf, None, None, False, layer.length, 0, None, scales)


class WholeStep:
    """``steps`` greedy decode steps of the answers over ``caches`` (each a cache the
    product's ``LeanDecoder.step_many`` takes), from ``tokens`` (each answer's last token)
    at ``positions`` (each what ``step_many`` takes for it)."""

    def __init__(self, dec, caches, tokens, positions, steps, *, split=4096):
        self.dec, self.caches, self.steps = dec, caches, steps
        B, L = len(caches), len(dec.layers)
        dev = dec.embed.weight.device
        per = [[_segments(c.layers[i], steps) for c in caches] for i in range(L)]
        lens = [(s[5], s[6]) for s in per[0]]
        assert all([(s[5], s[6]) for s in layer] == lens for layer in per)
        fp8 = per[0][0][8] is not None
        sets, keys = [], {}
        for b, s in enumerate(per[0]):    # forks of one prefix attend as a group
            if s[7] is None:
                sets.append([b])
            elif s[7] in keys:
                sets[keys[s[7]]].append(b)
            else:
                keys[s[7]] = len(sets)
                sets.append([b])
        attn = dec.layers[0].self_attn
        D = attn.head_dim
        H = attn.q_proj.out_features // D
        HKV = attn.k_proj.out_features // D
        self.rg = rd.Ragged(B, H, HKV, D, max(n0 for n0, _ in lens) + steps, split=split,
                            max_members=max(map(len, sets)), device=dev,
                            cache_dtype=rd.FP8_DT if fp8 else None)
        self.groups = self.rg.groups(sets, dev)
        self.ptrs = [rd.table([s[:5] for s in layer], dev,
                              scales=[s[8] for s in layer] if fp8 else None) for layer in per]
        self.lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        self.inc = torch.tensor([[0, 1] if s[4] else [1, 0] for s in per[0]],
                                dtype=torch.int64, device=dev)
        self.tok = torch.tensor(tokens, device=dev)
        self.pos = torch.cat([dec.position_ids(p, c) for p, c in zip(positions, caches)], -2)
        self.hist = torch.zeros(steps, B, dtype=torch.long, device=dev)
        self.at = torch.zeros(1, dtype=torch.long, device=dev)
        self.scaling = [layer.self_attn.scaling for layer in dec.layers]
        self.H, self.D, self.graph = H, D, None

    def step(self):
        """One step of every answer, device state in, device state out."""
        dec, B = self.dec, self.tok.shape[0]
        h = dec.embed(self.tok.view(B, 1))
        cos, sin = dec._rope(h, self.pos)
        rd.advance(self.lens, self.inc)
        for i in range(len(dec.layers)):
            q, k, v = dec._pre(i, h, cos, sin)
            self.rg.append(self.ptrs[i], self.lens, k[:, :, 0], v[:, :, 0])
            out = self.rg.attend(q[:, :, 0], self.ptrs[i], self.lens, self.groups,
                                 scale=self.scaling[i])
            h = dec._post(i, h, out.view(B, 1, self.H, self.D))
        self.logits = dec._logits(h)[:, -1]
        self.tok.copy_(self.logits.argmax(-1))
        self.hist.index_copy_(0, self.at, self.tok.view(1, B))
        self.at += 1
        self.pos += 1

    def capture(self):
        """The step in one CUDA graph (after a warm-up step that compiles the kernels; the
        warm-up's step is undone on the device so the first replay is step one)."""
        state = [t.clone() for t in (self.lens, self.tok, self.pos, self.at)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.step()
        torch.cuda.current_stream().wait_stream(s)
        for t, was in zip((self.lens, self.tok, self.pos, self.at), state):
            t.copy_(was)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()
        for t, was in zip((self.lens, self.tok, self.pos, self.at), state):
            t.copy_(was)       # capture ran nothing, but the warm-up's rows were written
        return self

    def run(self, n=None):
        """``n`` (default ``steps``) steps; each answer's tokens ``[B][n]`` (one host read)."""
        for _ in range(n or self.steps):
            self.graph.replay() if self.graph is not None else self.step()
        return self.hist[:n or self.steps].T.tolist()

    def sync(self):
        """The caches' Python-side lengths brought up to the device's (one read)."""
        lens = self.lens.tolist()
        for c, (n0, n1) in zip(self.caches, lens):
            for layer in c.layers:
                if isinstance(layer, ForkLayer):
                    if layer.tail is not None:
                        layer.tail._set_length(n0)
                        layer.keys, layer.values = layer.tail.keys, layer.tail.values
                    else:
                        layer.own._set_length(n1)
                        layer._views()
                else:
                    layer._set_length(n0)


def _timed(fn, dev, steps):
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps, out


def main(argv=None):
    """The 7B text shape with random weights on the GPU (``--tiny``: a tiny one on the CPU):
    ``--readers`` questions forked from one kept prefix (fork) and as many caches of their
    own (each), ``--length`` rows each, decoding ``--steps`` greedy steps: the whole step
    replayed from one graph (eagerly on the CPU) against the product's batched step
    (decode.step_batch, its CUDA graphs where they run), the same tokens checked."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import decode_step as ds
    from mminfer.models import decode
    from mminfer.models.kv import ForkKV
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--length", type=int, default=115000)
    p.add_argument("--readers", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if gpu else "cpu")
    dt = torch.bfloat16 if gpu else torch.float32
    n, R, steps = (a.length, a.readers, a.steps) if gpu else (300, 3, 4)
    tm, head = ds.text_model(ds.SHAPE_7B if gpu else ds.SHAPE_TINY, dev, dt)
    ad = ds.Bare(tm, head)
    dec = decode.decoder_of(ad)
    report = {"device": torch.cuda.get_device_name() if gpu else "cpu", "length": n,
              "readers": R, "steps": steps, "rows": []}
    first = [7 + j for j in range(R)]

    def product(caches):
        return lambda k: [t[1:] for t in ds.batched_tokens(ad, caches, first, k)]

    def ours(caches):
        ws = WholeStep(dec, caches, first,
                       [ad.positions_after(7, c.get_seq_length(), 1) for c in caches], steps,
                       split=4096 if gpu else 64)
        return ws.capture() if gpu else ws

    with torch.inference_mode():
        for case in ("fork", "each"):
            if case == "fork":
                prefix = ds.filled_cache(tm, n, 64, dev, dt)
                made = None
            else:
                prefix = None
                if gpu:
                    torch.cuda.empty_cache()
                made = [ds.filled_cache(tm, n, steps + 8, dev, dt, seed=j) for j in range(R)]

            def make():
                if made is None:
                    return [ForkKV(prefix, n, steps + 8) for _ in range(R)]
                for c in made:
                    c.truncate(n)
                return made
            product(make())(2)                              # warm-up: captures, compiles
            p_ms, p_tok = _timed(lambda: product(make())(steps), dev, steps)
            ws = ours(make())
            g_ms, g_tok = _timed(ws.run, dev, steps)
            row = {"case": case, "product_ms": round(p_ms, 3), "graph_ms": round(g_ms, 3),
                   "same_tokens": p_tok == g_tok}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            prefix = made = ws = None     # the next case's caches need the room
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
