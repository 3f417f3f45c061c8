"""Triton's compilations are counted per kernel, with their time, through the hooks Triton
calls around each one; a hook set before ours is still called and still decides; /metrics
serves the counts. On the GPU: a new specialisation of an integer argument (a multiple of
16, or not) compiles once, and a value of a specialisation seen before compiles nothing."""

import time

import pytest
import torch
from triton import knobs

from mminfer.kernels import compiles
from mminfer.serve.metrics import Metrics


@pytest.fixture
def fresh(monkeypatch):
    """compiles as if never installed, Triton's hooks restored after the test."""
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compiles, "_installed", False)
    monkeypatch.setattr(compiles, "_counts", {})
    monkeypatch.setattr(compiles, "_seconds", {})
    monkeypatch.setattr(compiles, "_started", {})


class _Fn:                       # what Triton passes as ``fn`` (its JitFunctionInfo)
    def __init__(self, name):
        self.name = name


def _compile(key, name, took=0.01, skip_by=None):
    """What Triton's JITFunction._do_compile calls: the cache hook (its True skips), the
    compilation, then the post-compile hook."""
    kw = dict(key=key, repr=f"{name}(n: i32)", fn=_Fn(name), compile={},
              is_manual_warmup=False, already_compiled=False)
    if knobs.runtime.jit_cache_hook(**kw):
        return False
    time.sleep(took)
    knobs.runtime.jit_post_compile_hook(**kw)
    return True


def test_compilations_are_counted_per_kernel_with_their_time(fresh):
    compiles.install()
    compiles.install()                               # idempotent: counted once
    assert _compile(("k1", "i32"), "_attn", took=0.02)
    assert _compile(("k1", "i32D"), "_attn")
    assert _compile(("k2", "i32"), "_proxy")
    st = compiles.stats()
    assert st["compiles"] == 3
    assert st["kernels"]["_attn"]["compiles"] == 2 and st["kernels"]["_proxy"]["compiles"] == 1
    assert st["kernels"]["_attn"]["seconds"] >= 0.02 + 0.01
    assert st["seconds"] == pytest.approx(sum(k["seconds"] for k in st["kernels"].values()))
    assert not compiles._started


def test_a_kernel_defined_in_a_function_is_counted_under_its_own_name(fresh):
    """Triton passes the kernel's ``__qualname__`` (seen on an H100: a test's nested kernel
    came as ``test_x.<locals>._fill`` and was not found under ``_fill``)."""
    compiles.install()
    assert _compile(("k", "i32"), "test_x.<locals>._fill")
    assert list(compiles.stats()["kernels"]) == ["_fill"]


def test_a_kernel_loaded_already_compiled_is_not_counted(fresh):
    """torch's inductor calls the post-compile hook for binaries it loads
    (``already_compiled=True``): nothing was compiled."""
    compiles.install()
    knobs.runtime.jit_post_compile_hook(key="k", repr="", fn=_Fn("triton_poi_fused"),
                                        compile={}, is_manual_warmup=False,
                                        already_compiled=True)
    assert compiles.stats() == {"compiles": 0, "seconds": 0.0, "kernels": {}}


def test_a_hook_set_before_is_called_and_decides(fresh):
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("cache", kw["key"])) or \
        kw["key"][0] == "skip"
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    compiles.install()
    assert _compile(("run", "i32"), "_attn")
    assert not _compile(("skip", "i32"), "_attn")          # theirs skipped it: not counted
    assert seen == [("cache", ("run", "i32")), ("post", ("run", "i32")),
                    ("cache", ("skip", "i32"))]
    assert compiles.stats()["compiles"] == 1 and not compiles._started


def test_metrics_serve_the_compilations():
    m = Metrics("tiny")
    m.watch_compiles(lambda: {"compiles": 3, "seconds": 1.5, "kernels": {
        "_attn": {"compiles": 2, "seconds": 1.25}, "_proxy": {"compiles": 1, "seconds": 0.25}}})
    text = m.exposition().decode()
    assert 'mminfer:triton_compiles_total{kernel="_attn",model_name="tiny"} 2.0' in text
    assert 'mminfer:triton_compile_seconds_total{kernel="_proxy",model_name="tiny"} 0.25' in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_new_specialisation_compiles_once_on_the_gpu(fresh):
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, offs + n, mask=offs < n)

    compiles.install()
    x = torch.empty(64, device="cuda", dtype=torch.int32)
    counts = []
    for n in (17, 33, 32, 48, 19):       # not / not / a multiple of 16 / one / not
        _fill[(1,)](x, n, BLOCK=64)
        counts.append(compiles.stats()["kernels"].get("_fill", {}).get("compiles", 0))
    torch.cuda.synchronize()
    assert counts == [1, 1, 2, 2, 2]
    assert compiles.stats()["kernels"]["_fill"]["seconds"] > 0


def test_a_figure_that_raises_does_not_fail_the_scrape():
    """Every collector reads its figures through one guard: one that raises is logged and
    left out, and the rest of /metrics is served."""
    def broken():
        raise RuntimeError("gone")

    m = Metrics("tiny")
    m.watch_compiles(broken)
    m.watch_cache(broken)
    m.watch_streams(broken)
    text = m.exposition().decode()
    assert "mminfer:triton_compiles" not in text and "mminfer:prefix_cache_hits" not in text
    assert "mminfer:model_info" in text


def _plan_round(n_vs, nv, ns, q_start, n=8192, H=28, device="cuda", seed=0):
    """A plan whose vertical_slash launch has ``n_vs`` slots of ``nv`` verticals and ``ns``
    slashes (the other heads A-shape), for the queries from ``q_start`` of ``n`` keys."""
    from mminfer.kernels import AShape, SparsePlan, VerticalSlash
    g = torch.Generator(device="cpu").manual_seed(seed)
    vert = torch.randint(0, n, (1, n_vs, nv), generator=g).to(device)
    slash = torch.randint(0, n // 2, (1, n_vs, ns), generator=g).to(device)
    specs = [VerticalSlash(list(range(n_vs)), vert, slash, window=256),
             AShape(list(range(n_vs, H)), sink=64, window=256)]
    return SparsePlan.build(n, H, specs, block_m=128, block_n=64, device=device,
                            q_start=q_start)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plans_of_other_counts_compile_no_new_sparse_kernel(fresh):
    """Once compiled, the sparse kernel runs any plan over keys of the same length class:
    slots, verticals, slashes, row blocks and query offsets that are 1, multiples of 16 or
    neither (as the configs a calibration scores and a live stream's pieces make them)
    compile nothing more. Each compilation took 2-8 s on an H100 with requests waiting."""
    from mminfer.kernels.launch import sparse_attention
    compiles.install()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, H, Hkv, D = 8192, 28, 4, 128
    k = torch.randn(1, Hkv, n, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, Hkv, n, D, device="cuda", generator=g).bfloat16()
    made = []
    for n_vs, nv, ns, q_start in ((7, 100, 17, 0), (16, 64, 32, 0), (1, 1, 1, 4100),
                                  (12, 33, 48, 4096)):
        plan = _plan_round(n_vs, nv, ns, q_start)
        q = torch.randn(1, H, n - q_start, D, device="cuda", generator=g).bfloat16()
        sparse_attention(q, k, v, plan)
        torch.cuda.synchronize()
        made.append(compiles.stats()["kernels"]["_sparse_attn_fwd"]["compiles"])
    assert made[0] >= 1 and made[1:] == [made[0]] * 3, made


class _Param:
    def __init__(self, name, is_constexpr=False):
        self.name, self.is_constexpr = name, is_constexpr


def _hook_kwargs(params, args):
    """The hook's arguments for a launch of a kernel with ``params`` ((name, constexpr)) on
    ``args``, built as Triton 3.6 builds them (JITFunction._pack_args over the binder's
    specialisation, native_specialize_impl per argument)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JitFunctionInfo, native_specialize_impl
    spec = [("constexpr", a) if cx else native_specialize_impl(BaseBackend, a, False, True, True)
            for (_, cx), a in zip(params, args)]
    signature = {p: s[0] for (p, _), s in zip(params, spec)}
    constants = {(i,): a for i, (s, a) in enumerate(zip(spec, args)) if s[0] == "constexpr"}
    attrs = {(i,): BaseBackend.parse_attr(s[1]) for i, s in enumerate(spec)
             if isinstance(s[1], str)}
    fn = type("Fn", (), {"params": [_Param(p, cx) for p, cx in params]})()
    return dict(key="k", repr="_k[num_warps=4](Q: ()", compile={
        "key": "k", "signature": signature, "constants": constants, "configs": [attrs]},
        fn=JitFunctionInfo(None, "_k", fn), is_manual_warmup=False, already_compiled=False)


def test_a_compile_is_logged_with_the_classes_of_its_integers(fresh, caplog):
    """Triton 3.6's repr no longer names the specialisation; the log does, by argument name:
    which integers were 1 or multiples of 16, and the constexprs (pointers left out)."""
    import logging
    params = [("X", False), ("n", False), ("m", False), ("one", False), ("BLOCK", True)]
    kw = _hook_kwargs(params, [torch.empty(4), 32, 17, 1, 64])
    assert compiles.specialisation(kw) == "ints one=1, n%16; constexprs BLOCK=64"
    compiles.install()
    with caplog.at_level(logging.INFO, logger="mminfer.kernels.compiles"):
        knobs.runtime.jit_cache_hook(**kw)
        knobs.runtime.jit_post_compile_hook(**kw)
    assert "ints one=1, n%16; constexprs BLOCK=64" in caplog.text
    assert compiles.specialisation({"repr": "old"}) == ""
