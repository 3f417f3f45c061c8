"""The video cache holds its budgets in the bytes its tensors really keep (the storage of every
buffer and scale of every entry), not only in what it counts: the embedded model on the CPU
with a small ``--kv-cache-gb`` and host tier, a long chat (its suffix growing past its
prefix) and re-asks with long questions over more entries than fit, through misses,
hits, spills and restores from the host."""

import pytest

from mminfer.engine.pipeline import Pipeline
from mminfer.models.base import VIDEO, Conversation, Turn

from conftest import write_video

GiB = 2 ** 30
BYTES_PER_ROW = 4096          # the embedded model: K and V of every layer, fp32
PREFIX_ROWS = 48              # about what the tiny clips' prefixes hold (checked below)
ENTRY = PREFIX_ROWS * BYTES_PER_ROW          # an entry's rows (its host copy keeps them alone)
# two or three entries on the device (each keeps a tail as long as its rows, tail_rows: these
# prefixes are short), two to four host copies
GPU_BUDGET, HOST_BUDGET = 4 * ENTRY, 2 * ENTRY
OTHERS = [(1, 2.0), (2, 2.0), (1, 4.0)]
LONG = "Describe every frame of the clip again, slowly and in detail. " * 6   # > a prefix


@pytest.fixture(scope="module")
def pipe():
    return Pipeline(None, attention="dense", device="cpu", kv_cache_gb=GPU_BUDGET / GiB,
                    kv_host_cache_gb=HOST_BUDGET / GiB)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    return [write_video(d / f"clip{i}.mp4", n_frames=8 + 4 * i, fps=4.0, width=64, height=48,
                        noise=True) for i in range(3)]


def real_bytes(cache) -> dict:
    """Bytes of the storage every tensor of every entry keeps, per tier, each storage once."""
    seen, out = set(), {"gpu": 0, "host": 0}
    for e in cache._entries.values():
        for layer in e.kv.layers:
            for t in (layer.k_buf, layer.v_buf, layer.keys, layer.values, layer.k_scale,
                      layer.v_scale):
                if t is None or t.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(t.untyped_storage().data_ptr())
                out["host" if e.tier == "host" else "gpu"] += t.untyped_storage().nbytes()
    return out


def _holds(cache, where):
    assert cache.settle(30)            # the spills that keep the budgets have landed
    got, s = real_bytes(cache), cache.stats()
    assert got["gpu"] <= cache.gpu_budget and got["host"] <= cache.host_budget, (where, got)
    assert (got["gpu"], got["host"]) == (s["gpu_bytes"], s["host_bytes"]), (where, got, s)


def test_a_long_chat_holds_the_budgets(pipe, clips):
    cache = pipe.video_cache
    cache.clear()
    assert (cache.gpu_budget, cache.host_budget) == (GPU_BUDGET, HOST_BUDGET)
    turns = [Turn("user", (VIDEO, "What happens in this clip?"))]
    seen = set()
    for i in range(4):
        r = pipe.answer(clips[0], conversation=Conversation(tuple(turns)), fps=2.0,
                        max_new_tokens=4)
        seen.add(r.cache)
        assert r.tokens["prefix"] <= PREFIX_ROWS
        _holds(cache, f"turn {i}")
        # other prefixes between turns: the chat's entry goes to the host and comes back
        for clip, fps in OTHERS:
            pipe.answer(clips[clip], "What happens?", fps=fps, max_new_tokens=2)
            _holds(cache, f"turn {i}, clip {clip} at {fps} fps")
        turns += [Turn("assistant", (r.answer or "I see.",)),
                  Turn("user", (LONG,))]
    assert r.tokens["total"] > 5 * PREFIX_ROWS      # far past the prefix: the fork's rows
    assert {"miss", "host"} <= seen
    assert cache.stats()["evictions_gpu"] > 0


def test_re_asking_many_entries_holds_the_budgets(pipe, clips):
    cache = pipe.video_cache
    cache.clear()
    asks = [(clip, fps) for clip in clips for fps in (2.0, 4.0)]   # six prefixes
    seen = []
    # each new prefix twice (on the device the second time), then the one three before (on
    # the host, or gone), with a long question each time
    for i in range(len(asks)):
        for j in (i, i, i - 3):
            clip, fps = asks[j % len(asks)]
            r = pipe.answer(clip, LONG, fps=fps, max_new_tokens=4)
            seen.append(r.cache)
            assert r.tokens["prefix"] <= PREFIX_ROWS
            _holds(cache, f"{clip.name} at {fps} fps")
    assert cache.stats()["evictions_gpu"] > 0
    assert {"miss", "hit", "host"} <= set(seen), seen
