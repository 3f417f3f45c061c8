"""LongVILA: a Qwen2 LLM, a SigLIP vision tower and the ``mlp_downsample`` projector, loaded
from the checkpoint's own subfolders with transformers' building blocks.

transformers has no VILA class and VILA's remote code does not import on 5.x, so the
checkpoint is read piece by piece: the root ``config.json`` as plain JSON (VILA's
``llava_llama`` format and the ``vila`` remote-code format share the fields we read),
``llm/`` as ``Qwen2ForCausalLM`` with our attention hook, ``vision_tower/`` as
``SiglipVisionModel`` (sdpa), ``mm_projector/`` rebuilt here from its weights.

Token layout of one request (VILA's ``BasicVideoEncoder``): the user text is
``"<vila/video>" + question`` inside Qwen2's ChatML template; the one ``<vila/video>`` token
becomes F frames of P visual embeddings followed by the embedding of "\\n", so frame f
occupies [s + f(P+1), s + (f+1)(P+1)) with its newline last. ``Prepared.input_ids`` spells
that layout out (video id at visual rows, the newline id at separators), so the
ModalityIndex and the embedding splice read the same ids.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from einops import rearrange
from huggingface_hub import snapshot_download
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, SiglipVisionModel

from mminfer.errors import Cancelled, ConfigError, InputError, VideoError
from mminfer.models import fp8, hooks, siglip
from mminfer.models.base import VIDEO, Adapter, Conversation, Prepared, PrepareOptions
from mminfer.models.streaming import LongVILAStreamLayout
from mminfer.video.sampling import vila_indices
from mminfer.models.vision import device_constant, frame_chunks, to_device
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity, default_config

VIDEO_TOKEN = "<vila/video>"
MEDIA_TOKENS = ("<vila/sentinel>", "<image>", VIDEO_TOKEN)
# VILA names the 2×2 merge both ways; the module and its weight names are the same.
PROJECTOR_TYPES = ("mlp_downsample", "mlp_downsample_2x2_fix")
SUBFOLDERS = ("llm", "vision_tower", "mm_projector")
LONGVILA_7B_1M = "Efficient-Large-Model/qwen2-7b-longvila-1M"
REPO_CONFIGS = Path(__file__).resolve().parent / "configs"   # shipped as package data
PATTERNS_FILE = "mminfer_patterns.json"       # a checkpoint's own calibrated patterns
# The real 7B LLM shape (layers, heads, kv heads, head dim) -> its shipped head patterns.
SHIPPED_PATTERNS = {(28, 28, 4, 128): "longvila_7b_1m.json"}
# VILA's chat_templates/qwen2.jinja: Qwen2 ChatML, system text without the final period.
_VILA_QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- projector
def space_to_depth_2x2(x: torch.Tensor) -> torch.Tensor:
    """``[B, N, C]`` tokens of a √N×√N row-major grid → ``[B, ⌈√N/2⌉², 4C]``.

    An odd side gets a zero row (bottom) / column (right) first. Merged cell (i, j) holds the
    channels of (2i,2j), (2i,2j+1), (2i+1,2j), (2i+1,2j+1) in that order; cells row-major.
    This is VILA's ``DownSampleBlock.flat_square`` order, which the projector was trained on.
    """
    b, n, c = x.shape
    s = math.isqrt(n)
    if s * s != n:
        raise ConfigError(f"vision tower gave {n} tokens per frame, not a square grid")
    x = x.reshape(b, s, s, c)
    if s % 2:
        x = nn.functional.pad(x, (0, 0, 0, 1, 0, 1))       # [B, s+1, s+1, C]
    return rearrange(x, "b (i di) (j dj) c -> b (i j) (di dj c)", di=2, dj=2)


class SpaceToDepth2x2(nn.Module):
    def forward(self, x):
        return space_to_depth_2x2(x)


class Projector(nn.Module):
    """VILA's ``mlp_downsample`` projector; the Sequential indices are the weight names
    (``layers.1`` LayerNorm, ``layers.2`` and ``layers.4`` Linear)."""

    def __init__(self, vision_hidden: int, llm_hidden: int):
        super().__init__()
        self.layers = nn.Sequential(
            SpaceToDepth2x2(),
            nn.LayerNorm(4 * vision_hidden),
            nn.Linear(4 * vision_hidden, llm_hidden),
            nn.GELU(),
            nn.Linear(llm_hidden, llm_hidden),
        )

    def forward(self, x):                                  # [B, N, C] -> [B, P, hidden]
        return self.layers(x)


def tokens_per_frame(image_size: int, patch_size: int) -> int:
    """P = ⌈⌊S/patch⌋ / 2⌉²: 448 px → 256, 384 px → 196."""
    return math.ceil((image_size // patch_size) / 2) ** 2


# --------------------------------------------------------------------------- layout
@dataclass
class Layout:
    """What the root config and the subfolders say, checked before any weight is read."""
    root: Path
    config: dict
    projector_type: str
    select_layer: int
    num_video_frames: int
    image_size: int
    patch_size: int
    image_mean: tuple
    image_std: tuple
    pad_to_square: bool       # image_aspect_ratio "pad"; every other value squashes frames
    chat_template: str | None


def resolve(path_or_id: str | os.PathLike, revision: str | None = None) -> Path:
    """A local checkpoint folder, or a hub id fetched (or found in the cache when
    HF_HUB_OFFLINE is set) with ``snapshot_download``."""
    p = Path(path_or_id).expanduser()
    if p.exists():
        return p
    name = str(path_or_id)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise ConfigError(f"LongVILA checkpoint {name!r}: no such folder, and not a hub id")
    try:
        return Path(snapshot_download(name, revision=revision))
    except Exception as e:   # offline miss, unknown repo, gated: all mean "not available here"
        raise ConfigError(f"LongVILA checkpoint {name!r} is not available locally and could "
                          f"not be downloaded ({type(e).__name__}: {e})") from e


def read_layout(root: Path) -> Layout:
    root = Path(root)
    cfg = _read_json(root / "config.json", "the root config.json")
    if not _is_vila_config(cfg):
        raise ConfigError(f"{root}/config.json is not a VILA/LongVILA config "
                          f"(model_type {cfg.get('model_type')!r}, no llm_cfg)")
    for sub in SUBFOLDERS:
        if not (root / sub / "config.json").is_file():
            raise ConfigError(f"LongVILA checkpoint {root} has no {sub}/ subfolder "
                              f"(expected {sub}/config.json and its weights)")
    if cfg.get("s2") or cfg.get("dynamic_s2"):
        raise ConfigError("multi-scale (S2) vision features are NVILA's recipe, not LongVILA's; "
                          "not supported")
    enc = cfg.get("video_encoder")
    if isinstance(enc, dict) and "Basic" not in str(enc.get("_target_", "Basic")):
        raise ConfigError(f"video encoder {enc.get('_target_')!r} pools frames (NVILA); only "
                          "LongVILA's one-newline-per-frame encoder is supported")

    pcfg = _read_json(root / "mm_projector" / "config.json", "mm_projector/config.json")
    root_pcfg = cfg.get("mm_projector_cfg")
    ptype = (pcfg.get("mm_projector_type")
             or (root_pcfg.get("mm_projector_type") if isinstance(root_pcfg, dict) else None)
             or cfg.get("mm_projector_type") or cfg.get("mm_projector"))
    if ptype not in PROJECTOR_TYPES:
        raise ConfigError(f"unknown LongVILA projector type {ptype!r} in {root}/mm_projector "
                          f"(supported: {', '.join(PROJECTOR_TYPES)})")
    feature = cfg.get("mm_vision_select_feature", "cls_patch")
    if feature != "cls_patch":
        raise ConfigError(f"mm_vision_select_feature {feature!r}: SigLIP towers keep all "
                          "tokens ('cls_patch'); nothing else is supported")

    vcfg = _read_json(root / "vision_tower" / "config.json", "vision_tower/config.json")
    vcfg = vcfg.get("vision_config", vcfg)   # a full SigLIP config nests the vision part
    pre_path = root / "vision_tower" / "preprocessor_config.json"
    pre = _read_json(pre_path, "preprocessor_config.json") if pre_path.is_file() else {}
    template = cfg.get("chat_template")
    return Layout(
        root=root, config=cfg, projector_type=ptype,
        select_layer=int(cfg.get("mm_vision_select_layer", -2)),
        num_video_frames=int(cfg.get("num_video_frames") or 8),
        image_size=int(vcfg.get("image_size", 224)), patch_size=int(vcfg.get("patch_size", 14)),
        image_mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
        pad_to_square=cfg.get("image_aspect_ratio") == "pad",
        chat_template=_VILA_QWEN2_TEMPLATE if template == "qwen2" else None)


def _is_vila_config(cfg: dict) -> bool:
    return cfg.get("model_type") in ("llava_llama", "vila") or "llm_cfg" in cfg


def _read_json(p: Path, what: str) -> dict:
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} not found at {p}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} at {p} is not valid JSON: {e}") from None


def load_projector(folder: Path, vision_hidden: int, llm_hidden: int) -> Projector:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no projector weights (*.safetensors) in {folder}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    proj = Projector(vision_hidden, llm_hidden)
    try:
        proj.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"projector weights in {folder} do not fit mlp_downsample "
                          f"{4 * vision_hidden}->{llm_hidden}->{llm_hidden}: {e}") from None
    return proj


# --------------------------------------------------------------------------- adapter
class LongVILA(Adapter):
    name = "longvila"
    sampling = "uniform"          # VILA: round(linspace(0, T-1, num_video_frames))
    vision_batch = 32             # frames per vision-tower call (bounds activation memory)
    fp8_encoder = None            # quantization="fp8": SigLIP's layers as models/siglip.py runs them

    @classmethod
    def accepts(cls, path) -> bool:
        p = Path(path) / "config.json"
        try:
            return p.is_file() and _is_vila_config(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return False

    @classmethod
    def from_pretrained(cls, path_or_id, *, revision: str | None = None, **kw) -> "LongVILA":
        """Load from a local folder or a hub id (see ``resolve``); ``kw`` as ``load``."""
        root = resolve(path_or_id, revision)
        if Path(path_or_id).expanduser().exists():
            return cls.load(root, revision=revision, **kw)
        # a hub snapshot folder is named by its commit: the exact revision loaded
        return cls.load(root, **{"model_id": str(path_or_id), "revision": root.name, **kw})

    @classmethod
    def load(cls, path, *, device=None, dtype=None, model_id: str | None = None,
             revision: str | None = None, num_frames: int | None = None,
             patterns=None, quantization: str | None = None) -> "LongVILA":
        """Load the checkpoint in local folder ``path``. ``num_frames`` overrides the config's
        ``num_video_frames``. ``patterns``: a head-pattern file or HeadPatternConfig (checked
        against the model identity); None takes ``mminfer_patterns.json`` next to the
        checkpoint, else the shipped file of the real 7B shape, else a generated default.
        ``quantization="fp8"``: the LLM's projections and SigLIP's attention projections and
        MLPs quantised at load (mminfer.models.fp8; the projector stays as it is)."""
        root = Path(path)
        layout = read_layout(root)
        quantization = fp8.check(quantization)
        for part in ("llm", "vision_tower"):
            if fp8.read_config(root / part).get("quantization_config"):
                raise ConfigError(f"{root / part}: pre-quantised LongVILA checkpoints are not "
                                  f"supported; load the bf16 one with quantization='fp8'")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

        self = cls()
        self.layout, self.device, self.dtype = layout, device, dtype
        self.num_frames = int(num_frames or layout.num_video_frames)
        self.frame_limit = self.num_frames      # the decoder samples this many at most, once
        self.model_id, self.revision = model_id or str(root), revision

        tok = _load(AutoTokenizer.from_pretrained, root / "llm", "tokenizer")
        missing = [t for t in MEDIA_TOKENS if t not in tok.get_vocab()]
        if missing:   # never embedded (replaced in embedding space), so the vocab may end before
            tok.add_tokens(missing, special_tokens=True)
        if layout.chat_template is not None or not tok.chat_template:
            tok.chat_template = layout.chat_template or _VILA_QWEN2_TEMPLATE
        self.tokenizer = tok
        self.video_token_id = tok.convert_tokens_to_ids(VIDEO_TOKEN)
        nl = tok.encode("\n", add_special_tokens=False)
        if len(nl) != 1:
            raise ConfigError(f"the tokenizer in {root}/llm splits '\\n' into {nl}; LongVILA "
                              "separates frames with one newline token")
        self.newline_id = nl[0]

        # no device_map: it needs accelerate; 7B in bf16 loads on the host, then moves
        llm = _load(Qwen2ForCausalLM.from_pretrained, root / "llm", "language model",
                    dtype=dtype, attn_implementation=hooks.register())
        self.llm = llm.to(device).eval()
        self.text_model, self.lm_head = self.llm.model, self.llm.lm_head
        self.quantization = quantization
        if quantization == "fp8":
            fp8.convert(self.text_model, fp8.is_llm_linear)
        lcfg = self.llm.config
        self.max_context = int(lcfg.max_position_embeddings)
        eos = {tok.eos_token_id, *_as_list(self.llm.generation_config.eos_token_id),
               *_as_list(lcfg.eos_token_id)}
        for t in ("<|im_end|>", "<|endoftext|>"):
            if t in tok.get_vocab():
                eos.add(tok.convert_tokens_to_ids(t))
        self.eos_token_ids = tuple(sorted(e for e in eos if e is not None))

        vision = _load(SiglipVisionModel.from_pretrained, root / "vision_tower",
                       "vision tower", dtype=dtype, attn_implementation="sdpa")
        self.tower = _truncate_tower(vision, layout.select_layer).to(device).eval()
        if quantization == "fp8":
            fp8.convert(self.tower, fp8.is_vision_linear)
            if siglip.fusable(self.tower.encoder):   # our steps: a quantisation per producer
                self.fp8_encoder = siglip.Fp8Encoder(self.tower.encoder)
        vhidden = vision.config.hidden_size
        self.image_size = layout.image_size
        self.tokens_per_frame = tokens_per_frame(layout.image_size, layout.patch_size)
        self.projector = load_projector(root / "mm_projector", vhidden, lcfg.hidden_size)
        self.projector.to(device=device, dtype=dtype).eval()

        self.identity = _identity(self.model_id, self.revision, lcfg)
        self.patterns = _head_patterns(root, patterns, self.identity)
        return self

    # ------------------------------------------------------------ per request
    def prepare(self, video, question: str, options: PrepareOptions | None = None) -> Prepared:
        """Frames ``[T, H, W, 3]`` uint8 (or a decoded video with ``.frames``, or a
        ``VideoStream`` still to be decoded) + question → token layout and ModalityIndex.
        The frames are kept as they are (a stream is told which samples and what size to
        decode); ``embed`` squashes them to S×S chunk by chunk."""
        frames = _frames_tensor(video)                   # [T, H, W, 3] uint8, or the stream
        want = self._frames_taken(options)
        if len(frames) > want:   # more than the model takes (a direct caller): VILA's picks
            idx = vila_indices(0, len(frames) - 1, want)
            frames = frames.keep_samples(idx) if hasattr(frames, "chunks") \
                else frames[torch.from_numpy(idx)]
        if hasattr(frames, "request_size"):
            frames.request_size(*self._frame_size(frames.shape[1], frames.shape[2]))
        n_frames = len(frames)

        prefix, suffix = self._prompt_ids(question)
        P = self.tokens_per_frame
        video_ids = ([self.video_token_id] * P + [self.newline_id]) * n_frames
        ids = prefix + video_ids + suffix
        if len(ids) > self.max_context:
            raise InputError(f"prompt of {len(ids)} tokens ({n_frames} frames × {P + 1}) is "
                             f"over the model's context of {self.max_context}",
                             tokens=len(ids), max_context=self.max_context)
        index = ModalityIndex.longvila(len(prefix), n_frames, P, len(suffix))
        return Prepared(input_ids=torch.tensor([ids], dtype=torch.long), index=index,
                        n_frames=n_frames, visual_tokens=len(video_ids),
                        text_tokens=len(prefix) + len(suffix),
                        prefix_len=len(prefix) + len(video_ids),
                        prefix_index=ModalityIndex.longvila(len(prefix), n_frames, P, 0),
                        tensors={"frames": frames, "resized": (self.image_size,) * 2})

    def stream_layout(self, conversation, fps, frame_hw, options=None):
        return LongVILAStreamLayout(self, conversation, fps, frame_hw, options)

    def visual_tokens(self, n_frames: int, height: int, width: int,
                      options: PrepareOptions | None = None) -> int:
        # every frame is squashed to one size: its tokens, then a newline
        return min(n_frames, self._frames_taken(options)) * (self.tokens_per_frame + 1)

    def _frames_taken(self, options) -> int:
        """Frames the model sees at most (more are picked down by VILA's rule)."""
        return int(getattr(options, "num_frames", None) or self.num_frames)

    def embed(self, prepared: Prepared, *, timer=None, cancel=None,
              shard=None) -> torch.Tensor:
        """Text embeddings with each frame's P projected visual rows in place; frames go
        through the squash, the tower and the projector ``vision_batch`` at a time, each
        chunk written straight into the embeddings. ``timer``/``cancel``/``shard`` as the
        base class."""
        section = timer if timer is not None else (lambda name: nullcontext())
        ids = prepared.input_ids.to(self.device)                       # [1, L]
        F, P = prepared.n_frames, self.tokens_per_frame
        is_vis = ids == self.video_token_id
        at = is_vis[0].nonzero().flatten()
        start = int(at[0]) if len(at) else 0
        span = is_vis[0, start:start + F * (P + 1)]
        if len(at) != F * P or len(span) != F * (P + 1) or \
                not bool(span.view(F, P + 1)[:, :P].all()):
            raise InputError(f"{len(at)} video positions for {F}×{P} visual embeddings, or "
                             f"not laid out as {F} frames of {P} + a newline")
        with torch.inference_mode():
            # the video id may lie past the LLM vocab (added at load); its rows are replaced
            embeds = self.text_model.get_input_embeddings()(ids.masked_fill(is_vis, 0))
            rows = embeds[0, start:start + F * (P + 1)].view(F, P + 1, -1)
            done = 0
            for chunk in frame_chunks(prepared.tensors["frames"], self.vision_batch):
                if cancel is not None and cancel():
                    raise Cancelled("request cancelled in the vision tower")
                f = len(chunk)
                if done + f > F:
                    raise InputError(f"the video gave more than the {F} frames its prompt "
                                     f"was laid out for")
                if shard is not None and not shard.take(rows[:, :P], done, done + f):
                    done += f            # another rank's chunk (mminfer.engine.parallel)
                    continue
                with section("preprocess"):
                    x = self._normalise(self._squash(torch.as_tensor(chunk)))
                with section("vision"):
                    rows[done:done + f, :P] = self._encode(x).to(rows.dtype)
                done += f
            if done != F:
                raise InputError(f"the video gave {done} frames, its prompt was laid out for "
                                 f"{F}")
        return embeds                                                   # [1, L, hidden]

    def pixels(self, prepared: Prepared) -> torch.Tensor:
        """All frames squashed, ``[F, 3, S, S]`` uint8 (what ``embed`` feeds the tower, at
        once; for reference paths)."""
        chunks = [self._squash(torch.as_tensor(c))
                  for c in frame_chunks(prepared.tensors["frames"], self.vision_batch)]
        return torch.cat(chunks)

    def positions(self, prepared: Prepared, start: int, length: int):
        return None                  # plain 1-D RoPE: the model counts from the cache length

    # ------------------------------------------------------------ pieces
    def encode_frames(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[F, 3, S, S]`` uint8 → ``[F, P, hidden]`` projected visual embeddings, the tower
        batched over ``vision_batch`` frames at a time."""
        with torch.inference_mode():
            return torch.cat([self._encode(self._normalise(chunk))
                              for chunk in pixels.split(self.vision_batch)])

    def _normalise(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 ``[f, 3, S, S]`` → the tower's input (model dtype, on the device)."""
        dev = str(self.device)
        mean = device_constant(tuple(self.layout.image_mean), dev).view(1, 3, 1, 1)
        std = device_constant(tuple(self.layout.image_std), dev).view(1, 3, 1, 1)
        x = to_device(pixels, self.device).float().div_(255)
        return ((x - mean) / std).to(self.dtype)

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised ``[f, 3, S, S]`` → ``[f, P, hidden]``: SigLIP up to ``select_layer``
        (one batched call), then the projector."""
        h = self.tower.embeddings(x)                                     # [f, N, C]
        if self.fp8_encoder is not None:
            h = self.fp8_encoder(h)
        else:
            h = _last_hidden(self.tower.encoder(inputs_embeds=h))        # layer select_layer
        return self.projector(h)

    def _frame_size(self, height: int, width: int) -> tuple[int, int]:
        """The size frames are wanted at before the squash: S×S, or, when they are padded
        to a square first, the frame scaled so its long side is S."""
        S = self.image_size
        if not self.layout.pad_to_square:
            return S, S
        m = max(height, width)
        return max(1, round(height * S / m)), max(1, round(width * S / m))

    def _squash(self, frames: torch.Tensor) -> torch.Tensor:
        """SigLIP preprocessing: bicubic (antialiased, like PIL) resize to S×S without keeping
        the aspect ratio (VILA's video frames with ``image_aspect_ratio`` "resize" or
        "dynamic"), rounded back to uint8 as the PIL path does. With "pad", LLaVA's
        expand2square first: centred on a square of the mean colour."""
        S = self.image_size
        out = []
        for chunk in frames.split(64):
            x = to_device(chunk, self.device).permute(0, 3, 1, 2).float()   # [f, 3, H, W]
            if self.layout.pad_to_square and x.shape[-1] != x.shape[-2]:
                x = _expand_to_square(x, self.layout.image_mean)
            if x.shape[-2:] != (S, S):
                x = nn.functional.interpolate(x, size=(S, S), mode="bicubic",
                                              align_corners=False, antialias=True)
            out.append(x.round_().clamp_(0, 255).to(torch.uint8))
        return torch.cat(out)

    def prompt_text(self, question) -> str:
        """The chat template's text of a question or Conversation, the video as
        ``<vila/video>`` where it goes."""
        conv = question if isinstance(question, Conversation) else Conversation.single(question)
        msgs = [{"role": t.role,
                 "content": "".join(VIDEO_TOKEN if p is VIDEO else p for p in t.parts)}
                for t in conv.turns]
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                  tokenize=False)

    def split_prompt(self, question, n_video_tokens: int = 0) -> tuple[list[int], list[int]]:
        """``(prefix, suffix)`` ids around the video: ``prefix`` ends just before the video's
        frames (:meth:`prepare` adds them), ``suffix`` is what follows them."""
        return self._prompt_ids(question)

    def _prompt_ids(self, question) -> tuple[list[int], list[int]]:
        conv = question if isinstance(question, Conversation) else Conversation.single(question)
        texts = [p for t in conv.turns for p in t.parts if isinstance(p, str)]
        if not conv.question:
            raise InputError("the question is empty")
        specials = set(self.tokenizer.all_special_tokens) | set(MEDIA_TOKENS) | {
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"}
        bad = sorted(t for t in specials if t and any(t in x for x in texts))
        if bad:
            raise InputError(f"the question contains special tokens {bad}")
        ids = self.tokenizer(self.prompt_text(conv), add_special_tokens=False)["input_ids"]
        at = [i for i, t in enumerate(ids) if t == self.video_token_id]
        if len(at) != 1:
            raise ConfigError(f"the chat template produced {len(at)} {VIDEO_TOKEN} tokens")
        return ids[:at[0]], ids[at[0] + 1:]


ADAPTER = LongVILA


# --------------------------------------------------------------------------- helpers
def _truncate_tower(vision, select_layer: int):
    """Keep the encoder layers up to VILA's ``hidden_states[select_layer]`` so the encoder's
    own output is that feature (no layers run for nothing, no stack of all hidden states);
    ``post_layernorm`` and the pooling head are never called."""
    tower = getattr(vision, "vision_model", vision)   # older transformers nest the transformer
    layers = tower.encoder.layers
    n = len(layers)
    keep = select_layer if select_layer >= 0 else n + 1 + select_layer
    if not 0 <= keep <= n:
        raise ConfigError(f"mm_vision_select_layer {select_layer} is outside a {n}-layer tower")
    tower.encoder.layers = layers[:keep]
    return tower


def _expand_to_square(x: torch.Tensor, mean) -> torch.Tensor:
    """``[f, 3, H, W]`` → ``[f, 3, M, M]``, M = max(H, W), the frame centred (offset floored)
    on ``int(mean * 255)``, as LLaVA's ``expand2square``."""
    f, c, h, w = x.shape
    m = max(h, w)
    fill = torch.tensor([int(v * 255) for v in mean], dtype=x.dtype, device=x.device)
    out = fill.view(1, c, 1, 1).repeat(f, 1, m, m)
    top, left = (m - h) // 2, (m - w) // 2
    out[:, :, top:top + h, left:left + w] = x
    return out


def _load(fn, folder: Path, what: str, **kw):
    try:
        return fn(folder, **kw)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load the LongVILA {what} from {folder}: {e}") from e


def _last_hidden(out):
    return out[0] if isinstance(out, tuple) else out.last_hidden_state


def _frames_tensor(video):
    """The uint8 frames of a video as a tensor, or the video itself when it is a stream
    (``len``, ``shape``, ``chunks``, ``keep_samples``)."""
    frames = getattr(video, "frames", video)
    if hasattr(frames, "chunks"):
        return frames
    if not isinstance(frames, torch.Tensor):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoError(f"expected frames [T, H, W, 3], got shape {tuple(frames.shape)}")
    if frames.shape[0] == 0:
        raise VideoError("the video has no frames")
    if frames.dtype != torch.uint8:
        raise VideoError(f"expected uint8 RGB frames, got {frames.dtype}")
    return frames


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _identity(model_id, revision, cfg):
    # a local folder has no revision; the file format wants a string (as the Qwen adapter)
    return ModelIdentity(id=model_id, revision=revision or "local",
                         layers=cfg.num_hidden_layers,
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=getattr(cfg, "head_dim", None)
                         or cfg.hidden_size // cfg.num_attention_heads)


def _head_patterns(root: Path, patterns, identity):
    """An explicit file or config (identity checked in full), else ``mminfer_patterns.json``
    next to the checkpoint (checked in full), else the shipped config of the real 7B shape
    (checked on the shape, so a local copy, another revision or a same-shape LongVILA still
    gets it; as the Qwen2.5-VL adapter does), else the uncalibrated default for the shape."""
    if isinstance(patterns, HeadPatternConfig):
        if patterns.identity != identity:
            raise ConfigError(f"head patterns are for {patterns.identity}, the model is "
                              f"{identity}")
        return patterns
    if patterns is not None:
        return HeadPatternConfig.load(Path(patterns), expect=identity)
    local = root / PATTERNS_FILE
    if local.is_file():
        return HeadPatternConfig.load(local, expect=identity)
    shape = (identity.layers, identity.heads, identity.kv_heads, identity.head_dim)
    shipped = REPO_CONFIGS / SHIPPED_PATTERNS.get(shape, "-")
    if shipped.is_file():
        model = _read_json(shipped, "head-pattern config").get("model", {})
        expect = replace(identity, id=model.get("id", identity.id),
                         revision=model.get("revision", identity.revision))
        return HeadPatternConfig.load(shipped, expect=expect)
    return default_config(identity)


# --------------------------------------------------------------------------- benchmark LLM
def longvila_7b_llm_config(**overrides):
    """Qwen2Config of LongVILA-7B-1M's language model (llm/config.json numbers; rope_theta
    is the ~3.58e9 of the 1M stage), for benchmarks that need the full-size LLM without
    downloading it. ``overrides`` change fields (e.g. ``num_hidden_layers=1``)."""
    return Qwen2Config(**{
        "vocab_size": 151648, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6,
        "rope_theta": 3.58e9, "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
        "architectures": ["Qwen2ForCausalLM"], **overrides})


def random_llm(config=None, *, dtype=None, device=None):
    """``Qwen2ForCausalLM`` with random weights built directly on ``device`` (default: the
    7B-1M config), its attention routed through our hook."""
    config = config or longvila_7b_llm_config()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with device:
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype,
                                              attn_implementation=hooks.register())
    return model.eval()
