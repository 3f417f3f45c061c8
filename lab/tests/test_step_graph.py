"""lab/experiments/step_graph.py: the whole batched decode step as one function over device
state gives each answer the greedy tokens of the product's batched step (LeanDecoder
.step_many) over the same caches — forks of one kept prefix, a fork in its prefix's tail and
a cache of its own side by side — in the model's dtype and FP8, and leaves the caches'
lengths and rows as the product's steps leave them."""

from pathlib import Path

import pytest
import torch

from lab.experiments.step_graph import WholeStep
from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from mminfer.models import decode
from mminfer.models.base import Conversation
from mminfer.models.kv import ForkKV, kv_dtype

CLIP = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
STEPS = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ad = Pipeline(str(save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("ckpt") / "q")),
                  attention="dense", device="cpu").adapter
    decoded = videolib.decode(str(CLIP), sampling=ad.sampling, fps=2.0, max_frames=4)
    prep = ad.prepare(decoded, Conversation.single("what number appears?"))
    return ad, prep, ad.embed(prep)


def _answers(ad, prep, embeds):
    """Four answers after their question's rows: three forks of one kept prefix (the first in
    its tail), one cache of its own. Returns (caches, last tokens, next positions)."""
    P = prep.prefix_len
    suffix = embeds[:, P:]
    S = suffix.shape[1]
    emb = ad.text_model.get_input_embeddings()
    g = torch.Generator().manual_seed(0)
    shared = ad.prefill_prefix(prep, embeds.clone(), headroom=64)     # a tail of 64 rows
    caches = [ForkKV(shared, P, headroom=2, claim=True), ForkKV(shared, P, headroom=2),
              ForkKV(shared, P, headroom=2), ad.prefill_prefix(prep, embeds.clone())]
    toks = []
    with torch.inference_mode():
        for c in caches:
            q = suffix.clone()
            q[:, :-2] = emb(torch.randint(0, emb.num_embeddings, (1, S - 2), generator=g))
            logits = ad.lm_head(ad._step(q, ad.positions_after(prep.rope_delta, P, S), c))
            toks.append(int(logits[:, -1].argmax(-1)))
    pos = [ad.positions_after(prep.rope_delta, c.get_seq_length(), 1) for c in caches]
    return caches, toks, pos


@pytest.mark.parametrize("kv", [None, "fp8"])
def test_the_whole_step_decodes_as_the_products_batched_step(tiny, kv):
    ad, prep, embeds = tiny
    dec = decode.decoder_of(ad)
    saved = ad.kv_cache_dtype
    ad.kv_cache_dtype = kv_dtype(kv) if kv else None
    try:
        caches, toks, pos = _answers(ad, prep, embeds)
        want = [[] for _ in caches]
        with torch.inference_mode():
            last, p = list(toks), list(pos)
            for _ in range(STEPS):
                logits = dec.step_many(last, p, caches)
                last = logits.argmax(-1).tolist()
                for w, t in zip(want, last):
                    w.append(t)
                p = [ad.positions_after(prep.rope_delta, c.get_seq_length(), 1) for c in caches]
        ref_rows = [[(layer.keys.clone(), layer.values.clone()) for layer in c.layers]
                    for c in caches]

        caches, toks, pos = _answers(ad, prep, embeds)
        with torch.inference_mode():
            ws = WholeStep(dec, caches, toks, pos, STEPS, split=32)
            assert ws.groups[:, 0].tolist().count(2) == 1     # forks 2 and 3 read it once
            assert caches[0].in_tail and not caches[1].in_tail
            got = ws.run()
            ws.sync()
        assert got == want
        assert len({t for w in want for t in w}) > 2
        torch.testing.assert_close(ws.logits, logits, atol=1e-4, rtol=1e-4)
        for c, rows in zip(caches, ref_rows):
            for layer, (k, v) in zip(c.layers, rows):
                assert layer.keys.shape == k.shape
                torch.testing.assert_close(layer.keys.float(), k.float(), atol=1e-5, rtol=0)
                torch.testing.assert_close(layer.values.float(), v.float(), atol=1e-5, rtol=0)
    finally:
        ad.kv_cache_dtype = saved


def test_the_benchmark_runs_on_the_cpu():
    """`python -m lab.experiments.step_graph --tiny`: both cases give the product's tokens."""
    from lab.experiments import step_graph
    rows = step_graph.main(["--tiny"])["rows"]
    assert [r["case"] for r in rows] == ["fork", "each"]
    assert all(r["same_tokens"] for r in rows)
