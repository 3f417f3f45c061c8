"""The embedded default model as shipped (``mminfer/models/mminfer-embedded``): it is small and
real, and answers every sample right, dense and sparse, within the CPU time limit, from the
library and from the CLI. How it is trained: ``lab/tests/test_train_embedded.py``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mminfer.models import embedded as M
from mminfer.offline import synthetic as synth

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples" / "videos"
BUILT = (M.DEFAULT_MODEL_DIR / "config.json").is_file()
NOT_BUILT = (f"the embedded model is not built yet ({M.DEFAULT_MODEL_DIR}): "
             f"`{M.BUILD_COMMAND}` on a GPU")
CPU_ANSWER_LIMIT_S = 10.0
# Sparse on CPU runs the Triton interpreter (about 10 s per sample): (sample, density; None =
# the shipped config as served)
SPARSE_SAMPLES = (("needle_0.mp4", None), ("needle_0.mp4", 0.5), ("order_0.mp4", 0.5),
                  ("colour_0.mp4", 0.5))


def test_missing_embedded_model_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    from mminfer.cli import main
    monkeypatch.setattr(M, "DEFAULT_MODEL_DIR", tmp_path / "none")
    assert main(["answer", str(SAMPLES / "needle_0.mp4"), "what?"]) == 2
    err = capsys.readouterr().err
    assert "build_embedded.sh" in err and "--model" in err and err.count("\n") == 1
    with pytest.raises(Exception, match="build_embedded.sh"):
        M.default_model()


@pytest.fixture(scope="module")
def default_pipe():
    if not BUILT:
        pytest.skip(NOT_BUILT)
    from mminfer.engine.pipeline import Pipeline
    return Pipeline(attention="dense", device="cpu", min_sparse_len=16)


def _answers():
    return json.loads((SAMPLES / "answers.json").read_text())


@pytest.mark.skipif(not BUILT, reason=NOT_BUILT)
def test_default_model_is_small_and_real():
    size = sum(f.stat().st_size for f in M.DEFAULT_MODEL_DIR.glob("*.safetensors"))
    assert size <= 16 * 2 ** 20
    cfg = json.loads((M.DEFAULT_MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert M.default_model() == M.DEFAULT_MODEL_DIR


def test_default_model_answers_the_samples_dense(default_pipe):
    wrong, slow = [], []
    for name, d in _answers().items():
        t0 = time.perf_counter()
        r = default_pipe.answer(SAMPLES / name, d["question"])
        dt = time.perf_counter() - t0
        assert r.attention == "dense" and r.model == M.DEFAULT_MODEL_DIR.name
        if r.answer != d["answer"]:
            wrong.append((name, r.answer, d["answer"]))
        if dt > CPU_ANSWER_LIMIT_S:
            slow.append((name, round(dt, 2)))
    assert not wrong, wrong
    assert not slow, slow


def test_default_model_answers_the_samples_sparse(default_pipe):
    """The shipped config as served, then the same heads re-sized to half the causal pairs
    (about the least 16 x 16 tiles allow at the samples' 183 tokens; the heads calibration
    made dense stay dense, and so do the question's rows): the samples named still answer
    right."""
    import torch
    if default_pipe.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("sparse attention on CPU needs TRITON_INTERPRET=1")
    from mminfer import video as videolib
    from mminfer.offline.calibrate import resize_config
    from mminfer.models.hooks import PrefillContext

    ad = default_pipe.adapter
    assert ad.patterns is not None and not ad.patterns.uncalibrated   # the shipped calibration
    answers = _answers()
    for name, density in SPARSE_SAMPLES:
        d = answers[name]
        dec = videolib.decode(str(SAMPLES / name), sampling=ad.sampling, fps=2.0)
        prep = ad.prepare(dec, d["question"])
        pats = ad.patterns if density is None else resize_config(
            ad.patterns, prep.index, prep.total_tokens, density, block_m=16, block_n=16)
        ctx = PrefillContext(index=prep.index, patterns=pats, mode="sparse",
                             min_sparse_len=16, keep_plans=True)
        gen = ad.generate(prep, max_new_tokens=4, ctx=ctx)
        # sparse ran in every layer but the last, which computes its last row only
        assert sorted(ctx.densities) == list(range(ad.identity.layers - 1)), name
        if density is not None:
            # the heads calibration left sparse (a hard head is dense, and stays so resized)
            measured = [float(p.density()["logical_per_head"][h])
                        for i, p in sorted(ctx.densities.items())
                        for h, hp in enumerate(pats.layer(i))
                        if any(x.kind != "dense" for x in hp.patterns.values())]
            # the question's rows stay dense: their pairs come on top of about half the rest
            n = prep.total_tokens
            text_pairs = sum(i + 1 for sp in prep.index.spans_of("text")
                             for i in range(sp.start, sp.end))
            share = text_pairs / (n * (n + 1) / 2)
            assert measured and max(measured) < 0.6 * (1 - share) + share, (name, measured)
        assert gen.text == d["answer"], (name, density, gen.text)
    assert torch.is_grad_enabled()


@pytest.mark.skipif(not BUILT, reason=NOT_BUILT)
def test_cli_answers_without_model(capsys):
    from mminfer.cli import main
    assert main(["answer", str(SAMPLES / "count_1.mp4"), synth.QUESTIONS["count"], "--json",
                 "--attention", "dense", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["answer"] == _answers()["count_1.mp4"]["answer"]
