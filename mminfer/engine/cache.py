"""The video cache: a video's prefix, prefilled once, answers every later question about it.

An entry is the KV cache of a prompt's prefix (everything up to and including the video:
mminfer.models.base.Conversation) plus what a suffix needs to continue it (the prefix length,
the M-RoPE offset, the prefix's ModalityIndex) and what the answer reports of the video. Its
key (:func:`cache_key`) is the video's content hash and everything that changes the prefix's
tokens or values: the model and its revision, dtype, what the KV cache stores (the model's
dtype or FP8: ``--kv-cache-dtype``), the sampling (fps, max_frames, start, end), the pixel
budget, the attention mode and its threshold, the head-pattern config, the quantization of
the linear layers (fp8 or none), and the turns before the video. A changed byte, model or
config is another key: a miss, never a stale hit. An FP8 entry holds half of bf16's bytes
(its ``nbytes``: the rows and their per-head scales) and moves between the tiers as it is.

Tiers (vLLM's v1 KV offload, at entry granularity): entries live on the model's device within
``gpu_bytes`` (``--kv-cache-gb``); the least recently used spill to pinned host memory within
``host_bytes`` (``--kv-host-cache-gb``; 0: no host tier, they are dropped) and come back on a
hit. An entry being read is pinned (never moved or evicted); a request that reads one holds
its lock, so two questions on one video run one after the other (each appends its own rows
after the prefix). A prefill that needs the memory asks :meth:`VideoCache.make_room` first.
Only a finished prefix is inserted: a cancelled or failed prefill leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

# Default GPU budget: this share of the device's memory (H200: 70 of 141 GB, room for one
# 1M-token LongVILA-7B prefix, 60 GB, beside the 16 GB of weights; a new long prefill first
# spills what it needs room for: make_room); on the CPU, 2 GiB.
GPU_SHARE = 0.5
CPU_DEFAULT_BYTES = 2 << 30
# Free memory kept for a new prefill on top of its KV cache: activations of its chunked
# prefill (models/prefill.py: the MLP's chunk temporaries, q and the attention output).
PREFILL_SLACK = 0.25

_digests: dict = {}
_digest_lock = threading.Lock()


def file_digest(path) -> str:
    """sha256 of the file's bytes, hex. Memoised by the file's identity and change stamps
    (device, inode, size, mtime and ctime in ns): any write through the filesystem changes
    ctime, which no user can set back, so a changed file is hashed again."""
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
             st.st_ctime_ns)
    with _digest_lock:
        hit = _digests.get(stamp)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    with _digest_lock:
        if len(_digests) > 4096:
            _digests.clear()
        _digests[stamp] = digest
    return digest


def cache_key(**parts) -> str:
    """A key from named parts (JSON-able values): sorted, so their order never matters."""
    blob = json.dumps(parts, sort_keys=True, default=str, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Entry:
    """A prefix ready to be continued: ``kv`` (models.kv.PrefixKV) holds ``length`` rows."""
    kv: object
    length: int                        # prefix tokens
    rope_delta: int = 0                # position of token i after the video: i + rope_delta
    index: object = None               # ModalityIndex of the prefix
    facts: dict = field(default_factory=dict)   # video facts, sparsity, the build's timings
    tier: str = "gpu"                  # "gpu" | "host"
    nbytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    readers: int = 0


class Slot:
    """What :meth:`VideoCache.use` yields: ``entry`` (None on a miss), ``status`` ("hit",
    "host", "miss" or "off"), ``restore_ms``; on a miss :meth:`store` inserts the built entry
    (kept pinned until the block ends)."""

    def __init__(self, cache, key, entry, status, restore_ms=0.0):
        self.cache, self.key, self.entry, self.status = cache, key, entry, status
        self.restore_ms = restore_ms

    def store(self, entry: Entry) -> None:
        entry.lock.acquire()             # the request that built it reads it now
        entry.readers += 1
        self.entry = entry
        if self.cache is not None and self.key is not None:
            self.cache._insert(self.key, entry)

    def _release_built(self) -> None:
        e = self.entry
        if e is not None:
            if e.kv is not None:
                e.kv.truncate(e.length)
            e.readers -= 1
            e.lock.release()


class VideoCache:
    def __init__(self, device, gpu_bytes: int | None = None, host_bytes: int = 0):
        # lazy: torch takes seconds to import, and `mminfer --help` imports this module
        import torch
        self.device = torch.device(device)
        if gpu_bytes is None:
            if self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                gpu_bytes = int(total * GPU_SHARE)
            else:
                gpu_bytes = CPU_DEFAULT_BYTES
        self.gpu_budget = max(int(gpu_bytes), 0)
        self.host_budget = max(int(host_bytes), 0)
        self._entries: OrderedDict[str, Entry] = OrderedDict()   # LRU first
        self._lock = threading.RLock()
        self.counts = dict(queries=0, hits=0, host_hits=0, misses=0, evictions_gpu=0,
                           evictions_host=0, inserted=0, rejected=0)

    # ------------------------------------------------------------ reading
    @property
    def enabled(self) -> bool:
        return self.gpu_budget > 0

    @contextmanager
    def use(self, key: str | None):
        """The entry under ``key`` for the duration of the block, pinned and locked (back on
        the device if it was on the host); a miss yields an empty slot to :meth:`Slot.store`
        into. ``key`` None: the cache is off for this request."""
        if key is None or not self.enabled:
            slot = Slot(None, None, None, "off")
            try:
                yield slot
            finally:
                slot._release_built()
            return
        with self._lock:
            self.counts["queries"] += 1
            entry = self._entries.get(key)
            if entry is not None:
                entry.readers += 1
                self._entries.move_to_end(key)
        if entry is None:
            with self._lock:
                self.counts["misses"] += 1
            slot = Slot(self, key, None, "miss")
            try:
                yield slot
            finally:
                with self._lock:
                    slot._release_built()
            return
        try:
            entry.lock.acquire()          # one question at a time appends after the prefix
            try:
                status, restore_ms = "hit", 0.0
                if entry.tier == "host":
                    t0 = time.perf_counter()
                    self._to_device(entry)
                    restore_ms = (time.perf_counter() - t0) * 1e3
                    status = "host"
                with self._lock:
                    self.counts["hits"] += 1
                    self.counts["host_hits"] += status == "host"
                slot = Slot(self, key, entry, status, restore_ms)
                yield slot
            finally:
                entry.kv.truncate(entry.length)   # the question's rows go, the prefix stays
                entry.lock.release()
        finally:
            with self._lock:
                entry.readers -= 1

    # ------------------------------------------------------------ tiers
    def _insert(self, key: str, entry: Entry) -> None:
        entry.nbytes = entry.kv.nbytes
        with self._lock:
            if entry.nbytes > self.gpu_budget:
                self.counts["rejected"] += 1       # served, never kept: over the budget
                return
            old = self._entries.pop(key, None)
            if old is not None and old.readers == 0:
                old.kv = None
            self._entries[key] = entry
            self.counts["inserted"] += 1
            self._fit_gpu(self.gpu_budget)

    def _to_device(self, entry: Entry) -> None:
        """A host entry back on the device (room made first, within the budget)."""
        import torch  # lazy: as in __init__
        with self._lock:
            entry.tier = "moving"     # its host copy is freed once it is back: not counted
            self._fit_gpu(self.gpu_budget - entry.nbytes, keep=entry)
        # lazy: kv imports torch and transformers (seconds), as in __init__
        from mminfer.models.kv import HEADROOM
        entry.kv.move(self.device, headroom=HEADROOM)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        entry.tier = "gpu"

    def _fit_gpu(self, budget: int, keep: Entry | None = None) -> None:
        """Spill idle GPU entries, least recently used first, until those on the GPU hold at
        most ``budget`` bytes."""
        for key, e in list(self._entries.items()):
            if self._bytes("gpu") <= budget:
                break
            if e.tier != "gpu" or e.readers or e is keep:
                continue
            self._spill(key, e)

    def _spill(self, key: str, e: Entry) -> None:
        self.counts["evictions_gpu"] += 1
        if e.nbytes <= self.host_budget:
            self._fit_host(self.host_budget - e.nbytes)
            if self._bytes("host") + e.nbytes <= self.host_budget:
                pin = self.device.type == "cuda"
                e.kv.move("cpu", pin=pin)
                e.tier = "host"
                return
        del self._entries[key]
        e.kv = None

    def _fit_host(self, budget: int) -> None:
        for key, e in list(self._entries.items()):
            if self._bytes("host") <= budget:
                break
            if e.tier == "host" and not e.readers:
                del self._entries[key]
                e.kv = None
                self.counts["evictions_host"] += 1

    def _bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.tier == tier)

    def make_room(self, need_bytes: int) -> None:
        """Before a prefill that will hold ``need_bytes`` of KV cache: spill idle entries
        until the device has that much free (plus the prefill's slack) or none is left."""
        import torch  # lazy: as in __init__
        if self.device.type != "cuda":
            return
        want = int(need_bytes * (1 + PREFILL_SLACK))
        with self._lock:
            for key, e in list(self._entries.items()):
                free, _ = torch.cuda.mem_get_info(self.device)
                if free >= want:
                    break
                if e.tier == "gpu" and not e.readers:
                    self._spill(key, e)
                    torch.cuda.empty_cache()

    def offload(self) -> int:
        """Move every idle device entry to the host tier (within its budget); returns how
        many moved. For an operator freeing the device, and for measuring the host tier."""
        moved = 0
        with self._lock:
            for key, e in list(self._entries.items()):
                if e.tier == "gpu" and not e.readers and e.nbytes <= self.host_budget:
                    self._spill(key, e)
                    moved += e.tier == "host"
        return moved

    def clear(self) -> None:
        with self._lock:
            for key, e in list(self._entries.items()):
                if not e.readers:
                    del self._entries[key]
                    e.kv = None

    def stats(self) -> dict:
        with self._lock:
            tiers = [e.tier for e in self._entries.values()]
            return {**self.counts,
                    "gpu_entries": tiers.count("gpu"), "host_entries": tiers.count("host"),
                    "gpu_bytes": self._bytes("gpu"), "host_bytes": self._bytes("host"),
                    "gpu_budget_bytes": self.gpu_budget, "host_budget_bytes": self.host_budget}
