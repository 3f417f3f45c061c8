"""lab/experiments/needle_frames.py: the needle frames of a quality run, as the model read them."""

import json

import numpy as np
import pytest

from lab.experiments import needle_frames


@pytest.fixture(scope="module")
def NF():
    return needle_frames


def _record(seed, depth, correct, look):
    return {"task": "needle", "seed": seed, "n_frames": 8, "depth": depth, "tokens": 64,
            "look": look, "answer": "?",
            "modes": {"dense": {"answer": "?" if correct else "x", "correct": correct}}}


def test_wrong_first_at_the_models_size_with_the_number_drawn(NF, tmp_path, capsys):
    from PIL import Image
    from lab.toy import render_eval
    q = {"renderer": "eval", "examples": [
        _record(500000, 0.0, True, "strokes"), _record(500003, 0.75, False, "dots"),
        {"task": "count", "seed": 1, "modes": {"dense": {"correct": False}}}]}
    src = tmp_path / "q.json"
    src.write_text(json.dumps(q))
    out = tmp_path / "sheet.png"
    assert NF.main([str(src), "--out", str(out), "--columns", "2", "--zoom", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["0", "WRONG"] and "seed 500003" in lines[0]
    assert lines[1].split()[:2] == ["1", "ok"] and "seed 500000" in lines[1]
    im = np.asarray(Image.open(out))
    assert im.shape == (84 * 3, 2 * 112 * 3, 3)
    # the first tile is the wrong video's last needle frame, not another of its frames
    ex = render_eval.needle(500003, 8, depth=0.75)
    tile = NF.model_frame(_record(500003, 0.75, False, "dots"), (84, 112))
    assert np.array_equal(im[:84 * 3:3, :112 * 3:3], tile)
    plain = [i for i in range(8) if i not in ex.meta["needle_frames"]][0]
    assert np.array_equal(tile, _resize(ex.frames[ex.meta["needle_frames"][-1]]))
    assert not np.array_equal(tile, _resize(ex.frames[plain]))
    # one look only
    assert NF.main([str(src), "--out", str(out), "--look", "strokes"]) == 0
    assert "1 frames" in capsys.readouterr().out


def _resize(frame):
    import torch
    from mminfer.models.qwen2_5_vl import resize_frames
    x = resize_frames(torch.from_numpy(np.ascontiguousarray(frame[None])), 84, 112)
    return x[0].permute(1, 2, 0).to(torch.uint8).numpy()


def test_a_synth_run_or_no_needles_is_a_clear_error(NF, tmp_path):
    src = tmp_path / "q.json"
    src.write_text(json.dumps({"renderer": "synth", "examples": []}))
    with pytest.raises(SystemExit, match="needs a --renderer eval run"):
        NF.main([str(src), "--out", str(tmp_path / "s.png")])
    src.write_text(json.dumps({"renderer": "eval", "examples": [_record(1, 0.0, True, "dots")]}))
    with pytest.raises(SystemExit, match="no needle records of look 'strokes'"):
        NF.main([str(src), "--out", str(tmp_path / "s.png"), "--look", "strokes"])
