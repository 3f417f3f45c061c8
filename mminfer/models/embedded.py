"""Where the model is when none is named: ``--model``, else ``$MMINFER_MODEL``, else the
embedded default model that ships inside the package (``mminfer/models/mminfer-embedded``: a
small Qwen2.5-VL trained on mminfer's synthetic video tasks, loaded through the ordinary
Qwen2.5-VL adapter). How it was made lives in :mod:`lab.toy.embedded`."""

from __future__ import annotations

import os
from pathlib import Path

from mminfer.errors import ConfigError

# MMINFER_EMBEDDED_MODEL overrides where the default model is looked for (deployments, tests)
DEFAULT_MODEL_DIR = Path(os.environ.get("MMINFER_EMBEDDED_MODEL")
                         or Path(__file__).resolve().parent / "mminfer-embedded")
BUILD_COMMAND = "bash lab/train/build_embedded.sh"


def default_model() -> Path:
    """The embedded model's directory, or a ConfigError that says how to build it."""
    p = DEFAULT_MODEL_DIR
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return p
    raise ConfigError(
        f"no --model given and the embedded default model is missing ({p}): build it with "
        f"`{BUILD_COMMAND}` (one GPU, about 15 minutes), or pass --model with a Qwen2.5-VL or "
        f"LongVILA checkpoint; --model is required until then")


def resolve_model(model: str | None = None) -> str:
    """The one rule for every interface: the given model, else ``$MMINFER_MODEL``, else the
    embedded default (or the ConfigError that says how to get it)."""
    return str(model or os.environ.get("MMINFER_MODEL") or default_model())
