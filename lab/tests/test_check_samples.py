"""lab/train/check_samples.py: the gate a candidate embedded model passes before it ships."""

import json
import tarfile

import pytest

from lab.train import check_samples


@pytest.fixture(scope="module")
def C():
    return check_samples


def test_a_tarball_of_the_shipped_model_passes_and_a_wrong_answer_fails(C, tmp_path,
                                                                         monkeypatch, capsys):
    from mminfer.models.embedded import DEFAULT_MODEL_DIR
    tar = tmp_path / "model.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        t.add(DEFAULT_MODEL_DIR, arcname="mminfer-embedded")
    assert C.main([str(tar)]) == 0
    n = len(json.loads((C.SAMPLES / "answers.json").read_text()))
    assert f"{n} / {n} samples right" in capsys.readouterr().out
    # the same model against an answer sheet with one answer changed
    samples = tmp_path / "samples"
    samples.mkdir()
    answers = json.loads((C.SAMPLES / "answers.json").read_text())
    for name in answers:
        (samples / name).symlink_to(C.SAMPLES / name)
    first = next(iter(answers))
    answers[first]["answer"] = "no such answer"
    (samples / "answers.json").write_text(json.dumps(answers))
    monkeypatch.setattr(C, "SAMPLES", samples)
    assert C.main([str(DEFAULT_MODEL_DIR)]) == 1
    assert f"WRONG {first}" in capsys.readouterr().out


def test_a_tarball_without_a_checkpoint_is_refused(C, tmp_path):
    tar = tmp_path / "empty.tar.gz"
    (tmp_path / "x.txt").write_text("x")
    with tarfile.open(tar, "w:gz") as t:
        t.add(tmp_path / "x.txt", arcname="x.txt")
    with pytest.raises(SystemExit, match="no <folder>/config.json"):
        C.main([str(tar)])
