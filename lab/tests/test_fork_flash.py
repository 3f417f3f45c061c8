"""lab/experiments/fork_flash.py: one decode token over a real ForkLayer (a prefix's SlabLayer
shared, the fork's own rows after it) equals the fp32 attention over the two segments'
concatenation, for every variant; several query rows go to the product's launcher."""

import pytest
import torch

from lab.experiments import fork_flash
from mminfer.kernels.runtime import interpreted
from mminfer.models import hooks
from mminfer.models.kv import ForkLayer, SlabLayer

H, HKV, D = 8, 2, 32


def fork_views(prefix_len, own_len, dtype, device="cpu", seed=0):
    """A ForkLayer over a SlabLayer of ``prefix_len`` random rows, ``own_len`` rows written
    to it: the ``keys``/``values`` the attention hook gets, and the full K/V, fp32."""
    g = torch.Generator().manual_seed(seed)

    def rows(n):
        return (torch.randn(1, HKV, n, D, generator=g) * 2).to(device, dtype)

    base = SlabLayer(16)
    pk, pv = rows(prefix_len), rows(prefix_len)
    base.update(pk, pv)
    fork = ForkLayer(base, prefix_len, 16)
    ok, ov = rows(own_len), rows(own_len)
    keys, values = fork.update(ok, ov)
    return keys, values, torch.cat([pk, ok], 2).float(), torch.cat([pv, ov], 2).float()


def reference(q, k, v, scale):
    """fp32 attention of the last position over every row, GQA by repeating K/V."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    w = torch.softmax(q.float() @ k.transpose(-1, -2) * scale, -1)
    return (w @ v).transpose(1, 2)                                       # [1, 1, H, D]


def cpu_variants():
    names = ["fork_flash_torchmerge"]
    if interpreted():                     # the Triton merge and split pass on the interpreter
        names += ["fork_flash", "fork_flash_split"]
    return names


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 4e-3)])
@pytest.mark.parametrize("prefix_len,own_len", [(300, 1), (517, 37)])
def test_one_token_equals_attention_over_both_segments(dtype, tol, prefix_len, own_len):
    keys, values, k, v = fork_views(prefix_len, own_len, dtype, seed=prefix_len + own_len)
    q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = D ** -0.5 * 1.3
    want = reference(q, k, v, scale)
    for name in cpu_variants():
        got = fork_flash.variant(name)(q, keys, values, scale)
        assert got.shape == (1, 1, H, D) and got.dtype == dtype, name
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=name)
    # the product on the same views: the same attention
    torch.testing.assert_close(hooks.fork_attention(q, keys, values, scale).float(), want,
                               atol=tol, rtol=tol)


def test_several_rows_go_to_the_product():
    keys, values, _, _ = fork_views(200, 9, torch.float32)
    q = torch.randn(1, H, 4, D, generator=torch.Generator().manual_seed(3))
    got = fork_flash.fork_attention_flash(q, keys, values, None)
    assert torch.equal(got, fork_flash.PRODUCT(q, keys, values, None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefix_len,own_len", [(4096, 1), (20000, 45)])
def test_gpu_bf16_equals_reference_and_the_split_kernel(prefix_len, own_len):
    keys, values, k, v = fork_views(prefix_len, own_len, torch.bfloat16, "cuda")
    q = torch.randn(1, H, 1, D, generator=torch.Generator().manual_seed(4)).to("cuda",
                                                                              torch.bfloat16)
    want = reference(q, k, v, D ** -0.5)
    product = hooks.fork_attention(q, keys, values, None).float()
    for name in fork_flash.VARIANTS:
        got = fork_flash.variant(name)(q, keys, values, None).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=name)
        assert (got - product).abs().max() < 2e-2, name
