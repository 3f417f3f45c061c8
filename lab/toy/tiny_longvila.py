"""A tiny LongVILA checkpoint in exactly the real on-disk layout, for CPU tests.

Same root ``config.json`` fields (VILA ``llava_llama`` format), same subfolders (``llm/``,
``vision_tower/``, ``mm_projector/``), same weight names and projector type as the real
checkpoints; only the numbers are small: SigLIP hidden 32, 3 layers, 56 px frames with 14 px
patches (4×4 patches → 2×2 merged = 4 tokens per frame, +1 newline), Qwen2 hidden 64,
2 layers, 4/2 heads. The tokenizer is byte-level with no merges: every byte is a token, in
GPT-2's byte order, so "\\n" is id 198 as in the real Qwen2 vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
import torch
from transformers import (PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          SiglipVisionConfig, SiglipVisionModel)

from mminfer.models.longvila import Projector

# Qwen2's ChatML template (the one Qwen2-7B-Instruct ships).
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                  "<vila/sentinel>", "<image>", "<vila/video>")

TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                   num_attention_heads=2, image_size=56, patch_size=14)
TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                rope_theta=1e6)


def _byte_chars() -> list[str]:
    """The 256 byte-level symbols in GPT-2 / Qwen2 id order (printable bytes first)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def tiny_tokenizer():
    """Byte-level tokenizer: ids 0..255 the bytes, then the Qwen2 and VILA special tokens."""

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = QWEN2_CHAT_TEMPLATE
    return fast


def save_tiny_longvila(path, *, seed: int = 0, num_video_frames: int = 8,
                       image_size: int = TINY_VISION["image_size"]) -> Path:
    """Write a random tiny LongVILA checkpoint at ``path`` (created); returns the path."""


    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    vision = SiglipVisionModel(SiglipVisionConfig(**{**TINY_VISION,
                                                     "image_size": image_size})).eval()
    # vocab resized to len(tokenizer), as VILA does after adding its media tokens
    lcfg = Qwen2Config(**TINY_LLM, vocab_size=len(tok), tie_word_embeddings=False,
                       bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                       eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                       architectures=["Qwen2ForCausalLM"])
    llm = Qwen2ForCausalLM(lcfg).eval()
    proj = Projector(vision.config.hidden_size, lcfg.hidden_size)
    with torch.no_grad():   # LayerNorm starts at ones/zeros: make it a real test of the weights
        proj.layers[1].weight.normal_(1.0, 0.1)
        proj.layers[1].bias.normal_(0.0, 0.1)
    return write_longvila(path, vision, llm, proj, tok, num_video_frames=num_video_frames)


def write_longvila(path, vision, llm, projector, tok, *, num_video_frames: int,
                   model_dtype: str = "torch.float32") -> Path:
    """Save a LongVILA checkpoint in the real layout at ``path`` (created) from its parts: a
    ``SiglipVisionModel``, a ``Qwen2ForCausalLM``, the ``mlp_downsample`` Projector and the
    tokenizer; the root ``config.json`` repeats the three sub-configs as VILA's does.
    Returns the path."""

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    vcfg, lcfg = vision.config, llm.config
    image_size = vcfg.image_size
    vision.save_pretrained(root / "vision_tower")
    _write_json(root / "vision_tower" / "preprocessor_config.json", {
        "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "SiglipImageProcessor", "processor_class": "SiglipProcessor",
        "resample": 3, "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size}})

    llm.save_pretrained(root / "llm")
    tok.save_pretrained(root / "llm")
    # The real checkpoints name the Qwen2 tokenizer; ours is a plain fast tokenizer.
    _patch_json(root / "llm" / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")

    (root / "mm_projector").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in projector.state_dict().items()},
              str(root / "mm_projector" / "model.safetensors"), metadata={"format": "pt"})
    pcfg = {"architectures": ["MultimodalProjector"], "mm_projector_type": "mlp_downsample",
            "model_type": "v2l_projector", "torch_dtype": model_dtype.removeprefix("torch.")}
    _write_json(root / "mm_projector" / "config.json", pcfg)

    _write_json(root / "config.json", {
        "_name_or_path": str(root),
        "architectures": ["LlavaLlamaModel"],
        "model_type": "llava_llama",
        "llm_cfg": {**_read_json(root / "llm" / "config.json"),
                    "_name_or_path": str(root / "llm")},
        "vision_tower_cfg": {**_read_json(root / "vision_tower" / "config.json"),
                             "_name_or_path": str(root / "vision_tower")},
        "mm_projector_cfg": {**pcfg, "_name_or_path": str(root / "mm_projector")},
        "hidden_size": lcfg.hidden_size,
        "mm_hidden_size": vcfg.hidden_size,
        "mm_vision_select_layer": -2,
        "mm_vision_select_feature": "cls_patch",
        "mm_use_im_start_end": False,
        "mm_use_im_patch_token": False,
        "image_aspect_ratio": "resize",
        "num_video_frames": num_video_frames,
        "fps": 0.0,
        "s2": False,
        "model_dtype": model_dtype,
    })
    return root


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text())


def _write_json(p: Path, d: dict):
    p.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _patch_json(p: Path, **kv):
    _write_json(p, {**_read_json(p), **kv})
