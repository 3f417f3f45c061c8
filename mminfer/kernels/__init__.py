"""Permuted block-sparse attention kernels (Triton), their plans and pure-torch references."""

from .plan import AShape, Block, Grid, SparsePlan, VerticalSlash, dense, row_table
from .launch import count_plan, sparse_attention
from .proxy import proxy_stats
from .reference import masked_attention

__all__ = ["AShape", "Block", "Grid", "SparsePlan", "VerticalSlash", "dense", "row_table",
           "count_plan", "sparse_attention", "masked_attention", "proxy_stats"]
