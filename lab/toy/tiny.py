"""Tiny checkpoints in the real on-disk layouts, for tests and CPU demos (random weights).

Qwen2.5-VL: the real config structure (text_config / vision_config, M-RoPE sections summing to
head_dim/2), real weight names via ``save_pretrained``, the real chat template, and a
word-level tokenizer. The tokenizer is compact: the 14 Qwen special tokens take ids 0..13 in
their real order, ``[UNK]`` 14, then the words; the config's token ids
(``video_token_id``, ``vision_start_token_id``...) name those compact ids. Adapters therefore
read every special id from the config and tokenizer, never hardcode Qwen's 151xxx ids, and a
trained word-level model (the embedded default) loads through the same path.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
import torch
from transformers import (PreTrainedTokenizerFast, Qwen2_5_VLConfig, GenerationConfig,
                          Qwen2_5_VLForConditionalGeneration)

# The Qwen2.5 special tokens, in the order of their real ids 151643..151656.
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
UNK = "[UNK]"

# Words the prompt template and simple video questions use.
WORDS = (
    "system user assistant you are a helpful . , ? ! : ' what which who where when how many "
    "much is was the of in on at to and or color colour colors shape moving move moves left right "
    "up down top bottom red green blue yellow white black orange purple gray circle square "
    "triangle ball box video frame frames first last start end does do there it this that one two "
    "three four five six seven eight nine ten zero yes no object objects background appears "
    "changes direction fast slow"
).split()

# The Qwen2-VL / Qwen2.5-VL chat template (as shipped with the checkpoints).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def mrope_section(head_dim: int) -> list[int]:
    """Split the head_dim/2 rotary pairs into (t, h, w) like the real [16, 24, 24] of 128."""
    half = head_dim // 2
    hw = (half - half // 4) // 2
    return [half - 2 * hw, hw, hw]


def word_tokenizer(words=WORDS, chat_template: str = QWEN_CHAT_TEMPLATE):
    """A lowercasing WordLevel fast tokenizer: Qwen specials at 0..13, ``[UNK]`` at 14, then
    ``words``."""

    vocab = {tok: i for i, tok in enumerate(QWEN_SPECIALS)}
    vocab[UNK] = len(vocab)
    for w in words:
        vocab.setdefault(w.lower(), len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tk.normalizer = normalizers.Lowercase()   # specials are added unnormalized, so they survive
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces, glues punctuation
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=UNK, pad_token="<|endoftext|>",
                                  eos_token="<|im_end|>", model_max_length=32768)
    tok.chat_template = chat_template
    return tok


def qwen2_5_vl_config(tok, text: dict, vision: dict):
    """A ``Qwen2_5_VLConfig`` from ``text_config`` / ``vision_config`` fields whose special
    token ids are ``tok``'s (the compact word ids), so any size uses the tokenizer above."""

    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    special = dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                   pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False)
    return Qwen2_5_VLConfig(
        text_config={**text, **special}, vision_config=dict(vision),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        **special)


def write_video_preprocessor_config(path, *, min_pixels: int, max_pixels: int,
                                    total_pixels: int | None = None):
    """``video_preprocessor_config.json``: the checkpoint's per-frame pixel range (and, when
    given, its whole-video budget), which the adapter takes as the request defaults."""
    video = {**_image_preprocessor(), "video_processor_type": "Qwen2VLVideoProcessor",
             "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
             "min_pixels": min_pixels, "max_pixels": max_pixels}
    video.pop("image_processor_type")
    if total_pixels is not None:
        video["total_pixels"] = int(total_pixels)
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def _image_preprocessor() -> dict:
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": mean, "image_std": std, "patch_size": 14, "temporal_patch_size": 2,
            "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056,
            "processor_class": "Qwen2_5_VLProcessor"}


def write_qwen2_5_vl(path, model, tok, *, min_pixels: int | None = None,
                     max_pixels: int | None = None):
    """Save ``model`` (a ``Qwen2_5_VLForConditionalGeneration`` built from
    :func:`qwen2_5_vl_config`) with ``tok`` in the hub layout at ``path``: weights via
    ``save_pretrained``, greedy generation config, tokenizer, image processor config, and a
    video processor config only when a pixel range is given (the hub checkpoints have none,
    so they get qwen-vl-utils' defaults). Returns the path."""

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
        do_sample=False)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(_image_preprocessor(), indent=2))
    if min_pixels is not None and max_pixels is not None:
        write_video_preprocessor_config(path, min_pixels=min_pixels, max_pixels=max_pixels)
    return path


def save_tiny_qwen2_5_vl(path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                         kv_heads: int = 2, vision_hidden: int = 32, vision_depth: int = 2,
                         max_position_embeddings: int = 32768, min_pixels: int = 28 * 28 * 4,
                         max_pixels: int = 28 * 28 * 16, seed: int = 0, words=WORDS,
                         window_size: int = 112, fullatt_block_indexes=None):
    """Build a random tiny Qwen2.5-VL and save it in the hub layout at ``path``; returns path.

    ``min_pixels``/``max_pixels`` go to ``video_preprocessor_config.json`` as this checkpoint's
    per-frame pixel range (small, so tests stay fast); the real checkpoints have no such file
    and get qwen-vl-utils' defaults. ``window_size`` (pixels) and ``fullatt_block_indexes``
    (default: the last vision block) shape the vision tower's attention.
    """

    tok = word_tokenizer(words)
    vocab_size = -(-len(tok) // 64) * 64
    head_dim = hidden // heads
    cfg = qwen2_5_vl_config(
        tok,
        text=dict(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                             "mrope_section": mrope_section(head_dim)},
        ),
        vision=dict(
            depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
            num_heads=2, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=window_size,
            fullatt_block_indexes=list(fullatt_block_indexes if fullatt_block_indexes is not None
                                       else [vision_depth - 1]),
            tokens_per_second=2, in_channels=3,
        ),
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    # Random init gives near-zero logits everywhere; a larger embedding scale makes greedy
    # answers depend on the input, so dense/sparse comparisons mean something.
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight.normal_(0, 1.0)
    return write_qwen2_5_vl(path, model, tok, min_pixels=min_pixels, max_pixels=max_pixels)
