"""FP8 linear layers (``quantization="fp8"``): e4m3 weights with one fp32 scale per output
channel, activations quantised per token at run time, one scaled GEMM.

A weight ``W [out, in]`` is stored as ``Wq = round_e4m3(W / s_w)`` with ``s_w[o] =
amax(|W[o, :]|) / 448``; an activation row as ``round_e4m3(x / s_x)`` with ``s_x`` its own
``amax / 448`` (mminfer.kernels.fp8_quant); ``y = (xq · Wqᵀ) * s_x * s_wᵀ + b``
(mminfer.kernels.fp8_gemm). This is the layout of the published "FP8-Dynamic" checkpoints
(compressed-tensors: channel-wise weight scales, token-wise dynamic input scales), which
:func:`load_scales` reads.

Here: :class:`Fp8Linear`, which takes a plain activation (quantised by the standalone pass) or
one a producing kernel quantised already; :func:`normed` and :func:`mlp`, the model's steps
through those producing kernels; converting a model's layers; reading an FP8 checkpoint's
config and scales.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from mminfer.errors import ConfigError
from mminfer.kernels.fp8_gemm import ALIGN, fp8_gemm
from mminfer.kernels.fp8_quant import (FP8, Fp8Act, quantize_rows, quantize_weight,
                                       rms_norm_quant, silu_mul_quant)

QUANTIZATIONS = (None, "fp8")


# ---------------------------------------------------------------------- the layer
def concat(*layers: "Fp8Linear") -> "Fp8Linear":
    """One FP8 layer whose output is the given layers' outputs side by side (e.g. q, k, v:
    one GEMM instead of three, the input read once); the layers are left as they are."""
    w = torch.cat([m.weight.view(torch.uint8) for m in layers]).view(FP8)
    s = torch.cat([m.weight_scale for m in layers])
    biases = [m.bias for m in layers]
    if all(b is None for b in biases):
        b = None
    else:
        ref = next(b for b in biases if b is not None)
        b = torch.cat([bb.detach() if bb is not None else ref.new_zeros(m.out_features)
                       for bb, m in zip(biases, layers)])
    return Fp8Linear(w, s, b, kernels=layers[0].kernels)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an e4m3 weight and per-output-channel scales. ``forward`` takes a
    plain activation (quantised here, per row) or an :class:`Fp8Act` (used as it is)."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias=None, *,
                 kernels: str = "auto"):
        super().__init__()
        if weight_fp8.dtype != FP8 or weight_fp8.dim() != 2:
            raise ValueError(f"expected an e4m3 [out, in] weight, got {weight_fp8.dtype} "
                             f"{tuple(weight_fp8.shape)}")
        self.out_features, self.in_features = weight_fp8.shape
        ws = weight_scale.detach().float().reshape(-1)
        if ws.numel() == 1:
            ws = ws.expand(self.out_features)
        if ws.numel() != self.out_features:
            raise ValueError(f"{ws.numel()} weight scales for {self.out_features} channels")
        self.register_buffer("weight", weight_fp8.detach().contiguous())
        self.register_buffer("weight_scale", ws.contiguous().to(weight_fp8.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "Fp8Linear":
        q, s = quantize_weight(linear.weight)
        return cls(q, s, linear.bias, **kw)

    def forward(self, x):
        if not isinstance(x, Fp8Act):
            x = quantize_rows(x, kernels=self.kernels)
        if x.data.is_cuda and (self.in_features % ALIGN or self.out_features % ALIGN):
            wq, ws = self.padded()
            return fp8_gemm(x, wq, ws, self.bias, out_features=self.out_features)
        return fp8_gemm(x, self.weight, self.weight_scale, self.bias)

    def padded(self):
        """The weight with zero rows and columns up to multiples of 16 (what ``_scaled_mm``
        takes on CUDA; e.g. the 7B vision MLP's 3420), and its scales; made once."""
        if getattr(self, "_padded", None) is None or self._padded[0].device != self.weight.device:
            N, K = self.weight.shape
            Np, Kp = -(-N // ALIGN) * ALIGN, -(-K // ALIGN) * ALIGN
            w = F.pad(self.weight.view(torch.uint8), (0, Kp - K, 0, Np - N)).view(FP8)
            ws = F.pad(self.weight_scale, (0, Np - N), value=1.0)
            self._padded = (w, ws)
        return self._padded

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8=e4m3 per-channel")


def is_fp8(*modules) -> bool:
    return all(isinstance(m, Fp8Linear) for m in modules)


# ---------------------------------------------------------------------- our engine's steps
def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _rms_like(norm) -> bool:
    return type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "weight")


def normed(norm, x, *consumers):
    """``norm(x)`` for ``consumers`` (the linear layers that read it): quantised by the norm's
    own kernel (an :class:`Fp8Act`) when they are all FP8 and ``norm`` is an RMSNorm, else
    the module's output."""
    if consumers and is_fp8(*consumers) and _rms_like(norm):
        return rms_norm_quant(x, norm.weight, _eps(norm), kernels=consumers[0].kernels)[1]
    return norm(x)


def _silu(mlp) -> bool:
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def mlp(mlp_module, norm, x):
    """``mlp_module(norm(x))``: a gated SiLU MLP of FP8 layers runs as RMSNorm→fp8, the
    gate and up GEMMs, SiLU·up→fp8 and the down GEMM (no separate quantisation pass); any
    other MLP through its module."""
    m = mlp_module
    if not (all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and _silu(m)
            and is_fp8(m.gate_proj, m.up_proj, m.down_proj) and _rms_like(norm)):
        return m(norm(x))
    xq = rms_norm_quant(x, norm.weight, _eps(norm), kernels=m.gate_proj.kernels)[1]
    h = silu_mul_quant(m.gate_proj(xq), m.up_proj(xq), kernels=m.down_proj.kernels)
    return m.down_proj(h)


# ---------------------------------------------------------------------- converting a model
def convert(root: nn.Module, names, *, kernels: str = "auto") -> int:
    """Replace the ``nn.Linear`` submodules of ``root`` whose qualified names match
    ``names`` (a predicate on the name) with :class:`Fp8Linear`; returns how many."""
    todo = [(n, m) for n, m in root.named_modules()
            if type(m) is nn.Linear and names(n)]
    for name, lin in todo:
        parent, _, leaf = name.rpartition(".")
        with torch.no_grad():
            new = Fp8Linear.from_linear(lin, kernels=kernels)
        setattr(root.get_submodule(parent) if parent else root, leaf, new)
    return len(todo)


LLM_LINEARS = re.compile(r"(^|\.)layers\.\d+\."
                         r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")


# Qwen2.5-VL's vision blocks (qkv, proj, the gated MLP; not the patch embedding, not the
# merger) and SigLIP's encoder layers (q/k/v/out, fc1, fc2; not the projector).
VISION_LINEARS = re.compile(r"(^|\.)blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate|up|down)_proj)$"
                            r"|(^|\.)layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])$")


def is_llm_linear(name: str) -> bool:
    """A decoder layer's attention or MLP projection (not lm_head, not embeddings)."""
    return LLM_LINEARS.search(name) is not None


def is_vision_linear(name: str) -> bool:
    """A vision block's attention projection or MLP layer."""
    return VISION_LINEARS.search(name) is not None


# ---------------------------------------------------------------------- FP8 checkpoints
def checkpoint_quantization(config: dict, where: str = "config.json") -> str | None:
    """The quantization a checkpoint's ``config.json`` declares: None (none) or "fp8" (the
    compressed-tensors FP8-Dynamic layout: e4m3 weights with channel-wise (or one
    tensor-wise) scales, per-token dynamic e4m3 activations). Any other layout is a
    ConfigError that names what is not supported."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"{where}: quant_method {method!r} is not supported (mminfer loads "
                          f"compressed-tensors FP8-Dynamic checkpoints only)")
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} is not supported "
                          f"(float-quantized FP8 only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: quantization_config has no config_groups")
    for name, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations")
        want_w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        bad = {k: w.get(k) for k, v in want_w.items() if w.get(k) != v}
        if w.get("strategy") not in ("channel", "tensor"):
            bad["strategy"] = w.get("strategy")
        if bad:
            raise ConfigError(f"{where}: config group {name!r} weights {bad} are not supported "
                              f"(FP8 e4m3, symmetric, static channel-wise scales only)")
        want_a = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        bad = {k: (a or {}).get(k) for k, v in want_a.items() if (a or {}).get(k) != v}
        if bad:
            raise ConfigError(f"{where}: config group {name!r} input_activations {bad} are not "
                              f"supported (FP8 per-token dynamic only)")
    return "fp8"


def load_scales(path, rename=lambda n: n) -> dict:
    """``{module name: weight_scale}`` of every quantised layer in the checkpoint ``path``'s
    safetensors files (``<layer>.weight_scale``), names through ``rename`` (the checkpoint's
    names to the model's modules). Static input scales are a ConfigError."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: an FP8 checkpoint needs its weights in .safetensors files")
    scales = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.endswith(".input_scale"):
                    raise ConfigError(f"{f.name}: {key}: static activation scales are not "
                                      f"supported (per-token dynamic only)")
                if key.endswith(".weight_scale"):
                    scales[rename(key[:-len(".weight_scale")])] = st.get_tensor(key)
    return scales


def apply_scales(model: nn.Module, scales: dict, *, kernels: str = "auto") -> int:
    """Turn each layer named in ``scales`` (its weight loaded as e4m3 values in a wider
    dtype, which holds them exactly) into an :class:`Fp8Linear` with those scales."""
    modules = dict(model.named_modules())
    for name, s in scales.items():
        lin = modules.get(name)
        if type(lin) is not nn.Linear:
            raise ConfigError(f"the checkpoint has an FP8 scale for {name!r}, which is "
                              f"{'not in the model' if lin is None else type(lin).__name__}")
        w = lin.weight.detach()
        wq = w.to(FP8)
        if not torch.equal(wq.to(w.dtype), w):
            raise ConfigError(f"{name}: the weight of a quantised layer holds values e4m3 "
                              f"cannot represent (not an FP8 checkpoint's weight)")
        parent, _, leaf = name.rpartition(".")
        new = Fp8Linear(wq, s.float().to(w.device), lin.bias, kernels=kernels)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(scales)


def read_config(path) -> dict:
    p = Path(path) / "config.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e


def check(quantization) -> str | None:
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
    return quantization
