"""The online softmax over key tiles, shared by the attention kernels (the sparse kernel's
tiles, the FP8 cache's flash-decoding): per tile, :func:`weights` then the values' load, then
:func:`accumulate` (the values are loaded between the two, where the kernels were tuned with
them); and :func:`fold`, one key range's partial into the merge of several (flash-decoding's
second launch).

Base 2: the logits come scaled by ``scale * log2(e)``. Rows that have seen no valid key yet
keep a running max of -inf, and their tile is taken against 0 instead, so they add nothing
(``exp2(-inf) = 0``) and never compute ``-inf - -inf``.
"""

import triton
import triton.language as tl


@triton.jit
def weights(qk, m_i, l_i):
    """One tile's logits ``qk`` ``[M, N]`` (fp32, -inf where a pair is masked) against the
    running max ``m_i`` and sum ``l_i`` ``[M]``: ``(p, alpha, m_new, l_new)``, the tile's
    unnormalised weights and the factor that rescales what was summed before."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def accumulate(acc, alpha, p, v, PRECISION: tl.constexpr):
    """``acc`` ``[M, D]`` rescaled by ``alpha`` plus the tile's ``p @ v`` (``p`` in v's
    dtype; ``PRECISION``: tl.dot's input precision)."""
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def fold(m, w_sum, acc, lse, o):
    """One more partial (``o`` ``[M, D]`` normalised, its base-2 ``lse`` ``[M]``; -inf: no
    key seen) into the running merge ``(m, w_sum, acc)``; returns the new three. The merged
    output is ``acc / w_sum`` (0 where no partial saw a key)."""
    m_new = tl.maximum(m, lse)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_use)
    w = tl.math.exp2(lse - m_use)
    return m_new, w_sum * alpha + w, acc * alpha[:, None] + o * w[:, None]
