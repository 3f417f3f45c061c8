"""Budgets by retained mass (``gamma``): a head with one sharp line keeps little, a head whose
mass is spread keeps much; the mass covered reaches gamma within the floor and ceiling; ids
are valid and unique; the kernel computes exactly the plan's pairs; count budgets keep their
meaning; nothing reads the device on the host."""

import pytest
import torch

from mminfer.kernels import masked_attention, sparse_attention
from mminfer.sparse.estimate import estimate_layer
from mminfer.sparse.mass import keep_by_mass, line_bounds
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import HeadPattern, a_shape, block, dense, grid, vertical_slash
from test_estimate import _mixed as _layout     # one copy of the mixed layout (tests/sparse)

BM = BN = 16


def _sharp_and_spread(n=1024, D=32, seed=0, spread=240):
    """Head 0: every query looks at key 300 (one sharp vertical). Head 1: at ``spread``
    random key columns equally (evidence across the whole sequence)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, n, D, generator=g) * 0.3
    k = torch.randn(1, 2, n, D, generator=g) * 0.3
    u = torch.nn.functional.normalize(torch.randn(2, D, generator=g), dim=-1)
    q[0, 0] += u[0] * 10
    k[0, 0, 300] += u[0] * 10
    cols = torch.randperm(n - 200, generator=g)[:spread] + 100
    q[0, 1] += u[1] * 5
    k[0, 1, cols] += u[1] * 5
    return q, k, cols


def _proxy_rows_mass(q, k, mask, rows=64):
    """Exact softmax mass of the last ``rows`` queries on the pairs of ``mask`` [H, N, N]."""
    n, D = q.shape[2], q.shape[3]
    s = (q[0, :, n - rows:] @ k[0].transpose(-1, -2)) * D ** -0.5
    i = torch.arange(n - rows, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > i, float("-inf"))
    p = s.softmax(-1)
    return (p * mask[:, n - rows:]).sum(-1).mean(-1)               # [H]


@pytest.mark.parametrize("gamma", [0.8, 0.9, 0.95])
def test_vertical_slash_budget_follows_the_mass(gamma):
    q, k, cols = _sharp_and_spread()
    n = q.shape[2]
    idx = ModalityIndex.from_segments([("text", n)])
    pat = vertical_slash(window=16, sink=4, gamma=gamma, max_density=0.5)
    est = estimate_layer(q, k, idx, [HeadPattern.single(pat)] * 2, block_m=BM, block_n=BN)
    (m,) = est.masses
    count, covered = m.count[0], m.covered[0]
    # One sharp line: one vertical. Spread mass: most of the planted columns.
    assert count[0] <= 2, count
    assert count[1] >= 0.6 * gamma * len(cols), count
    assert bool((covered >= gamma).all()), covered
    (spec,) = est.specs
    got = set(spec.verticals[0, 0].tolist()) - {-1}
    assert 300 in got and len(got) <= 4 + 2
    picked = set(spec.verticals[0, 1].tolist()) - {-1} - set(range(4))
    assert len(picked & set(cols.tolist())) >= 0.95 * len(picked)
    # What the kernel computes (the plan's mask, near range and all) holds that mass on the
    # proxy's rows: the estimate counted only the pairs the plan has.
    mask = est.build_plan().masks()[0]
    actual = _proxy_rows_mass(q, k, mask)
    assert bool((actual >= gamma - 0.01).all()), actual
    # The density reported for the request follows: the spread head costs more.
    d = est.build_plan().density()["logical_per_head"]
    assert float(d[1]) > 3 * float(d[0])


def test_mass_budget_floor_and_ceiling():
    """Floor and ceiling bound the lines' cost in keys per row: a vertical costs 1, a slash
    block_n (one key tile per row block in the kernel)."""
    q, k, cols = _sharp_and_spread()
    n = q.shape[2]
    idx = ModalityIndex.from_segments([("text", n)])
    heads = [HeadPattern.single(vertical_slash(window=16, sink=4, gamma=0.9,
                                               min_density=0.05, max_density=0.1)),
             HeadPattern.single(vertical_slash(window=16, sink=4, gamma=0.9,
                                               max_density=0.05))]
    est = estimate_layer(q, k, idx, heads, block_m=BM, block_n=BN)
    (m,) = est.masses
    (spec,) = est.specs
    cost = []
    for h in range(2):
        nv = int((spec.verticals[0, h] >= 4).sum())
        ns = int((spec.slashes[0, h] >= 0).sum())
        cost.append(nv + BN * ns)
        assert nv + ns == int(m.count[0, h])
    assert m.density[0].tolist() == pytest.approx([c / 1024 for c in cost])
    # The sharp head needs one line, but the floor (5 % of 1024 keys = 52) keeps adding
    # until the cost reaches it, within the ceiling (102).
    assert 52 <= cost[0] <= 102 and float(m.covered[0, 0]) >= 0.9
    # The spread head needs about 220 verticals; the ceiling (51) stops it short of gamma.
    assert 51 - BN < cost[1] <= 51 and float(m.covered[0, 1]) < 0.9


def test_slashes_cost_more_than_verticals():
    """Taken by mass per cost: where a slash and a vertical hold about the same mass, the
    vertical (1 key per row) comes before the slash (a key tile per row block), so a flat
    head at its ceiling stays within it in the kernel's tiles too."""
    g = torch.Generator().manual_seed(2)
    n, D = 1024, 32
    q = torch.randn(1, 1, n, D, generator=g) * 0.05          # near-uniform attention
    k = torch.randn(1, 1, n, D, generator=g) * 0.05
    idx = ModalityIndex.from_segments([("text", n)])
    pat = vertical_slash(window=16, sink=4, gamma=0.99, max_density=0.2)
    est = estimate_layer(q, k, idx, [HeadPattern.single(pat)], block_m=BM, block_n=BN)
    (spec,) = est.specs
    nv = int((spec.verticals[0, 0] >= 4).sum())
    ns = int((spec.slashes[0, 0] >= 0).sum())
    assert nv + BN * ns <= 0.2 * n and nv > 10 * ns
    d = est.build_plan().density()
    assert d["physical"] < 0.6, d


def test_mass_ids_valid_and_unique():
    q, k, _ = _sharp_and_spread(seed=3)
    n = q.shape[2]
    idx = ModalityIndex.from_segments([("text", n)])
    window, sink = 24, 6
    pat = vertical_slash(window=window, sink=sink, gamma=0.99, max_density=0.6)
    est = estimate_layer(q, k, idx, [HeadPattern.single(pat)] * 2, block_m=BM, block_n=BN)
    (spec,) = est.specs
    qmax = n - 1
    for h in range(2):
        v = [x for x in spec.verticals[0, h].tolist() if x >= 0]
        s = [x for x in spec.slashes[0, h].tolist() if x >= 0]
        assert len(v) == len(set(v)) and len(s) == len(set(s))
        assert set(range(sink)) <= set(v)                          # sinks forced in
        assert all(x < qmax - window for x in v if x >= sink)      # beyond some query's window
        assert all(window < x < n for x in s)                      # slashes beyond it
        assert all(x < n for x in v)


def test_block_budget_follows_the_mass():
    g = torch.Generator().manual_seed(1)
    n, D = 512, 64
    nkb = n // BN
    idx = ModalityIndex.from_segments([("text", n)])
    q = torch.randn(1, 2, n, D, generator=g) * 0.1
    k = torch.randn(1, 1, n, D, generator=g) * 0.1
    u = torch.linalg.qr(torch.randn(D, nkb + 1, generator=g))[0].T    # orthonormal
    # Head 0: row block r looks at key block r // 2 - 3 only. Head 1: at blocks 1..12 alike
    # (keys of those blocks share direction u[nkb]).
    for r in range(14, n // BM):
        q[0, 0, r * BM:(r + 1) * BM] += u[r // 2 - 3] * 8
        q[0, 1, r * BM:(r + 1) * BM] += u[nkb] * 8
    k[0, 0] += u[:nkb].repeat_interleave(BN, 0) * 8
    k[0, 0, BN:13 * BN] += u[nkb] * 8
    pat = block(window=BM, gamma=0.9, max_density=0.5)
    est = estimate_layer(q, k, idx, [HeadPattern.single(pat)] * 2, block_m=BM, block_n=BN)
    (spec,) = est.specs
    kb = spec.key_blocks[0]                                        # [H, R, w]
    cnt = (kb >= 0).sum(-1)
    rows = torch.arange(14, n // BM)
    assert bool((cnt[0, rows] == 1).all()), cnt[0]
    assert bool((kb[0, rows, :].max(-1).values == rows // 2 - 3).all())
    # the ceiling is half of each row block's own causal key blocks (r + 1 of them)
    ceil = torch.div(rows + 1, 2, rounding_mode="floor")
    assert bool((cnt[1, rows] <= ceil).all()), cnt[1]
    assert bool((cnt[1, rows] >= torch.clamp(ceil, max=10)).all()), cnt[1]
    assert bool((cnt[1, rows] <= 12).all()), cnt[1]
    assert bool((cnt[1, rows[:4]] == ceil[:4]).all())    # early row blocks: held by the ceiling
    assert set(kb[1, rows].flatten().tolist()) - {-1} <= set(range(1, 13))
    (m,) = est.masses
    # the least-covered row block: an early one (random attention, held at half its blocks)
    assert bool((m.covered[0] >= 0.5).all()) and bool((m.covered[0] < 0.9).all())
    assert float(m.count[0, 1]) > 2 * float(m.count[0, 0])     # mean over all row blocks
    # without a binding ceiling, gamma alone decides: 10-12 of head 1's 12 blocks, and every
    # row block reaches 0.9 of its estimated mass
    free = estimate_layer(q, k, idx, [HeadPattern.single(block(window=BM, gamma=0.9,
                                                                max_density=1.0))] * 2,
                          block_m=BM, block_n=BN)
    cnt_free = (free.specs[0].key_blocks[0] >= 0).sum(-1)
    assert bool((cnt_free[1, rows] >= 10).all()) and bool((cnt_free[1, rows] <= 12).all())
    assert bool((cnt_free[0, rows] == 1).all())
    assert bool((free.masses[0].covered[0] >= 0.9).all())
    # unique ids, each before the row block's near range
    for h in range(2):
        for r in range(n // BM):
            ids = [x for x in kb[h, r].tolist() if x >= 0]
            assert len(ids) == len(set(ids))
            assert all(x * BN < max(r * BM - BM, 0) for x in ids)


def test_keep_by_mass_counts_up_to_gamma():
    vals = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.0, float("-inf")]])
    need = torch.tensor([0.75])
    keep, kept = keep_by_mass(vals, need, torch.tensor(0), torch.tensor(7))
    assert keep[0].tolist() == [True, True, True, False, False, False, False]   # 0.8 >= 0.75
    assert float(kept[0]) == pytest.approx(0.8)
    keep, _ = keep_by_mass(vals, torch.tensor([-1.0]), torch.tensor(2), torch.tensor(7))
    assert keep[0].tolist() == [True, True] + [False] * 5                        # the floor
    keep, _ = keep_by_mass(vals, torch.tensor([5.0]), torch.tensor(0), torch.tensor(3))
    assert keep[0].tolist() == [True] * 3 + [False] * 4                          # the ceiling
    keep, _ = keep_by_mass(vals, torch.tensor([5.0]), torch.tensor(7), torch.tensor(7))
    assert keep[0].tolist() == [True] * 6 + [False]         # never a missing candidate
    keep, _ = keep_by_mass(vals, torch.tensor([5.0]), torch.tensor(0), torch.tensor(7))
    assert keep[0].tolist() == [True] * 5 + [False] * 2     # zero mass adds nothing
    # With costs, floor and ceiling bound the cost: 1 + 4 + 1 = 6 <= 6, the next (4) not.
    cost = torch.tensor([[1.0, 4.0, 1.0, 4.0, 1.0, 1.0, 1.0]])
    keep, _ = keep_by_mass(vals, torch.tensor([5.0]), torch.tensor(0), torch.tensor(6), cost)
    assert keep[0].tolist() == [True] * 3 + [False] * 4
    keep, _ = keep_by_mass(vals, torch.tensor([0.1]), torch.tensor(5), torch.tensor(99), cost)
    assert keep[0].tolist() == [True] * 2 + [False] * 5     # the floor: cost 5 after two
    pats = [vertical_slash(gamma=0.9, min_density=0.1, max_density=0.2),
            vertical_slash(gamma=0.9, min_density=0.3, max_density=0.3)]
    assert line_bounds(pats, 100) == ([10, 30], [20, 30])


# ---------------------------------------------------------------------- plans and kernels
def _mixed(seed=0, H=8, Hkv=2, D=32):
    """test_estimate's video-text-video-text layout, with every 11th key made heavier (so
    the mass rule has columns to find)."""
    idx, q, k, v = _layout(seed, H=H, Hkv=Hkv, D=D)
    k[:, :, ::11] *= 3
    return idx, q, k, v


_VSM = vertical_slash(window=8, sink=2, gamma=0.9, max_density=0.4)
_BLM = block(window=8, gamma=0.85, max_density=0.5)
MASS_HEADS = [
    HeadPattern.single(_VSM),
    HeadPattern.single(vertical_slash(n_vertical=8, n_slash=4, window=8, sink=2)),  # counts
    HeadPattern.single(_BLM),
    HeadPattern.single(block(top_k=2, window=8)),                                    # counts
    HeadPattern("q", {"video": _BLM, "text": _VSM}),
    HeadPattern("2d", {"video->video": _VSM, "video->text": _BLM, "text->text": _VSM,
                       "all": vertical_slash(window=4, sink=1, gamma=0.7, max_density=0.2)}),
    HeadPattern("q", {"video": grid(window=8, sink=2, min_lift=1e9, fallback=_VSM),
                      "text": a_shape(sink=2, window=8)}),
    HeadPattern.single(vertical_slash(window=8, sink=2, gamma=0.99, min_density=0.2,
                                      max_density=0.3), "k"),
]


def test_mass_plan_kernel_matches_its_masks():
    """Mass budgets in every boundary, mixed with count budgets in the same groups, and as a
    grid's fallback: the kernel computes exactly the pairs of plan.masks() (the oracle
    written from the specs by masks.py, not from the compiled arrays)."""
    idx, q, k, v = _mixed(seed=4)
    est = estimate_layer(q, k, idx, MASS_HEADS, block_m=BM, block_n=BN)
    assert {m.kind for m in est.masses} == {"vertical_slash", "block"}
    plan = est.build_plan()
    masks = plan.masks()
    ref, ref_lse = masked_attention(q, k, v, masks)
    out, lse = sparse_attention(q, k, v, plan, return_lse=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    # plan.density() (what AnswerResult.sparsity reports) counts the pairs of those masks.
    n = idx.n
    per_head = masks[0].double().sum((1, 2)) / (n * (n + 1) / 2)
    torch.testing.assert_close(plan.density()["logical_per_head"], per_head)


def test_count_budgets_unchanged_beside_mass_heads():
    """A count head's ids are the same whether or not mass heads share its group."""
    idx, q, k, _ = _mixed(seed=2)
    counts = [HeadPattern.single(vertical_slash(n_vertical=8, n_slash=4, window=8, sink=2)),
              HeadPattern.single(block(top_k=2, window=8))]
    alone = estimate_layer(q[:, :2], k[:, :1], idx, counts, block_m=BM, block_n=BN)
    both = estimate_layer(q[:, :4], k[:, :2], idx, counts + [HeadPattern.single(_VSM),
                                                             HeadPattern.single(_BLM)],
                          block_m=BM, block_n=BN)
    assert not alone.masses and len(both.masses) == 2
    a_vs, a_bl = alone.specs
    b_vs, b_bl = both.specs

    def ids(t):
        return sorted(x for x in t.tolist() if x >= 0)

    assert ids(a_vs.verticals[0, 0]) == ids(b_vs.verticals[0, 0])
    assert ids(a_vs.slashes[0, 0]) == ids(b_vs.slashes[0, 0])
    for r in range(a_bl.key_blocks.shape[2]):
        assert ids(a_bl.key_blocks[0, 0, r]) == ids(b_bl.key_blocks[0, 0, r])
    assert torch.equal(alone.build_plan().masks()[0], both.build_plan().masks()[0, :2])


def test_mass_budgets_per_request_in_a_batch():
    """Budgets are per request: in one batch, the request whose head is sharp keeps fewer
    lines than the one whose head is spread (same head, same pattern)."""
    q, k, _ = _sharp_and_spread()
    qb = torch.cat([q[:, :1], q[:, 1:]], 0)                       # [2, 1, N, D]
    kb = torch.cat([k[:, :1], k[:, 1:]], 0)
    idx = ModalityIndex.from_segments([("text", q.shape[2])])
    pat = vertical_slash(window=16, sink=4, gamma=0.9, max_density=0.5)
    est = estimate_layer(qb, kb, idx, [HeadPattern.single(pat)], block_m=BM, block_n=BN)
    (m,) = est.masses
    assert float(m.count[0, 0]) <= 2 and float(m.count[1, 0]) >= 100
    s = est.mass_summary()[0][0]
    assert s["kind"] == "vertical_slash" and s["gamma"] == 0.9 and len(s["count"]) == 2


def test_mass_estimate_reads_nothing_on_the_host():
    """On the meta device no tensor has a value: any .item(), .tolist() or bool() of a
    device tensor would raise. The whole estimate of mass-budget heads runs there."""
    idx, q, k, _ = _mixed()
    est = estimate_layer(q.to("meta"), k.to("meta"), idx, MASS_HEADS, block_m=BM, block_n=BN)
    assert len(est.masses) >= 6
    assert all(m.count.device.type == "meta" for m in est.masses)


def test_text_rows_of_a_q_boundary_head_find_their_verticals():
    """The text region's proxy queries are the question *and* the system prompt before the
    video (not contiguous): a video key the question attends to is still a vertical (its
    mass counts for the queries it is beyond the window of)."""
    idx = ModalityIndex.from_segments([("text", 20), ("video", 8, 4, 6, 0), ("text", 30)])
    n, D = idx.n, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, n, D, generator=g) * 0.3
    k = torch.randn(1, 1, n, D, generator=g) * 0.3
    u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
    col = 20 + 5 * 24 + 7                       # a key in the video's sixth frame
    q[0, 0, n - 30:] += u * 10
    k[0, 0, col] += u * 10
    pat = vertical_slash(window=8, sink=2, gamma=0.9, max_density=0.5)
    est = estimate_layer(q, k, idx, [HeadPattern("q", {"text": pat, "video": pat})],
                         block_m=BM, block_n=BN)
    text = [sp for sp in est.specs if sp.qgroup == idx.group_of("text")]
    (spec,) = text
    assert col in spec.verticals[0, 0].tolist()
    (m,) = [m for m in est.masses if m.qmod == "text"]
    assert float(m.covered[0, 0]) >= 0.9
