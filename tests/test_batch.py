"""The directory batch job with the tiny Qwen2.5-VL checkpoint: stable order and ids, a run
killed mid-way and resumed (every item exactly once), --retry-errors, a changed
configuration refused, and the same job on a local Ray instance."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import write_video

from mminfer import cli
from mminfer.batch import item_id, read_manifest, read_questions, run_batch, scan
from mminfer.errors import ConfigError, InputError
from lab.toy.tiny import save_tiny_qwen2_5_vl

QUESTIONS = ["what color is it?", "how many frames?"]
NEEDLE = Path(__file__).resolve().parents[1] / "samples" / "videos" / "needle_0.mp4"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_qwen2_5_vl(tmp_path_factory.mktemp("batch") / "tiny-qwen")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Seven readable clips in nested folders, one broken file, and files to ignore."""
    root = tmp_path_factory.mktemp("videos")
    names = ["b.mp4", "a/z.mp4", "a/b/c.mkv", "A.mp4", "a/x y.mp4", "c/d.mov", "c/e.MP4"]
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write_video(root / name, n_frames=8 + 2 * i, fps=4.0, width=64, height=48,
                    container="matroska" if name.endswith(".mkv") else
                    "mov" if name.endswith(".mov") else None)
    (root / "c" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 500)
    (root / "notes.txt").write_text("not a video")
    (root / ".hidden").mkdir()
    write_video(root / ".hidden" / "skip.mp4", n_frames=4)
    return root


def records(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_scan_order_and_stable_ids(videos):
    got = [v.rel for v in scan(videos)]
    assert got == ["A.mp4", "a/b/c.mkv", "a/x y.mp4", "a/z.mp4", "b.mp4", "c/broken.mp4",
                   "c/d.mov", "c/e.MP4"]
    first, again = scan(videos), scan(videos)
    assert [item_id(v, "q") for v in first] == [item_id(v, "q") for v in again]
    assert item_id(first[0], "q") != item_id(first[0], "q2")
    os.utime(first[0].path, ns=(first[0].mtime_ns + 10**9, first[0].mtime_ns + 10**9))
    moved = scan(videos)[0]
    assert item_id(moved, "q") != item_id(first[0], "q")      # an edited video is new work
    os.utime(first[0].path, ns=(first[0].mtime_ns, first[0].mtime_ns))
    with pytest.raises(InputError, match="no question"):
        read_questions(None, None)


def test_questions_file(tmp_path):
    f = tmp_path / "q.txt"
    f.write_text("# comment\nwhat color?\n\nhow many?\nwhat color?\n", encoding="utf-8")
    assert read_questions(["first?"], str(f)) == ["first?", "what color?", "how many?"]


def test_killed_run_resumes_exactly_once(ckpt, videos, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    n_items = len(scan(videos)) * len(QUESTIONS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = ["batch", str(videos), "--out", str(out), "--model", str(ckpt),
            "--max-new-tokens", "8", "--no-progress"]
    for q in QUESTIONS:
        args += ["--question", q]
    p = subprocess.Popen([sys.executable, "-m", "mminfer.cli", *args], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and p.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()[-2000:]
    p.stderr.close()
    before = [json.loads(ln) for ln in out.read_bytes().split(b"\n") if ln.endswith(b"}")]
    assert 3 <= len(before) < n_items, "the job finished before it could be killed"
    with open(out, "ab") as f:                   # a write torn by the kill
        f.write(b'{"custom_id": "deadbeef", "video": "b.mp')

    code = cli.main(args)
    summary = capsys.readouterr().out
    recs = records(out)                          # every line parses: the torn tail is gone
    assert code == 1                             # the broken file is an error
    ok = Counter((r["video"], r["question"]) for r in recs if r["status"] == "ok")
    readable = [v.rel for v in scan(videos) if v.rel != "c/broken.mp4"]
    assert set(ok) == {(v, q) for v in readable for q in QUESTIONS}
    assert set(ok.values()) == {1}               # each exactly once
    assert len({r["custom_id"] for r in recs}) == n_items == len(recs)
    errs = [r for r in recs if r["status"] == "error"]
    assert {r["video"] for r in errs} == {"c/broken.mp4"}
    assert all(r["error"]["code"] == "bad_video" and str(videos) not in r["error"]["message"]
               for r in errs)
    fp = {r["config_fingerprint"] for r in recs}
    assert len(fp) == 1
    r = next(r for r in recs if r["status"] == "ok")
    assert r["response"]["answer"] is not None and r["timings_ms"]["vision"] > 0
    assert "path" not in r["response"]["video"]
    line = next(ln for ln in summary.splitlines() if ln.startswith("batch:"))
    done_before = sum(1 for r in before if r["status"] == "ok")
    err_before = len(before) - done_before
    assert f"{len(before)} skipped" in line and "latency" in line and "p95" in line
    final = json.loads(summary.strip().splitlines()[-1])["summary"]
    assert final["skipped"] == len(before) and final["done"] + final["errors"] == \
        n_items - len(before)
    assert final["errors"] == len(QUESTIONS) - err_before

    # a rerun has nothing left to do; --retry-errors runs the errors again
    s = run_batch(videos, QUESTIONS, out, model=str(ckpt), max_new_tokens=8, progress=False)
    assert (s.done, s.errors, s.skipped) == (0, 0, n_items)
    s = run_batch(videos, QUESTIONS, out, model=str(ckpt), max_new_tokens=8, progress=False,
                  retry_errors=True)
    assert (s.done, s.errors, s.skipped) == (0, len(QUESTIONS), n_items - len(QUESTIONS))
    retried = [r for r in records(out) if r["status"] == "error"]
    assert Counter(r["attempt"] for r in retried) == {1: 2, 2: 2}
    assert len(records(out)) == n_items + len(QUESTIONS)

    # another configuration is refused and the file is left as it was
    snapshot = out.read_bytes()
    with pytest.raises(ConfigError, match="another configuration"):
        run_batch(videos, QUESTIONS, out, model=str(ckpt), max_new_tokens=8, fps=1.0,
                  progress=False)
    assert out.read_bytes() == snapshot


def test_ray_runs_the_same_job(ckpt, videos, tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
    local = tmp_path / "local.jsonl"
    on_ray = tmp_path / "ray.jsonl"
    questions = QUESTIONS[:1]
    run_batch(videos, questions, local, model=str(ckpt), max_new_tokens=4, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        s = run_batch(videos, questions, on_ray, model=str(ckpt), max_new_tokens=4,
                      progress=False, ray_address="auto", ray_workers=2)
    finally:
        ray.shutdown()
    assert (s.done, s.errors) == (len(scan(videos)) - 1, 1)
    a = {r["custom_id"]: r for r in records(local)}
    b = {r["custom_id"]: r for r in records(on_ray)}
    assert len(b) == len(records(on_ray)) == len(a)         # exactly once
    for cid, r in a.items():                                 # greedy: the same answers
        assert b[cid]["status"] == r["status"]
        if r["status"] == "ok":
            assert b[cid]["response"]["answer"] == r["response"]["answer"]


def test_scan_counts_everything_it_passes_over(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    write_video(root / "sub" / "ok.mp4", n_frames=4)
    (root / ".cache").mkdir()
    write_video(root / ".cache" / "hidden.mp4", n_frames=4)
    (root / ".hidden.mp4").write_bytes(b"x")
    (root / "notes.txt").write_text("not a video")
    (root / "linked").symlink_to(root / "sub", target_is_directory=True)
    (root / "dangling.mp4").symlink_to(tmp_path / "gone.mp4")
    os.mkfifo(root / "pipe.mp4")
    ignored = {}
    assert [v.rel for v in scan(root, ignored)] == ["sub/ok.mp4"]
    assert ignored == {"hidden": 2, "not a video file": 1, "symlinked folder": 1,
                       "unreadable or a dangling link": 1, "not a regular file": 1}


def test_summary_percentiles():
    from mminfer.batch import Summary
    d = Summary(latencies_ms=[float(x) for x in range(100, 0, -1)]).to_dict()["latency_ms"]
    assert (d["mean"], d["p50"], d["p95"]) == (50.5, 50.0, 95.0)


def test_manifest_input(ckpt, videos, tmp_path):
    man = tmp_path / "m" / "items.jsonl"
    man.parent.mkdir()
    rel = os.path.relpath(videos, man.parent)
    man.write_text("\n".join([
        json.dumps({"video": f"{rel}/b.mp4", "question": "what color is it?", "id": "first"}),
        "# a comment",
        json.dumps({"video": f"{rel}/a/z.mp4", "question": "how many frames?"}),
        json.dumps({"video": f"{rel}/b.mp4", "question": "how many frames?"}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(None, [], out, model=str(ckpt), max_new_tokens=4, progress=False,
                  manifest=man)
    assert (s.items, s.done, s.errors) == (3, 3, 0)
    recs = records(out)
    assert [r["custom_id"] for r in recs][0] == "first"
    assert [(r["video"], r["question"]) for r in recs] == [     # one video's items together
        (f"{rel}/b.mp4", "what color is it?"), (f"{rel}/b.mp4", "how many frames?"),
        (f"{rel}/a/z.mp4", "how many frames?")]
    again = run_batch(None, [], out, model=str(ckpt), max_new_tokens=4, progress=False,
                      manifest=man)
    assert (again.done, again.skipped) == (0, 3)
    man.write_text(json.dumps({"video": "nope.mp4", "question": "q"}) + "\n")
    with pytest.raises(InputError, match="line 1.*does not exist"):
        run_batch(None, [], out, model=str(ckpt), progress=False, manifest=man)
    man.write_text('{"video": "x.mp4"}\n')
    with pytest.raises(InputError, match="line 1 must be"):
        run_batch(None, [], out, model=str(ckpt), progress=False, manifest=man)


def test_questions_of_one_video_are_answered_from_one_prefill(ckpt, videos, tmp_path):
    man = tmp_path / "items.jsonl"
    rel = os.path.relpath(videos, tmp_path)
    b, z = f"{rel}/b.mp4", f"{rel}/a/z.mp4"
    man.write_text("\n".join(json.dumps(e) for e in [
        {"video": b, "questions": ["what color is it?", "how many frames?"], "id": "b"},
        {"video": z, "question": "what color is it?"},
        {"video": b, "question": "is it dark?"},
        {"video": z, "questions": ["how many frames?"], "id": "z"},
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    s = run_batch(None, [], out, model=str(ckpt), max_new_tokens=3, progress=False,
                  manifest=man)
    assert (s.items, s.done, s.errors) == (5, 5, 0)
    assert s.to_dict()["cache"] == {"hit": 3, "miss": 2}
    assert "prefixes: 3 hit, 2 miss" in s.line()
    recs = records(out)
    zid = next(r["custom_id"] for r in recs if r["video"] == z and r["custom_id"] != "z:0")
    # grouped by video in the order of first mention: one prefill, then hits
    assert [(r["custom_id"], r["video"], r["response"]["cache"]) for r in recs] == [
        ("b:0", b, "miss"), ("b:1", b, "hit"), (recs[2]["custom_id"], b, "hit"),
        (zid, z, "miss"), ("z:0", z, "hit")]
    assert recs[1]["response"]["tokens"]["cached"] > 0
    assert recs[1]["timings_ms"]["vision"] == 0 and recs[0]["timings_ms"]["vision"] > 0
    again = run_batch(None, [], out, model=str(ckpt), max_new_tokens=3, progress=False,
                      manifest=man)
    assert (again.done, again.skipped) == (0, 5)
    for bad, match in (({"video": b, "question": "q", "questions": ["q"]}, "not both"),
                       ({"video": b, "questions": []}, "non-empty"),
                       ({"video": b, "questions": ["q", ""]}, "non-empty"),
                       ({"video": b, "questions": ["q", "q"], "id": "x"}, None)):
        man.write_text(json.dumps(bad) + "\n")
        if match is None:                    # the same question twice under an id: two items
            assert [cid for _, _, cid in read_manifest(man)] == ["x:0", "x:1"]
            continue
        with pytest.raises(InputError, match=match):
            read_manifest(man)


def test_questions_of_one_video_decode_together(ckpt, tmp_path):
    """A video's questions after its first (which prefills the prefix) run together: their
    answers decode in shared batched steps (the summary counts the steps and the batches),
    each the answer it gets asked alone, the records in the items' order."""
    from mminfer.engine.pipeline import Pipeline
    root = tmp_path / "v"
    root.mkdir()
    clip = write_video(root / "one.mp4", n_frames=8, fps=4.0)
    qs = ["what color is it?", "how many frames?", "is it dark?", "where is the square?"]
    pipe = Pipeline(str(ckpt), attention="auto", device="cpu")
    out = tmp_path / "out.jsonl"
    s = run_batch(root, qs, out, model=str(ckpt), max_new_tokens=6, progress=False,
                  pipe=pipe)
    recs = records(out)
    assert [(r["question"], r["response"]["cache"]) for r in recs] == [
        (qs[0], "miss"), (qs[1], "hit"), (qs[2], "hit"), (qs[3], "hit")]
    d = s.to_dict()["decode"]
    assert d["steps"] > d["batches"] > 0          # several answers' steps in one batch
    assert f"decoded together: {d['steps']} steps in {d['batches']} batches" in s.line()
    for r in recs:                                 # each as asked alone
        alone = pipe.answer(clip, r["question"], fps=2.0, max_new_tokens=6)
        assert alone.cache == "hit" and alone.answer == r["response"]["answer"]
        assert alone.tokens["generated"] == r["response"]["tokens"]["generated"]
    assert len({r["response"]["answer"] for r in recs}) > 1


def test_every_question_flag_is_asked_of_each_video_in_turn(ckpt, tmp_path, capsys):
    root = tmp_path / "v"
    root.mkdir()
    write_video(root / "one.mp4", n_frames=8, fps=4.0)
    write_video(root / "two.mp4", n_frames=10, fps=4.0)   # other bytes (the same would hit)
    out = tmp_path / "out.jsonl"
    code = cli.main(["batch", str(root), "--question", "what color is it?", "--question",
                     "how many frames?", "--question", "is it dark?", "--out", str(out),
                     "--model", str(ckpt), "--max-new-tokens", "3", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert [(r["video"], r["response"]["cache"]) for r in records(out)] == [
        ("one.mp4", "miss"), ("one.mp4", "hit"), ("one.mp4", "hit"),
        ("two.mp4", "miss"), ("two.mp4", "hit"), ("two.mp4", "hit")]


def test_item_timeout_stops_one_item_and_the_job_goes_on(tmp_path):
    slow = save_tiny_qwen2_5_vl(tmp_path / "slow-qwen", max_pixels=28 * 28 * 64)
    root = tmp_path / "v"
    root.mkdir()
    shutil.copy(NEEDLE, root / "long.mp4")                  # a sparse prefill of minutes here
    write_video(root / "short.mp4", n_frames=4, fps=4.0)     # a few tokens: seconds
    out = tmp_path / "out.jsonl"
    t0 = time.monotonic()
    s = run_batch(root, ["what?"], out, model=str(slow), attention="sparse", max_new_tokens=2,
                  progress=False, item_timeout_s=3.0)
    took = time.monotonic() - t0
    by = {r["video"]: r for r in records(out)}
    assert by["long.mp4"]["status"] == "error" and by["long.mp4"]["error"]["code"] == "timeout"
    assert by["long.mp4"]["timings_ms"]["total"] < 3000 + 2000       # stopped, not finished
    assert by["short.mp4"]["status"] == "ok", by["short.mp4"]["error"]
    assert (s.done, s.errors) == (1, 1) and took < 120


def test_an_item_that_kills_the_process_is_quarantined(ckpt, tmp_path):
    """A video whose answer kills the process (SIGKILL, as the OOM killer ends it) is retried
    last, then quarantined; the other items are answered."""
    root = tmp_path / "v"
    root.mkdir()
    write_video(root / "a.mp4", n_frames=4)
    write_video(root / "z.mp4", n_frames=4)
    write_video(root / "big.mp4", n_frames=4)
    out = tmp_path / "out.jsonl"
    # decoding is bounded now (streamed at the model's size), so the death is planted: the
    # process is killed from inside the answer of big.mp4, with no chance to write a record
    code = f"""
import os, signal
from mminfer.batch import run_batch
from mminfer.engine import pipeline
real = pipeline.Pipeline.answer
def answer(self, video, *a, **kw):
    if str(video).endswith("big.mp4"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, video, *a, **kw)
pipeline.Pipeline.answer = answer
s = run_batch({str(root)!r}, ["what?"], {str(out)!r}, model={str(ckpt)!r}, attention="dense",
              fps=30.0, max_frames=120, max_new_tokens=2, progress=False)
print("SUMMARY", s.to_dict())
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=600) for _ in range(3)]
    assert runs[0].returncode != 0 and runs[1].returncode != 0, runs[0].stdout + runs[0].stderr
    assert "SUMMARY" in runs[2].stdout, runs[2].stdout + runs[2].stderr[-2000:]
    final = eval(runs[2].stdout.split("SUMMARY", 1)[1])       # noqa: S307 - our own dict
    assert final["quarantined"] == 1
    recs = records(out)
    by = {}
    for r in recs:
        by.setdefault(r["video"], []).append(r)
    assert [r["status"] for r in by["a.mp4"]] == ["ok"] and [r["status"] for r in
                                                             by["z.mp4"]] == ["ok"]
    (q,) = by["big.mp4"]
    assert q["error"]["code"] == "quarantined" and "died 2 times" in q["error"]["message"]


def test_ray_auto_without_a_cluster_says_local(ckpt, videos, tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="ray is not installed (pip install ray)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="--ray local"):
        run_batch(videos, QUESTIONS[:1], tmp_path / "o.jsonl", model=str(ckpt),
                  progress=False, ray_address="auto")
