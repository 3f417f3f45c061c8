"""``mminfer watch``: the needle sample followed as a stream with the embedded model, in this
process and against a running server (which reads the file itself); the --ask question is
answered after every piece, each answer saying the media time it saw, the last one the
one-shot answer over the whole video; a question typed on stdin is answered too."""

import io
import json
from pathlib import Path

import httpx

from mminfer.cli import main
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.streams import Stream
from mminfer.serve.app import Settings, create_app

SAMPLES = Path(__file__).resolve().parents[1] / "samples" / "videos"
NEEDLE = SAMPLES / "needle_0.mp4"
Q = "What number appears in the video?"


def answers(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]


def test_watch_in_process_answers_as_the_video_arrives(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("What colour is the background?\n"))
    warmed, appended = [], []
    real_warm, real_append = Pipeline.warmup, Stream.append_frames
    # kernels are compiled before the first piece (on a GPU; a no-op here), as by the server
    monkeypatch.setattr(Pipeline, "warmup", lambda self, **kw: (
        warmed.append(len(appended)), real_warm(self, **kw))[1])
    monkeypatch.setattr(Stream, "append_frames", lambda self, *a, **kw: (
        appended.append(1), real_append(self, *a, **kw))[1])
    rc = main(["watch", str(NEEDLE), "--ask", Q, "--json", "--device", "cpu",
               "--max-new-tokens", "4"])
    assert rc == 0 and warmed == [0] and appended
    got = answers(capsys)
    mine = [a for a in got if a["question"] == Q]
    assert [a["seen_until"] for a in mine] == [2.0, 4.0, 6.0, 8.0, 10.0]
    typed = [a for a in got if a["question"] != Q]
    assert len(typed) == 1 and typed[0]["question"] == "What colour is the background?"
    one_shot = Pipeline(None, device="cpu").answer(str(NEEDLE), Q, fps=2.0, max_new_tokens=4)
    assert one_shot.video["frames"] == 20
    assert mine[-1]["answer"] == one_shot.answer


def test_watch_against_a_server_that_pulls_the_file(tmp_path, live_server, capsys):
    srv = live_server(create_app(Settings(device="cpu", data_dir=str(tmp_path),
                                          allowed_local_media_path=str(SAMPLES))))
    rc = main(["watch", str(NEEDLE), "--url", srv.url, "--ask", Q, "--every", "4",
               "--json", "--no-stdin", "--max-new-tokens", "4"])
    assert rc == 0
    got = answers(capsys)
    assert got and got[-1]["seen_until"] == 10.0 and got[-1]["question"] == Q
    seen = [a["seen_until"] for a in got]
    assert seen == sorted(seen)
    # the stream is deleted at the end
    assert httpx.get(f"{srv.url}/v1/streams").json()["data"] == []
