"""Triton compilations in this process: how many, of which kernels, and how long they took.

A kernel compiles on the first launch of each of its specialisations, and Triton specialises
an integer argument on its value (1, a multiple of 16, 32 or 64 bits): a count that comes from
a request's data (a plan's most verticals, a length) can make a new variant in the middle of
serving, a second or so of one request's time that no stage names. Counted here, through the
hooks Triton calls around every compilation (``knobs.runtime.jit_cache_hook`` before, its
``jit_post_compile_hook`` after; hooks set before are still called), logged with the
specialisation, and served on ``/metrics``. Kernels run by the interpreter never compile.
"""

from __future__ import annotations

import logging
import threading
import time

from triton import knobs

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: dict = {}             # (thread, key) -> perf_counter at the compile's start
_counts: dict[str, int] = {}    # kernel name -> compilations
_seconds: dict[str, float] = {}
_installed = False
# (before, after) pairs called around every compilation, in the compiling thread (add_listener)
_listeners: list = []


def _name(fn) -> str:
    """The kernel's own name: Triton passes its ``__qualname__``, which for a kernel defined
    inside a function (a test's, say) carries ``outer.<locals>.``."""
    name = getattr(fn, "name", None) or str(fn)
    return name.rsplit(".", 1)[-1]


def add_listener(before, after) -> None:
    """Call ``before()`` in the compiling thread as a compilation starts and ``after()`` once
    it ended (also when a hook set before ours skipped it), from :func:`install` on: the
    scheduler hands the model's turn over meanwhile (Scheduler's idle work). ``after`` may
    raise; the kernel's launch then raises it."""
    with _lock:
        _listeners.append((before, after))


def _notify(which: int) -> None:
    for pair in list(_listeners):
        pair[which]()


def _before(**kw) -> None:
    with _lock:
        _started[(threading.get_ident(), kw.get("key"))] = time.perf_counter()
    _notify(0)


def _after(**kw) -> None:
    now = time.perf_counter()
    name = _name(kw.get("fn"))
    with _lock:
        t0 = _started.pop((threading.get_ident(), kw.get("key")), None)
        loaded = kw.get("already_compiled")   # a binary loaded, not compiled (torch's
        if not loaded:                        # inductor calls the hook so for its own)
            took = now - t0 if t0 is not None else 0.0
            _counts[name] = _counts.get(name, 0) + 1
            _seconds[name] = _seconds.get(name, 0.0) + took
    if not loaded:
        log.info("Triton compiled %s in %.2f s: %s", name, took,
                 specialisation(kw) or kw.get("repr", ""))
    _notify(1)                  # a listener acts only where its ``before`` did


def specialisation(kw) -> str:
    """What a variant was compiled for, by argument name, from the hook's ``compile``
    arguments (Triton 3.6's ``repr`` no longer shows it): the integers specialised as 1
    (``n=1``) or as multiples of 16 (``n%16``; any other integer is neither), then the
    constexprs' values. Pointers, nearly always 16-byte aligned, are left out. Empty when
    the hook passed none of it."""
    c = kw.get("compile") or {}
    sig = c.get("signature") or {}
    names = list(sig)
    fn = getattr(kw.get("fn"), "jit_function", None)
    declared = {p.name for p in getattr(fn, "params", ()) if getattr(p, "is_constexpr", False)}

    def name(path):
        return names[path[0]] if len(path) == 1 and path[0] < len(names) else None

    ones, sixteens, constexprs = [], [], []
    for path, value in (c.get("constants") or {}).items():
        n = name(path)
        if n is not None:
            (constexprs if n in declared else ones).append(f"{n}={value}")
    for path, attrs in ((c.get("configs") or [{}])[0] or {}).items():
        n = name(path)
        if n is not None and str(sig[n])[:1] in "iu" and ["tt.divisibility", 16] in attrs:
            sixteens.append(f"{n}%16")
    parts = [("ints " + ", ".join(ones + sixteens)) if ones or sixteens else "",
             ("constexprs " + ", ".join(constexprs)) if constexprs else ""]
    return "; ".join(p for p in parts if p)


def _chain(ours, theirs):
    """Our hook, then the one set before (which decides: a ``jit_cache_hook`` that returns
    True skips the compilation, which is then not counted)."""
    if theirs is None:
        return ours

    def hook(**kw):
        try:
            ours(**kw)
        except BaseException:            # a listener's: theirs is still called
            theirs(**kw)
            raise
        skip = theirs(**kw)
        if skip and ours is _before:
            with _lock:
                _started.pop((threading.get_ident(), kw.get("key")), None)
            _notify(1)                   # no compilation, no post-compile hook
        return skip

    return hook


def install() -> None:
    """Count this process's Triton compilations from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    rt = knobs.runtime
    rt.jit_cache_hook = _chain(_before, rt.jit_cache_hook)
    rt.jit_post_compile_hook = _chain(_after, rt.jit_post_compile_hook)


def stats() -> dict:
    """``{"compiles": n, "seconds": s, "kernels": {name: {"compiles", "seconds"}}}`` since
    :func:`install`."""
    with _lock:
        kernels = {k: {"compiles": _counts[k], "seconds": round(_seconds[k], 6)}
                   for k in sorted(_counts)}
    return {"compiles": sum(v["compiles"] for v in kernels.values()),
            "seconds": round(sum(v["seconds"] for v in kernels.values()), 6),
            "kernels": kernels}
