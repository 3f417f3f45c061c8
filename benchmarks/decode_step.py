"""How long is one decode step after a long prefill? ms a token for the three paths of
mminfer.models.decode, side by side in one run on the same cache:

- ``step``:  the text model's own forward per token (``Adapter._step``, what decoding was);
- ``lean``:  the lean step (the model's modules, no forward, no masks), eager;
- ``graph``: the lean step's segments replayed from CUDA graphs, attention between them.

and ``fork``: the fastest of those that runs the lean step (``graph`` on a GPU) over a ForkKV
of the same cache, as a question on a kept video reads it (the prefix shared and read only,
the answer's rows in buffers of its own; attention is the two-segment flash-decoding kernel,
mminfer.kernels.fp8_attention.split_attention, in place of SDPA); ``fork8``: one batched step
(``LeanDecoder.step_many``, eager) of 8 such forks of the cache, as 8 questions about one kept
video decode together, their attention reading the prefix once a step for all of them
(shared-prefix attention), and ``fork8_each``: the same step attending once per question (the
prefix read 8 times); ms a batched step of 8 tokens, and tokens a second.

``fork_flash``, ``fork_flash_split``, ``fork_flash_torchmerge`` (lab/experiments/fork_flash.py,
measured only): ``fork`` again with the fork's attention swapped for PyTorch's flash kernel
over the prefix (query heads folded into the query length), the own rows by the same kernel
or the split kernel's partial pass, the log-sum-exp merge in one Triton launch or in torch;
and, on a GPU, 28 layers' attention alone of one token over a fork with FORK_OWN_ROWS own rows
(CUDA events): the split kernel (``fork_attention_split_ms``) against each variant, with
their largest difference from it.

A random-weight language model at the Qwen2.5-VL-7B text shape (28 layers, hidden 3584, 28/4
heads, d 128, MLP 18944, vocab 152064; bf16) with a PrefixKV filled with random K/V to N tokens
(default 115K and 1.05M; a length that does not fit falls back to half of it, marked). Each path
decodes ``--steps`` tokens through ``decode_loop`` (the loop continue_on runs: one host sync a
token for the token id) after a warm-up; ms a step = wall time / steps. Also reported: the
memory floor (weights + K/V read once at 4.8 TB/s), attention alone (28 layers' SDPA over N per
step, CUDA events) and the segments alone (the graphs without attention), and whether the three
paths gave the same greedy tokens.

Batched (``--batch`` answers, default 8, each over a PrefixKV of its own of ``--batch-lengths``
random rows, default 115K): the answers decode together through ``step_batch`` (the server's
batched step), eagerly (``lean``: ``LeanDecoder.step_many``) and replayed from CUDA graphs
(``graph``: BatchGraphs), side by side: ms a step, ms a token (a step / answers), tokens a
second against one answer alone at the same length, the same tokens on both paths (and,
reported only, as each answer alone), and the memory the batched graphs reserved.

    python benchmarks/decode_step.py --out decode_step.json            # H200, ~1-2 min
    python benchmarks/decode_step.py --tiny --out /tmp/decode.json     # CPU, seconds
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.models import decode, hooks  # noqa: E402
from mminfer.models.base import Adapter  # noqa: E402
from mminfer.models.kv import ForkKV, PrefixKV  # noqa: E402
from lab.experiments import fork_flash  # noqa: E402

HBM_BYTES_S = 4.8e12          # H200
SHAPE_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
SHAPE_TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


class Bare(Adapter):
    """An adapter around a bare Qwen2.5-VL text model: what decode_loop and _step need."""

    def __init__(self, text_model, lm_head):
        self.text_model, self.lm_head = text_model, lm_head
        self.eos_token_ids = ()
        self.device = lm_head.weight.device

    def positions_after(self, rope_delta, start, length):
        p = torch.arange(start, start + length, device=self.device) + int(rope_delta)
        return p.view(1, 1, -1).expand(3, 1, -1)


def text_model(shape, device, dtype):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    d = shape["hidden_size"] // shape["num_attention_heads"]
    sec = [d // 8, (d // 2 - d // 8) // 2]
    sec.append(d // 2 - sum(sec))           # [16, 24, 24] at d 128
    cfg = Qwen2_5_VLConfig(text_config=dict(
        **shape, max_position_embeddings=1 << 21, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": sec},
        tie_word_embeddings=False)).text_config
    torch.manual_seed(0)
    with torch.device(device):
        model = m.Qwen2_5_VLTextModel._from_config(cfg, dtype=dtype,
                                                    attn_implementation=hooks.register())
        head = torch.nn.Linear(shape["hidden_size"], shape["vocab_size"], bias=False,
                               dtype=dtype)
    return model.eval(), head


def filled_cache(tm, n, headroom, device, dtype, seed=None):
    """A PrefixKV holding ``n`` rows of random K/V in every layer (no prefill)."""
    kv = PrefixKV.for_model(tm, headroom=headroom)
    attn = tm.layers[0].self_attn
    hkv = attn.k_proj.out_features // attn.head_dim
    g = torch.Generator(device=device).manual_seed(n if seed is None else seed)
    for layer in kv.layers:
        shape = (1, hkv, n + headroom, attn.head_dim)
        layer.k_buf = torch.empty(shape, device=device, dtype=dtype).normal_(generator=g)
        layer.v_buf = torch.empty(shape, device=device, dtype=dtype).normal_(generator=g)
        layer.device, layer.is_initialized = torch.device(device), True
        layer._set_length(n)
    return kv


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_path(ad, kv, n, mode, steps, warm, first):
    """(ms a step, tokens, first call's seconds) of ``steps`` decode steps of ``mode``."""
    dev = ad.device
    t0 = time.perf_counter()
    decode.decode_loop(ad, kv, [first], rope_delta=7, max_new_tokens=1 + warm, mode=mode)
    sync(dev)
    first_s = time.perf_counter() - t0
    kv.truncate(n)
    sync(dev)
    t0 = time.perf_counter()
    out = decode.decode_loop(ad, kv, [first], rope_delta=7, max_new_tokens=1 + steps,
                             mode=mode)
    sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    kv.truncate(n)
    return ms, out, first_s


def time_fork(ad, kv, n, mode, steps, warm, first, claim=False):
    """:func:`time_path` on a fresh ForkKV of ``kv``'s ``n`` rows each time; ``claim``: the
    fork writes into the prefix's tail (a lone question on a kept video: its cache in one
    piece), given back after each run."""
    dev = ad.device
    t0 = time.perf_counter()
    fork = ForkKV(kv, n, warm + 1, claim=claim)
    decode.decode_loop(ad, fork, [first], rope_delta=7, max_new_tokens=1 + warm, mode=mode)
    fork.release()
    sync(dev)
    first_s = time.perf_counter() - t0
    fork = ForkKV(kv, n, steps + 1, claim=claim)
    if claim and not kv.tail_claimed:
        raise RuntimeError("the fork did not claim the prefix's tail (no room past the rows)")
    sync(dev)
    t0 = time.perf_counter()
    out = decode.decode_loop(ad, fork, [first], rope_delta=7, max_new_tokens=1 + steps,
                             mode=mode)
    sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    fork.release()
    return ms, out, first_s


def time_fork_with(fn, ad, kv, n, mode, steps, warm, first):
    """:func:`time_fork` with ``fn`` as the fork's attention: the name the graph step calls
    (decode.fork_attention) and the one the attention hook calls (hooks.fork_attention, the
    eager paths) both swapped, then restored."""
    saved = decode.fork_attention, hooks.fork_attention
    decode.fork_attention = hooks.fork_attention = fn
    try:
        return time_fork(ad, kv, n, mode, steps, warm, first)
    finally:
        decode.fork_attention, hooks.fork_attention = saved


FORK_OWN_ROWS = 32     # a question's rows and the answer's so far


def fork_attention_alone(ad, kv, n, fns):
    """28 layers' attention of one decode token over a ForkKV of ``kv``'s ``n`` rows with
    FORK_OWN_ROWS random rows of its own, for each of ``fns`` (name: a function called as
    fork_attention is), CUDA events: ({name: ms a step}, {name: max |difference| from the
    first one's output, layer 0})."""
    from cuda_events import events_ms
    attn = ad.text_model.layers[0].self_attn
    H = attn.q_proj.out_features // attn.head_dim
    dtype = kv.layers[0].k_buf.dtype
    hkv = kv.layers[0].k_buf.shape[1]
    g = torch.Generator(device=ad.device).manual_seed(5)
    fork = ForkKV(kv, n, FORK_OWN_ROWS)

    def rows(*shape):
        return torch.randn(*shape, generator=g, device=ad.device, dtype=dtype)
    views = [layer.update(rows(1, hkv, FORK_OWN_ROWS, attn.head_dim),
                          rows(1, hkv, FORK_OWN_ROWS, attn.head_dim)) for layer in fork.layers]
    q = rows(1, H, 1, attn.head_dim)
    times, errs = {}, {}
    ref = None
    for name, fn in fns.items():
        def run(fn=fn):
            for keys, values in views:
                fn(q, keys, values, attn.scaling)
        times[name] = events_ms(run, reps=5)
        out = fn(q, *views[0], attn.scaling).float()
        ref = out if ref is None else ref
        errs[name] = float((out - ref).abs().max())
    return times, errs


READERS = 8


def time_readers(ad, kv, n, steps, warm, first, *, shared=True):
    """(ms a batched step, each reader's tokens) of ``steps`` steps of ``decode.step_batch``
    (the scheduler's batched step, replayed from CUDA graphs where they run) over READERS
    ForkKVs of ``kv``'s ``n`` rows, as that many questions about one cached video decode
    together (one host sync a step for the tokens); ``shared``: their attention reads
    the prefix once for all of them (decode.prefix_groups), else once per reader."""
    dec = decode.decoder_of(ad)
    vocab = dec.embed.num_embeddings
    groups = decode.prefix_groups

    def run(k):
        forks = [ForkKV(kv, n, k + 1) for _ in range(READERS)]
        toks = [(first + j) % vocab for j in range(READERS)]
        out = [[t] for t in toks]
        for _ in range(k):
            items = [(t, ad.positions_after(7, f.get_seq_length(), 1), f, False)
                     for t, f in zip(toks, forks)]
            toks = decode.step_batch(ad, items)
            for o, t in zip(out, toks):
                o.append(t)
        return out

    if not shared:
        decode.prefix_groups = lambda caches: []
    try:
        run(warm)
        sync(ad.device)
        t0 = time.perf_counter()
        out = run(steps)
        sync(ad.device)
        return (time.perf_counter() - t0) * 1e3 / steps, out
    finally:
        decode.prefix_groups = groups


def batched_tokens(ad, caches, first, k):
    """``k`` steps of the answers over ``caches`` decoding together through ``step_batch``
    (the scheduler's batched step) from their tokens ``first``: each answer's tokens, its
    first one included."""
    toks = [[t] for t in first]
    for _ in range(k):
        items = [(t[-1], ad.positions_after(7, c.get_seq_length(), 1), c, False)
                 for t, c in zip(toks, caches)]
        for t, got in zip(toks, decode.step_batch(ad, items)):
            t.append(got)
    return toks


def time_batched(ad, caches, n, mode, steps, warm, first):
    """(ms a step, each answer's tokens, first call's seconds) of ``steps`` steps of the
    answers over ``caches`` (``n`` rows each) decoding together through ``step_batch`` (the
    scheduler's batched step: one host sync a step for the token ids), on the path ``mode``
    gives it: "lean" runs step_many eagerly, "graph" replays it from CUDA graphs."""
    dev = ad.device

    def run(k):
        return batched_tokens(ad, caches, first, k)

    ad.decode_mode = mode
    try:
        t0 = time.perf_counter()
        run(warm)
        sync(dev)
        first_s = time.perf_counter() - t0
        for c in caches:
            c.truncate(n)
        sync(dev)
        t0 = time.perf_counter()
        out = run(steps)
        sync(dev)
        ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        ad.decode_mode = "auto"
        for c in caches:
            c.truncate(n)
    return ms, out, first_s


def batched_row(ad, n_asked, answers, modes, steps, warm, headroom, g, alone_ms):
    """``answers`` answers over caches of their own (``n`` random rows each, halved until
    they fit) decoding together: ms a step and a token, eager (``lean``: step_many) and
    replayed (``graph``), the same tokens on both and as each answer alone, and the memory
    the batched graphs took (allocator reservation across their capture)."""
    tm, dev = ad.text_model, ad.device
    dtype = tm.get_input_embeddings().weight.dtype
    n, caches, note = n_asked, None, None
    while caches is None:
        try:
            caches = [filled_cache(tm, n, headroom, dev, dtype, seed=n + j)
                      for j in range(answers)]
        except torch.cuda.OutOfMemoryError:
            caches = None
            torch.cuda.empty_cache()
            note = (f"{answers} caches of {n_asked} tokens did not fit: measured at a smaller "
                    "length")
            n //= 2
            print(f"out of memory for {answers} caches of {2 * n} tokens: trying {n}")
            if n < 4096:
                raise
    vocab = tm.get_input_embeddings().num_embeddings
    first = [int(t) for t in torch.randint(0, vocab, (answers,), generator=g)]
    row = dict(answers=answers, n_asked=n_asked, n=n, note=note, kv_bytes=caches[0].nbytes)
    tokens = {}
    for mode in [m for m in ("lean", "graph") if m in modes]:
        mem0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        try:
            ms, out, first_s = time_batched(ad, caches, n, mode, steps, warm, first)
        except Exception as e:          # reported, the other path still measured
            row[f"{mode}_ms"] = None
            row[f"{mode}_error"] = f"{type(e).__name__}: {e}"
            print(f"  batched {mode} failed at {answers} x {n} tokens: {row[f'{mode}_error']}")
            continue
        row[f"{mode}_ms"] = round(ms, 3)
        row[f"{mode}_ms_per_token"] = round(ms / answers, 3)
        row[f"{mode}_first_call_s"] = round(first_s, 3)
        tokens[mode] = out
        if mode == "graph":
            dec = decode.decoder_of(ad)
            row["graph_sizes"] = sorted(size for size, _ in dec._batch)
            row["graph_failed"] = dec._batch_failed
            if dev.type == "cuda":     # the capture's pool and its warm-up's temporaries
                row["graph_mem_reserved_bytes"] = torch.cuda.memory_reserved(dev) - mem0
    if alone_ms:
        row["alone_ms"] = alone_ms
        for mode in ("lean", "graph"):
            if row.get(f"{mode}_ms"):
                row[f"{mode}_tokens_per_s_vs_alone"] = round(alone_ms * answers
                                                             / row[f"{mode}_ms"], 2)
    # each answer alone (the lone step's fastest path): GEMMs of one row may sum in another
    # order than of several, so this is reported, not required
    alone = []
    with torch.inference_mode():
        for t, c in zip(first, caches):
            alone.append(decode.decode_loop(ad, c, [t], rope_delta=7, max_new_tokens=1 + steps,
                                            mode=modes[-1]))
            c.truncate(n)
    ref = tokens.get("lean")
    row["same_tokens"] = tokens.get("graph") == ref if "graph" in tokens and ref else None
    row["same_tokens_as_alone"] = {m: [a == b for a, b in zip(tokens[m], alone)]
                                   for m in tokens}
    row["tokens"] = tokens
    del caches
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def attention_ms(ad, kv, n):
    """28 layers' decode attention over ``n`` rows, CUDA events (ms a step)."""
    from cuda_events import events_ms
    tm = ad.text_model
    attn = tm.layers[0].self_attn
    H = attn.q_proj.out_features // attn.head_dim
    q = torch.randn(1, H, 1, attn.head_dim, device=ad.device, dtype=kv.layers[0].k_buf.dtype)
    fn = decode._attention_function(attn)

    def run():
        for layer, slab in zip(tm.layers, kv.layers):
            fn(layer.self_attn, q, slab.keys, slab.values, None, scaling=attn.scaling)
    return events_ms(run, reps=5)


# ---------------------------------------------------------------- split-K attention, measured only
# Is a flash-decoding kernel needed? A plain split-K Triton kernel for one query per head (the
# GQA group's queries packed as rows of one tile, each KV head read once), timed against the
# SDPA call the decode step makes, attention alone. Not used by mminfer.models.decode: a kernel
# that rounds differently would not give the _step path's tokens bit for bit.
_SPLITK = None


def _splitk_kernel():
    global _SPLITK
    if _SPLITK is None:
        import triton
        import triton.language as tl

        @triton.jit
        def partial(Q, K, V, O, LSE, n, chunk, T, scale, skh, skn, svh, svn,
                    G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BN: tl.constexpr):
            h = tl.program_id(0)
            s = tl.program_id(1)
            S = tl.num_programs(1)
            g = tl.arange(0, BG)
            d = tl.arange(0, D)
            q = tl.load(Q + (h * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G,
                        other=0.0)
            lo = s * chunk
            hi = tl.minimum(lo + chunk, n)
            m = tl.full([BG], float("-inf"), tl.float32)
            l = tl.zeros([BG], tl.float32)
            acc = tl.zeros([BG, D], tl.float32)
            for t in range(0, T):
                offs = lo + t * BN + tl.arange(0, BN)
                valid = offs < hi
                k = tl.load(K + h * skh + offs[:, None] * skn + d[None, :], mask=valid[:, None],
                            other=0.0)
                sc = tl.dot(q, tl.trans(k)) * scale
                sc = tl.where(valid[None, :], sc, float("-inf"))
                m_new = tl.maximum(m, tl.max(sc, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(sc - m_safe[:, None])
                alpha = tl.exp(m - m_safe)
                l = l * alpha + tl.sum(p, 1)
                v = tl.load(V + h * svh + offs[:, None] * svn + d[None, :], mask=valid[:, None],
                            other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m = m_new
            ok = l > 0
            l_div = tl.where(ok, l, 1.0)
            tl.store(O + ((h * S + s) * BG + g[:, None]) * D + d[None, :], acc / l_div[:, None])
            tl.store(LSE + (h * S + s) * BG + g, tl.where(ok, m + tl.log(l_div), float("-inf")))

        _SPLITK = (triton, partial)
    return _SPLITK


def splitk_attention(q, k, v, n, scale, *, block_n=64, programs=528):
    """q ``[1, H, 1, D]``, k/v ``[1, Hkv, cap, D]`` (rows ``[0, n)`` used) -> ``[1, H, 1, D]``."""
    triton, partial = _splitk_kernel()
    _, H, _, D = q.shape
    hkv = k.shape[1]
    G = H // hkv
    BG = max(16, triton.next_power_of_2(G))
    tiles = triton.cdiv(n, block_n)
    S = max(1, min(tiles, triton.cdiv(programs, hkv)))
    T = triton.cdiv(tiles, S)
    chunk = T * block_n
    S = triton.cdiv(n, chunk)
    o = torch.empty(hkv, S, BG, D, device=q.device, dtype=torch.float32)
    lse = torch.empty(hkv, S, BG, device=q.device, dtype=torch.float32)
    qc = q.reshape(hkv, G, D).contiguous()
    partial[(hkv, S)](qc, k, v, o, lse, n, chunk, T, float(scale), k.stride(1), k.stride(2),
                      v.stride(1), v.stride(2), G=G, BG=BG, D=D, BN=block_n)
    w = torch.softmax(lse[:, :, :G], dim=1)                      # [Hkv, S, G]
    out = (w[..., None] * o[:, :, :G]).sum(1)                    # [Hkv, G, D]
    return out.reshape(1, H, 1, D).to(q.dtype)


def splitk_check(ad, kv, n):
    """Largest |splitk - exact attention| (fp32, one KV head at a time) over the first and last
    layers' views (the kernel's inputs in the cache's dtype: fp32 on the CPU, bf16 on a GPU)."""
    attn = ad.text_model.layers[0].self_attn
    H = attn.q_proj.out_features // attn.head_dim
    g = torch.Generator(device=ad.device).manual_seed(3)
    worst = 0.0
    for slab in (kv.layers[0], kv.layers[-1]):
        hkv = slab.k_buf.shape[1]
        G = H // hkv
        q = torch.randn(1, H, 1, attn.head_dim, device=ad.device, generator=g,
                        dtype=torch.float32).to(slab.k_buf.dtype)
        got = splitk_attention(q, slab.k_buf, slab.v_buf, n, attn.scaling,
                               block_n=16 if ad.device.type == "cpu" else 64,
                               programs=8 if ad.device.type == "cpu" else 528)
        for h in range(hkv):
            qh = q[0, h * G:(h + 1) * G, 0].float()                       # [G, D]
            p = torch.softmax(qh @ slab.keys[0, h].float().T * attn.scaling, dim=-1)
            ref = p @ slab.values[0, h].float()
            worst = max(worst, float((got[0, h * G:(h + 1) * G, 0].float() - ref).abs().max()))
    return worst


def splitk_ms(ad, kv, n):
    from cuda_events import events_ms
    attn = ad.text_model.layers[0].self_attn
    H = attn.q_proj.out_features // attn.head_dim
    q = torch.randn(1, H, 1, attn.head_dim, device=ad.device, dtype=kv.layers[0].k_buf.dtype)

    def run():
        for slab in kv.layers:
            splitk_attention(q, slab.k_buf, slab.v_buf, n, attn.scaling)
    return events_ms(run, reps=5)


def segments_ms(ad, graphs):
    """The captured segments alone (no K/V write, no attention): ms a step."""
    from cuda_events import events_ms
    pos = graphs.pos.clone()

    def run():
        for g in graphs.graphs:
            g.replay()
    ms = events_ms(run, reps=5)
    graphs.pos.copy_(pos)
    return ms


def cell(row: dict, key: str, w: int = 8) -> str:
    """``row[key]`` as a table cell ``w`` wide, two decimals ("-" where not measured)."""
    v = row.get(key)
    return f"{v:{w}.2f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (seconds)")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated cache lengths (default 115000,1050000; tiny 300,700)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 24; tiny 6)")
    ap.add_argument("--batch", type=int, default=8,
                    help="answers decoding together in the batched measurement (0: none)")
    ap.add_argument("--batch-lengths", default=None,
                    help="comma-separated cache lengths of the batched answers, each its own "
                    "cache (default 115000; tiny 300)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)

    tiny = args.tiny
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not tiny:
        print("no CUDA device: running the tiny shape on the CPU (--tiny)")
        tiny = True
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = SHAPE_TINY if tiny else SHAPE_7B
    lengths = [int(x) for x in (args.lengths or ("300,700" if tiny else "115000,1050000"))
               .split(",")]
    steps = args.steps or (6 if tiny else 24)
    warm = 2 if tiny else 4
    headroom = 64

    t0 = time.perf_counter()
    tm, head = text_model(shape, device, dtype)
    ad = Bare(tm, head)
    weight_bytes = sum(p.numel() * p.element_size()
                       for p in [*tm.parameters(), *head.parameters()])
    weight_bytes -= tm.get_input_embeddings().weight.numel() * tm.get_input_embeddings() \
        .weight.element_size()          # a step reads one row of the embedding table
    modes = ["step", "lean"] + (["graph"] if decode.choose_path(ad) == "graph" else [])
    report = dict(model="qwen2.5-vl-7b text (random weights)" if not tiny else "tiny (CPU)",
                  shape=shape, dtype=str(dtype).replace("torch.", ""), device=str(device),
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  torch=torch.__version__, python=platform.python_version(), steps=steps,
                  build_s=round(time.perf_counter() - t0, 1), weight_bytes=weight_bytes,
                  modes=modes, rows=[], batched=[])
    if "graph" not in modes:
        report["graph"] = decode.decoder_of(ad).graph_unsupported()
    print(f"model built in {report['build_s']} s on {device} ({dtype}); paths: {modes}")

    g = torch.Generator().manual_seed(1)
    for n_asked in lengths:
        n, kv, note = n_asked, None, None
        while kv is None:
            try:
                kv = filled_cache(tm, n, headroom, device, dtype)
            except torch.cuda.OutOfMemoryError:
                kv = None
                torch.cuda.empty_cache()
                note = f"{n_asked} tokens did not fit: measured at a smaller length"
                n //= 2
                print(f"out of memory at {2 * n} tokens: trying {n}")
                if n < 4096:
                    raise
        kv_bytes = kv.nbytes
        first = int(torch.randint(0, shape["vocab_size"], (1,), generator=g))
        row = dict(n_asked=n_asked, n=n, kv_bytes=kv_bytes, note=note,
                   floor_ms=round((weight_bytes + kv_bytes) / HBM_BYTES_S * 1e3, 2))
        tokens = {}
        with torch.inference_mode():
            for mode in modes:
                try:
                    ms, out, first_s = time_path(ad, kv, n, mode, steps, warm, first)
                except torch.cuda.OutOfMemoryError as e:
                    kv.truncate(n)
                    torch.cuda.empty_cache()
                    row[f"{mode}_ms"] = None
                    row[f"{mode}_error"] = f"out of memory: {str(e).splitlines()[0]}"
                    print(f"  {mode}: out of memory at {n} tokens")
                    continue
                except Exception as e:      # reported, the other paths still measured
                    kv.truncate(n)
                    row[f"{mode}_ms"] = None
                    row[f"{mode}_error"] = f"{type(e).__name__}: {e}"
                    print(f"  {mode} failed at {n} tokens: {type(e).__name__}: {e}")
                    continue
                row[f"{mode}_ms"] = round(ms, 3)
                row[f"{mode}_first_call_s"] = round(first_s, 3)
                tokens[mode] = out
            try:
                ms, out, first_s = time_fork(ad, kv, n, modes[-1], steps, warm, first)
                row["fork_ms"], row["fork_first_call_s"] = round(ms, 3), round(first_s, 3)
                tokens["fork"] = out
            except Exception as e:          # reported, the in-place paths still measured
                row["fork_ms"] = None
                row["fork_error"] = f"{type(e).__name__}: {e}"
                print(f"  fork failed at {n} tokens: {row['fork_error']}")
            try:        # a lone question on a kept video: its rows in the prefix's tail
                ms, out, _ = time_fork(ad, kv, n, modes[-1], steps, warm, first, claim=True)
                row["tail_ms"] = round(ms, 3)
                tokens["tail"] = out
            except Exception as e:          # reported, the other paths still measured
                row["tail_ms"] = None
                row["tail_error"] = f"{type(e).__name__}: {e}"
                print(f"  tail failed at {n} tokens: {row['tail_error']}")
            for name in fork_flash.VARIANTS:     # measured only: lab/experiments/fork_flash.py
                try:
                    ms, out, _ = time_fork_with(fork_flash.variant(name), ad, kv, n, modes[-1],
                                                steps, warm, first)
                    row[f"{name}_ms"] = round(ms, 3)
                    row.setdefault("fork_flash_same_tokens", {})[name] = \
                        out == tokens.get("fork")
                except Exception as e:      # reported, the other paths still measured
                    row[f"{name}_ms"] = None
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                    print(f"  {name} failed at {n} tokens: {row[f'{name}_error']}")
            if device.type == "cuda":
                try:
                    fns = {"fork_attention_split": fork_flash.PRODUCT,
                           **{name: fork_flash.variant(name) for name in fork_flash.VARIANTS}}
                    times, errs = fork_attention_alone(ad, kv, n, fns)
                    for name, t in times.items():
                        row[f"{name}_attention_ms"] = round(t, 3)
                    row["fork_flash_max_abs_diff"] = errs
                except Exception as e:      # measured only: a failure is reported
                    row["fork_flash_attention_error"] = f"{type(e).__name__}: {e}"
                    print(f"  fork attention alone failed: {row['fork_flash_attention_error']}")
            try:
                got = {}
                for name, shared in (("fork8", True), ("fork8_each", False)):
                    ms, got[name] = time_readers(ad, kv, n, steps, warm, first, shared=shared)
                    row[f"{name}_ms"] = round(ms, 3)
                    row[f"{name}_tokens_per_s"] = round(READERS * 1e3 / ms, 1)
                row["fork8_same_tokens"] = got["fork8"] == got["fork8_each"]
            except Exception as e:          # reported, the other paths still measured
                row["fork8_error"] = f"{type(e).__name__}: {e}"
                print(f"  {READERS} readers failed at {n} tokens: {row['fork8_error']}")
            if device.type == "cuda":
                row["attention_ms"] = round(attention_ms(ad, kv, n), 3)
                row["attention_GBps"] = round(kv_bytes / row["attention_ms"] / 1e6, 1)
            if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
                try:
                    row["splitk_max_abs_err"] = splitk_check(ad, kv, n)
                    if device.type == "cuda":
                        row["splitk_ms"] = round(splitk_ms(ad, kv, n), 3)
                        row["splitk_GBps"] = round(kv_bytes / row["splitk_ms"] / 1e6, 1)
                except Exception as e:     # measured only: a failure is reported
                    row["splitk_error"] = f"{type(e).__name__}: {e}"
                    print(f"  split-K kernel failed: {row['splitk_error']}")
                graphs = decode.decoder_of(ad)._graphs
                if graphs is not None:
                    row["segments_ms"] = round(segments_ms(ad, graphs), 3)
                    # the host writes K/V and calls SDPA directly (not the attention hook)
                    row["graph_direct"] = graphs.dec._sdpa_direct
        ref = tokens.get("step")
        row["same_tokens"] = {m: tokens[m] == ref for m in tokens if m != "step"} \
            if ref else None
        row["tokens"] = tokens
        report["rows"].append(row)
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()

    batch_lengths = [int(x) for x in (args.batch_lengths or ("300" if tiny else "115000"))
                     .split(",")] if args.batch > 1 else []
    alone = {r["n"]: r.get(f"{modes[-1]}_ms") for r in report["rows"]}
    for n_asked in batch_lengths:
        report["batched"].append(batched_row(ad, n_asked, args.batch, modes, steps, warm,
                                             headroom, g, alone.get(n_asked)))

    print()
    print(f"{'tokens':>9} {'floor':>7} {'step':>8} {'lean':>8} {'graph':>8} {'fork':>8} "
          f"{'tail':>8} {'fork8':>8} {'each8':>8} {'attn':>7} {'splitK':>7} {'segs':>7}  "
          f"same tokens")
    for r in report["rows"]:
        f = functools.partial(cell, r)
        print(f"{r['n']:>9} {r['floor_ms']:7.2f} {f('step_ms')} {f('lean_ms')} "
              f"{f('graph_ms')} {f('fork_ms')} {f('tail_ms')} {f('fork8_ms')} "
              f"{f('fork8_each_ms')} "
              f"{f('attention_ms')[1:]} {f('splitk_ms')[1:]} "
              f"{f('segments_ms')[1:]}  "
              f"{r['same_tokens']}{'  (' + r['note'] + ')' if r['note'] else ''}")
    print("ms a decode step; fork: the lean step's fastest path over a fork of the cache (a "
          "question on a kept video, beside others); tail: the same fork writing into the "
          "prefix's tail (a lone question: its cache in one piece); fork8: one batched step of 8 questions about one "
          "kept video (the prefix read once a step for all), each8: the same step attending "
          "per question; floor: weights + K/V once at 4.8 TB/s; attn: every "
          "layer's decode "
          "attention alone (SDPA, as the step runs it); splitK: the same with the split-K Triton "
          "kernel (measured only); segs: the graphs without attention")
    print()
    print(f"{'tokens':>9} {'fork':>8} {'flash':>8} {'fl+split':>8} {'fl+torch':>8}  "
          f"{'a.split':>7} {'a.flash':>7} {'a.fl+sp':>7} {'a.fl+to':>7}  same tokens as fork")
    for r in report["rows"]:
        f = functools.partial(cell, r)
        names = list(fork_flash.VARIANTS)
        print(f"{r['n']:>9} {f('fork_ms')} " + " ".join(f(f"{m}_ms") for m in names) + "  "
              + " ".join(f(f"{m}_attention_ms", 7)
                         for m in ["fork_attention_split", *names])
              + f"  {r.get('fork_flash_same_tokens')}")
    print("the fork's step with its attention swapped (lab/experiments/fork_flash.py): "
          "flash: PyTorch's flash kernel over the prefix and the own rows, one Triton merge; "
          "fl+split: the own rows by the split kernel's pass; fl+torch: the merge in torch; "
          f"a.*: 28 layers' attention alone over a fork with {FORK_OWN_ROWS} own rows (a.split: "
          "the product's split kernel)")
    if report["batched"]:
        print()
        print(f"{'answers':>7} {'tokens':>9} {'lean':>8} {'graph':>8} {'lean/tok':>8} "
              f"{'graph/tok':>9} {'alone':>8} {'x alone':>7}  same tokens (lean = graph)")
    for r in report["batched"]:
        f = functools.partial(cell, r)
        best = "graph" if r.get("graph_ms") else "lean"
        print(f"{r['answers']:>7} {r['n']:>9} {f('lean_ms')} {f('graph_ms')} "
              f"{f('lean_ms_per_token')} {f('graph_ms_per_token', 9)} {f('alone_ms')} "
              f"{f(best + '_tokens_per_s_vs_alone', 7)}  {r['same_tokens']}"
              f"{'  (' + r['note'] + ')' if r['note'] else ''}")
    if report["batched"]:
        print(f"ms a step of {args.batch} answers decoding together, each over its own cache "
              "(lean: step_many eagerly; graph: replayed from CUDA graphs), and a token "
              "(/tok: a step / answers); alone: one answer's ms a token on the lone step's "
              "fastest path; x alone: tokens a second against one answer alone")
    for r in report["rows"]:
        if "splitk_max_abs_err" in r:
            err = r["splitk_max_abs_err"]
            print(f"  split-K vs exact attention at {r['n']}: max |err| {err:.2e}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
