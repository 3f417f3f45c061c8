"""Block heads ranked by antidiagonal scores (``block(stride=S)``): the proxy against a
brute-force reading of its definition, and the case it exists for — a landmark key that
mean-pooled keys average away."""

import pytest
import torch

from mminfer.errors import ConfigError
from mminfer.kernels import masked_attention, sparse_attention
from mminfer.sparse.estimate import _antidiag_logmass, estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPattern, Pattern, block, dense


def _brute(q, k, rows, S, bn, scale):
    """``_antidiag_logmass`` by its definition, one row group and key group at a time."""
    N, D = k.shape
    nkb = -(-N // bn)
    out = torch.zeros(len(rows), nkb)
    G = -(-N // S)
    kp = torch.nn.functional.pad(k, (0, 0, 0, G * S - N))
    for r, (s0, e0) in enumerate(rows):
        for g0 in range(s0, e0, S):
            last = min(g0 + S - 1, e0 - 1)
            sc = torch.full((G,), float("-inf"))
            for c in range(G):
                if c * S <= last:
                    sc[c] = sum(float(q[min(g0 + S - 1 - t, e0 - 1)] @ kp[c * S + t])
                                for t in range(S)) * scale / S
            p = torch.softmax(sc, 0)
            for c in range(G):
                out[r, c * S // bn] += p[c]
    return out


@pytest.mark.parametrize("N,S,bn,bm", [(200, 4, 8, 16), (96, 8, 16, 16), (77, 2, 8, 8)])
def test_antidiagonal_mass_matches_its_definition(N, S, bn, bm):
    g = torch.Generator().manual_seed(N)
    D = 8
    q = torch.randn(1, 2, N, D, generator=g)
    k = torch.randn(1, 1, N, D, generator=g)
    rows = [(a, min(a + bm, N)) for a in range(0, N, bm)]
    table = torch.tensor([(a, b, 0) for a, b in rows])
    nkb = -(-N // bn)
    G = -(-N // S)
    kr = torch.nn.functional.pad(k[:, [0, 0]], (0, 0, 0, G * S - N)).reshape(1, 2, G, S * D)
    got = _antidiag_logmass(q, torch.tensor([0, 1]), kr, table, S, bm, bn, nkb, D ** -0.5,
                            torch.ones(nkb, dtype=torch.bool)).exp()
    for h in range(2):
        want = _brute(q[0, h], k[0, 0], rows, S, bn, D ** -0.5)
        assert torch.allclose(got[0, h], want, atol=1e-5), (h, (got[0, h] - want).abs().max())
    # each row group's softmax sums to one: a row block's mass is its number of row groups
    assert torch.allclose(got[0].sum(-1), torch.tensor(
        [float(-(-(b - a) // S)) for a, b in rows]).expand(2, -1), atol=1e-5)


BM, BN = 16, 16


def _landmarks(seed=0, n=512, D=32):
    """Every row block from 8 on looks at one landmark key, alone in its key block among
    keys pointing the other way, so the block's mean key carries almost none of it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, n, D, generator=g) * 0.1
    k = torch.randn(1, 1, n, D, generator=g) * 0.1
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    land = 5 * BN + 7                                # one key in key block 5
    k[0, 0, 5 * BN:6 * BN] -= u * 0.6                # its neighbours cancel its mean
    k[0, 0, land] += u * (0.6 * BN)
    q[0, 0, 8 * BM:] += u * 1.0
    return q, k, land


def test_a_landmark_key_is_found_by_the_antidiagonal_and_lost_by_pooling():
    q, k, land = _landmarks()
    n = q.shape[2]
    idx = ModalityIndex.from_segments([("text", n)])
    kb = {}
    for name, pat in (("pooled", block(top_k=1, window=BM)),
                      ("antidiag", block(top_k=1, window=BM, stride=4))):
        est = estimate_layer(q, k, idx, [HeadPattern.single(pat)], block_m=BM, block_n=BN)
        kb[name] = est.specs[0].key_blocks[0, 0, 8:, 0]
    assert bool((kb["antidiag"] == land // BN).all())
    assert float((kb["pooled"] == land // BN).float().mean()) < 0.5


def test_antidiagonal_mass_budget_and_kernel_match_masks():
    """A mass budget on the antidiagonal proxy, next to a pooled head, through the kernel."""
    q, k, _ = _landmarks(seed=1, n=384)
    q = torch.cat([q, q.flip(2)], 1)
    v = torch.randn_like(k)
    n = q.shape[2]
    idx = ModalityIndex.from_segments([("text", 20), ("video", 91, 2, 2)])   # 364 tokens
    heads = [HeadPattern.single(block(window=BM, gamma=0.8, max_density=0.5, stride=8)),
             HeadPattern.single(block(window=BM, gamma=0.8, max_density=0.5))]
    est = estimate_layer(q, k, idx, heads, block_m=BM, block_n=BN)
    plan = est.build_plan(q.device)
    masks = plan.masks()
    out = sparse_attention(q, k, v, plan)
    ref, _ = masked_attention(q, k, v, masks)
    assert torch.allclose(out, ref, atol=2e-5)
    # alone, the antidiagonal head gets the same key blocks as next to the pooled one
    alone = estimate_layer(q[:, :1], k, idx, heads[:1], block_m=BM, block_n=BN)
    assert torch.equal(alone.specs[0].key_blocks[0, 0], est.specs[0].key_blocks[0, 0])
    assert not torch.equal(est.specs[0].key_blocks[0, 0], est.specs[0].key_blocks[0, 1])


def test_a_block_sink_keeps_the_first_keys_in_every_row_block_outside_the_budget():
    """A share per row block, ranked by any proxy, can miss the first frames (a needle at
    depth 0: KL 1.16 against 0.03 for the oracle on one video); ``sink`` keeps them."""
    q, k, _ = _landmarks(seed=2, n=384)
    v = torch.randn_like(k)
    idx = ModalityIndex.from_segments([("text", 20), ("video", 91, 2, 2)])   # 384 tokens
    share = dict(window=BM, gamma=0.99, min_density=0.25, max_density=0.25, stride=8)
    plain, sunk = block(**share), block(**share, sink=20)        # 20 keys: key blocks 0, 1
    got = {}
    for name, pat in (("plain", plain), ("sunk", sunk)):
        est = estimate_layer(q, k, idx, [HeadPattern.single(pat)], block_m=BM, block_n=BN)
        plan = est.build_plan(q.device)
        out = sparse_attention(q, k, v, plan)
        ref, _ = masked_attention(q, k, v, plan.masks())
        assert torch.allclose(out, ref, atol=2e-5), name
        got[name] = (est.specs[0].key_blocks[0, 0], plan.masks()[0, 0])
    kb_plain, m_plain = got["plain"]
    kb_sunk, m_sunk = got["sunk"]
    # the budget chooses the same blocks; the sink blocks come on top of them
    assert torch.equal(kb_sunk[:, :-2], kb_plain)
    n = idx.n
    far = torch.arange(n) >= 2 * BN + BM          # rows whose near range misses blocks 0-1
    assert bool(m_sunk[far][:, :20].all())
    assert not bool(m_plain[far][:, :20].all())
    assert bool((m_sunk | m_plain).eq(m_sunk).all())     # only ever adds pairs
    assert sunk.to_dict()["sink"] == 20 and "sink" not in plain.to_dict()
    assert Pattern.from_dict(sunk.to_dict()) == sunk


def test_stride_is_a_block_field_and_round_trips():
    p = block(top_k=4, window=32, stride=16)
    assert Pattern.from_dict(p.to_dict()) == p and p.to_dict()["stride"] == 16
    assert "stride" not in block(top_k=4).to_dict()      # unset: old configs unchanged
    for bad in (0, 3, -4, 2.0, True):
        with pytest.raises(ConfigError, match="stride"):
            block(top_k=4, stride=bad)
    with pytest.raises(ConfigError, match="no field 'stride'"):
        Pattern("vertical_slash", stride=8)
    assert dense().stride is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_antidiagonal_heads_on_gpu_bf16_queue_without_a_sync_and_match_masks():
    # 7,730 tokens: the masks the output is checked against exist up to 8,192
    index = ModalityIndex.from_segments([("text", 20), ("video", 30, 16, 16, 1), ("text", 30)])
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, index.n, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 2, index.n, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 2, index.n, 128, device="cuda", generator=g).bfloat16()
    ad = block(window=128, gamma=0.9, max_density=0.15, stride=16)
    heads = [HeadPattern("q", {"video": ad, "image": ad, "text": dense()})] * 2 + \
        [HeadPattern.single(block(top_k=8, window=128, stride=16)),
         HeadPattern.single(block(window=128, gamma=0.8, max_density=0.2))]
    plan = estimate_layer(q, k, index, heads).build_plan(q.device)     # warm the caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = estimate_layer(q, k, index, heads).build_plan(q.device)
        out = sparse_attention(q, k, v, plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    masks = plan.masks().to(q.device)       # built on the host
    ref, _ = masked_attention(q, k, v, masks)
    err = (out.float() - ref).abs().max()
    same_dtype, _ = masked_attention(q, k, v, masks, dtype=torch.bfloat16)
    assert err <= 2 * (same_dtype.float() - ref).abs().max() + 1e-3, err


def test_resizing_a_config_keeps_the_antidiagonal_ranking():
    from mminfer.offline.calibrate import resize_config
    from mminfer.sparse.patterns import HeadPatternConfig, ModelIdentity
    idx = ModalityIndex.from_segments([("text", 20), ("video", 91, 2, 2)])
    ad = block(window=16, gamma=0.9, max_density=0.2, stride=16, sink=4)
    heads = [HeadPattern("q", {"video": ad, "image": ad, "text": dense()}),
             HeadPattern.single(block(top_k=3, window=16))]
    cfg = HeadPatternConfig(ModelIdentity(id="t", layers=1, heads=2, kv_heads=1, head_dim=32),
                            [heads])
    got = resize_config(cfg, idx, idx.n, 0.3, block_m=16, block_n=16).layer(0)
    assert got[0].patterns["video"].stride == 16 and got[0].patterns["video"].top_k > 0
    assert got[0].patterns["video"].sink == 4
    assert got[0].patterns["text"].kind == "dense"
    assert got[1].patterns["all"].stride is None
    # a sink sized for long videos is the first key block at the resized length, and it is
    # paid for out of the top-k (the resized head must not exceed the density asked for)
    long_sink = block(window=16, gamma=0.9, max_density=0.2, stride=16, sink=64)
    cfg = HeadPatternConfig(cfg.identity, [[HeadPattern.single(long_sink), heads[1]]])
    got = resize_config(cfg, idx, idx.n, 0.3, block_m=16, block_n=16).layer(0)
    assert got[0].patterns["all"].sink == 16
    assert got[0].patterns["all"].top_k == got[1].patterns["all"].top_k - 1
