"""``Pipeline(kv_cache_dtype="fp8")`` and the video cache: entries hold FP8 rows (bytes a
half of bf16's, here a quarter of the fp32 CPU model's, plus the scales), the key includes
what the cache stores (a change is a miss), the host tier moves FP8 rows and their scales and
answers the same after the trip; the flag from the command line to the pipeline, the server's
settings, /v1/models and the start line."""

import pytest
import torch

from lab.toy.tiny import save_tiny_qwen2_5_vl
from mminfer.engine.pipeline import Pipeline
from mminfer.errors import ConfigError
from mminfer.models.kv import FP8, tail_rows

from conftest import write_video

Q = "where does the red square move?"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("fp8vc") / "tiny-qwen")


@pytest.fixture(scope="module")
def mp4(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("vid") / "square.mp4", n_frames=16, fps=8.0,
                       width=96, height=64, noise=True)


def _entry(pipe):
    (entry,) = pipe.video_cache._entries.values()
    return entry


def test_pipeline_kv_cache_dtype_names(qwen):
    with pytest.raises(ConfigError, match="kv cache dtype"):
        Pipeline(str(qwen), attention="dense", device="cpu", kv_cache_dtype="int8")
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_cache_dtype="fp8_e4m3")
    assert pipe.kv_cache_dtype == "fp8_e4m3" and pipe.adapter.kv_cache_dtype is FP8
    auto = Pipeline(str(qwen), attention="dense", device="cpu")
    assert auto.kv_cache_dtype == "auto" and auto.adapter.kv_cache_dtype is None
    # the prefill's room is asked for in the bytes the cache will hold
    assert pipe.kv_bytes_per_token * 4 == auto.kv_bytes_per_token       # fp32 model


def test_entries_are_fp8_and_a_changed_kv_dtype_is_a_miss(qwen, mp4):
    auto = Pipeline(str(qwen), attention="dense", device="cpu")
    a = auto.answer(mp4, Q, fps=4.0, max_new_tokens=3)
    ref_entry = _entry(auto)
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_cache_dtype="fp8")
    first = pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3)
    entry = _entry(pipe)
    assert first.cache == "miss" and entry.kv.layers[0].k_buf.dtype == FP8
    n_layers, kv_heads = len(entry.kv.layers), entry.kv.layers[0].k_buf.shape[1]
    scales = n_layers * 2 * kv_heads * 4
    assert entry.length == ref_entry.length
    assert (entry.nbytes - scales) * 4 == ref_entry.nbytes              # fp32 -> fp8
    assert pipe.video_cache.stats()["gpu_bytes"] == entry.nbytes
    assert first.answer == a.answer                                       # FP8 error is small
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3).cache == "hit"
    # what the cache stores is part of the key: switching is a miss, switching back a hit
    pipe.kv_cache_dtype = "auto"
    other = pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3)
    assert other.cache == "miss" and other.answer == a.answer
    assert pipe.video_cache.stats()["gpu_entries"] == 2
    pipe.kv_cache_dtype = "fp8"
    assert pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3).cache == "hit"


def test_host_tier_moves_fp8_rows_and_scales(qwen, mp4):
    pipe = Pipeline(str(qwen), attention="dense", device="cpu", kv_cache_dtype="fp8",
                    kv_host_cache_gb=1.0)
    a = pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3)
    entry = _entry(pipe)
    layer = entry.kv.layers[0]
    bits, scale = layer.keys.view(torch.uint8).clone(), layer.k_scale.clone()
    nbytes, rows = entry.nbytes, entry.kv.nbytes
    # on the device the rows, their scales and the tail; on the host the rows and scales
    assert nbytes == entry.kv.bytes_at(entry.length + tail_rows(entry.length)) > rows
    assert pipe.video_cache.offload() == 1 and entry.tier == "host"
    assert pipe.video_cache.stats()["host_bytes"] == entry.nbytes == entry.kv.nbytes == rows
    assert entry.kv.capacity == entry.length
    assert layer.k_buf.dtype == FP8 and layer.k_scale is not None
    back = pipe.answer(mp4, Q, fps=4.0, max_new_tokens=3)
    assert back.cache == "host" and back.answer == a.answer
    assert torch.equal(layer.keys[..., :entry.length, :].view(torch.uint8), bits)
    assert torch.equal(layer.k_scale, scale) and entry.nbytes == nbytes
    # restored with its tail, which the hit's question claimed and gave back
    assert entry.kv.capacity == entry.length + tail_rows(entry.length)
    assert pipe.video_cache.counts["tail_reads"] == 2 and not entry.kv.tail_claimed


def test_the_flag_reaches_pipeline_settings_and_batch():
    from mminfer.cli import build_parser
    from mminfer.cli_options import pipeline_options
    from mminfer.serve.cli import banner, settings_from
    for cmd in ("answer", "serve", "batch"):
        extra = {"answer": ["v.mp4", "q"], "serve": [],
                 "batch": ["dir", "--out", "o.jsonl"]}[cmd]
        argv = [cmd, *extra, "--kv-cache-dtype", "fp8"]
        args = build_parser(argv).parse_args(argv)
        assert args.kv_cache_dtype == "fp8", cmd
        assert pipeline_options(args)["kv_cache_dtype"] == "fp8"
        dflt = build_parser([cmd, *extra]).parse_args([cmd, *extra])
        assert dflt.kv_cache_dtype == "auto"
        with pytest.raises(SystemExit):
            build_parser(argv[:-1] + ["int8"]).parse_args(argv[:-1] + ["int8"])
    argv = ["serve", "--kv-cache-dtype", "fp8_e4m3"]
    assert settings_from(build_parser(argv).parse_args(argv)).kv_cache_dtype == "fp8_e4m3"
    assert "(kv cache: fp8_e4m3)" in banner("0.0.0.0", 8000, "m", False, kv_cache_dtype="fp8_e4m3")


def test_batch_loads_the_pipeline_with_the_dtype(monkeypatch):
    from mminfer import batch
    seen = {}
    monkeypatch.setattr(batch, "Pipeline", lambda model, **kw: seen.update(kw) or "pipe")
    batch.load_pipeline({"model": "m", "attention": "auto", "kv_cache_dtype": "fp8"})
    assert seen["kv_cache_dtype"] == "fp8"


def test_v1_models_reports_the_kv_cache_dtype(qwen, tmp_path):
    from fastapi.testclient import TestClient
    from mminfer.serve.app import Settings, create_app
    app = create_app(Settings(model=str(qwen), device="cpu", data_dir=str(tmp_path),
                              kv_cache_dtype="fp8"))
    with TestClient(app) as client:
        assert app.state.worker.wait_ready(120)
        assert app.state.worker.pipeline.adapter.kv_cache_dtype is FP8
        model, _default = client.get("/v1/models").json()["data"]
        assert model["kv_cache_dtype"] == "fp8_e4m3"
