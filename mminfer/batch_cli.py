"""``mminfer batch``'s command line: its options, light (argparse and the shared model
options), so ``mminfer batch --help`` is instant; the job itself, :mod:`mminfer.batch`, is
imported when it runs."""

from __future__ import annotations

import argparse

from mminfer.cli_options import HelpWithDefaults, add_model_arguments


def add_arguments(p: argparse.ArgumentParser):
    p.formatter_class = HelpWithDefaults
    p.add_argument("dir", nargs="?", help="folder scanned recursively for video files")
    g = p.add_argument_group("questions (with DIR: at least one)")
    g.add_argument("--question", action="append",
                   help="a question (repeatable: every video is asked each, its prefix "
                        "prefilled once)")
    g.add_argument("--questions", metavar="FILE", help="questions, one a line ('#' comments)")
    p.add_argument("--manifest", metavar="FILE",
                   help='instead of DIR: JSONL, {"video": PATH, "question": Q, "id": ID} or '
                        '{"video": PATH, "questions": [Q, ...], "id": ID} a line (paths '
                        "relative to FILE, id optional); the questions of one video run "
                        "together, answered from its cached prefix after the first")
    p.add_argument("--out", required=True, help="JSONL results file (appended to, resumable)")
    add_model_arguments(p, "$MMINFER_MODEL, else the embedded default model")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    p.add_argument("--max-frames", type=int, default=768, help="at most this many frames")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap")
    p.add_argument("--retry-errors", action="store_true",
                   help="run again the items whose earlier records are errors")
    p.add_argument("--item-timeout-s", type=float,
                   help="stop an item after this long (an error record 'timeout')")
    p.add_argument("--quarantine-after", type=int, default=2,
                   help="skip an item after the process died this many times on it (0: never)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="run on a Ray cluster: its address, 'auto', or 'local' (start one)")
    p.add_argument("--ray-workers", type=int,
                   help="model replicas on Ray (default: one per GPU, or 1 without GPUs)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N processes started by `torchrun "
                        "--nproc-per-node N -m mminfer batch ...`: rank 0 reads the input and "
                        "writes the results, every rank runs each item (default: 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    # lazy: the CLI's edge: the job imports the engine (torch, transformers: seconds), which
    # `mminfer batch --help` must not wait for
    from mminfer import batch
    return batch.run(args)
