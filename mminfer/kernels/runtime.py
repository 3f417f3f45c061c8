"""Where the kernels run: the Triton interpreter switch and the tile shapes per device kind.

Read at call time, not at import: ``TRITON_INTERPRET`` has to be set before triton is
imported, but whether it was set is asked here, by every caller, the same way.
"""

from __future__ import annotations

import os

import torch

# Tile shapes of the attention kernel per device kind and pattern family. The block_m of a
# plan is semantic (it defines the near range); BLOCK_N, warps and stages are free, except
# that a block-family tile must divide the plan's key block (block_n). Hopper: each family's
# fastest launch of one H200 run (128K tokens, density 0.1, bf16, 28/4 heads, d 128: 1.03-1.07x
# faster than 64-key tiles with 3 stages, and 0.970x the attention stage's time through the
# product's prefill at 131K; lab/NOTES.md, "Kernel variants and the query-set estimator" and
# "The fastest variants side by side"): 128-key tiles (up to the row block;
# the block family's up to its key block), 3 pipeline stages, 2 for the block family, whose
# full tiles are read through TMA descriptors. The interpreter runs the same kernel code
# with 16-key tiles.
GPU_CONFIG = {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
GPU_FAMILY = {"block": {"num_stages": 2}}
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compiled_gpu(is_cuda: bool) -> bool:
    """True when a kernel on a tensor of this device kind is compiled for the GPU."""
    return is_cuda and not interpreted()


# How a caller picks between a Triton kernel and its torch version.
KERNELS = ("auto", "triton", "torch")


def use_triton(x: torch.Tensor, choice: str = "auto") -> bool:
    """Triton for a CUDA tensor with the kernels compiled ("auto"), or whenever asked
    ("triton": on the CPU only under the interpreter); torch ops otherwise."""
    if choice not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, not {choice!r}")
    if choice == "torch":
        return False
    if choice == "triton":
        if not (x.is_cuda or interpreted() or x.device.type == "meta"):
            raise RuntimeError("Triton kernels on the CPU need TRITON_INTERPRET=1")
        return True
    return compiled_gpu(x.is_cuda)


def dot_precision(dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: fp32 products in full
    ("ieee": what the fp32 references compute); any other dtype "tf32", Triton's default,
    which only fp32 operands would feel."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_config(is_cuda: bool, family: str, block_m: int, block_n: int, config=None) -> dict:
    """Launch configuration of the attention kernel for one family's launch of a plan with
    these blocks: ``BLOCK_N``, ``num_warps``, ``num_stages`` (``config`` overrides, e.g. a
    tile sweep). ``BLOCK_N`` never exceeds the row block, nor, for the block family, the
    key block."""
    gpu = compiled_gpu(is_cuda)
    cfg = dict(GPU_CONFIG if gpu else CPU_CONFIG)
    if gpu:
        cfg.update(GPU_FAMILY.get(family, {}))
    cfg.update(config or {})
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_m, block_n if family == "block" else block_m)
    return cfg


def to_device(t, device):
    """A host tensor on ``device`` without waiting for the device: a plain ``.to(cuda)``
    from pageable memory synchronises the stream, which stalls the host behind every kernel
    queued before it (15 such waits per layer made estimation host-bound). Pinned memory
    from torch's caching host allocator is held until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_device(values, device, dtype=None):
    """A short list of host numbers as a device tensor (``to_device``; never in place)."""
    return to_device(torch.tensor(list(values), dtype=dtype), device)


def batch_stride(t, dim: int = 0) -> int:
    """``t.stride(dim)`` for a batch dimension, 0 when it has one entry (the kernels never
    step along it then). Triton compiles a separate kernel for an int argument past 2**31,
    and a batch stride gets there first (28 heads x 128 x N at N > 600K): at 1M tokens the
    first request compiled new variants of every kernel inside its index and attention
    stages. A stride that is always 0 keeps one variant for every length."""
    return 0 if t.shape[dim] == 1 else t.stride(dim)
