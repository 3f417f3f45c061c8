"""lab/experiments/ragged_decode.py: answers over ragged caches (one segment, or a shared
prefix and rows of their own), stepped with every length on the device, equal fp32
attention over each answer's rows, and each new row lands in its own segment."""

import pytest
import torch

from lab.experiments import ragged_decode as rd

H, HKV, D = 8, 2, 32


def reference(q, segs):
    """fp32 attention of ``q`` ``[H, D]`` over the concatenation of ``segs`` ([Hkv, n, D])."""
    k = torch.cat([s[0] for s in segs], 1).float().repeat_interleave(H // HKV, 0)
    v = torch.cat([s[1] for s in segs], 1).float().repeat_interleave(H // HKV, 0)
    w = torch.softmax((q.float().unsqueeze(1) @ k.transpose(1, 2)) * D ** -0.5, -1)
    return (w @ v).squeeze(1)                                               # [H, D]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("grouped", [True, False])
def test_steps_over_ragged_caches_match_fp32(dtype, tol, grouped):
    g = torch.Generator().manual_seed(0)

    def slab(cap):
        return (torch.randn(1, HKV, cap, D, generator=g) * 2).to(dtype)

    # answer 0: a cache of its own (61 rows); answers 1 and 2: one shared prefix of 70 rows,
    # 5 and 1 rows of their own after it
    plain = (slab(96), slab(96))
    prefix = (slab(80), slab(80))
    own = [(slab(16), slab(16)), (slab(16), slab(16))]
    segments = [(*plain, None, None, False), (*prefix, *own[0], True), (*prefix, *own[1], True)]
    ptrs = rd.table(segments, "cpu")
    lens = torch.tensor([[61, 0], [70, 5], [70, 1]])
    inc = torch.tensor([[1, 0], [0, 1], [0, 1]])
    rg = rd.Ragged(3, H, HKV, D, 96, split=32, max_members=2)
    # 1 and 2 read their prefix once for both, or each on its own
    groups = rg.groups([[0], [1, 2]] if grouped else [[0], [1], [2]], "cpu")
    prefix_before = prefix[0].clone()
    for step in range(3):
        rd.advance(lens, inc)
        q = torch.randn(3, H, D, generator=g).to(dtype)
        kn, vn = (torch.randn(3, HKV, D, generator=g).to(dtype) for _ in range(2))
        rg.append(ptrs, lens, kn, vn)
        out = rg.attend(q, ptrs, lens, groups)
        n0, n1, n2 = int(lens[0, 0]), int(lens[1, 1]), int(lens[2, 1])
        assert torch.equal(plain[0][0, :, n0 - 1], kn[0])         # each new row in its place
        assert torch.equal(own[0][1][0, :, n1 - 1], vn[1])
        assert torch.equal(own[1][0][0, :, n2 - 1], kn[2])
        want = [reference(q[0], [(plain[0][0, :, :n0], plain[1][0, :, :n0])]),
                reference(q[1], [(prefix[0][0, :, :70], prefix[1][0, :, :70]),
                                 (own[0][0][0, :, :n1], own[0][1][0, :, :n1])]),
                reference(q[2], [(prefix[0][0, :, :70], prefix[1][0, :, :70]),
                                 (own[1][0][0, :, :n2], own[1][1][0, :, :n2])])]
        for b in range(3):
            torch.testing.assert_close(out[b].float(), want[b], atol=tol, rtol=tol)
    assert torch.equal(prefix[0], prefix_before)          # the shared prefix is never written
    assert lens.tolist() == [[64, 0], [70, 8], [70, 4]]


def test_an_answer_past_its_ranges_and_an_empty_second_segment():
    """Ranges past an answer's length write empty partials that the merge ignores: a short
    answer beside a long one in the same static grid."""
    g = torch.Generator().manual_seed(1)
    long_, short = [(torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D,
                                                                         generator=g))
                    for n in (200, 8)]
    ptrs = rd.table([(*long_, None, None, False), (*short, None, None, False)], "cpu")
    lens = torch.tensor([[200, 0], [3, 0]])
    rg = rd.Ragged(2, H, HKV, D, 200, split=32, max_members=1)
    assert rg.S0 == 7
    q = torch.randn(2, H, D, generator=g)
    out = rg.attend(q, ptrs, lens, rg.groups([[1], [0]], "cpu"))
    torch.testing.assert_close(out[0], reference(q[0], [(long_[0][0], long_[1][0])]),
                               atol=1e-5, rtol=1e-5)
    want = reference(q[1], [(short[0][0, :, :3], short[1][0, :, :3])])
    torch.testing.assert_close(out[1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["each", "fork"])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_benchmark_cases_agree_with_the_product(kind, fp8):
    """The GPU benchmark's cases, small: this prototype and the product's launchers give the
    same step (fp32 on the CPU; on the GPU the benchmark reports their difference)."""
    ours, product, out, _ = rd.case(kind, 3, 150, 5, split=64, dev="cpu", dt=torch.float32,
                                    H=8, HKV=2, D=32, fp8=fp8)
    ours()
    torch.testing.assert_close(out, product(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grouped", [True, False])
def test_an_fp8_cache_is_written_and_read_as_the_product_does(grouped):
    """FP8 (e4m3) caches with per-head scales: each new row is the bytes kv.quantize_into
    writes, and attention equals fp32 attention over the dequantised rows."""
    from mminfer.models import kv
    g = torch.Generator().manual_seed(2)

    def quantised(x, scale):
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        kv.quantize_into(out, x, scale)
        return out

    prefix_f = [torch.randn(1, HKV, 90, D, generator=g) * 3 for _ in range(2)]
    scales = [kv.head_scales(t) for t in prefix_f]
    prefix = [quantised(t, sc) for t, sc in zip(prefix_f, scales)]
    own = [[torch.zeros(1, HKV, 8, D, dtype=torch.float8_e4m3fn) for _ in range(2)]
           for _ in range(2)]
    segments = [(*prefix, *own[b], True) for b in range(2)]
    ptrs = rd.table(segments, "cpu", scales=[tuple(scales)] * 2)
    lens = torch.tensor([[70, 0], [70, 0]])
    rg = rd.Ragged(2, H, HKV, D, 96, split=32, max_members=2, cache_dtype=torch.float8_e4m3fn)
    groups = rg.groups([[0, 1]] if grouped else [[0], [1]], "cpu")
    for step in range(2):
        rd.advance(lens, torch.tensor([[0, 1], [0, 1]]))
        q = torch.randn(2, H, D, generator=g)
        kn, vn = (torch.randn(2, HKV, D, generator=g) * 3 for _ in range(2))
        rg.append(ptrs, lens, kn, vn)
        out = rg.attend(q, ptrs, lens, groups)
        for b in range(2):
            want_k = quantised(kn[b].view(1, HKV, 1, D), scales[0])
            assert torch.equal(own[b][0][:, :, step:step + 1].view(torch.uint8),
                               want_k.view(torch.uint8))
            n = step + 1
            segs = [(kv.dequantize(prefix[0][:, :, :70], scales[0], torch.float32)[0],
                     kv.dequantize(prefix[1][:, :, :70], scales[1], torch.float32)[0]),
                    (kv.dequantize(own[b][0][:, :, :n], scales[0], torch.float32)[0],
                     kv.dequantize(own[b][1][:, :, :n], scales[1], torch.float32)[0])]
            torch.testing.assert_close(out[b], reference(q[b], segs), atol=1e-5, rtol=1e-5)
