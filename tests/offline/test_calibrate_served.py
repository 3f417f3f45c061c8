"""`mminfer calibrate --model --videos` calibrates what is served, as the server's
self-calibration does: the search's configs re-selected at each bound of a ladder, scored on
the videos by the served policy (the prefix sparse, the question dense over it) against dense,
the loosest that holds the thresholds gated on held-out videos; PASS writes it with how it was
measured, FAIL writes the search's config marked uncalibrated and exits 1. The thresholds are
the server's flags with the server's defaults.

The embedded model on the CPU, 8-frame synthetic videos (77 tokens), the reference engine."""

import argparse
import json

import pytest

from mminfer.errors import ConfigError, InputError
from mminfer.models.embedded import default_model
from mminfer.offline import served_policy as SP
from mminfer.offline.command import run
from mminfer.offline.capture import load_video
from mminfer.offline.cli import add_arguments
from mminfer.sparse.patterns import HeadPatternConfig

VIDEOS = ["synth:needle:8:900000", "synth:count:8:900001"]
HELD_OUT = ["synth:order:8:900002"]
# 77-token prompts: any sparse plan of them is near-dense, so no density ceiling (the
# default one is for real lengths; test_a_rung_that_holds_only_densely_fails sets one)
SMALL = ["--calibration-max-density", "1", "--device", "cpu", "--budget", "0.3", "--gamma", "0.9"]


def parse(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_the_thresholds_are_the_servers_flags_with_its_defaults():
    from mminfer.serve.cli import add_arguments as serve_arguments
    from mminfer.serve.settings import Settings
    offline = parse(["--out", "x.json"])
    p = argparse.ArgumentParser()
    serve_arguments(p)
    served = p.parse_args([])
    for name in ("calibration_min_agreement", "calibration_max_kl", "calibration_max_density"):
        assert getattr(offline, name) == getattr(served, name) == getattr(Settings(), name)
    assert (offline.calibration_min_agreement, offline.calibration_max_kl) == (0.98, 0.02)
    assert offline.calibration_max_density == 0.85


def test_pass_writes_the_winner_with_what_it_measured(tmp_path, capsys):
    out = tmp_path / "cfg.json"
    assert run(parse(["--model", str(default_model()), "--videos", *VIDEOS, "--gate-videos",
                      *HELD_OUT, "--out", str(out), *SMALL])) == 0
    printed = capsys.readouterr().out
    assert "PASS (agreement >= 0.98, mean KL <= 0.02)" in printed
    cfg = HeadPatternConfig.load(out)
    sp = cfg.provenance["served_policy"]
    assert not cfg.uncalibrated and sp["verdict"] == "pass"
    assert sp["min_agreement"] == 0.98 and sp["max_kl"] == 0.02
    assert sp["calibration"]["n"] == 2 and sp["gate"]["n"] == 1
    assert sp["gate"]["source"] == "videos"          # "gate on 1 held-out videos"
    assert [i["name"] for i in sp["inputs"]] == ["synth-needle-8-900000",
                                                 "synth-count-8-900001"]
    # the CPU's ladder, the server's (SearchSettings.for_device), loosest scored first
    assert sp["rungs"][0]["bound"] == 0.5 and sp["per_head_bound"] in (0.05, 0.2, 0.5)
    # what it reports of the gate is what the config does on that video, measured again
    from mminfer.engine.pipeline import Pipeline
    ad = Pipeline(str(default_model()), attention="dense", device="cpu").adapter
    decoded, question, name = load_video(HELD_OUT[0], ad, "")
    inp = SP.prepare(ad, decoded, question, name)
    dense = SP.run_served(ad, inp, None, max_new_tokens=sp["max_new_tokens"])
    sparse = SP.run_served(ad, inp, cfg, max_new_tokens=sp["max_new_tokens"],
                           engine="reference", block=tuple(sp["block"]))
    got = SP.compare(dense, sparse)
    assert got["kl"] == pytest.approx(sp["gate"]["mean_kl"], rel=1e-3, abs=1e-6)
    assert got["answer_agree"] == (sp["gate"]["agreement"] == 1.0)
    # the report written with it lets --reselect choose again without the model's forwards
    again = tmp_path / "again.json"
    assert run(parse(["--reselect", str(out), "--model", str(default_model()), "--videos",
                      VIDEOS[0], "--max-error", str(sp["per_head_bound"]), "--out", str(again),
                      "--device", "cpu"])) == 0
    assert HeadPatternConfig.load(again).layers == cfg.layers


def test_fail_marks_the_config_uncalibrated_and_exits_1(tmp_path, capsys):
    """No rung can hold a mean KL of 0: the run says FAIL, and what it writes stays dense
    under --attention auto (as a server whose gate fails stays dense)."""
    out = tmp_path / "cfg.json"
    assert run(parse(["--model", str(default_model()), "--videos", VIDEOS[0], "--out",
                      str(out), "--max-error", "5", "--calibration-max-kl", "0", *SMALL])) == 1
    assert "FAIL: no rung of the ladder (per-head bounds 5)" in capsys.readouterr().out
    cfg = HeadPatternConfig.load(out)
    sp = cfg.provenance["served_policy"]
    assert cfg.uncalibrated and sp["verdict"] == "fail" and sp["max_kl"] == 0
    assert [r["bound"] for r in sp["rungs"]] == [5] and sp["rungs"][0]["mean_kl"] > 0
    assert (tmp_path / "cfg.report.json").is_file()


def test_a_rung_that_holds_only_densely_fails(tmp_path, capsys):
    """The loosest rung that holds does so at a density above --calibration-max-density: it
    would serve no faster than dense, so the run says FAIL there (tighter rungs, denser,
    are not scored)."""
    out = tmp_path / "cfg.json"
    assert run(parse(["--model", str(default_model()), "--videos", VIDEOS[0], "--out",
                      str(out), *SMALL, "--calibration-max-density", "0.05"])) == 1
    printed = capsys.readouterr().out
    assert "FAIL: the loosest rung that holds the thresholds" in printed
    assert "above 0.05: sparse would be no faster than dense" in printed
    sp = HeadPatternConfig.load(out).provenance["served_policy"]
    assert sp["verdict"] == "fail" and sp["max_density"] == 0.05
    held = sp["rungs"][-1]
    assert held["mean_density"] > 0.05 and held["agreement"] >= 0.98
    assert all(r["bound"] > held["bound"] for r in sp["rungs"][:-1])   # none tighter


def test_what_needs_the_model_says_so(tmp_path):
    out = ["--out", str(tmp_path / "x.json")]
    with pytest.raises(InputError, match="ladder scored on the answers"):
        run(parse([str(tmp_path), "--max-error", "0.1", "0.2", *out]))
    with pytest.raises(InputError, match="--gate-videos are scored with the model"):
        run(parse([str(tmp_path), "--gate-videos", VIDEOS[0], *out]))
    with pytest.raises(InputError, match="--calibration-min-agreement must be in"):
        run(parse([str(tmp_path), "--calibration-min-agreement", "1.5", *out]))
    with pytest.raises(InputError, match=r"--calibration-max-density in \(0, 1\]"):
        run(parse([str(tmp_path), "--calibration-max-density", "0", *out]))


def _kinds(cfg) -> set:
    """The pattern kinds of every head's regions, dense ones left out."""
    return {p.kind for row in cfg.layers for hp in row for p in hp.patterns.values()
            if p.kind != "dense"}


def test_families_restrict_every_rung_of_the_ladder(tmp_path):
    """--families grid: the search measures only grid candidates and the rung that passes
    draws every sparse head from them; without it the same ladder picks other families."""
    argv = ["--model", str(default_model()), "--videos", VIDEOS[0], *SMALL]
    assert run(parse([*argv, "--out", str(tmp_path / "all.json")])) == 0
    assert run(parse([*argv, "--families", "grid", "--out", str(tmp_path / "grid.json")])) == 0
    default = HeadPatternConfig.load(tmp_path / "all.json")
    grid = HeadPatternConfig.load(tmp_path / "grid.json")
    assert _kinds(default) - {"grid"}              # the default ladder's choice is not all grid
    assert _kinds(grid) == {"grid"}
    assert grid.provenance["families"] == ["grid"]
    assert grid.provenance["served_policy"]["families"] == ["grid"]
    assert grid.provenance["served_policy"]["verdict"] == "pass"
    # the report written with it holds only what it chose among
    rows = json.loads((tmp_path / "grid.report.json").read_text())
    assert {lab.split("@")[0] for r in rows for lab in r["candidates"]} == {"grid"}
    # a family the candidates of these budgets do not have is refused, not ignored
    with pytest.raises(ConfigError, match="no candidate of families \\['block_ad'\\]"):
        run(parse([*argv[:-2], "--gamma", "--families", "block_ad",
                   "--out", str(tmp_path / "x.json")]))


def test_hard_best_holds_at_every_rung(tmp_path):
    """A bound no sparse candidate holds for most heads: the ladder's rung makes them dense
    by default, and with --hard best gives each its lowest-error candidate instead."""
    argv = ["--model", str(default_model()), "--videos", VIDEOS[0], *SMALL, "--max-error",
            "0.001"]
    assert run(parse([*argv, "--out", str(tmp_path / "dense.json")])) == 0
    assert run(parse([*argv, "--hard", "best", "--out", str(tmp_path / "best.json")])) == 0
    dense_cfg = HeadPatternConfig.load(tmp_path / "dense.json")
    best = HeadPatternConfig.load(tmp_path / "best.json")
    assert dense_cfg.provenance["served_policy"]["per_head_bound"] == 0.001
    assert best.provenance["served_policy"]["per_head_bound"] == 0.001

    def dense_heads(cfg):
        return sum(all(p.kind == "dense" for p in hp.patterns.values())
                   for row in cfg.layers for hp in row)
    assert dense_heads(dense_cfg) > 0 and dense_cfg.provenance["hard"] == "dense"
    assert dense_heads(best) == 0 and best.provenance["hard"] == "best"
    assert best.provenance["served_policy"]["hard"] == "best"
    sp = [c.provenance["served_policy"]["rungs"][0]["mean_density"] for c in (dense_cfg, best)]
    assert sp[1] < sp[0]


def test_dense_text_is_refused_where_the_served_policy_fixes_it(tmp_path):
    """The served policy computes the question's rows dense whatever the config says: the
    flag cannot change what the ladder measures, so it is an error there, not a no-op."""
    argv = ["--model", str(default_model()), "--videos", VIDEOS[0], "--out",
            str(tmp_path / "x.json"), *SMALL]
    for flag in ("--dense-text", "--no-dense-text"):
        with pytest.raises(InputError, match=f"{flag} does not apply to the ladder scored "
                           "as served"):
            run(parse([*argv, flag]))
    assert not (tmp_path / "x.json").exists()
