"""One answer about one video, with the time each stage took.

    decode (video file -> frames) -> preprocess (resize, patchify, prompt, ModalityIndex)
    -> vision -> prefill (index + attention + llm_other) -> generate (decode steps) -> answer

Stages on the GPU are timed with CUDA events (StageTimer) and read once at the end; video
decoding runs on the CPU and is timed with the wall clock. ``llm_other`` is the prefill minus
the index estimation and attention inside it (projections, MLPs, norms). ``ttft`` is
everything up to the first answer token.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from mminfer.errors import Cancelled, ConfigError, InputError
from mminfer.models.base import resolve_checkpoint

# Adapter modules, tried in order; each exposes ``ADAPTER`` (see mminfer.models.base).
ADAPTER_MODULES = ("mminfer.models.qwen2_5_vl", "mminfer.models.longvila")
MODES = ("auto", "sparse", "dense")
MAX_FPS = 60.0
MAX_NEW_TOKENS = 4096
STAGES = ("decode", "preprocess", "vision", "index", "attention", "llm_other", "generate",
          "ttft", "total")


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

    def to_dict(self) -> dict:
        return asdict(self)


def pick_adapter(path):
    import importlib
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
    from mminfer.models.base import Adapter
    for v in vars(mod).values():
        if isinstance(v, type) and issubclass(v, Adapter) and v is not Adapter \
                and v.__module__ == mod.__name__:
            return v
    raise ConfigError(f"{mod.__name__} defines no model adapter")


def _dtype(dtype, device):
    import torch
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


# "auto" attention: sparse prefill from this many tokens on a GPU (BENCHMARKS.md §2: sparse
# already wins at 128K; below 64K estimation is not yet amortised). On the CPU "auto" stays
# dense: the Triton interpreter there is for tests, not speed.
AUTO_SPARSE_MIN_TOKENS = 65536


def sparse_unavailable(device) -> str | None:
    """Why the sparse kernels cannot run on ``device``, or None. Triton needs a GPU; on the
    CPU only its interpreter runs them, and that must be chosen before triton is imported."""
    from mminfer.kernels.runtime import interpreted
    if device.type == "cpu" and not interpreted():
        return ("sparse attention runs Triton kernels: it needs a CUDA GPU, or "
                "TRITON_INTERPRET=1 in the environment on the CPU (slow: for tests); "
                "use --attention dense or auto here")
    return None


class Pipeline:
    """A loaded model ready to answer. ``model``: checkpoint dir or hub id; None, the
    embedded default model (``mminfer/models/mminfer-embedded``). ``attention`` is the default mode of its
    requests: "auto" goes sparse for prefills of at least ``min_sparse_len`` tokens."""

    def __init__(self, model: str | None = None, attention: str = "auto", device=None,
                 dtype=None, min_sparse_len: int | None = None):
        import torch
        if attention not in MODES:
            raise ConfigError(f"attention must be one of {MODES}, not {attention!r}")
        if model is None:       # the embedded default model (mminfer/models/mminfer-embedded)
            from mminfer.models.embedded import default_model
            model = default_model()
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _dtype(dtype, self.device)
        self.attention = attention
        if min_sparse_len is None:
            min_sparse_len = AUTO_SPARSE_MIN_TOKENS if self.device.type == "cuda" else 1 << 62
        self.min_sparse_len = int(min_sparse_len)
        path, model_id, revision = resolve_checkpoint(str(model))
        self.model_id = model_id
        self.adapter = pick_adapter(path).from_pretrained(
            path, device=self.device, dtype=self.dtype, model_id=model_id, revision=revision)
        if attention == "sparse" and self.adapter.patterns is None:
            raise ConfigError(f"no head patterns for {model_id}: sparse attention unavailable")
        self.sparse_unavailable = sparse_unavailable(self.device)
        if attention == "sparse" and self.sparse_unavailable:
            raise ConfigError(self.sparse_unavailable)

    def answer(self, video_path, question: str, *, fps: float = 2.0, max_frames: int = 768,
               max_new_tokens: int = 32, start: float | None = None, end: float | None = None,
               attention: str | None = None, options=None, cancel=None) -> AnswerResult:
        """``cancel``: a callable checked between stages and before every decoder layer's
        attention; when it returns True the request stops with :class:`Cancelled`."""
        from mminfer.engine import video as videolib
        from mminfer.models.base import PrepareOptions
        from mminfer.models.hooks import PrefillContext
        from mminfer.engine.timing import StageTimer

        mode = attention or self.attention
        question = check_request(question, fps, max_frames, max_new_tokens, start, end, mode)
        if mode == "sparse" and self.adapter.patterns is None:
            raise InputError(f"sparse attention needs head patterns; {self.model_id} has none")
        if mode == "sparse" and self.sparse_unavailable:
            raise InputError(self.sparse_unavailable)
        ad = self.adapter
        timer = StageTimer(self.device)
        t0 = time.perf_counter()

        decoded = videolib.decode(str(video_path), sampling=ad.sampling, fps=fps,
                                  max_frames=max_frames, start=start, end=end)
        timer.add_ms("decode", (time.perf_counter() - t0) * 1e3)
        _check(cancel, "after decoding")
        with timer("preprocess"):
            prep = ad.prepare(decoded, question, options or PrepareOptions())
        n = prep.total_tokens
        if n + max_new_tokens > ad.max_context:
            raise InputError(
                f"the prompt is {n} tokens ({prep.visual_tokens} visual) and {max_new_tokens} "
                f"new tokens are asked for, over the model's context of {ad.max_context} "
                f"tokens; lower fps or max_frames", tokens=n, limit=ad.max_context)
        # "auto" where the kernels cannot run stays dense whatever --min-sparse-len says
        min_sparse = 1 << 62 if self.sparse_unavailable else self.min_sparse_len
        _check(cancel, "before the prefill")
        ctx = PrefillContext(index=prep.index, patterns=ad.patterns, mode=mode,
                             min_sparse_len=min_sparse, timer=timer, keep_plans=True,
                             cancel=cancel)
        gen = ad.generate(prep, max_new_tokens=max_new_tokens, ctx=ctx, timer=timer)
        total_ms = (time.perf_counter() - t0) * 1e3    # generate ends on a host sync

        ms = timer.totals_ms()
        prefill = ms.pop("prefill", 0.0)
        ms["llm_other"] = max(prefill - ms.get("index", 0.0) - ms.get("attention", 0.0), 0.0)
        ms["ttft"] = sum(ms.get(k, 0.0) for k in ("decode", "preprocess", "vision")) + prefill
        ms["total"] = total_ms
        timings = {k: round(ms.get(k, 0.0), 3) for k in STAGES}
        resized = prep.tensors.get("resized")
        return AnswerResult(
            answer=gen.text, model=self.model_id,
            attention="sparse" if ctx.densities else "dense", attention_requested=mode,
            video={"path": str(video_path), "frames": int(len(decoded.frames)),
                   "model_frames": prep.n_frames, "sampled_fps": float(decoded.sampled_fps),
                   "fps": float(decoded.fps), "duration": float(decoded.duration),
                   "width": int(decoded.width), "height": int(decoded.height),
                   "resized": list(resized) if resized else None},
            tokens={"total": n, "visual": prep.visual_tokens, "text": prep.text_tokens,
                    "generated": len(gen.token_ids)},
            sparsity=_sparsity(ctx.densities, ad.patterns), timings_ms=timings)


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


def _sparsity(plans: dict, patterns) -> dict | None:
    """Densities of the sparse layers (fractions of the causal triangle), read from the plans
    after the request so reading them never sits inside the timed prefill."""
    if not plans:
        return None
    per_layer, tiles = {}, {}
    for layer, plan in sorted(plans.items()):
        d = plan.density() if hasattr(plan, "density") else plan
        if isinstance(d, dict):
            per_layer[layer] = float(d["logical"])
            if "physical" in d:
                tiles[layer] = float(d["physical"])
        else:
            per_layer[layer] = float(d)
    out = {"mean_density": sum(per_layer.values()) / len(per_layer),
           "per_layer": [round(v, 6) for v in per_layer.values()],
           "layers": list(per_layer),
           "uncalibrated": bool(getattr(patterns, "uncalibrated", True))}
    if tiles:
        out["mean_tile_density"] = sum(tiles.values()) / len(tiles)
    return out
