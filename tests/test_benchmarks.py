"""benchmarks/e2e.py on the CPU: the --tiny run writes every stage of both modes and the
baseline (measured and extrapolated), and the long-context checkpoint variant it builds for
the 276K case takes effect in the adapter."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import embedded_without_config, load_script

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "benchmarks" / "e2e.py"
STAGES = ("decode", "preprocess", "vision", "index", "attention", "llm_other", "generate",
          "ttft", "total")


def _e2e():
    return load_script("benchmarks/e2e.py", "e2e_bench")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    # the interpreter makes the sparse kernels runnable on the CPU (set before triton loads)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(E2E), "--tiny", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "e2e.json").read_text()), out, proc.stdout


def _stages_complete(entry, allow_none=()):
    t = entry["timings_ms"]
    assert set(STAGES) <= set(t), f"missing stages {set(STAGES) - set(t)}"
    for k in STAGES:
        if k in allow_none and t[k] is None:
            continue
        assert isinstance(t[k], (int, float)) and t[k] >= 0, (k, t[k])


def test_tiny_run_measures_every_stage_of_both_modes(tiny_run):
    rep, out, stdout = tiny_run
    assert set(rep["cases"]) == {"tiny-qwen", "tiny-longvila"}
    for name, case in rep["cases"].items():
        R = case["requests"]
        for mode in ("sparse", "dense"):
            assert "error" not in R[mode], R[mode].get("error")
            _stages_complete(R[mode])
        assert R["sparse"]["attention_ran"] == "sparse"
        assert R["sparse"]["measured"] is True
        assert R["sparse"]["timings_ms"]["index"] > 0       # estimation ran
        assert R["sparse"]["peak_rss_gib"] > 0
        assert R["sparse"]["tokens"]["total"] == case["summary"]["tokens"] > 0
        # the baseline has no decode steps (first token only)
        _stages_complete(R["transformers"], allow_none=("generate", "total"))
        for key in ("dense_over_sparse", "transformers_over_sparse", "transformers_over_dense",
                    "dense_over_sparse_excl_decode"):
            assert case["summary"]["ratios"][key] > 0, key
        assert name in (out / "table.txt").read_text() and name in stdout

    q = rep["cases"]["tiny-qwen"]["requests"]
    assert q["dense"]["attention_ran"] == "dense" and q["dense"]["measured"] is True
    assert q["transformers"]["measured"] is True
    assert q["transformers"]["timings_ms"]["attention"] > 0    # split by the timed sdpa
    assert q["first_request"]["warmup_frames"] == 8             # the short warm-up
    assert q["first_request"]["tokens"]["total"] < q["sparse"]["tokens"]["total"]


def test_tiny_longvila_figures_are_marked_and_add_up(tiny_run):
    rep, out, _ = tiny_run
    case = rep["cases"]["tiny-longvila"]
    R, probe = case["requests"], case["probe"]
    assert R["dense"]["measured"] is False and R["transformers"]["measured"] is False
    assert "first_request" not in R                             # warm-up "none"
    # the probe ran the dense prefix's length, and a dense prefix attends in every layer
    # but the last (which writes its K/V only)
    assert probe["tokens"] == R["sparse"]["tokens"]["prefix"]
    assert probe["attention_calls"] == probe["layers"] - 1
    assert probe["attention_total_ms"] == pytest.approx(
        probe["attention_ms"] * probe["attention_calls"], abs=1e-3)
    assert len(probe["calls"]) == 3 and probe["first_call"]["layer"] == 0   # 1 untimed + 3
    # tiny-qwen's dense run is measured: it validates the probe, and where they disagree
    # by more than 5 % the extrapolated rows take its factor, marked
    v = rep["cases"]["tiny-qwen"]["probe_validation"]
    # the factor is reported to 4 decimals: within 5e-5 of the ratio whatever its size
    assert v["factor"] == pytest.approx(v["measured_attention_ms"] / v["probe_attention_ms"],
                                        rel=1e-3, abs=5e-5)
    corr = rep["probe_correction"]
    assert (corr is None) == v["within"]
    f = 1.0 if corr is None else corr["factor"]
    if corr:
        assert corr["factor"] == v["factor"] and "tiny-qwen" in corr["from"]
        assert R["dense"]["probe_factor"] == corr and R["transformers"]["probe_factor"] == corr
    s, d = R["sparse"]["timings_ms"], R["dense"]["timings_ms"]
    assert d["attention"] == pytest.approx(probe["attention_total_ms"] * f, abs=2e-3)
    assert d["llm_other"] == pytest.approx(s["llm_other"], abs=1e-3) and d["index"] == 0
    assert d["ttft"] == pytest.approx(s["ttft"] - s["index"] - s["attention"] + d["attention"],
                                      abs=0.01)
    assert d["vision"] == s["vision"] and d["suffix"] == s["suffix"]
    t = R["transformers"]["timings_ms"]          # one-shot: attention in every layer
    assert t["attention"] == pytest.approx(probe["attention_ms"] * probe["layers"] * f,
                                           abs=2e-3)
    assert t["llm_other"] == pytest.approx(s["llm_other"], abs=1e-3)
    parts = sum(t[k] for k in ("decode", "preprocess", "vision", "attention", "llm_other"))
    assert t["ttft"] == pytest.approx(parts, abs=0.01)
    rows = case["summary"]["rows"]
    assert rows["dense"]["measured"] is False and rows["sparse"]["measured"] is True
    assert rows["dense"]["precision"] == rows["sparse"]["precision"] == "fp32"
    assert case["summary"]["ratios"]["dense_over_sparse"] == pytest.approx(
        rows["dense"]["ttft_ms"] / rows["sparse"]["ttft_ms"], rel=1e-2)
    text = (out / "table.txt").read_text()
    assert "tiny-longvila dense extrapolated: the sparse request's TTFT" in text
    assert "Dense probe: the product's dense prefill layer by layer" in text


def _fake_case(probe_ms=1100.0, measured_factor=1.6):
    """A 276K-like case by hand: the sparse row, a 4-layer probe and a dense row measured
    ``measured_factor`` x what the probe predicts."""
    sparse = {"mode": "sparse", "measured": True, "precision": "fp8 linear",
              "tokens": {"total": 276503, "prefix": 276483},
              "timings_ms": {"restore": 0.0, "decode": 1000.0, "preprocess": 200.0,
                             "vision": 3000.0, "index": 300.0, "attention": 1500.0,
                             "llm_other": 6800.0, "suffix": 40.0, "generate": 400.0,
                             "ttft": 12000.0, "total": 12450.0},
              "ttft_excl_decode_ms": 11000.0}
    probe = {"tokens": 276483, "layers": 28, "layers_timed": [0, 9, 18, 27],
             "attention_calls": 27, "attention_ms": probe_ms, "rest_ms": 250.0,
             "attention_total_ms": probe_ms * 27, "heads": 28, "kv_heads": 4, "head_dim": 128,
             "first_call": {"layer": 0, "attention_ms": 1700.0}, "calls": [],
             "sdpa": {"backend": "FLASH_ATTENTION"}}
    att = probe_ms * 27 * measured_factor
    dense = {"mode": "dense", "measured": True, "precision": "fp8 linear",
             "tokens": sparse["tokens"],
             "timings_ms": {**sparse["timings_ms"], "index": 0.0, "attention": att,
                            "ttft": 12000.0 - 1800.0 + att},
             "ttft_excl_decode_ms": 11000.0 - 1800.0 + att}
    return sparse, probe, dense


def test_extrapolation_arithmetic_validation_and_marking():
    """The dense row made from the sparse row and the probe, the probe checked against a
    measured dense row (the factor, the 5 % tolerance), the run's correction applied once
    and marked, and the tables saying which figure is which and in which precision."""
    e2e = _e2e()
    dp = load_script("benchmarks/dense_probe.py", "dense_probe")
    assert dp.spread_layers(28, 4) == [0, 9, 18, 27] and dp.spread_layers(28, 1) == [0]
    assert dp.timed_calls([0], 3) == [0, 0, 0]
    assert dp.timed_calls([0, 9, 18, 27], 3) == [0, 9, 18, 27]

    sparse, probe, dense = _fake_case()
    x = e2e.extrapolated_dense(sparse, probe)
    t = x["timings_ms"]
    assert x["measured"] is False and x["precision"] == "fp8 linear"
    assert t["attention"] == 1100.0 * 27 and t["index"] == 0.0 and t["llm_other"] == 6800.0
    assert t["ttft"] == 12000.0 - 300.0 - 1500.0 + 29700.0
    assert t["total"] == t["ttft"] + 450.0
    assert "4 of 28 layers measured in full" in x["how"]

    v = e2e.validate_probe(dense, sparse, probe)
    assert v["factor"] == pytest.approx(1.6) and v["within"] is False
    assert e2e.validate_probe(x, sparse, probe) is None            # nothing measured
    close = dict(v, tokens=115000, factor=1.01, within=True)
    report = {"cases": {"qwen115k": {"probe_validation": close},
                        "qwen276k": {"probe_validation": v}}}
    corr = e2e.probe_correction(report, "auto")
    assert corr["factor"] == pytest.approx(1.6) and "qwen276k" in corr["from"]
    assert e2e.probe_correction(report, "none") is None
    assert e2e.probe_correction(report, "1.25") == {"factor": 1.25, "from": "--probe-factor"}
    assert e2e.probe_correction({"cases": {"a": {"probe_validation": close}}}, "auto") is None

    R = {"sparse": sparse, "dense": x}
    ttft = t["ttft"]
    e2e.correct_extrapolated(R, corr)
    e2e.correct_extrapolated(R, corr)                                # applied once
    assert x["attention_uncorrected_ms"] == 29700.0 and x["probe_factor"] == corr
    assert x["timings_ms"]["attention"] == pytest.approx(29700.0 * 1.6, abs=1e-3)
    assert x["timings_ms"]["ttft"] == pytest.approx(ttft + 29700.0 * 0.6, abs=1e-3)
    assert sparse["timings_ms"]["attention"] == 1500.0                # measured rows untouched

    tf = {"mode": "transformers", "measured": True, "precision": "bf16",
          "timings_ms": dict(sparse["timings_ms"], ttft=60000.0), "ttft_excl_decode_ms": 59000.0}
    R["transformers"] = tf
    probe["versus_cudnn"] = dp.versus_cudnn(probe, {"ms": 1000.0, "tflops": 548.1,
                                                    "gqa": "K/V repeated"})
    vc = probe["versus_cudnn"]
    assert vc["ours_tflops"] == pytest.approx(
        4 * 28 * 128 * 276483 * 276484 / 2 / 1100.0 / 1e9, rel=1e-3)
    assert vc["at_cudnn_speed"] is False and vc["ours_backend"] == "FLASH_ATTENTION"
    case = e2e.Case("qwen276k", "qwen", 768, 560, 1008)
    s = e2e.summarise(case, R, probe, v)
    assert s["same_precision"] == {"dense_over_sparse": True, "transformers_over_sparse": False,
                                   "transformers_over_dense": False}
    assert s["targets"]["probe_over_measured_dense"]["met"] is False
    assert s["targets"]["dense_attention_over_cudnn"]["met"] is False
    text = e2e.table({"dtype": "bfloat16", "quantization": "fp8",
                      "cases": {"qwen276k": {"requests": R, "summary": s, "probe": probe,
                                             "probe_validation": v}}})
    row = next(ln for ln in text.splitlines() if ln.startswith("qwen276k") and " dense " in ln)
    assert " x " in row and "fp8 linear" in row
    ratios = next(ln for ln in text.splitlines() if ln.startswith("qwen276k") and "*" in ln)
    assert "x+" in ratios                  # FP8 rows against the bf16 transformers row
    assert "1.600 !" in text and "FLASH_ATTENTION" in text and "K/V repeated" in text
    assert "qwen276k dense extrapolated:" in text and "attention x 1.6" in text

    args = e2e.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8",
                           "--dtype", "bfloat16"])
    assert e2e.precision(args) == "fp8 linear + fp8 KV"
    assert e2e.precision(args, ours=False) == "bf16"
    args = e2e.parse_args(["--dtype", "bfloat16", "--dense-layers", "4"])
    assert e2e.precision(args) == "bf16" and args.dense_layers == 4


def test_the_probe_times_the_call_the_dense_prefill_makes(tmp_path):
    """A dense request through Pipeline.answer and the probe, both recorded at SDPA: the probe
    makes the call each of the request's prefix layers makes (the same callers down from the
    decoder layer, q/k/v shapes, dtypes and strides of the slab cache's views, the same
    arguments and the backend PyTorch picks for them), and counts as many of them. The same
    for the prefill into a DynamicCache that Adapter.generate and benchmarks/prefill.py run."""
    import torch
    from mminfer.engine.pipeline import Pipeline
    from mminfer.models.base import _new_cache
    from mminfer.models.prefill import prefill

    e2e = _e2e()
    dp = load_script("benchmarks/dense_probe.py", "dense_probe")
    ckpt = tmp_path / "qwen"
    e2e.write_qwen(ckpt, "cpu", tiny=True)
    video = e2e.write_video(tmp_path / "v.mp4", 8, 112, 112, 2.0)["path"]
    pipe = Pipeline(str(ckpt), device="cpu", dtype="float32")
    args = e2e.parse_args(["--tiny", "--max-new-tokens", "2", "--dtype", "float32"])
    case = e2e.Case("t", "qwen", 8, 112, 112)

    def layer_calls(calls):
        return [c for c in calls if "mminfer.models.prefill:_decoder_layer" in c["callers"]]

    with dp.record_sdpa() as during_request:
        ref = e2e.request(pipe, case, video, "dense", args)
    assert "error" not in ref, ref.get("error")
    product = layer_calls(during_request)
    tm = pipe.adapter.text_model
    P = ref["tokens"]["prefix"]
    assert len(product) == len(tm.layers) - 1
    assert product[0]["q_len"] == product[0]["kv_len"] == P
    assert product[0]["callers"][:2] == ["transformers.integrations.sdpa_attention:"
                                         "sdpa_attention_forward",
                                         "mminfer.models.hooks:attention_forward"]
    # the prefix's slab holds its rows and its tail (a lone question's rows go there): K is
    # a view of the slab, and the probe's cache is the same
    assert not product[0]["k"]["contiguous"]
    # the request's suffix and decode steps continue the cache: other calls, not timed here
    assert len(during_request) > len(product)

    with dp.record_sdpa() as during_probe:
        probe = e2e.probe_dense(pipe, ref, args)
    assert "error" not in probe, probe.get("error")
    probed = layer_calls(during_probe)
    assert len(probed) == 1 + 3                                  # one untimed, three timed
    for c in probed:
        assert c == product[0]
    assert probe["sdpa"] == product[0] and probe["attention_calls"] == len(product)
    assert probe["precision"] == "fp32" and probe["kv_dtype"] is None

    # Adapter.generate's prefill (a DynamicCache), as benchmarks/prefill.py times it
    h = torch.randn(1, P, tm.config.hidden_size)
    with dp.record_sdpa() as during_generate, torch.inference_mode():
        prefill(tm, h, _new_cache(tm))
    with dp.record_sdpa() as during_probe:
        dp.probe_layers(tm, P, cache=lambda: _new_cache(tm), repeats=1)
    full = [c for c in layer_calls(during_generate) if c["q_len"] == P]
    assert full and all(c == full[0] for c in layer_calls(during_probe))


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_dense_prefill_attention_runs_at_cudnn_speed():
    """Our dense prefill's attention (the call the probe times: the hook's SDPA call, the
    backend PyTorch picks, the slab cache's K/V) against a standalone cuDNN SDPA call at the
    same shape, Qwen2.5-VL-7B's heads at 64K tokens: within 5 % of cuDNN's TFLOP/s."""
    import torch
    from mminfer.models.longvila import longvila_7b_llm_config, random_llm

    dp = load_script("benchmarks/dense_probe.py", "dense_probe")
    lm = random_llm(longvila_7b_llm_config(num_hidden_layers=2, vocab_size=1024),
                    dtype=torch.bfloat16, device="cuda")
    n = 65536
    probe = dp.probe_layers(lm.model, n, repeats=5)
    attn = lm.model.layers[0].self_attn
    ref = dp.cudnn_reference(n, 28, 4, 128, device="cuda", dtype=torch.bfloat16,
                             scale=attn.scaling, repeats=5)
    vc = dp.versus_cudnn(probe, ref)
    assert vc is not None, ref
    assert vc["ours_over_cudnn"] >= 1 - dp.WITHIN, vc


def test_long_context_variant_raises_context_and_budget(tmp_path):
    import torch
    from mminfer.models.qwen2_5_vl import Qwen2_5_VLAdapter

    e2e = _e2e()
    base, long = tmp_path / "base", tmp_path / "long"
    e2e.write_qwen(base, "cpu", tiny=True)
    lo = e2e.QWEN_TINY_PIXELS[0]
    e2e.long_context_variant(base, long, 65536, total_pixels=16 * lo // 2)
    assert (long / "model.safetensors").is_symlink()
    assert not (long / "config.json").is_symlink()

    frames = torch.from_numpy(np.stack(list(e2e.synthetic_frames(16, 112, 112))))

    class Video:   # what decode returns, for prepare
        def __init__(self, f):
            self.frames, self.sampled_fps = f, 2.0

    a = Qwen2_5_VLAdapter.from_pretrained(base, device="cpu", dtype=torch.float32)
    b = Qwen2_5_VLAdapter.from_pretrained(long, device="cpu", dtype=torch.float32)
    assert a.max_context == 128000 and b.max_context == 65536
    # 112x112 frames: 16 tokens per frame pair under the base's per-frame range; the
    # variant's whole-video budget of 16 frames x 4 tokens cuts them to 2x2
    assert a.prepare(Video(frames), "what ?").visual_tokens == 8 * 16
    assert b.prepare(Video(frames), "what ?").visual_tokens == 8 * 4
    for p1, p2 in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p1, p2)


@pytest.mark.parametrize("model", ["qwen", "longvila"])
def test_baseline_survives_an_adapter_that_streams_its_pixels(tmp_path, model):
    """The vision rework may stop handing all patches over in Prepared, or replace the
    towers: the baseline then rebuilds inputs of the same shape and transformers' own tower,
    and still measures every stage."""
    from mminfer.engine.pipeline import Pipeline

    e2e = _e2e()
    ckpt = tmp_path / model
    if model == "qwen":
        e2e.write_qwen(ckpt, "cpu", tiny=True)
    else:
        e2e.write_longvila(ckpt, "cpu", tiny=True, max_position=8192, num_frames=8)
    video = e2e.write_video(tmp_path / "v.mp4", 8, 112, 112, 2.0)["path"]
    pipe = Pipeline(str(ckpt), device="cpu", dtype="float32")
    args = e2e.parse_args(["--tiny", "--max-new-tokens", "2"])
    case = e2e.Case("t", model, 8, 112, 112)
    ref = e2e.request(pipe, case, video, "dense", args)
    assert "error" not in ref, ref.get("error")

    ad = pipe.adapter
    real_prepare = ad.prepare

    def streamed(*a, **kw):
        p = real_prepare(*a, **kw)
        p.tensors.pop("pixel_values_videos" if model == "qwen" else "pixels", None)   # streamed already
        return p

    ad.prepare = streamed
    if model == "longvila":
        ad.tower, ad.projector = object(), None      # not transformers' tower, no projector
    b = e2e.baseline(pipe, case, video, args, run_prefill=True, vision_frames=8, sparse=ref,
                     probe=None)
    assert "error" not in b, b.get("error")
    assert b["measured"] is True and "synthetic" in b["vision_inputs"]
    if model == "longvila":
        assert "fresh transformers tower" in b["vision_inputs"]
    _stages_complete(b, allow_none=("generate", "total"))
    assert b["tokens"]["total"] == ref["tokens"]["total"]
    assert b["timings_ms"]["vision"] > 0 and b["timings_ms"]["attention"] > 0


def test_calibrate_benchmark_runs_the_users_command_and_measures_it(tmp_path):
    """benchmarks/calibrate.py --tiny: `mminfer calibrate` on a checkpoint it wrote, with the
    capture's tokens, the phases' times and the host memory measured from outside."""
    from mminfer.sparse.patterns import HeadPatternConfig
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "calibrate.py"), "--tiny",
                           "--model", "qwen", "--out", str(out), "--work-dir",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [rec] = json.loads((out / "calibrate.json").read_text())
    assert rec["rc"] == 0 and rec["tokens"] and rec["tokens"][0] > 50
    assert 0 < rec["capture_s"] <= rec["total_s"] and rec["search_s"] >= 0
    assert rec["capture_bytes"] > 0 and rec["peak_host_rss_gib"] > 0
    assert "calibrate --model" in rec["command"] and "--device cpu" in rec["command"]
    cfg = HeadPatternConfig.load(out / "qwen-tiny" / "heads.json")
    assert cfg.identity.layers == rec_layers(tmp_path / "work" / "qwen-tiny")
    assert not (tmp_path / "work" / "qwen.captures").exists()      # captures removed


def rec_layers(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["num_hidden_layers"]


def test_e2e_quantization_reaches_the_report_and_the_table():
    """--quantization fp8 is parsed for the Pipeline and names itself in the table's title
    (the transformers baseline row stays in the dtype)."""
    e2e = _e2e()
    assert e2e.parse_args(["--tiny"]).quantization is None
    assert e2e.parse_args(["--tiny", "--quantization", "fp8"]).quantization == "fp8"
    title = e2e.table({"quantization": "fp8", "dtype": "bfloat16", "cases": {}}).splitlines()[0]
    assert "linear layers fp8 (transformers row: bfloat16)" in title
    assert "fp8" not in e2e.table({"dtype": "bfloat16", "cases": {}}).splitlines()[0]


def test_siglip_benchmark_runs_the_e2e_vision_stage(tmp_path):
    """benchmarks/siglip.py --tiny: the adapter's tower (3 layers cut to 2 as LongVILA's -2
    feature layer), its batch and the e2e's tiny video, each variant through LongVILA.embed;
    and at full size the shapes the 1.05M case runs (26 layers, 448 px, 32 frames, 128
    batches for 4096 frames, 1,052,672 visual rows)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "siglip.py"), "--tiny",
                           "--frames", "8", "--reps", "1", "--profile", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "siglip.json").read_text())
    prof = (out / "siglip_profile.txt").read_text()        # one table a variant
    assert prof.count("one encoder call of 8 frames ==") == 3 and "aten::" in prof
    assert rep["layers"] == 2 and rep["input"] == "video" and rep["frames"] == 8
    assert rep["video"] == {"case": "tiny-longvila", "frames": 16, "batches": 2, "height": 112,
                            "width": 112, "source": "video"}
    assert len(rep["rows"]) == 3
    for r in rep["rows"].values():
        assert r["ms"] > 0 and r["stage_ms"] > 0 and r["video_vision_ms"] > 0
        assert r["rel_error_vs_bf16"] < 0.2
    assert "per video (tiny-longvila: 16 frames = 2 batches of 8" in proc.stdout

    import torch
    bench = load_script("benchmarks/siglip.py", "siglip_bench")
    with torch.device("meta"):
        ad = bench.adapter(bench.SO400M, bench.LLM_HIDDEN, bench.LongVILA.vision_batch,
                           "meta", torch.bfloat16)
    case = bench.e2e.full_cases()["longvila1m"]
    assert len(ad.tower.encoder.layers) == 26 and ad.tower.config._attn_implementation == "sdpa"
    assert ad.image_size == 448 and ad.tower.embeddings.num_patches == 1024
    assert ad.vision_batch == 32 and case.frames // ad.vision_batch == 128
    # the e2e JSON's visual tokens: 256 projected rows + the newline per frame
    assert case.frames * (ad.tokens_per_frame + 1) == 1052672


def _cell_number(cell: str) -> float:
    return float(re.search(r"[\d.]+", cell.replace("**", "")).group(0))


def test_readme_headline_quotes_the_committed_runs():
    """README's headline figures are the runs kept in benchmarks/results, rounded as printed:
    each TTFT of the table from its run's JSON (the first request of each mode; e2e A at
    767efc9 for 115K and 276K, C at 659a489 for 1.05M), a figure marked extrapolated exactly
    where its row was not measured, the kernels' TFLOP/s range over every pattern, and the FP8
    sentence from one call at a commit that landed; BENCHMARKS quotes the same."""
    res = ROOT / "benchmarks" / "results"
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "BENCHMARKS.md").read_text()
    a = json.loads((res / "2026-12-01-767efc9" / "e2e.json").read_text())["cases"]
    c = json.loads((res / "2026-12-01-659a489-longvila1m" / "e2e.json").read_text())["cases"]
    for tokens, rec in (("115K", a["qwen115k"]), ("276K", a["qwen276k"]),
                        ("1.05M", c["longvila1m"])):
        line = next(ln for ln in readme.splitlines() if f"| {tokens} |" in ln)
        cells = [x.strip() for x in line.strip().strip("|").split("|")][2:]
        for cell, mode in zip(cells, ("sparse", "dense", "transformers")):
            row = rec["requests"][mode]           # C ran sparse twice: the first is quoted
            s = row["timings_ms"]["ttft"] / 1e3
            assert _cell_number(cell) == (round(s, 1) if s < 100 else round(s)), (tokens, mode)
            assert ("extrapolated" in cell) == (not row["measured"]), (tokens, mode, cell)
            assert f"{s:.2f}" in bench, (tokens, mode)
    kern = json.loads((res / "2026-12-01-2abce60" / "kernels_variants_131072_block_a_shape_grid_"
                       "vertical_slash.json").read_text())["rows"]
    ours = [r["tflops"] for r in kern if r["impl"] == "mminfer" and r.get("variant") == "default"]
    assert len(ours) == 4
    assert f"run at {min(ours):.0f}–{max(ours):.0f} TFLOP/s" in readme
    one_call = json.loads((res / "2026-12-04-fp8-vision" / "e2e_276k_d38a582.json").read_text())
    ttft = {v: r["cases"]["qwen276k"]["requests"]["sparse"]["timings_ms"]["ttft"] / 1e3
            for v, r in one_call.items()}
    assert {r["env"]["commit"] for r in one_call.values()} == {"d38a582"}
    assert f"{ttft['fp8']:.1f} s instead of {ttft['bf16']:.1f} s in bf16" in readme
    assert f"**{ttft['fp8']:.2f} s** vs {ttft['bf16']:.2f} s" in bench
    assert "`d38a582`" in readme
    # 89a3ba8's figures are named as the lost commit's wherever they are quoted
    for text in (readme, bench):
        for ln in text.splitlines():
            if "7.47" in ln or "10.90" in ln:
                assert "89a3ba8" in ln or "lost" in ln, ln


@pytest.mark.slow
def test_load_benchmark_drives_both_server_modes(tmp_path):
    """benchmarks/load.py on the CPU at a tiny scale: both modes run through the real server,
    every request answered, the hits hit, the report written."""
    videos = ROOT / "samples" / "videos"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"),
         "--new-video", str(videos / "needle_2.mp4"), "--cached-video",
         str(videos / "needle_0.mp4"), "--cached-video", str(videos / "needle_1.mp4"),
         "--duration-s", "6", "--hit-rate", "2", "--max-frames", "64", "--max-new-tokens", "3",
         "--alone", "--serve-arg=--device", "--serve-arg=cpu", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "load.json").read_text())
    assert set(rep["modes"]) == {"serial", "scheduler"}
    for mode in rep["modes"].values():
        new, hit = mode["new_video"], mode["hit"]
        assert new["count"] >= 1 and hit["count"] >= 6
        assert new["errors"] == hit["errors"] == 0
        assert set(hit["cache"]) == {"hit"} and set(new["cache"]) == {"miss"}
        assert hit["ttft_ms"]["p99"] is not None and new["per_minute"] > 0
        # the CPU's cache measures no free memory: nothing is moved to make room
        assert mode["spills"] == {"gib": 0.0, "seconds": 0.0}
        assert mode["compiles"] == {"count": 0, "seconds": 0.0}    # the interpreter's
    assert "--max-num-seqs" in " ".join(rep["modes"]["serial"]["serve_args"])
    assert "serial" in proc.stdout and "scheduler" in proc.stdout


def test_load_benchmark_drives_a_longvila_server(tmp_path):
    """The issue's second load case (run_load_h200.sh MODEL=longvila) at a tiny scale: a
    LongVILA checkpoint in the real layout (e2e.py's writer, tiny shapes) through the real
    server with the scheduler, every request answered, the hits hit."""
    ckpt = tmp_path / "longvila"
    _e2e().write_longvila(ckpt, "cpu", tiny=True, max_position=8192, num_frames=8)
    videos = ROOT / "samples" / "videos"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--model", str(ckpt),
         "--modes", "scheduler", "--new-video", str(videos / "needle_2.mp4"),
         "--cached-video", str(videos / "needle_0.mp4"), "--duration-s", "4", "--hit-rate", "2",
         "--max-frames", "8", "--max-new-tokens", "3", "--attention", "sparse",
         "--serve-arg=--device", "--serve-arg=cpu", "--out", str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mode = json.loads((tmp_path / "out" / "load.json").read_text())["modes"]["scheduler"]
    new, hit = mode["new_video"], mode["hit"]
    assert new["count"] >= 1 and hit["count"] >= 4 and new["errors"] == hit["errors"] == 0
    assert set(hit["cache"]) == {"hit"} and set(new["cache"]) == {"miss"}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a container's init may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_load_benchmark_stops_its_server_when_stopped(tmp_path):
    """A device script's `timeout` stops load.py with SIGTERM: the server it started goes too
    (left running, it would hold the GPU for the script's next command)."""
    videos = ROOT / "samples" / "videos"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--modes", "scheduler",
         "--new-video", str(videos / "needle_2.mp4"), "--cached-video",
         str(videos / "needle_0.mp4"), "--duration-s", "600", "--max-frames", "12",
         "--serve-arg=--device", "--serve-arg=cpu", "--out", str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    pid = None
    try:
        for line in proc.stdout:
            m = re.match(r"server pid (\d+) at http", line)
            if m:
                pid = int(m.group(1))
                break
        assert pid is not None and _alive(pid), "load.py printed no server pid"
        proc.terminate()
        assert proc.wait(60) == 128 + 15
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), "the server outlived load.py"
    finally:
        proc.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, 9)


def test_load_benchmark_decoders_phase(tmp_path):
    """--decoders alone (no load modes): N answers over N distinct cached prefixes decode at
    once through the real server, then (--decode-shared) N questions about one of them;
    per-token times and the aggregate rate are reported for both."""
    videos = ROOT / "samples" / "videos"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--modes", "",
         "--new-video", str(videos / "needle_2.mp4"), "--cached-video",
         str(videos / "needle_0.mp4"), "--max-frames", "12", "--decoders", "3",
         "--decode-tokens", "6", "--decode-shared", "--serve-arg=--device",
         "--serve-arg=cpu", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads((tmp_path / "load.json").read_text())["decode"]
    for phase, prefixes in ((d, 3), (d["shared"], 1)):
        assert phase["decoders"] == 3 and phase["errors"] == 0
        assert phase["cache"] == ["hit"] * 3 and phase["prefixes"] == prefixes
        assert len(phase["ms_per_token"]) == 3 and phase["aggregate_tokens_per_s"] > 0
        assert phase["aggregate_vs_alone"] > 0 and phase["worst_per_token_vs_alone"] > 0
        # the server's batch counts over the phase: every decode step went through a batch
        assert phase["batches"] > 0 and 1.0 <= phase["mean_batch"] <= 3.0
    assert "one shared prefix" in proc.stdout


@pytest.mark.slow
def test_load_benchmark_compares_data_parallel_routing(tmp_path):
    """benchmarks/load.py --data-parallel 2 on the CPU: both routing modes run through a real
    2-engine server under the doubled workload, every request answered, the hit class's hit
    rate measured (every hit with affinity), throughput reported."""
    videos = ROOT / "samples" / "videos"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"),
         "--new-video", str(videos / "needle_2.mp4"), "--cached-video",
         str(videos / "needle_0.mp4"), "--cached-video", str(videos / "needle_1.mp4"),
         "--duration-s", "4", "--hit-rate", "2", "--max-frames", "12", "--max-new-tokens", "3",
         "--data-parallel", "2", "--serve-arg=--device", "--serve-arg=cpu",
         "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "load.json").read_text())
    assert set(rep["modes"]) == {"dp2-affinity", "dp2-round_robin"}
    for mode in rep["modes"].values():
        assert mode["engines"] == 2 and len(mode["health_after"]["engines"]) == 2
        assert mode["new_video"]["errors"] == mode["hit"]["errors"] == 0
        assert mode["hit"]["count"] >= 8 and mode["answers_per_s"] > 0
        assert 0 <= mode["hit"]["hit_rate"] <= 1
    assert rep["modes"]["dp2-affinity"]["hit"]["hit_rate"] == 1.0
    assert "dp2-round_robin" in proc.stdout and "hit%" in proc.stdout


def test_calib_quality_calibrates_both_scorings_and_evaluates_both_as_served(tmp_path):
    """benchmarks/calib_quality.py --tiny (the smallest honest setting: two 8-frame calibration
    videos, the CPU's ladder of three rungs, one 8-frame held-out video per task, the reference
    engine): a config per scoring, each one's calibration numbers being its own scoring's
    (measured again here), both evaluated as served on the same held-out videos."""
    import hashlib

    from mminfer.engine.pipeline import Pipeline
    from mminfer.models.embedded import default_model
    from mminfer.offline import served_policy as SP
    from mminfer.offline.answer_kl import AnswerProbe
    from mminfer.offline.capture import load_video
    from mminfer.sparse.patterns import HeadPatternConfig
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "calib_quality.py"),
                           "--tiny", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "calib_quality.json").read_text())
    assert "agree S" in proc.stdout and "one_shot" in proc.stdout     # the printed table
    cal, held = r["calibration"], r["held_out"]
    # the files the evaluation ran are the ones each calibration wrote
    cfgs = {}
    for side, key in (("served", "served_policy"), ("one_shot", "one_shot")):
        path = out / f"{side}.json"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == cal[side]["sha256"] \
            == held["configs"][f"cfg:{side}"]["sha256"]
        cfgs[side] = HeadPatternConfig.load(path)
        prov = cfgs[side].provenance
        assert prov["calibration_scoring"] == {"served": "served", "one_shot": "one-shot"}[side]
        assert prov[key]["per_head_bound"] == cal[side]["per_head_bound"] in r["ladder"]
        t = cal[side]["times"]
        assert t["search_s"] > 0 and t["ladder_s"] > 0 and t["total_s"] >= t["search_s"]
    assert held["configs_policy"] == "served"
    # each config's calibration numbers are its own scoring's on the calibration videos: a
    # side that took the other's config (or numbers) fails here, whichever rung each chose
    ad = Pipeline(str(default_model()), attention="dense", device="cpu").adapter
    block = tuple(r["block"])
    probe = AnswerProbe(ad, engine="reference", block=block, one_shot=True)
    got = {"served": [], "one_shot": []}
    for v in r["calibration_videos"]:
        decoded, question, name = load_video(v, ad, "")
        inp = SP.prepare(ad, decoded, question, name)
        dense = SP.run_served(ad, inp, None, max_new_tokens=4)
        run = SP.run_served(ad, inp, cfgs["served"], max_new_tokens=4, engine="reference",
                            block=block)
        got["served"].append(SP.compare(dense, run))
        kl, dens = probe.kl(probe.prepare(name, decoded, question), cfgs["one_shot"])
        got["one_shot"].append({"kl": kl, "density": dens})
    for side in ("served", "one_shot"):
        want = cal[side]["calibration"]
        n = len(got[side])
        assert want["n"] == n == 2
        assert sum(g["kl"] for g in got[side]) / n == pytest.approx(want["mean_kl"], abs=2e-6)
        assert sum(g["density"] for g in got[side]) / n == pytest.approx(
            want["mean_density"], abs=2e-5)
    # both evaluated on the same held-out videos, numbers in range
    q = json.loads(Path(held["quality_json"]).read_text())
    assert len(q["examples"]) == 4 and held["seeds"] == sorted(e["seed"] for e in q["examples"])
    cal_seeds = {int(v.rsplit(":", 1)[1]) for v in r["calibration_videos"]}
    for e in q["examples"]:
        assert set(e["modes"]) == {"dense", "cfg:served", "cfg:one_shot"}
        assert held["held_out_seeds"][0] <= e["seed"] < held["held_out_seeds"][1]
        assert e["seed"] not in cal_seeds
        for m in ("cfg:served", "cfg:one_shot"):
            assert e["modes"][m]["sparse"] and 0 < e["modes"][m]["density"] < 1
            assert e["modes"][m]["kl"] >= 0
    for side in ("served", "one_shot"):
        ev = r["evaluation"][side]
        assert set(ev) == {"needle", "colour", "count", "order"}
        for task, rows in ev.items():
            a = rows["all"]
            assert a["n"] == 1 and 0 <= a["agreement"] <= 1 and a["kl"] >= 0
            assert 0 < a["density"] < 1
            one = next(e for e in q["examples"] if e["task"] == task)["modes"][f"cfg:{side}"]
            assert a["kl"] == pytest.approx(one["kl"]) and a["density"] == pytest.approx(
                one["density"])


def test_load_benchmark_selfcal_phase(tmp_path):
    """--selfcal-video alone: the dense baseline's stream on a server that does not
    calibrate, then a server with no measured config under a steady stream of distinct
    requests; it starts dense and calibrating, its answers turn sparse (the stream stops at
    the first), the first sparse answer's time and every request's TTFT against dense's are
    reported, the config is stored in the phase's own folder, the state's changes recorded.
    Then again with the baseline kept in a file, read from it, and a limit too short for the
    calibration and the gate's four requests: no answer comes sparse, and it says so.
    The server's fast-calibration flags are tests/serve/test_selfcal.py's (8-frame synthetic
    videos, two requests calibrated on, two gated on); a request every 8 s leaves idle gaps
    longer than its longest calibration step (up to 4 s measured on a loaded 2-core machine:
    a step a request stops runs again from its start, so shorter gaps can starve it)."""
    model = embedded_without_config(tmp_path / "model")
    video = ROOT / "samples" / "videos" / "needle_2.mp4"
    serve = ["--device", "cpu", "--min-sparse-len", "0", "--calibration-requests", "2",
             "--calibration-gate-requests", "2", "--calibration-max-kl", "0.05",
             "--calibration-synthetic", "2", "--calibration-synthetic-frames", "8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    kept = tmp_path / "baseline.json"

    def run(limit_s, out):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--model", str(model),
             "--selfcal-video", str(video), "--selfcal-rate", "0.125", "--selfcal-s", limit_s,
             "--selfcal-baseline", "3", "--selfcal-sparse", "1", "--selfcal-baseline-file",
             str(kept), "--max-frames", "12", "--max-new-tokens", "3",
             *(f"--serve-arg={x}" for x in serve), "--out", str(out)],
            env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((out / "load.json").read_text()), proc

    rep, proc = run("240", tmp_path)
    assert rep["modes"] == {} and "decode" not in rep
    sc = rep["selfcal"]
    base = sc["baseline"]
    assert [r["attention"] for r in base["requests"]] == ["dense"] * 3
    assert base["ttft_ms_first"] == base["requests"][0]["ttft_ms"]
    assert base["ttft_ms_median"] == pytest.approx(
        float(np.median([r["ttft_ms"] for r in base["requests"][1:]])), abs=1e-3)
    assert sc["at_start"]["state"] == "calibrating" and sc["at_start"]["serving"] == "dense"
    rows = sc["requests"]
    assert sc["errors"] == 0 and [r["i"] for r in rows] == list(range(len(rows)))
    assert {r["cache"] for r in rows} == {"miss"}           # distinct keys: full prefills
    assert rows[0]["attention"] == "dense"                  # dense until a config passed
    first = sc["first_sparse"]
    assert first is not None, sc["verdict"]
    assert rows[first["request"]]["attention"] == "sparse"
    assert sc["first_sparse_s"] == first["answered_s"] == min(
        r["answered_s"] for r in rows if r["attention"] == "sparse")
    assert first["within_limit"] and first["answered_s"] > sc["ready_s"]
    assert sc["answers"] == {"dense": sum(r["attention"] == "dense" for r in rows),
                             "sparse": sum(r["attention"] == "sparse" for r in rows)}
    # each request's TTFT over dense's: the cold first one over the baseline's first
    assert rows[0]["ttft_vs_dense"] == pytest.approx(
        rows[0]["ttft_ms"] / base["ttft_ms_first"], rel=1e-3)
    for r in rows[1:]:
        assert r["ttft_vs_dense"] == pytest.approx(r["ttft_ms"] / base["ttft_ms_median"],
                                                   rel=1e-3)
    ratios = [r["ttft_vs_dense"] for r in rows]
    t = sc["ttft_vs_dense"]
    assert t["n"] == len(rows) and t["max"] == max(ratios)
    assert t["over_margin"] == sum(x > 1.05 for x in ratios)
    # the state over time: calibrating (dense) first, serving (sparse) by the end
    states = [(e["state"], e["serving"]) for e in sc["timeline"]]
    assert states[0] == ("calibrating", "dense") and ("serving", "sparse") in states
    assert sc["status_after"]["state"] == "serving"
    assert sc["status_after"]["config"] == "self-calibration"
    # the serve flags took: two 8-frame synthetic videos and two requests calibrated on
    assert sc["status_after"]["measured"]["inputs"] == {"requests": 2, "synthetic": 2}
    assert len(sc["stored"]) == 1 and sc["stored"][0].endswith(".json")
    assert "first sparse answer" in proc.stdout and "selfcal: dense baseline" in proc.stdout
    assert "reused_from" not in base and json.loads(kept.read_text())["requests"] == \
        base["requests"]

    # calibration needs the fourth request (two calibrated on, two gated on) before any
    # answer can come sparse, and the fourth goes 24 s after the first
    again, proc = run("10", tmp_path / "again")
    sc = again["selfcal"]
    assert sc["baseline"]["reused_from"] == str(kept)
    assert sc["baseline"]["requests"] == base["requests"]
    assert sc["first_sparse"] is None and sc["first_sparse_s"] is None
    assert sc["verdict"].startswith("no sparse answer within 10 s"), sc["verdict"]
    assert sc["answers"]["sparse"] == 0 and len(sc["requests"]) <= 3
    assert all(r["sent_s"] <= 10 for r in sc["requests"])
    assert "no sparse answer within 10 s" in proc.stdout


def test_load_selfcal_summary_says_when_no_answer_came_sparse():
    """The phase's figures where every answer stayed dense (and one was lost): no first
    sparse time, a verdict that says so, the ratios and the count over the margin."""
    load = load_script("benchmarks/load.py", "load_bench")
    rows = [{"i": 0, "status": 200, "sent_s": 5.0, "answered_s": 6.0, "ttft_ms": 900.0,
             "attention": "dense", "ttft_vs_dense": 0.9},
            {"i": 1, "status": 200, "sent_s": 7.0, "answered_s": 9.5, "ttft_ms": 1100.0,
             "attention": "dense", "ttft_vs_dense": 1.1},
            {"i": 2, "status": 0, "sent_s": 9.0, "answered_s": None, "ttft_ms": None,
             "attention": None}]
    s = load.selfcal_summary(rows, 30)
    assert s["first_sparse_s"] is None and s["first_sparse"] is None
    assert s["verdict"].startswith("no sparse answer within 30 s (2 answered, all dense)")
    assert s["answers"] == {"dense": 2, "sparse": 0} and s["errors"] == 1
    assert s["ttft_vs_dense"]["max"] == 1.1 and s["ttft_vs_dense"]["over_margin"] == 1
    assert s["ttft_vs_dense"]["over_margin_requests"] == [1]
    assert s["sent_while_busy"] == 1           # request 2 went while request 1 ran
    assert "1.100x dense's (1.100x over the answers still dense), 1 of 2 requests over 1.05x" \
        in s["verdict"]


def test_load_modes_name_the_servers_they_start():
    """`--modes scheduler@0.1` is the default server with that decode share, beside the others."""
    load = load_script("benchmarks/load.py", "load_bench")
    a = SimpleNamespace(modes="scheduler,scheduler@0.1,serial", data_parallel=None)
    got = {name: args for name, args, _ in load.modes_of(a, ["--model", "m"])}
    assert got == {"scheduler": ["--model", "m"],
                   "scheduler@0.1": ["--model", "m", "--decode-share", "0.1"],
                   "serial": ["--model", "m", "--max-num-seqs", "1"]}


def test_step_gap_measures_answers_decoding_together_through_the_pipeline(tmp_path):
    """benchmarks/step_gap.py on the embedded model: two answers about one cached video decode
    through Pipeline.answer and the scheduler in shared batched steps, every token asked for,
    and the gap between two full steps is measured; no batch waited out its gather window.
    The window is 20 s, not the default 2 ms that a busy 2-core machine can outlast between
    two threads' turns: a batch still waiting it out is one that its last answer back did not
    wake."""
    bench = load_script("benchmarks/step_gap.py", "step_gap_bench")
    out = tmp_path / "gap.json"
    bench.main(["--answers", "2", "--tokens", "6", "--repeat", "1", "--gather-s", "20",
                "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["answers"] == 2 and row["generated"] == [6, 6]
    assert row["mean_batch"] > 1 and row["full_pairs"] >= 1
    assert row["gap_ms_median"] is not None and row["gather_timeouts"] == 0


def test_step_host_counts_a_batched_steps_launches(tmp_path):
    """benchmarks/step_host.py on the CPU reaches the GPU's attention launchers (their Triton
    launches counted, not run): 8 forks of one prefix attend in one flash-attention call over
    the prefix (with the copies of its query rows in and its output and log-sum-exp out) and 2
    Triton launches a layer (every reader's own rows, the merge), with one copy of their K/V
    rows and one of their table; the same forks attending one by one take 2 launches each."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_host.py"),
                           "--steps", "3", "--warm", "1", "--out", str(out)],
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    L = rows["fork8"]["layers"]
    assert rows["fork8"]["triton_launches"] == 2 * L
    assert rows["fork8_each"]["triton_launches"] == 2 * 8 * L
    assert rows["fork8"]["torch_ops"] <= 6 * L + 8         # none of them once per reader
    assert all(r["median_ms"] > 0 for r in rows.values())


def test_stream_ingest_benchmark_measures_the_live_video_targets(tmp_path):
    """benchmarks/stream_ingest.py --tiny on the CPU: the ingest part times a one-shot sparse
    prefill and the same video in sparse pieces (their ratio) and questions after shares of
    the pieces (TTFT); the realtime part drives the real server over HTTP with streams paced
    200x faster than real time, which the CPU cannot ingest: every stream is reported as
    falling behind, with its lags. The full-size plan is the issue's (1.05M tokens, minute
    pieces), and the keep-up rule tells a steady lag from a growing one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_ingest.py"),
                           "--tiny", "--pace", "200", "--search", "all", "--out", str(tmp_path),
                           "--profile-pieces", "3", "--piece-lines", "0.5"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "stream_ingest.json").read_text())
    assert rep["argv"][0] == "--tiny" and rep["env"]["commit"] and rep["device"] == "cpu"
    plan = rep["full_size_plan"]["ingest"]
    assert (plan["visual_tokens"], plan["pieces"], plan["piece_tokens"]) == (1_052_672, 35, 30_840)
    assert plan["kv_gb_bf16"] == 60.4
    assert rep["full_size_plan"]["realtime"][0]["kv_gb_bf16"] == 82.6     # 8 streams, 10 min

    assert rep["ingest"]["piece_lines"] == 0.5      # the pieces' share of the line budgets
    ing = rep["ingest"]["summary"]
    assert ing["complete"] and ing["pieces"] == 6 and ing["sparse_pieces"] == 6
    assert ing["same_visual_tokens"] and ing["one_shot_attention"] == "sparse"
    assert ing["pieces_s"] > 0 and ing["one_shot_s"] > 0 and ing["one_shot_vision_s"] > 0
    assert ing["ratio"] == pytest.approx(ing["pieces_s"] / ing["one_shot_s"], abs=2e-3)
    # Triton compilations per piece (a new specialisation is a piece's second): none run by
    # the interpreter
    assert ing["pieces_compiles"] == 0 and ing["one_shot_compile_s"] == 0
    # --profile-pieces 3: that piece's heaviest host ops, and the profiler's table
    profiled = [p for p in rep["ingest"]["stream"]["pieces"] if "profile" in p]
    assert [p["piece"] for p in profiled] == [3]
    prof = profiled[0]["profile"]
    assert prof["by_host_time"] and all(r["ms"] >= 0 for r in prof["by_host_time"])
    assert (tmp_path / "piece3.txt").read_text().strip()
    assert prof["syncs"] == 0 and prof["sync_sites"] == []     # no device: nothing waits
    # where a piece's prefill goes: the estimate over every key so far, and the kernels
    assert 0 < ing["pieces_index_s"] + ing["pieces_attention_s"] < ing["pieces_prefill_s"]
    assert ing["one_shot_index_s"] > 0 and ing["one_shot_attention_s"] > 0
    asks = rep["ingest"]["stream"]["asks"]
    assert [a["after_pieces"] for a in asks] == [2, 3, 6]          # 25 %, 50 %, 100 %
    assert all(a["ttft_ms"] > 0 and a["kv"] == "gpu" for a in asks)
    assert [a["stream_tokens"] for a in asks] == sorted({a["stream_tokens"] for a in asks})
    assert ing["ttft_max_s"] == max(t["ttft_s"] for t in ing["ttft_s"])

    rt = rep["realtime"]
    assert [s["streams"] for s in rt["steps"]] == [1, 2]
    for step in rt["steps"]:
        assert len(step["stream_records"]) == step["streams"] and step["kept_up"] is False
        for r in step["stream_records"]:
            lags = [p["lag_s"] for p in r["pieces"]]
            assert r["pieces_done"] == step["paced_pieces"] == len(lags) and r["kept_up"] is False
            assert r["head"] and r["errors"] == [] and r["state"] == "open"
            assert max(lags[len(lags) // 2:]) > step["max_lag_s"] and min(lags) > 0
            assert r["pieces"][-1]["server_lag_s"] is not None and r["status"]["tokens"] > 0
        assert step["question"]["status"] == 200 and step["question"]["ttft_ms"] > 0
    assert rt["summary"]["max_streams_kept_up"] is None
    assert rt["summary"]["counts_fell_behind"] == [1, 2]

    bench = load_script("benchmarks/stream_ingest.py", "stream_ingest_bench")
    assert bench.keeps_up([0.3, 0.5, 0.4, 0.6, 0.5, 0.4], limit_s=8.0) is True
    assert bench.keeps_up([0.3, 2.0, 4.0, 6.0, 8.0, 10.0], limit_s=8.0) is False
    assert bench.lag_slope([1.0, 2.0, 3.0, 4.0], piece_media_s=4.0) == 15.0   # 1 s per 4 s


def test_a_sync_is_attributed_to_the_innermost_frame_of_the_package(monkeypatch):
    """stream_ingest's profiled pieces count the host's waits for the device by site: the
    innermost mminfer frame (the launcher or planner that asked), not torch's own code."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import stream_ingest     # benchmarks/ is not a package: on the path for this test only

    def fr(path, line, name):
        return traceback.FrameSummary(path, line, name)

    stack = [fr("/x/benchmarks/stream_ingest.py", 10, "run"),
             fr("/repo/mminfer/engine/streams.py", 20, "_ingest"),
             fr("/repo/mminfer/kernels/plan.py", 410, "_rowline_programs"),
             fr("/venv/torch/_tensor.py", 99, "item")]
    assert stream_ingest.sync_site(stack, "f:1") == \
        "mminfer/kernels/plan.py:410 (_rowline_programs)"
    assert stream_ingest.sync_site(stack[:1], "f:1") == "f:1"


def test_a_profiled_piece_counts_the_sync_warnings_and_passes_the_others_on(monkeypatch):
    """The capture itself: inside a profiled piece, a warning of a synchronizing call (what
    torch's sync debug mode emits on a GPU) is counted by its site and not shown; any other
    warning still reaches the handler set before."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import stream_ingest     # benchmarks/ is not a package: on the path for this test only

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda msg, *a, **k: shown.append(str(msg)))
    args = SimpleNamespace(profile_pieces=[2])
    with stream_ingest._profiled(args, 1) as prof:
        assert prof is None                       # not a profiled piece
    with stream_ingest._profiled(args, 2) as prof:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
    assert sum(prof.sync_sites.values()) == 3 and len(prof.sync_sites) == 1
    assert next(iter(prof.sync_sites)).startswith(__file__)    # no package frame: the line
    assert shown == ["something else"]
    warnings.warn("called a synchronizing CUDA operation")      # after it: shown again
    assert shown == ["something else", "called a synchronizing CUDA operation"]
