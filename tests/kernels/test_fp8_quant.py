"""The FP8 quantisers (mminfer.kernels.fp8_quant): every Triton kernel against its pure-PyTorch
fp32 reference on random inputs (the CPU interpreter at small sizes, fp16/fp32; on CUDA at the
7B's sizes in bf16), the e4m3 rounding, and the compiled kernels' conversion instruction."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from mminfer.kernels import fp8_quant
from mminfer.kernels.runtime import interpreted

needs_interpreter = pytest.mark.skipif(not interpreted(),
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
KERNELS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _same_fp8(got: fp8_quant.Fp8Act, q, s, *, exact: bool):
    """Scales equal (to fp32 rounding); the e4m3 values equal, or (``exact=False``: the GPU's
    division and rsqrt approximations) at most one e4m3 step apart on a few elements."""
    assert torch.allclose(got.scale.float(), s, rtol=1e-6 if exact else 1e-2, atol=0)
    a, b = got.data.float(), q.float()
    if exact:
        assert torch.equal(a, b)
        return
    step = b.abs().clamp(min=2 ** -6) * 2 ** -3            # one e4m3 step at b's binade
    assert bool(((a - b).abs() <= step + 2 ** -9).all())
    assert (a != b).float().mean() < 0.02


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("one_pass", [True, False], ids=["rows", "two-pass"])
def test_quant_kernels_match_reference(monkeypatch, dtype, one_pass):
    """Both standalone quantisers: whole rows read once, several a program (rows up to
    QUANT_ONE_PASS_MAX wide; 7 rows, part of one 8-row block), and two passes a row."""
    if not one_pass:
        monkeypatch.setattr(fp8_quant, "QUANT_ONE_PASS_MAX", 0)
    g = torch.Generator().manual_seed(0)
    N, C = 7, 300            # C not a power of 2
    x = (torch.randn(N, C, generator=g) * torch.logspace(-3, 2, N)[:, None]).to(dtype)
    x[3] = 0                                               # a zero row: scale floor, zeros
    got = fp8_quant.quantize_rows(x, kernels="triton")
    q, s = fp8_quant.quantize_rows_ref(x)
    _same_fp8(got, q, s, exact=True)
    assert torch.equal(got.data[3].float(), torch.zeros(C))
    # the amax element of every non-zero row is exactly ±448 after scaling
    assert torch.equal(got.data.float().abs().amax(-1)[[0, 1, 2, 4, 5, 6]],
                       torch.full((6,), 448.0))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("add", [False, True])
def test_rms_norm_quant_kernel_matches_reference(dtype, add):
    g = torch.Generator().manual_seed(1)
    N, C = 9, 96
    x = torch.randn(N, C, generator=g).to(dtype)
    d = torch.randn(N, C, generator=g).to(dtype) if add else None
    w = (torch.randn(C, generator=g) * 0.5 + 1).to(dtype)
    xs, want_q, want_s = fp8_quant.rms_norm_quant_ref(x.clone(), w, 1e-6, d)
    xk = x.clone()
    sum_k, got = fp8_quant.rms_norm_quant(xk, w, 1e-6, d, kernels="triton")
    _same_fp8(got, want_q, want_s, exact=True)
    if add:
        assert torch.equal(xk, xs) and sum_k is xk        # the sum written in place


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("C", [2100, 9000], ids=["one-pass", "two-pass"])
def test_silu_mul_quant_kernel_matches_reference(dtype, C):
    # 2100: the whole row in one program (<= ONE_PASS_MAX); 9000: column tiles of 2048
    assert (triton.next_power_of_2(2100) <= fp8_quant.ONE_PASS_MAX < triton.next_power_of_2(9000))
    g = torch.Generator().manual_seed(2)
    N = 5
    gu = (torch.randn(N, 2 * C, generator=g) * 3).to(dtype)
    gate, up = gu[:, :C], gu[:, C:]                        # views with a row stride of 2C
    got = fp8_quant.silu_mul_quant(gate, up, kernels="triton")
    q, s = fp8_quant.silu_mul_quant_ref(gate, up)
    _same_fp8(got, q, s, exact=True)


@needs_interpreter
def test_e4m3_grid_rounds_like_torch_everywhere():
    """Every rounding case of e4m3 (both sides of each binade carry, ties, subnormals, ±448)
    through the quantisation kernel: a row whose amax is 448 keeps every value's scale 1."""
    v = torch.cat([torch.linspace(-448, 448, 20001), torch.linspace(-0.02, 0.02, 4001),
                   torch.tensor([448.0, 2 ** -10, 3 * 2 ** -10, 2 ** -6, 15.5, 240.0])])
    got = fp8_quant.quantize_rows(v[None], kernels="triton")
    assert float(got.scale) == 1.0
    assert torch.equal(got.data.float(), v.to(fp8_quant.FP8).float()[None])


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("add", [False, True], ids=["norm", "add+norm"])
def test_layer_norm_quant_matches_reference(kernels, add):
    g = torch.Generator().manual_seed(0)
    N, C = 6, 72
    x = torch.randn(N, C, generator=g) * 3 + 1
    d = torch.randn(N, C, generator=g) if add else None
    w, b = torch.randn(C, generator=g), torch.randn(C, generator=g)
    xs, q, s = fp8_quant.layer_norm_quant_ref(x.clone(), w, b, 1e-6, d)
    xk = x.clone()
    got_x, got = fp8_quant.layer_norm_quant(xk, w, b, 1e-6, d, kernels=kernels)
    _same_fp8(got, q, s, exact=kernels == "torch")     # fp32 statistics summed in another order
    assert torch.allclose(got_x, xs)
    if add and kernels == "triton":
        assert got_x is xk                                 # the sum written in place


@pytest.mark.parametrize("kernels", KERNELS)
def test_gelu_tanh_quant_matches_torch_gelu(kernels):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 300, generator=g) * 4
    h[0, :3] = torch.tensor([60.0, -60.0, 0.0])           # tanh saturates, no NaN
    got = fp8_quant.gelu_tanh_quant(h, kernels=kernels)
    _same_fp8(got, *fp8_quant.gelu_tanh_quant_ref(h), exact=kernels == "torch")


def _rounding_cases():
    return torch.cat([torch.linspace(-448, 448, 20001), torch.linspace(-0.02, 0.02, 4001),
                      torch.tensor([448.0, 2 ** -10, 3 * 2 ** -10, 2 ** -6, 15.5, 240.0]),
                      torch.randn(100_000) * 30])


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("one_pass", [True, False], ids=["rows", "two-pass"])
def test_gpu_conversion_rounds_like_torch_everywhere(monkeypatch, one_pass):
    """The compiled kernels' e4m3 conversion (the hardware's cvt.rn.satfinite) is torch's
    cast on every rounding case and 100K random values: rows of 4000 (each holding 448, so
    every scale is 1 and the quotient is the value) through the one-read kernel, and one
    row of them all through the two-pass kernel."""
    v = _rounding_cases().clamp(-448, 448)
    v = torch.cat([v, v.new_zeros(-len(v) % 3999)]).view(-1, 3999)
    v = torch.cat([v, v.new_full((len(v), 1), 448.0)], 1).cuda()
    if not one_pass:
        monkeypatch.setattr(fp8_quant, "QUANT_ONE_PASS_MAX", 0)
        v = v.reshape(1, -1)
    got = fp8_quant.quantize_rows(v)
    assert torch.equal(got.scale, torch.ones_like(got.scale))
    assert torch.equal(got.data.view(torch.uint8), v.to(fp8_quant.FP8).view(torch.uint8))


def test_compiled_kernels_convert_with_the_hardware_instruction():
    """Without a GPU: every FP8 quantising kernel, compiled ahead of time for sm_90 by the
    Triton wheel's ptxas (what the H200 runs), builds, converts with cvt.rn.satfinite.e4m3x2
    and no longer rounds onto the e4m3 grid first (the interpreter's path, ALU-bound on the
    GPU); a control kernel that does round on the grid shows the check can see it."""
    script = Path(__file__).with_name("_fp8_compile_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["kernel"]: r for r in map(json.loads, out.stdout.splitlines())}
    control = rows.pop("_grid_control_kernel")
    assert control["grid_mark"] > 0 and control["cvt_e4m3"] > 0
    assert len(rows) == 7
    for name, r in rows.items():
        assert r["cubin_bytes"] > 0 and r["cvt_e4m3"] > 0, name
        assert r["grid_mark"] == 0, name


@needs_cuda
@pytest.mark.gpu
def test_bf16_kernels_at_7b_sizes_on_cuda():
    """The compiled quantisers in bf16 at Qwen2-7B widths against the fp32 references (the
    GPU's division and rsqrt may move an element one e4m3 step)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf, dev = torch.bfloat16, "cuda"
    N, C, I = 4096, 3584, 18944
    x = torch.randn(N, C, generator=g, device=dev).to(bf)
    w = torch.randn(C, generator=g, device=dev).to(bf)
    _, got = fp8_quant.rms_norm_quant(x, w, 1e-6)
    _, q, s = fp8_quant.rms_norm_quant_ref(x, w, 1e-6)
    _same_fp8(got, q, s, exact=False)
    _same_fp8(fp8_quant.quantize_rows(x), *fp8_quant.quantize_rows_ref(x), exact=False)
    for inter in (I, 3456):          # the LM's MLP (two passes), the vision MLP's (one)
        gu = torch.randn(N, 2 * inter, generator=g, device=dev).to(bf)
        _same_fp8(fp8_quant.silu_mul_quant(gu[:, :inter], gu[:, inter:]),
                  *fp8_quant.silu_mul_quant_ref(gu[:, :inter], gu[:, inter:]), exact=False)
