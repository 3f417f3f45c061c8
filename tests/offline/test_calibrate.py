"""Offline search: blockwise dense reference, per-head cost, per-head choice, the CLI entry."""

import argparse
import json

import pytest
import torch

from mminfer.offline.calibrate import calibrate, dense_reference, head_density
from mminfer.offline.command import run
from mminfer.offline.cli import add_arguments
from mminfer.errors import ConfigError
from mminfer.sparse.estimate import estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (HeadPattern, HeadPatternConfig, ModelIdentity, a_shape, grid,
                              vertical_slash)

IDENTITY = ModelIdentity("toy/model", "main", layers=2, heads=2, kv_heads=2, head_dim=32)


def _capture(n=160, D=32, seed=0):
    """Head 0 attends locally (slow rotary on both q and k); head 1 to four early key columns."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n, D, generator=g) * 0.2
    k = torch.randn(1, 2, n, D, generator=g) * 0.2
    v = torch.randn(1, 2, n, D, generator=g)
    i = torch.arange(n).float()
    theta = torch.linspace(0.02, 0.15, 8)
    rot = torch.cat([(i[:, None] * theta).cos(), (i[:, None] * theta).sin()], -1) * 2.5
    q[0, 0, :, :16] += rot
    k[0, 0, :, :16] += rot
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    q[0, 1] += u * 4
    k[0, 1, torch.tensor([5, 12, 20, 30])] += u * 4
    idx = ModalityIndex.from_segments([("text", n)])
    return {"index": idx.to_dict(), "layers": {0: {"q": q, "k": k, "v": v}},
            "name": f"cap{seed}"}


def test_dense_reference_matches_sdpa_in_chunks():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 45, 16, generator=g)
    k, v = torch.randn(1, 2, 45, 16, generator=g), torch.randn(1, 2, 45, 16, generator=g)
    out, lse = dense_reference(q, k, v, scale=0.2, rows=7)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                           enable_gqa=True, scale=0.2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.2
    s = s.masked_fill(~torch.ones(45, 45, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_head_density_adds_up_to_the_plan_density():
    idx = ModalityIndex.from_segments([("text", 10), ("video", 4, 4, 5, 0), ("text", 30)])
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 3, idx.n, 16, generator=g), torch.randn(1, 1, idx.n, 16, generator=g)
    heads = [HeadPattern.single(a_shape(sink=2, window=8)),
             HeadPattern("2d", {"video->video": a_shape(sink=0, window=4),
                                "all": a_shape(sink=2, window=30)}),
             HeadPattern("q", {"video": grid(sink=2, window=8, min_lift=0.0),
                               "text": vertical_slash(8, 2, 8, 2)})]
    plan = estimate_layer(q, k, idx, heads, block_m=16, block_n=16).build_plan()
    logical, physical = head_density(plan)
    d = plan.density()
    assert float(logical.mean()) == pytest.approx(d["logical"], rel=1e-9)
    assert float(physical.mean()) == pytest.approx(d["physical"], rel=1e-9)
    masks = plan.masks()[0]
    n = idx.n
    torch.testing.assert_close(logical, masks.double().sum((1, 2)) / (n * (n + 1) / 2))


def test_calibrate_chooses_per_head_at_the_smallest_sufficient_budget(tmp_path):
    def candidates(index, n, budget, **_):
        small = budget < 0.5
        return {"local": HeadPattern.single(a_shape(sink=2, window=16 if small else 32)),
                "verticals": HeadPattern.single(vertical_slash(n_vertical=4 if small else 20,
                                                               n_slash=1, window=2, sink=2))}

    cfg, report = calibrate([_capture(seed=0), _capture(seed=1)], IDENTITY,
                            budgets=[0.9, 0.3], candidates=candidates, max_error=0.05,
                            engine="reference", hard="best", progress=False)
    head0, head1 = cfg.layer(0)
    # The local head is fine with the small budget; the vertical head is not at any budget
    # and (hard="best") takes the larger budget's best pattern.
    assert head0 == candidates(None, 160, 0.3)["local"]
    assert head1 == candidates(None, 160, 0.9)["verticals"]
    by_head = {r["head"]: r for r in report}
    assert by_head[0]["budget"] == 0.3 and by_head[0]["error"] < 0.05
    assert by_head[0]["mass"] > 0.99 and by_head[0]["density"] < 0.45
    assert by_head[1]["budget"] == 0.9 and by_head[1]["pattern"] == "verticals"
    assert by_head[1]["candidates"]["verticals@0.9"]["error"] < \
        by_head[1]["candidates"]["local@0.9"]["error"]
    assert [r["error"] for r in report] == sorted((r["error"] for r in report), reverse=True)
    # Layer 1 had no capture: it keeps the default and the file says it is uncalibrated.
    assert cfg.uncalibrated and cfg.provenance["layers_calibrated"] == [0]
    assert [x["tokens"] for x in cfg.provenance["calibration_inputs"]] == [160, 160]
    assert cfg.provenance["objective"] == "output_error"
    assert cfg.provenance["budgets"] == [0.3, 0.9]
    path = tmp_path / "c.json"
    cfg.save(path)
    assert HeadPatternConfig.load(path, expect=IDENTITY).layers == cfg.layers
    with pytest.raises(ConfigError, match="model.heads = 4 but input cap0 layer 0 has 2"):
        calibrate([_capture()], ModelIdentity("toy/model", "main", 2, 4, 2, 32),
                  budgets=[0.5], candidates=candidates, engine="reference", progress=False)


def test_cli_run_writes_config_and_report(tmp_path, capsys):
    (tmp_path / "caps").mkdir()
    torch.save(_capture(seed=2), tmp_path / "caps" / "a.pt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "toy.json"
    args = parser.parse_args([str(tmp_path / "caps"), "--out", str(out), "--model-id",
                              "toy/model", "--layers", "1", "--budget", "0.5",
                              "--engine", "reference", "--hard", "best"])
    assert run(args) == 0
    ident = ModelIdentity("toy/model", "main", 1, 2, 2, 32)
    cfg = HeadPatternConfig.load(out, expect=ident)
    assert not cfg.uncalibrated and cfg.provenance["calibration_inputs"][0]["name"] == "cap2"
    report = json.loads((tmp_path / "toy.report.json").read_text())
    assert len(report) == 2 and report[0]["error"] >= report[1]["error"]
    assert {r["pattern"] for r in report} <= {"a_shape", "vertical_slash", "block"}
    assert "wrote" in capsys.readouterr().out


def test_capture_from_a_real_layout_checkpoint_then_calibrate(tmp_path):
    """`mminfer calibrate --model M --videos V`: q/k/v captured from the tiny Qwen2.5-VL
    checkpoint's dense prefill on a sample video, then searched; the config written next to
    the checkpoint is the one its adapter loads (same identity: folder name, 'local'
    revision), and the report is sorted worst-first."""
    import argparse
    from pathlib import Path

    from mminfer.offline import command as C
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    from mminfer.engine.pipeline import Pipeline

    ckpt = save_tiny_qwen2_5_vl(tmp_path / "ckpt")
    video = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = ckpt / "mminfer_patterns.json"
    args = p.parse_args(["--model", str(ckpt), "--videos", str(video), "--out", str(out),
                         "--capture-dir", str(tmp_path / "caps"), "--budget", "0.5",
                         "--fps", "2", "--hard", "best"])
    assert C.run(args) == 0
    assert len(list((tmp_path / "caps").glob("*.pt"))) == 1
    cfg = Pipeline(str(ckpt), attention="dense", device="cpu").adapter.patterns
    assert not cfg.uncalibrated and cfg.provenance["calibration_inputs"]
    assert (cfg.identity.id, cfg.identity.revision) == ("ckpt", "local")
    assert len(cfg.layer(0)) == 4
    report = json.loads((ckpt / "mminfer_patterns.report.json").read_text())
    errors = [r["error"] for r in report]
    assert errors == sorted(errors, reverse=True) and len(report) == 8


def test_capture_from_synthetic_sources(tmp_path):
    """`--videos synth:TASK:FRAMES:SEED` renders the video in-process (no decoder) and asks the
    task's own question; the capture holds every layer at the prompt's length. Bad specs are
    refused with the expected form."""
    import pytest

    from mminfer.offline.capture import capture_qkv, synthetic_video
    from mminfer.errors import InputError
    from lab.toy.tiny import save_tiny_qwen2_5_vl

    vid, question, name = synthetic_video("synth:colour:6:900001")
    assert vid.frames.shape == (6, 224, 224, 3) and "color" in question
    assert name == "synth-colour-6-900001"
    for bad in ("synth:needle:6", "synth:nope:6:1", "synth:needle:x:1", "synth:needle:1:1"):
        with pytest.raises(InputError, match="synth:TASK:FRAMES:SEED|task must be"):
            synthetic_video(bad)
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "ckpt")
    (path,) = capture_qkv(str(ckpt), ["synth:needle:4:900000"], "unused", tmp_path / "caps")
    cap = torch.load(path)
    assert cap["name"] == "synth-needle-4-900000" and sorted(cap["layers"]) == [0, 1]
    q = cap["layers"][0]["q"]
    assert q.shape[2] == cap["index"]["n"] and q.shape[2] > 2 * 4   # 2 pairs of 4 tokens + text


def test_reselect_repeats_the_choice_then_loosens_it_without_measuring(tmp_path, capsys):
    """--reselect rebuilds the candidates from the config's provenance and the first input's
    index: at the calibration's own bound it gives the same config back, at a looser one
    fewer hard heads and a lower density, with each head's numbers those its report kept."""
    from mminfer.errors import InputError
    from mminfer.offline.calibrate import reselect
    from mminfer.sparse.patterns import default_config
    (tmp_path / "caps").mkdir()
    for s in (3, 4):
        torch.save(_capture(seed=s), tmp_path / "caps" / f"c{s}.pt")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--model-id", "toy/model", "--layers", "1", "--engine", "reference"]
    out = tmp_path / "tight.json"
    assert run(parser.parse_args([str(tmp_path / "caps"), "--out", str(out), "--budget", "0.3",
                                  "0.6", "--gamma", "0.9", "--max-error", "0.002", *base])) == 0
    tight = HeadPatternConfig.load(out)
    tight_report = json.loads((tmp_path / "tight.report.json").read_text())
    assert any(r["hard"] for r in tight_report)          # the bound is strict enough to bite

    def again(bound, name):
        args = parser.parse_args([str(tmp_path / "caps" / "c3.pt"), "--reselect", str(out),
                                  "--out", str(tmp_path / name), "--max-error", str(bound)])
        assert run(args) == 0
        return (HeadPatternConfig.load(tmp_path / name),
                json.loads((tmp_path / name.replace(".json", ".report.json")).read_text()))

    same, same_report = again(0.002, "same.json")
    assert same.layers == tight.layers
    assert [(r["head"], r["pattern"], r["hard"]) for r in same_report] == \
        [(r["head"], r["pattern"], r["hard"]) for r in tight_report]
    loose, loose_report = again(10.0, "loose.json")
    assert not any(r["hard"] for r in loose_report)
    assert loose.provenance["reselected_from"]["max_error"] == 0.002
    assert loose.provenance["mean_density"] < same.provenance["mean_density"]
    for r in loose_report:                   # the cheapest candidate, with its kept numbers
        label = f"{r['pattern']}@{r['budget']:g}" if r["budget"] is not None else \
            f"{r['pattern']}@g{r['gamma']:g}"
        cheapest = min(r["candidates"].values(), key=lambda m: m["density"])
        assert r["density"] == cheapest["density"] == r["candidates"][label]["density"]
        assert r["error"] == r["candidates"][label]["error"]
    assert "re-selected" in capsys.readouterr().out
    # The candidates are sized on the first input: another length is refused, and so is a
    # config that no calibration wrote.
    other = ModalityIndex.from_segments([("text", 100)])
    with pytest.raises(InputError, match="had 160 tokens, the index given has 100"):
        reselect(tight, tight_report, other, max_error=0.1)
    with pytest.raises(ConfigError, match="only a config written by `mminfer calibrate`"):
        reselect(default_config(IDENTITY), tight_report, other, max_error=0.1)
