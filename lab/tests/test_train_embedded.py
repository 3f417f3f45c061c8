"""Training the embedded default model: its tokenizer and config, composed videos, a micro
training run of ``lab/train/train_embedded.py`` and the device script's CPU smoke mode. The
shipped model's answers are checked in ``tests/models/test_embedded.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mminfer.offline import synthetic as synth
from mminfer.models import embedded as M
from lab.toy import embedded as E
from lab.toy.tiny import QWEN_SPECIALS
from lab.train import train_embedded

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "samples" / "videos"
BUILT = (M.DEFAULT_MODEL_DIR / "config.json").is_file()
NOT_BUILT = (f"the embedded model is not built yet ({M.DEFAULT_MODEL_DIR}): "
             f"`{M.BUILD_COMMAND}` on a GPU")
TINY = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 128,
        "vision_hidden": 32, "vision_depth": 1, "vision_heads": 1, "vision_intermediate": 64}


def _train_module():
    return train_embedded


# --------------------------------------------------------------------------- tokenizer
def test_tokenizer_specials_and_task_vocabulary():
    tok = E.build_tokenizer()
    for i, t in enumerate(QWEN_SPECIALS):           # Qwen's specials in their real order
        assert tok.convert_tokens_to_ids(t) == i
    assert tok.convert_tokens_to_ids("[UNK]") == 14 == tok.unk_token_id
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for w in synth.ANSWER_VOCAB:                    # every question / answer word: one token
        ids = tok(w, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] > 14, w
        assert tok.decode(ids) == w
    for q in synth.QUESTIONS.values():
        ids = tok(q, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == q.lower()
    ans = E.answer_ids(tok)
    assert all(len(v) == len(synth.ANSWERS[t]) for t, v in ans.items())
    assert len(set(ans["needle"].values())) == 90

    cfg = E.build_config(tok)
    roles = {"video_token_id": "<|video_pad|>", "image_token_id": "<|image_pad|>",
             "vision_start_token_id": "<|vision_start|>",
             "vision_end_token_id": "<|vision_end|>"}
    for attr, t in roles.items():
        assert getattr(cfg, attr) == tok.convert_tokens_to_ids(t)
    assert cfg.text_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.vocab_size >= len(tok)

    # the adapter's prompt layout, words and specials in their places
    head, tail, pos = E.layout(tok, cfg, synth.QUESTIONS["needle"], 3)
    words = tok.convert_ids_to_tokens(head + tail)
    assert words[:3] == ["<|im_start|>", "system", "you"] and words[len(head) - 1] == \
        "<|vision_start|>"
    assert words[len(head)] == "<|vision_end|>" and words[-2:] == ["<|im_start|>", "assistant"]
    assert pos.shape == (3, len(head) + 3 * E.TOKENS_PER_PAIR + len(tail) + 1)


def test_batched_vision_matches_the_model():
    import torch
    model, _ = E.new_model(TINY)
    bv = E.BatchedVision(model)
    assert bv.check(n_pairs=3) < 1e-5
    # the training step runs it under autograd (the modules' own norms and rotary): same
    # features, and gradients reach the tower's weights
    pix = torch.randn(2 * E.PATCHES_PER_PAIR, 1176)
    with torch.no_grad():
        want = bv(pix, 2)
    got = bv(pix, 2)
    assert got.requires_grad and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    assert model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- training
def test_composed_videos_match_their_labels():
    """Training videos composed from the frame bank: answers, where the needles / flashes /
    colour clips sit, and the auxiliary labels all agree with the bank's records."""
    import numpy as np
    import torch

    train = _train_module()
    bank = train.Bank(torch.device("cpu"), scenes=4, needles_per_scene=3, clip_frames=4,
                      colour_clips=8, red=4)
    bank.add(train.job_scenes(0, 0, 4, 4, 3, 0.5))
    bank.add(train.job_colour(0, 0, 8, 4, 0.5))
    bank.add(train.job_red(0, 0, 4, 0.5))
    tok = E.build_tokenizer()
    inv = {i: a for t in E.answer_ids(tok).values() for a, i in t.items()}
    comp = train.Composer(bank, E.answer_ids(tok))
    rng = np.random.default_rng(0)
    nb = bank.needle_base
    for Tp in (1, 2, 5, 9):
        idx, ans, aux, atok = comp.make("needle", rng, 16, Tp)
        for b in range(16):
            nf = np.flatnonzero((idx[b] >= nb) & (idx[b] < bank.colour_base))
            assert 1 <= len(nf) <= 2 and np.all(np.diff(nf) == 1)
            run = (idx[b, nf[0]] - nb) // 2
            assert inv[ans[b]] == str(bank.num.reshape(-1)[run])
            pairs = sorted(set(nf // 2))
            assert sorted(np.flatnonzero(aux[b])) == pairs
            assert all((atok[b, p] == bank.tok.reshape(-1, 16)[run]).all() for p in pairs)
            assert not atok[b, [p for p in range(Tp) if p not in pairs]].any()
        if Tp >= 2:
            idx, ans, aux, _ = comp.make("order", rng, 16, Tp)
            for b in range(16):
                runs = (idx[b][(idx[b] >= nb) & (idx[b] < bank.colour_base)] - nb) // 2
                first = bank.num.reshape(-1)[runs[0]]
                assert inv[ans[b]] == str(first)
                assert len(set(bank.num.reshape(-1)[runs])) == 2      # two different numbers
        idx, ans, aux, _ = comp.make("count", rng, 16, Tp)
        for b in range(16):
            red = np.flatnonzero(idx[b] >= bank.red_base)
            assert inv[ans[b]] == str(len(red)) and np.all(np.diff(red) > 1)
            assert sorted(np.flatnonzero(aux[b])) == sorted(set(red // 2))
        idx, ans, aux, _ = comp.make("colour", rng, 16, Tp)
        for b in range(16):
            clips = (idx[b] - bank.colour_base) // bank.F
            assert ((idx[b] >= bank.colour_base) & (idx[b] < bank.red_base)).all()
            assert {list(synth.COLOURS)[c] for c in
                    bank.colour_label[clips]} == {inv[ans[b]]}


def test_varied_sizes_compose_videos_of_one_size_with_their_token_labels():
    """With randomised renderings the bank holds clips of several model-side frame sizes: a
    composed video takes every frame (scene, needle, flash, colour clip) from one size, its
    per-token labels have that size's token count, and they mark the number's cells."""
    import numpy as np
    import torch

    train = _train_module()
    bank = train.Bank(torch.device("cpu"), scenes=24, needles_per_scene=2, clip_frames=4,
                      colour_clips=24, red=24)
    bank.add(train.job_scenes(1, 0, 24, 4, 2, 0.5, 1.0))
    bank.add(train.job_colour(1, 0, 24, 4, 0.5, 1.0))
    bank.add(train.job_red(1, 0, 24, 0.5, 1.0))
    assert len(set(bank.scene_cls)) >= 3            # several sizes in one job
    tok = E.build_tokenizer()
    comp = train.Composer(bank, E.answer_ids(tok))
    rng = np.random.default_rng(1)
    seen = set()
    for task in ("needle", "order", "count", "colour"):
        for cls in bank.sizes_for(task):
            seen.add(cls)
            idx, ans, aux, atok = comp.make(task, rng, 6, 5, cls)
            assert atok.shape == (6, 5, train.size_tokens(cls))
            sc = idx < bank.needle_base
            assert (bank.scene_cls[idx[sc] // bank.F] == cls).all()
            nd = (idx >= bank.needle_base) & (idx < bank.colour_base)
            assert (bank.scene_cls[(idx[nd] - bank.needle_base) // (2 * bank.K)] == cls).all()
            co = (idx >= bank.colour_base) & (idx < bank.red_base)
            assert (bank.colour_cls[(idx[co] - bank.colour_base) // bank.F] == cls).all()
            assert (bank.red_cls[idx[idx >= bank.red_base] - bank.red_base] == cls).all()
            if task == "needle":
                assert atok[aux > 0].any(axis=-1).all()      # some cell reads a digit
            v = bank.view(cls)[torch.from_numpy(idx).view(-1)]
            assert tuple(v.shape[1:3]) == train.SIZES[cls]
    assert len(seen) >= 2
    # token labels on a 84 x 112 frame: 3 x 4 cells, tens left of units
    lab = train.token_labels(np.array([[30.0, 2.0, 86.0, 54.0]]), np.array([47]), (84, 112))
    assert lab.shape == (1, 12)
    assert list(lab[0, :4]) == [0, 1 + 4, 11 + 7, 0] and not lab[0, 8:].any()


def test_micro_training_lowers_the_loss_and_saves_a_loadable_checkpoint(tmp_path):
    from mminfer.engine.pipeline import Pipeline

    train = _train_module()
    out = tmp_path / "model"
    res = train.main([
        "--minutes", "3", "--steps", "12", "--out", str(out), "--workers", "0",
        "--device", "cpu", "--shape", json.dumps(TINY), "--max-tokens", "32",
        "--start-pairs", "2", "--batch-tokens", "96", "--max-batch", "6", "--lr", "3e-3",
        "--warmup", "1", "--scenes", "6", "--colour-clips", "6", "--red", "6", "--chunk", "3",
        "--clip-frames", "4", "--needles-per-scene", "2", "--eval-n", "1", "--log-every", "0",
        "--ckpt-every", "1000", "--eval-every", "1000", "--reserve", "1",
        "--archive", str(tmp_path / "model.tar.gz")])
    losses = [h["loss"] for h in res["history"] if "loss" in h]
    assert res["step"] == 12 and len(losses) >= 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    info = json.loads((out / "embedded.json").read_text())
    assert info["final"] and info["steps"] == 12
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["model_type"] == "qwen2_5_vl"
    assert (tmp_path / "model.tar.gz").stat().st_size > 0
    assert (tmp_path / "model.state.pt").is_file()      # for --resume

    pipe = Pipeline(str(out), attention="dense", device="cpu")
    r = pipe.answer(SAMPLES / "needle_0.mp4", synth.QUESTIONS["needle"], max_new_tokens=3)
    assert isinstance(r.answer, str)
    assert r.video["resized"] == [E.FRAME_SIDE, E.FRAME_SIDE]
    assert r.tokens["visual"] == 10 * E.TOKENS_PER_PAIR     # 20 frames = 10 pairs


def test_curriculum_reaches_the_longest_video_on_schedule():
    nxt = _train_module().next_longest
    # the schedule alone: m0 at the start of growth, the cap at its end, doublings between
    assert nxt(8, 8, 2048, 0.0) == 8
    assert nxt(8, 8, 2048, 0.39) == 8
    assert nxt(8, 8, 2048, 0.5) == int(8 * 2 ** (8 * 0.1 / 0.45))     # 27: not only doublings
    # above half the cap, the last step is less than a doubling and still happens
    assert nxt(1143, 8, 2048, 0.84) == 1143
    assert nxt(1143, 8, 2048, 0.85) == 2048
    assert nxt(1143, 8, 2048, 0.99) == 2048
    assert nxt(2048, 8, 2048, 0.99) == 2048
    # passing the tasks doubles early; the cap holds
    assert nxt(8, 8, 2048, 0.0, passed=True) == 16
    assert nxt(1500, 8, 2048, 0.0, passed=True) == 2048
    # --grow moves the window: a long-length fine-tune is at the cap early
    assert nxt(512, 512, 2048, 0.3, grow=(0.05, 0.3)) == 2048
    assert nxt(512, 512, 2048, 0.04, grow=(0.05, 0.3)) == 512


@pytest.mark.slow
def test_device_script_train_stage_smoke(tmp_path):
    """lab/train/run_embedded_h200.sh train in its CPU smoke mode (TINY=1): fine-tunes the
    shipped model on the randomised bank and packs a checkpoint the pipeline loads."""
    import subprocess
    import sys
    import tarfile

    if not BUILT:
        pytest.skip(NOT_BUILT)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "WORK": str(work), "TINY": "1",
           "PYTHON": sys.executable, "MINUTES": "0.6"}
    r = subprocess.run(["bash", str(REPO / "lab" / "train" / "run_embedded_h200.sh"), "train"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "weights initialised from mminfer/models/mminfer-embedded" in r.stdout
    with tarfile.open(out / "model.tar.gz") as tar:
        names = tar.getnames()
        assert "mminfer-embedded/model.safetensors" in names
        tar.extractall(tmp_path / "x")
    info = json.loads((out / "embedded.json").read_text())
    assert info["final"] and "--variety" in info["command"]
    from mminfer.engine.pipeline import Pipeline
    pipe = Pipeline(str(tmp_path / "x" / "mminfer-embedded"), attention="dense", device="cpu")
    res = pipe.answer(SAMPLES / "needle_0.mp4", synth.QUESTIONS["needle"], max_new_tokens=2)
    assert isinstance(res.answer, str) and res.tokens["visual"] == 160
