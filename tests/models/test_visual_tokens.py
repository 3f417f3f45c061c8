"""An adapter's visual token count before decoding (``Adapter.visual_tokens``: what the
server's budget refuses a request by, from the header alone) is what its ``prepare`` makes of
the decoded frames, for every adapter: odd frame counts padded, big frames shrunk, small ones
grown, more frames than the model takes picked down, a request's pixel options."""

import pytest

from lab.toy.tiny import save_tiny_qwen2_5_vl
from lab.toy.tiny_longvila import save_tiny_longvila
from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from mminfer.models.base import PrepareOptions

# (frames, width, height): the tiny Qwen's pixel range is 4..16 patches of 28x28 per frame
CASES = ((8, 64, 48), (7, 320, 180), (12, 900, 500), (30, 28, 28))
LONGVILA_FRAMES = 8


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    ckpt = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("q") / "tiny-qwen")
    return Pipeline(str(ckpt), device="cpu").adapter


@pytest.fixture(scope="module")
def longvila(tmp_path_factory):
    ckpt = save_tiny_longvila(tmp_path_factory.mktemp("lv") / "tiny-longvila",
                              num_video_frames=LONGVILA_FRAMES)
    return Pipeline(str(ckpt), device="cpu").adapter


@pytest.mark.parametrize("name", ["qwen", "longvila"])
def test_visual_tokens_are_what_prepare_makes(name, request, make_video):
    ad = request.getfixturevalue(name)
    seen = set()
    for n, w, h in CASES:
        path = make_video(f"v{n}_{w}.mp4", n_frames=n, fps=10.0, width=w, height=h)
        # past the model's own limit (LongVILA's): prepare picks down where it must
        d = videolib.decode(str(path), sampling=ad.sampling, fps=10.0, max_frames=64)
        # and one frame fewer (an odd count: Qwen pads it to a whole temporal pair)
        for v in (d, videolib.DecodedVideo.from_frames(d.frames[:-1], fps=d.sampled_fps)):
            prep = ad.prepare(v, "what?")
            assert ad.visual_tokens(len(v.frames), h, w) == prep.visual_tokens, (n, w, h)
            seen.add(prep.visual_tokens)
    assert len(seen) > 1                     # the cases differ: a constant would not pass


def test_qwen_visual_tokens_follow_the_request_pixel_options(qwen, make_video):
    path = make_video("v.mp4", n_frames=8, fps=10.0, width=320, height=180)
    d = videolib.decode(str(path), fps=10.0, max_frames=64)
    small = PrepareOptions(max_pixels=28 * 28 * 4)
    got = qwen.visual_tokens(8, 180, 320, small)
    assert got == qwen.prepare(d, "what?", small).visual_tokens
    assert got < qwen.visual_tokens(8, 180, 320)


def test_longvila_counts_a_newline_after_each_frame_it_takes(longvila):
    per_frame = longvila.tokens_per_frame + 1
    assert longvila.visual_tokens(3, 48, 64) == 3 * per_frame
    assert longvila.visual_tokens(50, 48, 64) == LONGVILA_FRAMES * per_frame
