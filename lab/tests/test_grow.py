"""Deepening the embedded model (lab.toy.grow): the deepened model computes what the
old one did, new blocks sit between old ones, and a checkpoint of it loads by its own shape."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lab.toy import embedded as E
from lab.toy import grow
from lab.train import train_embedded as T
from mminfer.engine.pipeline import Pipeline
from mminfer.models.embedded import DEFAULT_MODEL_DIR
from mminfer.sparse.patterns import HeadPatternConfig

TINY = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vision_hidden=64,
            vision_depth=2, vision_heads=2, vision_intermediate=128)


def test_layout_spreads_new_blocks_after_old_ones():
    assert grow.layout(3, 3) == [0, None, 1, None, 2, None]
    assert grow.layout(4, 2) == [0, 1, None, 2, 3, None]
    assert grow.layout(4, 0) == [0, 1, 2, 3]
    five = grow.layout(2, 5)
    assert five.count(None) == 5 and [i for i in five if i is not None] == [0, 1]
    with pytest.raises(ValueError):
        grow.layout(0, 1)


def _inputs(model, tok):
    cfg = model.config
    grid = torch.tensor([[2, 4, 4]])                     # 2 temporal x 4 x 4 patches
    n = int(grid.prod()) // 4                            # tokens after the 2 x 2 merge
    ids = [tok.convert_tokens_to_ids("<|vision_start|>")] + [cfg.video_token_id] * n + \
        [tok.convert_tokens_to_ids("<|vision_end|>")] + tok("what number appears")["input_ids"]
    g = torch.Generator().manual_seed(1)
    pix = torch.randn(int(grid.prod()), 3 * 2 * 14 * 14, generator=g)
    return dict(input_ids=torch.tensor([ids]), pixel_values_videos=pix, video_grid_thw=grid)


@torch.no_grad()
def test_deepened_model_gives_the_same_logits():
    model, tok = E.new_model(TINY, seed=3)
    for p in model.parameters():                 # no zero projections by chance: all random
        p.add_(0.02 * torch.randn_like(p))
    model.eval()
    big = grow.deepen(model, vision=2, text=1, seed=4).eval()
    s = grow.shape_of(big.config)
    assert (s["vision_depth"], s["layers"]) == (4, 3)
    assert big.config.vision_config.fullatt_block_indexes == [0, 1, 2, 3]
    x = _inputs(model, tok)
    want, got = model(**x).logits, big(**x).logits
    assert torch.equal(want, got)
    # the new blocks are real blocks: moving one projection off zero changes the logits
    big.model.visual.blocks[1].attn.proj.bias.fill_(0.5)
    assert not torch.allclose(big(**x).logits, want)
    # old blocks kept their weights, in order
    assert torch.equal(big.model.visual.blocks[2].attn.qkv.weight,
                       model.model.visual.blocks[1].attn.qkv.weight)
    assert torch.equal(big.model.language_model.layers[1].self_attn.q_proj.weight,
                       model.model.language_model.layers[1].self_attn.q_proj.weight)


def test_a_deepened_checkpoint_trains_from_its_own_shape(tmp_path):
    """train_embedded.py --init of a deepened checkpoint builds the deepened shape (not
    embedded.SHAPE) and --deepen grows an --init model before training."""
    model, tok = E.new_model(TINY, seed=0)
    E.save_checkpoint(model, tok, tmp_path / "small", info={"made_by": "test"})
    common = ["--device", "cpu", "--max-tokens", "32", "--steps", "2", "--minutes", "5",
              "--workers", "0", "--scenes", "8", "--colour-clips", "8", "--red", "8",
              "--eval-n", "1", "--start-pairs", "2"]
    T.main(["--init", str(tmp_path / "small"), "--deepen", "1", "1",
            "--out", str(tmp_path / "big")] + common)
    cfg = json.loads((tmp_path / "big" / "config.json").read_text())
    assert cfg["vision_config"]["depth"] == 3 and cfg["text_config"]["num_hidden_layers"] == 3
    T.main(["--init", str(tmp_path / "big"), "--out", str(tmp_path / "again")] + common)
    cfg = json.loads((tmp_path / "again" / "config.json").read_text())
    assert cfg["vision_config"]["depth"] == 3 and cfg["text_config"]["num_hidden_layers"] == 3


def test_the_product_runs_a_deepened_checkpoint_as_the_old_one(tmp_path):
    """The Pipeline's own vision tower and prefill (not transformers' forward) take any depth:
    a deepened, untrained checkpoint answers a sample exactly as the model it came from."""
    sample = Path(__file__).resolve().parents[2] / "samples" / "videos" / "needle_0.mp4"
    model, tok = E.new_model(TINY, seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    E.save_checkpoint(model, tok, tmp_path / "small", info={"made_by": "test"})
    E.save_checkpoint(grow.deepen(model, 1, 1), tok, tmp_path / "big", info={"made_by": "test"})
    answers = []
    for name in ("small", "big"):
        pipe = Pipeline(str(tmp_path / name), attention="dense", device="cpu")
        r = pipe.answer(sample, "what number appears", max_new_tokens=4)
        answers.append((r.answer, r.tokens["visual"]))
    assert answers[0] == answers[1] and answers[0][0] != ""


def test_patterns_follow_the_deepened_layers():
    src = json.loads((DEFAULT_MODEL_DIR / "mminfer_patterns.json").read_text())
    tagged = {**src, "layers": [{"tag": i} for i in range(4)]}
    out = grow.deepen_patterns(tagged, 2)           # layout(4, 2) = [0, 1, new, 2, 3, new]
    assert [r["tag"] for r in out["layers"]] == [0, 1, 1, 2, 3, 3]
    assert out["model"]["layers"] == 6 and tagged["model"]["layers"] == 4   # input unchanged
    real = grow.deepen_patterns(src, 2)
    ident = HeadPatternConfig.from_dict(src).identity
    assert len(HeadPatternConfig.from_dict(real, replace(ident, layers=6)).layers) == 6
    with pytest.raises(ValueError):
        grow.deepen_patterns({**src, "layers": src["layers"][:3]}, 1)
