"""Permuted block-sparse attention kernels (Triton), their plans, masks and references.

``specs`` (what to compute) -> ``plan`` (compiled for the kernel, rows as ``layout`` says) ->
``launch`` (the kernel); ``masks`` is the oracle written from the specs, ``density`` counts a
plan's work from its arrays, ``runtime`` says where kernels run.
"""

from .specs import AShape, Block, Fallback, Grid, VerticalSlash, dense
from .layout import row_table
from .plan import SparsePlan
from .launch import count_plan, sparse_attention
from .masks import spec_masks
from .proxy import proxy_stats
from .reference import masked_attention

__all__ = ["AShape", "Block", "Fallback", "Grid", "SparsePlan", "VerticalSlash", "dense",
           "row_table", "count_plan", "sparse_attention", "spec_masks", "masked_attention",
           "proxy_stats"]
