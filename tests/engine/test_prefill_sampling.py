"""LongVILA's frames are sampled once on the way through the pipeline, by VILA's rule
(the rule itself: tests/video/test_sampling.py)."""

from mminfer.video import vila_indices


def test_longvila_frames_are_sampled_once(tmp_path, make_video):
    """The pipeline decodes exactly the model's frame count by VILA's rule; the adapter gets
    those frames and samples nothing again (before: 2 fps first, then 12 -> 8 on top)."""
    from mminfer.engine.pipeline import Pipeline
    from lab.toy.tiny_longvila import save_tiny_longvila
    ckpt = save_tiny_longvila(tmp_path / "tiny-longvila", num_video_frames=8)
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu")
    video = make_video(n_frames=60, fps=10.0)                 # 6 s: fps 2 would give 12 frames
    seen = []
    real_prepare = pipe.adapter.prepare

    def prepare(decoded, question, options=None):
        # the pipeline streams frames (decoded while the tower works): the stream's source
        # indices are what it will decode (stream == decode() is pinned in test_video.py)
        seen.append([int(i) for i in decoded.indices])
        return real_prepare(decoded, question, options)

    pipe.adapter.prepare = prepare
    res = pipe.answer(video, "what?", fps=2.0, max_new_tokens=1)
    assert seen == [vila_indices(0, 59, 8).tolist()]          # [0, 8, 17, 25, 34, 42, 51, 59]
    assert res.video["frames"] == res.video["model_frames"] == 8
    # a short clip under the model's count: the user's fps decides, still one sampling
    seen.clear()
    res = pipe.answer(make_video("short.mp4", n_frames=30, fps=10.0), "what?", fps=2.0,
                      max_new_tokens=1)
    assert seen == [vila_indices(0, 29, 6).tolist()] and res.video["model_frames"] == 6
