"""SigLIP's encoder with FP8 layers as our steps (mminfer.models.siglip) against transformers'
forward of the same FP8 layers (its two kernels, LayerNorm → fp8 with the residual add and
GELU(tanh) → fp8, are tests/kernels/test_fp8_quant.py's); the CPU interpreter, and bf16 on
the GPU."""

import pytest
import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig, SiglipVisionModel

from mminfer.kernels import fp8_quant
from mminfer.kernels.runtime import interpreted
from mminfer.models import fp8, siglip
from tests.kernels.test_fp8_quant import _same_fp8

needs_interpreter = pytest.mark.skipif(not interpreted(),
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1")
KERNELS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def _tower(seed=0, hidden=48, inter=96, layers=3, heads=4):
    torch.manual_seed(seed)
    cfg = SiglipVisionConfig(hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             image_size=56, patch_size=14)
    m = SiglipVisionModel(cfg).eval()
    with torch.no_grad():    # LayerNorms off their ones/zeros start: a test of their weights
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.normal_(1.0, 0.2)
                mod.bias.normal_(0.0, 0.2)
    return getattr(m, "vision_model", m)   # older transformers nest the transformer


@pytest.mark.parametrize("kernels", KERNELS)
def test_fp8_encoder_equals_transformers_forward_of_the_fp8_layers(kernels):
    tower = _tower()
    plain = [p.clone() for p in tower.parameters()]
    fp8.convert(tower, fp8.is_vision_linear, kernels=kernels)
    assert siglip.fusable(tower.encoder) and len(plain) > 0
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        h = tower.embeddings(x)
        want = tower.encoder(inputs_embeds=h.clone()).last_hidden_state
        got = siglip.Fp8Encoder(tower.encoder)(h.clone())
    rel = float((got - want).norm() / want.norm())
    print(f"{kernels}: fused vs transformers' forward, same FP8 layers: rel {rel:.2e}")
    assert got.shape == want.shape
    assert rel < 2e-3           # the same e4m3 values; only where a quotient sits on a tie


def test_fusable_says_no_to_a_bf16_tower_or_another_activation():
    tower = _tower()
    assert not siglip.fusable(tower.encoder)
    fp8.convert(tower, fp8.is_vision_linear)
    assert siglip.fusable(tower.encoder)
    tower.encoder.layers[1].mlp.activation_fn = torch.nn.ReLU()
    assert not siglip.fusable(tower.encoder)
    with pytest.raises(ValueError):
        siglip.Fp8Encoder(tower.encoder)


def test_concat_is_the_layers_side_by_side():
    g = torch.Generator().manual_seed(3)
    layers = [fp8.Fp8Linear.from_linear(torch.nn.Linear(32, n, bias=bias))
              for n, bias in ((16, True), (8, False), (24, True))]
    x = torch.randn(5, 32, generator=g)
    both = fp8.concat(*layers)
    assert both.out_features == 48
    # the same products (fp32 sums in another order on the CPU)
    assert torch.allclose(both(x), torch.cat([m(x) for m in layers], -1), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_encoder_on_cuda_bf16_at_so400m_widths():
    """bf16 on the GPU at SigLIP-so400m's widths (1152, 4304, 16 heads of 72): the fused
    encoder within FP8's own error of transformers' forward of the same FP8 layers."""
    tower = _tower(hidden=1152, inter=4304, layers=2, heads=16).to("cuda", torch.bfloat16)
    fp8.convert(tower, fp8.is_vision_linear)
    x = torch.randn(4, 3, 56, 56, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        h = tower.embeddings(x)
        want = tower.encoder(inputs_embeds=h.clone()).last_hidden_state.float()
        got = siglip.Fp8Encoder(tower.encoder)(h.clone()).float()
    assert float((got - want).norm() / want.norm()) < 2 ** -5
    g = torch.randn(64, 4304, device="cuda", dtype=torch.bfloat16) * 3
    _same_fp8(fp8_quant.gelu_tanh_quant(g), *fp8_quant.gelu_tanh_quant_ref(g), exact=False)
    xx = torch.randn(64, 1152, device="cuda", dtype=torch.bfloat16)
    w, b = tower.encoder.layers[0].layer_norm1.weight, tower.encoder.layers[0].layer_norm1.bias
    _same_fp8(fp8_quant.layer_norm_quant(xx, w, b, 1e-6)[1],
              *fp8_quant.layer_norm_quant_ref(xx, w, b, 1e-6)[1:], exact=False)
