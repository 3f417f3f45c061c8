"""Calibration measures what is served (mminfer/offline/served_policy.py): a served run on
kept inputs is the server's answer (the prefix sparse from its own last queries, the question
dense over its cache), bit for bit in tokens and to rounding in logits; the calibration's
steps choose the cheapest rung that holds the thresholds, and what they report is what the
config does when measured again."""

import os
from pathlib import Path

import pytest
import torch

from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from mminfer.offline import served_policy as SP
from mminfer.offline.capture import load_video
from mminfer.sparse.patterns import HeadPatternConfig

ROOT = Path(__file__).resolve().parents[2]
VIDEO = ROOT / "samples" / "videos" / "count_0.mp4"
QUESTION = "How many times does the dot flash?"
TINY = ROOT / "tests" / "data" / "embedded_tiny_budget.json"


@pytest.fixture(scope="module")
def pipe():
    return Pipeline(None, attention="dense", device="cpu")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="sparse prefill needs a GPU or TRITON_INTERPRET=1")
def test_a_served_run_is_the_servers_answer(pipe):
    ad = pipe.adapter
    shipped = ad.patterns
    tiny = HeadPatternConfig.load(TINY)
    decoded = videolib.decode(str(VIDEO), sampling=ad.sampling, fps=2.0, max_frames=768)
    inp = SP.prepare(ad, decoded, QUESTION, "count_0")
    try:
        for attention, cfg in (("dense", None), ("sparse", tiny)):
            ad.patterns = cfg or shipped
            got = pipe.answer(VIDEO, QUESTION, attention=attention, max_new_tokens=8,
                              use_cache=False, keep_for_shadow=True)
            run = SP.run_served(ad, inp, cfg, max_new_tokens=8)      # the kernels, as served
            assert inp.tokens == got.tokens["total"] and inp.prefix_len == got.tokens["prefix"]
            assert ad.tokenizer.decode([t for t in run.token_ids if t not in ad.eos_token_ids],
                                       skip_special_tokens=True).strip() == got.answer
            if cfg is not None:        # the server kept its logits and tokens for the shadow
                assert run.token_ids == got.shadow.sparse_tokens
                torch.testing.assert_close(run.logits, got.shadow.sparse_logits, rtol=1e-4,
                                           atol=1e-4)
                assert run.density == pytest.approx(got.sparsity["mean_density"], abs=1e-6)
    finally:
        ad.patterns = shipped
    # the exact reference engine (what calibration measures with on a CPU) gives the same
    ref = SP.run_served(ad, inp, tiny, max_new_tokens=8, engine="reference", block=(16, 16))
    assert ref.token_ids == run.token_ids
    torch.testing.assert_close(ref.logits, run.logits, rtol=1e-4, atol=1e-4)
    # the tiny budget moves this answer: the comparison says so
    dense = SP.run_served(ad, inp, None, max_new_tokens=8)
    c = SP.compare(dense, ref)
    assert c["kl"] > 0.1 and not c["answer_agree"]
    assert SP.compare(dense, dense) == {"kl": 0.0, "argmax_agree": True, "answer_agree": True,
                                        "density": None}


def test_calibration_steps_choose_the_cheapest_rung_that_holds(pipe):
    ad = pipe.adapter
    inputs = []
    for spec in ("synth:needle:8:910000", "synth:count:8:910001"):
        decoded, question, name = load_video(spec, ad, "")
        inputs.append(SP.prepare(ad, decoded, question, name))
    cal = SP.ServedCalibration(ad, inputs, min_agreement=1.0, max_kl=0.02)
    whats = []
    for step in cal.steps():               # offline: nothing to wait for, no None
        step()
        whats.append(step.what)
    assert whats[:2] == [f"dense reference of {i.name}" for i in inputs]
    assert [w for w in whats if "search" in w] == [f"per-head search of layer {i}"
                                                  for i in range(4)]
    assert cal.winner is not None and all(i.capture is None for i in inputs)   # freed
    # tried loosest first; every looser rung failed a threshold, the winner holds both
    tried = [r for r in cal.rungs if r.rows]
    assert [r.bound for r in tried] == sorted([r.bound for r in tried], reverse=True)
    assert tried[-1] is cal.winner
    for r in tried[:-1]:
        s = r.summary()
        assert s["agreement"] < 1.0 or s["mean_kl"] > 0.02
    s = cal.winner.summary()
    assert s["n"] == 2 and s["agreement"] == 1.0 and s["mean_kl"] <= 0.02
    # what it reports is what the config does, measured again
    cfg = cal.config()
    assert not cfg.uncalibrated and cfg.provenance["served_policy"]["calibration"]["n"] == 2
    again = [SP.compare(i.reference, SP.run_served(ad, i, cfg, max_new_tokens=4,
                                                   engine="reference", block=(16, 16)))
             for i in inputs]
    assert SP.summarize(again)["mean_kl"] == pytest.approx(s["mean_kl"], rel=1e-6, abs=1e-9)
    # a winner turned down elsewhere (the server's gate): the next tighter rung that holds,
    # the rungs already scored not measured again
    scored = {r.bound: list(r.rows) for r in tried}
    first = cal.winner
    for step in cal.ladder_steps(tighter_than=first.bound):
        step()
    assert all(r.rows == scored[r.bound] for r in tried)
    assert cal.winner is None or (cal.winner.bound < first.bound and
                                  SP.holds(cal.winner.summary(), 1.0, 0.02))
    # a step stopped by its cancel check raises and can be run again
    from mminfer.errors import Cancelled
    before = inputs[0].reference
    step = cal.reference_step(inputs[0])
    with pytest.raises(Cancelled):
        step(lambda: True)
    assert inputs[0].reference is before
    step()
    assert inputs[0].reference.token_ids == before.token_ids


def _kinds(cfg) -> set:
    return {p.kind for row in cfg.layers for hp in row for p in hp.patterns.values()
            if p.kind != "dense"}


def _dense_heads(cfg) -> int:
    return sum(all(p.kind == "dense" for p in hp.patterns.values())
               for row in cfg.layers for hp in row)


def test_the_ladder_draws_from_the_settings_families_and_hard(pipe):
    """The server's ladder and `mminfer calibrate`'s are one (ServedCalibration): its
    settings' ``families`` limit what the search measures and every rung chooses among, and
    ``hard`` decides what a head no candidate holds a rung's bound for becomes."""
    from dataclasses import replace
    ad = pipe.adapter
    base = replace(SP.SearchSettings.for_device(ad.device), bounds=(0.001, 0.5))

    def prepared():
        decoded, question, name = load_video("synth:needle:8:910000", ad, "")
        return [SP.prepare(ad, decoded, question, name)]

    def searched(settings):
        cal = SP.ServedCalibration(ad, prepared(), settings=settings)
        steps = cal.steps()
        for step in steps:                  # references and the search, up to the ladder
            if step.what.startswith("rung"):
                return cal
            step()

    full = searched(base)
    # on a prefix of text and video the search builds every family --families may name
    from mminfer.offline.cli import FAMILIES
    assert sorted(full.head_config.provenance["candidates"]) == sorted(FAMILIES)

    def rungs(**kw):
        """The rungs under other settings, from the full search's numbers."""
        cal = SP.ServedCalibration(ad, full.inputs, settings=replace(base, **kw))
        cal.head_config, cal.head_report = full.head_config, full.head_report
        assert next(cal.steps()).what.startswith("rung")
        return {r.bound: r.config for r in cal.rungs}

    default, grid, best = rungs(), rungs(families=("grid",)), rungs(hard="best")
    assert _kinds(default[0.5]) - {"grid"}
    assert _kinds(grid[0.5]) == {"grid"} and _kinds(grid[0.001]) <= {"grid"}
    assert _dense_heads(default[0.001]) > 0 and _dense_heads(best[0.001]) == 0
    assert best[0.001].provenance["hard"] == "best"
    # the server's own search (no search given) measures only the families it is set to
    own = searched(replace(base, families=("grid",)))
    assert {lab.split("@")[0] for r in own.head_report for lab in r["candidates"]} == {"grid"}
    assert all(_kinds(r.config) <= {"grid"} for r in own.rungs)


def test_the_per_head_search_runs_on_the_models_device(monkeypatch):
    """The captures wait on the host; each layer's search gets them on the model's device (on
    a GPU the kernels read nothing else: an H100 stopped self-calibration at layer 0 with
    "cannot be accessed from Triton (cpu tensor?)"). Here the model's device is PyTorch's
    meta device, which no CPU tensor is on."""
    from types import SimpleNamespace

    seen = []

    def search(caps, identity, **kw):
        seen.extend(t.device.type for c in caps for lay in c.layers.values() for t in lay)
        return None

    monkeypatch.setattr(SP, "calibrate", search)
    ad = SimpleNamespace(device=torch.device("meta"), identity=None)
    qkv = tuple(torch.zeros(1, 2, 8, 4) for _ in range(3))
    inp = SimpleNamespace(name="a", prefix_index=None, capture={0: qkv, 1: qkv})
    cal = SP.ServedCalibration(ad, [inp])
    steps = cal._search([inp])
    next(steps)(None)
    assert seen == ["meta"] * 3
    assert all(t.device.type == "cpu" for t in inp.capture[0])      # the host copy stays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_served_calibration_runs_its_steps_on_a_gpu():
    """Every step of the served calibration on a GPU, as a server runs them in idle time: the
    dense references (captures to the host), the per-head search with the kernels (captures
    back on the device, a layer at a time), the ladder scored sparse. The CPU tests measure
    with the reference engine on CPU tensors, where a tensor left on the wrong device does not
    show."""
    gpipe = Pipeline(None, attention="dense", device="cuda")
    ad = gpipe.adapter
    inputs = []
    for spec in ("synth:needle:8:910000", "synth:count:8:910001"):
        decoded, question, name = load_video(spec, ad, "")
        inputs.append(SP.prepare(ad, decoded, question, name))
    cal = SP.ServedCalibration(ad, inputs)
    assert cal.engine == "kernel"
    whats = []
    for step in cal.steps():
        step()
        whats.append(step.what)
    layers = ad.identity.layers
    assert [w for w in whats if "search" in w] == [f"per-head search of layer {i}"
                                                  for i in range(layers)]
    assert any(r.rows for r in cal.rungs) and all(i.capture is None for i in inputs)
    if cal.winner is not None:
        assert not cal.config().uncalibrated
