"""The fused vision tower (mminfer.models.vision, fused=True) against transformers' own tower
(fp32, CPU): the Triton kernels (interpreter) and their torch versions, the one permutation
kept through every block (window and full), the zero-padded MLP width, a padded last chunk,
the torch.compile'd block. The kernels alone: tests/kernels/test_vision_elementwise.py."""

import pytest
import torch

from mminfer.kernels.runtime import interpreted, use_triton
from mminfer.models.qwen2_5_vl import Qwen2_5_VLAdapter
from mminfer.models.vision import INTER_ALIGN, QwenVisionTower
from lab.toy.tiny import save_tiny_qwen2_5_vl

TOWER = dict(window_size=56, vision_depth=5, fullatt_block_indexes=[1, 3],
             max_pixels=140 * 196)
needs_interpreter = pytest.mark.skipif(not interpreted(),
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def visual(tmp_path_factory):
    path = save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vision") / "tiny-qwen", **TOWER)
    ad = Qwen2_5_VLAdapter.from_pretrained(path, device="cpu")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():                 # sharp attention: a token in the wrong window shows
        for p in ad.model.model.visual.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.25 if p.dim() > 1 else 1.0))
    return ad.model.model.visual


def _pixels(t, h, w, seed=0):
    return torch.randn(t * h * w, 1176, generator=torch.Generator().manual_seed(seed))


def _reference(visual, pixels, t, h, w):
    with torch.no_grad():
        out = visual(pixels, grid_thw=torch.tensor([[t, h, w]]))
    return getattr(out, "pooler_output", out)


def _close(got, ref, rel=5e-6):
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    return err <= rel * max(1.0, scale), err, scale


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("t,h,w", [(2, 10, 14), (1, 8, 8)])   # ragged windows; they divide
def test_fused_tower_equals_transformers(visual, kernels, t, h, w):
    pix = _pixels(t, h, w, seed=h * w)
    ref = _reference(visual, pix, t, h, w)
    with torch.no_grad():
        got = QwenVisionTower(visual, kernels=kernels)(pix, t, h, w)
        plain = QwenVisionTower(visual, fused=False)(pix, t, h, w)
    ok, err, scale = _close(got, ref)
    print(f"{kernels} {t}x{h}x{w}: max abs diff {err:.2e} (max |feature| {scale:.1f}), "
          f"modules path {float((plain - ref).abs().max()):.2e}")
    assert got.shape == ref.shape and ok
    assert _close(plain, ref)[0]


def test_window_order_is_kept_through_every_block(visual):
    """After every block, window and full-attention alike, the fused tower's residual stream
    is transformers' hidden state of the same patches: one permutation to window order at
    the start (``layout.perm``), none after, and a full block over a pair in that order is the
    full block over the pair in any order."""
    vu = pytest.importorskip("transformers.vision_utils")
    t, h, w = 2, 10, 14
    pix = _pixels(t, h, w, seed=5)
    theirs = {}
    hooks = [blk.register_forward_hook(lambda m, a, out, i=i: theirs.__setitem__(i, out))
             for i, blk in enumerate(visual.blocks)]
    try:
        _reference(visual, pix, t, h, w)
    finally:
        for hk in hooks:
            hk.remove()
    index, _ = vu.get_vision_window_index(torch.tensor([[t, h, w]]), spatial_merge_size=2,
                                          window_size=56, patch_size=14)
    their_perm = (index[:, None] * 4 + torch.arange(4)).reshape(-1)   # patch at each position
    tower = QwenVisionTower(visual, kernels="torch")
    lay = tower.layout(h, w, "cpu")
    S = h * w
    our_perm = (torch.arange(t)[:, None] * S + lay.perm[None]).reshape(-1)
    ours = {}
    with torch.no_grad():
        tower._forward_fused(pix, t, S, lay, trace=lambda i, x: ours.__setitem__(i, x.clone()))
    assert sorted(ours) == list(range(len(visual.blocks)))
    for i in range(len(visual.blocks)):
        a = torch.empty_like(ours[i])
        a[our_perm] = ours[i]                       # both back to the processor's order
        b = torch.empty_like(theirs[i])
        b[their_perm] = theirs[i]
        ok, err, scale = _close(a, b)
        assert ok, (i, "full" if i in tower.full else "window", err, scale)
    # the orders differ (else this test would not tell them apart) on a ragged grid
    assert not torch.equal(their_perm, our_perm)


def test_padded_last_chunk_equals_unpadded(visual):
    """A chunk of 3 pairs padded with 2 zero pairs (what a compiled tower does to its last
    chunk) gives the 3 pairs' features, and the tower really ran 5."""
    t, h, w = 3, 10, 14
    pix = _pixels(t, h, w, seed=9)
    tower = QwenVisionTower(visual, kernels="torch")
    tower.pad_chunks = True
    ran = []
    inner = tower._forward_fused
    tower._forward_fused = lambda pixels, P, S, lay: (ran.append(P), inner(pixels, P, S, lay))[1]
    with torch.no_grad():
        padded = tower(pix, t, h, w, pad_to=5)
        plain = tower(pix, t, h, w)                 # no pad_to: no padding
    ref = _reference(visual, pix, t, h, w)
    assert ran == [5, 3]
    assert padded.shape == plain.shape == ref.shape
    assert _close(padded, plain, 1e-6)[0] and _close(padded, ref)[0]
    eager = QwenVisionTower(visual, kernels="torch")      # not compiled: pad_to is ignored
    assert not eager.pad_chunks


def test_mlp_width_padded_with_zeros_and_weights_follow_the_model(visual):
    tower = QwenVisionTower(visual, kernels="torch")
    blk, b = visual.blocks[0], tower.block_weights()[0]
    inter = blk.mlp.gate_proj.out_features
    assert b.inter % INTER_ALIGN == 0 and b.inter >= inter > 0
    assert torch.equal(b.gu_w[:inter], blk.mlp.gate_proj.weight)
    assert torch.equal(b.gu_w[b.inter:b.inter + inter], blk.mlp.up_proj.weight)
    assert torch.equal(b.down_w[:, :inter], blk.mlp.down_proj.weight)
    assert not b.gu_w[inter:b.inter].any() and not b.gu_w[b.inter + inter:].any()
    assert not b.gu_b[inter:b.inter].any() and not b.down_w[:, inter:].any()
    assert b.qkv_w is blk.attn.qkv.weight                    # no copy where nothing changes
    assert tower.block_weights() is tower.block_weights()    # cached while unchanged
    # a weight written in place (training, load_state_dict) is seen by the next call
    w0 = blk.mlp.up_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            blk.mlp.up_proj.weight.mul_(2)
        fresh = tower.block_weights()[0]
        assert torch.equal(fresh.gu_w[fresh.inter:fresh.inter + inter], 2 * w0)
        pix = _pixels(1, 8, 8, seed=3)
        with torch.no_grad():
            got = tower(pix, 1, 8, 8)
        assert _close(got, _reference(visual, pix, 1, 8, 8))[0]
    finally:
        with torch.no_grad():
            blk.mlp.up_proj.weight.copy_(w0)


def test_triton_on_the_cpu_without_the_interpreter_is_refused(visual, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton(torch.zeros(1))                    # auto: torch ops
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        use_triton(torch.zeros(1), "triton")
    with pytest.raises(ValueError):
        QwenVisionTower(visual, kernels="cuda")


@pytest.mark.slow
def test_compiled_tower_equals_eager_and_keeps_one_shape(visual):
    """compile=True on the CPU (inductor): the same features as the eager fused tower, a
    short last chunk padded to the chunk's shape so it compiles nothing new."""
    from torch._dynamo.utils import counters
    t, h, w = 3, 8, 8                       # windows divide the grid: two graphs (window, full)
    pix = _pixels(t, h, w, seed=11)
    ref = _reference(visual, pix, t, h, w)
    tower = QwenVisionTower(visual, compile=True)
    assert tower.pad_chunks
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        got = tower(pix, t, h, w, pad_to=3)
        frames = counters["stats"]["unique_graphs"]
        assert frames > before                                 # it did compile
        short = tower(pix[:h * w], 1, h, w, pad_to=3)          # the last chunk of a video
        assert counters["stats"]["unique_graphs"] == frames    # no recompilation
        eager = QwenVisionTower(visual)(pix, t, h, w)
    ok, err, scale = _close(got, ref, 1e-5)
    print(f"compiled: max abs diff {err:.2e} to transformers (max |feature| {scale:.1f})")
    assert ok and _close(got, eager, 1e-5)[0]
    assert _close(short, got[:h * w // 4], 1e-5)[0]


def test_pipeline_passes_vision_compile(tmp_path, monkeypatch):
    """Pipeline(vision_compile=...) reaches the adapter's tower; on the CPU the tower stays
    eager, on CUDA it is the compiled one with chunks padded to one shape."""
    from mminfer.engine.pipeline import Pipeline
    from mminfer.models.vision import COMPILE_DEFAULT
    path = save_tiny_qwen2_5_vl(tmp_path / "tiny-qwen", **TOWER)
    seen = []
    orig = Qwen2_5_VLAdapter.set_vision_compile
    monkeypatch.setattr(Qwen2_5_VLAdapter, "set_vision_compile",
                        lambda self, on: (seen.append(on), orig(self, on))[1])
    pipe = Pipeline(str(path), device="cpu", vision_compile=True)
    assert seen == [COMPILE_DEFAULT, True]
    assert not pipe.adapter.tower.compile                 # the CPU stays eager
    assert Pipeline(str(path), device="cpu").adapter.tower.compile is False
    ad = pipe.adapter
    ad.device = torch.device("cuda")                      # what a CUDA adapter gets (lazy:
    ad.set_vision_compile(True)                           # nothing compiles before a call)
    assert ad.tower.compile and ad.tower.pad_chunks
    assert ad.tower.visual is ad.model.model.visual
