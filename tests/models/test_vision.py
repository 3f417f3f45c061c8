"""The batched Qwen2.5-VL vision tower against transformers' own (fp32, CPU): several
windows per frame with ragged edges, several full-attention blocks, odd numbers of pairs,
one pair per chunk and several; the window grouping and the rotary table pinned; the
rearrangements (patchify, LongVILA's 2x2 merge) pinned against view/permute formulas."""

import numpy as np
import pytest
import torch

from mminfer.models.qwen2_5_vl import Qwen2_5_VLAdapter, patchify
from mminfer.models.vision import QwenVisionTower, window_units
from lab.toy.tiny import save_tiny_qwen2_5_vl

# window_size 56 px = 2x2 merged units = 4x4 patches; five blocks, two of them full
TOWER = dict(window_size=56, vision_depth=5, fullatt_block_indexes=[1, 3],
             max_pixels=140 * 196)   # frames up to 10 x 14 patches


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vision") / "tiny-qwen", **TOWER)
    ad = Qwen2_5_VLAdapter.from_pretrained(path, device="cpu")
    # the default init (std 0.02) leaves attention nearly uniform; sharper weights make a
    # token in the wrong window change the output
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ad.model.model.visual.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
    return ad


def _reference(ad, pixels, t, h, w):
    grid = torch.tensor([[t, h, w]])
    with torch.no_grad():
        out = ad.model.model.get_video_features(pixels, grid)
    out = getattr(out, "pooler_output", out)
    return torch.cat(list(out), 0) if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("t,h,w", [
    (3, 10, 14),   # 5x7 units: 2x3 whole windows, a right column, a bottom row, a corner
    (5, 12, 6),    # 6x3 units: a right column only
    (1, 8, 8),     # 4x4 units: windows divide the grid (one group, no copies)
    (3, 2, 2),     # one unit: smaller than a window
])
def test_tower_equals_transformers(adapter, t, h, w):
    tower = adapter.tower
    assert tower.window == 2 and tower.full == {1, 3}
    g = torch.Generator().manual_seed(t * 100 + h * 10 + w)
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14, generator=g)
    ref = _reference(adapter, pixels, t, h, w)
    with torch.no_grad():
        got = tower(pixels, t, h, w)
    # with autograd on (training): the modules' own norm/rotary arithmetic, same result
    got_grad = tower(pixels.clone().requires_grad_(), t, h, w).detach()
    err, err_grad = (float((x - ref).abs().max()) for x in (got, got_grad))
    scale = float(ref.abs().max())
    print(f"grid {t}x{h}x{w}: max abs diff {err:.2e}, autograd path {err_grad:.2e} "
          f"(max |feature| {scale:.2f})")
    assert got.shape == ref.shape and err < 5e-6 * max(1.0, scale)
    assert err_grad < 5e-6 * max(1.0, scale)


def test_window_groups_are_transformers_windows():
    """Our windows (as sets of merged units) are exactly the ones transformers cuts, for
    grids that divide, that are ragged on either side, and that are under one window."""
    vu = pytest.importorskip("transformers.vision_utils")
    for hm, wm, ws in [(5, 7, 2), (6, 3, 2), (4, 4, 2), (1, 1, 2), (20, 36, 4), (9, 13, 4),
                       (3, 5, 8), (2, 8, 4), (23, 12, 4)]:
        m, patch = 2, 14
        grid = torch.tensor([[1, hm * m, wm * m]])
        index, cu = vu.get_vision_window_index(grid, spatial_merge_size=m,
                                               window_size=ws * m * patch, patch_size=patch)
        cu = (cu // (m * m)).tolist()
        theirs = sorted(tuple(sorted(index[a:b].tolist())) for a, b in zip(cu, cu[1:]))
        order, groups = window_units(hm, wm, ws)
        ours = []
        for start, n, k in groups:
            for j in range(n):
                ours.append(tuple(sorted(order[start + j * k:start + (j + 1) * k].tolist())))
        assert sorted(ours) == theirs, (hm, wm, ws)
        assert sorted(order.tolist()) == list(range(hm * wm))
        # window shapes: (whole rows, a cut row) x (whole columns, a cut column), those present
        n_h, n_w = (hm >= ws) + (hm % ws > 0), (wm >= ws) + (wm % ws > 0)
        assert len(groups) == n_h * n_w <= 4


def test_rotary_table_is_the_models(adapter):
    """The cos/sin the tower uses are the ones transformers hands its blocks (read from the
    model with a hook), on a frame that is one window (both orders are then the same)."""
    vis = adapter.model.model.visual
    seen = {}

    def hook(mod, args, kwargs):
        seen.setdefault("pe", kwargs.get("position_embeddings"))

    handle = vis.blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        _reference(adapter, torch.zeros(4 * 4, 1176), 1, 4, 4)
    finally:
        handle.remove()
    if seen.get("pe") is None:
        pytest.skip("this transformers computes the rotary inside its blocks")
    cos, sin = seen["pe"]
    lay = adapter.tower.layout(4, 4, "cpu")
    assert torch.equal(lay.perm, torch.arange(16))
    assert torch.allclose(lay.cos[:, 0], cos.float(), atol=1e-6)
    assert torch.allclose(lay.sin[:, 0], sin.float(), atol=1e-6)


@pytest.mark.parametrize("chunk_patches", [1, 140 * 2, 1 << 16])
def test_adapter_embed_streams_chunks_and_equals_transformers(adapter, chunk_patches):
    """The product path (prepare -> embed) with one pair per chunk, two, or the whole video
    at once, on an odd number of frames (the last one repeated): the video span of the
    embeddings is transformers' get_video_features of the processor's pixels."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (9, 150, 200, 3), dtype=np.uint8)    # -> 5 pairs of 10x14
    video = type("V", (), {"frames": frames, "sampled_fps": 2.0})()
    p = adapter.prepare(video, "what is there?")
    t, h, w = p.tensors["video_grid_thw"][0].tolist()
    assert (t, h, w) == (5, 10, 14) and p.n_frames == 10
    adapter.vision_chunk_patches = chunk_patches
    try:
        embeds = adapter.embed(p)[0]
    finally:
        from mminfer.models.vision import CHUNK_PATCHES
        adapter.vision_chunk_patches = CHUNK_PATCHES
    ref = _reference(adapter, adapter.pixel_values(p), t, h, w)
    span = p.index.spans_of("video")[0]
    got = embeds[span.start:span.end]
    err = float((got - ref).abs().max())
    print(f"chunk {chunk_patches} patches: max abs diff {err:.2e} (max |feature| "
          f"{float(ref.abs().max()):.2f})")
    assert err < 5e-6 * max(1.0, float(ref.abs().max()))
    text = adapter.text_model.get_input_embeddings()(p.input_ids)[0]
    assert torch.equal(embeds[:span.start], text[:span.start])
    assert torch.equal(embeds[span.end:], text[span.end:])


def test_pairs_per_chunk_bounds_the_tower_call(adapter):
    calls = []
    tower = adapter.tower
    orig = QwenVisionTower.__call__

    def spy(self, pixels, n, h, w, **kw):
        calls.append((n, kw.get("pad_to")))
        return orig(self, pixels, n, h, w, **kw)

    frames = np.zeros((14, 56, 56, 3), np.uint8)                       # 7 pairs of 4x4
    p = adapter.prepare(type("V", (), {"frames": frames, "sampled_fps": 2.0})(), "what?")
    adapter.vision_chunk_patches = 3 * 16
    QwenVisionTower.__call__ = spy
    try:
        adapter.embed(p)
    finally:
        QwenVisionTower.__call__ = orig
        from mminfer.models.vision import CHUNK_PATCHES
        adapter.vision_chunk_patches = CHUNK_PATCHES
    # every call is told the chunk's size: what a compiled tower pads the last one to
    assert calls == [(3, 3), (3, 3), (1, 3)] and tower.pairs_per_chunk(4, 4, 3 * 16) == 3


# ---------------------------------------------------------------------- layouts
def _patchify_by_view(x, patch=14, temporal=2, merge=2):
    """The implementation before einops (view/permute), kept as the layout's reference."""
    T, C, H, W = x.shape
    t, h, w = T // temporal, H // patch, W // patch
    x = x.reshape(t, temporal, C, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, C * temporal * patch * patch)


def test_patchify_equals_the_view_permute_layout():
    g = torch.Generator().manual_seed(0)
    for shape in [(2, 3, 28, 28), (6, 3, 56, 84), (4, 3, 112, 28)]:
        x = torch.randn(shape, generator=g)
        assert torch.equal(patchify(x), _patchify_by_view(x))


def test_patchify_equals_transformers_processor():
    """Against the patch layout of transformers' own Qwen2-VL image processor (an image is
    a temporal pair of one frame), where this transformers has its PIL backend."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import \
            Qwen2VLImageProcessorPil
    except ImportError:
        pytest.skip("no Qwen2VLImageProcessorPil in this transformers")
    g = torch.Generator().manual_seed(0)
    img = torch.randn(3, 56, 84, generator=g)                 # normalised [C, H, W]
    theirs, gh, gw = Qwen2VLImageProcessorPil().patchify(img.numpy(), patch_size=14,
                                                          merge_size=2, temporal_patch_size=2)
    assert (gh, gw) == (4, 6)
    assert torch.equal(patchify(img[None].expand(2, -1, -1, -1)), torch.from_numpy(theirs))


def test_space_to_depth_equals_the_view_permute_layout():
    from mminfer.models.longvila import space_to_depth_2x2
    g = torch.Generator().manual_seed(0)
    for s, c in [(4, 3), (6, 2), (32, 5)]:
        x = torch.randn(2, s * s, c, generator=g)
        h = s // 2
        want = x.reshape(2, h, 2, h, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(2, h * h, 4 * c)
        assert torch.equal(space_to_depth_2x2(x), want)


# ---------------------------------------------------------------------- the benchmark
@pytest.mark.slow
def test_vision_benchmark_runs_tiny_on_the_cpu(tmp_path):
    """benchmarks/vision.py --tiny: transformers and two variants of ours side by side on the
    same input, their features equal (fp32), the JSON written; --ops lists every op of a
    block with its traffic (meta tensors), the fused block in far fewer kernels and bytes."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    bench = os.path.join(root, "benchmarks", "vision.py")
    out = subprocess.run([sys.executable, bench, "--tiny", "--pairs", "3", "--reps", "1",
                          "--variants", "plain", "fused", "--gemms", "--profile",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "speedup" in out.stdout                            # the printed table
    res = json.loads((tmp_path / "vision.json").read_text())
    rows = {r["impl"]: r for r in res["rows"]}
    assert set(rows) == {"transformers", "ours[plain]", "ours[plain]+preprocess",
                         "ours[fused]"}
    assert all(r["pairs"] == 3 and r["ms"] > 0 for r in rows.values())
    for v in ("plain", "fused"):
        assert rows[f"ours[{v}]"]["rel_max_diff"] < 5e-6 and rows[f"ours[{v}]"]["speedup"] > 0
    check = res["fp32_check"]
    for key in ("ours_max_abs_err", "ours_plain_max_abs_err", "ours_fused_max_abs_err"):
        assert check[key] < 5e-6 * max(1.0, check["max_abs_feature"])
    assert res["window_groups"] == [[0, 6, 16], [96, 2, 8], [112, 3, 8], [136, 1, 4]]
    assert set(res["first_chunk_ms"]) == {"plain", "fused"} and not res["failed"]
    g = res["gemms"]
    assert g["gate+up (padded)"]["n"] % 128 == 0 and g["down (padded)"]["k"] % 128 == 0
    assert all(r["ms"] > 0 for r in g.values())
    prof = (tmp_path / "vision_profile.txt").read_text()
    assert "== plain:" in prof and "== fused:" in prof and "aten::addmm" in prof

    # the 7B config at its real chunk (22 pairs of 40x72), on meta tensors
    out = subprocess.run([sys.executable, bench, "--ops", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    ops = json.loads((tmp_path / "vision_ops.json").read_text())
    assert ops["pairs"] == 22 and ops["tokens"] == 22 * 2880
    plain, fused = ops["variants"]["plain"], ops["variants"]["fused"]
    names = [o["op"] for o in fused["window_block"]]
    # a window block: rotary and attention in one kernel (mminfer.kernels.window_attention)
    assert names.count("addmm") == 4 and names.count("sdpa(flash)") == 0
    assert sorted(n for n in names if n.startswith("vision_")) == [
        "vision_add_rms_norm", "vision_add_rms_norm", "vision_silu_mul",
        "vision_window_attention"]
    full_names = [o["op"] for o in fused["full_block"]]     # a full block: rotary + SDPA
    assert full_names.count("sdpa(flash)") == 1 and "vision_rotary_" in full_names
    pw, fw = plain["per_block"]["window"], fused["per_block"]["window"]
    assert fw["elementwise_ops"] == 3 and pw["elementwise_ops"] > 20
    assert fw["attention_ops"] == 1 and fw["attention_gb"] < 0.7     # q, k, v in; o out
    assert fw["elementwise_gb"] < 0.45 * pw["elementwise_gb"]
    # the same GEMM work up to the 1 % of the padded MLP width (3420 -> 3456)
    assert 1.0 < fused["whole_tower"]["gemm_tflop"] / plain["whole_tower"]["gemm_tflop"] < 1.011


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h,w", [(40, 72), (46, 24)])     # windows divide; ragged edges
def test_tower_bf16_on_gpu_is_as_close_to_fp32_as_transformers(h, w):
    """The 7B vision block shapes (8 of its 32 blocks, two full) in bf16 on the GPU: ours
    and transformers' sdpa tower against transformers in fp32 on the same input; ours is no
    further from it than transformers' own bf16 run (plus bf16 rounding of the output)."""
    import copy
    from conftest import load_script
    bench = load_script("benchmarks/vision.py", "mminfer_benchmark_vision")
    QWEN_7B_VISION, build_visual = bench.QWEN_7B_VISION, bench.build_visual
    transformers_features = bench.transformers_features
    torch.manual_seed(0)
    visual = build_visual({**QWEN_7B_VISION, "depth": 8, "fullatt_block_indexes": [3, 7]},
                          "cuda", torch.bfloat16)
    ref_visual = copy.deepcopy(visual).float()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            pix = torch.randn(3 * h * w, 1176, device="cuda")
            ref = transformers_features(ref_visual, pix, 3, h, w).float()
            hf = transformers_features(visual, pix.bfloat16(), 3, h, w).float()
            ours = QwenVisionTower(visual)(pix.bfloat16(), 3, h, w).float()
            ours32 = QwenVisionTower(ref_visual)(pix, 3, h, w).float()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    scale = float(ref.abs().max())
    e_hf, e_ours, e32 = (float((x - ref).abs().max()) for x in (hf, ours, ours32))
    print(f"{h}x{w}: max abs err vs fp32: transformers bf16 {e_hf:.3g}, ours bf16 {e_ours:.3g}, "
          f"ours fp32 {e32:.3g} (max |feature| {scale:.3g})")
    assert e32 < 1e-4 * max(1.0, scale)
    assert e_ours <= 1.5 * e_hf + 2 ** -7 * scale
