"""The KV cache of one prompt, in one preallocated buffer per layer: a prefix's cache that many
questions continue.

transformers' ``DynamicCache`` grows by ``torch.cat`` on every update: each decode step copies
the whole cache of every layer (6.6 GB at 115K tokens for a 7B model), and a question asked on
a kept prefix would copy the prefix before appending to it. Here each layer's K and V live in a
buffer with room past the prompt (``headroom`` tokens); an update writes its rows in place and
the layer's ``keys``/``values`` are views of the rows written so far. Rows ``[0, prefix)`` are
never written again once the prefix is built, so a question appends its own rows after the
prefix, reads every row, and :meth:`PrefixKV.truncate` gives the buffer back to the prefix for
the next question without copying anything.

The layers subclass transformers' ``DynamicLayer`` and keep its ``keys``/``values`` attributes,
so the mask sizes and sequence lengths transformers reads from them stay right (5.17 and 5.24).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Rows of room past the prompt: a question and its answer (grown, one copy, when more is asked).
HEADROOM = 1024


class SlabLayer(DynamicLayer):
    """One layer's K and V in ``[B, Hkv, capacity, D]`` buffers; ``keys``/``values`` are the
    views ``[..., :length, :]``."""

    def __init__(self, headroom: int = HEADROOM):
        super().__init__()
        self.headroom = int(headroom)
        self.k_buf = self.v_buf = None
        self.length = 0

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
        self.k_buf[..., self.length:end, :].copy_(key_states)
        self.v_buf[..., self.length:end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def _grow(self, capacity: int, k, v) -> None:
        B, H, _, D = k.shape
        k_new = k.new_empty(B, H, capacity, D)
        v_new = v.new_empty(B, v.shape[1], capacity, v.shape[-1])
        if self.k_buf is not None and self.length:
            k_new[..., :self.length, :].copy_(self.k_buf[..., :self.length, :])
            v_new[..., :self.length, :].copy_(self.v_buf[..., :self.length, :])
        self.k_buf, self.v_buf = k_new, v_new

    def _set_length(self, n: int) -> None:
        self.length = n
        self.keys = self.k_buf[..., :n, :]
        self.values = self.v_buf[..., :n, :]

    def get_seq_length(self, *args) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        self._set_length(min(max(max_length, 0), self.length))

    def reset(self) -> None:
        self.k_buf = self.v_buf = self.keys = self.values = None
        self.length = 0
        self.is_initialized = False

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (not the headroom)."""
        if self.k_buf is None:
            return 0
        per_row = self.k_buf[..., :1, :].numel() * self.k_buf.element_size()
        per_row += self.v_buf[..., :1, :].numel() * self.v_buf.element_size()
        return per_row * self.length

    def move(self, device, *, pin: bool = False, headroom: int = 0) -> None:
        """The held rows to ``device`` (pinned host memory with ``pin``), with ``headroom``
        rows of room; the old buffers are dropped."""
        n = self.length
        k, v = self.k_buf[..., :n, :], self.v_buf[..., :n, :]
        shape_k = (*k.shape[:2], n + headroom, k.shape[-1])
        shape_v = (*v.shape[:2], n + headroom, v.shape[-1])
        k_new = torch.empty(shape_k, dtype=k.dtype, device=device, pin_memory=pin)
        v_new = torch.empty(shape_v, dtype=v.dtype, device=device, pin_memory=pin)
        k_new[..., :n, :].copy_(k, non_blocking=True)
        v_new[..., :n, :].copy_(v, non_blocking=True)
        self.k_buf, self.v_buf, self.device = k_new, v_new, torch.device(device)
        self._set_length(n)


class PrefixKV(DynamicCache):
    """A DynamicCache whose layers are :class:`SlabLayer` s (see the module doc)."""

    def __init__(self, n_layers: int, headroom: int = HEADROOM):
        try:
            super().__init__()
        except TypeError:     # pragma: no cover - signatures that insist on arguments
            super().__init__(config=None)
        self.layers = [SlabLayer(headroom) for _ in range(n_layers)]

    @classmethod
    def for_model(cls, text_model, headroom: int = HEADROOM) -> "PrefixKV":
        return cls(len(text_model.layers), headroom)

    def get_seq_length(self, layer_idx: int = 0, *args) -> int:
        return self.layers[layer_idx].length if self.layers else 0

    @property
    def length(self) -> int:
        return self.get_seq_length()

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def truncate(self, n: int) -> None:
        """Back to the first ``n`` rows (a question's rows after its prefix are dropped)."""
        for layer in self.layers:
            layer.crop(n)

    def move(self, device, *, pin: bool = False, headroom: int = 0) -> None:
        for layer in self.layers:
            layer.move(device, pin=pin, headroom=headroom)
