"""Qwen2.5-VL adapter: our own video preprocessing (no torchvision), the chat-template prompt,
M-RoPE positions by the reference rule, and the ModalityIndex from the same token layout.

Preprocessing follows qwen-vl-utils + Qwen2VLVideoProcessor numerically: ``smart_resize``
(factor 28) under a per-frame pixel cap derived from a whole-video budget, bicubic resize with
antialias rounded to uint8 levels, CLIP normalisation, an even frame count (last frame
repeated), and patches in (t, h/2, w/2, 2, 2) order with features (C, T, 14, 14).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from einops import rearrange
from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from mminfer.errors import Cancelled, ConfigError, InputError, VideoError
from mminfer.models import fp8, hooks
from mminfer.models.base import (VIDEO, Adapter, Conversation, PrepareOptions, Prepared,
                                 resolve_checkpoint)
from mminfer.models.streaming import QwenStreamLayout
from mminfer.models.vision import (CHUNK_PATCHES, COMPILE_DEFAULT, QwenVisionTower,
                                   device_constant, frame_chunks, to_device)
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity, default_config

# qwen-vl-utils defaults (video): pixels per frame and for the whole video.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)
FRAME_FACTOR = 2
MAX_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SYSTEM = "You are a helpful assistant."
RESIZE_CHUNK = 16     # frames resized at once: bounds the float copy of a long video

REPO_CONFIGS = Path(__file__).resolve().parent / "configs"   # shipped as package data
PATTERNS_FILE = "mminfer_patterns.json"
# The real 7B shape -> its shipped head-pattern config.
SHIPPED_PATTERNS = {(28, 28, 4, 128): "qwen2_5_vl_7b.json"}   # (layers, heads, kv, dim)


# ---------------------------------------------------------------------- resize numerics
def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = VIDEO_MIN_PIXELS,
                 max_pixels: int = VIDEO_MAX_PIXELS) -> tuple[int, int]:
    """Both sides multiples of ``factor``, area within [min_pixels, max_pixels], aspect ratio
    kept as closely as possible (qwen-vl-utils ``smart_resize``)."""
    if min(height, width) <= 0:
        raise VideoError(f"frame size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise VideoError(f"frame aspect ratio {width}x{height} is beyond {MAX_RATIO}:1")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_pixel_range(n_frames: int, min_pixels: int | None = None,
                      max_pixels: int | None = None,
                      total_pixels: int | None = None) -> tuple[int, int]:
    """Per-frame (min, max) pixels: the whole-video budget spread over the frames (two frames
    make one temporal patch), capped at 768 tokens per frame and never below 1.05 x min."""
    lo = VIDEO_MIN_PIXELS if min_pixels is None else min_pixels
    total = VIDEO_TOTAL_PIXELS if total_pixels is None else total_pixels
    hi = max(min(VIDEO_MAX_PIXELS, total / max(n_frames, 1) * FRAME_FACTOR), int(lo * 1.05))
    if max_pixels is not None:
        hi = min(hi, max_pixels)
    return lo, int(hi)


def resize_frames(frames, height: int, width: int):
    """uint8 ``[T, H, W, 3]`` -> float ``[T, 3, height, width]`` on uint8 levels (0..255,
    rounded), bicubic with antialias as torchvision does for the uint8 tensors qwen-vl-utils
    resizes."""
    x = frames.permute(0, 3, 1, 2).float()                          # [T, 3, H, W]
    if x.shape[-2:] != (height, width):
        x = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic",
                                            align_corners=False, antialias=True)
    return x.round_().clamp_(0, 255)


def patchify(x, patch: int = 14, temporal: int = 2, merge: int = 2):
    """Normalised frames ``[T, C, H, W]`` (T a multiple of ``temporal``) -> patches
    ``[t*h*w, C*temporal*patch*patch]``: rows in (t, h/merge, w/merge, merge, merge) order
    (each 2x2 unit the merger joins is four consecutive rows), features (C, T, p, p) as the
    Conv3d patch embedding reads them."""
    return rearrange(x, "(t tp) c (hu i p) (wu j q) -> (t hu wu i j) (c tp p q)",
                     tp=temporal, i=merge, j=merge, p=patch, q=patch)


def video_grid(n_frames: int, height: int, width: int, *, min_pixels=None, max_pixels=None,
               total_pixels=None, patch: int = 14, temporal: int = 2, merge: int = 2):
    """Frame size and patch grid for ``n_frames`` source frames of ``height x width``:
    ``((resized_h, resized_w), (t, h, w), n_frames after padding to whole pairs)``."""
    lo, hi = frame_pixel_range(n_frames, min_pixels, max_pixels, total_pixels)
    rh, rw = smart_resize(height, width, patch * merge, lo, hi)
    T_pad = -(-n_frames // temporal) * temporal
    return (rh, rw), (T_pad // temporal, rh // patch, rw // patch), T_pad


def frames_to_patches(frames, size, *, mean=CLIP_MEAN, std=CLIP_STD, patch: int = 14,
                      temporal: int = 2, merge: int = 2, device="cpu", dtype=None):
    """uint8 frames ``[n, H, W, 3]`` (numpy or torch; n a multiple of ``temporal``) -> model
    patches ``[n/temporal * h*w, 3*temporal*patch^2]`` on ``device``: resized to ``size``
    (h, w) unless already there, normalised in fp32, patchified, then ``dtype``. Resizes
    ``RESIZE_CHUNK`` frames at a time (bounds the float copy of large frames)."""
    x = torch.as_tensor(frames)
    n = x.shape[0]
    if n % temporal:
        raise VideoError(f"{n} frames do not make whole temporal patches of {temporal}")
    rh, rw = size
    rows = (rh // patch) * (rw // patch)
    dtype = dtype or torch.float32
    out = torch.empty(n // temporal * rows, 3 * temporal * patch * patch, dtype=dtype,
                      device=device)
    dev = str(torch.device(device))
    mean_t = device_constant(tuple(mean), dev).view(1, 3, 1, 1) * 255.0
    std_t = device_constant(tuple(std), dev).view(1, 3, 1, 1) * 255.0
    step = RESIZE_CHUNK - RESIZE_CHUNK % temporal
    for s in range(0, n, step):
        part = to_device(x[s:s + step], device)
        part = (resize_frames(part, rh, rw) - mean_t) / std_t             # [k, 3, rh, rw]
        g0, g1 = s // temporal, (s + len(part)) // temporal
        out[g0 * rows:g1 * rows] = patchify(part, patch, temporal, merge).to(dtype)
    return out


def preprocess_video(frames, *, min_pixels=None, max_pixels=None, total_pixels=None,
                     mean=CLIP_MEAN, std=CLIP_STD, patch: int = 14, temporal: int = 2,
                     merge: int = 2, device="cpu", dtype=None):
    """Decoded frames (uint8 ``[T, H, W, 3]``, numpy or torch) -> ``(pixel_values_videos
    [t*h*w, 3*temporal*patch^2], grid_thw (t, h, w), n_frames_after_padding)``, the whole
    video at once (the adapter streams it in chunks instead; same numbers)."""
    frames = torch.as_tensor(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise VideoError(f"expected frames [T, H, W, 3], got {tuple(frames.shape)}")
    T, H, W, _ = frames.shape
    size, grid, T_pad = video_grid(T, H, W, min_pixels=min_pixels, max_pixels=max_pixels,
                                   total_pixels=total_pixels, patch=patch, temporal=temporal,
                                   merge=merge)
    idx = torch.arange(T_pad).clamp_(max=T - 1)                   # pads with the last frame
    pixels = frames_to_patches(frames[idx], size, mean=mean, std=std, patch=patch,
                               temporal=temporal, merge=merge, device=device, dtype=dtype)
    return pixels, grid, T_pad


# ---------------------------------------------------------------------- M-RoPE
def mrope_positions(index, second_per_grid_ts, tokens_per_second: float):
    """3-D positions ``[3, L]`` and ``rope_delta`` by the reference rule (Qwen training code,
    vLLM): text runs count on from the current position; a video span starting at s puts
    token (g, r, c) at (s + floor(g * second_per_grid_ts * tokens_per_second), s + r, s + c);
    the text after it starts at max(vision positions) + 1. Decode token i is at
    ``i + rope_delta`` on all three axes."""
    L = index.n
    pos = torch.empty(3, L, dtype=torch.long)
    cur, k = 0, 0
    for sp in index.spans:
        a, b = sp.start, sp.end
        if sp.modality == "text":
            pos[:, a:b] = torch.arange(cur, cur + sp.length)
            cur += sp.length
            continue
        t, gh, gw = sp.n_frames, sp.grid_h, sp.grid_w
        if sp.modality == "video":
            interval = float(second_per_grid_ts[k]) * tokens_per_second
            k += 1
        else:
            interval = 1.0
        tt = torch.floor(torch.arange(t, dtype=torch.float64) * interval).long()
        pos[0, a:b] = (cur + tt).repeat_interleave(gh * gw)
        pos[1, a:b] = (cur + torch.arange(gh)).repeat_interleave(gw).repeat(t)
        pos[2, a:b] = (cur + torch.arange(gw)).repeat(t * gh)
        cur = int(pos[:, a:b].max()) + 1
    return pos, int(pos.max()) + 1 - L


# ---------------------------------------------------------------------- the adapter
class Qwen2_5_VLAdapter(Adapter):
    name = "qwen2_5_vl"
    sampling = "qwen"

    def __init__(self, model, tokenizer, path, *, device="cpu", dtype=None, model_id=None,
                 revision=None, video_defaults=None, mean=CLIP_MEAN, std=CLIP_STD):
        self.model = model
        self.tokenizer = tokenizer
        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = dtype or next(model.parameters()).dtype
        cfg = model.config
        self.cfg, self.tcfg, self.vcfg = cfg, cfg.text_config, cfg.vision_config
        self.text_model = model.model.language_model
        self.lm_head = model.lm_head
        self.video_token_id = int(cfg.video_token_id)
        self.image_token_id = int(cfg.image_token_id)
        self.max_context = int(self.tcfg.max_position_embeddings)
        self.video_defaults = video_defaults or {}
        self.mean, self.std = mean, std
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.identity = _identity(self.tcfg, model_id or self.path.resolve().name, revision)
        self.patterns = None
        self.vision_chunk_patches = CHUNK_PATCHES   # patches per tower call (memory bound)
        self.set_vision_compile(COMPILE_DEFAULT)

    def set_vision_compile(self, compile: bool):
        """The vision tower's fused block through ``torch.compile`` (CUDA only: on the CPU
        the tower stays eager), chunks padded to one shape per frame size."""
        on = bool(compile) and self.device.type == "cuda"
        self.tower = QwenVisionTower(self.model.model.visual, compile=on)

    # ---------------------------------------------------------------- loading
    @classmethod
    def accepts(cls, path) -> bool:
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            return False
        try:
            return json.loads(cfg.read_text()).get("model_type") == "qwen2_5_vl"
        except (OSError, ValueError):
            return False

    @classmethod
    def from_pretrained(cls, path, *, device=None, dtype=None, model_id=None, revision=None,
                        quantization=None):
        """Load a local checkpoint dir or hub id (HF_HUB_OFFLINE respected).
        ``quantization="fp8"``: the language model's projections and the vision blocks'
        qkv/proj/MLP quantised at load (mminfer.models.fp8). A compressed-tensors FP8-Dynamic
        checkpoint loads as it is (its layers with ``weight_scale`` become FP8, the ones it
        left unquantised stay in ``dtype``) and implies ``quantization="fp8"``."""
        path, rid, rrev = resolve_checkpoint(str(path))
        model_id, revision = model_id or rid, revision or rrev
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        quantization = fp8.check(quantization)
        stored = fp8.checkpoint_quantization(fp8.read_config(path), f"{path}/config.json")
        extra = {}
        try:
            if stored:
                # transformers would hand the checkpoint to the compressed-tensors package;
                # we load its e4m3 weights into `dtype` (exact) and apply its scales below
                config = AutoConfig.from_pretrained(path)
                del config.quantization_config
                extra["config"] = config
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path, dtype=dtype,
                attn_implementation={"text_config": hooks.register(), "vision_config": "sdpa"},
                **extra)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load Qwen2.5-VL checkpoint {path}: {e}") from e
        model.to(device).eval()
        if stored:
            fp8.apply_scales(model, fp8.load_scales(path, rename=checkpoint_module_name))
        elif quantization == "fp8":
            fp8.convert(model.model.language_model, fp8.is_llm_linear)
            fp8.convert(model.model.visual, fp8.is_vision_linear)
        pre = _read_json(path / "preprocessor_config.json")
        adapter = cls(model, tokenizer, path, device=device, dtype=dtype, model_id=model_id,
                      revision=revision, video_defaults=_video_defaults(path),
                      mean=tuple(pre.get("image_mean", CLIP_MEAN)),
                      std=tuple(pre.get("image_std", CLIP_STD)))
        adapter.quantization = stored or quantization
        adapter.patterns = load_patterns(path, adapter.identity)
        return adapter

    # ---------------------------------------------------------------- per request
    def prompt_ids(self, question, n_video_tokens: int) -> list[int]:
        """Token ids of the whole prompt (a question or a Conversation), the video as
        ``n_video_tokens`` pads: :meth:`split_prompt` joined."""
        prefix, suffix = Qwen2_5_VLAdapter.split_prompt(self, question, n_video_tokens)
        return prefix + suffix

    def split_prompt(self, conversation, n_video_tokens: int) -> tuple[list[int], list[int]]:
        """``(prefix, suffix)`` token ids of the chat-template layout (Qwen2.5-VL's ChatML:
        the default system prompt unless the conversation starts with one; a video part is
        ``<|vision_start|>`` + ``n_video_tokens`` pads + ``<|vision_end|>``, what the HF
        processor makes of one ``<|video_pad|>``, without tokenizing 10^5 pads). The prefix
        ends with ``<|vision_end|>``; the suffix ends with the assistant's opening. Message
        texts are tokenized as plain text: special-token strings in them stay text, so no
        message can end its turn or add a video."""
        conv = conversation if isinstance(conversation, Conversation) else \
            Conversation.single(conversation)
        tok = self.tokenizer
        special = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
        plain = lambda t: tok(t, add_special_tokens=False,                 # noqa: E731
                              split_special_tokens=True)["input_ids"]
        out, prefix = [], None
        turns = conv.turns
        if turns[0].role != "system":
            out += special(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
        for t in turns:
            out += special(f"<|im_start|>{t.role}\n")
            for part in t.parts:
                if part is VIDEO:
                    out += special("<|vision_start|>") + [self.video_token_id] * n_video_tokens \
                        + special("<|vision_end|>")
                    prefix, out = out, []
                elif part:
                    out += plain(part)
            out += special("<|im_end|>\n")
        out += special("<|im_start|>assistant\n")
        if prefix is None:
            raise InputError("the conversation has no video")
        return prefix, out

    def prepare(self, video, question: str, options: PrepareOptions | None = None) -> Prepared:
        """Token layout, ModalityIndex and M-RoPE positions of ``video`` (decoded frames, or
        a ``VideoStream`` still to be decoded: it is told the frame size, and decodes while
        ``embed`` runs). No pixels are made here: ``embed`` preprocesses chunk by chunk."""
        v = self.vcfg
        frames = _frames_of(video)
        T, H, W, _ = frames.shape
        (rh, rw), (t, h, w), n_frames = self._grid(T, H, W, options)
        if hasattr(frames, "request_size"):
            frames.request_size(rh, rw)
        merge = v.spatial_merge_size
        n_video = t * (h // merge) * (w // merge)
        prefix, suffix = self.split_prompt(question, n_video)
        ids = prefix + suffix
        grid = torch.tensor([[t, h, w]], dtype=torch.long)
        index, prefix_index = (
            ModalityIndex.qwen2_5_vl(x, grid, video_token_id=self.video_token_id,
                                     image_token_id=self.image_token_id,
                                     spatial_merge_size=merge) for x in (ids, prefix))
        fps = float(video.sampled_fps)
        if not fps > 0:
            raise VideoError(f"sampled fps {fps} is not positive")
        sgt = [v.temporal_patch_size / fps]
        pos, delta = mrope_positions(index, sgt, float(v.tokens_per_second))
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        return Prepared(
            input_ids=input_ids, index=index, n_frames=n_frames, visual_tokens=n_video,
            text_tokens=len(ids) - n_video, prefix_len=len(prefix), prefix_index=prefix_index,
            rope_delta=int(delta),
            tensors={"frames": frames, "video_grid_thw": grid.to(self.device),
                     "second_per_grid_ts": sgt, "position_ids": pos[:, None].to(self.device),
                     "rope_delta": delta,
                     "mm_token_type_ids": (input_ids == self.video_token_id).long() * 2,
                     "resized": (rh, rw)})

    def stream_layout(self, conversation, fps, frame_hw, options=None):
        return QwenStreamLayout(self, conversation, fps, frame_hw, options)

    def visual_tokens(self, n_frames: int, height: int, width: int,
                      options: PrepareOptions | None = None) -> int:
        _, (t, h, w), _ = self._grid(n_frames, height, width, options)
        merge = self.vcfg.spatial_merge_size
        return t * (h // merge) * (w // merge)

    def _grid(self, n_frames: int, height: int, width: int, options: PrepareOptions | None):
        """:func:`video_grid` of the frames with the request's pixel options, the
        checkpoint's preprocessor defaults where it leaves them out."""
        opt = options or PrepareOptions()
        pick = lambda v, key: v if v is not None else self.video_defaults.get(key)  # noqa: E731
        v = self.vcfg
        return video_grid(
            n_frames, height, width, min_pixels=pick(opt.min_pixels, "min_pixels"),
            max_pixels=pick(opt.max_pixels, "max_pixels"),
            total_pixels=pick(opt.total_pixels, "total_pixels"), patch=v.patch_size,
            temporal=v.temporal_patch_size, merge=v.spatial_merge_size)

    def pixel_values(self, prepared: Prepared):
        """The whole video's ``pixel_values_videos`` at once, as transformers' processor
        makes them (for reference paths; ``embed`` never holds them)."""
        frames = prepared.tensors["frames"]
        chunks = list(frame_chunks(frames, max(len(frames), 1)))
        x = torch.as_tensor(chunks[0] if len(chunks) == 1 else _cat(chunks))
        x = x[torch.arange(prepared.n_frames).clamp_(max=len(x) - 1)]
        return self._patches(x, prepared.tensors["resized"])

    def _patches(self, frames, size):
        v = self.vcfg
        return frames_to_patches(frames, size, mean=self.mean, std=self.std,
                                 patch=v.patch_size, temporal=v.temporal_patch_size,
                                 merge=v.spatial_merge_size, device=self.device,
                                 dtype=self.dtype)

    def embed(self, prepared: Prepared, *, timer=None, cancel=None, shard=None):
        """Text embeddings with the video's features in its span: frames stream through
        preprocessing and the vision tower ``vision_chunk_patches`` patches at a time, each
        chunk's features written straight into the embeddings. ``timer(name)`` (a
        StageTimer) times each chunk's "preprocess" and "vision"; ``cancel()`` is checked
        between chunks; ``shard`` as the base class."""
        section = timer if timer is not None else (lambda name: nullcontext())
        ids = prepared.input_ids
        tens = prepared.tensors
        t, h, w = (int(x) for x in tens["video_grid_thw"][0])
        T = self.vcfg.temporal_patch_size
        units = h * w // self.vcfg.spatial_merge_size ** 2
        with torch.inference_mode():
            embeds = self.text_model.get_input_embeddings()(ids)          # [1, L, hidden]
            at = (ids[0] == self.video_token_id).nonzero().flatten()
            if len(at) != prepared.visual_tokens or t * units != len(at) or (
                    len(at) and int(at[-1] - at[0]) + 1 != len(at)):
                raise ConfigError(f"{len(at)} video positions in the prompt for "
                                  f"{prepared.visual_tokens} video tokens of a {t}x{h}x{w} "
                                  f"grid, or not one run")
            out = embeds[0, int(at[0]):int(at[0]) + len(at)] if len(at) else embeds[0, :0]
            pairs = self.tower.pairs_per_chunk(h, w, self.vision_chunk_patches)
            per_chunk = pairs * T
            done = 0
            for frames in frame_chunks(tens["frames"], per_chunk):
                if cancel is not None and cancel():
                    raise Cancelled("request cancelled in the vision tower")
                frames = torch.as_tensor(frames)
                if len(frames) % T:                       # odd count: repeat the last frame
                    frames = torch.cat([frames] + [frames[-1:]] * (T - len(frames) % T))
                n = len(frames) // T
                if done + n > t:
                    raise ConfigError(f"the video gave more than the {t} temporal pairs its "
                                      f"prompt was laid out for")
                if shard is not None and not shard.take(out, done * units, (done + n) * units):
                    done += n            # another rank's chunk (mminfer.engine.parallel)
                    continue
                with section("preprocess"):
                    pixels = self._patches(frames, tens["resized"])
                with section("vision"):
                    feats = self.tower(pixels, n, h, w, pad_to=pairs)
                    out[done * units:(done + n) * units] = feats.to(out.dtype)
                done += n
            if done != t:
                raise ConfigError(f"the video gave {done} temporal pairs, its prompt was laid "
                                  f"out for {t}")
        return embeds

    def positions(self, prepared: Prepared, start: int, length: int):
        L = prepared.input_ids.shape[1]
        if start + length <= L:
            return prepared.tensors["position_ids"][..., start:start + length]   # [3, 1, n]
        return self.positions_after(prepared.tensors["rope_delta"], start, length)

    def positions_after(self, rope_delta: int, start: int, length: int):
        """M-RoPE positions of tokens [start, start+length) after the video: text positions
        run on from the video's largest, ``i + rope_delta`` on all three axes."""
        p = torch.arange(start, start + length, device=self.device)
        return (p + int(rope_delta)).view(1, 1, -1).expand(3, 1, -1)


ADAPTER = Qwen2_5_VLAdapter


# ---------------------------------------------------------------------- helpers
def checkpoint_module_name(name: str) -> str:
    """A checkpoint's module name as the transformers 5 model names it: checkpoints saved
    before transformers 4.52 (the published ones) have ``model.layers...`` and
    ``visual...`` where the model has ``model.language_model.layers...`` and
    ``model.visual...``; newer ones already match."""
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith(("model.language_model.",
                                                          "model.visual.")):
        return "model.language_model." + name[len("model."):]
    return name


def _frames_of(video):
    """The frames of a decoded video (a uint8 ``[T, H, W, 3]`` tensor) or the video itself
    when it is a stream (``len``, ``shape``, ``chunks``)."""
    frames = getattr(video, "frames", video)
    if hasattr(frames, "chunks"):
        return frames
    frames = torch.as_tensor(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise VideoError(f"expected frames [T, H, W, 3], got {tuple(frames.shape)}")
    return frames


def _cat(chunks):
    return torch.cat([torch.as_tensor(c) for c in chunks])


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e


def _video_defaults(path: Path) -> dict:
    """Per-frame pixel range a checkpoint asks for in ``video_preprocessor_config.json``.
    The hub Qwen2.5-VL repos have none, so they get qwen-vl-utils' defaults; their image
    ``preprocessor_config.json`` range is deliberately not used (it would keep 1080p frames
    at full size)."""
    cfg = _read_json(path / "video_preprocessor_config.json")
    size = cfg.get("size") or {}
    out = {"min_pixels": size.get("shortest_edge", cfg.get("min_pixels")),
           "max_pixels": size.get("longest_edge", cfg.get("max_pixels")),
           "total_pixels": cfg.get("total_pixels")}
    return {k: int(v) for k, v in out.items() if v is not None}


def _eos_ids(model, tokenizer) -> tuple:
    ids = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    for tok in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(tok)
        if i is not None and i != tokenizer.unk_token_id:
            ids.add(i)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(int(i) for i in ids if i is not None))


def _identity(tcfg, model_id: str, revision):
    heads = tcfg.num_attention_heads
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads
    return ModelIdentity(id=model_id, revision=revision or "local",
                         layers=tcfg.num_hidden_layers, heads=heads,
                         kv_heads=tcfg.num_key_value_heads, head_dim=head_dim)


def load_patterns(path: Path, identity):
    """Head patterns for this checkpoint: ``mminfer_patterns.json`` next to it (identity
    checked in full), else the shipped config of its shape (the real 7B: checked on the
    shape, so a local copy or a same-shape fine-tune under another name still gets it), else
    an uncalibrated default for its shape."""
    local = Path(path) / PATTERNS_FILE
    if local.is_file():
        return HeadPatternConfig.load(local, expect=identity)
    shape = (identity.layers, identity.heads, identity.kv_heads, identity.head_dim)
    name = SHIPPED_PATTERNS.get(shape)
    if name and (REPO_CONFIGS / name).is_file():
        shipped = json.loads((REPO_CONFIGS / name).read_text()).get("model", {})
        expect = replace(identity, id=shipped.get("id", identity.id),
                         revision=shipped.get("revision", identity.revision))
        return HeadPatternConfig.load(REPO_CONFIGS / name, expect=expect)
    return default_config(identity)
