"""One answer about one video, with the time each stage took.

    decode (video file -> frames) -> preprocess (resize, patchify, prompt, ModalityIndex)
    -> vision -> prefill (index + attention + llm_other) -> generate (one step per token)
    -> density (a sparse prefill's, counted from its plans) -> answer

Stages on the GPU are timed with CUDA events (StageTimer) and read once at the end; video
decoding runs on the CPU and is timed with the wall clock. ``llm_other`` is the prefill minus
the index estimation and attention inside it (projections, MLPs, norms).

Decode, preprocess and vision overlap: frames are decoded (at the model's size when the
source is much larger) in a background thread while earlier chunks of frames are
preprocessed and run through the vision tower. Each of the three is its own busy time
(decode: the decoder thread's wall time; preprocess: building the prompt plus each chunk's
resize/normalise/patchify; vision: each chunk's tower), so for a long video decode +
preprocess + vision exceeds the time they took together. ``video.decode_wait_ms`` is the
part of decoding the vision loop waited for, ``video.decode_hidden_ms`` the part hidden
behind it. ``ttft`` (wall clock to the end of the vision tower, then the prefill's events)
and ``total`` are true elapsed times.
"""

from __future__ import annotations

import contextvars
import importlib
import math
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from mminfer import video as videolib
from mminfer.errors import Cancelled, ConfigError, InputError, MemoryBusy
from mminfer.engine.cache import (Entry, PrefixFacts, PrefixKey, VideoCache, cache_key,
                                  file_digest)
from mminfer.engine.parallel import FrameShards, init_from_env, shard_decoder
from mminfer.engine.rerun import dense_rerun, finish, keep_inputs
from mminfer.engine.scheduler import DECODE, Solo
from mminfer.engine.timing import PIPELINE_STAGES, StageTimer
from mminfer.kernels import compiles, fp8_attention, proxy, sparsity
from mminfer.kernels.runtime import compiled_gpu
from mminfer.models.base import (VIDEO, Adapter, Conversation, PrepareOptions, Turn,
                                 resolve_checkpoint)
from mminfer.models.decode import choose_path, decoder_of, step_batch
from mminfer.models.embedded import default_model
from mminfer.models.hooks import (AUTO_NEVER, MODES, PrefillContext, auto_min_tokens,
                                  sparse_refusal, sparse_unavailable)
from mminfer.models.kv import ForkKV, kv_dtype, tail_rows
from mminfer.models.prefill import DEFAULT_CHUNK as PREFILL_CHUNK
from mminfer.video import DecodedVideo

# Adapter modules, tried in order; each exposes ``ADAPTER`` (see mminfer.models.base).
ADAPTER_MODULES = ("mminfer.models.qwen2_5_vl", "mminfer.models.longvila")
MAX_FPS = 60.0
MAX_NEW_TOKENS = 4096
# How long a new prefill waits for other requests to give back the device memory it needs
# (their answers decoding over pinned entries end within seconds); then it is refused (503)
# rather than started into an out-of-memory error.
ROOM_WAIT_S = 10.0
# Device memory the vision tower takes past the embeddings it fills, at most: one chunk's
# activations (Qwen2.5-VL-7B: 65536 patches x (1280 x ~8 + 3420 x 3) x 2 bytes, ~2.7 GB;
# LongVILA-7B: 32 frames x 729 patches x (1152 x ~8 + 4304 x 3) x 2 bytes, ~1 GB), with room
# to spare. The room a new prefill makes is copied out while the tower runs, once this much
# is free (VideoCache.make_room's ahead_bytes).
VISION_WORKSPACE_BYTES = 4 << 30
STAGES = PIPELINE_STAGES     # the timings of an answer, in order (mminfer.engine.timing)
# the scheduler turn of the request this thread runs (Pipeline.answer), for the cache's waits
_current_turn: contextvars.ContextVar = contextvars.ContextVar("mminfer_turn", default=None)


def _release_idle() -> int:
    """The video cache's release_idle: the request's scheduler makes paused idle work (a
    calibration step) give up its memory; a request with the model to itself has none."""
    turn = _current_turn.get()
    sched = getattr(turn, "sched", None)
    return 0 if sched is None else sched.evict_idle()


def _cache_wait(event, own: bool = False) -> None:
    """The video cache's wait (for another request's build of a prefix, or its restore from
    the host tier; ``own``: for the request's own room copied to the host): the request's
    turn on the model is given to others meanwhile, else the request waited for could never
    run."""
    turn = _current_turn.get()
    if turn is None:
        while not event.wait(0.05):
            pass
        return
    turn.wait_for(event, own=own)


@dataclass
class AnswerResult:
    answer: str
    model: str
    attention: str                 # what the prefill ran: "sparse" or "dense"
    attention_requested: str       # "auto" | "sparse" | "dense"
    video: dict                    # frames, sampled_fps, fps, duration, width, height, ...
    tokens: dict                   # total, visual, text, generated
    sparsity: dict | None          # mean_density, per_layer (only when sparse ran)
    timings_ms: dict = field(default_factory=dict)
    # the video cache: "miss" (the prefix was built, and kept), "hit" (continued a kept
    # prefix on the device), "host" (brought back from the host tier first), "off"
    cache: str = "off"
    finish_reason: str = "length"  # "stop" (an end token or a stop string) | "length"
    logprobs: list | None = None   # with sampling_params.logprobs (mminfer.models.base.Generated)
    # answer(keep_for_shadow=True) of a sparse prefill: engine.rerun.ShadowInputs (CPU
    # tensors) for Pipeline.shadow_dense; never part of to_dict
    shadow: object = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        d = asdict(replace(self, shadow=None))
        del d["shadow"]
        if d["logprobs"] is None:      # asked for only
            del d["logprobs"]
        return d


@dataclass
class BuiltPrefix:
    """What :meth:`Pipeline._build_prefix` made: the prefix's entry (its KV cache holds the
    prefix), the suffix's embeddings (the question's rows to prefill over it), the prefill's
    context (its plans: the density), the prepared inputs, the inputs kept for a dense shadow
    re-run (None unless asked for) and how long decoding the video took (ms: the ``decode``
    stage)."""
    entry: Entry
    suffix: object                # [1, S, hidden]
    ctx: PrefillContext
    prep: object                  # models.base.Prepared
    kept: object                  # engine.rerun.ShadowInputs | None
    video_decode_ms: float
    answered: object = None       # the prefix observer's callback for the answer, or None


def pick_adapter(path):
    for name in ADAPTER_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:       # that adapter is not installed in this tree
                continue
            raise
        cls = getattr(mod, "ADAPTER", None) or _adapter_class(mod)
        if cls.accepts(path):
            return cls
    raise ConfigError(f"{path} is not a checkpoint mminfer knows (Qwen2.5-VL config.json, or "
                      f"LongVILA root config.json with llm/, vision_tower/, mm_projector/)")


def _adapter_class(mod):
    for v in vars(mod).values():
        if isinstance(v, type) and issubclass(v, Adapter) and v is not Adapter \
                and v.__module__ == mod.__name__:
            return v
    raise ConfigError(f"{mod.__name__} defines no model adapter")


def _kv_cache_dtype(name):
    """The dtype a prefix's KV cache stores for ``--kv-cache-dtype`` ``name`` (None: the
    model's), or ConfigError."""
    try:
        return kv_dtype(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _dtype(dtype, device):
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        try:
            return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                    "float16": torch.float16, "fp32": torch.float32,
                    "float32": torch.float32}[dtype]
        except KeyError:
            raise ConfigError(f"unknown dtype {dtype!r}") from None
    return dtype


def _device(device):
    """The torch device to run on: ``device`` (None: CUDA where there is a GPU, else the CPU);
    a ConfigError, before anything loads, for one this machine does not have."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {device!r}: not a device (cuda, cpu, cuda:1 ...)") from None
    if dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"device {device!r}: mminfer runs on cuda or cpu")
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise ConfigError(f"device {device!r}: this torch ({torch.__version__}) is a "
                              "CPU build, without CUDA; use --device cpu, or install a CUDA "
                              "build of torch")
        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(f"device {device!r}: no CUDA GPU is visible here (check the "
                              "driver and CUDA_VISIBLE_DEVICES); use --device cpu")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {device!r}: this machine has {count} CUDA GPU"
                              f"{'s' if count > 1 else ''} (cuda:0 to cuda:{count - 1})")
    return dev


class Pipeline:
    """A loaded model ready to answer. ``model``: checkpoint dir or hub id; None, the
    embedded default model (``mminfer/models/mminfer-embedded``). ``attention`` is the default mode of its
    requests: "auto" goes sparse for prefills of at least ``min_sparse_len`` tokens (None:
    ``hooks.auto_min_tokens`` of the device).
    ``vision_compile``: the vision tower's block through torch.compile (CUDA; None: the
    adapter's default, ``mminfer.models.vision.COMPILE_DEFAULT`` for Qwen2.5-VL).
    ``quantization``: None (weights in ``dtype``) or "fp8" (the LLM's and the vision tower's
    projections and MLPs as FP8 GEMMs, mminfer.models.fp8); an FP8 checkpoint implies "fp8".
    ``prefill_context``: the type of a request's ``hooks.PrefillContext`` (the lab substitutes
    a subclass to measure a setting the product does not serve).
    ``kv_cache_dtype``: what a prefix's KV cache stores (vLLM's names): "auto" the model's
    dtype, "fp8" / "fp8_e4m3" float8 e4m3 with per-KV-head scales (mminfer.models.kv: half
    of bf16's bytes; the video cache keeps and moves it as it is)."""

    prefill_context = PrefillContext

    def __init__(self, model: str | None = None, attention: str = "auto", device=None,
                 dtype=None, min_sparse_len: int | None = None, tensor_parallel: int = 1,
                 vision_compile: bool | None = None, kv_cache_gb: float | None = None,
                 kv_host_cache_gb: float = 0.0, kv_cache_dtype: str = "auto",
                 quantization: str | None = None):
        if attention not in MODES:
            raise ConfigError(f"attention must be one of {MODES}, not {attention!r}")
        if model is None:       # the embedded default model (mminfer/models/mminfer-embedded)
            model = default_model()
        self.device = _device(device)
        if compiled_gpu(self.device.type == "cuda"):
            compiles.install()      # Triton's compilations counted (/metrics) and logged
        self.tensor_parallel, self.rank = int(tensor_parallel), 0
        if self.tensor_parallel > 1:
            self.rank, local = init_from_env(self.tensor_parallel, self.device.type)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", local)
                torch.cuda.set_device(self.device)
        self.dtype = _dtype(dtype, self.device)
        _kv_cache_dtype(kv_cache_dtype)       # a wrong name fails before the model loads
        self.attention = attention
        if min_sparse_len is None:
            min_sparse_len = auto_min_tokens(self.device)
        self.min_sparse_len = int(min_sparse_len)
        path, model_id, revision = resolve_checkpoint(str(model))
        self.model_id = model_id
        if quantization not in (None, "fp8"):
            raise ConfigError(f"quantization must be None or 'fp8', not {quantization!r}")
        self.adapter = pick_adapter(path).from_pretrained(
            path, device=self.device, dtype=self.dtype, model_id=model_id, revision=revision,
            **({"quantization": quantization} if quantization else {}))
        self.kv_cache_dtype = kv_cache_dtype
        # what runs: an FP8 checkpoint is FP8 whatever was asked
        self.quantization = getattr(self.adapter, "quantization", None)
        if self.quantization and self.device.type == "cuda" and \
                torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ConfigError("quantization fp8 needs FP8 tensor cores (compute capability "
                              f"8.9+: Ada, Hopper); {torch.cuda.get_device_name(self.device)} "
                              "has none")
        if self.quantization and self.tensor_parallel > 1:
            raise ConfigError("quantization fp8 does not run tensor parallel (the sharded "
                              "layers are plain nn.Linear)")
        if vision_compile is not None and hasattr(self.adapter, "set_vision_compile"):
            self.adapter.set_vision_compile(vision_compile)
        if self.tensor_parallel > 1:
            shard_decoder(self.adapter.text_model, self.rank, self.tensor_parallel)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.sparse_unavailable = sparse_unavailable(self.device)
        why = sparse_refusal(self.adapter.patterns, self.sparse_unavailable)
        if attention == "sparse" and why:
            raise ConfigError(f"{model_id}: {why}")
        # the video cache (engine/cache.py); off under tensor parallelism, where every rank
        # would have to make the same decisions in lockstep
        gpu_bytes = None if kv_cache_gb is None else int(float(kv_cache_gb) * 2**30)
        if self.tensor_parallel > 1:
            gpu_bytes = 0
        self.video_cache = VideoCache(self.device, gpu_bytes,
                                      int(float(kv_host_cache_gb or 0) * 2**30))
        self.video_cache.wait = _cache_wait
        self.video_cache.release_idle = _release_idle
        # the server's self-calibration (serve/selfcal.py): ``prefix_observer(adapter, prep,
        # embeds)`` sees each prompt before its prefix's prefill overwrites the embeddings
        # (it may keep a copy, and return ``answered(gen, dense, greedy)``, called with the
        # answer's models.base.Generated once the answer is complete);
        # ``calibration_status()`` is what attention_policy reports of it
        self.prefix_observer = None
        self.calibration_status = None

    @property
    def kv_cache_dtype(self) -> str:
        """"auto" (the model's dtype) or "fp8_e4m3": what prefixes built from now on store
        (set with any name ``--kv-cache-dtype`` takes; the video cache's key follows it)."""
        return "auto" if self.adapter.kv_cache_dtype is None else "fp8_e4m3"

    @kv_cache_dtype.setter
    def kv_cache_dtype(self, name) -> None:
        self.adapter.kv_cache_dtype = _kv_cache_dtype(name)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per prompt token, all layers, in the dtype the cache stores."""
        ad = self.adapter
        k = ad.text_model.layers[0].self_attn.k_proj
        bits = torch.finfo(ad.kv_cache_dtype or self.dtype).bits
        return 2 * len(ad.text_model.layers) * k.out_features * bits // 8

    def prefill_bytes(self, n: int) -> int:
        """Device bytes a prefill of ``n`` tokens holds at its peak (models/prefill.py): the
        KV cache it writes; per token, the residual stream (the embeddings, updated in
        place), one layer's queries, K and V and attention output, and the rotary tables;
        and one chunk's MLP temporaries (gate, up and their product)."""
        ad = self.adapter
        attn, mlp = ad.text_model.layers[0].self_attn, ad.text_model.layers[0].mlp
        elt = torch.finfo(self.dtype).bits // 8
        hidden, q_dim = attn.q_proj.in_features, attn.q_proj.out_features
        kv_dim = attn.k_proj.out_features
        per_token = (hidden + 2 * q_dim + 2 * kv_dim + 2 * attn.head_dim) * elt
        chunk = min(n, ad.prefill_chunk or PREFILL_CHUNK)
        return n * (self.kv_bytes_per_token + per_token) \
            + chunk * mlp.gate_proj.out_features * elt * 3

    def embed_bytes(self, n: int) -> int:
        """Device bytes of the embeddings of ``n`` tokens (the vision tower fills them; the
        prefill updates them in place, its residual stream)."""
        hidden = self.adapter.text_model.layers[0].self_attn.q_proj.in_features
        return n * hidden * (torch.finfo(self.dtype).bits // 8)

    def make_room(self, turn, need_bytes: int, ahead_bytes: int | None = None) -> int:
        """The video cache's room check (VideoCache.make_room, no wait for other requests)
        for work outside the cache that allocates ``need_bytes`` on the device (a live
        stream's piece), on ``turn``: paused idle work gives its memory up first when the
        device is short, then idle cached videos spill; the cache's waits give the turn
        away. Returns the bytes still short (0 on a device it cannot measure)."""
        token = _current_turn.set(turn)
        try:
            return self.video_cache.make_room(need_bytes, ahead_bytes=ahead_bytes)
        finally:
            _current_turn.reset(token)

    def _refuse_if_short(self, need: int, short: int) -> None:
        """A prefill still ``short`` of its room after the cache's wait is refused (503)
        rather than started into an out-of-memory error. Not under tensor parallelism: its
        ranks' memory may differ, and no refusal is one rank's alone."""
        if short > 0 and self.tensor_parallel == 1:
            raise MemoryBusy(
                f"this video's prefill needs {need / 2**30:.1f} GiB of device memory and "
                f"{short / 2**30:.1f} GiB of it is held by other requests (videos being "
                f"asked about, answers decoding); try again shortly, or ask for fewer frames")

    def _kv_key(self) -> str:
        """What the prefix's cache stores, for its key (read per request: an FP8 prefix is
        never a hit for a bf16 request, nor the other way)."""
        return str(self.adapter.kv_cache_dtype or self.dtype)

    def _prefix_key(self, digest: str, conv, sampling: dict, mode: str, options,
                    salt: str | None = None) -> PrefixKey:
        """The video cache's key of a request's prefix. Read per request, from what the
        prefix's build reads (a caller may swap the head patterns, the KV cache's dtype or
        ``min_sparse_len``): never a stale hit."""
        ad = self.adapter
        start, end = sampling["start"], sampling["end"]
        return PrefixKey(
            model=self.model_id, revision=getattr(ad.identity, "revision", None),
            adapter=ad.name, dtype=str(self.dtype), kv_cache=self._kv_key(),
            quantization=self.quantization, device=self.device.type, sampling=ad.sampling,
            frame_limit=ad.frame_limit, patterns=self._patterns_key(),
            min_sparse_len=int(self.min_sparse_len),
            video=digest, fps=float(sampling["fps"]), max_frames=int(sampling["max_frames"]),
            start=None if start is None else float(start),
            end=None if end is None else float(end), mode=mode,
            options=asdict(options or PrepareOptions()), turns=conv.prefix_digest(),
            salt=salt)

    def _patterns_key(self) -> str | None:
        """A digest of the head-pattern config the prefix would be built with: a swapped
        config (``adapter.patterns = ...``) or one marked calibrated is another key, never a
        stale hit. Memoised on the object (hashing a 7B config takes ~20 ms)."""
        pats = self.adapter.patterns
        if pats is None:
            return None
        memo = getattr(self, "_patterns_memo", None)   # (config object, flag, digest)
        if memo is None or memo[0] is not pats or memo[1] != pats.uncalibrated:
            memo = self._patterns_memo = (pats, pats.uncalibrated, cache_key(p=pats.to_dict()))
        return memo[2]

    def attention_policy(self) -> dict:
        """What "auto" attention does with this model, and why, and how its linear layers run
        (``quantization``: None or "fp8"): for the start-up message, ``/v1/models`` and
        ``/report``."""
        pats = self.adapter.patterns
        if pats is None:
            state, auto = "none", "dense (the model has no head-pattern config)"
        elif self.sparse_unavailable:
            state = "uncalibrated" if pats.uncalibrated else "calibrated"
            auto = "dense (sparse kernels cannot run here)"
        elif pats.uncalibrated:
            state = "uncalibrated"
            auto = ("dense until calibrated: the shipped head patterns are an uncalibrated "
                    "starting point; run `mminfer calibrate` (attention=sparse runs them now)")
        elif self.min_sparse_len >= AUTO_NEVER:
            state = "calibrated"
            auto = ("dense on the CPU (the Triton interpreter is for tests, not speed; "
                    "attention=sparse runs the kernels here)" if self.device.type == "cpu"
                    else "dense (--min-sparse-len is longer than any prompt)")
        else:
            state, auto = "calibrated", f"sparse from {self.min_sparse_len:,} prompt tokens"
        out = {"head_patterns": state, "auto_attention": auto,
               "quantization": getattr(self, "quantization", None)}
        status = getattr(self, "calibration_status", None)
        if status is not None:
            out["self_calibration"] = status()
        return out

    def _frame_shards(self):
        if self.tensor_parallel == 1:
            return None
        return FrameShards(self.rank, self.tensor_parallel)

    def warmup(self, *, force: bool = False, frames: int = 16, batch: int = 0) -> dict:
        """Compile, before the first user waits, what the first long request would compile:
        the vision tower's and the prefill's kernels and, where sparse attention can run, the
        estimator's proxy and the sparse kernel variants of the head patterns (measured on the
        H200: a first LongVILA request took 27.9 s instead of 11.4 s). A short synthetic
        video, two prompt lengths, one divisible by 16 and one not (Triton specialises integer
        arguments on that). ``batch``: also capture the batched decode step's CUDA graphs for
        up to that many answers at once (each size's first use would otherwise stall every
        request for its capture). On the CPU nothing is compiled, so it does nothing unless
        ``force``. Returns what it ran and how long it took."""
        if self.device.type != "cuda" and not force:
            return {"ran": False, "why": "nothing to compile on the CPU"}
        t0 = time.perf_counter()
        ad = self.adapter
        rng = np.random.default_rng(0)
        frames = max(2, min(int(frames), ad.frame_limit or frames))
        video = DecodedVideo(frames=rng.integers(0, 256, (frames, 448, 448, 3), np.uint8),
                             timestamps=np.arange(frames) / 2.0, indices=np.arange(frames),
                             fps=2.0, sampled_fps=2.0, duration=frames / 2.0, width=448,
                             height=448, backend="warmup")
        sparse = sparse_refusal(ad.patterns, self.sparse_unavailable) is None
        lengths, seen = [], set()
        for extra in range(32):               # one prefix per residue class: 0 and not 0
            prep = ad.prepare(video, Conversation((Turn("system", ("warm up" + " now" * extra,)),
                                                   Turn("user", (VIDEO, "warm up")))),
                              PrepareOptions())
            cls = prep.prefix_len % 16 == 0
            if cls in seen:
                continue
            seen.add(cls)
            ctx = PrefillContext(index=prep.prefix_index, patterns=ad.patterns,
                                 mode="sparse" if sparse else "dense", min_sparse_len=0,
                                 unavailable=self.sparse_unavailable)
            # the path a request runs: the prefix's prefill, then a question forking it
            embeds = ad.embed(prep)
            kv = ad.prefill_prefix(prep, embeds, ctx=ctx, headroom=0)
            ad.continue_on(ForkKV(kv, prep.prefix_len, 2), embeds[:, prep.prefix_len:],
                           rope_delta=prep.rope_delta, max_new_tokens=2)
            lengths.append(prep.prefix_len)
            if len(seen) == 2:
                break
        out = {"ran": True, "sparse": sparse, "lengths": lengths}
        if sparse:
            # the estimator's mass pass has a second layout, which only prompts of
            # proxy.TUNING["chunks_from"] keys and more take: compiled here, not in the
            # middle of the first long request or live stream (0.7-1.0 s on an H100)
            with proxy.mass_layout("chunks"):
                ctx = PrefillContext(index=prep.prefix_index, patterns=ad.patterns,
                                     mode="sparse", min_sparse_len=0,
                                     unavailable=self.sparse_unavailable)
                kv = ad.prefill_prefix(prep, ad.embed(prep), ctx=ctx, headroom=0)
            out["mass_layouts"] = ["auto", "chunks"]
        if ad.kv_cache_dtype is not None or self.device.type == "cuda":
            # a question's rows over a fork of the prefix take one of several row tiles of
            # the flash-decoding kernel, each its own compile (on the CPU only an FP8 cache
            # runs it); the warm-up's own suffix met one of them
            layer = kv.layers[0]
            cfg = ad.text_model.config
            group = cfg.num_attention_heads // cfg.num_key_value_heads
            out["row_tiles"] = fp8_attention.warm(
                layer.keys, layer.values, layer.k_scale, layer.v_scale,
                group * layer.keys.shape[1], embeds.dtype)
        if batch > 1 and self.device.type == "cuda" and choose_path(ad) == "graph":
            dec = decoder_of(ad)
            out["batch_graphs"] = dec.capture_batches(batch, dec.position_ids(None, kv))
        out["seconds"] = round(time.perf_counter() - t0, 3)
        return out

    def answer(self, video_path, question: str | None = None, *, conversation=None,
               fps: float = 2.0, max_frames: int = 768, max_new_tokens: int = 32,
               start: float | None = None, end: float | None = None,
               attention: str | None = None, options=None, cancel=None,
               keep_for_shadow: bool = False, shadow_max_bytes: int | None = None,
               on_token=None, use_cache: bool = True, cache_salt: str | None = None,
               sampling_params=None, turn=None) -> AnswerResult:
        """The answer to ``question`` (or the last user turn of ``conversation``, a
        mminfer.models.base.Conversation holding the video) about the video at
        ``video_path``.

        The prompt splits at the video: its prefix (up to and including the video) is taken
        from the video cache when an earlier request built it with the same video bytes,
        model, sampling, pixel budget, attention mode and turns before the video ("hit", or
        "host" from the host tier), else decoded, encoded and prefilled ("miss") and kept
        (``use_cache=False``: not looked up nor kept, "off"). The suffix (the question, later
        turns) is prefilled densely over the prefix's cache, then the answer is decoded.
        ``cache_salt`` (vLLM's): part of the cache key, so only requests with the same salt
        share an entry (the server salts with the tenant).

        ``cancel``: a callable checked between stages, before every decoder layer of the
        prefill and before every generated token; when it returns True the request stops with
        :class:`Cancelled` (and nothing is kept). ``on_token(text, token_id)``: called on
        this thread as each answer token exists, the first once the prefill is done
        (``Adapter.continue_on`` says how the texts add up to the answer); it must not block.
        ``keep_for_shadow``: when the prefix is built sparse, keep on the CPU what a dense
        re-run of the whole prompt needs (mminfer.engine.rerun: the prompt embeddings and
        positions, at most ``shadow_max_bytes``, and the sparse last-token logits and
        answer) as ``result.shadow``, for :meth:`shadow_dense`.

        ``turn``: the request's mminfer.engine.scheduler.Turn when several requests share the
        model (the server): taken before the model is touched, handed to others at every step
        boundary as the scheduler decides (the time waiting for them is the ``wait`` stage),
        and left held or not on return — its owner closes it. None: the model is this call's
        alone. ``sampling_params``
        (mminfer.models.sampler.SamplingParams; None: greedy): how the answer's tokens are
        chosen, its stop strings and logprobs."""

        mode = attention or self.attention
        if conversation is None:
            question = check_request(question, fps, max_frames, max_new_tokens, start, end,
                                     mode)
            conv = Conversation.single(question)
        else:
            conv = conversation.validate()
            check_request(conv.question, fps, max_frames, max_new_tokens, start, end, mode)
        why = sparse_refusal(self.adapter.patterns, self.sparse_unavailable)
        if mode == "sparse" and why:         # refused before the video is decoded
            raise InputError(f"{self.model_id}: {why}")
        ad = self.adapter
        timer = StageTimer(self.device)
        t0 = time.perf_counter()
        turn = turn if turn is not None else Solo()
        turn.timer = timer

        def check():            # a step boundary: others may run, then: asked to stop?
            return turn.checkpoint() or (cancel is not None and bool(cancel()))

        def generation_check():     # the same before each generated token, as generation
            if turn.kind != DECODE:
                turn.decoding()
            return check()

        digest = key = None
        try:
            digest = file_digest(video_path)
        except OSError:
            pass                              # the decoder says what is wrong with the path
        sampling = dict(fps=fps, max_frames=max_frames, start=start, end=end)
        if use_cache and digest is not None and self.video_cache.enabled:
            key = self._prefix_key(digest, conv, sampling, mode, options,
                                   cache_salt).digest()
        if not turn.acquire():
            raise Cancelled("request cancelled while waiting for the model")
        # the cache's waits (another request's build or restore of this prefix) give the
        # turn away meanwhile: _cache_wait reads the request's turn here
        token = _current_turn.set(turn)
        try:
            with self.video_cache.use(key) as lease:
                built = None
                if lease.entry is None:
                    # building the prefix is the long work the scheduler admits one at a time
                    # paused idle work keeps its memory unless the room check comes up short
                    with turn.long(room_checked=self.video_cache.measures_room):
                        built = self._build_prefix(video_path, conv, sampling, mode, options,
                                                   timer, check, keep_for_shadow,
                                                   shadow_max_bytes, max_new_tokens,
                                                   cached=key is not None, digest=digest)
                    lease.store(built.entry)
                entry = lease.entry
                suffix = built.suffix if built else ad.suffix_embeds(conv)
                n = entry.length + suffix.shape[1]
                _check_context(n, entry.facts.visual_tokens, max_new_tokens, ad.max_context)
                _check(check, "before the question's prefill")
                # the prefix is read only, shared with every other question about it: this
                # question's and answer's rows go into a fork of its own, in the prefix's
                # tail if no other question holds it (then it decodes over a cache in one
                # piece); given back before the lease ends, however the answer ends
                fork = ForkKV(entry.kv, entry.length, headroom=max_new_tokens, claim=True)
                if fork.in_tail:
                    self.video_cache.read_in_tail()
                try:
                    gen = ad.continue_on(fork, suffix, rope_delta=entry.rope_delta,
                                         max_new_tokens=max_new_tokens, cancel=generation_check,
                                         on_token=on_token, timer=timer,
                                         sampling_params=sampling_params,
                                         stepper=self._stepper(turn))
                finally:
                    fork.release()
                status, restore_ms = lease.status, lease.restore_ms
                # after the last token (never in the time to first token) and inside the
                # total: the stages add up to it; wall clock, as the count ends on host reads.
                # Before the lease ends: the entry is kept filled
                t_density = time.perf_counter()
                if built is not None:
                    ctx = built.ctx
                    entry.sparsity = _sparsity(ctx.densities, ad.patterns, ctx.last_row_only)
                    ctx.densities.clear()              # the plans are not needed any more
                sparsity = entry.sparsity
                timer.add_ms("density", (time.perf_counter() - t_density) * 1e3)
        finally:
            _current_turn.reset(token)
        total_ms = (time.perf_counter() - t0) * 1e3    # generate ends on a host sync

        ms = timer.totals_ms()
        prefill = ms.pop("prefill", 0.0)
        ms["llm_other"] = max(prefill - ms.get("index", 0.0) - ms.get("attention", 0.0), 0.0)
        ms["restore"] = restore_ms
        if built is not None:
            ms["decode"] = built.video_decode_ms
        ms["ttft"] = (gen.first_token_s - t0) * 1e3
        ms["total"] = total_ms
        timings = {k: round(ms.get(k, 0.0), 3) for k in STAGES}
        kept = built.kept if built else None
        if kept is not None:
            finish(kept, ad, built.prep, gen, (sparsity or {}).get("mean_density"))
        if built is not None and built.answered is not None:
            built.answered(gen, dense=not built.ctx.sparse,
                           greedy=sampling_params is None or sampling_params.greedy)
        facts = entry.facts
        video = {**facts.video, "path": str(video_path)}
        if built is None:                  # a hit decoded nothing: no decoding to report
            video.update(decode_wait_ms=0.0, decode_hidden_ms=0.0)
        return AnswerResult(
            answer=gen.text, model=self.model_id,
            attention=facts.attention, attention_requested=mode,
            video=video,
            tokens={"total": n, "visual": facts.visual_tokens,
                    "text": n - facts.visual_tokens,
                    "prefix": entry.length, "generated": len(gen.token_ids),
                    "cached": entry.length if built is None else 0},
            sparsity=sparsity, timings_ms=timings, shadow=kept, cache=status,
            finish_reason=gen.finish_reason, logprobs=gen.logprobs)

    def _stepper(self, turn):
        """Generation steps through the scheduler, batched with the other answers generating
        at the same time (None for a request that has the model to itself: its own loop)."""
        if isinstance(turn, Solo):
            return None
        ad = self.adapter

        def run(items):
            return step_batch(ad, items)

        return lambda token, pos, cache, logits: turn.decode((token, pos, cache, logits), run)

    def _build_prefix(self, video_path, conv, sampling, mode, options, timer, cancel,
                      keep_for_shadow, shadow_max_bytes, max_new_tokens, cached,
                      digest=None) -> BuiltPrefix:
        """decode -> preprocess -> vision -> the prefix's prefill: an Entry, the suffix's
        embeddings, and what the answer reports of the build. ``digest``: the video's
        sha256, which the answer reports."""
        ad = self.adapter
        # decode -> preprocess -> vision, overlapped: the stream decodes in its own thread
        # while earlier chunks of frames are preprocessed and go through the vision tower
        # sampled once, here: at most the frames the model takes, by its own rule
        stream = videolib.open_stream(str(video_path),
                                      **ad.sampling_args(sampling["fps"], sampling["max_frames"]),
                                      start=sampling["start"], end=sampling["end"])
        try:
            _check(cancel, "after opening the video")
            with timer("preprocess"):
                prep = ad.prepare(stream, conv, options or PrepareOptions())
            n = prep.total_tokens
            _check_context(n, prep.visual_tokens, max_new_tokens, ad.max_context)
            # room for the embeddings and the prefill before the vision tower makes them:
            # idle entries spill; what others pin (their questions decoding) is waited for
            # while they finish, a bounded time, so the prefill does not run out of memory.
            # Spills that cover it are copied out while the tower runs, once the tower's
            # own share is free; the prefill waits for the rest of them
            total = n + max_new_tokens + tail_rows(prep.prefix_len)
            need, embed_bytes = self.prefill_bytes(total), self.embed_bytes(n)
            with timer("room"):
                short = self.video_cache.make_room(
                    need, wait_s=ROOM_WAIT_S, ahead_bytes=embed_bytes + VISION_WORKSPACE_BYTES)
            self._refuse_if_short(need, short)
            # tensor parallel: each rank runs the tower on its share of the chunks of frames,
            # then every rank gathers the others' features (mminfer.engine.parallel)
            shard = self._frame_shards()
            embeds = ad.embed(prep, timer=timer, cancel=cancel,
                              **({"shard": shard} if shard is not None else {}))
            if shard is not None:
                with timer("vision"):
                    shard.gather()
        finally:
            stream.close()
        _check(cancel, "before the prefill")
        with timer("room"):          # the embeddings are made: the rest of the need
            self._refuse_if_short(need, self.video_cache.make_room(need - embed_bytes,
                                                                   wait_s=ROOM_WAIT_S))
        P = prep.prefix_len
        # the prefix's prefill decides dense or sparse once (hooks.choose_attention) from its
        # own length, and a sparse one estimates from the prefix's own last queries: the
        # cached prefix is right for every later question
        ctx = self.prefill_context(index=prep.prefix_index, patterns=ad.patterns, mode=mode,
                                   min_sparse_len=self.min_sparse_len,
                                   unavailable=self.sparse_unavailable, timer=timer,
                                   keep_plans=True, cancel=cancel)
        kept = None
        if keep_for_shadow and ctx.decide(P):     # before the prefill overwrites embeds
            kept = keep_inputs(ad, prep, embeds, shadow_max_bytes)
        observer = getattr(self, "prefix_observer", None)
        answered = None
        if observer is not None:                  # before the prefill overwrites embeds
            answered = observer(ad, prep, embeds)
        suffix = embeds[:, P:]                    # the prefill overwrites only [:, :P]
        # the prefix's rows and its tail, where one question at a time (this one first)
        # writes its rows (ForkKV claim=True); no question writes the prefix's rows. A kept
        # prefix's tail is tail_rows (charged while kept); one kept by nobody, this question's
        own = suffix.shape[1] + max_new_tokens
        tail = tail_rows(P) if cached else own
        kv = ad.prefill_prefix(prep, embeds, ctx=ctx, timer=timer, headroom=tail)
        del embeds
        resized = prep.tensors.get("resized")
        facts = PrefixFacts(
            attention="sparse" if ctx.sparse else "dense",
            visual_tokens=prep.visual_tokens,
            video={"frames": len(stream),
                   "model_frames": prep.n_frames, "sampled_fps": float(stream.sampled_fps),
                   "fps": float(stream.fps), "duration": float(stream.duration),
                   "width": stream.width, "height": stream.height,
                   "resized": list(resized) if resized else None,
                   "decoded": list(stream.frame_size), "backend": stream.backend,
                   # decoding runs in its own thread alongside preprocess and vision: how
                   # long the vision loop waited for frames, and the decoding hidden
                   # behind it
                   "decode_wait_ms": round(stream.wait_ms, 3),
                   "decode_hidden_ms": round(max(stream.decode_ms - stream.wait_ms, 0.0), 3),
                   "sha256": digest})
        entry = Entry(kv=kv, length=P, rope_delta=prep.rope_delta, index=prep.prefix_index,
                      facts=facts)
        return BuiltPrefix(entry=entry, suffix=suffix, ctx=ctx, prep=prep, kept=kept,
                           video_decode_ms=stream.decode_ms, answered=answered)

    def shadow_dense(self, kept, *, max_new_tokens: int = 8, cancel=None):
        """The dense prefill of a sparse answer's kept inputs (``answer(keep_for_shadow=True)``
        gave ``result.shadow``) and up to ``max_new_tokens`` greedy tokens after it:
        an engine.rerun.DenseRerun (dense last-token logits, tokens, text). ``cancel`` is
        checked before every decoder layer and generated token (:class:`Cancelled`)."""
        return dense_rerun(self.adapter, kept, max_new_tokens=max_new_tokens, cancel=cancel)


def _check_context(n: int, visual: int, max_new_tokens: int, max_context: int) -> None:
    """InputError when a prompt of ``n`` tokens and its answer do not fit the model."""
    if n + max_new_tokens > max_context:
        raise InputError(
            f"the prompt is {n} tokens ({visual} visual) and {max_new_tokens} new tokens are "
            f"asked for, over the model's context of {max_context} tokens; lower fps or "
            f"max_frames", tokens=n, limit=max_context)


def _check(cancel, where: str):
    if cancel is not None and cancel():
        raise Cancelled(f"request cancelled {where}")


def check_request(question, fps, max_frames, max_new_tokens, start, end, mode) -> str:
    """Raise InputError for a request field that is wrong; return the stripped question."""
    if not isinstance(question, str) or not question.strip():
        raise InputError("the question is empty")
    try:
        fps = float(fps)
    except (TypeError, ValueError):
        raise InputError(f"fps must be a number, not {fps!r}") from None
    if not (math.isfinite(fps) and 0 < fps <= MAX_FPS):
        raise InputError(f"fps must be in (0, {MAX_FPS:g}], not {fps:g}")
    if not isinstance(max_frames, int) or max_frames < 1:
        raise InputError(f"max_frames must be a positive integer, not {max_frames!r}")
    if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise InputError(f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], "
                         f"not {max_new_tokens!r}")
    if start is not None and start < 0:
        raise InputError(f"start must be >= 0 seconds, not {start}")
    if start is not None and end is not None and end <= start:
        raise InputError(f"end ({end}) must be after start ({start})")
    if mode not in MODES:
        raise InputError(f"attention must be one of {MODES}, not {mode!r}")
    return question.strip()


def _sparsity(plans: dict, patterns, last_row_only: int | None = None) -> dict | None:
    """What the sparse layers computed, counted from their plans' arrays (no launch):
    mminfer.kernels.density.sparsity (``mean_density``: the pairs computed over the causal
    triangle, never above 1; ``mean_tile_work``: the kernels' tile work over a dense pass's,
    what the time follows), with whether the config was calibrated and ``last_row_only``:
    the layer that made no plan (the prefix's last layer writes K/V only, models/prefill.py)."""
    out = sparsity(plans)
    if out is not None:
        out.update(uncalibrated=bool(getattr(patterns, "uncalibrated", True)),
                   last_row_only=last_row_only)
    return out
