"""engine/rerun.py: what a sparse request keeps for the shadow monitor's dense re-run, and the
re-run. On the embedded model: the kept inputs are a copy (the prefill overwrites its input),
the re-run answers what a dense request answers, and a cancel check stops it between layers.
On a GPU, also the pinned copy ordered before the prefill, and the dense-equivalent and
tiny-budget configs through the real sparse kernels."""

from pathlib import Path

import numpy as np
import pytest
import torch

from mminfer.engine.rerun import dense_rerun, finish, inputs_nbytes, keep_inputs
from mminfer.errors import Cancelled

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
NEEDLE = ROOT / "samples" / "videos" / "needle_0.mp4"
QUESTION = "What number appears in the video?"
N_FRAMES, SIZE = 20, 224          # scripts/make_samples.py's samples: 10 s at 2 fps, 224 px


def kl(dense_logits, sparse_logits) -> float:
    ld = torch.log_softmax(dense_logits.double(), -1)
    ls = torch.log_softmax(sparse_logits.double(), -1)
    return float((ld.exp() * (ld - ls)).sum())


def count_layers(adapter):
    """Layers entered since the call (input_layernorm runs first in each), and the hooks."""
    seen = []
    hooks = [layer.input_layernorm.register_forward_pre_hook(lambda *_, i=i: seen.append(i))
             for i, layer in enumerate(adapter.text_model.layers)]
    return seen, hooks


def assert_cancels_after_two_layers(ad, kept):
    """A re-run asked to stop once two layers ran stops there, in layer 2."""
    seen, hooks = count_layers(ad)
    try:
        with pytest.raises(Cancelled, match="layer 2"):
            dense_rerun(ad, kept, max_new_tokens=8, cancel=lambda: len(seen) >= 2)
    finally:
        for h in hooks:
            h.remove()
    assert seen == [0, 1]


def test_dense_rerun_is_the_dense_answer_and_stops_between_layers():
    from mminfer import video as videolib
    from mminfer.engine.pipeline import Pipeline

    pipe = Pipeline(None, device="cpu")
    ad = pipe.adapter
    dense = pipe.answer(NEEDLE, QUESTION, attention="dense", max_new_tokens=8,
                        keep_for_shadow=True)
    # a dense prefill keeps nothing (nothing to compare), and to_dict never shows the field
    assert dense.shadow is None and "shadow" not in dense.to_dict()
    prep = ad.prepare(videolib.decode(str(NEEDLE), fps=2.0, max_frames=768,
                                      sampling=ad.sampling), QUESTION)
    embeds = ad.embed(prep)
    positions = ad.positions(prep, 0, prep.input_ids.shape[1])
    assert keep_inputs(ad, prep, embeds, inputs_nbytes(embeds, positions) - 1) is None
    kept = keep_inputs(ad, prep, embeds, None)
    assert kept.nbytes == inputs_nbytes(embeds, positions) and kept.tokens == prep.total_tokens
    assert kept.embeds is not embeds and torch.equal(kept.embeds, embeds)
    with torch.inference_mode():
        embeds.zero_()                               # what the prefill does to its input
    assert kept.embeds.abs().sum() > 0
    kept.sparse_tokens = [0] * 8                     # the comparison's length: 8 tokens
    kept.answer_positions = ad.positions(prep, kept.tokens, 8)
    run = dense_rerun(ad, kept, max_new_tokens=8)
    assert run.text == dense.answer and len(run.token_ids) == dense.tokens["generated"]
    assert run.logits.shape == (ad.lm_head.out_features,)
    again = dense_rerun(ad, kept, max_new_tokens=8)          # kept is intact after a re-run
    assert again.token_ids == run.token_ids and torch.equal(again.logits, run.logits)

    assert_cancels_after_two_layers(ad, kept)


@pytest.mark.gpu
def test_kept_inputs_and_rerun_on_cuda():
    """The embedded model in bf16 on a GPU, the needle sample's frames rendered (no decoder
    needed): the pinned copy holds the embeddings as they were before the sparse prefill
    overwrote them; the re-run gives the tokens a dense generate gives; a dense-equivalent
    config is KL ~ 0 from dense, the tiny budget is not; a cancel check (after its sync)
    stops between layers."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mminfer.engine.pipeline import Pipeline
    from mminfer.video import DecodedVideo
    from mminfer.models.hooks import PrefillContext
    from mminfer.sparse.patterns import HeadPatternConfig
    from mminfer.offline import synthetic as synth

    pipe = Pipeline(None, device="cuda")
    ad = pipe.adapter
    ex = synth.needle(1000, n_frames=N_FRAMES, height=SIZE, width=SIZE)   # needle_0.mp4's
    video = DecodedVideo(frames=ex.frames, timestamps=np.arange(N_FRAMES) / 2.0,
                         indices=np.arange(N_FRAMES), fps=2.0, sampled_fps=2.0,
                         duration=N_FRAMES / 2.0, width=SIZE, height=SIZE, backend="synthetic")
    kls = {}
    for config in ("embedded_dense_equivalent.json", "embedded_tiny_budget.json"):
        ad.patterns = HeadPatternConfig.load(DATA / config, expect=ad.identity)
        prep = ad.prepare(video, QUESTION)
        embeds = ad.embed(prep)
        before = embeds.clone()
        kept = keep_inputs(ad, prep, embeds)
        ctx = PrefillContext(index=prep.index, patterns=ad.patterns, mode="sparse",
                             min_sparse_len=0, unavailable=pipe.sparse_unavailable,
                             keep_plans=True)
        gen = ad.generate(prep, max_new_tokens=8, ctx=ctx, embeds=embeds)
        assert ctx.sparse
        finish(kept, ad, prep, gen, None)
        assert kept.embeds.device.type == "cpu" and kept.embeds.is_pinned()
        assert torch.equal(kept.embeds, before.cpu())
        run = dense_rerun(ad, kept, max_new_tokens=8)
        dense = ad.generate(prep, max_new_tokens=8, ctx=PrefillContext(mode="dense"),
                            embeds=before.clone())
        steps = min(8, len(gen.token_ids))
        assert run.token_ids == dense.token_ids[:steps]
        assert torch.allclose(run.logits, dense.prefill_logits.float().cpu(), atol=1e-3)
        kls[config] = kl(run.logits, kept.sparse_logits)
    assert kls["embedded_dense_equivalent.json"] < 5e-3, kls
    assert kls["embedded_tiny_budget.json"] > 0.1, kls

    assert_cancels_after_two_layers(ad, kept)
