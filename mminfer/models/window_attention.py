"""The Qwen2.5-VL vision tower's window attention in one kernel, rotary embedding included.

A window layer of the tower attends inside windows of 64 patch tokens (8x8 patches, 4x4
merged units on the 7B), non-causally, 16 heads of 80. Per window and head that is a
64x64 score tile: the FLOPs are nothing (21 GFLOP a layer at a 22-pair chunk) and the layer
is memory-bound. Before this kernel the fused tower ran it as two passes: the rotary kernel
rewriting q and k inside the qkv GEMM's output (0.57 ms a layer at a 22-pair chunk on the
H200) and cuDNN's SDPA over ``[P * windows, heads, 64, 80]`` (~0.5 ms), against ~0.14 ms to
read q, k, v and write o once at the H200's bandwidth.

Here a window's q, k and v are read straight from the qkv GEMM's output, q and k rotated in
registers (fp32, rounded to the input dtype, as transformers' ``apply_rotary_pos_emb_vision``
rounds them), the softmax taken in fp32 and o written in ``[tokens, heads * head_dim]``, what
the output projection reads. The head dim is handled as its two rotary halves (40 + 40 on the
7B, each padded to a 16-multiple tile). Two layouts:

* a window of up to ``HEADS_MAX_L`` tokens is one program over every head in turn (its
  angles loaded once for q, k and every head): 0.357 -> 0.318 ms against one program per
  head on the 7B's window layer (lab/experiments/window_attention.py);
* a longer run (64 < L <= ``MAX_WINDOW``) is one program per head and 64-row block, an
  online softmax over 64-key tiles.

Windows of one shape are contiguous runs of the tower order (mminfer.models.vision), so a
launch covers a ``(first token, windows, tokens per window)`` group of every pair of a chunk;
a full-attention layer is the group ``(0, 1, S)``. ``MAX_WINDOW`` says up to which window
length the product uses this kernel: above it (the full layers' 2880-token pairs) cuDNN's
flash kernel is faster and the tower keeps rotary + SDPA there.

Checked against transformers' arithmetic in fp32 on the CPU interpreter and in bf16 on the
GPU (tests/models/test_window_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The longest window the product runs here (the rest: rotary kernel + SDPA). Measured on the
# H200 at a 22-pair 560x1008 chunk (lab/experiments/window_attention.py).
MAX_WINDOW = 256
# Windows up to this length run every head in one program (_window_heads_kernel), longer
# runs one head per program (measured: lab/experiments/window_attention.py).
HEADS_MAX_L = 64
HEADS_WARPS = 4


@triton.jit
def _halves(base, rows_mask, f, HALF: tl.constexpr):
    """The two rotary halves of each row at ``base`` (pointers to each row's head), fp32."""
    m = rows_mask[:, None] & (f < HALF)[None, :]
    lo = tl.load(base[:, None] + f[None, :], mask=m, other=0.0).to(tl.float32)
    hi = tl.load(base[:, None] + HALF + f[None, :], mask=m, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _angles(COS, SIN, pos, rows_mask, f, HALF: tl.constexpr):
    m = rows_mask[:, None] & (f < HALF)[None, :]
    at = pos[:, None] * HALF + f[None, :]
    return tl.load(COS + at, mask=m, other=0.0), tl.load(SIN + at, mask=m, other=0.0)


@triton.jit
def _rotate(lo, hi, c, s, DT: tl.constexpr):
    """Rotary halves in fp32, rounded to DT, as transformers rounds q and k."""
    return (lo * c - hi * s).to(DT), (hi * c + lo * s).to(DT)


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, IEEE: tl.constexpr):
    """q kᵀ over the two halves of the head dim, fp32."""
    if IEEE:
        qk = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
        return tl.dot(q_hi, tl.trans(k_hi), qk, input_precision="ieee")
    return tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))


@triton.jit
def _pv(p, v, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(p, v, acc, input_precision="ieee")
    return tl.dot(p, v, acc)


@triton.jit
def _window_attention_kernel(QKV, COS, SIN, O, stride_t, stride_o, S, start, n_win, L,
                             m_blocks, qk_scale, H: tl.constexpr, HEAD_D: tl.constexpr,
                             HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_F: tl.constexpr, ONE_TILE: tl.constexpr,
                             IEEE: tl.constexpr):
    # HALF and HEAD_D are constants: with them known (40, 80 on the 7B: 16-byte multiples) the
    # loads of each half-row are vector loads, not element by element
    # heads vary fastest: the programs of one window run together and share its rows in L2
    h = tl.program_id(0)
    pid = tl.program_id(1)
    win = pid // m_blocks
    mb = pid % m_blocks
    pos0 = start + (win % n_win) * L                  # the window's first position in its pair
    tok0 = (win // n_win).to(tl.int64) * S + pos0     # ... and its first row of the chunk
    DT = QKV.dtype.element_ty
    f = tl.arange(0, BLOCK_F)
    fmask = f < HALF
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < L
    c, s = _angles(COS, SIN, pos0 + rows, rmask, f, HALF)
    lo, hi = _halves(QKV + (tok0 + rows) * stride_t + h * HEAD_D, rmask, f, HALF)
    q_lo, q_hi = _rotate(lo, hi, c, s, DT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_F], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        kmask = keys < L
        row_at = (tok0 + keys) * stride_t
        if ONE_TILE:                   # a window in one tile: the keys are the rows
            ck, sk = c, s
        else:
            ck, sk = _angles(COS, SIN, pos0 + keys, kmask, f, HALF)
        lo, hi = _halves(QKV + row_at + (H + h) * HEAD_D, kmask, f, HALF)
        k_lo, k_hi = _rotate(lo, hi, ck, sk, DT)
        qk = _scores(q_lo, q_hi, k_lo, k_hi, IEEE)
        qk = tl.where(kmask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vm = kmask[:, None] & fmask[None, :]
        v_at = QKV + row_at[:, None] + (2 * H + h) * HEAD_D + f[None, :]
        v_lo = tl.load(v_at, mask=vm, other=0.0)
        v_hi = tl.load(v_at + HALF, mask=vm, other=0.0)
        p = p.to(DT)
        acc_lo = _pv(p, v_lo, acc_lo * alpha[:, None], IEEE)
        acc_hi = _pv(p, v_hi, acc_hi * alpha[:, None], IEEE)
        m_i = m_new
    inv = 1.0 / l_i
    om = rmask[:, None] & fmask[None, :]
    o_at = O + (tok0 + rows)[:, None] * stride_o + h * HEAD_D + f[None, :]
    tl.store(o_at, (acc_lo * inv[:, None]).to(O.dtype.element_ty), mask=om)
    tl.store(o_at + HALF, (acc_hi * inv[:, None]).to(O.dtype.element_ty), mask=om)


@triton.jit
def _window_heads_kernel(QKV, COS, SIN, O, stride_t, stride_o, S, start, n_win, L,
                         qk_scale, H: tl.constexpr, HEAD_D: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr, IEEE: tl.constexpr):
    # one program per window (up to BLOCK_L tokens), every head in turn: the window's angles
    # are loaded once for all heads, q and k
    win = tl.program_id(0)
    pos0 = start + (win % n_win) * L
    tok0 = (win // n_win).to(tl.int64) * S + pos0
    DT = QKV.dtype.element_ty
    f = tl.arange(0, BLOCK_F)
    fmask = f < HALF
    rows = tl.arange(0, BLOCK_L)
    rmask = rows < L
    m2 = rmask[:, None] & fmask[None, :]
    c, s = _angles(COS, SIN, pos0 + rows, rmask, f, HALF)
    row_at = QKV + (tok0 + rows)[:, None] * stride_t + f[None, :]
    o_at = O + (tok0 + rows)[:, None] * stride_o + f[None, :]
    for h in range(H):
        lo, hi = _halves(QKV + (tok0 + rows) * stride_t + h * HEAD_D, rmask, f, HALF)
        q_lo, q_hi = _rotate(lo, hi, c, s, DT)
        lo, hi = _halves(QKV + (tok0 + rows) * stride_t + (H + h) * HEAD_D, rmask, f, HALF)
        k_lo, k_hi = _rotate(lo, hi, c, s, DT)
        qk = _scores(q_lo, q_hi, k_lo, k_hi, IEEE)
        qk = tl.where(rmask[None, :], qk * qk_scale, float("-inf"))
        m = tl.max(qk, 1)
        p = tl.math.exp2(qk - m[:, None])
        inv = 1.0 / tl.sum(p, 1)
        v_at = row_at + (2 * H + h) * HEAD_D
        v_lo = tl.load(v_at, mask=m2, other=0.0)
        v_hi = tl.load(v_at + HALF, mask=m2, other=0.0)
        p = p.to(DT)
        zero = tl.zeros([BLOCK_L, BLOCK_F], tl.float32)
        o_lo = _pv(p, v_lo, zero, IEEE) * inv[:, None]
        o_hi = _pv(p, v_hi, zero, IEEE) * inv[:, None]
        tl.store(o_at + h * HEAD_D, o_lo.to(O.dtype.element_ty), mask=m2)
        tl.store(o_at + h * HEAD_D + HALF, o_hi.to(O.dtype.element_ty), mask=m2)


def applies(qkv: torch.Tensor, groups) -> bool:
    """Whether the product runs a layer with these ``groups`` here: windows up to
    ``MAX_WINDOW`` tokens, in fp16/bf16 on a GPU (an fp32 tower there, a reference, keeps
    rotary + SDPA: fp32 tiles do not fit shared memory) or any dtype under the interpreter."""
    if max(L for _, _, L in groups) > MAX_WINDOW:
        return False
    return not (qkv.is_cuda and qkv.dtype == torch.float32)


def tiles(L: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for windows of ``L`` tokens: a window of up to 64
    in one tile; longer runs in 64-row blocks over 64-key tiles."""
    if L <= 64:
        b = max(16, triton.next_power_of_2(L))
        return b, b, 4
    return 64, 64, 4


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
    ieee = qkv.dtype == torch.float32
    for i in range(0, len(groups), 3):
        start, n, L = groups[i:i + 3]
        if P * n == 0:
            continue
        if L <= HEADS_MAX_L:
            _window_heads_kernel[(P * n,)](
                qkv, cos, sin, out, qkv.stride(0), out.stride(0), S, start, n, L,
                scale * LOG2E, H=heads, HEAD_D=head_dim, HALF=half,
                BLOCK_L=max(16, triton.next_power_of_2(L)), BLOCK_F=BF, IEEE=ieee,
                num_warps=HEADS_WARPS)
            continue
        BM, BN, warps = tiles(L)
        mb = triton.cdiv(L, BM)
        _window_attention_kernel[(heads, P * n * mb)](
            qkv, cos, sin, out, qkv.stride(0), out.stride(0), S, start, n, L, mb,
            scale * LOG2E, H=heads, HEAD_D=head_dim, HALF=half, BLOCK_M=BM, BLOCK_N=BN,
            BLOCK_F=BF, ONE_TILE=L <= BM and BM == BN, IEEE=ieee, num_warps=warps)
    return out


@_window_attention_op.register_fake
def _(qkv, cos, sin, groups, S, heads, head_dim, scale):
    return qkv.new_empty(qkv.shape[0], heads * head_dim)


def reference(qkv, cos, sin, groups, S: int, heads: int, head_dim: int, scale: float):
    """The same in PyTorch fp32 from transformers' steps: rotate q and k
    (``t * cos + rotate_half(t) * sin`` in fp32, rounded to qkv's dtype), softmax attention
    per window in fp32. ``[P*S, heads*head_dim]`` in fp32."""
    P = qkv.shape[0] // S
    t = qkv.view(P, S, 3, heads, head_dim)
    emb_c = torch.cat([cos, cos], -1).view(1, S, 1, head_dim).float()
    emb_s = torch.cat([sin, sin], -1).view(1, S, 1, head_dim).float()

    def rot(u):
        f = u.float()
        half = head_dim // 2
        r = torch.cat((-f[..., half:], f[..., :half]), -1)
        return (f * emb_c + r * emb_s).to(u.dtype).float()

    q, k, v = rot(t[:, :, 0]), rot(t[:, :, 1]), t[:, :, 2].float()
    o = torch.zeros(P, S, heads, head_dim)
    o = o.to(qkv.device)
    for start, n, L in groups:
        sl = slice(start, start + n * L)
        qs, ks, vs = (x[:, sl].reshape(P * n, L, heads, head_dim).transpose(1, 2)
                      for x in (q, k, v))
        a = torch.softmax(qs @ ks.transpose(-1, -2) * scale, -1) @ vs
        o[:, sl] = a.transpose(1, 2).reshape(P, n * L, heads, head_dim)
    return o.reshape(P * S, heads * head_dim)
