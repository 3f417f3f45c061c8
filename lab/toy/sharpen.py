"""A training term that makes the embedded model's attention sparse-friendly (issue 14).

Sparse prefill computes, per head, a small share of the attention tiles; it is exact where
a head's mass sits in those tiles and loses what the head spreads elsewhere. A real VLM's
heads are sharp (sinks, local windows, frame columns); a 5.6M-parameter model trained only
on answers is not: counting and ordering can be solved by averaging over the whole video,
and calibration found 8-14 of its 16 heads covering under 60 % of their mass at 20 %
density (lab/NOTES.md §4). Even the best choice of tiles leaves mass out: on 4K-token synth
videos the shipped model's 64-row blocks keep 70-80 % of their mass in their top 10 % of
64-key blocks (``lab/experiments/tail_mass.py``). So training adds, with weight λ, the **tail
mass**: for sampled blocks of query rows, the attention mass outside the block's top
``rho`` share of key blocks (causal keys only), averaged over blocks, heads and layers.
A block whose mass sits in 10 % of its key tiles costs nothing, a uniform one 1 - rho.
The forward pass itself is untouched (SDPA); the term reads the rotated q and k that
transformers hands the attention function.

Measured (lab/NOTES.md §4, ft8s): the term does cut the tail mass (0.33 -> 0.05 at 8K), but
the sharper heads attend to content landmarks that online estimation misses more often, and
the sparse answers' last-token KL at density 0.2 rose 3.5-4x against the unsharpened model.
So it is off by default (``--sharpen 0``); it is worth turning on together with an estimator
that finds those landmarks.

Row blocks: those covering the last ``n_last`` queries (what online estimation reads, and
the answer's context) plus ``n_random`` drawn from the rest past ``min_pos`` (every row is
computed by the sparse kernels, so every row's spread matters). Cost per layer:
B x H x rows x L logits in fp32, small next to the dense prefill at training lengths.

    sharp = Sharpener(rho=0.1, n_random=3, n_last=64, row_block=64, key_block=64)
    model.model.language_model.config._attn_implementation = sharp.register()
    with sharp.collect(seq_len=L) as tail:     # tail: list, one [B, H, blocks] per layer
        h = model.model.language_model(inputs_embeds=x, ...)
    loss = task_loss + lam * torch.stack([t.mean() for t in tail]).mean()
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_NAME = "mminfer_sharpen"   # no "flash" in it: transformers would treat it as FlashAttention


def tail_mass(query, key, starts, rho: float, scaling: float, row_block: int = 1,
              key_block: int = 1):
    """Attention mass outside the top ``rho`` share of causal key blocks, per sampled block
    of query rows. A row block is ``row_block`` consecutive rows from each of ``starts``
    (their attention rows averaged: what one tile row of the kernels shares); keys are
    counted in blocks of ``key_block`` (the kernels' tiles), of which the block's last row
    sees ``n``; the top ``ceil(rho * n)`` key blocks by mass are kept. With both blocks 1
    this is the per-row tail: mass outside the row's top ``ceil(rho * (row + 1))`` keys.

    query ``[B, H, L, D]``, key ``[B, Hkv, L, D]`` (GQA by index: query head h reads key
    head ``h // (H // Hkv)``), starts a LongTensor with ``start + row_block <= L``.
    Returns ``[B, H, len(starts)]`` in fp32, differentiable in query and key."""
    B, H, L, D = query.shape
    Hkv = key.shape[1]
    g = H // Hkv
    S = len(starts)
    rows = (starts[:, None] + torch.arange(row_block, device=starts.device)).reshape(-1)
    q = query[:, :, rows].float().view(B, Hkv, g, S * row_block, D)
    k = key.float()[:, :, None]                                   # [B, Hkv, 1, L, D]
    logits = (q @ k.transpose(-1, -2)) * scaling                  # [B, Hkv, g, S*rb, L]
    pos = torch.arange(L, device=query.device)
    causal = pos[None, :] <= rows[:, None]
    p = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    p = p.view(B, H, S, row_block, L).mean(3)                     # [B, H, S, L]
    nkb = -(-L // key_block)
    if key_block > 1:
        p = torch.nn.functional.pad(p, (0, nkb * key_block - L)).view(B, H, S, nkb,
                                                                      key_block).sum(-1)
    top = torch.sort(p, dim=-1, descending=True).values.cumsum(-1)
    last = starts + row_block - 1
    n_vis = torch.div(last, key_block, rounding_mode="floor") + 1
    k_idx = torch.ceil(rho * n_vis.float()).long().clamp(min=1) - 1
    kept = top.gather(-1, k_idx.to(p.device).view(1, 1, -1, 1).expand(B, H, -1, 1))
    return (1.0 - kept.squeeze(-1)).clamp(min=0.0)


def sample_starts(seq_len: int, n_random: int, n_last: int, min_pos: int, row_block: int = 1,
                  generator=None, device=None):
    """Starts of row blocks of ``row_block`` rows: the blocks covering the last ``n_last``
    rows (a multiple of ``row_block``) and ``n_random`` distinct others starting in
    [min_pos, L - n_last - row_block], sorted; fewer where the sequence is short (none when
    it does not reach past ``min_pos + n_last``)."""
    last0 = max(min_pos, seq_len - n_last)
    starts = torch.arange(last0, max(last0, seq_len - row_block + 1), row_block)
    span = last0 - row_block + 1 - min_pos
    if span > 0 and n_random > 0:
        pick = torch.randperm(span, generator=generator)[:n_random] + min_pos
        starts = torch.cat([pick, starts])
    return torch.sort(starts).values.to(device)


class Sharpener:
    """Collects the tail mass of every layer of one forward pass (see the module text)."""

    def __init__(self, rho: float = 0.1, n_random: int = 3, n_last: int = 64,
                 min_pos: int = 256, row_block: int = 64, key_block: int = 64, seed: int = 0):
        if not 0.0 < rho < 1.0:
            raise ValueError(f"rho must be in (0, 1), not {rho}")
        if row_block < 1 or key_block < 1 or n_last % row_block:
            raise ValueError(f"blocks must be >= 1 and n_last ({n_last}) a multiple of "
                             f"row_block ({row_block})")
        self.rho, self.n_random, self.n_last, self.min_pos = rho, n_random, n_last, min_pos
        self.row_block, self.key_block = row_block, key_block
        self.generator = torch.Generator().manual_seed(seed)
        self._rows = None
        self._out: list | None = None

    def register(self) -> str:
        """Register the attention function (SDPA plus the collection) and its mask (SDPA's)
        with transformers; returns the name to set as ``_attn_implementation``."""
        AttentionInterface.register(ATTN_NAME, self.attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        return ATTN_NAME

    @contextmanager
    def collect(self, seq_len: int, device=None):
        """Inside: every whole-sequence attention call appends its ``[B, H, rows]`` tail
        mass to the yielded list. Sequences too short to have rows past ``min_pos`` yield an
        empty list."""
        rows = sample_starts(seq_len, self.n_random, self.n_last, self.min_pos,
                             self.row_block, self.generator, device)
        self._rows = rows if len(rows) else None
        self._out = []
        try:
            yield self._out
        finally:
            self._rows, self._out = None, None

    def attention_forward(self, module, query, key, value, attention_mask, scaling=None,
                          dropout=0.0, **kwargs):
        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     scaling=scaling, dropout=dropout, **kwargs)
        if self._rows is not None and query.shape[2] == key.shape[2]:
            scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
            self._out.append(tail_mass(query, key, self._rows.to(query.device), self.rho,
                                       scale, self.row_block, self.key_block))
        return out
