"""Every Triton kernel of the package, with its launchers and torch versions; first of all
the permuted block-sparse attention kernel, its plans, masks and references.

``specs`` (what to compute) -> ``plan`` (compiled for the kernel, rows as ``layout`` says) ->
``launch`` (the kernel, one launch per pattern family); ``density`` counts a plan's work
from its arrays; ``masks`` evaluates the specs' exact masks a chunk of rows at a time, which
``reference.plan_attention`` runs on a CPU without Triton; ``proxy`` is the estimator's
fused proxy; ``runtime`` says where kernels run and with which tiles; ``online_softmax`` is
the tile step the attention kernels share. For the models: ``fp8_attention`` (decoding over
an FP8 KV cache, and over a video prefix shared by several questions, any dtype),
``fp8_quant`` and ``fp8_gemm`` (FP8 linear layers), ``vision_elementwise`` and
``window_attention`` (the Qwen2.5-VL vision block), ``rope`` (the prefill's RoPE).

Importing the package imports triton (a dependency of the package), and triton chooses
between its interpreter and compiled kernels when each ``@triton.jit`` kernel is defined, i.e.
on this import: set ``TRITON_INTERPRET`` before it, as ``runtime.interpreted`` reads. The
sparse layer, the models and the engine import it at their top, so before importing them too.
"""

from .density import plan_density, sparsity
from .launch import sparse_attention
from .layout import row_table
from .plan import SparsePlan
from .proxy import QuerySet, proxy_sets
from .reference import masked_attention, plan_attention
from .specs import AShape, Block, Fallback, Grid, VerticalSlash, dense

__all__ = ["AShape", "Block", "Fallback", "Grid", "QuerySet", "SparsePlan", "VerticalSlash",
           "dense", "masked_attention", "plan_attention", "plan_density",
           "proxy_sets", "row_table", "sparse_attention", "sparsity"]
