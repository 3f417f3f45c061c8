"""How the embedded default model is made: a small Qwen2.5-VL trained on mminfer's synthetic
video tasks.

Real VLM weights cannot be downloaded everywhere mminfer runs, and a random model answers
nonsense. So mminfer ships its own model in ``mminfer/models/mminfer-embedded``: the real
Qwen2.5-VL architecture (``Qwen2_5_VLForConditionalGeneration``, real config and weight layout)
at a small size, with a word-level tokenizer over the task vocabulary, trained by
``lab/train/train_embedded.py`` on the tasks of :mod:`mminfer.offline.synthetic` (needle,
colour, count, order), drawn by synth and by the randomised renderings of
:mod:`lab.toy.variety`. It loads through the ordinary Qwen2.5-VL adapter and pipeline, so
``mminfer answer VIDEO QUESTION`` works with no ``--model`` and no download, and sparse-vs-dense
quality (``benchmarks/quality.py``) is measured on a model whose attention was learned.

Shape (``SHAPE``): text 4 layers, hidden 256, 4 query / 2 KV heads of dim 64, M-RoPE sections
[8, 12, 12]; vision 3 blocks, hidden 192, 3 heads of dim 64, patch 14, temporal patch 2,
merge 2, one attention window per frame (``window_size`` 448 px, every block full). Frames
are resized to 112 x 112 (``video_preprocessor_config.json`` pins the per-frame pixels), so a
temporal pair of frames is 8 x 8 patches = 16 tokens: a 10 s sample at 2 fps is 160 visual
tokens, 32K tokens is about 34 minutes of video.

Seed split (``mminfer.offline.synthetic`` examples are reproducible from (task, seed)):

* training: ``synth.colour`` seeds >= ``TRAIN_SEED_MIN`` (1,000,000) and private random
  streams (``numpy.random.default_rng([0x5EED, run_seed, job])``), which never coincide with
  ``synth``'s per-(task, seed) streams;
* evaluation during training: seeds ``[TRAIN_EVAL_SEED_MIN, +1000)`` = [800,000, 801,000);
* ``benchmarks/quality.py``: seeds ``[HELDOUT_SEED_MIN, 800,000)`` = [500,000, 800,000);
* ``samples/videos``: seeds 1000-1002; tests: small seeds (< 1000).

Fonts: the "system" digit style of ``synth`` draws with DejaVu fonts where installed. A
digits-only subset of the same 20 DejaVu files ships in ``lab/toy/fonts`` (identical glyphs,
see its LICENSE); ``use_bundled_fonts()`` points ``synth`` at them, so training on a machine
without fonts still sees the rendering of the shipped samples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mminfer.models.embedded import BUILD_COMMAND, DEFAULT_MODEL_DIR, default_model  # noqa: F401

import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, GenerationConfig

from lab.toy.tiny import WORDS, word_tokenizer, QWEN_SPECIALS, mrope_section
from mminfer.models.qwen2_5_vl import resize_frames, patchify, Qwen2_5_VLAdapter, mrope_positions
from mminfer.models.vision import QwenVisionTower
from mminfer.offline import synthetic as synth
from mminfer.sparse.modality import ModalityIndex

FONTS_DIR = Path(__file__).resolve().parent / "fonts"

RENDER_SIDE = 224           # synthetic videos are drawn at 224 x 224, like samples/videos
FRAME_SIDE = 112            # ... and the model sees them at 112 x 112
FRAME_PIXELS = FRAME_SIDE * FRAME_SIDE
GRID = FRAME_SIDE // 14     # 8 x 8 patches per frame
TOKENS_PER_PAIR = (GRID // 2) ** 2   # 16 merged tokens per temporal pair of frames
PATCHES_PER_PAIR = GRID * GRID       # 64

TRAIN_SEED_MIN = 1_000_000
TRAIN_EVAL_SEED_MIN = 800_000
HELDOUT_SEED_MIN = 500_000
HELDOUT_SEED_MAX = 800_000

SHAPE = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768,
             vision_hidden=192, vision_depth=3, vision_heads=3, vision_intermediate=512,
             max_position_embeddings=131072, rope_theta=1e6)

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


# ---------------------------------------------------------------------- tokenizer
def vocabulary() -> list[str]:
    """Words of the tokenizer: the chat template and generic question words of the tiny
    checkpoints, every question and answer word of the synthetic tasks, a few spellings."""
    words: list[str] = []
    for w in list(WORDS) + list(synth.ANSWER_VOCAB) + ["colour", "flash", "number", "numbers",
                                                      "appear", "appeared", "second", "seen"]:
        if w.lower() not in words:
            words.append(w.lower())
    return words


def build_tokenizer():
    """Word-level fast tokenizer: the 14 Qwen2.5 special tokens at ids 0-13 in their real
    order, ``[UNK]`` 14, then ``vocabulary()``; the Qwen chat template."""
    return word_tokenizer(vocabulary())


# ---------------------------------------------------------------------- config / model
def build_config(tok, shape: dict | None = None):
    s = {**SHAPE, **(shape or {})}
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    vocab_size = -(-len(tok) // 64) * 64
    head_dim = s["hidden"] // s["heads"]
    depth = s["vision_depth"]
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            max_position_embeddings=s["max_position_embeddings"], rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": float(s["rope_theta"]),
                             "mrope_section": mrope_section(head_dim)},
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=depth, hidden_size=s["vision_hidden"],
            intermediate_size=s["vision_intermediate"], num_heads=s["vision_heads"],
            out_hidden_size=s["hidden"], patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=448, fullatt_block_indexes=list(range(depth)),
            tokens_per_second=2, in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )


def new_model(shape: dict | None = None, seed: int = 0):
    """A freshly initialised embedded-shape model (fp32, SDPA attention) and its tokenizer."""

    tok = build_tokenizer()
    cfg = build_config(tok, shape)
    torch.manual_seed(seed)
    try:
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa",
                                                                 dtype=torch.float32)
    except TypeError:   # older signature: torch_dtype
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            cfg, attn_implementation="sdpa", torch_dtype=torch.float32)
    return model, tok


def generation_config(tok):
    end, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    return GenerationConfig(eos_token_id=[end, pad], pad_token_id=pad, do_sample=False)


def save_checkpoint(model, tok, path, *, info: dict | None = None, dtype=None) -> Path:
    """Write ``model`` in the Qwen2.5-VL hub layout (weights as ``dtype``, default fp16) with
    the tokenizer, the (video) preprocessor configs pinning 112 x 112 frames and
    ``embedded.json`` (how it was made). Files are written to a temporary folder and moved
    into ``path`` one by one, so an interrupted save leaves the previous files whole."""

    dtype = dtype or torch.float16
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    tmp = Path(tempfile.mkdtemp(prefix=".save-", dir=path))
    old_dtype = getattr(model.config, "dtype", None)
    try:
        model.generation_config = generation_config(tok)
        model.config.dtype = dtype
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        cfg_file = tmp / "config.json"           # record the storage dtype of the weights
        cfg = json.loads(cfg_file.read_text())
        name = str(dtype).replace("torch.", "")
        for d in (cfg, cfg.get("text_config", {}), cfg.get("vision_config", {})):
            if "dtype" in d or d is cfg:
                d["dtype"] = name
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tok.save_pretrained(tmp)
        pre = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
               "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
               "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "patch_size": 14,
               "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136,
               "max_pixels": FRAME_PIXELS, "processor_class": "Qwen2_5_VLProcessor"}
        (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        video = {**pre, "video_processor_type": "Qwen2VLVideoProcessor",
                 "size": {"shortest_edge": 3136, "longest_edge": FRAME_PIXELS},
                 "min_pixels": 3136, "max_pixels": FRAME_PIXELS,
                 # the whole-video budget never shrinks frames below 112 x 112 (up to 2^16
                 # pairs): the token count grows linearly with the video
                 "total_pixels": FRAME_PIXELS * 65536}
        video.pop("image_processor_type")
        (tmp / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
        if info is not None:
            (tmp / "embedded.json").write_text(json.dumps(info, indent=2, default=str))
        for f in tmp.iterdir():
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old_dtype is not None:
            model.config.dtype = old_dtype
    return path


# ---------------------------------------------------------------------- rendering
def use_bundled_fonts() -> bool:
    """Make ``synth``'s "system" font style draw with ``lab/toy/fonts`` (digit-only subsets of
    the DejaVu files, glyph-identical), whatever is installed. Returns whether it did."""
    fonts = tuple(sorted(str(p) for p in FONTS_DIR.glob("*.ttf")
                         if "DejaVu" in p.name
                         and not any(k in p.name for k in ("ExtraLight", "Math"))))
    if not fonts:
        return False
    synth._system_fonts = lambda: fonts     # noqa: SLF001 (module-level hook, same filter)
    return True


def resize_frames_np(frames, side: int = FRAME_SIDE, chunk: int = 64):
    """uint8 ``[T, H, W, 3]`` -> uint8 ``[T, side, side, 3]`` with the adapter's own resize
    (bicubic, antialias, rounded): the pixels the model sees for that video."""

    frames = np.asarray(frames)
    out = np.empty((len(frames), side, side, 3), np.uint8)
    for s in range(0, len(frames), chunk):
        x = resize_frames(torch.from_numpy(np.ascontiguousarray(frames[s:s + chunk])), side, side)
        out[s:s + chunk] = x.permute(0, 2, 3, 1).to(torch.uint8).numpy()
    return out


def render_example(task: str, seed: int, n_frames: int, **kw):
    """A ``synth`` example drawn at 224 x 224 and resized to 112 x 112 as the adapter would:
    ``(frames uint8 [T, 112, 112, 3], answer, question, meta)``."""
    ex = synth.make_example(task, seed, n_frames=n_frames, height=RENDER_SIDE,
                            width=RENDER_SIDE, **kw)
    return resize_frames_np(ex.frames), ex.answer, ex.question, ex.meta


# ---------------------------------------------------------------------- model inputs
def pixels_from_frames(frames, mean=CLIP_MEAN, std=CLIP_STD, dtype=None):
    """uint8 frames ``[..., T, 112, 112, 3]`` (T even; leading dims are videos) on any device
    -> patches ``[pairs * 64, 1176]`` exactly as ``preprocess_video`` makes them (CLIP
    normalisation in fp32, then ``dtype``)."""

    f = frames.reshape(-1, *frames.shape[-3:])
    if f.shape[0] % 2:
        raise ValueError("frames must come in temporal pairs")
    x = f.permute(0, 3, 1, 2).float()
    m = torch.tensor(mean, device=x.device).view(1, 3, 1, 1) * 255.0
    s = torch.tensor(std, device=x.device).view(1, 3, 1, 1) * 255.0
    out = patchify((x - m) / s)
    return out.to(dtype) if dtype is not None else out


class BatchedVision:
    """The model's own vision tower on equal-sized frame pairs, batched
    (:class:`mminfer.models.vision.QwenVisionTower`, the adapter's tower), for training and
    the quality benchmark. ``check()`` compares against ``get_video_features``;
    ``use_reference`` switches to that (slow, always right) path where a check fails."""

    def __init__(self, model, grid_hw=(GRID, GRID)):
        self.model = model
        self.visual = model.model.visual
        self.h, self.w = grid_hw
        self.tower = QwenVisionTower(self.visual)
        self.use_reference = False     # True: run get_video_features (slow, always right)

    def __call__(self, pixels, n_pairs: int, grid_hw=None):
        """``pixels [n_pairs * h * w, 1176]`` -> merged features ``[n_pairs * h*w/4, out]``;
        ``grid_hw`` (patches) for frames of another size than the default."""
        h, w = grid_hw or (self.h, self.w)
        if self.use_reference:
            return self._reference(pixels, n_pairs, (h, w))
        return self.tower(pixels, n_pairs, h, w)

    def _reference(self, pixels, n_pairs, grid_hw=None):
        h, w = grid_hw or (self.h, self.w)
        grid = torch.tensor([[n_pairs, h, w]], device=pixels.device)
        ref = self.model.model.get_video_features(pixels, grid)
        ref = getattr(ref, "pooler_output", ref)
        return torch.cat(list(ref), 0) if isinstance(ref, (tuple, list)) else ref

    def check(self, n_pairs: int = 3, seed: int = 0) -> float:
        """Largest difference to ``get_video_features`` on random pixels, relative to the
        largest feature magnitude (fp32 matmuls: TF32 off while checking)."""
        p = self.visual.patch_embed
        dev = next(self.visual.parameters()).device
        dt = next(self.visual.parameters()).dtype
        g = torch.Generator(device="cpu").manual_seed(seed)
        pix = torch.randn(n_pairs * self.h * self.w, p.in_channels * p.temporal_patch_size
                          * p.patch_size ** 2, generator=g).to(dev, dt)
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            with torch.no_grad():
                ref = self._reference(pix, n_pairs).float()
                got = self(pix, n_pairs).float()
            return float((got - ref).abs().max() / ref.abs().max())
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def layout(tok, config, question: str, n_pairs: int, fps: float = 2.0, grid_hw=(GRID, GRID)):
    """The exact token layout the Qwen2.5-VL adapter builds for a video of ``n_pairs``
    temporal pairs of ``grid_hw`` patches (default 8 x 8: 112 x 112 frames) and ``question``:
    ``(head_ids, tail_ids, positions)`` where the video tokens sit between head and tail, and
    ``positions [3, L + 1]`` are the M-RoPE positions of the L prompt tokens plus the first
    answer token (decode position ``L + rope_delta``)."""

    v = config.vision_config
    gh, gw = grid_hw
    n_video = n_pairs * (gh // 2) * (gw // 2)
    vid = int(config.video_token_id)
    ids = Qwen2_5_VLAdapter.prompt_ids(SimpleNamespace(tokenizer=tok, video_token_id=vid),
                                       question, n_video)
    grid = torch.tensor([[n_pairs, gh, gw]])
    index = ModalityIndex.qwen2_5_vl(ids, grid, video_token_id=vid,
                                     image_token_id=int(config.image_token_id),
                                     spatial_merge_size=v.spatial_merge_size)
    pos, delta = mrope_positions(index, [v.temporal_patch_size / fps], float(v.tokens_per_second))
    L = len(ids)
    pos = torch.cat([pos, torch.full((3, 1), L + delta, dtype=pos.dtype)], 1)
    start = ids.index(vid)
    return ids[:start], ids[start + n_video:], pos


def answer_ids(tok) -> dict:
    """Token id of every answer of every task (each answer is one word)."""
    out = {}
    for task, answers in synth.ANSWERS.items():
        out[task] = {a: tok.convert_tokens_to_ids(a) for a in answers}
    return out
