"""A dense re-run of a sparse prefill: what has to be kept of the sparse request, and the run.

The service's shadow monitor (mminfer.serve.shadow) compares what a sparse prefill answered
with what a dense prefill of the same inputs answers. :class:`ShadowInputs` is everything
that comparison needs, and nothing more:

* the prompt embeddings as they entered the prefill: the text embeddings with the vision
  tower's output spliced in, ``[1, L, hidden]`` in the model dtype (L x hidden x 2 bytes in
  bf16: 7 KB a token for a 7B model, 470 MB at 64K tokens). The prefill overwrites them (they
  become its residual stream), so they are copied before it starts;
* the positions of the prompt (M-RoPE ``[3, 1, L]`` int64 for Qwen2.5-VL; None where the
  model counts positions itself) and of the answer tokens that follow;
* the sparse run's last-token logits (float32, one vocabulary row) and its answer tokens.

All of it lives on the CPU, so a kept request holds no GPU memory while other requests run;
from a CUDA model the embeddings are copied into pinned memory without a host wait, on the
stream that runs the prefill (ordered before the prefill overwrites them; the GPU spends
size / PCIe bandwidth on it, about 20 ms for 470 MB). Video frames, pixels, the
ModalityIndex and the KV cache are not kept: a dense prefill needs none of them, and the
cache is rebuilt.

:func:`dense_rerun` runs the prefill engine dense on the kept embeddings and greedy-decodes a
few tokens on the cache it wrote, as ``Adapter.generate`` does. ``cancel`` is checked before
every decoder layer and every decode step; on CUDA each check first waits for the queued work,
so that when it says stop, at most one layer's kernels are still ahead of the next request's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mminfer.errors import Cancelled
from mminfer.models.base import _new_cache
from mminfer.models.hooks import PrefillContext
from mminfer.models.prefill import DEFAULT_CHUNK, prefill


@dataclass
class ShadowInputs:
    embeds: object                     # [1, L, hidden] CPU tensor (model dtype)
    positions: object                  # the prompt's position_ids on the CPU, or None
    tokens: int                        # L
    nbytes: int                        # what embeds and positions hold
    answer_positions: object = None    # positions L .. L+T-1 of the answer tokens, or None
    sparse_logits: object = None       # [vocab] float32 CPU: the sparse prefill's last row
    sparse_tokens: list = field(default_factory=list)   # the sparse answer's tokens (with EOS)
    sparse_text: str = ""
    density: float | None = None       # the sparse prefill's mean density


@dataclass
class DenseRerun:
    logits: object                     # [vocab] float32 CPU: the dense prefill's last row
    token_ids: list                    # greedy tokens after the dense prefill (with EOS)
    text: str
    seconds: float                     # wall time of the re-run


def inputs_nbytes(embeds, positions) -> int:
    n = embeds.numel() * embeds.element_size()
    if positions is not None:
        n += positions.numel() * positions.element_size()
    return n


def keep_inputs(adapter, prepared, embeds, max_bytes: int | None = None) -> ShadowInputs | None:
    """Copy what a dense re-run needs of ``embeds`` (before the prefill overwrites them) and
    of the prompt's positions to the CPU; None when that is more than ``max_bytes``."""
    L = prepared.input_ids.shape[1]
    positions = adapter.positions(prepared, 0, L)
    nbytes = inputs_nbytes(embeds, positions)
    if max_bytes is not None and nbytes > max_bytes:
        return None
    return ShadowInputs(embeds=to_host(embeds), positions=to_host(positions),
                        tokens=L, nbytes=nbytes)


def finish(kept: ShadowInputs, adapter, prepared, generated, density) -> ShadowInputs:
    """Add the sparse run's outputs, once it has answered."""
    kept.sparse_logits = generated.prefill_logits.detach().float().cpu()
    kept.sparse_tokens = list(generated.token_ids)
    kept.sparse_text = generated.text
    kept.density = density
    steps = len(generated.token_ids)
    kept.answer_positions = to_host(adapter.positions(prepared, kept.tokens, steps))
    return kept


def to_host(t):
    """``t`` on the host (pinned, copied without blocking, from a GPU), or None."""
    if t is None:
        return None
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.detach().clone()


def dense_rerun(adapter, kept: ShadowInputs, *, max_new_tokens: int = 8,
                cancel=None) -> DenseRerun:
    """The dense prefill of ``kept``'s prompt and up to ``max_new_tokens`` greedy tokens
    (at least the first; never more than the sparse answer had, the comparison's length).
    Raises :class:`mminfer.errors.Cancelled` when ``cancel()`` says stop."""

    t0 = time.perf_counter()
    device = adapter.device
    cuda = getattr(device, "type", str(device)) == "cuda"

    def stop() -> bool:
        if cancel is None:
            return False
        if cuda:                  # the host may not run ahead of the GPU by more than a layer
            torch.cuda.synchronize(device)
        return bool(cancel())

    steps = max(1, min(int(max_new_tokens), len(kept.sparse_tokens) or 1))
    with torch.inference_mode():
        # a copy even on the CPU: the prefill overwrites its input, and kept stays intact
        embeds = kept.embeds.to(device, copy=True, non_blocking=True)
        positions = None if kept.positions is None else kept.positions.to(device)
        ctx = PrefillContext(mode="dense", cancel=stop)
        cache = _new_cache(adapter.text_model)
        logits = prefill(adapter.text_model, embeds, cache, positions,
                         chunk=adapter.prefill_chunk or DEFAULT_CHUNK, ctx=ctx,
                         lm_head=adapter.lm_head)
        del embeds
        first = logits[0, -1].float().cpu()
        token = logits.argmax(-1)
        out = [int(token)]
        embed_tokens = adapter.text_model.get_input_embeddings()
        while len(out) < steps and out[-1] not in adapter.eos_token_ids:
            if stop():
                raise Cancelled("the dense re-run was stopped while generating")
            j = len(out) - 1          # out[j] goes in at position L + j
            # None: the model counts positions from the cache (LongVILA)
            pos = None if kept.answer_positions is None else \
                kept.answer_positions[..., j:j + 1].to(device)
            hidden = adapter._step(embed_tokens(token), pos, cache)
            token = adapter.lm_head(hidden[:, -1:]).argmax(-1)
            out.append(int(token))
    answer = [t for t in out if t not in adapter.eos_token_ids]
    text = adapter.tokenizer.decode(answer, skip_special_tokens=True).strip()
    return DenseRerun(logits=first, token_ids=out, text=text,
                      seconds=time.perf_counter() - t0)

