"""The ``mminfer`` command. Subcommands live in modules with ``add_arguments(parser)`` and
``run(args) -> int`` (:data:`SUBCOMMANDS`). Those modules are light (argparse and the options'
defaults): only the subcommand named is imported, and its ``run`` imports the engine, the app
or the batch job when it runs, so ``mminfer --help`` and every subcommand's ``--help`` stay
instant. Everything below this edge imports torch and the rest at the top of its module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys

from mminfer import __version__
from mminfer.cli_options import HelpWithDefaults, add_model_arguments, pipeline_options
from mminfer.errors import InputError, MMInferError
from mminfer.models.embedded import resolve_model

# name -> (module, one-line help): a light module with add_arguments(parser) and run(args),
# the run importing the heavy part (the engine, the app, the job) when it runs; `answer` is
# defined below. Benchmarks are scripts in the source tree (benchmarks/), not subcommands.
SUBCOMMANDS = {
    "answer": ("mminfer.cli", "answer a question about a video"),
    "serve": ("mminfer.serve.cli", "run the HTTP service"),
    "batch": ("mminfer.batch_cli", "answer questions about every video of a directory"),
    "watch": ("mminfer.watch_cli", "follow a video file or live URL as a stream, answering "
                               "questions as it arrives"),
    "calibrate": ("mminfer.offline.cli", "search head patterns on calibration videos"),
}


# ---------------------------------------------------------------------- answer
def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("video", help="video file")
    p.add_argument("question", help="question about the video")
    add_model_arguments(p, "$MMINFER_MODEL, else the embedded default model")
    p.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    p.add_argument("--max-frames", type=int, default=768, help="at most this many frames")
    p.add_argument("--max-new-tokens", type=int, default=32, help="answer length cap")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0: sampled (with --top-p, --seed)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling")
    p.add_argument("--seed", type=int, help="the same seed gives the same sampled answer")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the answer before TEXT (may be given more than once)")
    p.add_argument("--start", type=float, help="clip start (seconds)")
    p.add_argument("--end", type=float, help="clip end (seconds)")
    p.add_argument("--json", action="store_true", help="print the full record as JSON")
    p.add_argument("--no-video-cache", action="store_true",
                   help="do not look the video's prefix up in (or add it to) the video cache; "
                        "the record says cache \"off\"")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the language model over N processes started by `torchrun "
                   "--nproc-per-node N -m mminfer answer ...` (default: 1)")


def run(args) -> int:
    check_video_path(args.video)             # before the model loads (seconds), not after
    args.model = resolve_model(args.model)   # a clear error says how to get a model
    # lazy: the CLI's edge: the engine (torch, transformers, triton: seconds) loads when
    # `answer` runs, never for `mminfer --help`
    from transformers.utils import logging as hf_logging
    from mminfer.engine.pipeline import Pipeline, check_request
    from mminfer.models.sampler import SamplingParams
    # bad arguments fail before the model loads
    check_request(args.question, args.fps, args.max_frames, args.max_new_tokens, args.start,
                  args.end, args.attention)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                              stop=tuple(args.stop))
    hf_logging.disable_progress_bar()
    pipe = Pipeline(args.model, **pipeline_options(args), tensor_parallel=args.tensor_parallel)
    res = pipe.answer(args.video, args.question, fps=args.fps, max_frames=args.max_frames,
                      max_new_tokens=args.max_new_tokens, start=args.start, end=args.end,
                      use_cache=not args.no_video_cache, sampling_params=sampling)
    if pipe.rank != 0:       # tensor parallel: every rank computes the answer, one prints it
        return 0
    # how the model ran, which the answer's own record does not carry
    d = {**res.to_dict(), "quantization": pipe.quantization,
         "kv_cache_dtype": pipe.kv_cache_dtype}
    print(json.dumps(d, indent=2) if args.json else format_result(d))
    return 0


def check_video_path(path: str):
    """InputError unless ``path`` names a readable file (a URL is the pipeline's to judge)."""
    if "://" in path:
        return
    if not os.path.exists(path):
        raise InputError(f"{path}: not found (no such file)")
    if not os.path.isfile(path):
        raise InputError(f"{path}: not a file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: not readable (permission denied)")


def format_result(d: dict) -> str:
    v, t = d["video"], d["tokens"]
    lines = [d["answer"], ""]
    attn = d["attention"]
    if d.get("sparsity"):
        attn += f" (density {d['sparsity']['mean_density']:.3f})"
    running = [f"model  {d['model']}"]
    if d.get("quantization") == "fp8":
        running.append("FP8 linear layers (--quantization fp8)")
    if d.get("kv_cache_dtype") == "fp8_e4m3":
        running.append("FP8 KV cache (--kv-cache-dtype fp8)")
    lines.append(", ".join(running))
    lines.append(f"video  {v['frames']} frames at {v['sampled_fps']:.2f} fps of "
                 f"{v['duration']:.1f} s, {v['width']}x{v['height']}")
    lines.append(f"tokens {t['total']} ({t['visual']} visual, {t['text']} text), "
                 f"attention {attn}, cache {d.get('cache', '-')}")
    lines.append("")
    width = max(len(k) for k in d["timings_ms"])
    for k, ms in d["timings_ms"].items():
        lines.append(f"  {k:<{width}}  {ms:10.1f} ms")
    return "\n".join(lines)


# ---------------------------------------------------------------------- main
def build_parser(argv=()) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` gets its module imported."""
    parser = argparse.ArgumentParser(
        prog="mminfer", description="Fast long-video question answering with modality-aware "
                                    "sparse prefill (MMInference).")
    parser.add_argument("--version", action="version", version=f"mminfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in SUBCOMMANDS.items():
        if not _exists(module):
            continue
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=HelpWithDefaults)
        if name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:     # its parent package is not written yet
        return False


# Pinned host memory (the video cache's host tier: a spill moves a cached video's KV there) by
# malloc, its pages mapped by 8 threads, then cudaHostRegister, instead of PyTorch's default
# cudaHostAlloc: a 5.3 GB spill in 56 buffers took 2.6-3.0 s by the default and 0.9 s so, the
# copy back to the device unchanged (H100, lab/experiments/pinned_spill.py). Read by PyTorch's
# allocator once, on its first use: set before anything touches CUDA.
PINNED_HOST = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def allocator_env(environ) -> None:
    """Add PINNED_HOST to the CUDA allocator's settings in ``environ`` unless they say how to
    pin host memory already; settings given only by PYTORCH_ALLOC_CONF are left alone."""
    conf = environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "pinned_use_cuda_host_register" in conf or (not conf and environ.get(
            "PYTORCH_ALLOC_CONF")):
        return
    environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{conf},{PINNED_HOST}" if conf else PINNED_HOST


def main(argv=None) -> int:
    allocator_env(os.environ)
    rc = _main(argv)
    _end_rank(rc)
    return rc


def _end_rank(rc: int):
    """A torchrun rank (``--tensor-parallel``) ends here once its work is done, not in the
    interpreter's teardown: there C++ objects holding threads that are still joinable
    (seen after a decoded video and a served or answered request) abort the process with
    "terminate called without an active exception", exit -6, and torchrun reports a
    failed job although every answer was given."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    # lazy: the CLI's edge (cli.py loads no engine); a torchrun rank has it loaded by now
    from mminfer.engine.parallel import leave
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    leave()
    os._exit(rc)


def _main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        rc = int(args._run(args) or 0)
        sys.stdout.flush()           # a reader gone away shows here, not in the teardown
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except MMInferError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:   # a bug, not bad input: still one line unless debugging
        if os.environ.get("MMINFER_DEBUG"):
            raise
        print(f"error: internal: {type(e).__name__}: {e} (MMINFER_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


def _stdout_closed() -> int:
    """The reader of stdout went away (``mminfer answer ... | head -1``): end quietly, as a
    Unix tool killed by SIGPIPE does (status 128 + 13), without a message about it. stdout is
    pointed at /dev/null so that the interpreter's last flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
