"""Tensor parallelism for the language model: one request spread over N processes.

Started by ``torchrun --nproc-per-node N -m mminfer answer ... --tensor-parallel N``. Each
rank loads the checkpoint, then :func:`shard_decoder` keeps only its slice of every decoder
layer (Megatron's split): q/k/v and MLP gate/up are split by output rows (whole heads, whole
KV heads), o_proj and MLP down by input columns, and their outputs are summed over ranks with
one all-reduce each — the only communication. The KV cache each rank writes therefore holds
only its own KV heads. Embeddings, norms, lm_head and the vision tower stay whole on every
rank; the vision tower's *work* is split instead (:class:`FrameShards`): each rank runs it on
its share of the chunks of frames and the features are all-gathered.

Sparse attention needs nothing gathered: rank ``r`` holds global heads ``r * local + h``, and
the attention hook reads their patterns with ``HeadPatternConfig.heads_for_rank`` (the
sharded attention module carries ``tp_rank``), estimating and running the kernels for those
heads only.
"""

from __future__ import annotations

import atexit
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

from mminfer.errors import ConfigError


def check_launch(world_size: int) -> int:
    """This process's rank among the ``world_size`` torchrun started (ConfigError, saying
    how to start them, when it did not)."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != world_size:
        raise ConfigError(
            f"--tensor-parallel {world_size} needs {world_size} processes, started by "
            f"`torchrun --nproc-per-node {world_size} -m mminfer ...`; this process sees "
            f"WORLD_SIZE={env_world}")
    return int(os.environ.get("RANK", "0"))


def init_from_env(world_size: int, device_type: str):
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR ...): NCCL on
    GPUs, gloo on the CPU. Returns ``(rank, local_rank)``."""
    check_launch(world_size)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        # Left to the interpreter's teardown, a group's worker threads can still be joinable
        # when their C++ objects are destroyed: std::terminate, exit code -6, after the
        # answer was printed (seen with gloo under load). Tear the groups down first.
        atexit.register(leave)
    return dist.get_rank(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))


def leave():
    """Tear this process's groups down (idempotent)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:       # a peer already gone: nothing left to tear down cleanly
            pass
    # Groups (and the store under them) that reference cycles still hold would otherwise die
    # in the interpreter's final teardown, after rank 0, which hosts the store, may have
    # exited: a follower then aborts (std::terminate, SIGABRT) after its work was done. In
    # tests/engine/test_parallel_lockstep.py that was 2 runs in 12 without this, 0 in 36 with.
    gc.collect()


def _row_parallel(linear, group):
    """A row-parallel ``nn.Linear``: this rank's partial product, summed over the ranks (its
    bias, if any, is kept on rank 0 only, so the sum adds it once)."""
    class RowParallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = linear

        @property
        def weight(self):       # callers that read .weight (dtype, device) still work
            return self.inner.weight

        def forward(self, x):
            y = self.inner(x)
            dist.all_reduce(y, group=group)
            return y

    return RowParallel()


def _keep_rows(linear, lo: int, hi: int):
    linear.weight = torch.nn.Parameter(linear.weight.data[lo:hi].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[lo:hi].clone(), requires_grad=False)
    linear.out_features = hi - lo


def _keep_cols(linear, lo: int, hi: int, rank: int):
    linear.weight = torch.nn.Parameter(linear.weight.data[:, lo:hi].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = hi - lo


def shard_decoder(text_model, rank: int, world: int, group=None) -> int:
    """Keep rank ``rank``'s slice of every decoder layer of ``text_model`` (in place).
    Returns the number of query heads each rank holds."""
    cfg = text_model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    inter = cfg.intermediate_size
    if heads % world or kv % world or inter % world:
        raise ConfigError(
            f"--tensor-parallel {world} must divide the model's {heads} query heads, {kv} KV "
            f"heads and MLP width {inter}")
    hq, hkv, mi = heads // world, kv // world, inter // world
    for layer in text_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        _keep_rows(attn.q_proj, rank * hq * d, (rank + 1) * hq * d)
        _keep_rows(attn.k_proj, rank * hkv * d, (rank + 1) * hkv * d)
        _keep_rows(attn.v_proj, rank * hkv * d, (rank + 1) * hkv * d)
        _keep_cols(attn.o_proj, rank * hq * d, (rank + 1) * hq * d, rank)
        attn.o_proj = _row_parallel(attn.o_proj, group)
        _keep_rows(mlp.gate_proj, rank * mi, (rank + 1) * mi)
        _keep_rows(mlp.up_proj, rank * mi, (rank + 1) * mi)
        _keep_cols(mlp.down_proj, rank * mi, (rank + 1) * mi, rank)
        mlp.down_proj = _row_parallel(mlp.down_proj, group)
        attn.tp_rank = rank      # the attention hook reads this rank's global heads
        for name in ("num_heads", "num_attention_heads"):
            if hasattr(attn, name):
                setattr(attn, name, hq)
        for name in ("num_key_value_heads",):
            if hasattr(attn, name):
                setattr(attn, name, hkv)
    return hq


class FrameShards:
    """The vision tower data-parallel over the adapter's chunks of frames.

    Every rank walks the same chunks in the same order (``Adapter.embed`` with ``shard=``);
    before running a chunk it asks :meth:`take` with the rows of its feature tensor that chunk
    fills, and runs it only when the chunk is this rank's (chunk ``k`` goes to rank
    ``k % world``: every chunk but the last is the same size, so the shares stay even however
    many chunks a video makes). :meth:`gather` then all-gathers the rows each rank filled, so
    every rank holds the whole video's features, equal to one process's: a chunk's features
    depend on its own frames only (Qwen2.5-VL's tower attends within a temporal pair, SigLIP
    within a frame) and each chunk is computed exactly as one process computes it.
    """

    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.spans: list[tuple[int, int]] = []      # rows of ``out`` per chunk, in order
        self.out = None

    def take(self, out, lo: int, hi: int) -> bool:
        """Chunk ``len(spans)`` fills ``out[lo:hi]``: True when this rank is to run it."""
        if self.out is None:
            self.out = out
        elif out.data_ptr() != self.out.data_ptr() or out.shape != self.out.shape:
            raise ValueError("FrameShards.take: every chunk must write into the same tensor")
        self.spans.append((int(lo), int(hi)))
        return (len(self.spans) - 1) % self.world == self.rank

    def mine(self, rank: int | None = None) -> list[tuple[int, int]]:
        r = self.rank if rank is None else rank
        return [s for k, s in enumerate(self.spans) if k % self.world == r]

    def gather(self):
        """Fill every other rank's rows of ``out`` with what that rank computed (a
        collective: every rank calls it after the same chunks)."""
        if not self.spans:
            return
        out = self.out
        shares = [self.mine(r) for r in range(self.world)]
        size = max(sum(hi - lo for lo, hi in s) for s in shares)    # equal-sized blocks
        with torch.inference_mode():
            send = out.new_zeros((size, *out.shape[1:]))
            at = 0
            for lo, hi in shares[self.rank]:
                send[at:at + hi - lo] = out[lo:hi]
                at += hi - lo
            recv = out.new_empty((self.world * size, *out.shape[1:]))
            all_gather_single(recv, send, self.group)
            for r, share in enumerate(shares):
                if r == self.rank:
                    continue
                at = r * size
                for lo, hi in share:
                    out[lo:hi] = recv[at:at + hi - lo]
                    at += hi - lo


def all_gather_single(out, inp, group=None):
    """``out`` = every rank's ``inp`` concatenated in rank order: ``all_gather_single``
    (torch >= 2.13, which deprecates the older name), else ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)
