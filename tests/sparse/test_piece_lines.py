"""``estimation.piece_lines``: the share of vertical_slash's count budgets that a piece's plan
(rows appended at an offset: a live stream's) takes. A one-shot prefill's row sees only the
lines before it (half of them on average), a piece's rows nearly all of theirs: at full
budgets a video ingested in pieces visits about 1.5x (here; 1.8x for LongVILA-7B at 1.05M,
lab/NOTES.md §19) the tiles of its one-shot prefill, at 0.5 about the same."""

import pytest
import torch

from mminfer.errors import ConfigError
from mminfer.kernels import density
from mminfer.sparse.estimate import estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (HeadPattern, HeadPatternConfig, ModelIdentity, a_shape,
                                     block, grid, vertical_slash)

VS = vertical_slash(n_vertical=64, n_slash=16, window=16, sink=4)
IDENT = ModelIdentity("tiny", "main", 1, 4, 4, 32)


def _config(heads=None, **estimation):
    return HeadPatternConfig(IDENT, [heads or [HeadPattern.single(VS)] * 4],
                             uncalibrated=False, estimation=estimation)


def test_a_piece_takes_its_share_of_the_count_budgets_and_nothing_else_changes():
    heads = [HeadPattern.single(VS, "k"),
             HeadPattern("q", {"video": grid(fallback=VS), "text": a_shape(sink=4, window=8)}),
             HeadPattern.single(vertical_slash(gamma=0.9, window=16)),
             HeadPattern.single(block(top_k=3, window=16))]
    cfg = _config(heads, piece_lines=0.3)
    got = cfg.piece_layer(0)
    assert got[0].boundary == "k" and got[0].patterns["all"] == vertical_slash(
        n_vertical=20, n_slash=5, window=16, sink=4)                 # ceil(64 * .3), ceil(16 * .3)
    assert got[1].patterns["video"].fallback.n_vertical == 20
    assert got[1].patterns["video"].window == heads[1].patterns["video"].window
    assert got[1].patterns["text"] == heads[1].patterns["text"]
    assert got[2] == heads[2] and got[3] == heads[3]                 # mass and block budgets
    assert cfg.piece_layer(0) is got                                 # built once
    assert cfg.heads_for_rank(0, 0, 2, piece=True) == got[:2] != heads[:2]
    assert cfg.heads_for_rank(0, 0, 2) == heads[:2]                  # the whole prompt's
    default = _config(heads)
    assert default.piece_layer(0) is default.layers[0]               # default: all of them


def test_the_share_is_read_checked_and_written():
    cfg = HeadPatternConfig.from_dict(_config(piece_lines=0.5).to_dict())
    assert cfg.piece_lines == 0.5 and _config().piece_lines == 1.0
    assert "estimation" not in _config().to_dict()
    for bad in (0, 1.5, -0.5, "half", True):
        d = _config().to_dict()
        d["estimation"] = {"piece_lines": bad}
        with pytest.raises(ConfigError, match="piece_lines"):
            HeadPatternConfig.from_dict(d)


def _index(frames):
    return ModalityIndex.from_segments([("text", 16), ("video", frames, 4, 8, 0)])


def test_pieces_at_half_the_lines_visit_about_the_one_shot_prefills_tiles():
    """A 32-frame video (1,040 tokens) whose first 8 frames are prefilled whole and the rest
    in pieces of 8 frames, each planned from its own last queries against every key before
    it, against one sparse prefill of the whole: tiles counted from the plans."""
    torch.manual_seed(0)
    N, piece = _index(32).n, 8 * 32
    q, k = torch.randn(1, 4, N, 32), torch.randn(1, 4, N, 32)

    def tiles(q0, n, heads):
        est = estimate_layer(q[:, :, q0:n], k[:, :, :n], _index((n - 16) // 32), heads,
                             block_m=16, block_n=16, q_start=q0)
        plan = est.build_plan(q.device)
        return int(density.counts(plan, block_n_tile=16)["tiles_per_head"].sum())

    heads = _config().layer(0)
    one = tiles(0, N, heads)
    first = 16 + piece
    ratio = {}
    for share in (1.0, 0.5):
        cfg = _config(piece_lines=share)
        ratio[share] = (tiles(0, first, heads) + sum(
            tiles(s, s + piece, cfg.piece_layer(0)) for s in range(first, N, piece))) / one
    assert ratio[1.0] > 1.3, ratio                  # 1.49 measured
    assert 0.8 < ratio[0.5] < 1.1, ratio             # 0.97 measured
