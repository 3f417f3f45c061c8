"""Where the kernels run: the Triton interpreter switch and the tile shapes per device kind.

Read at call time, not at import: ``TRITON_INTERPRET`` has to be set before triton is
imported, but whether it was set is asked here, by every caller, the same way.
"""

from __future__ import annotations

import os

# Tile shapes per device kind. The block_m of a plan is semantic (it defines the near range);
# BLOCK_N, warps and stages are free (except for the block family, whose key block is the
# plan's block_n). Hopper values come from benchmarks/kernels.py --tune, see BENCHMARKS.md.
GPU_CONFIG = {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
CPU_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


def interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compiled_gpu(is_cuda: bool) -> bool:
    """True when a kernel on a tensor of this device kind is compiled for the GPU."""
    return is_cuda and not interpreted()


def tile_config(is_cuda: bool, block_m: int, block_n: int, config=None) -> dict:
    """Launch configuration of the attention kernel for a plan with these blocks:
    ``BLOCK_N`` never exceeds the plan's row block or key block."""
    cfg = dict(GPU_CONFIG if compiled_gpu(is_cuda) else CPU_CONFIG)
    cfg.update(config or {})
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], block_m, block_n)
    cfg.setdefault("FAST", True)
    return cfg


def to_device(t, device):
    """A host tensor on ``device`` without waiting for the device: a plain ``.to(cuda)``
    from pageable memory synchronises the stream, which stalls the host behind every kernel
    queued before it (15 such waits per layer made estimation host-bound). Pinned memory
    from torch's caching host allocator is held until the copy has run."""
    import torch
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def as_device(values, device, dtype=None):
    """A short list of host numbers as a device tensor (``to_device``; never in place)."""
    import torch
    return to_device(torch.tensor(list(values), dtype=dtype), device)


def batch_stride(t, dim: int = 0) -> int:
    """``t.stride(dim)`` for a batch dimension, 0 when it has one entry (the kernels never
    step along it then). Triton compiles a separate kernel for an int argument past 2**31,
    and a batch stride gets there first (28 heads x 128 x N at N > 600K): at 1M tokens the
    first request compiled new variants of every kernel inside its index and attention
    stages. A stride that is always 0 keeps one variant for every length."""
    return 0 if t.shape[dim] == 1 else t.stride(dim)
