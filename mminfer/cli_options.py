"""The command line's shared options (interface layer): which model and how it runs, the same
flags for ``answer``, ``serve`` and ``batch``, mapping onto
:class:`mminfer.engine.pipeline.Pipeline`'s constructor; and the help formatter every
subcommand gets from :func:`mminfer.cli.build_parser`."""

from __future__ import annotations

import argparse


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows a default where there is one to show (not None, not an off switch,
    not one the help already states)."""

    def _get_help_string(self, action):
        if action.default in (None, False, [], ()) or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_model_arguments(p: argparse.ArgumentParser, model_default: str):
    """Which model and how it runs: the same options for answer, serve and batch."""
    p.add_argument("--model", help=f"checkpoint directory or hub id (default: {model_default})")
    p.add_argument("--attention", choices=("auto", "sparse", "dense"), default="auto",
                   help="prefill attention (auto: sparse for long prompts)")
    p.add_argument("--device", help="cuda, cpu, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto",
                   help="what the KV cache stores: auto the model dtype; fp8 (= fp8_e4m3) "
                   "float8 e4m3 with per-head scales, half the memory of bf16")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: the LLM's and vision tower's linear layers as FP8 GEMMs "
                   "(per-channel weight, per-token activation scales; sm89+ GPUs); an FP8 "
                   "checkpoint implies it (default: the dtype's weights)")
    p.add_argument("--min-sparse-len", type=int, default=None,
                   help="auto mode: shorter prefills stay dense (default: 65536 on a GPU, "
                   "always dense on the CPU)")


def pipeline_options(args) -> dict:
    """How the model runs, from the flags :func:`add_model_arguments` added: the keywords
    ``Pipeline`` (and the server's ``Settings``) take besides the model."""
    return {"attention": args.attention, "device": args.device, "dtype": args.dtype,
            "min_sparse_len": args.min_sparse_len, "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": args.quantization}
