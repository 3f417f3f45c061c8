"""Sparse pieces of a live stream on the embedded model (CPU).

* Where every piece's plan is dense — the piece shorter than the stream's threshold, or the
  head patterns at full budget (every pair planned, run by the sparse kernels under the
  interpreter) — a stream ingested with attention "sparse" answers as the dense stream.
* With the shipped patterns, the prefix built in sparse pieces against the sparse one-shot
  prefix (``benchmarks/stream_sparse.py``'s functions, the plans run by the reference
  engine with the GPU's tiles): pieces cut on the row-block grid give the one-shot's answer
  distribution (the embedded model's block heads plan each row block alone; only the key
  block at a piece's end, partial in the piece and whole in the one-shot, weighs differently
  in the mass budget, which can move a choice: on this needle video it does not), cut off it
  the same answer within a small KL, and both are sparse.
"""

import pytest
import torch

from conftest import load_script
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.streams import Stream
from mminfer.errors import InputError
from mminfer.models.base import PrepareOptions
from mminfer.sparse.estimate import full_budget
from mminfer.sparse.patterns import HeadPatternConfig

from test_streams import FPS, Q, assert_same, random_frames

# 4 x 6 merged tokens per temporal pair: a piece of 4 frames is 48 rows
PIXELS = PrepareOptions(min_pixels=28 * 28 * 4, max_pixels=112 * 168)


@pytest.fixture(scope="module")
def qwen():
    return Pipeline(None, attention="dense", device="cpu")


def _ingest(pipe, frames, **kw):
    s = Stream(pipe, fps=FPS, options=PIXELS, **kw)
    reports = [s.append_frames(frames[a:a + 4]) for a in range(0, len(frames), 4)]
    return s, reports


def test_pieces_below_the_threshold_run_dense(qwen):
    frames = random_frames(8, 112, 168, seed=7)
    dense, _ = _ingest(qwen, frames, mode="dense")
    s, reports = _ingest(qwen, frames, mode="sparse", sparse_min_tokens=10 ** 6)
    assert [r["attention"] for r in reports] == ["dense", "dense"]
    assert all(r["index_ms"] == 0.0 for r in reports)      # nothing estimated
    want = dense.generate(Q, max_new_tokens=4)[0]
    got = s.generate(Q, max_new_tokens=4)[0]
    assert torch.equal(got.prefill_logits, want.prefill_logits)
    assert s.ask(Q, max_new_tokens=2).attention == "dense"


def test_full_budget_sparse_pieces_equal_the_dense_stream(qwen):
    from mminfer.kernels.runtime import interpreted
    if not interpreted():
        pytest.skip("the sparse kernels on the CPU need TRITON_INTERPRET=1")
    frames = random_frames(8, 112, 168, seed=8)
    dense, _ = _ingest(qwen, frames, mode="dense")
    ad = qwen.adapter
    shipped = ad.patterns
    ad.patterns = HeadPatternConfig(shipped.identity, [full_budget(shipped.layer(i), 1 << 20)
                                                       for i in range(len(shipped.layers))])
    try:
        s, reports = _ingest(qwen, frames, mode="sparse", sparse_min_tokens=1)
        got = s.generate(Q, max_new_tokens=4)[0]
        res = s.ask(Q, max_new_tokens=2)
    finally:
        ad.patterns = shipped
    assert [r["attention"] for r in reports] == ["sparse", "sparse"]
    assert all(r["density"] == 1.0 for r in reports)
    # each piece's prefill says what its estimate and its kernels took
    assert all(0 < r["index_ms"] + r["attention_ms"] < r["prefill_ms"] for r in reports)
    assert all(r["index_ms"] > 0 for r in reports)
    assert_same(got, dense.generate(Q, max_new_tokens=4)[0])
    assert (res.attention, res.attention_requested) == ("sparse", "sparse")


def test_a_stream_checks_its_attention_mode(qwen):
    with pytest.raises(InputError, match="attention must be one of"):
        Stream(qwen, fps=FPS, mode="flash")
    assert Stream(qwen, fps=FPS).mode == qwen.attention


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/stream_sparse.py", "stream_sparse_bench")


@pytest.fixture(scope="module")
def example(qwen):
    from lab.toy import embedded as E
    frames, _, question, _ = E.render_example("needle", E.HELDOUT_SEED_MIN + 9, 128,
                                              depth=0.5)
    return frames, question


def test_sparse_pieces_against_the_sparse_one_shot(qwen, bench, example):
    frames, question = example
    ad = qwen.adapter
    kw = dict(engine="reference", block=(128, 64))
    # the video starts after the head; 256-row pieces from there sit on the 128-row grid
    aligned = bench.run_example(ad, frames, question, piece=256, **kw)
    assert aligned["n_pieces"] >= 4
    one, pieces = aligned["one-shot"], aligned["pieces"]
    assert 0.2 < one[2] < 0.8 and pieces[2] < 0.8          # sparse, both
    assert torch.allclose(pieces[1], one[1], atol=1e-4)
    off = bench.run_example(ad, frames, question, piece=200, **kw)
    assert off["pieces"][0] == off["one-shot"][0]
    kl = bench.kl_divergence(off["one-shot"][1], off["pieces"][1])
    assert kl < 0.05, kl
    assert off["pieces"][2] < 0.8
