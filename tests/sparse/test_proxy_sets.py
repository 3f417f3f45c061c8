"""kernels/proxy.proxy_sets: every query set of a layer in one launch per pass, each set for
its own heads, against brute-force fp32 softmax sums (both mass-pass layouts)."""

import pytest
import torch

from mminfer.kernels.proxy import QuerySet, proxy_sets


def _brute(q, k, runs, scale, kgroup):
    """(col, diag, {group: diag over its keys}) ``[B, Hq, N]`` of the query positions of
    ``runs``, fp32."""
    B, H, n, _ = q.shape
    Hkv = k.shape[1]
    pos = torch.cat([torch.arange(q0, q0 + nq) for q0, nq in runs]).to(q.device)
    kk = k.float().repeat_interleave(H // Hkv, 1)
    s = (q.float()[:, :, pos] @ kk.transpose(-1, -2)) * scale
    keys = torch.arange(n, device=q.device)
    s = s.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
    p = s.softmax(-1)
    off = pos[:, None] - keys[None, :]
    ok = off >= 0
    diag = torch.zeros(B, H, n, device=q.device).index_add_(2, off[ok], p[:, :, ok])
    by = {}
    for grp in kgroup.unique().tolist():
        m = ok & (kgroup[None, :] == grp)
        by[grp] = torch.zeros(B, H, n, device=q.device).index_add_(2, off[m], p[:, :, m])
    return p.sum(2), diag, by


SETS = [QuerySet(((636, 64),), (0, 1, 2, 3, 4, 5), ((None,),) * 6),   # last 64, every head
        QuerySet(((0, 20), (670, 30)), (1, 4), ((None, 1), (None,))),  # two runs, one slot
        QuerySet(((100, 50),), (2, 3), ((1,), ())),                    # col only for head 3
        QuerySet(((5, 3),), (5,), ((0, 1),))]                          # a short early run


def _check(q, k, kgroup, scale, config, tol, sets=SETS, q_start=0):
    """``q_start``: the kernels read only q's rows from there (a piece appended to a cached
    prompt), the runs' positions staying absolute; the brute force reads the whole q."""
    got = proxy_sets(q[:, :, q_start:].contiguous(), k, sets, scale, kgroup=kgroup,
                     config=config, q_start=q_start)
    assert len(got) == len(sets)
    for s, (col, diags) in zip(sets, got):
        rc, rd, rby = _brute(q, k, s.runs, scale, kgroup)
        hs = list(s.heads)
        torch.testing.assert_close(col, rc[:, hs], **tol)
        assert set(diags) == {d for ds in s.diags for d in ds}
        for d, dg in diags.items():
            ref = rd if d is None else rby[d]
            for i, h in enumerate(hs):
                want = ref[:, h] if d in s.diags[i] else torch.zeros_like(ref[:, h])
                torch.testing.assert_close(dg[:, i], want, **tol)


@pytest.mark.parametrize("layout,kb_per", [("persistent", 8), ("chunks", 8), ("chunks", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_proxy_sets_match_brute_force(layout, kb_per, dtype):
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, n, D = 2, 6, 2, 700, 16
    q = torch.randn(B, H, n, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, n, D, generator=g).to(dtype)
    kgroup = (torch.rand(n, generator=g) > 0.5).to(torch.int32)
    _check(q, k, kgroup, D ** -0.5, {"mass_layout": layout, "kb_per": kb_per},
           dict(atol=1e-5, rtol=1e-4))


@pytest.mark.parametrize("layout", ["persistent", "chunks"])
def test_proxy_sets_of_a_piece_read_its_rows_at_the_offset(layout):
    """The query rows of a piece, from row 500 of 700 keys: runs at absolute positions, scored
    against every key, give the sums of the whole sequence's same queries."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, n, D = 1, 6, 2, 700, 16
    q = torch.randn(B, H, n, D, generator=g)
    k = torch.randn(B, Hkv, n, D, generator=g)
    kgroup = (torch.arange(n) // 97 % 2).to(torch.int32)
    sets = [QuerySet(((636, 64),), (0, 1, 2, 3, 4, 5), ((None,),) * 6),
            QuerySet(((500, 20), (670, 30)), (1, 4), ((None, 1), (None,))),
            QuerySet(((541, 50),), (2, 3), ((1,), ()))]
    _check(q, k, kgroup, D ** -0.5, {"mass_layout": layout}, dict(atol=1e-5, rtol=1e-4),
           sets, q_start=500)
    with pytest.raises(ValueError, match="query run"):       # a run before the piece
        proxy_sets(q[:, :, 500:], k, [QuerySet(((490, 20),), (0,), ((),))], 1.0, q_start=500)


def test_auto_layout_switches_at_chunks_from(monkeypatch):
    """"auto" takes the chunked mass pass from ``chunks_from`` keys on (1.05M on the H200) and
    the persistent one below (262K): both give the brute-force sums."""
    import mminfer.kernels.proxy as P
    seen = []
    for name in ("_sets_mass_chunk_kernel", "_sets_mass_kernel"):
        real = getattr(P, name)

        class Spy:
            def __init__(self, real, name):
                self.real, self.name = real, name

            def __getitem__(self, grid):
                seen.append(self.name)
                return self.real[grid]
        monkeypatch.setattr(P, name, Spy(real, name))
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 4, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g)
    for chunks_from, want in ((300, "_sets_mass_chunk_kernel"), (301, "_sets_mass_kernel")):
        seen.clear()
        _check(q, k, torch.zeros(300, dtype=torch.int32), 0.25,
               {"mass_layout": "auto", "chunks_from": chunks_from},
               dict(atol=1e-5, rtol=1e-4), [QuerySet(((236, 64),), (0, 3), ((None,),) * 2)])
        assert seen == [want]
    with pytest.raises(ValueError, match="mass_layout"):
        proxy_sets(q, k, [QuerySet(((0, 8),), (0,), ((),))], 1.0, config={"mass_layout": "x"})


def test_proxy_sets_bad_inputs():
    q, k = torch.zeros(1, 4, 100, 16), torch.zeros(1, 2, 100, 16)
    with pytest.raises(ValueError, match="query run"):
        proxy_sets(q, k, [QuerySet(((0, 65),), (0,), ((),))], 1.0)
    with pytest.raises(ValueError, match="ascending"):
        proxy_sets(q, k, [QuerySet(((0, 8),), (1, 0), ((), ()))], 1.0)
    with pytest.raises(ValueError, match="kgroup"):
        proxy_sets(q, k, [QuerySet(((0, 8),), (0,), ((1,),))], 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["persistent", "chunks"])
def test_proxy_sets_on_gpu_bf16(layout):
    """The compiled kernels at several thousand keys in bf16, 28/4 heads, d 128."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, n, D = 1, 28, 4, 9001, 128
    q = torch.randn(B, H, n, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, Hkv, n, D, device="cuda", generator=g).bfloat16()
    kgroup = (torch.arange(n, device="cuda") // 777 % 2).to(torch.int32)
    sets = [QuerySet(((n - 64, 64),), (0, 7, 14, 21), ((None,),) * 4),
            QuerySet(((0, 20), (n - 30, 30)), tuple(range(1, 7)), ((None, 1),) * 6),
            QuerySet(((n - 94, 64),), tuple(range(8, 14)), ((0,), (), (None,), (1,), (), ()))]
    _check(q, k, kgroup, D ** -0.5, {"mass_layout": layout}, dict(atol=1e-4, rtol=1e-3), sets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["persistent", "chunks"])
def test_a_new_length_compiles_no_new_proxy_kernel(layout):
    """Once compiled, the proxy kernels run at any length and offset: key counts, key
    blocks, chunks and offsets that are multiples of 16 or not (as a live stream's pieces
    make them) compile nothing more. Counted in Triton's own caches of compiled variants,
    not by compile hooks: an earlier test in the process may have compiled them already
    (the H100 run of the whole GPU suite saw [0, 0, 0, 0] from the hooks)."""
    from mminfer.kernels import proxy_kernel as PK

    def variants():
        total = 0
        for fn in (PK._sets_lse_kernel, PK._sets_mass_kernel, PK._sets_mass_chunk_kernel,
                   PK._fold_lse_kernel):
            caches = getattr(fn, "device_caches", None)
            if caches is None:
                pytest.skip("this Triton keeps its compiled kernels elsewhere")
            total += sum(len(c[0]) for c in caches.values())
        return total

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, D = 1, 28, 4, 128
    made = []
    # keys: 8704 (136 blocks, 17 chunks), 8192 (128 and 16), 8200 (129, 17); offsets 0, 4100
    for n, q_start in ((8704, 0), (8192, 0), (8200, 4100), (9001, 4096)):
        q = torch.randn(B, H, n - q_start, D, device="cuda", generator=g).bfloat16()
        k = torch.randn(B, Hkv, n, D, device="cuda", generator=g).bfloat16()
        sets = [QuerySet(((n - 64, 64),), tuple(range(H)), ((None,),) * H)]
        proxy_sets(q, k, sets, D ** -0.5, config={"mass_layout": layout}, q_start=q_start)
        torch.cuda.synchronize()
        made.append(variants())
    assert made[0] >= 1 and made[1:] == [made[0]] * 3, made
