"""A batched decode step's K/V writes (mminfer.models.kv.write_rows): every cache gets the rows
its own ``update`` writes, bit for bit, the ordinary forks' rows in one launch for all and every
other kind (a prefix of its own, FP8, a tail, a buffer that must grow) through its update; and a
fork's views of its prefix follow the prefix's buffers when they are replaced."""

import pytest
import torch

from mminfer.models.kv import ForkKV, PrefixKV, write_rows

H, D, P = 2, 8, 6


def _prefix(dtype=None, headroom=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = PrefixKV(1, headroom=headroom, dtype=dtype)
    kv.layers[0].update(torch.randn(1, H, P, D, generator=g), torch.randn(1, H, P, D, generator=g))
    return kv


def _caches():
    """Two ordinary forks (room for rows), one whose buffer is full, one in its prefix's tail,
    an FP8 fork, and a prefix of its own; each with some rows of its own already."""
    shared, tailed, quant = _prefix(), _prefix(headroom=4, seed=1), _prefix("fp8", seed=2)
    out = [ForkKV(shared, P, headroom=5), ForkKV(shared, P, headroom=5),
           ForkKV(shared, P, headroom=0), ForkKV(tailed, P, claim=True),
           ForkKV(quant, P, headroom=5), _prefix(headroom=3, seed=3)]
    assert out[3].in_tail
    g = torch.Generator().manual_seed(9)
    for j, c in enumerate(out[:5]):
        c.layers[0].update(torch.randn(1, H, 1 + j, D, generator=g),
                           torch.randn(1, H, 1 + j, D, generator=g))
    return out


def test_write_rows_writes_what_each_update_writes(monkeypatch):
    g = torch.Generator().manual_seed(4)
    rows = [(torch.randn(6, H, 1, D, generator=g), torch.randn(6, H, 1, D, generator=g))
            for _ in range(3)]
    ref = _caches()
    for k, v in rows:
        want = [c.layers[0].update(k[j:j + 1], v[j:j + 1]) for j, c in enumerate(ref)]
    got_caches = _caches()
    fused = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, src: fused.append(len(dst)) or real(dst, src))
    for k, v in rows:
        got = write_rows([c.layers[0] for c in got_caches], k, v)
    # the two forks with room in one copy a step (K and V of each); the tail had no room for
    # its reader's next row, which left it for buffers of its own and is written with them
    # from then on; the fork without headroom grows at every row (through its update)
    assert fused == [4, 6, 6]
    assert got_caches[2].layers[0].own.capacity == got_caches[2].get_seq_length() - P
    assert not got_caches[3].in_tail
    for (gk, gv), (wk, wv), a, b in zip(got, want, got_caches, ref):
        assert torch.equal(gk.float(), wk.float()) and torch.equal(gv.float(), wv.float())
        assert a.get_seq_length() == b.get_seq_length()
        pk = getattr(wk, "kv_prefix", None)
        assert (pk is None) == (getattr(gk, "kv_prefix", None) is None)
        if pk is not None:
            assert torch.equal(gk.kv_prefix, pk)
    # a fork's own rows lie row by row: one row of every head is contiguous
    own = got_caches[0].layers[0].own
    assert own.k_buf[0, :, 0].is_contiguous() and own.keys.shape == (1, H, 4, D)


@pytest.mark.parametrize("how", ["move", "grow"])
def test_a_forks_prefix_views_follow_the_prefixs_buffers(how):
    kv = _prefix(headroom=2)
    fork = ForkKV(kv, P - 1)
    layer = fork.layers[0]
    k, v = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    layer.update(k, v)
    before = layer.keys.kv_prefix
    assert before.data_ptr() == kv.layers[0].k_buf.data_ptr()
    if how == "move":
        kv.move("cpu", headroom=7)                  # new buffers, the same rows
    else:
        kv.layers[0].update(torch.randn(1, H, 5, D), torch.randn(1, H, 5, D))   # outgrows room
    base = kv.layers[0]
    write_rows([layer], k, v)
    pk, pv = layer.keys.kv_prefix, layer.values.kv_prefix
    assert pk.data_ptr() == base.k_buf.data_ptr() and pv.data_ptr() == base.v_buf.data_ptr()
    assert pk.shape == (1, H, P - 1, D) and torch.equal(pk, before)
