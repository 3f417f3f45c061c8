"""Calibration against the answer (`mminfer calibrate --answer-kl`): the frontier of rungs per
head, and on the embedded model end to end: the config written holds the mean last-token KL
it reports (re-measured here through the pipeline's prefill), a looser bound buys a sparser
config, a tighter one keeps more heads dense, a deadline stops it early and what it kept still
holds. The question's rows dense (the default): what it changes in a head, and that it moves
the answer far less at the same choice."""

import argparse
import json

import pytest
import torch

from mminfer.errors import InputError
from mminfer.offline.answer_kl import AnswerProbe, frontier, kl_divergence
from mminfer.offline.command import run
from mminfer.offline.cli import add_arguments
from mminfer.sparse.patterns import HeadPatternConfig

VIDEOS = ["synth:needle:24:900000", "synth:count:40:900003"]


def test_frontier_keeps_only_rungs_that_buy_error_with_density():
    got = frontier({"a": {"density": 0.1, "error": 0.5}, "b": {"density": 0.2, "error": 0.6},
                    "c": {"density": 0.3, "error": 0.2}, "d": {"density": 0.5, "error": 0.2},
                    "e": {"density": 1.2, "error": 0.0}})
    # b is dearer than a and worse; d is dearer than c and no better; e is no saving
    assert [lab for lab, *_ in got] == ["c", "a"]


def test_kl_divergence():
    p = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0]), -1)
    q = torch.log_softmax(torch.tensor([0.0, 0.0, 0.0]), -1)
    assert kl_divergence(p, p) == 0.0
    want = float((p.exp() * (p - q)).sum())
    assert kl_divergence(p, q) == pytest.approx(want) and want > 0.1


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A per-head calibration of the embedded model (every candidate's numbers in the
    report): a trained model, so its answers depend on what attention reads."""
    from mminfer.models.embedded import default_model
    tmp = tmp_path_factory.mktemp("answer")
    ckpt = default_model()
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp / "heads.json"
    assert run(p.parse_args(["--model", str(ckpt), "--device", "cpu", "--videos", *VIDEOS,
                             "--out", str(out), "--capture-dir", str(tmp / "caps"),
                             "--budget", "0.3", "--gamma", "0.8", "--max-error", "0.2"])) == 0
    return ckpt, out, tmp


def _answer(calibrated, target, name):
    ckpt, heads, tmp = calibrated
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp / f"{name}.json"
    args = p.parse_args(["--reselect", str(heads), "--model", str(ckpt), "--device", "cpu",
                         "--videos", *VIDEOS, "--max-error", "0.2", "--answer-kl",
                         str(target), "--answer-rungs", "2", "--out", str(out)])
    assert run(args) == 0
    rows = json.loads((tmp / f"{name}.answer.json").read_text())
    return HeadPatternConfig.load(out), rows


def _measure(ckpt, cfg, one_shot=False):
    """Mean KL of ``cfg`` over VIDEOS, measured afresh (a new probe, the pipeline's model) as
    served, or in a one-shot prefill of the whole prompt."""
    from mminfer.engine.pipeline import Pipeline
    from mminfer.offline.capture import load_video
    ad = Pipeline(str(ckpt), attention="dense", device="cpu").adapter
    probe = AnswerProbe(ad, engine="reference", block=(16, 16), one_shot=one_shot)
    kls = []
    for v in VIDEOS:
        decoded, question, name = load_video(v, ad, "")
        kls.append(probe.kl(probe.prepare(name, decoded, question), cfg)[0])
    return sum(kls) / len(kls)


def test_answer_bound_holds_and_trades_density(calibrated):
    ckpt = calibrated[0]
    loose_cfg, loose = _answer(calibrated, 5.0, "loose")
    tight_cfg, tight = _answer(calibrated, 1e-4, "tight")
    for cfg, rows, target in ((loose_cfg, loose, 5.0), (tight_cfg, tight, 1e-4)):
        a = cfg.provenance["answer_kl"]
        assert a["target"] == target and a["mean_kl"] <= target
        assert len(rows) == 16 and all(r["rungs"] for r in rows)
        # what it reports is what the config does, measured again from scratch
        assert _measure(ckpt, cfg) == pytest.approx(a["mean_kl"], rel=1e-3, abs=1e-6)
    dens = lambda rows: sum(r["density"] for r in rows) / len(rows)
    # a bound of 5 nats holds anything: every head takes its cheapest rung
    assert all(r["candidate"] == r["rungs"][-1]["candidate"] for r in loose)
    assert dens(loose) < dens(tight)
    # even the tight bound leaves the last layer at its cheapest: no pattern there is served
    assert all(r["candidate"] == r["rungs"][-1]["candidate"] and r["own_kl"] == 0
               for r in tight if r["layer"] == 3)
    assert sum(r["candidate"] == "dense" for r in tight) > sum(
        r["candidate"] == "dense" for r in loose)
    assert loose_cfg.provenance["made_by"] == "mminfer calibrate --answer-kl"


def test_a_deadline_stops_early_and_still_holds_the_bound(calibrated):
    from mminfer.engine.pipeline import Pipeline
    from mminfer.offline.answer_kl import refine
    from mminfer.offline.calibrate import report_candidates
    from mminfer.offline.capture import load_video
    ckpt, heads, _ = calibrated
    cfg = HeadPatternConfig.load(heads)
    report = json.loads(heads.with_name("heads.report.json").read_text())
    ad = Pipeline(str(ckpt), attention="dense", device="cpu").adapter
    probe = AnswerProbe(ad, engine="reference", block=(16, 16))
    d, q, name = load_video(VIDEOS[0], ad, "")
    inp = probe.prepare(name, d, q)
    new, rows = refine(probe, [inp], cfg, report, report_candidates(cfg, inp.prep.prefix_index),
                       target=5.0, max_rungs=1, deadline=0.0)     # already past
    # the last layer's heads run their last row only when served: cheapest, never measured
    last = [r for r in rows if r["last_row_only"]]
    assert [r["layer"] for r in last] == [3] * 4
    assert all(r["candidate"] == r["rungs"][-1]["candidate"] for r in last)
    assert all(r["candidate"] == "dense" and not r["measured"] for r in rows
               if not r["last_row_only"])
    assert "time ran out" in new.provenance["answer_kl"]["stopped_early"]
    assert new.provenance["answer_kl"]["mean_kl"] == 0.0 and probe.forwards == 1


def test_answer_kl_needs_the_model_and_videos(calibrated, tmp_path):
    _, heads, tmp = calibrated
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([str(tmp / "caps"), "--answer-kl", "0.01", "--out",
                         str(tmp_path / "x.json"), "--budget", "0.3", "--gamma"])
    with pytest.raises(InputError, match="--answer-kl runs the model"):
        run(args)


def test_dense_text_head_keeps_visual_rows_and_makes_text_rows_dense():
    from mminfer.offline.calibrate import dense_text_head
    from mminfer.sparse.patterns import HeadPattern, a_shape, dense, vertical_slash
    vs = vertical_slash(n_vertical=8, n_slash=1, window=4, sink=2)
    for b in ("none", "k"):
        got = dense_text_head(HeadPattern.single(vs, b))
        assert got.boundary == "q"
        assert got.for_region("video") == got.for_region("image") == vs
        assert got.for_region("text").kind == "dense"
    q = dense_text_head(HeadPattern("q", {"video": vs, "text": a_shape(sink=1, window=2)}))
    assert q.for_region("video") == vs and q.for_region("text").kind == "dense"
    two = dense_text_head(HeadPattern("2d", {"video->video": vs, "text->video": vs,
                                             "video->text": a_shape(sink=1, window=2)}))
    assert two.for_region("video", "video") == vs
    assert two.for_region("video", "text").kind == "a_shape"
    assert all(two.for_region("text", k).kind == "dense" for k in ("video", "text"))
    d = HeadPattern.single(dense())
    assert dense_text_head(d) is d


def test_calibrate_makes_question_rows_dense_by_default(calibrated):
    """The per-head config written for text + video inputs has every sparse head's text rows
    dense and says so; --reselect follows it, --no-dense-text turns it off."""
    ckpt, heads, tmp = calibrated
    cfg = HeadPatternConfig.load(heads)
    assert cfg.provenance["dense_text"] is True
    sparse = [hp for row in cfg.layers for hp in row if hp.kinds() != {"dense"}]
    assert sparse and all(hp.boundary in ("q", "2d") for hp in sparse)
    assert all(hp.for_region("text", "video").kind == "dense" for hp in sparse)
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--reselect", str(heads), "--model", str(ckpt), "--device", "cpu",
            "--videos", VIDEOS[0], "--max-error", "0.2"]
    assert run(p.parse_args(base + ["--out", str(tmp / "same.json")])) == 0
    assert HeadPatternConfig.load(tmp / "same.json").layers == cfg.layers
    assert run(p.parse_args(base + ["--no-dense-text", "--out", str(tmp / "off.json")])) == 0
    off = HeadPatternConfig.load(tmp / "off.json")
    assert "dense_text" not in off.provenance
    assert any(hp.boundary in ("none", "k") for row in off.layers for hp in row)
    # What it is for: at a bound loose enough that the answer moves (0.5), in a one-shot
    # prefill of the whole prompt the same choice moves it far less with the question's rows
    # dense. As served, the question's rows are dense over the prefix's cache whatever the
    # config says (the prefix's text rows are its system prompt): the same KL either way.
    loose = base[:-1] + ["0.5"]
    assert run(p.parse_args(loose + ["--out", str(tmp / "on5.json")])) == 0
    assert run(p.parse_args(loose + ["--no-dense-text", "--out", str(tmp / "off5.json")])) == 0
    on5, off5 = HeadPatternConfig.load(tmp / "on5.json"), HeadPatternConfig.load(tmp / "off5.json")
    on_kl, off_kl = _measure(ckpt, on5, one_shot=True), _measure(ckpt, off5, one_shot=True)
    assert off_kl > 0.01 and on_kl < off_kl / 5, (on_kl, off_kl)
    served_on, served_off = _measure(ckpt, on5), _measure(ckpt, off5)
    assert served_on == pytest.approx(served_off, rel=0.05, abs=1e-6)
    assert served_off < off_kl / 5             # serving never makes the question sparse

