"""Decode steps without transformers' forward: the lean step, and the same step replayed from
CUDA graphs; greedy, or each token chosen by a mminfer.models.sampler.Sampler from the logits.

A decode step through the text model's forward (``Adapter._step``) spends most of its time on
the host: the mask machinery, the output wrappers, and 28 layers × ~15 small kernels launched
one by one from Python (34 ms a step at 115K tokens on an H200 where the memory floor is
≈ 4.5 ms). Here one token goes through the decoder layers using the model's own modules, the
way mminfer.models.prefill does (``input_layernorm``, the q/k/v/o projections, the module's
``apply_rotary_pos_emb`` with cos/sin from ``rotary_emb``, ``post_attention_layernorm``,
``mlp``, ``norm``, ``lm_head``): nothing is re-implemented, no mask is built (one query sees
every cached key), K/V go into the cache through ``cache.update`` (a PrefixKV writes them in
place into its slab), and attention is the function the attention module itself calls (our
hook: SDPA with GQA by index on the flash / memory-efficient backends), so each kernel is the
one ``_step`` launches and the greedy tokens are the same.

On a GPU the step is split at attention into ``L + 1`` segments — [embed, rotary, layer 0 up to
its q/k/v], [layer i-1 after attention, layer i up to its q/k/v] for i = 1..L-1, [the last
layer after attention, norm, lm_head, argmax] — each captured once per model in a CUDA graph
with static buffers (the token id and the position live on the device and the last segment
advances them). Between the replays the host runs what changes length every step: the K/V
write into the cache and attention over its current view, as in the eager step (flash attention
splits a long cache across its length for one query: flash-decoding). On a PrefixKV the host
writes the rows through its SlabLayers and calls SDPA itself, once it has checked on the first
cache that this gives bit for bit what the attention function gives (else it goes through
``cache.update`` and that function). That leaves ~4 launches a layer instead of ~15 plus the
module machinery, keeps the graphs independent of any cache (one capture serves every video and
question), and replays exactly the eager step's kernels, so the tokens are the eager step's.
An FP8 cache (``--kv-cache-dtype fp8``) is attended there by the flash-decoding kernel that
reads e4m3 tiles (mminfer.kernels.fp8_attention), the one the hook runs in the eager step, and
so is a reader's ForkKV over a kept prefix (its own rows after the shared ones, either dtype);
a reader whose rows are in the prefix's tail (``ForkKV(claim=True)``) is a cache in one piece,
written and attended as a PrefixKV is.
Capture happens on a model's first decode (its time falls in that request's "generate").

Answers decoding together (``step_batch``, the scheduler's batched step) run
``LeanDecoder.step_many``: the token-wise work once over their B rows (the weights read once for
all), attention per answer over its own cache. On a GPU that step is captured the same way
(BatchGraphs), at each of BATCH_SIZES on its first use, into the memory pool of the lone step's
graphs: each step's tokens and positions are written into the static buffers, a batch pads up
to the next captured size (the padding rows are computed and ignored) and the host attends
between the replays as step_many does, so the tokens are step_many's.

Where a step cannot be captured (the CPU, tensor-parallel layers whose collectives run inside
the modules, rotary embeddings that rescale with the position) the lean step runs eagerly; a
model whose layers the lean step does not cover (sliding-window attention) decodes through
``Adapter._step``. ``adapter.decode_mode`` ("auto" | "graph" | "lean" | "step") forces one path
(benchmarks, tests).

Greedy decoding without logprobs takes each step's own ``argmax`` (on a GPU the last graph's,
read as one integer): the fast path, untouched by sampling. A sampled answer, or one that
reports logprobs, needs the whole logits row: the last graph keeps its logits in a static
buffer (the tensor its ``argmax`` reads, held instead of freed: the same kernels, so greedy
replays are unchanged), which the sampler reads between replays before feeding its own choice
back as the next token; the eager paths hand the logits over instead of their ``argmax``.
"""

from __future__ import annotations

import logging
import threading

import torch

from mminfer.errors import Cancelled
from mminfer.kernels.fp8_attention import fp8_attention
from mminfer.models import fp8
from mminfer.models.hooks import (attention_forward, current, decode_backends, fork_attention,
                                  fork_group_attention, fp8_cache_attention)
from mminfer.models.kv import (ForkKV, ForkLayer, PrefixKV, SlabLayer, prefix_of, scale_of,
                               write_rows)
from mminfer.models.prefill import _attention_function, _module_of, _position_ids

MODES = ("auto", "graph", "lean", "step")
# The batch sizes the batched step is captured at (each on its first use). A batch pads up to
# the next one: its token-wise GEMMs read the weights once whatever their rows (memory-bound
# far past 64 rows), so the padding rows add no launch and little time. Up to 64, the most the
# scheduler gathers (mminfer.engine.scheduler; --max-num-seqs 8 by default: sizes 2, 4, 8); a
# larger batch replays in chunks of 64 (each chunk reads the weights again: still far less than
# the ~15 launches a layer an eager step makes from Python). Memory, in the shared pool: a row
# holds its q/k/v of every layer and a row of logits, ≈ 0.6 MB at the 7B shape (28 layers,
# vocab 152064, bf16): ≈ 5 MB at 8 answers, ≈ 75 MB with every size up to 64 captured.
BATCH_SIZES = (2, 4, 8, 16, 32, 64)


class LeanDecoder:
    """The decode step of one text model (a transformers Qwen2 / Qwen2.5-VL decoder stack) and
    its ``lm_head``. ``step(token, position_ids, cache)`` → the next greedy token ``[1, 1]``;
    ``logits(...)`` → the logits ``[1, 1, vocab]`` it is the argmax of."""

    def __init__(self, text_model, lm_head):
        self.text_model, self.lm_head = text_model, lm_head
        self.layers = list(text_model.layers)
        self._attns = [layer.self_attn for layer in self.layers]
        self.embed = text_model.get_input_embeddings()
        self.unsupported = _lean_unsupported(text_model)
        self._graphs = None
        self._graph_failed: str | None = None
        self._batch: dict[tuple[int, int], BatchGraphs] = {}   # (size, position dims)
        self._batch_failed: str | None = None
        self._pool = None
        # held by whoever replays this model's graphs (one step, or a lone answer's loop)
        self._lock = threading.Lock()
        self._sdpa_direct: bool | None = None       # sdpa_direct's check, made once

    # ------------------------------------------------------------ the segments
    def _rope(self, h, position_ids):
        return self.text_model.rotary_emb(h, position_ids)

    def _pre(self, i, h, cos, sin):
        """Layer ``i`` up to attention: q ``[B, H, 1, d]``, k/v ``[B, Hkv, 1, d]`` (rotated)."""
        layer = self.layers[i]
        attn = layer.self_attn
        d = attn.head_dim
        b = h.shape[0]          # 1, or the answers of a batched step (step_many)
        x = fp8.normed(layer.input_layernorm, h, attn.q_proj, attn.k_proj, attn.v_proj)
        q = attn.q_proj(x).view(b, 1, -1, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, 1, -1, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, 1, -1, d).transpose(1, 2)
        q, k = _module_of(attn).apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def _attend(self, i, q, k, v, cache):
        """K/V of layer ``i`` into ``cache``, attention over all its rows: ``[1, 1, H, d]``."""
        attn = self.layers[i].self_attn
        keys, values = cache.update(k, v, attn.layer_idx)
        out, _ = _attention_function(attn)(attn, q, keys, values, None, dropout=0.0,
                                           scaling=attn.scaling)
        return out

    def _post(self, i, h, out):
        """Layer ``i`` after attention: the new residual stream ``[B, 1, hidden]``."""
        layer = self.layers[i]
        h = h + layer.self_attn.o_proj(out.reshape(h.shape[0], 1, -1))
        return h + fp8.mlp(layer.mlp, layer.post_attention_layernorm, h)

    def _logits(self, h):
        return self.lm_head(self.text_model.norm(h))                         # [1, 1, vocab]

    def _head(self, h):
        return self._logits(h).argmax(-1)                                    # [1, 1]

    # ------------------------------------------------------------ eager
    def step(self, token, position_ids, cache):
        """One greedy step, eagerly: ``token`` ``[1, 1]`` at ``position_ids`` (what the model's
        forward takes; None: the cache's length) → the next token ``[1, 1]``."""
        return self._head(self._hidden(token, position_ids, cache))

    def logits(self, token, position_ids, cache):
        """The step of :meth:`step`, its logits ``[1, 1, vocab]`` instead of their argmax."""
        return self._logits(self._hidden(token, position_ids, cache))

    def _hidden(self, token, position_ids, cache):
        h = self.embed(token)
        pos = self.position_ids(position_ids, cache)
        cos, sin = self._rope(h, pos)
        for i in range(len(self.layers)):
            q, k, v = self._pre(i, h, cos, sin)
            h = self._post(i, h, self._attend(i, q, k, v, cache))
        return h

    def step_many(self, tokens, position_ids, caches):
        """One step of several answers at once, each over its own cache (lengths, dtypes and
        prefixes differ): ``tokens`` (ints), ``position_ids`` (each what ``step`` takes) and
        ``caches`` side by side → the last-position logits ``[B, vocab]``.

        Everything token-wise (embedding, norms, the q/k/v/o projections, rotary, MLP,
        lm_head) runs once over the B rows, so the weights are read once for all answers — what
        a decode step's time is made of; attention runs per answer over its own cache (what
        the function the attention module calls would run, as in ``step``: BatchPlan.attend),
        every answer's K/V rows written first, together (:meth:`BatchPlan.write`), except for
        answers whose caches
        fork one prefix (:func:`prefix_groups`): their attention is one call per layer
        (``fork_group_attention``: the prefix read once for all of them, each one's own rows,
        merged through the log-sum-exp). Row b's arithmetic is that of ``step`` on answer b
        alone except where a GEMM of B rows sums in another order than one of 1 row, and where
        a group's attention sums its two segments in another order."""
        b = len(tokens)
        dev = self.embed.weight.device
        h = self.embed(torch.tensor(tokens, device=dev).view(b, 1))          # [B, 1, hidden]
        # [3, 1, 1] (M-RoPE) or [1, 1] per answer -> [3, B, 1] or [B, 1]
        pos = torch.cat([self.position_ids(p, c) for p, c in zip(position_ids, caches)], -2)
        cos, sin = self._rope(h, pos)
        plan = self.group_plan(caches)
        for i in range(len(self.layers)):
            q, k, v = self._pre(i, h, cos, sin)
            h = self._post(i, h, self._attend_many(i, q, k, v, caches, plan))
        return self._logits(h)[:, -1]                                        # [B, vocab]

    def group_plan(self, caches) -> "BatchPlan":
        """How the answers of a batch attend (:class:`BatchPlan`), made once a step: no layer
        changes it."""
        return BatchPlan(self, caches)

    def _attend_many(self, i, q, k, v, caches, plan=None, out=None):
        """Layer ``i``'s K/V and attention of B answers, row j over ``caches[j]``: q
        ``[B, H, 1, d]``, k/v ``[B, Hkv, 1, d]`` → ``[B, 1, H, d]``, written into ``out``
        where given (BatchGraphs' attention buffer); ``plan``: group_plan's (None: made here).
        The eager batched step and its CUDA-graph replay (BatchGraphs) both attend through
        here."""
        plan = plan if plan is not None else self.group_plan(caches)
        attn = self._attns[i]
        views = plan.write(attn.layer_idx, k, v)
        if not plan.groups:
            outs = [plan.attend(attn, q[j:j + 1], views[j], k[j:j + 1], v[j:j + 1], c)
                    for j, c in enumerate(caches)]
            return torch.cat(outs) if out is None else torch.cat(outs, out=out)
        if out is None:
            out = q.new_empty(q.shape[0], 1, q.shape[1], q.shape[-1])
        for j in plan.alone:
            out[j] = plan.attend(attn, q[j:j + 1], views[j], k[j:j + 1], v[j:j + 1],
                                 caches[j])[0]
        for rows, span, at in plan.groups:
            # the group's attention in one call; a group of adjacent rows reads its queries
            # and writes its outputs in place
            keys, values = zip(*(views[j] for j in rows))
            if span is not None:
                fork_group_attention(q[span[0]:span[1]], keys, values, attn.scaling,
                                     plan.ctx, out[span[0]:span[1]])
            else:
                out.index_copy_(0, at, fork_group_attention(q.index_select(0, at), keys,
                                                            values, attn.scaling, plan.ctx))
        return out

    def sdpa_direct(self, q, keys, values) -> bool:
        """Whether one SDPA call (GQA by index, the decode backends) gives, bit for bit, what
        the attention function gives for a decode query ``q`` over a cache in one piece in
        the model's dtype: checked once, on the first such cache (the lone step's direct
        replay, StepGraphs.direct_slabs, and the batched step's, BatchPlan, both ask)."""
        if self._sdpa_direct is None:
            attn = self._attns[0]
            probe = torch.randn(q.shape, device=keys.device, dtype=keys.dtype)
            ref, _ = _attention_function(attn)(attn, probe, keys, values, None, dropout=0.0,
                                               scaling=attn.scaling)
            with decode_backends(probe, 1):
                got = torch.nn.functional.scaled_dot_product_attention(
                    probe, keys, values, scale=attn.scaling, enable_gqa=True)
            self._sdpa_direct = bool(torch.equal(ref, got.transpose(1, 2)))
        return self._sdpa_direct

    def position_ids(self, position_ids, cache):
        if position_ids is None:     # the model's default: counted from the cache's length
            n = cache.get_seq_length()
            position_ids = torch.tensor([[n]], device=self.embed.weight.device)
        return _position_ids(self.text_model, position_ids, 1, self.embed.weight.device)

    # ------------------------------------------------------------ CUDA graphs
    def graph_unsupported(self) -> str | None:
        """Why the step cannot be replayed from CUDA graphs here, or None."""
        if self.unsupported:
            return self.unsupported
        dev = self.embed.weight.device
        if dev.type != "cuda":
            return f"CUDA graphs need a CUDA device, the model is on {dev}"
        if any(getattr(layer.self_attn, "tp_rank", None) is not None for layer in self.layers):
            return "tensor-parallel layers run collectives inside the step"
        kind = str(getattr(self.text_model.rotary_emb, "rope_type", "default"))
        if "dynamic" in kind or kind == "longrope":
            return f"{kind} rotary embeddings rescale with the position"
        return self._graph_failed

    def graphs(self, position_ids) -> "StepGraphs":
        """The captured step (captured on the first call; one per model and position shape)."""
        shape = tuple(position_ids.shape)
        if self._graphs is None or self._graphs.pos.shape != shape:
            self._graphs = None
            try:
                self._graphs = StepGraphs(self, position_ids, pool=self.graph_pool())
            except Exception as e:     # capture refused: this model decodes eagerly from now on
                self._graph_failed = f"capture failed: {type(e).__name__}: {e}"
                raise
        return self._graphs

    def batch_graphs(self, n: int, position_ids) -> "BatchGraphs | None":
        """The batched step for ``n`` ≤ ``BATCH_SIZES[-1]`` answers, captured at the smallest
        of BATCH_SIZES that holds them (on its first use); ``position_ids``: one answer's.
        None where batched steps run eagerly: a capture failed (logged once, not tried
        again; the lone answer's graphs are not affected)."""
        size = next(s for s in BATCH_SIZES if s >= n)
        key = (size, position_ids.dim())
        graphs = self._batch.get(key)
        if graphs is None and self._batch_failed is None:
            try:
                graphs = BatchGraphs(self, size, position_ids, pool=self.graph_pool())
            except Exception as e:     # capture refused: batched steps run eagerly from now on
                self._batch_failed = f"capture failed: {type(e).__name__}: {e}"
                logging.getLogger(__name__).warning(
                    "batched decode steps run eagerly: CUDA graph capture at %d answers "
                    "failed (%s: %s)", size, type(e).__name__, e)
                return None
            self._batch[key] = graphs
        return graphs

    def capture_batches(self, most: int, position_ids) -> list[int]:
        """Capture the batched step now for every size of BATCH_SIZES that batches of up to
        ``most`` answers use (a server's warm-up: a size's first use would otherwise stall
        every request while it is captured); ``position_ids``: one answer's. Returns the
        sizes captured."""
        sizes = [s for s in BATCH_SIZES if s < most] + \
            [next((s for s in BATCH_SIZES if s >= most), BATCH_SIZES[-1])]
        with self._lock:
            return [s for s in sizes if self.batch_graphs(s, position_ids) is not None]

    def graph_pool(self):
        """The memory pool every capture of this model shares (None off CUDA): one step's
        graphs replay at a time (``_lock``), so the captures' temporaries share memory."""
        if self._pool is None and self.embed.weight.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool


class _Segments:
    """The lean step's ``L + 1`` segments over static buffers of ``rows`` answers, captured
    in CUDA graphs (into ``pool``, shared by every capture of one decoder: they are replayed
    one whole step at a time, under the decoder's lock, and every buffer a segment reads in
    the pool is written earlier in the same step). Buffers: ``tok`` ``[rows, 1]`` (token
    ids), ``pos`` (position ids: ``[3, rows, 1]`` M-RoPE, else ``[rows, 1]``), ``attn``
    ``[rows, 1, H, d]`` (what the host's attention wrote); each segment's outputs (``q/k/v``
    of each layer, the residual ``h``, ``logits``, ``next``) are read at the addresses the
    capture left them at. The segments are plain code over those attributes: run eagerly
    (the CPU tests replace the capture by calling them) they are the step itself."""

    def __init__(self, dec: LeanDecoder, rows: int, position_ids):
        self.dec = dec
        L = len(dec.layers)
        dev = dec.embed.weight.device
        self.tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.pos = position_ids.detach().clone(memory_format=torch.contiguous_format)
        attn0 = dec.layers[0].self_attn
        H = attn0.q_proj.out_features // attn0.head_dim
        self.attn = torch.zeros(rows, 1, H, attn0.head_dim, dtype=dec.embed.weight.dtype,
                                device=dev)
        # filled at capture: each segment's outputs, read by the host and the next segment
        self.q, self.k, self.v = [None] * L, [None] * L, [None] * L
        self.h = None
        self.next = None
        self.logits = None
        self.scale = attn0.scaling

    def _seg(self, j):
        dec, L = self.dec, len(self.dec.layers)
        if j == 0:
            h = dec.embed(self.tok)
            self.cos, self.sin = dec._rope(h, self.pos)
        else:
            h = dec._post(j - 1, self.h, self.attn)
        self.h = h
        if j < L:
            self.q[j], self.k[j], self.v[j] = dec._pre(j, h, self.cos, self.sin)
        else:
            self._last(h)

    def _last(self, h):
        raise NotImplementedError

    def _record(self, warmup: int, pool):
        """Warm the segments up (twice each, on a side stream), restore the token and
        position buffers the warm-up may have advanced, capture one graph per segment."""
        dev, n = self.tok.device, len(self.dec.layers) + 1
        saved_tok, saved_pos = self.tok.clone(), self.pos.clone()
        _warm_up(dev, lambda: [self._seg(j) for _ in range(warmup) for j in range(n)])
        self.tok.copy_(saved_tok)
        self.pos.copy_(saved_pos)
        self.graphs = _capture(dev, [lambda j=j: self._seg(j) for j in range(n)], pool)


class StepGraphs(_Segments):
    """The lean step of one answer captured in CUDA graphs: ``tok`` (the token fed, then the
    one produced), ``pos`` (its position ids, advanced by one per step), ``logits`` (the last
    segment's, valid until the next replay); between the replays the host writes K/V and runs
    attention (``LeanDecoder._attend``)."""

    def __init__(self, dec: LeanDecoder, position_ids, warmup: int = 2, pool=None):
        super().__init__(dec, 1, position_ids)
        self._record(warmup, pool)

    def _last(self, h):
        # the logits a sampler reads stay referenced (the graph's output buffer, in the
        # shared pool: read before the next replay of the first segment); the argmax is the
        # one _head computes, so greedy replays are unchanged
        self.logits = self.dec._logits(h)
        self.next = self.logits.argmax(-1)
        self.tok.copy_(self.next)
        self.pos.add_(1)

    def step(self, cache, slabs=None):
        """One step from the token and position in ``tok``/``pos``; returns ``tok`` (now the
        next token, on the device). ``slabs`` (from :meth:`direct_slabs`): the cache's
        SlabLayers, written and attended directly (fewer host calls, the same kernels)."""
        g, dec = self.graphs, self.dec
        g[0].replay()
        if slabs is None:
            for i in range(len(dec.layers)):
                self.attn.copy_(dec._attend(i, self.q[i], self.k[i], self.v[i], cache))
                g[i + 1].replay()
            return self.tok
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with decode_backends(self.q[0], 1):
            for i, slab in enumerate(slabs):
                keys, values = slab.update(self.k[i], self.v[i])
                if prefix_of(keys) is not None:    # a reader of a shared prefix: the hook's
                    self.attn.copy_(fork_attention(self.q[i], keys, values, self.scale))
                elif slab.quantized:   # FP8 cache: the kernel the attention hook runs
                    self.attn.copy_(fp8_attention(self.q[i], keys, values, slab.k_scale,
                                                  slab.v_scale, self.scale))
                else:
                    out = sdpa(self.q[i], keys, values, scale=self.scale, enable_gqa=True)
                    self.attn.copy_(out.transpose(1, 2))
                g[i + 1].replay()
        return self.tok

    def direct_slabs(self, cache):
        """``cache.layers`` where they are SlabLayers (layer i's at index i) and one SDPA call
        gives, bit for bit, what the attention function the step would call gives (checked
        once, on the first such cache); else None (the step goes through ``cache.update`` and
        the attention function)."""
        layers = getattr(cache, "layers", None)
        if (not layers or len(layers) != len(self.dec.layers)
                or any(a.self_attn.layer_idx != i for i, a in enumerate(self.dec.layers))):
            return None
        forks = all(isinstance(x, ForkLayer) for x in layers)
        if forks and not any(x.in_tail for x in layers):
            # a ForkKV: the hook and the direct step call the same launcher (fork_attention)
            return list(layers)
        # a PrefixKV, or a ForkKV whose rows are in its prefix's tail (a cache in one piece,
        # attended as one; should its rows leave the tail, the step sees their kv_prefix)
        if not (forks or all(isinstance(x, SlabLayer) for x in layers)) or any(
                x.get_seq_length() == 0 or x.keys is None for x in layers):
            return None
        if all(x.quantized for x in layers):
            # FP8: the hook and the direct step call the same launcher (fp8_attention) on the
            # same views and scales: the same kernels by construction, nothing to check
            return list(layers)
        if any(x.quantized for x in layers):
            return None
        direct = self.dec.sdpa_direct(self.q[0], layers[0].keys, layers[0].values)
        return list(layers) if direct else None


class BatchGraphs(_Segments):
    """The batched step (``LeanDecoder.step_many``) of up to ``size`` answers captured in CUDA
    graphs: the token-wise work over ``size`` rows replayed, K/V and attention per answer run
    by the host between the replays (``LeanDecoder._attend_many``, as in step_many), the
    tokens and positions of each step written into ``tok``/``pos`` first (the answers of a
    batch change from step to step). A batch of B < size answers fills rows 0..B-1; the rows
    after them keep whatever an earlier batch left there (token ids, positions, attention
    outputs: finite values). Every token-wise kernel computes a row from that row alone, so
    they change nothing in rows 0..B-1, and nothing reads their outputs."""

    def __init__(self, dec: LeanDecoder, size: int, position_ids, warmup: int = 2, pool=None):
        # position_ids: one answer's ([3, 1, 1] M-RoPE or [1, 1]), as a row of the buffer
        super().__init__(dec, size, position_ids.expand(*position_ids.shape[:-2], size, 1))
        self.size = size
        self._record(warmup, pool)

    def _last(self, h):
        self.logits = self.dec._logits(h)[:, -1]                             # [size, vocab]
        self.next = self.logits.argmax(-1)                                   # [size]

    def step(self, tokens, position_ids, caches):
        """One step of B = ``len(caches)`` ≤ size answers: ``tokens`` (ints) and
        ``position_ids`` (each ``LeanDecoder.position_ids``'s, one answer's) into rows 0..B-1.
        Returns the logits ``[B, vocab]`` and the greedy tokens ``[B]``: views of the graphs'
        buffers, valid until their next replay."""
        b, dec, g = len(caches), self.dec, self.graphs
        self.tok[:b, 0].copy_(torch.tensor(tokens))
        self.pos[..., :b, :].copy_(torch.cat(position_ids, -2))
        plan = dec.group_plan(caches)
        attn = self.attn[:b]
        g[0].replay()
        for i in range(len(dec.layers)):
            dec._attend_many(i, self.q[i][:b], self.k[i][:b], self.v[i][:b], caches, plan,
                             attn)
            g[i + 1].replay()
        return self.logits[:b], self.next[:b]


def _warm_up(dev, fn):
    """``fn()`` on a side stream (cuBLAS handles and lazy inits happen before a capture)."""
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(dev).wait_stream(side)


def _capture(dev, fns, pool=None) -> list:
    """One CUDA graph per function, captured in order into one memory pool (``pool``, else a
    new one; they are replayed in that order, never concurrently, so their temporaries may
    share memory)."""
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    graphs = []
    for fn in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            fn()
        graphs.append(g)
    torch.cuda.synchronize(dev)
    return graphs


def prefix_groups(caches) -> list[list[int]]:
    """The indices of ``caches`` that fork one prefix (ForkKV over the same PrefixKV, the
    same number of rows shared), for each prefix forked by two or more: their decode step's
    attention reads the prefix once for all of them (``LeanDecoder.step_many``). The reader
    whose rows are in the prefix's tail is one of them (alone it attends as a cache in one
    piece; beside others, a call of its own a layer would cost the host as much as the
    group's, measured on an H100: ~90 us of CPU a flash call)."""
    by_prefix: dict = {}
    for j, c in enumerate(caches):
        if isinstance(c, ForkKV) and c.layers:
            by_prefix.setdefault((id(c.prefix), c.layers[0].shared), []).append(j)
    return [g for g in by_prefix.values() if len(g) > 1]


class BatchPlan:
    """What the attention of a batched step needs that no layer changes, found once a step
    (not once a layer): the groups of forks of one prefix (:func:`prefix_groups`), each as
    ``(rows, span, at)`` — its answers' indices, ``(first, end)`` where they are adjacent
    (their queries and outputs are then slices of the batch's), else their indices on the
    device (``at``) —; the answers that attend alone; whether their rows are written
    together (:meth:`write`); the request context the attention functions take."""

    def __init__(self, dec: LeanDecoder, caches):
        self.ctx = current()
        groups = prefix_groups(caches)
        grouped = {j for g in groups for j in g}
        self.alone = [j for j in range(len(caches)) if j not in grouped]
        self.groups = []
        for rows in groups:
            if rows == list(range(rows[0], rows[0] + len(rows))):
                self.groups.append((rows, (rows[0], rows[0] + len(rows)), None))
            else:
                at = torch.tensor(rows, device=dec.embed.weight.device)
                self.groups.append((rows, None, at))
        # a batch of PrefixKV / ForkKV: every layer's rows written together (what each
        # update does); any other cache in it: each one through its own update
        self.caches = caches
        self.ours = all(isinstance(c, (PrefixKV, ForkKV)) for c in caches)
        # where the attention function is our hook, what it would run for a decode query is
        # called here directly: fork_attention over a reader's rows after a shared prefix,
        # fp8_cache_attention over an FP8 cache, and over a cache in one piece SDPA where it
        # gives the hook's bits (LeanDecoder.sdpa_direct) and no stage timer runs
        self.dec = dec
        attn = dec._attns[0] if dec._attns else None
        self.hooked = attn is not None and _attention_function(attn) is attention_forward
        self.sdpa = self.hooked and (self.ctx is None or self.ctx.timer is None)

    def write(self, layer_idx, k, v) -> list:
        """Layer ``layer_idx``'s K/V rows (``[B, Hkv, 1, d]``) into the caches, all at once
        (:func:`mminfer.models.kv.write_rows`): each one's ``(keys, values)``; Nones where a
        cache is of another kind (each written by :meth:`attend`)."""
        if self.ours:
            return write_rows([c.layers[layer_idx] for c in self.caches], k, v)
        return [None] * len(self.caches)

    def attend(self, attn, q, views, k, v, cache):
        """One answer's attention over ``cache`` after its K/V were written (``views``:
        what the write returned; None: written here through ``cache.update``), as
        ``LeanDecoder._attend``: ``[1, 1, H, d]``."""
        if views is None:
            keys, values = cache.update(k, v, attn.layer_idx)
        else:
            keys, values = views
            if self.hooked and prefix_of(keys) is not None:
                return fork_attention(q, keys, values, attn.scaling, self.ctx)
            if self.hooked and scale_of(keys) is not None:
                return fp8_cache_attention(q, keys, values, attn.scaling, self.ctx)
            if self.sdpa and self.dec.sdpa_direct(q, keys, values):
                with decode_backends(q, 1):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q, keys, values, scale=attn.scaling, enable_gqa=True)
                return out.transpose(1, 2)
        out, _ = _attention_function(attn)(attn, q, keys, values, None, dropout=0.0,
                                           scaling=attn.scaling)
        return out


# ---------------------------------------------------------------- the loop
def decoder_of(adapter) -> LeanDecoder:
    """The adapter's LeanDecoder (built once, kept on the adapter)."""
    dec = getattr(adapter, "_lean_decoder", None)
    if dec is None or dec.text_model is not adapter.text_model:
        dec = LeanDecoder(adapter.text_model, adapter.lm_head)
        adapter._lean_decoder = dec
    return dec


def choose_path(adapter, mode: str | None = None) -> str:
    """"graph", "lean" or "step": the path a decode on ``adapter`` takes (``mode``: its
    ``decode_mode`` by default; "graph" asked where it cannot run is an error)."""
    mode = mode or getattr(adapter, "decode_mode", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"decode mode must be one of {MODES}, not {mode!r}")
    if mode == "step":
        return "step"
    dec = decoder_of(adapter)
    if dec.unsupported:
        if mode in ("lean", "graph"):
            raise ValueError(f"the lean decode step cannot run this model: {dec.unsupported}")
        return "step"
    if mode == "lean":
        return "lean"
    why = dec.graph_unsupported()
    if mode == "graph" and why:
        raise ValueError(f"the decode step cannot be captured in CUDA graphs: {why}")
    return "lean" if why else "graph"


def step_batch(adapter, items) -> list:
    """One decode step of each answer in ``items`` — ``(token id, position_ids, cache,
    logits?)`` each, the caches all different — as one batched step
    (``LeanDecoder.step_many``); a batch of one takes the path a lone answer takes (the CUDA
    graphs where they run: its token and position are written into their buffers first, as
    another answer may have replayed them since), so an answer decoding alone is as fast as
    without batching. A batch of several is replayed from CUDA graphs (BatchGraphs, padded
    up to the next of BATCH_SIZES; above the largest, in chunks of it) where a lone answer's
    step would be (``choose_path`` says "graph") and no other thread is replaying this
    model's graphs; else step_many runs eagerly. Returns, in order, the next greedy token id,
    or where an item's ``logits?`` is True the step's logits ``[1, 1, vocab]`` (a copy), or
    where it is a chooser (a mminfer.models.sampler.Sampler: logits -> token id) the token it
    chooses from them, chosen here (the answers' samplers run in the step that made their
    logits, not each on its own thread between steps); what a chooser raised is returned as
    that item's result, for its answer alone to raise."""
    with torch.inference_mode():
        dec = decoder_of(adapter)
        if len(items) > 1 and dec.unsupported is None:
            got = _step_many(adapter, dec, items)
        else:
            got = [_step_one(adapter, dec, *item) for item in items]
        for j, item in enumerate(items):
            if callable(item[3]):
                try:
                    got[j] = item[3](got[j])
                except Exception as e:     # noqa: BLE001 - its answer's error, not the batch's
                    got[j] = e
        return got


def _step_many(adapter, dec, items) -> list:
    out, rest = [], list(items)
    if choose_path(adapter) == "graph" and dec._lock.acquire(blocking=False):
        try:
            while rest:
                chunk = rest[:BATCH_SIZES[-1]]
                tokens, pos, caches, want = zip(*chunk)
                pos = [dec.position_ids(p, c) for p, c in zip(pos, caches)]
                graphs = dec.batch_graphs(len(chunk), pos[0])
                if graphs is None:         # capture failed: eager from here
                    break
                logits, top = graphs.step(list(tokens), pos, list(caches))
                top = top.tolist()
                out += [logits[j].view(1, 1, -1).clone() if w else top[j]
                        for j, w in enumerate(want)]
                rest = rest[len(chunk):]
        finally:
            dec._lock.release()
    if rest:
        tokens, pos, caches, want = zip(*rest)
        logits = dec.step_many(list(tokens), list(pos), list(caches))
        top = logits.argmax(-1).tolist()
        out += [logits[j].view(1, 1, -1) if w else top[j] for j, w in enumerate(want)]
    return out


def _step_one(adapter, dec, token: int, pos, cache, want_logits: bool):
    path = choose_path(adapter)
    if path == "graph" and dec._lock.acquire(blocking=False):
        try:
            graphs = dec.graphs(dec.position_ids(pos, cache))
            graphs.tok.fill_(token)
            graphs.pos.copy_(dec.position_ids(pos, cache))
            tok = graphs.step(cache, graphs.direct_slabs(cache))
            return graphs.logits.clone() if want_logits else int(tok)
        except Exception as e:     # capture refused: eager from here, as in decode_loop
            logging.getLogger(__name__).warning(
                "decode steps run eagerly: CUDA graph capture failed (%s: %s)",
                type(e).__name__, e)
        finally:
            dec._lock.release()
    t = torch.tensor([[token]], device=dec.embed.weight.device)
    if path == "step":
        hidden = adapter._step(adapter.text_model.get_input_embeddings()(t), pos, cache)
        logits = adapter.lm_head(hidden[:, -1:])
        return logits if want_logits else int(logits.argmax(-1))
    return dec.logits(t, pos, cache) if want_logits else int(dec.step(t, pos, cache))


def decode_loop(adapter, cache, out: list, *, rope_delta: int = 0, max_new_tokens: int = 32,
                cancel=None, emit=None, mode: str | None = None, sampler=None,
                stepper=None) -> list:
    """Decode steps on ``cache`` after the tokens in ``out`` (``out[-1]`` is the token to feed;
    its position is the cache's length): appends each new token to ``out`` until
    ``max_new_tokens`` tokens, an end token, or ``emit(token_id)`` (called after each) returns
    True (a stop string), calling ``cancel()`` before each step (raises
    mminfer.errors.Cancelled). ``sampler`` (mminfer.models.sampler.Sampler) chooses each token
    from the step's logits where it needs them; else the step's argmax. Returns ``out``.
    ``stepper(token, position_ids, cache, chooser)``: who runs each step (the server's
    scheduler batches the steps of answers decoding at the same time: ``step_batch``), giving
    the next token id (``chooser``: the sampler that chooses it from the step's logits, or
    None: their argmax) or the exception its chooser raised; None: this loop, on this
    thread."""
    choose = sampler if sampler is not None and sampler.needs_logits else None
    with torch.inference_mode():
        if stepper is not None:
            return _stepped_loop(adapter, cache, out, rope_delta, max_new_tokens, cancel, emit,
                                 choose, stepper)
        return _decode_loop(adapter, cache, out, rope_delta, max_new_tokens, cancel, emit, mode,
                            choose)


def _stepped_loop(adapter, cache, out, rope_delta, max_new_tokens, cancel, emit, choose,
                  stepper):
    eos = adapter.eos_token_ids
    # every step's position at once: a step takes a view of it (no device work of its own
    # between the batched steps, where the answers' threads run one at a time)
    start = cache.get_seq_length()
    ahead = adapter.positions_after(rope_delta, start, max(max_new_tokens - len(out), 1))
    while len(out) < max_new_tokens and out[-1] not in eos:
        if cancel is not None and cancel():
            raise Cancelled(f"request cancelled after {len(out)} answer tokens")
        i = cache.get_seq_length() - start
        if ahead is not None and 0 <= i < ahead.shape[-1]:
            pos = ahead[..., i:i + 1]
        else:
            pos = adapter.positions_after(rope_delta, start + i, 1)
        got = stepper(out[-1], pos, cache, choose)
        if isinstance(got, BaseException):
            raise got
        out.append(int(got))
        if emit is not None and emit(out[-1]):
            break
    return out


def _decode_loop(adapter, cache, out, rope_delta, max_new_tokens, cancel, emit, mode, choose):
    path = choose_path(adapter, mode)
    dec = decoder_of(adapter)
    eos = adapter.eos_token_ids
    device = dec.embed.weight.device
    stopped = False

    def more():
        if stopped or len(out) >= max_new_tokens or out[-1] in eos:
            return False
        if cancel is not None and cancel():
            raise Cancelled(f"request cancelled after {len(out)} answer tokens")
        return True

    def push(t):
        nonlocal stopped
        out.append(t)
        if emit is not None and emit(t):
            stopped = True

    if not more():
        return out
    pos0 = adapter.positions_after(rope_delta, cache.get_seq_length(), 1)
    graphs = None
    if path == "graph" and dec._lock.acquire(blocking=False):   # one decode at a time replays
        try:
            try:
                graphs = dec.graphs(dec.position_ids(pos0, cache))
            except Exception as e:
                if mode == "graph" or getattr(adapter, "decode_mode", "auto") == "graph":
                    raise
                logging.getLogger(__name__).warning(
                    "decode steps run eagerly: CUDA graph capture failed (%s: %s)",
                    type(e).__name__, e)
                graphs = None                  # eager from here (graph_unsupported says why)
            if graphs is not None:
                graphs.tok.fill_(out[-1])
                graphs.pos.copy_(dec.position_ids(pos0, cache))
                slabs = graphs.direct_slabs(cache)
                while True:
                    tok = graphs.step(cache, slabs)
                    if choose is None:
                        push(int(tok))
                    else:                      # the sampler's token is the next one fed
                        t = choose(graphs.logits)
                        tok.fill_(t)
                        push(t)
                    if not more():
                        return out
        finally:
            dec._lock.release()
    if path == "step":
        embed = adapter.text_model.get_input_embeddings()
    while True:
        token = torch.tensor([[out[-1]]], device=device)
        pos = adapter.positions_after(rope_delta, cache.get_seq_length(), 1)
        if path == "step":
            hidden = adapter._step(embed(token), pos, cache)
            logits = adapter.lm_head(hidden[:, -1:])
            push(int(logits.argmax(-1)) if choose is None else choose(logits))
        elif choose is None:
            push(int(dec.step(token, pos, cache)))
        else:
            push(choose(dec.logits(token, pos, cache)))
        if not more():
            return out


def _lean_unsupported(text_model) -> str | None:
    for layer in text_model.layers:
        attn = layer.self_attn
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention layers need their mask"
        if not hasattr(_module_of(attn), "apply_rotary_pos_emb"):
            return f"{type(attn).__name__}'s module has no apply_rotary_pos_emb"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(attn, name):
                return f"{type(attn).__name__} has no {name}"
    for name in ("rotary_emb", "norm"):
        if not hasattr(text_model, name):
            return f"{type(text_model).__name__} has no {name}"
    return None
