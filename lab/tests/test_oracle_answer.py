"""lab/experiments/oracle_answer.py: the oracle is exact attention restricted to the tiles it
keeps, and keeping every tile is exact attention."""

import torch

from lab.experiments import oracle_answer


def _mod():
    return oracle_answer


def _causal(q, k, v, scale, mask=None):
    n = q.shape[0]
    s = (q @ k.T) * scale
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    if mask is not None:
        keep &= mask
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v


def test_keeping_every_tile_is_exact_attention():
    m = _mod()
    g = torch.Generator().manual_seed(0)
    n, D = 300, 16
    q, k, v = (torch.randn(n, D, generator=g) for _ in range(3))
    ref = _causal(q, k, v, D ** -0.5)
    for sel in ("exact", "pooled", "sampled4", "antidiag8"):
        out, kept, causal = m.oracle_head(q, k, v, D ** -0.5, rho=1.0, rb=32, kb=16,
                                          chunk=64, select=sel)
        assert torch.allclose(out, ref, atol=1e-5), sel
        assert kept == causal == n * (n + 1) / 2


def test_the_oracle_is_attention_over_the_tiles_it_keeps():
    m = _mod()
    g = torch.Generator().manual_seed(1)
    n, D, rb, kb = 256, 16, 32, 16
    q, k, v = (torch.randn(n, D, generator=g) for _ in range(3))
    dense_rows = torch.zeros(n, dtype=torch.bool)
    dense_rows[-10:] = True                          # the question's rows see every key
    out, kept, causal = m.oracle_head(q, k, v, D ** -0.5, rho=0.25, rb=rb, kb=kb,
                                      dense_rows=dense_rows, chunk=64)
    # rebuild its mask: per row block, top tiles by exact mass + the diagonal tiles
    p = torch.softmax((q @ k.T * D ** -0.5).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), -1)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for b0 in range(0, n, rb):
        last = (b0 + rb - 1) // kb
        mass = p[b0:b0 + rb].reshape(rb, -1, kb).sum((0, 2))[:last + 1]
        top = mass.argsort(descending=True)[:max(1, -(-(last + 1) // 4))]
        for t in set(top.tolist()) | set(range(b0 // kb, last + 1)):
            mask[b0:b0 + rb, t * kb:(t + 1) * kb] = True
    mask[dense_rows] = True
    assert torch.allclose(out, _causal(q, k, v, D ** -0.5, mask), atol=1e-5)
    assert kept == float((mask & torch.ones(n, n, dtype=torch.bool).tril()).sum())
    assert 0.2 < kept / causal < 0.6
