"""Spread queries (``estimation.spread_queries``): columns that only earlier queries attend
to reach the estimate; the setting travels from calibration through the config to serving."""

import json

import pytest
import torch

from mminfer.errors import ConfigError
from mminfer.kernels.reference import plan_attention
from mminfer.offline.calibrate import calibrate, dense_reference, reselect, resize_config
from mminfer.sparse.attention import layer_attention
from mminfer.sparse.estimate import _spread, estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (HeadPattern, HeadPatternConfig, ModelIdentity,
                                     default_config, vertical_slash)


def _landmarks(n=1024, H=2, D=32, seed=0, strength=6.0, rows=(400, 900)):
    """``rows`` (400-899) attend to two landmark keys (a shared direction); the rows after
    them do not: the last 64 queries cannot show those columns, queries from the middle can."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, n, D, generator=g) * 0.3
    k = torch.randn(1, H, n, D, generator=g) * 0.3
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    q -= (q @ u)[..., None] * u            # only the middle rows point at the landmarks
    marks = [150, 333]
    k[0, :, marks] += u * strength
    q[0, :, rows[0]:rows[1]] += u * strength
    v = torch.randn(1, H, n, D, generator=g)
    return q, k, v, marks


def test_spread_positions_are_even_within_the_parts_past_the_first_eighth():
    got = _spread([(0, 1000)], 125, 936, 8)
    assert len(got) == 8 and got == sorted(got) and got[0] >= 125 and got[-1] < 936
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert max(gaps) - min(gaps) <= 1
    # two spans of one modality, the first partly before lo: only what lies in [lo, hi)
    got = _spread([(10, 60), (100, 140)], 40, 130, 10)
    assert len(got) == 10 and all(40 <= p < 60 or 100 <= p < 130 for p in got)
    assert _spread([(0, 10)], 20, 30, 4) == [] and len(_spread([(0, 100)], 0, 3, 8)) == 3


def test_spread_queries_find_columns_the_last_queries_do_not_see():
    q, k, v, marks = _landmarks()
    n, H = q.shape[2], q.shape[1]
    idx = ModalityIndex.from_segments([("text", n)])
    heads = [HeadPattern.single(vertical_slash(n_vertical=4, n_slash=1, window=32, sink=0))] * H
    ref = dense_reference(q, k, v)[0]
    errs = {}
    for spread in (0, 64):
        est = estimate_layer(q, k, idx, heads, block_m=16, block_n=16, spread_q=spread)
        (spec,) = est.specs
        found = [set(spec.verticals[0, h].tolist()) & set(marks) for h in range(H)]
        out = plan_attention(q, k, v, est.build_plan())
        rows = slice(400, 900)
        errs[spread] = float((out[..., rows, :] - ref[..., rows, :]).norm()
                             / ref[..., rows, :].norm())
        if spread:
            assert all(f == set(marks) for f in found), found
        else:
            assert not any(found), found
    assert errs[64] < 0.5 * errs[0], errs


def test_spread_queries_stay_in_the_query_modality():
    idx = ModalityIndex.from_segments([("text", 40), ("video", 10, 4, 4, 0), ("text", 30),
                                       ("video", 20, 4, 4, 0), ("text", 40)])
    n = idx.n
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    from mminfer.sparse.estimate import _Estimator   # the positions the proxy reads
    e = _Estimator(q, k, idx, 16, 16, 64, None, 0.25, True, idx.row_groups(), {}, "torch",
                   {}, 32)
    spans = idx.spans_of("video")
    pos = e._qpos("video")
    assert len(pos) == 96 == len(set(pos)) and pos == sorted(pos)
    assert all(any(s.start <= p < s.end for s in spans) for p in pos)
    assert pos[-64:] == idx.last_positions("video", 64)
    assert any(spans[0].start <= p < spans[0].end for p in pos)   # the first span too
    text = e._qpos("text")
    assert all(not any(s.start <= p < s.end for s in spans) for p in text)
    hp = HeadPattern("q", {"video": vertical_slash(n_vertical=4, n_slash=1, window=16, sink=0),
                           "text": vertical_slash(n_vertical=4, n_slash=1, window=16, sink=0)})
    est = estimate_layer(q, k, idx, [hp] * 2, block_m=16, block_n=16, spread_q=32)
    assert est.build_plan().masks().shape[-1] == n


def test_config_carries_the_setting_and_rejects_bad_values(tmp_path):
    ident = ModelIdentity("m", "local", 2, 2, 1, 32)
    cfg = default_config(ident)
    assert cfg.spread_queries == 0 and "estimation" not in cfg.to_dict()   # old files unchanged
    d = cfg.to_dict()
    d["estimation"] = {"spread_queries": 64}
    back = HeadPatternConfig.from_dict(json.loads(json.dumps(d)))
    assert back.spread_queries == 64 and back.to_dict()["estimation"] == {"spread_queries": 64}
    back.save(tmp_path / "c.json")
    assert HeadPatternConfig.load(tmp_path / "c.json").spread_queries == 64
    for bad, msg in (({"spread_queries": -1}, ">= 0"), ({"spread_queries": "64"}, ">= 0"),
                     ({"last_q": 32}, "unknown field"), ([], "object")):
        d["estimation"] = bad
        with pytest.raises(ConfigError, match=msg):
            HeadPatternConfig.from_dict(d)


def test_calibration_writes_the_setting_and_measures_with_it():
    """A head whose attention sits on landmark columns holds a tight bound only when the
    candidates are estimated with spread queries; the config written says so, and a
    re-selection keeps it."""
    q, k, v, _ = _landmarks(n=512, H=2, rows=(150, 400))
    idx = ModalityIndex.from_segments([("text", 512)])
    cap = {"name": "x", "index": idx.to_dict(),
           "layers": {0: {"q": q, "k": k, "v": v}}}
    ident = ModelIdentity("m", "local", 1, 2, 2, 32)
    results = {}
    for spread in (0, 64):
        cfg, report = calibrate([cap], ident, budgets=[0.1], gammas=[], max_error=0.2,
                                engine="reference", block_m=16, block_n=16, progress=False,
                                spread_q=spread)
        results[spread] = max(r["best_sparse"]["error"] for r in report)
        assert cfg.spread_queries == spread
        assert ("estimation" in cfg.to_dict()) == bool(spread)
    assert results[64] < results[0]
    new, _ = reselect(cfg, report, idx, max_error=0.5)
    assert new.spread_queries == 64
    assert resize_config(cfg, idx, 512, 0.2, block_m=16, block_n=16).spread_queries == 64


def test_layer_attention_passes_the_setting_to_estimation():
    q, k, v, marks = _landmarks(n=512, rows=(150, 400))
    idx = ModalityIndex.from_segments([("text", 512)])
    heads = [HeadPattern.single(vertical_slash(n_vertical=4, n_slash=1, window=32, sink=0))] * 2
    _, plan0 = layer_attention(q, k, v, idx, heads, return_plan=True, engine="reference")
    _, plan1 = layer_attention(q, k, v, idx, heads, return_plan=True, engine="reference",
                               spread_q=64)
    v0 = set(plan0.specs[0].verticals[0, 0].tolist())
    v1 = set(plan1.specs[0].verticals[0, 0].tolist())
    assert set(marks) <= v1 and not set(marks) & v0


def test_the_transformers_hook_estimates_with_the_configs_setting(monkeypatch):
    from types import SimpleNamespace

    import mminfer.sparse.attention as attn_mod     # where the layer's entry point calls it
    from mminfer.models import hooks
    seen = []
    real = attn_mod.estimate_layer

    def spy(*a, **kw):
        seen.append(kw.get("spread_q"))
        return real(*a, **kw)

    monkeypatch.setattr(attn_mod, "estimate_layer", spy)
    q, k, v, _ = _landmarks(n=512, rows=(150, 400))
    idx = ModalityIndex.from_segments([("text", 512)])
    cfg = default_config(ModelIdentity("m", "local", 1, 2, 2, 32))
    cfg.estimation = {"spread_queries": 48}
    ctx = hooks.PrefillContext(index=idx, patterns=cfg, mode="sparse", engine="reference")
    with hooks.prefill_context(ctx):
        out, _ = hooks.attention_forward(SimpleNamespace(layer_idx=0), q, k, v, None)
    assert seen == [48] and out.shape == (1, 512, 2, 32)


def test_the_fused_proxy_reads_spread_queries_in_sets_of_64_and_gives_the_torch_estimate(
        monkeypatch):
    """proxy="triton" (the GPU default; the interpreter here) splits a query set of 64 last +
    spread queries into sets of at most 64 within the layer's one proxy_sets call, and its
    sums give the verticals and slashes of the PyTorch proxy over the whole set."""
    import mminfer.sparse.estimate as P        # where estimate_layer looks proxy_sets up
    from test_estimate import _FUSED_HEADS, _mixed, _same_lines
    idx, q, k, _ = _mixed()
    ref = estimate_layer(q, k, idx, _FUSED_HEADS, block_m=16, block_n=16, spread_q=40)
    calls = []
    real = P.proxy_sets
    monkeypatch.setattr(P, "proxy_sets", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    got = estimate_layer(q, k, idx, _FUSED_HEADS, block_m=16, block_n=16, proxy="triton",
                         spread_q=40)
    (sets,) = calls
    sizes = [sum(n for _, n in s.runs) for s in sets]
    assert max(sizes) <= 64 and sum(sizes) > 3 * 64       # every set read, in parts
    _same_lines(ref, got)
