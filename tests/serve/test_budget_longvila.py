"""The server's pre-queue estimate for a LongVILA model (frames it will decode, visual tokens)
is what a tiny LongVILA pipeline really makes of the same video, across frame counts: fewer
than its minimum, a normal one, one capped by max_frames, and more than the model takes."""

import pytest

from mminfer.engine.pipeline import Pipeline
from mminfer.serve.budget import Budget
from mminfer.serve.settings import Settings
from lab.toy.tiny_longvila import save_tiny_longvila

MODEL_FRAMES = 8


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    ck = save_tiny_longvila(tmp_path_factory.mktemp("lv") / "tiny-longvila",
                            num_video_frames=MODEL_FRAMES)
    return Pipeline(str(ck), device="cpu")


@pytest.mark.parametrize("n_frames, fps, max_frames, want_frames", [
    (5, 2.0, 64, 4),               # 0.5 s: VILA's minimum of 4 frames
    (30, 2.0, 64, 6),              # 3 s at 2 fps
    (60, 2.0, 5, 5),               # capped by the request's max_frames
    (60, 8.0, 64, MODEL_FRAMES),   # 48 asked for, the model takes 8
])
def test_estimate_is_what_the_pipeline_makes(pipe, make_video, n_frames, fps, max_frames,
                                             want_frames):
    video = make_video(f"v{n_frames}.mp4", n_frames=n_frames, fps=10.0, width=80, height=60)
    question = "what number appears?"
    params = {"fps": fps, "max_frames": max_frames, "max_new_tokens": 2}
    est = Budget(Settings(model="x")).check_video(str(video), question, params, pipe.adapter)
    r = pipe.answer(str(video), question, attention="dense", **params)
    assert r.video["frames"] == r.video["model_frames"] == want_frames
    assert est["frames"] == want_frames            # what the decode budget is counted on
    assert est["visual_tokens"] == r.tokens["visual"] == want_frames * (
        pipe.adapter.tokens_per_frame + 1)
    # the context check's lower bound: the question's tokens are inside the prompt's text
    assert est["question_tokens"] <= r.tokens["text"]
    assert est["visual_tokens"] + est["question_tokens"] <= r.tokens["total"]
