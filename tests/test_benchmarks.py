"""benchmarks/e2e.py on the CPU: the --tiny run writes every stage of both modes and the
baseline (measured and extrapolated), and the long-context checkpoint variant it builds for
the 276K case takes effect in the adapter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script

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
    rep, _, _ = tiny_run
    case = rep["cases"]["tiny-longvila"]
    R, probe = case["requests"], case["probe"]
    assert R["dense"]["measured"] is False and R["transformers"]["measured"] is False
    assert "first_request" not in R                             # warm-up "none"
    assert probe["tokens"] == R["sparse"]["tokens"]["total"]
    # both figures are rounded to 3 decimals (ms): equal to their rounding
    assert probe["all_layers_ms"] == pytest.approx(probe["layer_ms"] * probe["layers"], rel=1e-3,
                                                   abs=probe["layers"] * 5e-4 + 5e-4)
    for e in (R["dense"], R["transformers"]):
        t = e["timings_ms"]
        assert t["attention"] == pytest.approx(probe["all_layers_ms"], abs=1e-3)
        assert t["llm_other"] == pytest.approx(R["sparse"]["timings_ms"]["llm_other"], abs=1e-3)
        parts = sum(t[k] for k in ("decode", "preprocess", "vision", "attention", "llm_other"))
        assert t["ttft"] == pytest.approx(parts, abs=0.01)
    assert R["dense"]["timings_ms"]["vision"] == R["sparse"]["timings_ms"]["vision"]
    rows = case["summary"]["rows"]
    assert rows["dense"]["measured"] is False and rows["sparse"]["measured"] is True
    assert case["summary"]["ratios"]["dense_over_sparse"] == pytest.approx(
        rows["dense"]["ttft_ms"] / rows["sparse"]["ttft_ms"], rel=1e-2)


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
