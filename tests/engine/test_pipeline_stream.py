"""Pipeline.answer streams decode -> preprocess -> vision: the same answer and embeddings as
decoding the whole video first, honest timings, and oversized uploads decoded at the
model's size."""

import numpy as np
import pytest
import torch

from mminfer import video as videolib
from mminfer.engine.pipeline import Pipeline
from lab.toy.tiny import save_tiny_qwen2_5_vl
from test_pipeline import write_mp4      # one copy of the moving-square clip (tests/engine)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    ckpt = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("stream") / "tiny-qwen")
    return Pipeline(str(ckpt), attention="dense", device="cpu")


def test_streamed_answer_equals_decoding_first(pipe, tmp_path):
    """Same video, same question: the streamed pipeline (several tower chunks) answers with
    the tokens of the whole-video path (decode(), prepare, embed, generate), and its
    embeddings are that path's."""
    mp4 = write_mp4(tmp_path / "square.mp4", n=24)
    ad = pipe.adapter
    q = "where does the red square move?"
    decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=8.0)
    whole = ad.prepare(decoded, q)
    want = ad.generate(whole, max_new_tokens=6)
    ad.vision_chunk_patches = 2 * 6 * 4                 # two pairs of 6x4 patches a call
    try:
        res = pipe.answer(mp4, q, fps=8.0, max_new_tokens=6)
        with videolib.open_stream(str(mp4), sampling=ad.sampling, fps=8.0) as s:
            streamed = ad.embed(ad.prepare(s, q))
    finally:
        from mminfer.models.vision import CHUNK_PATCHES
        ad.vision_chunk_patches = CHUNK_PATCHES
    assert res.answer == want.text and res.tokens["generated"] == len(want.token_ids)
    with torch.inference_mode():
        ref = ad.embed(whole)
    assert torch.allclose(streamed, ref, atol=1e-5, rtol=1e-5)
    # timings: each stage's own time; ttft and total are wall times that hold them
    t = res.timings_ms
    assert t["decode"] > 0 and t["preprocess"] > 0 and t["vision"] > 0
    assert t["vision"] <= t["ttft"] <= t["total"]
    v = res.video
    assert 0 <= v["decode_wait_ms"] and 0 <= v["decode_hidden_ms"] <= t["decode"]
    assert res.video["frames"] == len(decoded.frames) == 24
    assert res.video["decoded"] == [64, 96]            # not oversized: full size, resized


def test_oversized_upload_is_decoded_at_the_model_size(pipe, tmp_path):
    """A 720p upload for a model that sees 84x140 frames: the decoder scales (the record
    says so), and the answer is computed from those frames."""
    import av
    path = tmp_path / "hd.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=4, options={"preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = 1280, 720, "yuv420p"
        for i in range(8):
            img = np.zeros((720, 1280, 3), np.uint8)
            img[200:500, 100 * i:100 * i + 300, 0] = 255
            for p in s.encode(av.VideoFrame.from_ndarray(img, "rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    res = pipe.answer(path, "where does the red square move?", fps=4.0, max_new_tokens=3)
    h, w = res.video["resized"]
    assert (res.video["width"], res.video["height"]) == (1280, 720)
    assert res.video["decoded"] == [h, w] and h * w * 4 < 1280 * 720
    assert res.tokens["generated"] >= 1


def test_longvila_streamed_answer_equals_decoding_first(tmp_path):
    """LongVILA through the streamed pipeline: the stream is narrowed to the model's frames
    before decoding, and the answer and embeddings are the whole-video path's."""
    from lab.toy.tiny_longvila import save_tiny_longvila
    ckpt = save_tiny_longvila(tmp_path / "tiny-longvila")
    pipe = Pipeline(str(ckpt), attention="dense", device="cpu")
    ad = pipe.adapter
    ad.vision_batch = 3                                   # several tower chunks
    mp4 = write_mp4(tmp_path / "square.mp4", n=24)
    q = "where does the red square move?"
    decoded = videolib.decode(str(mp4), sampling=ad.sampling, fps=8.0)
    whole = ad.prepare(decoded, q)
    want = ad.generate(whole, max_new_tokens=4)
    res = pipe.answer(mp4, q, fps=8.0, max_new_tokens=4)
    assert res.answer == want.text and res.video["model_frames"] == whole.n_frames == 8
    assert res.video["frames"] == 8 < len(decoded.frames)          # only those were decoded
    with videolib.open_stream(str(mp4), sampling=ad.sampling, fps=8.0) as s:
        streamed = ad.embed(ad.prepare(s, q))
    with torch.inference_mode():
        assert torch.allclose(streamed, ad.embed(whole), atol=1e-5, rtol=1e-5)
