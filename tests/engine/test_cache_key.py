"""The video cache's key: every field of :class:`PrefixKey` changes the key, the pipeline
fills each field from what the prefix's build reads, live (a swapped head-pattern config, a
flag flipped on it, ``min_sparse_len`` or the KV cache's dtype changed under the pipeline),
and an entry continues its prefix at its own M-RoPE offset."""

import copy
from dataclasses import fields, replace

import pytest
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer import video as videolib
from mminfer.engine.cache import PrefixKey
from mminfer.engine.pipeline import Pipeline
from mminfer.models.base import VIDEO, Conversation, PrepareOptions, Turn
from mminfer.models.hooks import PrefillContext

from conftest import write_video

# Every field, named here on purpose: a field taken out of the key fails this test, and a new
# one must come with its own change below.
FIELDS = {"model", "revision", "adapter", "dtype", "kv_cache", "quantization", "device",
          "sampling", "frame_limit", "patterns", "min_sparse_len", "video", "fps",
          "max_frames", "start", "end", "mode", "options", "turns", "salt"}
Q = "where does the red square move?"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("key") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


@pytest.fixture()
def pipe(qwen):
    return Pipeline(str(qwen), attention="dense", device="cpu")


def test_every_field_of_the_key_changes_it():
    base = PrefixKey(model="m", revision="r", adapter="qwen2_5_vl", dtype="torch.float32",
                     kv_cache="torch.float32", quantization=None, device="cpu",
                     sampling="qwen", frame_limit=None, patterns="p", min_sparse_len=4096,
                     video="a" * 64, fps=2.0, max_frames=768, start=None, end=None,
                     mode="auto", options={"min_pixels": None, "max_pixels": None,
                                           "total_pixels": None}, turns="t")
    other = dict(model="m2", revision="r2", adapter="longvila", dtype="torch.float16",
                 kv_cache="torch.float8_e4m3fn", quantization="fp8", device="cuda",
                 sampling="uniform", frame_limit=64, patterns="p2", min_sparse_len=0,
                 video="b" * 64, fps=1.0, max_frames=8, start=1.0, end=2.0, mode="sparse",
                 options={**base.options, "max_pixels": 50176}, turns="t2", salt="tenant-b")
    assert {f.name for f in fields(PrefixKey)} == FIELDS == set(other)
    digests = {base.digest()}
    for name, value in other.items():
        digests.add(replace(base, **{name: value}).digest())
    assert len(digests) == len(FIELDS) + 1


def _swap_patterns(m, p, r):
    pats = p.adapter.patterns
    swapped = copy.deepcopy(pats)
    swapped.provenance = {**pats.provenance, "calibrated_on": "another set"}
    assert swapped.to_dict() != pats.to_dict()
    m.setattr(p.adapter, "patterns", swapped)


def _flag_calibrated(m, p, r):          # the same config object, marked calibrated
    m.setattr(p.adapter.patterns, "uncalibrated", not p.adapter.patterns.uncalibrated)


# what changes each field, on the pipeline (``m``: monkeypatch, undone after) or the request
CHANGES = {
    "model": lambda m, p, r: m.setattr(p, "model_id", "someone/else"),
    "revision": lambda m, p, r: m.setattr(p.adapter, "identity",
                                          replace(p.adapter.identity, revision="abc123")),
    "adapter": lambda m, p, r: m.setattr(p.adapter, "name", "another"),
    "dtype": lambda m, p, r: m.setattr(p, "dtype", torch.float16),
    "kv_cache": lambda m, p, r: m.setattr(p, "kv_cache_dtype", "fp8"),
    "quantization": lambda m, p, r: m.setattr(p, "quantization", "fp8"),
    "device": lambda m, p, r: m.setattr(p, "device", torch.device("meta")),
    "sampling": lambda m, p, r: m.setattr(p.adapter, "sampling", "uniform"),
    "frame_limit": lambda m, p, r: m.setattr(p.adapter, "frame_limit", 3),
    "patterns": _swap_patterns,
    "min_sparse_len": lambda m, p, r: m.setattr(p, "min_sparse_len", p.min_sparse_len + 1),
    "video": lambda m, p, r: r.update(digest="f" * 64),
    "fps": lambda m, p, r: r["sampling"].update(fps=3.0),
    "max_frames": lambda m, p, r: r["sampling"].update(max_frames=4),
    "start": lambda m, p, r: r["sampling"].update(start=0.5),
    "end": lambda m, p, r: r["sampling"].update(end=1.5),
    "mode": lambda m, p, r: r.update(mode="sparse"),
    "options": lambda m, p, r: r.update(options=PrepareOptions(max_pixels=64 * 28 * 28)),
    "turns": lambda m, p, r: r.update(conv=Conversation(
        (Turn("system", ("Be terse.",)), Turn("user", (VIDEO, Q))))),
    "salt": lambda m, p, r: r.update(salt="tenant-b"),
}


def _request():
    return dict(digest="e" * 64, conv=Conversation.single(Q),
                sampling=dict(fps=2.0, max_frames=768, start=None, end=None), mode="dense",
                options=None, salt=None)


def test_the_pipeline_fills_every_field_from_what_the_build_reads(pipe, monkeypatch):
    assert set(CHANGES) == FIELDS
    base = pipe._prefix_key(**_request())
    assert pipe._prefix_key(**{**_request(), "options": PrepareOptions()}) == base
    for name, change in [*CHANGES.items(), ("patterns", _flag_calibrated)]:
        with monkeypatch.context() as m:
            req = _request()
            change(m, pipe, req)
            key = pipe._prefix_key(**req)
        assert getattr(key, name) != getattr(base, name), name
        assert key.digest() != base.digest(), name
    assert pipe._prefix_key(**_request()) == base        # every change undone


def test_a_request_that_changes_the_prefix_misses(pipe, mp4):
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=2).cache == "miss"
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=2).cache == "hit"
    assert pipe.answer(mp4, Q, fps=4.0, end=1.0, max_new_tokens=2).cache == "miss"
    fewer = PrepareOptions(max_pixels=32 * 28 * 28)
    small = pipe.answer(mp4, Q, fps=4.0, options=fewer, max_new_tokens=2)
    assert small.cache == "miss"
    pipe.adapter.patterns.uncalibrated = not pipe.adapter.patterns.uncalibrated
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=2).cache == "miss"
    pipe.min_sparse_len += 1
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=2).cache == "miss"


def test_a_kept_prefix_continues_at_its_own_rope_offset(pipe, mp4):
    """The entry's M-RoPE offset is its prompt's (a video's positions advance by its grid,
    not by its token count: non-zero here), and a question continued on the entry with it
    gives the one-shot prefill's logits."""
    first = pipe.answer(mp4, Q, fps=4.0, max_new_tokens=2)
    (entry,) = pipe.video_cache._entries.values()
    ad = pipe.adapter
    decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=4.0, max_frames=768)
    conv = Conversation.single("what colour is the background?")
    prep = ad.prepare(decoded, conv)
    assert prep.prefix_len == entry.length == first.tokens["prefix"]
    assert entry.rope_delta == prep.rope_delta != 0
    embeds = ad.embed(prep)
    ref = ad.generate(prep, embeds=embeds.clone(), ctx=PrefillContext(mode="dense"),
                      max_new_tokens=1)
    got = ad.continue_on(entry.kv, ad.suffix_embeds(conv), rope_delta=entry.rope_delta,
                         max_new_tokens=1)
    entry.kv.truncate(entry.length)
    assert torch.allclose(got.prefill_logits, ref.prefill_logits, atol=1e-4, rtol=1e-4), \
        (got.prefill_logits - ref.prefill_logits).abs().max()
