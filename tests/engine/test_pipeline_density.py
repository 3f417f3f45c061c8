"""A sparse answer's density is counted from its plans inside a stage of its own, so the
stages add up to the total and the count is never in the time to first token; what the
answer reports as a density never exceeds 1 (tile work, which can, is reported as work)."""

import time
from pathlib import Path

import pytest
import torch

from mminfer.engine.pipeline import Pipeline, _sparsity
from mminfer.engine.timing import PIPELINE_STAGES, TOTALS

NEEDLE = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
SLOW_S = 0.25          # per layer: a count slow enough that no gap can hide it


@pytest.fixture(scope="module")
def pipe():
    return Pipeline(None, device="cpu")          # the embedded model, calibrated patterns


def stages_sum(t: dict) -> float:
    return sum(v for k, v in t.items() if k not in TOTALS)


def test_density_is_a_stage_inside_the_total(pipe, monkeypatch):
    from mminfer.kernels import density
    real = density.plan_density
    counted = []

    def slow_density(plan, *a, **kw):
        counted.append(plan.n)
        time.sleep(SLOW_S)
        return real(plan, *a, **kw)

    monkeypatch.setattr(density, "plan_density", slow_density)
    r = pipe.answer(NEEDLE, "What number appears in the video?", fps=2, max_frames=4,
                    max_new_tokens=3, attention="sparse")
    t = r.timings_ms
    assert list(t) == list(PIPELINE_STAGES)
    layers = len(r.sparsity["layers"])
    # once per sparse layer, over the prefix (the video's prompt up to the question)
    assert counted == [r.tokens["prefix"]] * layers
    assert t["density"] >= SLOW_S * layers * 1e3
    # every stage is inside the total and together they are all of it, up to the few
    # untimed statements between them
    gap = t["total"] - stages_sum(t)
    assert -1.0 <= gap <= 50.0 + 0.005 * t["total"], (gap, t)
    # the count comes after the last token: not in the time to first token
    assert t["ttft"] + t["generate"] + t["density"] <= t["total"] + 1.0
    assert t["ttft"] < t["total"] - SLOW_S * layers * 1e3


def test_a_dense_answer_has_nothing_to_count(pipe):
    r = pipe.answer(NEEDLE, "What number appears in the video?", fps=2, max_frames=4,
                    max_new_tokens=2, attention="dense")
    assert r.sparsity is None and r.timings_ms["density"] < 1.0
    assert -1.0 <= r.timings_ms["total"] - stages_sum(r.timings_ms) <= 50.0


def test_making_room_for_a_prefill_is_a_stage_of_its_own(pipe, monkeypatch):
    """The device room a miss's prefill needs (idle cached prefixes moved to the host tier)
    is timed as ``room``, inside the time to first token and the total: without it a load
    run on an 80 GB card had seconds of a new video's TTFT in no stage."""
    real = pipe.video_cache.make_room

    def slow_room(need, wait_s=0.0, **kw):
        time.sleep(SLOW_S)                       # the spill's copies and host allocations
        return real(need, wait_s=wait_s, **kw)

    monkeypatch.setattr(pipe.video_cache, "make_room", slow_room)
    r = pipe.answer(NEEDLE, "What colour is it?", fps=2, max_frames=3, max_new_tokens=2,
                    attention="dense")
    t = r.timings_ms
    assert r.cache == "miss" and t["room"] >= SLOW_S * 1e3
    assert t["ttft"] >= t["room"] + t["vision"]
    assert -1.0 <= t["total"] - stages_sum(t) <= 50.0 + 0.005 * t["total"], t


# The embedded model's config until 2026-12-01: sparse in every head, 2D-boundary heads in
# layer 0 (the shipped one since is dense in most heads: calibration found them hard).
OLD_CONFIG = Path(__file__).resolve().parents[1] / "data" / "embedded_patterns_2026-11-29.json"


def _config(pipe, which):
    from mminfer.sparse.patterns import HeadPatternConfig
    if which == "shipped":
        return pipe.adapter.patterns
    return HeadPatternConfig.load(OLD_CONFIG, expect=pipe.adapter.identity)


def _plans(pipe, frames: int, pats=None) -> dict:
    """The embedded model's plans for a request of ``frames`` 4x4-token frames, from its own
    estimator on random q/k (the plan's counts need no kernel launch)."""
    from mminfer.sparse.estimate import estimate_layer
    from mminfer.sparse.modality import ModalityIndex
    pats = pats or pipe.adapter.patterns
    idx = ModalityIndex.from_segments([("text", 15), ("video", frames, 4, 4, 0), ("text", 8)])
    g = torch.Generator().manual_seed(frames)
    out = {}
    for layer in range(pipe.adapter.identity.layers):
        q = torch.randn(1, 4, idx.n, 64, generator=g)
        k = torch.randn(1, 2, idx.n, 64, generator=g)
        est = estimate_layer(q, k, idx, pats.layer(layer), block_m=16, block_n=16,
                             scale=64 ** -0.5)
        out[layer] = est.build_plan(q.device)
    return out


@pytest.mark.parametrize("config", ["shipped", "2026-11-29"])
@pytest.mark.parametrize("frames", [4, 11, 32, 64])
def test_reported_density_never_exceeds_one(pipe, frames, config):
    pats = _config(pipe, config)
    plans = _plans(pipe, frames, pats)
    raw = {layer: p.density() for layer, p in plans.items()}
    s = _sparsity(plans, pats)
    assert "mean_tile_density" not in s
    assert 0 < s["mean_density"] <= 1 and all(0 < d <= 1 for d in s["per_layer"])
    assert s["per_layer"] == [round(raw[i]["logical"], 6) for i in sorted(raw)]
    assert s["per_layer_tile_work"] == [round(raw[i]["physical"], 6) for i in sorted(raw)]
    assert s["mean_tile_work"] == pytest.approx(
        sum(d["physical"] for d in raw.values()) / len(raw))


def test_tile_work_above_one_is_work_not_density(pipe):
    """535 tokens: the 2D-boundary heads of layer 0 (of the 2026-11-29 config) have windows longer than the prompt, so
    each of their two key groups sweeps every tile: twice a dense pass's work for those heads
    while every pair is computed once."""
    pats = _config(pipe, "2026-11-29")
    plans = _plans(pipe, 32, pats)
    d = plans[0].density()
    assert d["logical"] == pytest.approx(1.0) and d["physical"] > 1.2
    s = _sparsity({0: plans[0]}, pats)
    assert s["mean_density"] == pytest.approx(1.0)
    assert s["mean_tile_work"] == pytest.approx(d["physical"])
