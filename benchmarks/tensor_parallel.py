"""Tensor-parallel prefill on N GPUs against one (issue 15's targets): the product's prefill
engine (mminfer.models.prefill, what Adapter.generate runs) through a decoder sharded by
mminfer.engine.parallel.shard_decoder, full-size Qwen2.5-VL text shapes with random weights,
video-shaped inputs with the real ModalityIndex layout, then greedy decode steps.

    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --shape qwen7b --lengths 524288 --baseline
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --shape qwen72b --lengths 131072

Weights are made layer by layer on each rank's GPU and sharded at once, so a 72B shape
(≈ 145 GB in bf16) never exists whole on one card; every parameter is drawn from a generator
seeded by its name, so the shards of N ranks are slices of the one model's weights.
``--baseline``: rank 0 first runs the same prefill alone with the whole model (TP=1; the
others wait), then every rank runs it sharded; the row gives both times, their ratio, and
how far the sharded logits and tokens are from the baseline's.

Timed: one prefill after a warm-up on the first and last layer (kernel compilation), CUDA
events on each rank, the slowest rank's time reported (``ttft_ms``); ``index``/``attention``
from the prefill's own stage timer (rank 0); then ``--decode-steps`` greedy steps. On the CPU
(``--device cpu --shape tiny``, gloo) it only checks that it runs and that TP=N gives TP=1's
logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from datetime import timedelta
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.engine.parallel import init_from_env, shard_decoder  # noqa: E402
from mminfer.engine.timing import StageTimer  # noqa: E402
from mminfer.models import hooks  # noqa: E402
from mminfer.models.base import _cache_kwarg, _new_cache  # noqa: E402
from mminfer.models.prefill import DEFAULT_CHUNK, prefill  # noqa: E402
from mminfer.sparse.modality import ModalityIndex  # noqa: E402
from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity, default_config  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
# Qwen2.5-VL text configs (the 7B and 72B checkpoints' numbers); the grid is the merged
# tokens of one frame pair (1280x720 video at 560x1008 px: 20 x 36)
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, grid=(4, 4)),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                   grid=(20, 36)),
    "qwen72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                    grid=(20, 36)),
}


def text_config(shape: str, max_len: int):
    from transformers import Qwen2_5_VLConfig
    s = dict(SHAPES[shape])
    s.pop("grid")
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    half = head_dim // 2
    hw = (half - half // 4) // 2
    cfg = Qwen2_5_VLConfig(text_config=dict(
        **s, max_position_embeddings=max(max_len, 32768), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                         "mrope_section": [half - 2 * hw, hw, hw]},
        tie_word_embeddings=False)).text_config
    cfg._attn_implementation = hooks.register()
    return cfg


def _fill(name: str, p: torch.Tensor):
    """Parameter ``name``'s values, the same on every rank and in every TP degree."""
    g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        p.normal_(1.0, 0.1, generator=g)
    else:
        p.normal_(0.0, 0.02, generator=g)


def build(shape: str, max_len: int, device, dtype, rank: int, world: int):
    """The text model and lm_head of ``shape``, random, this rank's shard of every layer."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
    cfg = text_config(shape, max_len)
    with torch.device("meta"):
        model = m.Qwen2_5_VLTextModel._from_config(cfg, dtype=dtype,
                                                    attn_implementation=hooks.register())
        head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
    with torch.no_grad():
        for mod, prefix in ((model.embed_tokens, "embed_tokens"), (model.norm, "norm"),
                            (head, "lm_head")):
            mod.to_empty(device=device)
            for n, p in mod.named_parameters():
                _fill(f"{prefix}.{n}", p)
        for i, layer in enumerate(model.layers):
            layer.to_empty(device=device)                # the whole layer, for a moment
            for n, p in layer.named_parameters():
                _fill(f"layers.{i}.{n}", p)
            if world > 1:
                shard_decoder(SimpleNamespace(config=cfg, layers=[layer]), rank, world)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    with torch.device(device):      # its inverse frequencies, computed where they are used
        model.rotary_emb = type(model.rotary_emb)(config=cfg)
    return model.eval(), head.eval(), cfg


def patterns_for(shape: str, cfg):
    if shape == "qwen7b":
        return HeadPatternConfig.load(os.path.join(ROOT, "mminfer", "models", "configs",
                                                   "qwen2_5_vl_7b.json"))
    return default_config(ModelIdentity(
        id=f"random-{shape}", layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads))


def layout(shape: str, n: int) -> ModalityIndex:
    pre, suf = 20, 30
    h, w = SHAPES[shape]["grid"]
    return ModalityIndex.from_segments([("text", pre), ("video", max(1, (n - pre - suf) // (h * w)),
                                                         h, w, 0), ("text", suf)])


def positions(index, device):
    from mminfer.models.qwen2_5_vl import mrope_positions
    pos, _ = mrope_positions(index, [1.0], 2.0)
    return pos[:, None, :].to(device)


class Clock:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            self.ev[0].record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.ev[1].record()
            torch.cuda.synchronize()
            self.ms = self.ev[0].elapsed_time(self.ev[1])
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def run_one(model, head, cfg, patterns, shape, n, mode, steps, chunk, embeds=None):
    """Warm-up, one timed prefill, ``steps`` greedy decode steps. Returns the row, the last
    logits and the tokens."""
    dev = next(model.parameters()).device
    index = layout(shape, n)
    pos = positions(index, dev)
    if embeds is None:
        embeds = random_embeds(index.n, cfg.hidden_size, dev, next(model.parameters()).dtype)
    warm = hooks.PrefillContext(index=index, patterns=patterns, mode=mode, min_sparse_len=0)
    prefill(model, embeds.clone(), _new_cache(model), pos, chunk=chunk, ctx=warm,
            lm_head=head, layers=[0, len(model.layers) - 1])
    timer = StageTimer(dev)
    ctx = hooks.PrefillContext(index=index, patterns=patterns, mode=mode, min_sparse_len=0,
                               timer=timer, keep_plans=(mode == "sparse"))
    cache = _new_cache(model)
    h = embeds.clone()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with Clock(dev) as clock:
        logits = prefill(model, h, cache, pos, chunk=chunk, ctx=ctx, lm_head=head)
    del h
    stages = timer.totals_ms()
    tokens, step_ms = [int(logits[0, -1].argmax())], []
    kw = {_cache_kwarg(model): cache}
    with torch.inference_mode():
        for i in range(steps):
            x = model.embed_tokens(torch.tensor([[tokens[-1]]], device=dev))
            with Clock(dev) as c:
                hid = model(inputs_embeds=x, position_ids=pos[..., -1:] + 1 + i, use_cache=True,
                            **kw).last_hidden_state
                tokens.append(int(head(hid[:, -1:])[0, -1].argmax()))
            step_ms.append(c.ms)
    row = {"shape": shape, "n": index.n, "mode": mode, "prefill_ms": clock.ms,
           "index_ms": stages.get("index", 0.0), "attention_ms": stages.get("attention", 0.0),
           "decode_step_ms": sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
           "peak_gib": (torch.cuda.max_memory_allocated() / 2**30
                        if dev.type == "cuda" else None),
           "kv_cache_gib": sum(lay.keys.numel() * lay.keys.element_size() * 2
                               for lay in cache.layers) / 2**30}
    if mode == "sparse":
        dens = [p.density()["logical"] for _, p in sorted(ctx.densities.items()) if p is not None]
        row["density_mean"] = sum(dens) / max(len(dens), 1)
    return row, logits[0, -1].float().cpu(), tokens


def random_embeds(n, hidden, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(1, n, hidden, device=device, dtype=dtype, generator=g)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen7b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[524288])
    ap.add_argument("--modes", nargs="+", choices=("sparse", "dense"), default=["sparse"])
    ap.add_argument("--baseline", action="store_true",
                    help="rank 0 also runs each case alone with the whole model (TP=1)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(a.device)
    if world > 1:
        rank, local = init_from_env(world, device.type)
    else:
        rank, local = 0, 0
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # rank 0's TP=1 baseline may take minutes: the others wait on a group that allows it
    wait = dist.new_group(backend="gloo", timeout=timedelta(hours=4)) if world > 1 else None
    max_len = max(a.lengths) + 64
    cases = [(n, mode) for n in a.lengths for mode in a.modes]
    base = {}
    if a.baseline and rank == 0:
        t0 = time.time()
        model, head, cfg = build(a.shape, max_len, device, dtype, 0, 1)
        patterns = patterns_for(a.shape, cfg)
        print(f"TP=1 {a.shape}: built in {time.time() - t0:.0f} s", flush=True)
        for n, mode in cases:
            base[(n, mode)] = run_one(model, head, cfg, patterns, a.shape, n, mode,
                                      a.decode_steps, a.chunk)
            print(json.dumps({"tp": 1, **base[(n, mode)][0]}), flush=True)
        del model, head
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if wait is not None:
        dist.barrier(group=wait)
    t0 = time.time()
    model, head, cfg = build(a.shape, max_len, device, dtype, rank, world)
    patterns = patterns_for(a.shape, cfg)
    if rank == 0:
        print(f"TP={world} {a.shape}: built in {time.time() - t0:.0f} s "
              f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params a rank)",
              flush=True)
    rows = []
    os.makedirs(a.out, exist_ok=True)
    for n, mode in cases:
        index = layout(a.shape, n)
        embeds = random_embeds(index.n, cfg.hidden_size, device, dtype)
        if world > 1:
            dist.broadcast(embeds, src=0)            # one input, whatever each RNG does
        row, logits, tokens = run_one(model, head, cfg, patterns, a.shape, n, mode,
                                      a.decode_steps, a.chunk, embeds)
        if world > 1:
            t = torch.tensor([row["prefill_ms"], row["peak_gib"] or 0.0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=wait)
            seen = [None] * world
            dist.all_gather_object(seen, tokens, group=wait)
            row["ttft_ms"], row["peak_gib_max"] = float(t[0]), float(t[1])
            row["ranks_agree"] = all(s == seen[0] for s in seen)
        else:
            row["ttft_ms"] = row["prefill_ms"]
        row["tp"], row["tokens"] = world, tokens
        if (n, mode) in base:
            b, b_logits, b_tokens = base[(n, mode)]
            row["tp1_ttft_ms"] = b["prefill_ms"]
            row["ratio_to_tp1"] = row["ttft_ms"] / b["prefill_ms"]
            row["tp1_peak_gib"] = b["peak_gib"]
            row["logits_max_diff"] = float((logits - b_logits).abs().max())
            row["logits_scale"] = float(b_logits.abs().max())
            row["tokens_equal_tp1"] = tokens == b_tokens
        if rank == 0:
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, f"tensor_parallel_{a.shape}.json"), "w") as f:
                json.dump({"device": (torch.cuda.get_device_name() if device.type == "cuda"
                                      else "cpu"), "torch": torch.__version__,
                           "world": world, "rows": rows}, f, indent=1)
        del embeds
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"{'shape':>8} {'N':>8} {'mode':>6} {'TP':>3} {'TTFT ms':>10} {'TP1 ms':>10} "
              f"{'ratio':>6} {'peak GiB':>8} {'step ms':>8}")
        for r in rows:
            print(f"{r['shape']:>8} {r['n']:>8} {r['mode']:>6} {r['tp']:>3} "
                  f"{r['ttft_ms']:10.0f} {r.get('tp1_ttft_ms', float('nan')):10.0f} "
                  f"{r.get('ratio_to_tp1', float('nan')):6.3f} "
                  f"{r.get('peak_gib_max', r['peak_gib']) or float('nan'):8.1f} "
                  f"{r['decode_step_ms'] or float('nan'):8.1f}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
