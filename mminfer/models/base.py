"""What every model adapter gives the pipeline, and the prefill/decode loop they share.

An adapter owns one loaded checkpoint. ``prepare`` turns decoded frames and a question into
model inputs plus the ModalityIndex (from the token layout it built, never from values);
``embed`` runs the vision tower and splices its output into the text embeddings; the shared
``generate`` then runs the language model: the prefill engine (mminfer.models.prefill, our
attention hook inside it, sparse or dense by the PrefillContext's decision), then dense decode
over the KV cache it wrote (greedy, or as a mminfer.models.sampler.SamplingParams says) —
the decode loop ``continue_on`` runs after a cached prefix too.

An adapter implements: ``accepts`` and ``from_pretrained`` (classmethods), ``name``, ``identity``,
``patterns``, ``max_context``, ``sampling``, ``tokenizer``, ``text_model`` (the decoder stack:
takes ``inputs_embeds``, ``position_ids``, the cache, returns ``last_hidden_state``),
``lm_head``, ``eos_token_ids``, ``prepare``, ``embed`` and ``positions``. Its module exposes
the class as ``ADAPTER``; ``mminfer.engine.pipeline.ADAPTER_MODULES`` lists the modules, and the first
whose ``ADAPTER.accepts(checkpoint_dir)`` is true loads the checkpoint.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from transformers import DynamicCache

from mminfer.errors import Cancelled, ConfigError, InputError
from mminfer.models.decode import decode_loop
from mminfer.models.detokenize import IncrementalText
from mminfer.models.kv import HEADROOM, PrefixKV
from mminfer.models.prefill import DEFAULT_CHUNK, prefill
from mminfer.models.sampler import Sampler, openai_logprobs


class _Video:
    """Where the video goes in a turn's parts (one per conversation)."""
    __slots__ = ()

    def __repr__(self):
        return "VIDEO"

    def __reduce__(self):        # unpickled (tensor-parallel ranks, workers) as the one VIDEO
        return "VIDEO"


VIDEO = _Video()
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Turn:
    role: str                           # "system" | "user" | "assistant"
    parts: tuple                        # str, or VIDEO (in one user turn)


@dataclass(frozen=True)
class Conversation:
    """A chat about one video, as the model's chat template lays it out. The prompt splits at
    the video: the *prefix* is every turn up to and including the video (the system prompt,
    earlier turns, the video's turn up to the video) and is what the video cache keeps; the
    *suffix* is the rest (the question, later turns) and the assistant's opening."""
    turns: tuple

    @classmethod
    def single(cls, question: str) -> "Conversation":
        """One user turn: the video, then the question (the model's default system prompt)."""
        return cls((Turn("user", (VIDEO, question)),))

    def validate(self) -> "Conversation":
        if not self.turns:
            raise InputError("the conversation is empty")
        videos = 0
        for i, t in enumerate(self.turns):
            if t.role not in ROLES:
                raise InputError(f"message {i}: role must be one of {ROLES}, not {t.role!r}")
            if t.role == "system" and i != 0:
                raise InputError(f"message {i}: a system message may only come first")
            for part in t.parts:
                if part is VIDEO:
                    if t.role != "user":
                        raise InputError(f"message {i}: only a user message may hold the video")
                    videos += 1
                elif not isinstance(part, str):
                    raise InputError(f"message {i}: a part must be text or the video")
        if videos != 1:
            raise InputError("the conversation must hold exactly one video, not "
                             f"{videos}" if videos else "the conversation has no video")
        last = self.turns[-1]
        if last.role != "user" or not any(isinstance(p, str) and p.strip() for p in last.parts):
            raise InputError("the last message must be a user message with text")
        return self

    def split(self) -> tuple[list, list]:
        """``(before, after)``: the turns up to the video and from it on; the video's turn is
        split in two: ``before[-1]`` holds its parts before the video, ``after[0]`` (same
        role) the parts after it."""
        for i, t in enumerate(self.turns):
            for j, part in enumerate(t.parts):
                if part is VIDEO:
                    return ([*self.turns[:i], Turn(t.role, t.parts[:j])],
                            [Turn(t.role, t.parts[j + 1:]), *self.turns[i + 1:]])
        raise ValueError("no video in the conversation")

    def prefix_digest(self) -> str:
        """What of the conversation the prefix's tokens depend on: the turns before the video
        (a changed system prompt or earlier turn is another prefix)."""
        before, _ = self.split()
        blob = json.dumps([[t.role, list(t.parts)] for t in before], ensure_ascii=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def question(self) -> str:
        """The last user message's text (what a one-question caller asked)."""
        return " ".join(p for p in self.turns[-1].parts if isinstance(p, str)).strip()


@dataclass
class PrepareOptions:
    """Per-request knobs of preprocessing. ``None`` means the adapter's default."""
    min_pixels: int | None = None       # per frame (Qwen)
    max_pixels: int | None = None       # per frame (Qwen)
    total_pixels: int | None = None     # whole-video budget (Qwen, qwen-vl-utils rule)


@dataclass
class Prepared:
    """Model inputs of one request (batch of one, no padding)."""
    input_ids: object                   # LongTensor [1, L] (media spans as placeholder ids)
    index: object                       # mminfer.sparse.modality.ModalityIndex over the L tokens
    n_frames: int                       # frames the model sees (after any padding)
    visual_tokens: int
    text_tokens: int
    tensors: dict = field(default_factory=dict)   # adapter-specific (pixels, grids, positions)
    # the prompt splits at the video (Conversation): tokens [0, prefix_len) are the prefix
    # (up to and including the video), the rest the suffix; prefix_index is the
    # ModalityIndex of the prefix alone (what its sparse prefill estimates from)
    prefix_len: int = 0
    prefix_index: object = None
    rope_delta: int = 0                 # position of token i after the video: i + rope_delta

    @property
    def total_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens


@dataclass
class Generated:
    text: str
    token_ids: list
    prefill_tokens: int
    prefill_logits: object = None       # [vocab] logits of the prompt's last position
    first_token_s: float | None = None  # time.perf_counter() when the first token was known
    finish_reason: str = "length"       # "stop" (an end token or a stop string) | "length"
    # with SamplingParams.logprobs: per answer token, OpenAI's {token, logprob, bytes,
    # top_logprobs} (mminfer.models.sampler.openai_logprobs)
    logprobs: list | None = None


class Adapter:
    name: str = "base"
    sampling: str = "qwen"     # mminfer.video sampling rule this model was trained with
    identity = None            # mminfer.sparse.patterns.ModelIdentity
    patterns = None            # mminfer.sparse.patterns.HeadPatternConfig (None: dense only)
    max_context: int = 0       # tokens the LLM takes (prompt + answer)
    frame_limit: int | None = None   # frames the model takes at most (LongVILA: its config's)
    tokenizer = None
    text_model = None
    lm_head = None
    eos_token_ids: tuple = ()
    device = None
    dtype = None
    # what a prefix's KV cache stores (``--kv-cache-dtype``): None the model's dtype, or
    # torch.float8_e4m3fn (mminfer.models.kv); set by the pipeline
    kv_cache_dtype = None
    quantization: str | None = None   # None (the dtype's weights) or "fp8" (mminfer.models.fp8)

    # ------------------------------------------------------------ per adapter
    @classmethod
    def accepts(cls, path) -> bool:
        """Whether the checkpoint at local ``path`` is of this adapter's layout."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, path, *, device=None, dtype=None, model_id: str | None = None,
                        revision: str | None = None,
                        quantization: str | None = None) -> "Adapter":
        """Load from checkpoint dir ``path`` (the pipeline passes a local dir, a hub snapshot
        for hub ids); ``model_id``/``revision`` name it (hub id and commit) for the
        head-pattern identity check; LLM attention goes through
        ``mminfer.models.hooks.register()``, the vision tower stays on SDPA.
        ``quantization="fp8"``: the LLM's projections and the vision tower's projections and
        MLPs as mminfer.models.fp8 layers (a checkpoint that is FP8 already loads as it is and
        sets it)."""
        raise NotImplementedError

    def prepare(self, video, question: str, options: PrepareOptions | None = None) -> Prepared:
        raise NotImplementedError

    def visual_tokens(self, n_frames: int, height: int, width: int,
                      options: PrepareOptions | None = None) -> int | None:
        """The visual tokens ``prepare`` makes of ``n_frames`` decoded frames of ``height x
        width``, known before decoding (the server refuses a request over its budget with
        it); None where the adapter cannot tell (the pipeline's own context check still
        applies)."""
        return None

    def embed(self, prepared: Prepared, *, timer=None, cancel=None, shard=None):
        """Run the vision tower; return inputs_embeds ``[1, L, hidden]`` in the model dtype.
        ``timer(name)`` times the "preprocess" and "vision" work it does; ``cancel()`` is
        checked between its chunks of frames. ``shard`` (tensor parallel: an
        ``engine.parallel.FrameShards``): before each chunk, ``shard.take(features, lo,
        hi)`` with the rows of one tensor that chunk fills; a chunk it answers False for is
        skipped (another rank runs it; the caller then gathers)."""
        raise NotImplementedError

    def positions(self, prepared: Prepared, start: int, length: int):
        """position_ids for tokens [start, start+length) (``None``: the model's 1-D default)."""
        raise NotImplementedError

    def positions_after(self, rope_delta: int, start: int, length: int):
        """position_ids of tokens [start, start+length) after the video, from the prefix's
        ``rope_delta`` alone (a cached prefix has no Prepared); None: the model counts them
        from the cache's length (``rope_delta`` 0; else 1-D positions ``i + rope_delta``: a
        stream whose oldest rows were dropped keeps its positions absolute)."""
        if not rope_delta:
            return None
        start += int(rope_delta)
        return torch.arange(start, start + length, device=self.device)[None]

    def stream_layout(self, conversation, fps: float, frame_hw, options=None):
        """How a live stream's prompt is laid out on this model, for a stream sampled at
        ``fps`` whose frames are ``frame_hw`` (h, w): a mminfer.models.streaming.StreamLayout
        (the head, each piece's rows and positions, a question's suffix)."""
        raise InputError(f"{self.name} does not take live streams")

    def split_prompt(self, conversation, n_video_tokens: int) -> tuple[list, list]:
        """``(prefix, suffix)`` token ids of a question or Conversation around the video;
        the suffix (what follows the video) is the same whatever ``n_video_tokens``."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared
    prefill_chunk: int | None = None   # tokens per chunk of the prefill (None: its default)

    def sampling_args(self, fps: float, max_frames: int) -> dict:
        """Keyword arguments of mminfer.video's samplers (``sample_indices``,
        ``open_stream``) for a request's ``fps`` and ``max_frames``: the model's own rule, and
        no more frames than the model takes (its ``frame_limit``)."""
        return {"sampling": self.sampling, "fps": fps,
                "max_frames": min(max_frames, self.frame_limit or max_frames)}

    def generate(self, prepared: Prepared, *, max_new_tokens: int = 32, ctx=None,
                 timer=None, embeds=None, on_token=None, sampling_params=None) -> Generated:
        """The answer of the whole prompt at once: the prefill engine (mminfer.models.prefill:
        layer by layer, chunked, into a new cache) then the decode steps of
        :meth:`continue_on`. ``ctx`` (hooks.PrefillContext) is active during the prefill only,
        so decode-step attention is neither sparse nor counted as prefill attention; its
        ``cancel`` is also checked before every decode step. Sections timed: vision (unless
        ``embeds`` from ``embed`` are given), prefill, generate (the decode steps after the
        first token). ``on_token`` and ``sampling_params``: as in :meth:`continue_on`."""
        section = timer if timer is not None else (lambda name: nullcontext())
        sampler = Sampler(sampling_params)
        L = prepared.input_ids.shape[1]
        with torch.inference_mode():
            if embeds is None:
                with section("vision"):
                    embeds = self.embed(prepared)                 # [1, L, hidden]
            cache = _new_cache(self.text_model)
            with section("prefill"):
                logits = prefill(self.text_model, embeds, cache, self.positions(prepared, 0, L),
                                 chunk=self.prefill_chunk or DEFAULT_CHUNK, ctx=ctx,
                                 lm_head=self.lm_head)
                first = sampler(logits) if sampler.needs_logits else logits.argmax(-1)
            del embeds                                            # the prefill's residual
        return self._answer(logits, first, sampler, cache, rope_delta=prepared.rope_delta,
                            prefill_tokens=L, max_new_tokens=max_new_tokens,
                            cancel=getattr(ctx, "cancel", None), on_token=on_token,
                            section=section)

    def prefill_prefix(self, prepared: Prepared, embeds, *, ctx=None, timer=None,
                       headroom: int | None = None):
        """The prefix of ``prepared`` (tokens up to and including the video) into a new
        :class:`mminfer.models.kv.PrefixKV`: the prefill engine over ``embeds[:, :prefix]``
        (overwritten), its last layer writing K/V only (nobody reads the prefix's logits).
        ``ctx`` is active during it (sparse or dense by its decision on the prefix's length,
        estimated from the prefix's own last queries: ``ctx.index`` is the prefix's). The
        cache stores ``self.kv_cache_dtype`` (FP8: quantised as each layer writes it)."""
        section = timer if timer is not None else (lambda name: nullcontext())
        P = prepared.prefix_len
        kv = PrefixKV.for_model(self.text_model, HEADROOM if headroom is None else headroom,
                                dtype=self.kv_cache_dtype)
        with torch.inference_mode(), section("prefill"):
            prefill(self.text_model, embeds[:, :P], kv, self.positions(prepared, 0, P),
                    chunk=self.prefill_chunk or DEFAULT_CHUNK, ctx=ctx, kv_only_last=True)
        return kv

    def continue_on(self, cache, embeds, *, rope_delta: int = 0, max_new_tokens: int = 32,
                    cancel=None, on_token=None, timer=None, sampling_params=None,
                    stepper=None) -> Generated:
        """The answer of the suffix ``embeds`` ``[1, S, hidden]`` continuing ``cache`` (a
        prefix's PrefixKV): the suffix's rows in one pass over every cached key (dense,
        causal among themselves: hooks.continuation_attention), timed as "suffix", then the
        decode steps ("generate"). The cache keeps the suffix's and answer's rows; its owner
        truncates them. ``Generated.first_token_s``: ``time.perf_counter()`` when the first
        token was known.

        ``sampling_params`` (mminfer.models.sampler.SamplingParams; None: greedy) chooses the
        tokens, ends the answer before a stop string, and asks for logprobs
        (``Generated.logprobs``).
        ``on_token(text, token_id)``, if given, is called on this thread as each token
        exists (the first right after the suffix): ``text`` is what the token adds to the
        answer ("" while a character is incomplete or may begin a stop string, and for end
        tokens); a last call with ``token_id`` None sends what is still owed. The texts add up
        to ``Generated.text``. ``stepper``: who runs each decode step
        (mminfer.models.decode ``decode_loop``; the server batches the steps of the answers
        decoding together)."""
        section = timer if timer is not None else (lambda name: nullcontext())
        sampler = Sampler(sampling_params)
        P, S = cache.get_seq_length(), embeds.shape[1]
        with torch.inference_mode(), section("suffix"):
            hidden = self._step(embeds, self.positions_after(rope_delta, P, S), cache)
            logits = self.lm_head(hidden[:, -1:])
            first = sampler(logits) if sampler.needs_logits else logits.argmax(-1)
        return self._answer(logits, first, sampler, cache, rope_delta=rope_delta,
                            prefill_tokens=P + S, max_new_tokens=max_new_tokens, cancel=cancel,
                            on_token=on_token, section=section, stepper=stepper)

    def _answer(self, logits, first, sampler, cache, *, rope_delta, prefill_tokens,
                max_new_tokens, cancel, on_token, section, stepper=None) -> Generated:
        """The answer after the prompt whose last logits are ``logits`` ``[1, 1, vocab]`` and
        first token ``first`` (chosen by ``sampler``, a mminfer.models.sampler.Sampler), then
        the decode steps on ``cache`` (mminfer.models.decode: the lean step, replayed from CUDA
        graphs on a GPU; ``self._step`` where it cannot run), the cut at a stop string, the
        text."""
        params = sampler.params
        out = [int(first)]
        first_token_s = time.perf_counter()
        text = (IncrementalText(self.tokenizer, self.eos_token_ids, params.stop)
                if on_token is not None or params.stop else None)

        def emit(token_id) -> bool:
            piece = text.push(token_id)
            if on_token is not None:
                on_token(piece, token_id)
            return text.stopped

        with section("generate"):
            if text is None or not emit(out[0]):
                decode_loop(self, cache, out, rope_delta=rope_delta,
                            max_new_tokens=max_new_tokens, cancel=cancel,
                            emit=emit if text is not None else None, sampler=sampler,
                            stepper=stepper)
        if text is None:
            answer = [t for t in out if t not in self.eos_token_ids]
            full = self.tokenizer.decode(answer, skip_special_tokens=True).strip()
        else:
            full = text.text()
            if on_token is not None:
                rest = text.finish(full)
                if rest:
                    on_token(rest, None)
        stopped = out[-1] in self.eos_token_ids or (text is not None and text.stopped)
        return Generated(text=full, token_ids=out, prefill_tokens=prefill_tokens,
                         prefill_logits=logits[0, -1], first_token_s=first_token_s,
                         finish_reason="stop" if stopped else "length",
                         logprobs=(openai_logprobs(self.tokenizer, sampler.logprobs)
                                   if params.logprobs else None))

    def suffix_embeds(self, conversation):
        """The embeddings of a conversation's suffix (what follows the video), ``[1, S,
        hidden]``: all a question on a cached prefix needs of the prompt."""
        _, suffix = self.split_prompt(conversation, 0)
        ids = torch.tensor([suffix], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            return self.text_model.get_input_embeddings()(ids)

    def _step(self, embeds, position_ids, cache):
        """One decode step through the text model's own forward on ``cache``."""
        kw = {_cache_kwarg(self.text_model): cache}
        if position_ids is not None:
            kw["position_ids"] = position_ids
        return self.text_model(inputs_embeds=embeds, use_cache=True, **kw).last_hidden_state


def _new_cache(text_model):
    try:
        return DynamicCache(config=text_model.config)
    except TypeError:   # older signatures take no config
        return DynamicCache()


def _cache_kwarg(module) -> str:
    return _cache_kwarg_of(type(module))


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls) -> str:
    # transformers 5.24 renamed the forward kwarg past_key_values -> cache; 5.17 has the old.
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def resolve_checkpoint(model: str) -> tuple[Path, str, str | None]:
    """A local directory, or a hub id fetched (or found in the cache under HF_HUB_OFFLINE).
    Returns (local dir, id, revision): a hub id and its commit; for a local directory, the
    hub id and commit when it is a hub cache snapshot, else its folder name and None (the
    name head-pattern files next to it are made for)."""
    p = Path(model).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"model path {model} is not a directory")
        parts = p.resolve().parts     # .../models--owner--name/snapshots/<commit>
        if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
            return p, parts[-3][len("models--"):].replace("--", "/"), parts[-1]
        return p, p.resolve().name, None
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ConfigError(f"model {model!r} is neither a directory nor a hub id (owner/name)")
    try:
        local = Path(snapshot_download(repo_id=model))
    except Exception as e:   # offline, missing, gated, network: all mean "cannot get it"
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise ConfigError(f"cannot get model {model}{why}: {type(e).__name__}: {e}") from e
    return local, model, local.name
