"""The Qwen2.5-VL vision tower's window attention in one kernel, rotary embedding included.

A window layer of the tower attends inside windows of 64 patch tokens (8x8 patches, 4x4
merged units on the 7B), non-causally, 16 heads of 80. Per window and head that is a
64x64 score tile: the FLOPs are nothing (21 GFLOP a layer at a 22-pair chunk) and the layer
is memory-bound. As two passes — the rotary kernel rewriting q and k inside the qkv GEMM's
output (0.57 ms a layer at a 22-pair chunk on the H200), then cuDNN's SDPA over
``[P * windows, heads, 64, 80]`` (~0.5 ms) — it costs about eight times the ~0.14 ms it takes to
read q, k, v and write o once at the H200's bandwidth.

Here one program takes one window (up to ``MAX_WINDOW`` tokens) and every head in turn: it
reads q, k and v straight from the qkv GEMM's output, loads the window's rotary angles once
(for q, k and every head), rotates q and k in registers (fp32, rounded to the input dtype, as
transformers' ``apply_rotary_pos_emb_vision`` rounds them), takes the softmax in fp32 and
writes o in ``[tokens, heads * head_dim]``, what the output projection reads. The head dim is
handled as its two rotary halves (40 + 40 on the 7B, each padded to a 16-multiple tile).
Measured on the H200 at a 22-pair chunk (lab/experiments/window_attention.py; lab/NOTES.md,
"The vision tower's window layers"): 0.579 ms a window layer as the two passes, 0.357 ms with
one program per head, 0.318 ms like this.

Windows of one shape are contiguous runs of the tower order (mminfer.models.vision), so a
launch covers a ``(first token, windows, tokens per window)`` group of every pair of a chunk.
Longer runs (the full layers' 2880-token pairs) stay on the rotary kernel + cuDNN's flash
attention: a flash-style version of this kernel took 12.7-37 ms there against 2.67 ms.

Checked against transformers' arithmetic in fp32 on the CPU interpreter and in bf16 on the
GPU (tests/kernels/test_window_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import dot_precision
from .vision_elementwise import rotary_angles, rotary_halves, rotate_halves

LOG2E = 1.4426950408889634
# Windows up to this many tokens run here (the 7B's are 64), longer runs through the rotary
# kernel + SDPA; one program holds a window's rows, so this is also its tile height.
MAX_WINDOW = 64
WARPS = 4


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, PRECISION: tl.constexpr):
    """q kᵀ over the two halves of the head dim, fp32."""
    qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)
    return tl.dot(q_hi, tl.trans(k_hi), qk, input_precision=PRECISION)


@triton.jit
def _head(QKV, tok0, rows, rmask, f, c, s, h, stride_t, qk_scale, H: tl.constexpr,
          HEAD_D: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr,
          BLOCK_F: tl.constexpr, PRECISION: tl.constexpr):
    """Head ``h`` of one window (rows ``tok0 + rows``, angles ``c``/``s``): its output's two
    halves, fp32, normalised."""
    DT = QKV.dtype.element_ty
    row_at = QKV + (tok0 + rows) * stride_t
    lo, hi = rotary_halves(row_at + h * HEAD_D, rmask, f, HALF)
    q_lo, q_hi = rotate_halves(lo, hi, c, s, DT)
    lo, hi = rotary_halves(row_at + (H + h) * HEAD_D, rmask, f, HALF)
    k_lo, k_hi = rotate_halves(lo, hi, c, s, DT)
    qk = tl.where(rmask[None, :], _scores(q_lo, q_hi, k_lo, k_hi, PRECISION) * qk_scale,
                  float("-inf"))
    p = tl.math.exp2(qk - tl.max(qk, 1)[:, None])
    inv = 1.0 / tl.sum(p, 1)
    p = p.to(DT)
    m2 = rmask[:, None] & (f < HALF)[None, :]
    v_at = row_at[:, None] + (2 * H + h) * HEAD_D + f[None, :]
    zero = tl.zeros([BLOCK_L, BLOCK_F], tl.float32)
    v_lo = tl.load(v_at, mask=m2, other=0.0)
    o_lo = tl.dot(p, v_lo, zero, input_precision=PRECISION) * inv[:, None]
    v_hi = tl.load(v_at + HALF, mask=m2, other=0.0)
    o_hi = tl.dot(p, v_hi, zero, input_precision=PRECISION) * inv[:, None]
    return o_lo, o_hi


@triton.jit
def _window_kernel(QKV, COS, SIN, O, stride_t, stride_o, S, start, n_win, L, qk_scale,
                   H: tl.constexpr, HEAD_D: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr, PRECISION: tl.constexpr):
    # one program per window (up to BLOCK_L tokens), every head in turn: the window's angles
    # are loaded once for all heads, q and k. HALF and HEAD_D are constants: with them known
    # (40, 80 on the 7B: 16-byte multiples) a half-row loads as vectors, not element by element
    win = tl.program_id(0)
    pos0 = start + (win % n_win) * L                  # the window's first position in its pair
    tok0 = (win // n_win).to(tl.int64) * S + pos0     # ... and its first row of the chunk
    f = tl.arange(0, BLOCK_F)
    rows = tl.arange(0, BLOCK_L)
    rmask = rows < L
    m2 = rmask[:, None] & (f < HALF)[None, :]
    c, s = rotary_angles(COS, SIN, pos0 + rows, rmask, f, HALF)
    o_at = O + (tok0 + rows)[:, None] * stride_o + f[None, :]
    for h in range(H):
        o_lo, o_hi = _head(QKV, tok0, rows, rmask, f, c, s, h, stride_t, qk_scale, H, HEAD_D,
                           HALF, BLOCK_L, BLOCK_F, PRECISION)
        tl.store(o_at + h * HEAD_D, o_lo.to(O.dtype.element_ty), mask=m2)
        tl.store(o_at + h * HEAD_D + HALF, o_hi.to(O.dtype.element_ty), mask=m2)


def applies(qkv: torch.Tensor, groups) -> bool:
    """Whether the tower runs a layer with these ``groups`` here: windows up to
    ``MAX_WINDOW`` tokens, in fp16/bf16 on a GPU (an fp32 tower there, a reference, keeps
    rotary + SDPA: fp32 tiles do not fit shared memory) or any dtype under the interpreter."""
    if max(L for _, _, L in groups) > MAX_WINDOW:
        return False
    return not (qkv.is_cuda and qkv.dtype == torch.float32)


def window_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups, S: int,
                     heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """Non-causal attention inside the windows ``groups`` (``(first token, windows, tokens
    per window)`` of each S-token pair) of ``qkv [P*S, 3*heads*head_dim]`` (q, k, v of
    each token; q and k *not yet rotated*), with token i of a pair at rotary position i:
    ``cos``/``sin`` ``[S, head_dim/2]`` fp32. Returns ``o [P*S, heads*head_dim]`` in qkv's
    dtype; tokens outside every group are left unwritten. A torch custom op, so meta
    tensors (``benchmarks/vision.py --ops``) and ``torch.compile`` see one op."""
    N, W = qkv.shape
    if head_dim % 2 or W != 3 * heads * head_dim or N % S or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} (stride {qkv.stride()}) is not "
                         f"[P*{S}, 3*{heads}*{head_dim}] with contiguous rows")
    half = head_dim // 2
    if tuple(cos.shape) != (S, half) or tuple(sin.shape) != (S, half):
        raise ValueError(f"cos/sin must be [{S}, {half}], got {tuple(cos.shape)}")
    for start, n, L in groups:
        if start < 0 or n < 0 or L < 1 or start + n * L > S:
            raise ValueError(f"group ({start}, {n}, {L}) is not inside a pair of {S} tokens")
        if L > MAX_WINDOW:
            raise ValueError(f"windows of {L} tokens: this kernel takes up to {MAX_WINDOW}")
    flat = [int(v) for g in groups for v in g]
    return _window_attention_op(qkv, cos.contiguous(), sin.contiguous(), flat, S, heads,
                                head_dim, float(scale))


@torch.library.custom_op("mminfer::vision_window_attention", mutates_args=())
def _window_attention_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         groups: list[int], S: int, heads: int, head_dim: int,
                         scale: float) -> torch.Tensor:
    N = qkv.shape[0]
    P, half = N // S, head_dim // 2
    out = qkv.new_empty(N, heads * head_dim)
    BF = max(16, triton.next_power_of_2(half))
    for i in range(0, len(groups), 3):
        start, n, L = groups[i:i + 3]
        if P * n:
            _window_kernel[(P * n,)](
                qkv, cos, sin, out, qkv.stride(0), out.stride(0), S, start, n, L,
                scale * LOG2E, H=heads, HEAD_D=head_dim, HALF=half,
                BLOCK_L=max(16, triton.next_power_of_2(L)), BLOCK_F=BF,
                PRECISION=dot_precision(qkv.dtype),
                num_warps=WARPS)
    return out


@_window_attention_op.register_fake
def _(qkv, cos, sin, groups, S, heads, head_dim, scale):
    return qkv.new_empty(qkv.shape[0], heads * head_dim)
