"""The prefill's rotary kernel (mminfer.kernels.rope) against transformers' own
``apply_rotary_pos_emb`` of the Qwen2 and Qwen2.5-VL text models, to the bit: random rows,
cos and sin (different in the two halves, as M-RoPE's can be), a ragged token count, written
into a strided head-major buffer at an offset; bf16 (the models' dtype) on the CPU interpreter
and the GPU (whose compiler once turned the kernel's roundings into bf16 FMAs: 1 ulp off)."""

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

from mminfer.kernels import rope
from mminfer.kernels.runtime import interpreted

MODULES = [modeling_qwen2, modeling_qwen2_5_vl]
needs_interpreter = pytest.mark.skipif(not interpreted(),
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1")


def _case(dtype, device, H=3, c=37, d=32, n=50, s=9, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(c, H * d, generator=g) * 3).to(dtype).to(device)
    cos = torch.randn(c, d, generator=g).to(dtype).to(device)
    sin = torch.randn(c, d, generator=g).to(dtype).to(device)
    buf = torch.full((1, H, n, d), float("nan"), dtype=dtype, device=device)
    return x, cos, sin, buf, s


def _transformers(module, x, cos, sin, d):
    c = x.shape[0]
    t = x.view(1, c, -1, d).transpose(1, 2)
    out, _ = module.apply_rotary_pos_emb(t, t, cos[None], sin[None])
    return out[0]


def _check(module, dtype, device, kernels):
    x, cos, sin, buf, s = _case(dtype, device)
    H, d, c = buf.shape[1], buf.shape[-1], x.shape[0]
    rope.rotate_into(buf[0, :, s:s + c], x, cos, sin, kernels=kernels)
    ref = _transformers(module, x, cos, sin, d)
    assert torch.equal(buf[0, :, s:s + c], ref)
    # nothing outside the rows it was given is written
    assert torch.isnan(buf[0, :, :s]).all() and torch.isnan(buf[0, :, s + c:]).all()


@pytest.mark.parametrize("module", MODULES, ids=["qwen2", "qwen2_5_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])     # fp16: torch ops, even if asked
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_rotate_into_equals_transformers(module, dtype, kernels):
    _check(module, dtype, "cpu", kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("module", MODULES, ids=["qwen2", "qwen2_5_vl"])
def test_rotate_into_equals_transformers_gpu(module):
    _check(module, torch.bfloat16, "cuda", "auto")


def test_standard_names_the_two_models_functions_only():
    assert all(rope.standard(m.apply_rotary_pos_emb) for m in MODULES)
    assert not rope.standard(lambda q, k, cos, sin: (q, k))
    assert not rope.standard(modeling_qwen2_5_vl.apply_rotary_pos_emb_vision)


def test_rotate_into_refuses_shapes_that_do_not_fit():
    x, cos, sin, buf, s = _case(torch.float32, "cpu")
    with pytest.raises(ValueError):
        rope.rotate_into(buf[0, :, s:s + 5], x, cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotate_into_a_buffer_past_2_to_the_31_elements():
    """The 7B's q buffer at 1M tokens (28 x 2^20 x 128 bf16 = 7.5 GB): the last head's rows
    lie past 2^31 elements from its start (an int32 offset crashed the 1.05M prefill)."""
    H, n, d, c = 28, 1 << 20, 128, 64
    buf = torch.zeros(1, H, n, d, dtype=torch.bfloat16, device="cuda")
    x, cos, sin, _, _ = _case(torch.bfloat16, "cuda", H=H, c=c, d=d)
    s = n - c
    rope.rotate_into(buf[0, :, s:], x, cos, sin)
    torch.cuda.synchronize()
    assert torch.equal(buf[0, :, s:], _transformers(modeling_qwen2, x, cos, sin, d))
    del buf
    torch.cuda.empty_cache()
