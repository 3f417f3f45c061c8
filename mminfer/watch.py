"""``mminfer watch SOURCE`` (its options: watch_cli.py): follow a video file or live URL as a stream and answer questions
while it arrives.

Every piece of the source (two seconds of media, or two seconds of waiting) is appended to a
live stream as soon as it is read, and a progress line on stderr says how far it got. The
questions given with ``--ask`` are answered after each piece (``--every S``: at most once per
S seconds of media), and each line typed on stdin is answered after the piece in progress, over
everything taken in so far; every answer says the media time it saw. The stream ends with the
source (or Ctrl-C).

In this process with the model of ``--model`` (by default the embedded one), like ``mminfer
answer``: the source is read with PyAV (``--realtime``: a file at the pace of its timestamps,
as a camera would deliver it). With ``--url`` the running server at that address reads the
source itself (pull mode: the server must allow it, ``--allowed-media-domains`` or
``--allowed-local-media-path``) and the questions go to it; the stream is deleted at the end.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

import httpx
from transformers.utils import logging as hf_logging

from mminfer.cli_options import pipeline_options
from mminfer.engine.pipeline import Pipeline
from mminfer.engine.streams import Stream
from mminfer.errors import InputError, MMInferError
from mminfer.models.base import PrepareOptions
from mminfer.models.embedded import resolve_model
from mminfer.video.live import LiveSource

ENDED = ("ended", "failed", "full", "stopped")


class Questions:
    """The questions to answer next: ``--ask`` ones when due, lines typed on stdin once."""

    def __init__(self, asked: list[str], every: float, read_stdin: bool):
        self.asked, self.every = asked, every
        self.typed: queue.Queue = queue.Queue()
        self.last_at: float | None = None
        if read_stdin:
            threading.Thread(target=self._read, daemon=True, name="mminfer-watch-stdin").start()

    def _read(self):
        for line in sys.stdin:
            if line.strip():
                self.typed.put(line.strip())

    def due(self, media_s: float, final: bool = False) -> list[str]:
        out = []
        while not self.typed.empty():
            out.append(self.typed.get_nowait())
        if self.asked and (final or self.last_at is None or
                           media_s - self.last_at >= self.every - 1e-9):
            if final and self.last_at == media_s:
                return out
            out = [*self.asked, *out]
            self.last_at = media_s
        return out


def show(out, question: str, answer: str, seen_until: float, as_json: bool, **extra):
    if as_json:
        print(json.dumps({"question": question, "answer": answer, "seen_until": seen_until,
                          **extra}, ensure_ascii=False), file=out, flush=True)
    else:
        print(f"[{seen_until:7.1f} s] {question}\n          {answer}", file=out, flush=True)


def progress(text: str):
    if sys.stderr.isatty():
        print("\r" + text[:150].ljust(150), end="", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


def run(args) -> int:
    """``mminfer watch`` (watch_cli.py's options)."""
    if not args.ask and args.no_stdin:
        raise InputError("nothing to ask: give --ask QUESTION or type questions on stdin")
    if not 0 < args.fps <= 60 or args.every < 0 or args.max_new_tokens < 1:
        raise InputError("--fps must be in (0, 60], --every >= 0, --max-new-tokens >= 1")
    questions = Questions(args.ask, args.every, not args.no_stdin)
    if args.url:
        return _remote(args, questions)
    return _local(args, questions)


def _local(args, questions: Questions) -> int:
    hf_logging.disable_progress_bar()
    pipe = Pipeline(resolve_model(args.model), **pipeline_options(args))
    # on a GPU, the kernels compile now (as the server's do before it is ready), not in
    # the middle of the stream: the first piece of 512K keys would compile the estimator's
    # chunked mass pass (nothing to compile on the CPU)
    pipe.warmup()
    stream = Stream(pipe, fps=args.fps, options=PrepareOptions(max_pixels=args.max_pixels))
    source = LiveSource(args.source, args.fps, realtime=args.realtime)
    started = time.monotonic()

    def answer_due(final=False):
        for q in questions.due(stream.media_end, final):
            if not stream.length:
                continue
            res = stream.ask(q, max_new_tokens=args.max_new_tokens)
            show(sys.stdout, q, res.answer, res.video["seen_until"], args.json,
                 tokens=res.tokens["total"], ttft_ms=res.timings_ms.get("ttft"))

    try:
        for piece in source.pieces():
            rep = stream.append_frames(
                piece.frames, media_seconds=max(piece.media_end - stream.media_end, 0.0),
                next_sample=piece.next_sample)
            progress(f"[watch] {stream.seen_until:.1f} s seen, {stream.pieces} pieces, "
                     f"{stream.length} tokens; last piece {rep['total_ms'] / 1e3:.2f} s; "
                     f"{time.monotonic() - started:.0f} s since start")
            answer_due()
    except KeyboardInterrupt:
        pass
    except MMInferError as e:                 # what came before it is still answered
        progress(f"[watch] the source stopped: {e.message}")
        answer_due(final=True)
        return 1
    if sys.stderr.isatty():
        print(file=sys.stderr)
    answer_due(final=True)
    return 0


def _remote(args, questions: Questions) -> int:
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    source = args.source
    if "://" not in source:                  # a path: as the server's allowed folder sees it
        source = os.path.abspath(source)
    body = {"fps": args.fps, "source": source}
    if args.max_pixels:
        body["max_pixels"] = args.max_pixels
    with httpx.Client(base_url=url, headers=headers, timeout=600) as client:
        r = client.post("/v1/streams", json=body)
        if r.status_code != 200:
            raise InputError(_said(r))
        sid = r.json()["id"]

        def answer_due(st, final=False):
            for q in questions.due(st["media_seconds"], final):
                if not st["tokens"]:
                    continue
                a = client.post("/v1/answer", data={
                    "question": q, "stream_id": sid, "max_new_tokens": str(args.max_new_tokens)},
                    files={"dummy": ("x.bin", b"", "application/octet-stream")})
                if a.status_code != 200:
                    print(f"error: {_said(a)}", file=sys.stderr)
                    continue
                got = a.json()
                show(sys.stdout, q, got["answer"], got["video"]["seen_until"], args.json,
                     tokens=got["tokens"]["total"], ttft_ms=got["timings_ms"]["ttft"])

        pieces = 0
        try:
            while True:
                st = client.get(f"/v1/streams/{sid}").json()
                src = st.get("source") or {}
                progress(f"[watch] {st['seen_until']:.1f} s seen, {st['pieces']} pieces, "
                         f"{st['tokens']} tokens; source {src.get('state')}, lag "
                         f"{src.get('lag_seconds') or 0:.1f} s")
                if st["pieces"] > pieces or not questions.typed.empty():
                    pieces = st["pieces"]
                    answer_due(st)
                if src.get("state") in ENDED:
                    if src.get("error"):
                        progress(f"[watch] the source stopped: {src['error']['message']}")
                    answer_due(st, final=True)
                    return 0 if src.get("state") == "ended" else 1
                time.sleep(0.5)
        except KeyboardInterrupt:
            return 130
        finally:
            client.delete(f"/v1/streams/{sid}")


def _said(r) -> str:
    try:
        return f"the server answered {r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"the server answered {r.status_code}"
