"""The flash-decoding kernel over an FP8 KV cache (mminfer.kernels.fp8_attention) against the
pure-PyTorch fp32 oracle: one query (a decode step) and a few rows (a question's suffix,
causal from the bottom right), GQA, K/V as strided views of a larger buffer, the key range
split in several programs then merged. CPU under the Triton interpreter at small sizes (fp16,
fp32: bf16 arithmetic is wrong there); a GPU test at long lengths in bf16."""

import inspect
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mminfer.kernels import fp8_attention as F

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def reference(q, k, v, k_scale, v_scale, scale: float | None = None) -> torch.Tensor:
    """The oracle (the package runs no such thing): K/V dequantised whole, fp32 softmax with
    the bottom-right causal mask, K/V repeated per query head. ``[1, q_len, H, D]`` fp32."""
    B, H, q_len, D = q.shape
    kv_len, G = k.shape[2], H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = F.dequantize(k, k_scale).repeat_interleave(G, dim=1)
    vf = F.dequantize(v, v_scale).repeat_interleave(G, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale                     # [B, H, q, kv]
    qpos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    s = s.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > qpos, float("-inf"))
    return (s.softmax(-1) @ vf).transpose(1, 2)


def _case(H, Hkv, q_len, kv_len, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    cap = kv_len + 9           # the cache is a view of a buffer with headroom
    kb = (torch.randn(1, Hkv, cap, D, generator=g, device=device) * 3).to(F.FP8)
    vb = (torch.randn(1, Hkv, cap, D, generator=g, device=device) * 3).to(F.FP8)
    ks = torch.rand(Hkv, generator=g, device=device) + 0.05
    vs = torch.rand(Hkv, generator=g, device=device) + 0.05
    q = torch.randn(1, q_len, H, D, generator=g, device=device, dtype=dtype).transpose(1, 2)
    return q, kb[:, :, :kv_len], vb[:, :, :kv_len], ks, vs


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("H,Hkv,q_len,kv_len,D,splits", [
    (4, 2, 1, 100, 16, None),       # a decode step, the default split
    (6, 2, 1, 75, 24, 4),           # head dim not a power of two, 4 key ranges
    (6, 2, 5, 70, 16, 3),           # continuation rows: lower-right causal across ranges
    (4, 1, 20, 48, 32, 5),          # more rows than a block, a range past every row's keys
])
def test_kernel_matches_the_fp32_reference(H, Hkv, q_len, kv_len, D, splits, dtype, tol):
    q, k, v, ks, vs = _case(H, Hkv, q_len, kv_len, D, dtype)
    got = F.fp8_attention(q, k, v, ks, vs, 0.3, n_splits=splits)
    ref = reference(q, k, v, ks, vs, 0.3)
    assert got.shape == (1, q_len, H, D) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    # the reference is not trivially close to something else: the mask and scales matter
    wrong = reference(q, k, v, ks * 2, vs, 0.3)
    assert (wrong - ref).abs().max() > 10 * tol


@pytest.mark.parametrize("q_len", [1, 7])
def test_chunked_fallback_matches_the_reference(q_len):
    """The PyTorch path (the CPU without the interpreter), chunk smaller than the cache."""
    q, k, v, ks, vs = _case(6, 2, q_len, 50, 16, torch.float32, seed=3)
    got = F.chunked(q, k, v, ks, vs, None, chunk=16)
    torch.testing.assert_close(got, reference(q, k, v, ks, vs), atol=2e-6, rtol=2e-5)


def _split(k, v, at: int):
    """The cache as two segments in separate buffers: rows [0, at) and the rest."""
    return [(k[:, :, :at], v[:, :, :at]), (k[:, :, at:].clone(), v[:, :, at:].clone())]


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("q_len,at,splits", [(1, 61, None), (5, 40, 3), (20, 27, 4)])
def test_two_segments_read_as_their_concatenation(q_len, at, splits, fp8):
    """A reader's rows after a shared prefix: the keys in two buffers give what they give
    as one cache (FP8 with scales; fp32 with none), the key ranges never straddling the two;
    the Triton kernel under the interpreter where it runs, and the PyTorch fallback."""
    q, k, v, ks, vs = _case(6, 2, q_len, 70, 16, torch.float32, seed=5)
    if not fp8:
        k, v = F.dequantize(k, ks), F.dequantize(v, vs)
        ks = vs = torch.ones(2)
    ref = reference(q, k, v, ks, vs, 0.3)
    segs = _split(k, v, at)
    scales = (ks, vs) if fp8 else (None, None)
    got = F.chunked(q, None, None, ks, vs, 0.3, chunk=16, segments=segs)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if INTERP:
        got = F.split_attention(q, segs, *scales, 0.3, n_splits=splits)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # the second segment's keys are read where they are: another buffer changes the answer
    other = [segs[0], (segs[1][1], segs[1][0])]
    assert not torch.allclose(F.chunked(q, None, None, ks, vs, 0.3, segments=other), ref,
                              atol=1e-3)


def _readers(M, H, Hkv, P, owns, D, fp8, seed=0):
    """M readers of one prefix of P rows, reader j with ``owns[j]`` rows of its own after it
    (separate buffers, views of larger ones): the queries ``[M, H, 1, D]`` (a strided view of
    the step's q), the prefix, the own segments, scales; FP8 or fp32."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.rand(Hkv, generator=g) + 0.05
    vs = torch.rand(Hkv, generator=g) + 0.05

    def cache(n):
        k = torch.randn(1, Hkv, n + 3, D, generator=g) * 3
        v = torch.randn(1, Hkv, n + 3, D, generator=g) * 3
        if fp8:
            k, v = k.to(F.FP8), v.to(F.FP8)
        return k[:, :, :n], v[:, :, :n]

    q = torch.randn(M, 1, H, D, generator=g).transpose(1, 2)
    return q, cache(P), [cache(n) for n in owns], (ks, vs) if fp8 else (None, None)


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("M,H,Hkv,P,owns,D,splits", [
    (3, 6, 2, 61, [1, 9, 4], 16, None),     # readers with own segments of several lengths
    (5, 4, 1, 40, [2, 2, 30, 1, 7], 24, 3),  # 20 rows: two row blocks, 3 prefix key ranges
    (1, 6, 2, 33, [5], 16, 2),               # one reader
])
def test_shared_prefix_readers_match_each_alone(M, H, Hkv, P, owns, D, splits, fp8):
    """Cascade attention: M readers of one prefix at once (the prefix read in one launch for
    all) give each reader's attention over the prefix and its own rows: the fp32 oracle on
    their concatenation; the Triton kernel under the interpreter where it runs, and the
    PyTorch fallback. A prefix in the queries' dtype with no forced key ranges takes the
    flash-attention prefix pass (here the CPU's flash kernel), its partial merged the same."""
    q, (pk, pv), segs, (ks, vs) = _readers(M, H, Hkv, P, owns, D, fp8)
    one = torch.ones(Hkv)
    refs = []
    for j, (k, v) in enumerate(segs):
        kk, vv = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        refs.append(reference(q[j:j + 1], kk, vv, ks if fp8 else one, vs if fp8 else one,
                              0.3))
    ref = torch.cat(refs)                                         # [M, 1, H, D]
    got = F._shared_prefix_chunked(q, (pk, pv), segs, ks if fp8 else one,
                                   vs if fp8 else one, 0.3)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    if INTERP:
        got = F.shared_prefix_attention(q, (pk, pv), segs, ks, vs, 0.3, n_splits=splits)
        assert got.shape == (M, 1, H, D) and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
        # the reader each output belongs to matters: its own rows, its own query
        if M > 1:
            swapped = F.shared_prefix_attention(q, (pk, pv), segs[::-1], ks, vs, 0.3)
            assert not torch.allclose(swapped, ref, atol=1e-3)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 on the CPU")
def test_shared_prefix_fp16_queries_over_fp8():
    """fp16 queries over an FP8 prefix (the tile conversion and the output's dtype)."""
    q, (pk, pv), segs, (ks, vs) = _readers(4, 6, 2, 50, [3, 1, 12, 6], 16, True, seed=2)
    ref = torch.cat([reference(q[j:j + 1].half(), torch.cat([pk, k], 2),
                               torch.cat([pv, v], 2), ks, vs) for j, (k, v) in enumerate(segs)])
    got = F.shared_prefix_attention(q.half(), (pk, pv), segs, ks, vs)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, atol=3e-3, rtol=3e-3)


def test_split_plan_covers_the_keys():
    for n in (1, 63, 64, 1000, 1 << 20):
        for progs in (1, 4, 300):
            for gpu, bn in ((True, 64), (False, 16)):
                split, count = F.split_plan(n, progs, gpu=gpu, block_n=bn)
                assert split % bn == 0 and (count - 1) * split < n <= count * split
                assert count <= F.MAX_SPLITS
    # one query on 4 KV heads at 1M keys: enough programs for two waves of 132 SMs
    split, count = F.split_plan(1 << 20, 4, gpu=True, block_n=64)
    assert 4 * count >= 2 * 132
    # 16 queries (one 128-row block per KV head): one wave, half the splits of two
    one = F.split_plan(1 << 20, 4, gpu=True, block_n=128, waves=F.waves(128))[1]
    two = F.split_plan(1 << 20, 4, gpu=True, block_n=128, waves=F.waves(16))[1]
    assert 4 * one >= 132 and 2 * one == two


def test_warm_lengths_cover_every_row_tile():
    """Every question length meets a row tile the warm-up compiled (on the H200 a follow-up
    of 9 rows where warm-up and first question had used 10 compiled mid-request: 1.10 s),
    with one launch per tile."""
    for gpu in (True, False):
        for group in (1, 2, 4, 7, 8, 16):
            lengths = F.warm_lengths(group, gpu)
            warmed = {F.tiles(n * group, gpu) for n in lengths}
            assert len(warmed) == len(lengths)
            assert all(F.tiles(q * group, gpu) in warmed for q in range(1, 600))
    assert F.warm_lengths(7, True) == [1, 3, 5, 10]


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 on the CPU")
def test_warm_launches_over_a_cache_view(monkeypatch):
    """warm runs the launcher once per warm length over the cache it is given, in two
    segments as a fork's reader reads it (FP8 with scales, or without)."""
    q, k, v, ks, vs = _case(14, 2, 1, 40, 16, torch.float32)
    calls = []
    real = F.split_attention
    monkeypatch.setattr(F, "split_attention", lambda q_, segs, *a: calls.append(
        (q_.shape, [s[0].shape[2] for s in segs], a[0] is not None)) or real(q_, segs, *a))
    monkeypatch.setattr(F, "warm_lengths", lambda group, gpu: [1, 3, 5, 10])
    assert F.warm(k, v, ks, vs, 14, torch.float32) == [1, 3, 5, 10]
    assert calls == [((1, 14, n, 16), [40 - n, n], True) for n in (1, 3, 5, 10)]
    calls.clear()
    plain = F.dequantize(k, ks)
    assert F.warm(plain, plain, None, None, 14, torch.float32) == [1, 3, 5, 10]
    assert [c[2] for c in calls] == [False] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_len", [1, 16, 128])
@pytest.mark.parametrize("kv_len", [4097, 262144])
def test_kernel_matches_the_reference_on_cuda_at_long_lengths(q_len, kv_len):
    q, k, v, ks, vs = _case(28, 4, q_len, kv_len, 128, torch.bfloat16, device="cuda")
    got = F.fp8_attention(q, k, v, ks, vs)
    ref = F.chunked(q.float(), k, v, ks, vs)      # fp32, a chunk at a time (memory)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    if kv_len < 10000:
        torch.testing.assert_close(ref, reference(q.float(), k, v, ks, vs),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("P", [4097, 131072])
def test_shared_prefix_readers_on_cuda_at_long_lengths(P, fp8):
    """8 readers of one long prefix (bf16 queries, 28/4 heads of 128, FP8 or bf16 K/V): each
    output is that reader's split_attention alone and the fp32 chunked form's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    M, owns = 8, [1, 5, 64, 300, 2, 17, 1000, 9]
    ks = torch.rand(4, generator=g, device="cuda") + 0.05
    vs = torch.rand(4, generator=g, device="cuda") + 0.05

    def cache(n):
        kv = [torch.randn(1, 4, n, 128, generator=g, device="cuda") * 3 for _ in range(2)]
        return tuple(t.to(F.FP8 if fp8 else torch.bfloat16) for t in kv)

    prefix, segs = cache(P), [cache(n) for n in owns]
    q = torch.randn(M, 28, 1, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    scales = (ks, vs) if fp8 else (None, None)
    one = torch.ones(4, device="cuda")
    got = F.shared_prefix_attention(q, prefix, segs, *scales)
    for j, seg in enumerate(segs):
        alone = F.split_attention(q[j:j + 1], [prefix, seg], *scales)
        ref = F.chunked(q[j:j + 1].float(), None, None, ks if fp8 else one, vs if fp8 else one,
                        segments=[prefix, seg])
        torch.testing.assert_close(got[j:j + 1].float(), alone.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got[j:j + 1].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_len", [1, 32, 200])
@pytest.mark.parametrize("P", [4097, 131072])
def test_question_rows_over_a_bf16_prefix_on_cuda(P, q_len):
    """A question's rows (or a decode step) over a bf16 prefix and its own rows after it (the
    prefix by PyTorch's flash attention, the own rows causal by the Triton pass, merged):
    the fp32 chunked form's."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def cache(n):
        return tuple(torch.randn(1, 4, n + 5, 128, generator=g, device="cuda",
                                 dtype=torch.bfloat16)[:, :, :n] * 3 for _ in range(2))

    segs = [cache(P), cache(q_len + 3)]
    q = torch.randn(1, q_len, 28, 128, generator=g, device="cuda",
                    dtype=torch.bfloat16).transpose(1, 2)
    one = torch.ones(4, device="cuda")
    got = F.split_attention(q, segs)
    ref = F.chunked(q.float(), None, None, one, one, segments=segs)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


def _lower_for_hopper():
    """Both kernels through Triton's sm_90 pipeline down to a cubin (ptxas), bf16 queries over
    e4m3 K/V at the H200 shapes (GQA 7, d 128) and each row block the launcher picks; prints
    SKIP where this triton has no CUDA backend."""
    # Triton's compiler internals: only the child process that lowers imports them
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    target = GPUTarget("cuda", 90, 32)
    try:
        backend = make_backend(target)
    except Exception as e:
        print(f"SKIP: triton has no CUDA backend here: {e}")
        return

    def lower(fn, pointers, const, num_warps):
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: "constexpr" if n in const else pointers.get(
            n, "fp32" if n == "qk_scale" else "i32") for n in names}
        src = ASTSource(fn=fn, signature=sig, attrs={},
                        constexprs={(names.index(k),): v for k, v in const.items()})
        options = backend.parse_options({"num_warps": num_warps, "num_stages": 2})
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        mod = src.make_ir(target, options, backend.get_codegen_implementation(options),
                          backend.get_module_map(), ctx)
        passes, md = {}, {}
        backend.add_stages(passes, options, src.language)
        for stage in ("ttir", "ttgir", "llir", "ptx", "cubin"):
            mod = passes[stage](mod, md)
        assert md["shared"] <= 227 * 1024

    ptrs = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "K2": "*fp8e4nv",
            "V2": "*fp8e4nv", "KS": "*fp32", "VS": "*fp32", "PO": "*fp32", "PL": "*fp32",
            "O": "*bf16"}
    for block_m, warps in ((16, 4), (32, 4), (64, 4), (128, 8)):
        lower(F._fp8_split_fwd, ptrs, dict(G=7, D=128, BLOCK_M=block_m, BLOCK_N=64,
                                            BLOCK_D=128, PRECISION="tf32", CAUSAL=True), warps)
    # a forked reader of a bf16 cache: the same kernel, K/V in the query's dtype
    bf16 = {**ptrs, **{n: "*bf16" for n in ("K", "V", "K2", "V2")}}
    lower(F._fp8_split_fwd, bf16, dict(G=7, D=128, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128,
                                       PRECISION="tf32", CAUSAL=True), 4)
    # readers of one prefix decoding together: their rows over the prefix, none causal
    for dt in (ptrs, bf16):
        lower(F._fp8_split_fwd, dt, dict(G=7, D=128, BLOCK_M=64, BLOCK_N=128, BLOCK_D=128,
                                         PRECISION="tf32", CAUSAL=False), 4)
    # every reader's own rows in one launch, K/V found through the table of addresses
    for dt in (ptrs, bf16):
        lower(F._fp8_own_fwd, {**dt, "TAB": "*i64"},
              dict(G=7, D=128, BLOCK_M=16, BLOCK_N=128, BLOCK_D=128, PRECISION="tf32",
                   M_BLOCKS=1), 4)
    lower(F._fp8_merge, ptrs, dict(G=7, D=128, BLOCK_M=16, BLOCK_D=128), 4)
    print("lowered")


def test_kernels_compile_for_hopper():
    """No GPU here, but the sm_90 compiler runs on the host: FP8 loads, the e4m3 -> bf16
    conversion and the dots must lower (in a child without TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", "import tests.kernels.test_fp8_attention as t; "
                          "t._lower_for_hopper()"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    if "SKIP:" in res.stdout:
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0 and "lowered" in res.stdout, res.stderr[-3000:]
