"""End-to-end prefill benchmark on one GPU: time to first token, dense (our dense prefill: the
attention hook's SDPA call, the backend PyTorch picks for it) against sparse (our estimation +
kernels), for the full-size Qwen2.5-VL-7B and LongVILA-7B language
models built from their configs with random weights (no download), on video-shaped inputs
with the real ModalityIndex layout.

    python benchmarks/prefill.py                         # both models, default lengths
    python benchmarks/prefill.py --model longvila --lengths 1048576

The prefill is the product's own engine (mminfer.models.prefill, what Adapter.generate runs):
layer by layer through the real decoder modules and our attention hook, token-wise work
chunked (``--chunk``), the KV cache written as decode needs it, only the last position's
logits computed. Peak memory therefore includes the KV cache (≈ 57 GB at 1M tokens for the
7B shapes). Stages: ``index`` (online estimation + plan), ``attention`` (kernels),
``llm_other`` (projections, norms, RoPE, MLP, cache writes, logits) from CUDA events with one
synchronisation per run. Dense runs longer than ``--dense-full-max`` tokens are extrapolated
from one layer of the same dense prefill (benchmarks/dense_probe.py: the engine's own call,
timed warm, median of 3) plus the measured non-attention time, and marked as such.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.sparse.modality import ModalityIndex  # noqa: E402
from mminfer.models import fp8, hooks  # noqa: E402
from mminfer.models.base import _new_cache  # noqa: E402
from mminfer.models.prefill import DEFAULT_CHUNK, prefill  # noqa: E402
from mminfer.sparse.patterns import HeadPatternConfig  # noqa: E402
from mminfer.engine.timing import StageTimer  # noqa: E402
import dense_probe  # noqa: E402  (benchmarks/ is the script's folder)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def qwen_7b_text_model(device):
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    cfg = Qwen2_5_VLConfig(text_config=dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=1048576,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                            "mrope_section": [16, 24, 24]},
        tie_word_embeddings=False))
    tcfg = cfg.text_config
    tcfg._attn_implementation = hooks.register()
    with torch.device(device):
        model = m.Qwen2_5_VLTextModel._from_config(tcfg, dtype=torch.bfloat16,
                                                    attn_implementation=hooks.register())
        head = torch.nn.Linear(3584, 152064, bias=False, dtype=torch.bfloat16)
    return model.eval(), head


def longvila_7b(device):
    from mminfer.models.longvila import random_llm
    lm = random_llm(device=device, dtype=torch.bfloat16)
    return lm.model, lm.lm_head


def layout(kind, n):
    pre, suf = 20, 30
    if kind == "qwen":   # 1280x720 video at 560x1008: 20 x 36 merged tokens per frame pair
        h, w, sep = 20, 36, 0
    else:                # LongVILA: 16 x 16 tokens + one newline per frame
        h, w, sep = 16, 16, 1
    frames = (n - pre - suf) // (h * w + sep)
    return ModalityIndex.from_segments([("text", pre), ("video", frames, h, w, sep),
                                        ("text", suf)])


def positions(kind, index, device):
    if kind == "qwen":
        from mminfer.models.qwen2_5_vl import mrope_positions
        pos, _ = mrope_positions(index, [1.0], 2.0)
        return pos[:, None, :].to(device)
    return torch.arange(index.n, device=device)[None, :]


def _embeds(model, index, device):
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(1, index.n, model.config.hidden_size, device=device,
                       dtype=next(model.parameters()).dtype, generator=g)


def run_prefill(model, head, index, pos, ctx, layers=None, chunk=DEFAULT_CHUNK):
    """The engine on random embeddings into a fresh KV cache; returns the last logits."""
    return prefill(model, _embeds(model, index, pos.device), _new_cache(model), pos,
                   chunk=chunk, ctx=ctx, lm_head=head, layers=layers)


def run_one(model, head, kind, n, mode, patterns, chunk=DEFAULT_CHUNK):
    """One timed prefill of ``n`` tokens on the model's device (CUDA events and peak memory
    on a GPU; the wall clock on the CPU, where this only checks the script runs)."""
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    index = layout(kind, n)
    pos = positions(kind, index, dev)
    timer = StageTimer(dev)
    ctx = hooks.PrefillContext(index=index, patterns=patterns, mode=mode, min_sparse_len=0,
                               timer=timer, keep_plans=(mode == "sparse"))
    # warm-up on the first and the last layer (the configs' two kinds of layer): compiles
    # every kernel variant outside the timed run
    warm = hooks.PrefillContext(index=index, patterns=patterns, mode=mode, min_sparse_len=0)
    run_prefill(model, head, index, pos, warm, [0, len(model.layers) - 1], chunk)
    h = _embeds(model, index, dev)
    cache = _new_cache(model)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    prefill(model, h, cache, pos, chunk=chunk, ctx=ctx, lm_head=head)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        total = start.elapsed_time(end)
    else:
        total = (time.perf_counter() - t0) * 1e3
    stages = timer.totals_ms()
    step_ms = decode_steps_ms(model, cache, pos, steps=8) if cuda else []
    diag = decode_diagnosis(model, cache, pos) if cuda and DIAG else {}
    row = {"model": kind, "n": index.n, "mode": mode, "ttft_ms": total, "chunk": chunk,
           "index_ms": stages.get("index", 0.0), "attention_ms": stages.get("attention", 0.0),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           "kv_cache_gib": sum(lay.keys.numel() * lay.keys.element_size() * 2
                               for lay in cache.layers) / 2**30,
           # decode steps on the cache this prefill wrote: must not depend on the mode
           "decode_step_ms": sorted(step_ms)[len(step_ms) // 2] if step_ms else float("nan"),
           **diag}
    del h, cache
    row["llm_other_ms"] = total - row["index_ms"] - row["attention_ms"]
    if mode == "sparse":
        dens = [p.density()["logical"] for _, p in sorted(ctx.densities.items()) if p is not None]
        row["density_mean"] = sum(dens) / max(len(dens), 1)
        row["density_per_layer"] = dens
    return row


DIAG = os.environ.get("MMINFER_DECODE_DIAG") == "1"


def decode_diagnosis(model, cache, pos, steps=6) -> dict:
    """Why a decode step is slow after one prefill and not another: the same steps with the
    host clock beside the events (a host-bound step shows wall >> events), with Python's
    collector off, and after the allocator's cache is emptied."""
    import gc
    out = {}
    t0 = time.perf_counter()
    ev = decode_steps_ms(model, cache, pos, steps)
    out["diag_wall_ms"] = (time.perf_counter() - t0) * 1e3 / steps
    out["diag_events_ms"] = sorted(ev)[steps // 2]
    gc.collect()
    gc.disable()
    try:
        out["diag_no_gc_ms"] = sorted(decode_steps_ms(model, cache, pos, steps))[steps // 2]
    finally:
        gc.enable()
    torch.cuda.empty_cache()
    out["diag_after_empty_cache_ms"] = sorted(decode_steps_ms(model, cache, pos, steps))[steps // 2]
    # the cache itself: the same values in fresh contiguous tensors
    for lay in cache.layers:
        lay.keys, lay.values = lay.keys.clone(), lay.values.clone()
    out["diag_cloned_cache_ms"] = sorted(decode_steps_ms(model, cache, pos, steps))[steps // 2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        decode_steps_ms(model, cache, pos, 2)
    ev = prof.key_averages()

    def dev_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    out["diag_top_kernels"] = [(e.key[:60], round(dev_us(e) / 2e3, 2), e.count // 2)
                               for e in sorted(ev, key=lambda e: -dev_us(e))[:8]]
    out["diag_top_cpu"] = [(e.key[:60], round(e.self_cpu_time_total / 2e3, 2), e.count // 2)
                           for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:6]]
    return out


def fp8_error(model, head, kind, lengths, patterns, chunk):
    """For each length and attention mode: the last logits of a prefill with the bf16 model
    and with its FP8 conversion (the product's --quantization fp8; the model is converted in
    place), same random input: ``||fp8 - bf16|| / ||bf16||`` and whether the argmax agrees.
    Beside it, the same error between two bf16 runs that differ only in the chunk (other
    GEMM shapes, so other bf16 roundings): how much this random network amplifies rounding
    noise. With random weights this measures the arithmetic, not answers."""
    dev = next(model.parameters()).device

    def logits(n, mode, c):
        index = layout(kind, n)
        pos = positions(kind, index, dev)
        ctx = hooks.PrefillContext(index=index, patterns=patterns, mode=mode, min_sparse_len=0)
        return run_prefill(model, head, index, pos, ctx, chunk=c).float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())
    todo = [(n, mode) for n in lengths for mode in ("sparse", "dense")]
    ref = {k: logits(*k, chunk) for k in todo}
    other = {k: logits(*k, chunk // 2) for k in todo}
    fp8.convert(model, fp8.is_llm_linear)
    rows = []
    for k in todo:
        got, r = logits(*k, chunk), ref[k]
        row = {"model": kind, "n": layout(kind, k[0]).n, "attention": k[1],
               "fp8_logits_rel_error": rel(got, r),
               "bf16_other_chunk_rel_error": rel(other[k], r),
               "fp8_logits_max_abs_error": float((got - r).abs().max()),
               "logits_max_abs": float(r.abs().max()),
               "argmax_agrees": bool(int(got.argmax()) == int(r.argmax()))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def profile_prefill(model, head, kind, n, patterns, chunk, path):
    """One (warm) sparse prefill under torch.profiler: kernels by device time, top 40."""
    from torch.profiler import ProfilerActivity, profile
    dev = next(model.parameters()).device
    index = layout(kind, n)
    pos = positions(kind, index, dev)
    ctx = hooks.PrefillContext(index=index, patterns=patterns, mode="sparse", min_sparse_len=0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_prefill(model, head, index, pos, ctx, chunk=chunk)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    total = sum(getattr(e, "self_device_time_total", 0) for e in ka)
    with open(path, "w") as f:
        f.write(f"{kind} n={n}: {total / 1e3:.0f} ms of kernels\n")
        f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
    print(f"profile in {path}", flush=True)


def decode_steps_ms(model, cache, pos, steps=8):
    """Times of ``steps`` one-token decode steps (the text model's own forward, dense, as
    Adapter.generate runs them) on the KV cache the prefill wrote."""
    from mminfer.models.base import _cache_kwarg
    dev = next(model.parameters()).device
    x = torch.randn(1, 1, model.config.hidden_size, device=dev,
                    dtype=next(model.parameters()).dtype)
    last = pos[..., -1:]
    out = []
    with torch.inference_mode():
        for i in range(steps):
            p = last + 1 + i
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            model(inputs_embeds=x, position_ids=p, use_cache=True, **{_cache_kwarg(model): cache})
            ev[1].record()
            torch.cuda.synchronize()
            out.append(ev[0].elapsed_time(ev[1]))
    return out


def dense_layer(model, n, chunk):
    """One decoder layer of the dense prefill ``run_one`` times, at ``n`` tokens, into the
    same kind of cache (dense_probe: warm, median of 3 CUDA-event timed calls)."""
    return dense_probe.probe_layers(model, n, chunk=chunk, cache=lambda: _new_cache(model))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["qwen", "longvila", "both"], default="both")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--dense-full-max", type=int, default=300000)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                    help="tokens per chunk of the prefill's token-wise work")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none",
                    help="fp8: the decoder layers' projections as FP8 layers (the product's "
                    "--quantization fp8, converted from the random bf16 weights)")
    ap.add_argument("--profile", action="store_true",
                    help="one more sparse prefill under torch.profiler: its kernels by device "
                    "time to OUT/prefill_profile_MODEL_N.txt")
    ap.add_argument("--fp8-error", action="store_true",
                    help="instead of timing: the last position's logits of the bf16 model and "
                    "of its FP8 conversion on the same input, their relative error")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    todo = []
    if a.model in ("qwen", "both"):
        todo.append(("qwen", a.lengths or [65536, 131072, 262144]))
    if a.model in ("longvila", "both"):
        todo.append(("longvila", a.lengths or [262144, 524288, 1048576]))
    rows = []
    os.makedirs(a.out, exist_ok=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for kind, lengths in todo:
        t0 = time.time()
        model, head = qwen_7b_text_model("cuda") if kind == "qwen" else longvila_7b("cuda")
        cfg_path = os.path.join(ROOT, "mminfer", "models", "configs", "qwen2_5_vl_7b.json" if kind == "qwen"
                                else "longvila_7b_1m.json")
        patterns = HeadPatternConfig.load(cfg_path)
        if a.fp8_error:
            rows += fp8_error(model, head, kind, a.lengths or [32768], patterns, a.chunk)
            with open(os.path.join(a.out, "prefill_fp8_error.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
            continue
        if a.quantization == "fp8":
            fp8.convert(model, fp8.is_llm_linear)
        print(f"{kind}: built in {time.time() - t0:.0f} s ({a.quantization})", flush=True)
        for n in lengths:
            sp = run_one(model, head, kind, n, "sparse", patterns, a.chunk)
            sp["quantization"] = a.quantization
            rows.append(sp)
            if a.profile:
                profile_prefill(model, head, kind, n, patterns, a.chunk,
                                os.path.join(a.out, f"prefill_profile_{kind}_{n}.txt"))
            print(json.dumps({k: v for k, v in sp.items() if k != "density_per_layer"}),
                  flush=True)
            if n <= a.dense_full_max:
                de = run_one(model, head, kind, n, "dense", patterns, a.chunk)
                de["extrapolated"] = False
            else:
                pr = dense_layer(model, sp["n"], a.chunk)
                de = {"model": kind, "n": sp["n"], "mode": "dense", "extrapolated": True,
                      "attention_ms": pr["attention_total_ms"], "index_ms": 0.0,
                      "llm_other_ms": sp["llm_other_ms"],
                      "ttft_ms": pr["attention_total_ms"] + sp["llm_other_ms"],
                      "dense_layer_ms": pr["attention_ms"],
                      "probe": {k: pr[k] for k in ("layers_timed", "calls", "first_call",
                                                   "attention_calls", "sdpa")}}
            de["speedup"] = de["ttft_ms"] / sp["ttft_ms"]
            rows.append(de)
            print(json.dumps(de), flush=True)
            with open(os.path.join(a.out, "prefill.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "rows": rows}, f, indent=1)
            torch.cuda.empty_cache()
        del model, head
        torch.cuda.empty_cache()
    print(f"{'model':>9} {'N':>8} {'mode':>6} {'TTFT ms':>10} {'index':>8} {'attn':>9} "
          f"{'other':>8} {'density':>8} {'peak GiB':>8} {'speedup':>7}")
    for r in rows:
        if "mode" not in r:     # --fp8-error rows: printed as they came
            continue
        print(f"{r['model']:>9} {r['n']:>8} {r['mode']:>6} {r['ttft_ms']:10.0f} "
              f"{r['index_ms']:8.0f} {r['attention_ms']:9.0f} {r['llm_other_ms']:8.0f} "
              f"{r.get('density_mean', 1.0):8.3f} {r.get('peak_gib', float('nan')):8.1f} "
              f"{r.get('speedup', float('nan')):7.2f}{' (dense extrapolated)' if r.get('extrapolated') else ''}")


if __name__ == "__main__":
    main()
