"""Permuted block-sparse attention kernels (Triton), their plans, masks and references.

``specs`` (what to compute) -> ``plan`` (compiled for the kernel, rows as ``layout`` says) ->
``launch`` (the kernel); ``masks`` is the oracle written from the specs, ``density`` counts a
plan's work from its arrays, ``runtime`` says where kernels run.

Names are imported on first use, so ``mminfer.kernels.runtime`` (or ``specs``) loads without
triton.
"""

import importlib

_WHERE = {"AShape": "specs", "Block": "specs", "Fallback": "specs", "Grid": "specs",
          "VerticalSlash": "specs", "dense": "specs", "row_table": "layout",
          "SparsePlan": "plan", "count_plan": "launch", "sparse_attention": "launch",
          "spec_masks": "masks", "proxy_stats": "proxy", "masked_attention": "reference",
          "plan_attention": "reference"}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
