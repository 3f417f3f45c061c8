"""The attention-sharpening term of the embedded model's training (lab.toy.sharpen)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lab.toy import sharpen as S  # noqa: E402
from lab.train import train_embedded  # noqa: E402


def _brute_tail(q, k, starts, rho, scale, rb=1, kb=1):
    B, H, L, D = q.shape
    g = H // k.shape[1]
    out = torch.empty(B, H, len(starts))
    for b in range(B):
        for h in range(H):
            for i, s0 in enumerate(starts.tolist()):
                p = torch.zeros(L, dtype=torch.float64)
                for r in range(s0, s0 + rb):
                    p[:r + 1] += torch.softmax(
                        q[b, h, r].double() @ k[b, h // g, :r + 1].double().T * scale, 0) / rb
                blocks = torch.stack([p[j:j + kb].sum() for j in range(0, L, kb)])
                n = math.ceil(rho * ((s0 + rb - 1) // kb + 1))
                out[b, h, i] = 1 - blocks.sort(descending=True).values[:n].sum()
    return out


@pytest.mark.parametrize("H,Hkv,rb,kb", [(4, 2, 1, 1), (4, 4, 1, 1), (7, 1, 1, 1),
                                         (4, 2, 4, 8), (7, 1, 3, 5)])
def test_tail_mass_equals_the_row_by_row_computation(H, Hkv, rb, kb):
    g = torch.Generator().manual_seed(H * 10 + Hkv + rb)
    B, L, D = 2, 53, 16
    q = torch.randn(B, H, L, D, generator=g) * 2
    k = torch.randn(B, Hkv, L, D, generator=g)
    starts = torch.tensor([0, 5, 17, 40, 53 - rb])
    got = S.tail_mass(q, k, starts, 0.1, 0.25, rb, kb)
    assert got.shape == (B, H, 5)
    torch.testing.assert_close(got, _brute_tail(q, k, starts, 0.1, 0.25, rb, kb).float(),
                               atol=1e-5, rtol=1e-4)


def test_tail_mass_is_one_minus_rho_for_uniform_rows_and_zero_for_one_hot():
    L, D = 200, 8
    rows = torch.tensor([99, 199])
    q = torch.zeros(1, 2, L, D)                     # every logit equal: uniform rows
    k = torch.randn(1, 2, L, D)
    t = S.tail_mass(q, k, rows, 0.05, 1.0)
    expect = torch.tensor([1 - 5 / 100, 1 - 10 / 200])
    torch.testing.assert_close(t[0, 0], expect)
    k = torch.zeros(1, 1, L, D)
    k[0, 0, 3, 0] = 1.0                             # one key far above the rest
    q = torch.zeros(1, 1, L, D)
    q[..., 0] = 100.0
    assert S.tail_mass(q, k, rows, 0.05, 1.0).max() < 1e-6
    assert S.tail_mass(q, k, torch.tensor([100, 136]), 0.05, 1.0, 64, 64).max() < 1e-6


def test_sample_starts_keeps_the_last_queries_and_stays_in_range():
    g = torch.Generator().manual_seed(0)
    r = S.sample_starts(1000, 50, 64, 256, 1, g)
    assert r.tolist()[-64:] == list(range(936, 1000))
    assert len(r) == 114 and len(set(r.tolist())) == 114 and r.min() >= 256
    r = S.sample_starts(1000, 3, 64, 256, 32, g)
    assert r.tolist()[-2:] == [936, 968] and len(r) == 5
    assert r.min() >= 256 and r[:3].max() + 32 <= 936
    assert S.sample_starts(100, 50, 64, 256, 1, g).numel() == 0      # too short: nothing
    with pytest.raises(ValueError, match="rho"):
        S.Sharpener(rho=0.0)
    with pytest.raises(ValueError, match="multiple"):
        S.Sharpener(n_last=50, row_block=64)


def _tiny_text():
    from lab.toy import embedded as E
    shape = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vision_hidden=32,
                 vision_depth=1, vision_heads=1, vision_intermediate=64)
    model, _ = E.new_model(shape, seed=0)
    return model.model.language_model


def test_the_hooked_forward_is_sdpa_and_the_term_sharpens_attention():
    """The forward with the collector equals plain SDPA; the tail mass has a gradient, and
    a few steps on it alone lower it (the term does what training relies on)."""
    text = _tiny_text().train()
    sharp = S.Sharpener(rho=0.1, n_random=2, n_last=16, min_pos=16, row_block=16,
                        key_block=8, seed=0)
    L = 160
    x = torch.randn(2, L, 64)
    pos = torch.arange(L).view(1, 1, L).expand(3, 2, L)
    ref = text(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
    cfg = text.config
    cfg._attn_implementation = sharp.register()
    try:
        with sharp.collect(L) as tail:
            got = text(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
        torch.testing.assert_close(got, ref)
        assert len(tail) == 2 and tail[0].shape == (2, 4, 3)
        opt = torch.optim.Adam(text.parameters(), lr=2e-2)
        first = None
        for _ in range(20):
            with sharp.collect(L) as tail:
                text(inputs_embeds=x, position_ids=pos, use_cache=False)
            loss = torch.stack([t.mean() for t in tail]).mean()
            first = float(loss.detach()) if first is None else first
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert float(loss.detach()) < 0.7 * first, (first, float(loss.detach()))
        with sharp.collect(8) as tail:                       # nothing to sample: no term
            text(inputs_embeds=x[:, :8], position_ids=pos[..., :8], use_cache=False)
        assert tail == []
    finally:
        cfg._attn_implementation = "sdpa"


def _train_module():
    return train_embedded


def test_training_with_sharpen_logs_the_tail_mass_and_saves_sdpa(tmp_path):
    train = _train_module()
    tiny = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vision_hidden=32,
                vision_depth=1, vision_heads=1, vision_intermediate=64)
    out = tmp_path / "model"
    res = train.main([
        "--minutes", "3", "--steps", "4", "--out", str(out), "--workers", "0",
        "--device", "cpu", "--shape", json.dumps(tiny), "--max-tokens", "128",
        "--start-pairs", "8", "--batch-tokens", "300", "--max-batch", "2", "--lr", "3e-3",
        "--warmup", "1", "--scenes", "6", "--colour-clips", "6", "--red", "6", "--chunk", "3",
        "--clip-frames", "4", "--needles-per-scene", "2", "--eval-n", "1", "--log-every", "0",
        "--ckpt-every", "1000", "--eval-every", "1000", "--reserve", "1", "--tasks", "needle",
        "--sharpen", "0.5", "--sharpen-min-len", "64", "--sharpen-blocks", "2", "16",
        "--sharpen-block", "8", "16"])
    tails = [h["tail"] for h in res["history"] if "tail" in h]
    assert res["step"] == 4 and tails and all(0.0 <= t <= 1.0 for t in tails)
    cfg = json.loads((out / "config.json").read_text())
    assert S.ATTN_NAME not in json.dumps(cfg)


def test_the_oracle_of_benchmarks_tail_mass_is_exact_with_every_tile_and_lossy_without():
    from lab.experiments import tail_mass as tm
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g) for _ in range(3))
    starts = torch.tensor([128, 192])
    assert tm._oracle_error(q, k, v, starts, 0.999, 32, 16).max() < 1e-5
    q = torch.zeros(1, 2, 256, 16)                      # uniform rows: tiles left out matter
    assert tm._oracle_error(q, k, v, starts, 0.1, 32, 16).min() > 0.1
