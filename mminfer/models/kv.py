"""The KV cache of one prompt, in one preallocated buffer per layer: a prefix's cache that many
questions continue.

transformers' ``DynamicCache`` grows by ``torch.cat`` on every update: each decode step copies
the whole cache of every layer (6.6 GB at 115K tokens for a 7B model), and a question asked on
a kept prefix would copy the prefix before appending to it. Here each layer's K and V live in a
buffer with room past the prompt (``headroom`` tokens); an update writes its rows in place and
the layer's ``keys``/``values`` are views of the rows written so far. Rows ``[0, prefix)`` are
never written again once the prefix is built, so a question appends its own rows after the
prefix, reads every row, and :meth:`PrefixKV.truncate` gives the buffer back to the prefix for
the next question without copying anything. A kept prefix that many questions read at once
is forked instead (:class:`ForkKV`): each reader's rows in buffers of its own, except one
reader at a time, which writes its rows in place into the prefix's room past its rows (its
tail: :data:`TAIL_ROWS`) and so reads a cache in one piece.

The layers subclass transformers' ``DynamicLayer`` and keep its ``keys``/``values`` attributes,
so the mask sizes and sequence lengths transformers reads from them stay right (5.17 and 5.24).

FP8 (``--kv-cache-dtype fp8``): with ``dtype=float8_e4m3fn`` the buffers hold K and V in e4m3
(half of bf16: a 1.05M-token LongVILA-7B prefix from 60 to 30 GB) with one fp32 scale per
(layer, KV head) for K and one for V (``k_scale``/``v_scale`` ``[Hkv]``). The scales are set
by the layer's first write, the prefix's prefill, from its own K/V: ``amax / 448`` per head
(448 is e4m3's largest value), so the prefix uses the whole range and no prefix row
saturates. Later rows (the question, the answer) are quantised with the same scales,
saturating at ±448 (a value past the prefix's amax is clipped, never NaN). A per-head scale
costs nothing to apply (a constant of each attention program: mminfer.kernels.fp8_attention)
and fits what varies most: K's magnitude differs by head far more than along the prompt
(RoPE only rotates pairs of channels). ``keys``/``values`` are then FP8 views carrying their
scale as ``kv_scale`` (:func:`scale_of`), which is how our attention hook
(mminfer.models.hooks) finds it between transformers' ``cache.update`` and the attention call.
Quantising runs a chunk of rows at a time, so its fp32 temporaries stay small at 1M tokens.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Rows of room past the prompt: a question and its answer (grown, one copy, when more is asked).
HEADROOM = 1024
# Rows a kept prefix keeps past its own (its tail, :func:`tail_rows`), where one reader at a
# time writes its question's and answer's rows in place (ForkKV ``claim=True``) and so decodes
# over a cache in one piece. A question and its answer: a chat template's question is tens of
# tokens, an answer tens to a few hundred (the server's default max_tokens is 32). At the 7B
# shapes (28 layers, 4 KV heads of 128, bf16) 1024 rows are 58.7 MB: 0.9 % of a 115K-token
# prefix (6.6 GB), 0.1 % of a 1.05M-token one; a longer question or answer leaves the tail
# for buffers of its own (ForkLayer).
TAIL_ROWS = 1024

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # e4m3fn's largest finite value
# rows quantised at a time: fp32 temporaries of 32K x Hkv x d (64 MB at 4 x 128)
QUANT_CHUNK = 32768
# rows moved at a time when rows are cut out of a cache (a temporary of this many rows of
# one layer when the cut is shorter: the source and destination of a chunk overlap then)
CUT_CHUNK = 8192
# what "--kv-cache-dtype" takes (vLLM's names): "auto" is the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}


def tail_rows(length: int) -> int:
    """The tail a kept prefix of ``length`` rows keeps past them: TAIL_ROWS, but never more
    than the prefix's own rows (a prefix of a few frames at most doubles; at its length
    attention is a small part of a decode step, so its readers lose little outside it)."""
    return max(0, min(TAIL_ROWS, int(length)))


# guards every prefix's tail claim (taken and given back by whichever request thread)
_CLAIM_LOCK = threading.Lock()


def kv_dtype(name):
    """The storage dtype of ``--kv-cache-dtype`` ``name`` (None: the model's own), or
    ValueError."""
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return KV_CACHE_DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"kv cache dtype must be one of {tuple(KV_CACHE_DTYPES)}, "
                         f"not {name!r}") from None


def head_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-head e4m3 scales of ``x`` ``[B, H, n, D]``: ``amax / 448`` over everything but the
    head, fp32 ``[H]`` (never 0: an all-zero head gets the smallest normal float)."""
    amax = None
    for s in range(0, x.shape[-2], QUANT_CHUNK):
        a = x[..., s:s + QUANT_CHUNK, :].abs().amax(dim=(0, 2, 3)).float()
        amax = a if amax is None else torch.maximum(amax, a)
    return (amax / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)


def quantize_into(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> None:
    """``dst`` (fp8, ``[B, H, n, D]``) = ``src / scale`` per head, saturating at ±448."""
    inv = (1.0 / scale).view(1, -1, 1, 1)
    for s in range(0, src.shape[-2], QUANT_CHUNK):
        e = min(s + QUANT_CHUNK, src.shape[-2])
        x = src[..., s:e, :].float() * inv
        dst[..., s:e, :].copy_(x.clamp_(-FP8_MAX, FP8_MAX).to(FP8))


def dequantize(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src`` (fp8, ``[B, H, n, D]``) times its per-head ``scale``, in ``dtype``: a chunk of
    rows at a time, so the fp32 temporaries stay small."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    sc = scale.view(1, -1, 1, 1)
    for s in range(0, src.shape[-2], QUANT_CHUNK):
        e = min(s + QUANT_CHUNK, src.shape[-2])
        out[..., s:e, :] = (src[..., s:e, :].float() * sc).to(dtype)
    return out


def scale_of(t: torch.Tensor):
    """The per-head scale an FP8 ``keys``/``values`` view carries (None: not one of ours)."""
    return getattr(t, "kv_scale", None)


class SlabLayer(DynamicLayer):
    """One layer's K and V in ``[B, Hkv, capacity, D]`` buffers; ``keys``/``values`` are the
    views ``[..., :length, :]``. ``dtype``: what the buffers hold (None: the dtype K/V come
    in; FP8: quantised, see the module doc). ``rows_outer``: the buffers are laid out row by
    row in memory (``[B, capacity, Hkv, D]``, seen transposed), so one row of every head is
    contiguous: a reader's own rows, which a batched decode step writes for many readers in
    one launch (:func:`write_rows`); a prefix's rows stay head by head."""

    def __init__(self, headroom: int = HEADROOM, dtype: torch.dtype | None = None,
                 rows_outer: bool = False):
        super().__init__()
        self.headroom = int(headroom)
        self.store_dtype = dtype
        self.rows_outer = rows_outer
        self.k_buf = self.v_buf = None
        self.k_scale = self.v_scale = None
        self.length = 0

    @property
    def quantized(self) -> bool:
        return self.store_dtype == FP8

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if self.k_buf is None or end > self.k_buf.shape[-2]:
            self._grow(end + self.headroom, key_states, value_states)
        if self.quantized:
            if self.k_scale is None:       # the first write (the prefix) sets the scales
                self.k_scale = head_scales(key_states)
                self.v_scale = head_scales(value_states)
            quantize_into(self.k_buf[..., self.length:end, :], key_states, self.k_scale)
            quantize_into(self.v_buf[..., self.length:end, :], value_states, self.v_scale)
        else:
            self.k_buf[..., self.length:end, :].copy_(key_states)
            self.v_buf[..., self.length:end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, capacity: int, k, v) -> None:
        B, H, _, D = k.shape
        dt = self.store_dtype or k.dtype
        if self.rows_outer:
            k_new = k.new_empty(B, capacity, H, D, dtype=dt).transpose(1, 2)
            v_new = v.new_empty(B, capacity, v.shape[1], v.shape[-1], dtype=dt).transpose(1, 2)
        else:
            k_new = k.new_empty(B, H, capacity, D, dtype=dt)
            v_new = v.new_empty(B, v.shape[1], capacity, v.shape[-1], dtype=dt)
        if self.k_buf is not None and self.length:
            k_new[..., :self.length, :].copy_(self.k_buf[..., :self.length, :])
            v_new[..., :self.length, :].copy_(self.v_buf[..., :self.length, :])
        self.k_buf, self.v_buf = k_new, v_new

    def load(self, k, v) -> None:
        """``k``/``v`` ``[B, Hkv, n, D]``, rows already in the storage dtype (FP8: quantised
        with this layer's scales), as the layer's only rows, with ``headroom`` rows of room
        past them."""
        n = k.shape[-2]
        self.k_buf = self.v_buf = None
        self._grow(n + self.headroom, k, v)
        self.k_buf[..., :n, :].copy_(k)
        self.v_buf[..., :n, :].copy_(v)
        self.device, self.is_initialized = k.device, True
        self._set_length(n)

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys = self.k_buf[..., :n, :]
        self.values = self.v_buf[..., :n, :]
        if self.quantized:
            self.keys.kv_scale, self.values.kv_scale = self.k_scale, self.v_scale

    def get_seq_length(self, *args) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        self._set_length(min(max(max_length, 0), self.length))

    def reset(self) -> None:
        self.k_buf = self.v_buf = self.keys = self.values = None
        self.k_scale = self.v_scale = None
        self.length = 0
        self.is_initialized = False

    @property
    def capacity(self) -> int:
        """Rows the buffers have room for (the rows held and the room past them)."""
        return 0 if self.k_buf is None else self.k_buf.shape[-2]

    def _row_bytes(self) -> int:
        return (self.k_buf[..., :1, :].numel() * self.k_buf.element_size()
                + self.v_buf[..., :1, :].numel() * self.v_buf.element_size())

    def _scale_bytes(self) -> int:
        return sum(s.untyped_storage().nbytes() for s in (self.k_scale, self.v_scale)
                   if s is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (not the room past them), and the FP8 scales: what a pass
        over the cache reads."""
        if self.k_buf is None:
            return 0
        return self._row_bytes() * self.length + self._scale_bytes()

    @property
    def held_bytes(self) -> int:
        """Every byte the layer keeps: its buffers' storage (the room past the rows too) and
        the FP8 scales."""
        if self.k_buf is None:
            return 0
        return (self.k_buf.untyped_storage().nbytes() + self.v_buf.untyped_storage().nbytes()
                + self._scale_bytes())

    def bytes_at(self, rows: int) -> int:
        """:attr:`held_bytes` once the buffers have room for ``rows`` rows."""
        if self.k_buf is None:
            return 0
        return self._row_bytes() * rows + self._scale_bytes()

    def cut(self, start: int, n: int) -> None:
        """Rows ``[start, start + n)`` dropped: the rows after them move down ``n`` rows in
        place (the buffers keep their size; the freed rows become room). The rows keep the
        values they have (their positions were applied when they were written)."""
        n = min(max(int(n), 0), self.length - start)
        if self.k_buf is None or n <= 0:
            return
        c = max(n, CUT_CHUNK)
        with torch.inference_mode():         # the buffers are written under it by a prefill
            for buf in (self.k_buf, self.v_buf):
                for a in range(start, self.length - n, c):
                    b = min(a + c, self.length - n)
                    src = buf[..., a + n:b + n, :]
                    buf[..., a:b, :].copy_(src if b - a <= n else src.clone())
        self._set_length(self.length - n)

    def _copied(self, device, pin: bool, headroom: int) -> tuple:
        """New buffers on ``device`` holding the rows, with ``headroom`` rows of room, and the
        scales there; the layer itself is not changed."""
        n = self.length
        k, v = self.k_buf[..., :n, :], self.v_buf[..., :n, :]
        shape_k = (*k.shape[:2], n + headroom, k.shape[-1])
        shape_v = (*v.shape[:2], n + headroom, v.shape[-1])
        k_new = torch.empty(shape_k, dtype=k.dtype, device=device, pin_memory=pin)
        v_new = torch.empty(shape_v, dtype=v.dtype, device=device, pin_memory=pin)
        k_new[..., :n, :].copy_(k, non_blocking=True)
        v_new[..., :n, :].copy_(v, non_blocking=True)
        scales = (None, None)
        if self.k_scale is not None:
            scales = (self.k_scale.to(device, non_blocking=True),
                      self.v_scale.to(device, non_blocking=True))
        return k_new, v_new, *scales

    def _adopt(self, device, copied: tuple) -> None:
        self.k_buf, self.v_buf, k_scale, v_scale = copied
        if k_scale is not None:
            self.k_scale, self.v_scale = k_scale, v_scale
        self.device = torch.device(device)
        self._set_length(self.length)

    def move(self, device, *, pin: bool = False, headroom: int = 0) -> None:
        """The held rows to ``device`` (pinned host memory with ``pin``), with ``headroom``
        rows of room; the old buffers are dropped. FP8 rows move as they are, with their
        scales. Moving to the device the layer is on resizes its room (one copy of the
        rows)."""
        if self.k_buf is not None:
            self._adopt(device, self._copied(device, pin, headroom))


class PrefixKV(DynamicCache):
    """A DynamicCache whose layers are :class:`SlabLayer` s (see the module doc); ``dtype``:
    what they store (None: the model's dtype; FP8)."""

    def __init__(self, n_layers: int, headroom: int = HEADROOM, dtype=None):
        try:
            super().__init__()
        except TypeError:     # pragma: no cover - signatures that insist on arguments
            super().__init__(config=None)
        self.store_dtype = kv_dtype(dtype)
        self.layers = [SlabLayer(headroom, self.store_dtype) for _ in range(n_layers)]
        # the reader whose rows are in the tail now (a weak reference to its _TailClaim: a
        # fork dropped without ForkKV.release frees the tail with it)
        self._tail = None

    @classmethod
    def for_model(cls, text_model, headroom: int = HEADROOM, dtype=None) -> "PrefixKV":
        return cls(len(text_model.layers), headroom, dtype)

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.layers[layer_idx].length if self.layers else 0

    @property
    def length(self) -> int:
        return self.get_seq_length()

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held and the FP8 scales (what a pass over the cache reads)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def held_bytes(self) -> int:
        """Every byte the cache keeps: the buffers' storage, room past the rows included, and
        the scales (what the video cache charges an entry)."""
        return sum(layer.held_bytes for layer in self.layers)

    @property
    def capacity(self) -> int:
        """Rows the largest layer buffer has room for."""
        return max((layer.capacity for layer in self.layers), default=0)

    def bytes_at(self, rows: int) -> int:
        """:attr:`held_bytes` once every layer has room for ``rows`` rows."""
        return sum(layer.bytes_at(rows) for layer in self.layers)

    @property
    def tail_claimed(self) -> bool:
        """A reader's rows are in the room past the rows (ForkKV ``claim=True``)."""
        held = self._tail
        return held is not None and held() is not None

    def _claim_tail(self, shared: int) -> "_TailClaim | None":
        """The room past the rows for one reader of all of them, or None: another reader
        holds it, there is none, or ``shared`` is not every row (the rows after it are the
        prefix's, never a reader's to write)."""
        with _CLAIM_LOCK:
            if self.tail_claimed or not self.layers or any(
                    layer.k_buf is None or layer.length != shared or layer.capacity <= shared
                    for layer in self.layers):
                return None
            claim = _TailClaim(self, len(self.layers))
            self._tail = weakref.ref(claim)
            return claim

    def _unclaimed(self, what: str) -> None:
        if self.tail_claimed:
            raise RuntimeError(f"cannot {what} a prefix while a reader's rows are in its tail")

    def truncate(self, n: int) -> None:
        """Back to the first ``n`` rows (a question's rows after its prefix are dropped)."""
        self._unclaimed("truncate")
        for layer in self.layers:
            layer.crop(n)

    def cut(self, start: int, n: int) -> None:
        """Rows ``[start, start + n)`` of every layer dropped (:meth:`SlabLayer.cut`)."""
        self._unclaimed("cut rows of")
        for layer in self.layers:
            layer.cut(start, n)

    def trim(self, room: int) -> None:
        """Leave at most ``room`` rows of room past the rows held: a layer with more is copied
        into a smaller buffer, one layer at a time (one layer's rows of extra memory while it
        runs; a failure part way leaves every layer whole)."""
        self._unclaimed("trim")
        for layer in self.layers:
            if layer.capacity > layer.length + room:
                layer.move(layer.device, headroom=room)

    def move(self, device, *, pin: bool = False, headroom: int = 0) -> None:
        """Every layer to ``device`` (see :meth:`SlabLayer.move`), all or nothing: the new
        buffers are allocated and filled for every layer before any layer takes them, so an
        error while copying (out of memory, an interrupt) leaves the cache where it was. A
        reader holding the tail (never one of a video cache entry's: its readers pin it)
        keeps the old buffers, which it writes and reads alone from then on; the new ones'
        tail is free."""
        self.adopt(device, self.copies(device, pin=pin, headroom=headroom))

    def copies(self, device, *, pin: bool = False, headroom: int = 0) -> list:
        """:meth:`move`'s first half: every layer's rows in new buffers on ``device``, the
        cache unchanged (the copies are queued on the current stream)."""
        return [layer._copied(device, pin, headroom) if layer.k_buf is not None else None
                for layer in self.layers]

    def adopt(self, device, copies: list) -> None:
        """:meth:`move`'s second half: every layer takes its copy; the old buffers go."""
        for layer, c in zip(self.layers, copies):
            if c is not None:
                layer._adopt(device, c)
        with _CLAIM_LOCK:
            self._tail = None


class _TailClaim:
    """One reader's hold on a prefix's tail, shared by its ForkLayers: given back by
    :meth:`ForkKV.release`, when the last of its layers has left the tail, or when the fork
    is dropped (the prefix refers to it weakly)."""

    __slots__ = ("prefix", "left", "__weakref__")

    def __init__(self, prefix: PrefixKV, layers: int):
        self.prefix, self.left = prefix, layers

    def layer_left(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.give_back()

    def give_back(self) -> None:
        with _CLAIM_LOCK:
            p, self.prefix = self.prefix, None
            if p is not None and p._tail is not None and p._tail() is self:
                p._tail = None


class ForkLayer(DynamicLayer):
    """One layer of a :class:`ForkKV`: the first ``shared`` rows of a prefix's SlabLayer,
    read and never written, then this reader's own rows in a SlabLayer of its own (row by row
    in memory, for :func:`write_rows`; in the prefix's storage dtype; FP8 rows quantised with
    the prefix's scales, as rows appended to the prefix's own slab would be).
    ``keys``/``values`` are the views of the reader's rows, carrying the prefix's views as
    ``kv_prefix`` (:func:`prefix_of`) and, FP8, their scales as ``kv_scale``.

    With a claim on the prefix's tail (``claim``), the reader's rows go instead into the
    prefix's own buffers after the shared rows, through ``tail`` (a SlabLayer over those
    buffers), and ``keys``/``values`` are plain views ``[..., :shared + own, :]`` of them:
    a cache in one piece, attended as one. A write the tail has no room for first moves the
    rows written there into the own SlabLayer (at most TAIL_ROWS rows: a small copy, once),
    and the layer is an ordinary one from then on; the prefix's rows are never moved."""

    def __init__(self, base: SlabLayer, shared: int, headroom: int, claim=None):
        super().__init__()
        self.base, self.shared = base, int(shared)
        self.own = SlabLayer(headroom, base.store_dtype, rows_outer=True)
        self.own.k_scale, self.own.v_scale = base.k_scale, base.v_scale
        self.claim, self.tail, self.released = claim, None, False
        self._prefix = None
        if claim is not None:
            tail = self.tail = SlabLayer(0, base.store_dtype)
            tail.k_buf, tail.v_buf = base.k_buf, base.v_buf
            tail.k_scale, tail.v_scale = base.k_scale, base.v_scale
            tail.device, tail.is_initialized = base.k_buf.device, True
            tail.length = self.shared

    @property
    def quantized(self) -> bool:
        return self.own.quantized

    @property
    def k_scale(self):
        """The prefix's FP8 scales (as they were when it was forked), which its rows use."""
        return self.own.k_scale

    @property
    def v_scale(self):
        return self.own.v_scale

    @property
    def in_tail(self) -> bool:
        """Its rows are in the prefix's tail: ``keys``/``values`` are a cache in one piece."""
        return self.tail is not None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def prefix(self) -> tuple:
        """The shared rows' K and V views ``[1, Hkv, shared, D]`` (made again only when the
        prefix's buffers are other tensors: moved, grown)."""
        b, seen = self.base, self._prefix
        if seen is None or seen[0] is not b.k_buf or seen[1] is not b.v_buf:
            n = self.shared
            seen = self._prefix = (b.k_buf, b.v_buf, b.k_buf[..., :n, :], b.v_buf[..., :n, :])
        return seen[2], seen[3]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tail = self.tail
        if tail is not None:
            if tail.length + key_states.shape[-2] <= tail.k_buf.shape[-2]:
                self.keys, self.values = tail.update(key_states, value_states)
                return self.keys, self.values
            self._leave_tail()
        elif self.released:
            raise RuntimeError("this fork gave its prefix's tail back (ForkKV.release): its "
                               "rows there are not its own any more")
        self.own.update(key_states, value_states)
        self._views()
        return self.keys, self.values

    def _leave_tail(self) -> None:
        """The rows written in the tail into the own SlabLayer (as they are stored), the
        tail left: an ordinary fork layer from here."""
        tail, a = self.tail, self.shared
        if tail.length > a:
            self.own.load(tail.k_buf[..., a:tail.length, :], tail.v_buf[..., a:tail.length, :])
        self.tail = None
        self._views()
        self.claim.layer_left()

    def _views(self) -> None:
        self.keys, self.values = self.own.keys, self.own.values
        if self.keys is not None:
            self.keys.kv_prefix, self.values.kv_prefix = self.prefix()

    def _release(self) -> None:
        """The tail given back: its rows there are no longer this layer's."""
        if self.tail is not None:
            self.tail = None
            self.keys = self.values = None
            self.released = True

    def get_seq_length(self, *args) -> int:
        if self.tail is not None:
            return self.tail.length
        return self.shared + self.own.length

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if self.tail is not None:
            self.tail.crop(max(max_length, self.shared))
            self.keys, self.values = self.tail.keys, self.tail.values
        elif self.own.k_buf is not None:
            self.own.crop(max(max_length - self.shared, 0))
            self._views()

    def reset(self) -> None:
        if self.tail is not None:
            self.tail.length = self.shared
        self.own.reset()
        self.own.k_scale, self.own.v_scale = self.base.k_scale, self.base.v_scale
        self.keys = self.values = None
        self.is_initialized = False

    @property
    def held_bytes(self) -> int:
        """The reader's own buffers (the shared rows and the tail are the prefix's)."""
        return self.own.held_bytes


def write_rows(layers, k, v) -> list:
    """One decode step's K/V of several caches at once: ``layers[j]`` (a SlabLayer or a
    ForkLayer, each of another cache) takes row j of ``k``/``v`` (``[M, Hkv, 1, D]``)
    exactly as ``layers[j].update`` would; returns the ``(keys, values)`` each update returns.
    The rows of ordinary forks (room for one more row, the model's dtype: a plain copy each)
    are copied together by one ``torch._foreach_copy_``, one launch on a GPU for all of them
    (its fast path wants every row contiguous: a fork's own rows are kept row by row); the
    others (FP8 rows, quantised on the way; a prefix's rows; a tail; a buffer that must
    grow) through their ``update``."""
    k_rows, v_rows = k[:, :, 0].unbind(0), v[:, :, 0].unbind(0)      # [Hkv, D] each
    out = [None] * len(layers)
    fast, dst, src = [], [], []
    for j, layer in enumerate(layers):
        own = getattr(layer, "own", None)
        if (own is not None and layer.tail is None and not layer.released
                and layer.is_initialized and own.k_buf is not None and not own.quantized
                and own.length < own.k_buf.shape[-2]):
            n = own.length
            fast.append(j)
            dst += (own.k_buf[0, :, n], own.v_buf[0, :, n])
            src += (k_rows[j], v_rows[j])
        else:
            out[j] = layer.update(k[j:j + 1], v[j:j + 1])
    if fast:
        torch._foreach_copy_(dst, src)
        for j in fast:
            layer = layers[j]
            layer.own._set_length(layer.own.length + 1)
            layer._views()
            out[j] = layer.keys, layer.values
    return out


def prefix_of(t: torch.Tensor):
    """The shared prefix's K or V view a ForkLayer's ``keys``/``values`` carry (None: a
    cache in one piece)."""
    return getattr(t, "kv_prefix", None)


class ForkKV(DynamicCache):
    """A question's KV cache over a kept prefix: the prefix's first ``shared`` rows, shared
    with every other reader and never written, and the question's and answer's rows in
    buffers of this reader's own (``headroom`` rows past the first write before they grow).
    Any number of readers fork one prefix at once; the attention over the two segments is
    one flash-decoding launch (mminfer.kernels.fp8_attention.split_attention, through
    mminfer.models.hooks), which reads them as their concatenation without making it. Its
    owner drops it when the answer is done: nothing to truncate.

    ``claim=True``: where the prefix keeps room past its rows (its tail: a video cache
    entry's, :func:`tail_rows`), ``shared`` is all of them and no other reader holds the
    tail, this reader takes it (:attr:`in_tail`) and writes its rows there in place: its
    layers' ``keys``/``values`` are plain views of the prefix's buffers, carrying no
    ``kv_prefix``, so every attention path (the hook, the lean step and its CUDA graphs, the
    batched step) runs the kernels a prefix of its own would run (the split kernel over two
    segments measured +28 % a decode step at 115K tokens on an H100). One reader at a time: the others read ``[0, shared)`` alone, as ordinary forks,
    and never see the tail. Rows the tail has no room for move the reader's rows into
    buffers of its own (:class:`ForkLayer`). The tail is given back by :meth:`release`
    (call it when the answer is done: a reader that held the tail cannot be used after),
    when every layer has left it, or when the fork is dropped. Only a prefix no one appends
    to may be claimed (a video cache entry; a live stream's cache is never)."""

    def __init__(self, prefix: PrefixKV, shared: int, headroom: int = HEADROOM,
                 claim: bool = False):
        try:
            super().__init__()
        except TypeError:     # pragma: no cover - signatures that insist on arguments
            super().__init__(config=None)
        if any(layer.length < shared for layer in prefix.layers):
            raise ValueError(f"the prefix holds fewer than the {shared} rows to share")
        self.prefix = prefix
        self.store_dtype = prefix.store_dtype
        self._claim = prefix._claim_tail(shared) if claim else None
        self.layers = [ForkLayer(layer, shared, headroom, self._claim)
                       for layer in prefix.layers]

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.layers[layer_idx].get_seq_length() if self.layers else 0

    @property
    def length(self) -> int:
        return self.get_seq_length()

    @property
    def in_tail(self) -> bool:
        """It holds the prefix's tail and its layers' rows are there (a cache in one
        piece); once a write outgrows the tail, or after :meth:`release`, False."""
        claim = self._claim
        return claim is not None and claim.left > 0

    def release(self) -> None:
        """Give the prefix's tail back, if this reader holds it (idempotent; nothing for an
        ordinary fork). Its rows there become the next claimer's to overwrite: a reader that
        held the tail raises on its next write."""
        claim, self._claim = self._claim, None
        if claim is None:
            return
        for layer in self.layers:
            layer._release()
        claim.left = 0
        claim.give_back()

    @property
    def held_bytes(self) -> int:
        """This reader's own bytes (what it holds on top of the prefix while it answers)."""
        return sum(layer.held_bytes for layer in self.layers)
