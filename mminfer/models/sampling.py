"""Which frames of a video a model sees, where the rule is the model's own (no torch: the
video decoder in mminfer.engine.video and the adapters both use it)."""

from __future__ import annotations

import numpy as np


def vila_indices(first: int, last: int, n: int) -> np.ndarray:
    """``n`` source frames in [first, last] as VILA's inference code picks them
    (``llava/utils/media.py::_load_video``): ``round(linspace(first, last, n))``, numpy's
    round (halves to even). Training code truncates instead; served checkpoints see these.
    ``n`` beyond the frames there repeats frames, as VILA's loader does."""
    return np.round(np.linspace(first, last, n)).astype(np.int64)
