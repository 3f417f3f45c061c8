"""benchmarks/quality.py's tables: accuracy per task x length x mode, density per task, the
last-token KL to dense, the long-video summary and their markdown."""

import math
from pathlib import Path

import pytest
import torch

from conftest import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def Q():
    return load_script("benchmarks/quality.py")


def test_kl_divergence_is_kl_of_dense_to_sparse(Q):
    p = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0]), -1)
    q = torch.log_softmax(torch.tensor([1.0, 0.5, -1.0]), -1)
    want = sum(math.exp(a) * (a - b) for a, b in zip(p.tolist(), q.tolist()))
    assert Q.kl_divergence(p, q) == pytest.approx(want, rel=1e-5) and want > 0
    assert Q.kl_divergence(p, p) == pytest.approx(0.0, abs=1e-7)
    assert Q.kl_divergence(None, q) is None


def _rec(task, tokens, modes, depth=None, vt=None):
    return {"task": task, "tokens": tokens, "depth": depth, "visual_tokens": vt or tokens,
            "modes": {m: {"answer": a, "correct": ok, "density": d, "kl": kl}
                      for m, (a, ok, d, kl) in modes.items()}}


def _records():
    R = []
    # needle: dense right everywhere; config wrong once at 16K
    for n, dep, ok_c in ((1024, 0.0, True), (16384, 0.0, True), (16384, 1.0, False)):
        R.append(_rec("needle", n, {"dense": ("42", True, None, 0.0),
                                    "config": ("42" if ok_c else "24", ok_c, 0.1, 0.05),
                                    "d=0.20": ("42", True, 0.2, 0.01)}, depth=dep, vt=n * 3 // 4))
    # count at 16K: dense right, both sparse wrong, densities differ from needle's
    R.append(_rec("count", 16384, {"dense": ("3", True, None, 0.0),
                                   "config": ("4", False, 0.3, 0.5),
                                   "d=0.20": ("4", False, 0.2, 0.7)}))
    return R


def test_summary_has_density_and_kl_per_task_and_the_long_videos(Q):
    modes = ["dense", "config", "d=0.20"]
    s = Q.summarise(_records(), modes, [1024, 16384], [0.0, 1.0], long_from=16384)
    assert s["accuracy"]["config"]["needle"] == {"1024": 1.0, "16384": 0.5}
    assert s["accuracy"]["dense"]["all"] == 1.0
    assert s["accuracy"]["config"]["all"] == pytest.approx(2 / 4)
    assert s["density_task"]["config"]["needle"] == pytest.approx(0.1)
    assert s["density_task"]["config"]["count"] == pytest.approx(0.3)
    assert s["density_task_length"]["d=0.20"]["count"] == {"1024": None, "16384": 0.2}
    assert s["kl_task"]["config"]["needle"] == pytest.approx(0.05)
    assert s["kl_task"]["d=0.20"]["count"] == pytest.approx(0.7)
    lo = s["long"]["config"]
    assert lo["accuracy"]["needle"] == 0.5 and lo["accuracy"]["count"] == 0.0
    assert lo["n"]["needle"] == 2 and lo["n"]["colour"] == 0
    assert lo["kl_all"] == pytest.approx((0.05 + 0.05 + 0.5) / 3)
    assert s["visual_tokens"]["16384"] == pytest.approx((12288 * 2 + 16384) / 3)
    assert s["needle_grid"]["config"]["16384"] == {"0": 1.0, "1": 0.0}
    assert s["agreement_with_dense"]["config"] == pytest.approx(2 / 4)


def test_needle_accuracy_by_the_digits_look(Q):
    R = _records()
    R[0]["look"], R[1]["look"], R[2]["look"] = "dots", "strokes", "dots"
    s = Q.summarise(R, ["dense", "config"], [1024, 16384], [0.0, 1.0])
    assert s["needle_by_look"]["config"] == {"dots": {"accuracy": 0.5, "n": 2},
                                             "strokes": {"accuracy": 1.0, "n": 1}}
    md = Q.markdown(s, ["dense", "config"], [1024, 16384], renderer="eval")
    assert ("Needle accuracy by the digits' look (all lengths): dense: dots 1.00 (n=2), "
            "strokes 1.00 (n=1); config: dots 0.50 (n=2), strokes 1.00 (n=1)") in md
    # synth's examples have no look: no line
    assert "look" not in Q.markdown(Q.summarise(_records(), ["dense"], [1024], [0.0]),
                                    ["dense"], [1024])


def test_markdown_tables(Q):
    modes = ["dense", "config", "d=0.20"]
    s = Q.summarise(_records(), modes, [1024, 16384], [0.0, 1.0], long_from=16384)
    md = Q.markdown(s, modes, [1024, 16384], renderer="eval", heatmap="h.png")
    lines = md.splitlines()
    assert "| task | length | visual tokens | dense | config | d=0.20 | n |" in lines
    assert "| needle | 16K | 13653 | 1.00 | 0.50 | 1.00 | 2 |" in lines
    # the long-video row: accuracy with the points from dense, density, KL
    row = next(ln for ln in lines if ln.startswith("| count | 1 | 1.00 |"))
    assert "0.00 (-100) | 0.30 | 0.500" in row
    assert "| needle | config | 0.10 | 0.10 | 0.10 |" in lines
    assert "| count | d=0.20 | – | 0.700 | 0.700 |" in lines
    assert "![needle heatmaps, dense and sparse](h.png)" in lines
    # every table row has the header's number of columns
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            assert len({ln.count("|") for ln in rows}) == 1, block


def test_sigint_with_rendering_workers_keeps_the_videos_done(tmp_path):
    """A device call's time limit sends SIGINT to the whole process group (``timeout -s
    INT``). The run must stop, write its JSON and tables, and exit; and the JSON must
    already hold each finished video before that (a later SIGKILL loses nothing done)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "q"
    cmd = [sys.executable, str(REPO / "benchmarks" / "quality.py"), "--device", "cpu",
           "--workers", "2", "--lengths", "64", "128", "--depths", "0", "1", "--per-task", "150",
           "--needle-reps", "50", "--no-config", "--densities", "--max-minutes", "10",
           "--out", str(out)]
    # 1100 videos: far more than it can draw before the signal (a video of this size takes
    # tens of ms, so a short grid could end on its own first and prove nothing)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    # started with SIGINT ignored, as a background job of a non-interactive shell is (CI
    # ran it so): the run must still take the signal its callers send
    p = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.time()
        done = []
        while time.time() - t0 < 180 and p.poll() is None:
            f = out / "quality.json"
            if f.is_file():
                r = json.loads(f.read_text())
                done = r["examples"]
                if len(done) >= 2:
                    break
            time.sleep(0.5)
        assert len(done) >= 2 and r["stopped"] == "in progress", p.poll()
        os.killpg(p.pid, signal.SIGINT)
        log, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, log[-2000:]
    r = json.loads((out / "quality.json").read_text())
    assert r["stopped"] == "interrupted"
    assert len(done) <= len(r["examples"]) < 1100
    assert (out / "tables.md").is_file()


def test_a_pool_whose_terminate_deadlocks_is_stopped_by_killing_its_workers(Q):
    """Pool.terminate can block for good mid-run (a worker stuck writing into the full result
    pipe holds the lock terminate needs): stop_pool gives it its time, then kills the
    workers, which unblocks it, and returns; a pool that stops is just stopped."""
    import multiprocessing as mp
    import time
    worker = mp.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True)
    worker.start()

    class Stuck:                     # terminate returns only once the worker is gone
        joined = False

        def terminate(self):
            while worker.is_alive():
                time.sleep(0.05)

        def join(self):
            self.joined = True

    t0 = time.monotonic()
    try:
        assert Q.stop_pool(Stuck(), wait_s=0.5) is False
    finally:
        if worker.is_alive():
            worker.kill()
    assert worker.exitcode is not None and worker.exitcode < 0       # killed, not done
    assert time.monotonic() - t0 < 60            # 2 x wait_s, with room for a busy machine
    # A real pool the way the benchmark makes it (spawn: a fork of this many-threaded pytest
    # process can inherit a lock held mid-fork, and CI once saw such a worker outlive SIGTERM),
    # up and idle after one task, stops by terminate alone.
    pool = mp.get_context("spawn").Pool(1)
    assert pool.map(abs, [-1]) == [1]
    procs = list(pool._pool)
    assert Q.stop_pool(pool, wait_s=30) is True
    assert procs and not any(p.is_alive() for p in procs)


def test_more_configs_are_modes_checked_against_the_model(Q, tmp_path):
    """``--configs`` turns each file into a mode named by its stem, on the same videos; a
    config of another model shape, or two files of one stem, stop the run before any video."""
    import json
    from dataclasses import replace
    from mminfer.sparse.patterns import ModelIdentity, default_config
    ident = ModelIdentity(id="m", revision="local", layers=2, heads=4, kv_heads=2, head_dim=8)
    a = tmp_path / "a.json"
    a.write_text(json.dumps(default_config(ident).to_dict()))
    (tmp_path / "b").mkdir()
    a2 = tmp_path / "b" / "a.json"
    a2.write_text(a.read_text())
    out = Q.extra_configs([str(a)], ident)
    assert list(out) == ["cfg:a"] and out["cfg:a"].identity == ident
    with pytest.raises(SystemExit, match="two files named 'a'"):
        Q.extra_configs([str(a), str(a2)], ident)
    with pytest.raises(SystemExit, match="--configs"):
        Q.extra_configs([str(a)], replace(ident, layers=3))


def test_fp8_mode_compares_the_fp8_model_with_dense(Q, tmp_path):
    """--fp8: the embedded model loaded again with quantization="fp8" is one more mode, dense,
    with its agreement with dense and last-token KL(dense || fp8) in the summary."""
    r = Q.main(["--device", "cpu", "--lengths", "64", "--depths", "0", "--per-task", "1",
                "--tasks", "needle", "colour", "--no-config", "--densities", "--fp8",
                "--workers", "0", "--out", str(tmp_path / "q")])
    assert r["modes"] == ["dense", "fp8"]
    for ex in r["examples"]:
        m = ex["modes"]["fp8"]
        assert m["kl"] is not None and 0 <= m["kl"] < 0.01 and not m["sparse"]
    assert r["summary"]["agreement_with_dense"]["fp8"] == 1.0
