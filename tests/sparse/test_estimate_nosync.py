"""Estimation, plan and kernels queue a layer without waiting for the GPU: one
synchronisation stalls the host behind every kernel queued before it, so the next layer's
launches no longer overlap this layer's work (15 waits per layer made estimation
host-bound, lab/NOTES.md section 7)."""

from pathlib import Path

import pytest
import torch

from mminfer.kernels import sparse_attention
from mminfer.kernels.runtime import as_device, to_device
from mminfer.sparse.estimate import estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPatternConfig

ROOT = Path(__file__).resolve().parents[2]


def test_uploads_keep_values_and_dtypes():
    t = torch.arange(5, dtype=torch.int32)
    assert torch.equal(to_device(t, "cpu"), t)
    x = as_device([1, 2, 3], "cpu", torch.long)
    assert x.dtype == torch.long and x.tolist() == [1, 2, 3]
    assert as_device([0.5], "cpu", torch.float32).dtype == torch.float32


def test_estimator_lists_are_uploaded_once_per_value():
    """The estimator's small lists (head ids, windows, budgets) repeat in every layer: one
    upload per value, not per layer."""
    from mminfer.sparse.estimate import _const
    a = _const([3, 1, 2], "cpu", torch.long)
    assert a.tolist() == [3, 1, 2] and a.dtype == torch.long
    assert _const((3, 1, 2), torch.device("cpu"), torch.long) is a
    assert _const([3, 1, 2], "cpu", torch.float32) is not a
    assert _const([3, 1, 2], "cpu", torch.float32).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_layer_queues_without_a_synchronisation():
    cfg = HeadPatternConfig.load(ROOT / "mminfer" / "models" / "configs" / "qwen2_5_vl_7b.json")
    index = ModalityIndex.from_segments([("text", 20), ("video", 64, 16, 16, 1),
                                         ("text", 30)])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 28, index.n, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 4, index.n, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 4, index.n, 128, device="cuda", generator=g).bfloat16()
    for layer in (0, 5):                 # first call: compile and fill the layout caches
        heads = cfg.layer(layer)
        plan = estimate_layer(q, k, index, heads).build_plan(q.device)
        ref = sparse_attention(q, k, v, plan)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = estimate_layer(q, k, index, heads).build_plan(q.device)
            out = sparse_attention(q, k, v, plan)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(out, ref)


def test_a_batch_of_one_has_no_batch_stride():
    from mminfer.kernels.runtime import batch_stride
    x = torch.zeros(1, 28, 64, 128)
    assert batch_stride(x) == 0 and batch_stride(torch.zeros(2, 3, 4)) == 12
    assert batch_stride(x.unsqueeze(0), 1) == 0


def _compiled_variants(fn):
    caches = getattr(fn, "device_caches", None)
    if not caches:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(c[0]) for c in caches.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_long_prompt_compiles_no_new_kernel_variant():
    """At 1M tokens a [1, 28, N, 128] tensor's batch stride passes 2**31; as a kernel
    argument that compiled a second variant of every kernel inside the first long request.
    Here the same small inputs viewed with such a stride reuse the compiled kernels."""
    from mminfer.kernels.sparse_attn_kernel import _sparse_attn_fwd
    cfg = HeadPatternConfig.load(ROOT / "mminfer" / "models" / "configs" / "qwen2_5_vl_7b.json")
    index = ModalityIndex.from_segments([("text", 20), ("video", 16, 16, 16, 1), ("text", 30)])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, index.n, 128, device="cuda", generator=g).bfloat16()
               for h in (28, 4, 4))

    def huge(t):
        return t.as_strided(t.shape, (2 ** 32,) + t.stride()[1:])

    plan = estimate_layer(q, k, index, cfg.layer(3)).build_plan(q.device)
    ref = sparse_attention(q, k, v, plan)
    torch.cuda.synchronize()
    before = _compiled_variants(_sparse_attn_fwd)
    out = sparse_attention(huge(q), huge(k), huge(v), plan)
    torch.cuda.synchronize()
    assert _compiled_variants(_sparse_attn_fwd) == before
    assert torch.equal(out, ref)
    # the per-layer query-set kernels (estimate_layer's default) likewise
    from mminfer.kernels.proxy import QuerySet, proxy_sets
    from mminfer.kernels.proxy_kernel import _sets_lse_kernel, _sets_mass_kernel
    sets = [QuerySet(((index.n - 64, 64),), (0, 7), ((None,), ()))]
    want = proxy_sets(q, k, sets, 128 ** -0.5)
    torch.cuda.synchronize()
    before = (_compiled_variants(_sets_lse_kernel), _compiled_variants(_sets_mass_kernel))
    got = proxy_sets(huge(q), huge(k), sets, 128 ** -0.5)
    torch.cuda.synchronize()
    assert (_compiled_variants(_sets_lse_kernel), _compiled_variants(_sets_mass_kernel)) == before
    assert torch.equal(got[0][0], want[0][0])          # column sums: one writer per key
    torch.testing.assert_close(got[0][1][None], want[0][1][None], atol=1e-6, rtol=1e-5)
