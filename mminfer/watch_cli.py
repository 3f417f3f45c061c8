"""``mminfer watch``'s command line: its options, light (argparse and the shared model
options), so ``mminfer watch --help`` is instant; the work, :mod:`mminfer.watch`, is imported
when it runs."""

from __future__ import annotations

import argparse
import os

from mminfer.cli_options import add_model_arguments


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("source", help="a video file, or a live URL PyAV opens (http(s), HLS, "
                                  "rtsp)")
    p.add_argument("--ask", action="append", default=[], metavar="QUESTION",
                   help="a question answered as the video arrives (may be given more than "
                        "once); lines typed on stdin are asked too")
    p.add_argument("--every", type=float, default=0.0, metavar="S",
                   help="ask the --ask questions at most once per S seconds of media (0: "
                        "after every piece)")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    p.add_argument("--max-pixels", type=int, help="pixels per frame at most (Qwen2.5-VL)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap")
    p.add_argument("--realtime", action="store_true",
                   help="read a file at the pace of its timestamps (as a live source)")
    p.add_argument("--no-stdin", action="store_true", help="do not read questions from stdin")
    p.add_argument("--json", action="store_true",
                   help="print each answer as a JSON line (question, answer, seen_until...)")
    p.add_argument("--url", help="a running mminfer server that reads the source itself "
                                 "(pull mode) and answers")
    p.add_argument("--api-key", default=os.environ.get("MMINFER_API_KEY"),
                   help="with --url: the server's API key (default: $MMINFER_API_KEY)")
    add_model_arguments(p, "$MMINFER_MODEL, else the embedded default model")


def run(args) -> int:
    # lazy: the CLI's edge: watching imports the engine (torch, transformers: seconds), which
    # `mminfer watch --help` must not wait for
    from mminfer import watch
    return watch.run(args)
