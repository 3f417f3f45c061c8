"""The answer pipeline end to end on a tiny Qwen2.5-VL checkpoint and a generated mp4:
the record (video facts, token counts, timings, sparsity), dense and sparse one flag apart,
adapter choice, and the errors users get."""

import json
import os

import av
import numpy as np
import pytest

from mminfer.errors import ConfigError, InputError, VideoError
from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.engine.pipeline import STAGES, Pipeline, pick_adapter
from mminfer.kernels import proxy


def write_mp4(path, n=16, w=96, h=64, fps=8):
    """A red square moving right over a dark blue background."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            img = np.zeros((h, w, 3), np.uint8)
            img[..., 2] = 40
            x = 4 * i % (w - 16)
            img[24:40, x:x + 16, 0] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("pipe") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_mp4(tmp_path_factory.mktemp("vid") / "square.mp4")


@pytest.fixture(scope="module")
def pipe(ckpt):
    return Pipeline(str(ckpt), attention="dense", device="cpu")


def test_dense_answer_record(pipe, mp4):
    res = pipe.answer(mp4, "  where does the red square move?  ", fps=4.0, max_new_tokens=5)
    d = res.to_dict()
    json.dumps(d)                                  # the record is plain JSON
    assert isinstance(res.answer, str) and res.attention == "dense" and res.sparsity is None
    assert d["model"] == "tiny-qwen" and d["attention_requested"] == "dense"
    v = d["video"]
    assert (v["frames"], v["fps"], v["duration"], v["width"], v["height"]) == (8, 8.0, 2.0, 96, 64)
    assert v["sampled_fps"] == pytest.approx(4.0) and v["model_frames"] == 8
    # tiny checkpoint's pixel range: 96x64 frames stay 84x56 (28-multiples) -> 2x3 merged grid
    h, w = v["resized"]
    t = d["tokens"]
    assert t["visual"] == (8 // 2) * (h // 28) * (w // 28)
    assert t["total"] == t["visual"] + t["text"]
    assert 1 <= t["generated"] <= 5 and t["text"] > 10
    ms = d["timings_ms"]
    assert list(ms) == list(STAGES) and all(x >= 0 for x in ms.values())
    for k in ("decode", "preprocess", "vision", "attention", "llm_other", "ttft", "total"):
        assert ms[k] > 0, k
    assert ms["index"] == 0                        # no estimation in a dense prefill
    assert ms["ttft"] <= ms["total"] and ms["attention"] + ms["llm_other"] <= ms["ttft"]


def test_same_request_same_answer(pipe, mp4):
    a = pipe.answer(mp4, "what color is the square?", max_new_tokens=4)
    b = pipe.answer(mp4, "what color is the square?", max_new_tokens=4)
    # greedy: deterministic; the second continues the first's kept prefix
    assert a.answer == b.answer and (a.cache, b.cache) == ("miss", "hit")
    assert {**a.tokens, "cached": 0} == {**b.tokens, "cached": 0} and b.tokens["cached"] > 0


def test_request_errors(pipe, mp4, tmp_path):
    with pytest.raises(InputError, match="question is empty"):
        pipe.answer(mp4, "   ")
    for fps in (0, -1.0, float("nan"), 1000):
        with pytest.raises(InputError, match="fps"):
            pipe.answer(mp4, "what?", fps=fps)
    with pytest.raises(InputError, match="max_new_tokens"):
        pipe.answer(mp4, "what?", max_new_tokens=0)
    with pytest.raises(InputError, match="attention"):
        pipe.answer(mp4, "what?", attention="fast")
    with pytest.raises(VideoError, match="not found"):
        pipe.answer(tmp_path / "missing.mp4", "what?")
    (tmp_path / "notes.txt").write_text("not a video at all\n")
    with pytest.raises(VideoError):
        pipe.answer(tmp_path / "notes.txt", "what?")


def test_prompt_over_the_context(tmp_path, mp4):
    small = save_tiny_qwen2_5_vl(tmp_path / "short-ctx", max_position_embeddings=40)
    p = Pipeline(str(small), attention="dense", device="cpu")
    with pytest.raises(InputError) as e:
        p.answer(mp4, "what?", fps=4.0, max_new_tokens=4)     # 24 visual + 18 text tokens
    assert e.value.details["limit"] == 40 and e.value.details["tokens"] + 4 > 40
    assert "40" in e.value.message and str(e.value.details["tokens"]) in e.value.message


def test_checkpoint_choice_and_errors(ckpt, tmp_path, monkeypatch):
    from mminfer.models.qwen2_5_vl import Qwen2_5_VLAdapter
    assert pick_adapter(ckpt) is Qwen2_5_VLAdapter
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="not a checkpoint mminfer knows"):
        pick_adapter(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        Pipeline(str(tmp_path / "config.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        Pipeline("nobody/no-such-model", device="cpu")
    with pytest.raises(ConfigError, match="attention"):
        Pipeline(str(ckpt), attention="fast")


def test_sparse_and_dense_one_flag_apart(pipe, ckpt, mp4):
    dense = pipe.answer(mp4, "where does the square move?", fps=4.0, max_new_tokens=4)
    sparse = pipe.answer(mp4, "where does the square move?", fps=4.0, max_new_tokens=4,
                         attention="sparse")
    assert dense.attention == "dense" and sparse.attention == "sparse"
    assert sparse.attention_requested == "sparse"
    assert {**sparse.tokens, "cached": 0} == {**dense.tokens, "cached": 0}
    # the default patterns' budgets cover every pair of a 40-token prompt: same answer
    assert sparse.answer == dense.answer
    s = sparse.sparsity
    # the last layer computes its last row only: no plan, named as such
    assert s["layers"] == [0] and len(s["per_layer"]) == 1 and s["last_row_only"] == 1
    assert s["mean_density"] == pytest.approx(1.0) and s["uncalibrated"] is True
    assert sparse.timings_ms["index"] > 0 and dense.timings_ms["index"] == 0
    # auto: dense while the head patterns are uncalibrated (the tiny checkpoint's defaults),
    # sparse from min_sparse_len tokens on once they are calibrated
    auto = Pipeline(str(ckpt), device="cpu", min_sparse_len=16)
    assert auto.adapter.patterns.uncalibrated
    assert auto.answer(mp4, "what?", max_new_tokens=2).attention == "dense"
    auto.adapter.patterns.uncalibrated = False
    auto.video_cache.clear()          # the config changed under the pipeline: rebuild
    assert auto.answer(mp4, "what?", max_new_tokens=2).attention == "sparse"
    assert pipe.answer(mp4, "what?", max_new_tokens=2, attention="auto").attention == "dense"


def test_the_auto_policy_is_said_in_words(ckpt, monkeypatch):
    """What "auto" does, for /v1/models, /v1/latency-report and /report: the CPU's "never"
    threshold is said as such, a real one with its number."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    p = Pipeline(str(ckpt), device="cpu")
    p.adapter.patterns.uncalibrated = False
    auto = p.attention_policy()["auto_attention"]
    assert auto.startswith("dense on the CPU") and str(p.min_sparse_len) not in auto, auto
    p.min_sparse_len = 65536
    assert p.attention_policy()["auto_attention"] == "sparse from 65,536 prompt tokens"


def test_sparse_without_a_gpu_or_the_interpreter_says_why(pipe, ckpt, mp4, monkeypatch):
    """On a CPU without TRITON_INTERPRET=1 the kernels cannot run: an explicit "sparse" is
    refused with the reason (not triton's "0 active drivers"), "auto" answers dense."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        Pipeline(str(ckpt), attention="sparse", device="cpu")
    auto = Pipeline(str(ckpt), device="cpu", min_sparse_len=16)
    with pytest.raises(InputError, match="needs a CUDA GPU"):
        auto.answer(mp4, "what?", max_new_tokens=2, attention="sparse")
    assert auto.answer(mp4, "what?", max_new_tokens=2).attention == "dense"


def test_cancel_stops_between_stages_and_layers():
    """A request whose cancel() turns True stops with Cancelled: once the video is open
    when it is already set, between chunks of the vision tower, and inside the prefill
    (before decoder layer 0) when it turns on there; the pipeline answers normally
    afterwards."""
    from pathlib import Path
    from mminfer.errors import Cancelled
    video = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
    q = "What number appears in the video?"
    pipe = Pipeline(attention="dense", device="cpu")
    with pytest.raises(Cancelled, match="after opening the video"):
        pipe.answer(video, q, cancel=lambda: True)
    # the sample is one chunk of the vision tower: the stage checks and that chunk's pass,
    # the first layer check stops
    calls = iter([False, False, False])
    with pytest.raises(Cancelled, match="layer 0"):
        pipe.answer(video, q, cancel=lambda: next(calls, True))
    pipe.adapter.vision_chunk_patches = 64          # one pair (8 x 8 patches) per chunk
    calls = iter([False, False, False])             # opened, chunks 1 and 2 pass; 3 stops
    with pytest.raises(Cancelled, match="vision tower"):
        pipe.answer(video, q, cancel=lambda: next(calls, True))
    assert pipe.answer(video, q).answer == "99"


def test_warmup_compiles_both_length_classes_before_the_first_request(tmp_path):
    """warmup() runs the product path (prepare, tower, prefill, decode) on a synthetic video
    at one prompt length divisible by 16 and one not, sparse where it can run; a no-op on the
    CPU unless forced; the pipeline answers as before afterwards."""
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny")
    pipe = Pipeline(str(ckpt), attention="auto", device="cpu", min_sparse_len=16)
    assert pipe.warmup() == {"ran": False, "why": "nothing to compile on the CPU"}
    seen = []
    real = pipe.adapter.prefill_prefix

    def prefill_prefix(prep, embeds, **kw):          # the path requests run: prefix first
        seen.append((prep.prefix_len, kw["ctx"].mode, proxy.TUNING["mass_layout"]))
        return real(prep, embeds, **kw)
    pipe.adapter.prefill_prefix = prefill_prefix
    warm = pipe.warmup(force=True, frames=4)
    sparse = os.environ.get("TRITON_INTERPRET") == "1"
    # sparse: a third prefill with the estimator's chunked mass pass, which only long
    # prompts take otherwise
    assert warm["ran"] and len(seen) == 2 + sparse
    assert warm["lengths"] == [n for n, _, _ in seen[:2]]
    assert sorted(n % 16 == 0 for n, _, _ in seen[:2]) == [False, True]
    assert {m for _, m, _ in seen} == {"sparse" if sparse else "dense"}
    assert [lay for _, _, lay in seen] == ["auto", "auto"] + ["chunks"] * sparse
    assert proxy.TUNING["mass_layout"] == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_warmup_compiles_the_estimators_chunked_mass_pass_on_the_gpu(tmp_path, monkeypatch):
    """Vertical-slash heads estimate through the proxy kernels; the warm-up compiles both
    of their mass-pass layouts, so the first prompt of 512K keys or more (or the piece of a
    live stream that reaches them) compiles no estimator kernel."""
    from triton import knobs

    from mminfer.kernels import compiles
    from mminfer.sparse.patterns import HeadPattern, HeadPatternConfig, Pattern
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_counts", {})
    monkeypatch.setattr(compiles, "_seconds", {})
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny")
    pipe = Pipeline(str(ckpt), attention="auto", device="cuda", min_sparse_len=16)
    ad = pipe.adapter
    vs = HeadPattern.single(Pattern("vertical_slash", n_vertical=32, n_slash=32, window=32,
                                    sink=4))
    ad.patterns = HeadPatternConfig(ad.patterns.identity,
                                    [[vs] * len(ad.patterns.layer(i))
                                     for i in range(len(ad.patterns.layers))])
    warm = pipe.warmup(frames=4)
    assert warm["sparse"] and warm["mass_layouts"] == ["auto", "chunks"]
    made = compiles.stats()["kernels"]
    assert made.get("_sets_mass_kernel", {}).get("compiles", 0) >= 1
    assert made.get("_sets_mass_chunk_kernel", {}).get("compiles", 0) >= 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the forks' kernel on the CPU needs TRITON_INTERPRET=1")
def test_warmup_compiles_every_row_tile_of_the_forks_kernel(tmp_path, monkeypatch):
    """With --kv-cache-dtype fp8 the warm-up also launches the kernel a question over a fork
    of a kept prefix runs once per row tile (kernels.fp8_attention.warm_lengths) over the
    warm-up's own cache; on the CPU a cache in the model's dtype is not read by it."""
    from lab.toy.tiny import save_tiny_qwen2_5_vl
    from mminfer.kernels import fp8_attention
    ckpt = save_tiny_qwen2_5_vl(tmp_path / "tiny")
    monkeypatch.setattr(fp8_attention, "warm_lengths", lambda group, gpu: [1, 2, 3])
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu", kv_cache_dtype="fp8")
    assert pipe.warmup(force=True, frames=4)["row_tiles"] == [1, 2, 3]
    plain = Pipeline(str(ckpt), attention="dense", device="cpu").warmup(force=True, frames=4)
    assert "row_tiles" not in plain
