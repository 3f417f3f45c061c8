"""SigLIP's encoder (LongVILA's vision tower) with FP8 layers, run as our steps.

transformers' ``SiglipEncoderLayer`` with :class:`~mminfer.models.fp8.Fp8Linear` projections
quantises its input before each of six GEMMs (q, k and v each read and quantise the same
normed rows) and writes every LayerNorm and GELU output in the model dtype first: on the H200
at 1.05M tokens the FP8 tower was no faster than bf16 (8.98 s against 8.76 s, BENCHMARKS.md
"Decode and FP8").
Here a layer is: LayerNorm → fp8 (one kernel, fused with the residual add that ends the layer
before), one q/k/v GEMM (the three layers side by side, :func:`fp8.concat`), SDPA,
``out_proj`` (its input quantised by a pass of its own: SDPA writes the model dtype), the
residual add + LayerNorm → fp8, ``fc1``, GELU(tanh) → fp8, ``fc2``. The arithmetic is the
layers' own: the same e4m3 weights, scales and per-token activation scales, LayerNorm and
GELU in fp32 rounded to the model dtype as torch rounds them.

Used when every encoder layer's projections are FP8 and the layer is the plain SigLIP one
(:func:`fusable`); otherwise the tower runs transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mminfer.kernels import fp8_quant
from mminfer.models import fp8


def fusable(encoder) -> bool:
    """Every layer of ``encoder`` (a transformers ``SiglipEncoder``) has FP8 q/k/v/out and
    fc1/fc2, LayerNorms, and the tanh GELU."""
    layers = getattr(encoder, "layers", None)
    if not layers:
        return False
    for layer in layers:
        a, m = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or m is None:
            return False
        if not fp8.is_fp8(*(getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj",
                                                           "out_proj")),
                          getattr(m, "fc1", None), getattr(m, "fc2", None)):
            return False
        if not all(isinstance(getattr(layer, n, None), nn.LayerNorm)
                   for n in ("layer_norm1", "layer_norm2")):
            return False
        act = getattr(m, "activation_fn", None)
        if type(act).__name__ not in ("PytorchGELUTanh", "GELUTanh") and \
                getattr(act, "approximate", None) != "tanh":
            return False
    return True


class Fp8Encoder:
    """``encoder(inputs_embeds=h).last_hidden_state`` for a :func:`fusable` SigLIP encoder,
    layer by layer as above. Holds each layer's concatenated q/k/v layer (made once; the
    encoder's own modules are left as they are)."""

    def __init__(self, encoder):
        if not fusable(encoder):
            raise ValueError("not a SigLIP encoder with FP8 layers throughout")
        self.encoder = encoder
        self.qkv = [fp8.concat(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
                    for l in encoder.layers]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """``h [f, N, C]`` (the embeddings' output; overwritten) → the last layer's output."""
        layers = self.encoder.layers
        f, N, C = h.shape
        x = h.reshape(f * N, C)
        if not x.is_contiguous():
            x = x.contiguous()
        kern = layers[0].self_attn.q_proj.kernels
        ln = layers[0].layer_norm1
        x, xq = fp8_quant.layer_norm_quant(x, ln.weight, ln.bias, ln.eps, kernels=kern)
        for i, layer in enumerate(layers):
            a = layer.self_attn
            heads, d = a.num_heads, a.head_dim
            qkv = self.qkv[i](xq).view(f, N, 3, heads, d)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))          # [f, H, N, d]
            o = F.scaled_dot_product_attention(q, k, v, scale=a.scale)
            o = a.out_proj(o.transpose(1, 2).reshape(f * N, C))
            del q, k, v, qkv
            ln = layer.layer_norm2
            x, xq = fp8_quant.layer_norm_quant(x, ln.weight, ln.bias, ln.eps, o, kernels=kern)
            m = layer.mlp.fc2(fp8_quant.gelu_tanh_quant(layer.mlp.fc1(xq), kernels=kern))
            del o
            if i + 1 < len(layers):    # the residual add fused into the next layer's norm
                ln = layers[i + 1].layer_norm1
                x, xq = fp8_quant.layer_norm_quant(x, ln.weight, ln.bias, ln.eps, m, kernels=kern)
            else:
                x = x + m
        return x.view(f, N, C)
