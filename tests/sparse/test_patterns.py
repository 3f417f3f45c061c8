"""Head patterns and their config files: defaults, validation, round trips, shipped configs."""

import json
from pathlib import Path

import numpy as np
import pytest

from mminfer.errors import ConfigError
from mminfer.sparse.patterns import (KNOWN_MODELS, HeadPattern, HeadPatternConfig, ModelIdentity,
                              Pattern, a_shape, default_config, grid, vertical_slash)

ROOT = Path(__file__).resolve().parents[2]
QWEN = KNOWN_MODELS["Qwen/Qwen2.5-VL-7B-Instruct"]
LONGVILA = KNOWN_MODELS["Efficient-Large-Model/qwen2-7b-longvila-1M"]


def test_pattern_defaults_and_fields():
    g = grid()
    assert (g.lines, g.sink, g.window, g.min_lift) == ("both", 128, 6144, 3.0)
    assert g.fallback == vertical_slash()
    assert a_shape().params() == {"sink": 128, "window": 4096}
    assert Pattern("dense").to_dict() == {"kind": "dense"}
    with pytest.raises(ConfigError, match="kind 'strided'"):
        Pattern("strided")
    with pytest.raises(ConfigError, match="has no field 'top_k'"):
        Pattern("a_shape", top_k=3)
    with pytest.raises(ConfigError, match="non-grid"):
        grid(fallback=grid())
    with pytest.raises(ConfigError, match="lines"):
        grid(lines="diagonal")
    with pytest.raises(ConfigError, match="window must be an int >= 0"):
        a_shape(window=-1)


def test_head_pattern_regions():
    hp = HeadPattern("q", {"video": grid(), "text": vertical_slash()})
    assert hp.for_region("video").kind == "grid"
    assert hp.for_region("image").kind == "grid"        # image falls back to video's pattern
    assert hp.for_region("text").kind == "vertical_slash"
    d2 = HeadPattern("2d", {"video->text": a_shape(), "all": vertical_slash()})
    assert d2.for_region("video", "text").kind == "a_shape"
    assert d2.for_region("text", "video").kind == "vertical_slash"
    with pytest.raises(ConfigError, match="'all'"):
        HeadPattern("none", {"video": grid()})
    with pytest.raises(ConfigError, match="qmod->kmod"):
        HeadPattern("2d", {"video": grid()})


def test_config_round_trip_and_ranks(tmp_path):
    cfg = default_config(QWEN)
    path = tmp_path / "c.json"
    cfg.save(path)
    back = HeadPatternConfig.load(path, expect=QWEN)
    assert back.layers == cfg.layers and back.identity == QWEN and back.uncalibrated
    # Saving again is byte-identical (names kept, one layer per line).
    back.save(tmp_path / "d.json")
    assert (tmp_path / "d.json").read_text() == path.read_text()
    assert len(back.layer(5)) == 28
    # Tensor parallel: rank r of 4 (7 local heads) holds global heads 7r .. 7r+6.
    assert back.heads_for_rank(5, 2, 7) == back.layer(5)[14:21]
    assert back.heads_for_rank(5, 2, 7)[0].boundary == "k"     # global head 14 = 7 * 2
    with pytest.raises(ConfigError, match="rank 4"):
        back.heads_for_rank(5, 4, 7)


@pytest.mark.parametrize("name,identity", [("qwen2_5_vl_7b.json", QWEN),
                                           ("longvila_7b_1m.json", LONGVILA)])
def test_shipped_configs_load(name, identity):
    cfg = HeadPatternConfig.load(ROOT / "mminfer" / "models" / "configs" / name, expect=identity)
    assert cfg.uncalibrated is True
    assert len(cfg.layers) == 28 and all(len(row) == 28 for row in cfg.layers)
    kinds = {p.kind for row in cfg.layers for hp in row for p in hp.patterns.values()}
    assert {"grid", "vertical_slash", "a_shape"} <= kinds
    assert {hp.boundary for row in cfg.layers for hp in row} == {"q", "k", "none"}
    for key in ("date", "calibration_inputs", "objective", "budgets", "device"):
        assert key in cfg.provenance


def _bad(tmp_path, mutate):
    d = default_config(QWEN).to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("mutate,expect,message", [
    (lambda d: None, ModelIdentity("Qwen/Qwen2.5-VL-7B-Instruct", "main", 28, 12, 4, 128),
     "config model.heads = 28 but the model has 12"),
    (lambda d: None, ModelIdentity("Qwen/Qwen2-VL-7B-Instruct", "main", 28, 28, 4, 128),
     "config model.id = 'Qwen/Qwen2.5-VL-7B-Instruct' but the model has 'Qwen/Qwen2-VL"),
    (lambda d: d.update(schema_version=7), QWEN, "schema_version = 7 but this mminfer reads 1"),
    (lambda d: d["patterns"]["a_shape"]["patterns"]["all"].update(kind="strided"), QWEN,
     "patterns.a_shape.patterns.all.kind = 'strided' is not one of"),
    (lambda d: d["model"].pop("head_dim"), QWEN, "missing field model.head_dim"),
    (lambda d: d.pop("provenance"), QWEN, "missing field 'provenance'"),
    (lambda d: d["patterns"]["k_vs"]["patterns"]["all"].update(n_slash="many"), QWEN,
     "n_slash must be an int"),
    (lambda d: d["layers"].pop(), QWEN, "config has 27 layers but model.layers = 28"),
    (lambda d: d["layers"][3]["heads"].update({"28": "k_vs"}), QWEN,
     r"layers\[3\].heads: head '28' is not in \[0, 28\)"),
    (lambda d: d["layers"][0].update(default="nope"), QWEN, "names pattern 'nope'"),
    (lambda d: d["patterns"]["q_grid"].update(boundary="x"), QWEN, "boundary = 'x'"),
])
def test_config_validation_errors(tmp_path, mutate, expect, message):
    path = _bad(tmp_path, mutate)
    with pytest.raises(ConfigError, match=message) as err:
        HeadPatternConfig.load(path, expect=expect)
    assert str(path) in err.value.message


def test_config_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        HeadPatternConfig.load(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        HeadPatternConfig.load(tmp_path / "x.json")


# ---------------------------------------------------------------------- density claim
def replay_grid_density(n, start, end, stride, phase, sink, window, BM, BN):
    """The kernel's traversal for one grid head (lines both, no row groups), replayed in
    numpy: (logical, physical): pairs over the causal triangle, tiles over a dense pass's
    tiles. Used for the 1M claim in configs/README.md; checked against the kernel's count
    mode and against plan.density() below."""
    r0 = np.arange(0, n, BM, dtype=np.int64)
    r1 = np.minimum(r0 + BM, n)
    lo = np.maximum(r0 - window, 0)
    c_hi = np.minimum(end, lo)
    skip = max(max(sink, start) - start - phase, 0)
    j0 = start + phase + -(-skip // stride) * stride
    ncols = np.maximum(-(-(c_hi - j0) // stride), 0)
    n_full = (r0 - lo) // BN
    tiles = int((-(-np.minimum(sink, lo) // BN) + -(-ncols // BN) + n_full
                 + -(-(r1 - lo - n_full * BN) // BN)).sum())
    i = np.arange(n, dtype=np.int64)
    blk = i // BM
    on = (i >= start) & (i < end) & ((i - start) % stride == phase)
    logical = np.where(on, i + 1, i - lo[blk] + 1 + np.minimum(sink, lo[blk]) + ncols[blk]).sum()
    first = start + phase
    n_lines = -(-(end - first) // stride)
    for t in range(-(-n_lines // BM)):
        tiles += -(-(first + (min((t + 1) * BM, n_lines) - 1) * stride + 1) // BN)
    tri = n * (n + 1) / 2
    nf = r0 // BN
    dense = int((nf + -(-(r1 - nf * BN) // BN)).sum())
    return logical / tri, tiles / dense


def test_default_grid_density_at_1m():
    from mminfer.kernels import Grid, SparsePlan
    from mminfer.kernels.density import counts, summarise
    from mminfer.kernels.runtime import CPU_CONFIG
    from mminfer.sparse.modality import ModalityIndex

    # The replay equals the kernel's own count (interpreter, CPU tile width) at small N ...
    idx = ModalityIndex.longvila(100, 11, 256, 60)
    vs = idx.visual_spans()[0]
    args = dict(start=vs.start, end=vs.end, stride=257, phase=7, sink=128, window=300)
    plan = SparsePlan.build(idx.n, 1, [Grid([0], lines="both", **args)], block_m=64,
                            block_n=16, device="cpu")
    d = plan.density()
    logical, physical = replay_grid_density(idx.n, BM=64, BN=CPU_CONFIG["BLOCK_N"], **args)
    assert d["logical"] == pytest.approx(logical, rel=1e-9)
    assert d["physical"] == pytest.approx(physical, rel=1e-9)
    # ... so at 1M tokens (LongVILA: 257 tokens per frame, 128 x 64 GPU tiles) the default
    # grid pattern costs about 2 % of a dense pass; plan.density() (counted from the plan's
    # arrays, no launch) says the same at that length.
    g = grid()
    idx = ModalityIndex.longvila(100, (1 << 20) // 257, 256, 100)
    vs = idx.visual_spans()[0]
    logical, physical = replay_grid_density(idx.n, vs.start, vs.end, 257, 5, g.sink, g.window,
                                            BM=128, BN=64)
    assert 0.017 < logical < 0.023 and 0.017 < physical < 0.023
    plan = SparsePlan.build(idx.n, 1, [Grid([0], vs.start, vs.end, 257, 5, lines="both",
                                            sink=g.sink, window=g.window)],
                            block_m=128, block_n=64, device="cpu")
    d = summarise(plan, counts(plan, block_n_tile=64))
    assert d["logical"] == pytest.approx(logical, rel=1e-12)
    assert d["physical"] == pytest.approx(physical, rel=1e-12)
