"""``mminfer calibrate``'s command line: its options, light (argparse only), so
``mminfer calibrate --help`` is instant; the command, :mod:`mminfer.offline.command`, is
imported when it runs."""

from __future__ import annotations

import argparse

from .thresholds import add_threshold_arguments

# what a head no candidate holds the bound for becomes (--hard; calibrate() checks it too)
HARD = ("dense", "best")
# the candidate families the search builds (calibrate.candidate_patterns: fixed budgets;
# calibrate.mass_candidate_patterns: mass budgets; the q:/k:/2d ones on inputs of text and
# video only): what --families may name
FAMILIES = ("a_shape", "vertical_slash", "block", "block_ad", "grid", "grid_cols", "q:vs",
            "q:grid|vs", "k:vs", "2d")
# --max-error without a model to score a ladder on answers: one bound
MAX_ERROR = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*",
                        help="captured q/k/v: .pt files or directories of them (default: none; "
                        "give these, or --model with --videos)")
    parser.add_argument("--model", help="calibrate this checkpoint (with --videos): a dense "
                        "prefill per video captures q/k/v of its prefix, the per-head search "
                        "runs on them, then a ladder of configs (--max-error) is scored by "
                        "what the server serves against dense and judged by the thresholds "
                        "(PASS/FAIL, exit status 0/1) (default: none)")
    parser.add_argument("--videos", nargs="+", default=[],
                        help="calibration videos, several lengths and tasks: files, or "
                        "synthetic sources synth:TASK:FRAMES:SEED rendered in-process at "
                        "224x224 and 2 fps, asked their own task's question (TASK: needle, "
                        "colour, count, order; no decoder needed) (default: none)")
    parser.add_argument("--gate-videos", nargs="+", default=[],
                        help="with --model: held-out videos (files or synth: sources, as "
                        "--videos), not calibrated on, that the chosen config must also hold "
                        "the thresholds on, as a server's gate checks a candidate on requests "
                        "it was not calibrated on; one that fails gives way to the next tighter "
                        "rung (default: none, the verdict is on --videos)")
    add_threshold_arguments(parser, what="with --model: on --videos, then on --gate-videos; "
                            "the server's flags of the same name, same defaults")
    parser.add_argument("--question", default="What happens in the video?",
                        help="question placed after each calibration video file (synthetic "
                        "sources ask their own)")
    parser.add_argument("--fps", type=float, default=2.0,
                        help="frames per second sampled from each video file")
    parser.add_argument("--max-frames", type=int, default=768,
                        help="at most this many frames per video file")
    parser.add_argument("--capture-dir", help="where captured .pt files go "
                        "(default: OUT without its suffix + '.captures'; kept for --reselect "
                        "and for searching again without the model)")
    parser.add_argument("--out", required=True, help="head-pattern config to write (JSON; "
                        "required, no default)")
    parser.add_argument("--report", help="per-head report (JSON; default: OUT without its "
                        "suffix + '.report.json')")
    parser.add_argument("--model-id", help="model id (known ids fill in the shape; others "
                        "take it from the captures) (default: the checkpoint's with --model, "
                        "else 'unknown')")
    parser.add_argument("--revision", help="model revision (default: the checkpoint's own, "
                        "'local' for a plain directory, else 'main')")
    parser.add_argument("--layers", type=int, help="number of layers of the model "
                        "(default: known model, else highest captured layer + 1)")
    parser.add_argument("--budget", type=float, nargs="*", default=[0.1, 0.2],
                        help="target densities of the fixed-budget candidates (physical "
                        "tiles / causal triangle at the median calibration length); give no "
                        "value for mass-budget candidates only")
    parser.add_argument("--gamma", type=float, nargs="*", default=[0.9, 0.95, 0.99],
                        help="mass targets of the mass-budget candidates: keep lines/blocks "
                        "until the estimated attention mass covered reaches gamma (configs/"
                        "README.md); give no value for fixed budgets only")
    parser.add_argument("--min-density", type=float, default=0.0,
                        help="floor of the mass-budget candidates: vertical_slash, what "
                        "its lines cost per row (a vertical 1 key, a slash block_n) as a "
                        "fraction of the keys; block, its key blocks per row block as a "
                        "fraction of that row block's causal key blocks (default: 0.0)")
    parser.add_argument("--max-density", type=float, default=0.3,
                        help="ceiling of the mass-budget candidates, the same fraction")
    parser.add_argument("--objective", choices=["output_error", "mass"], default="output_error",
                        help="what --max-error bounds: the relative L2 error of the attention "
                        "output against dense, or 1 - the dense softmax mass captured")
    parser.add_argument("--max-error", type=float, nargs="+", default=None,
                        help="bound on the objective: each head takes the cheapest candidate "
                        "(mean density over the inputs) that holds it. With --model (not "
                        "--answer-kl) the bounds of the ladder: each is a config, scored on "
                        "--videos as served, the loosest that holds the thresholds wins "
                        "(default: 0.02 0.05 0.1 0.2 0.4 on a GPU, 0.05 0.2 0.5 on the CPU, "
                        "the server's; one bound otherwise, default 0.05)")
    parser.add_argument("--error-quantile", type=float, default=1.0,
                        help="which input's objective must hold the bound: this quantile "
                        "across the inputs, per head (1.0: the worst input; 0.9: all but the "
                        "worst tenth)")
    parser.add_argument("--hard", choices=HARD, default="dense",
                        help="a head that no candidate holds the bound for: dense (holds it) "
                        "or best (the candidate with the lowest objective); with --model, at "
                        "every bound of the ladder")
    parser.add_argument("--engine", choices=["auto", "kernel", "reference"], default="auto",
                        help="kernel: the sparse kernels with physical-tile density; "
                        "reference: exact masked attention by row chunks (no Triton) with "
                        "logical-pair density; auto: kernel on a GPU or above 4096 tokens")
    parser.add_argument("--block-m", type=int, help="tile rows of the plans measured "
                        "(default: 128 on a GPU, 16 on the CPU)")
    parser.add_argument("--block-n", type=int, help="tile keys of the plans measured "
                        "(default: 64 on a GPU, 16 on the CPU)")
    parser.add_argument("--spread-queries", type=int, default=0,
                        help="estimate every candidate with this many queries spread over "
                        "the sequence besides the last 64, as serving then will (written to "
                        "the config's estimation.spread_queries) (default: 0, the last "
                        "queries only)")
    parser.add_argument("--reselect", metavar="CONFIG", help="choose again from an earlier "
                        "calibration's numbers (CONFIG and its report), under this run's "
                        "--max-error and --hard, measuring nothing; the candidates are rebuilt "
                        "on the first calibration input: give its capture (.pt), or --model "
                        "with that one video (default: none)")
    parser.add_argument("--answer-kl", type=float, default=None, metavar="KL",
                        help="then calibrate against the answer (needs --model and --videos): "
                        "starting from all heads dense, make heads sparse with the candidates "
                        "the per-head step measured, cheapest per unit of their own answer KL "
                        "first, as long as the mean last-token KL(dense || sparse) over the "
                        "videos stays within KL; OUT is that config, the per-head step's goes "
                        "to OUT.heads.json (default: off)")
    parser.add_argument("--answer-rungs", type=int, default=6,
                        help="with --answer-kl: candidates tried per head, from its density/"
                        "error frontier")
    parser.add_argument("--answer-minutes", type=float, default=None,
                        help="with --answer-kl: stop measuring after this long (heads not yet "
                        "measured stay dense; what was kept holds the bound) (default: no "
                        "limit)")
    parser.add_argument("--families", nargs="+", default=None, metavar="FAMILY",
                        choices=FAMILIES,
                        help="draw candidates only from these families, e.g. 'vertical_slash "
                        "block': the search measures only them, and every rung of the ladder, "
                        "--reselect and --answer-kl choose only among them (a head none of "
                        "them holds is hard: --hard) (one or more of: " + ", ".join(FAMILIES) +
                        "; default: all the search builds, or all the report has)")
    parser.add_argument("--dense-text", action=argparse.BooleanOptionalAction, default=None,
                        help="make the text rows (the question) of every sparse head dense, "
                        "visual rows keeping their pattern: it costs about 2 x text tokens / N "
                        "of density and moves the answer much less; the answer step measures "
                        "its candidates so (default: on for inputs of text and video; "
                        "--reselect: as the calibration was). Not with --model and --videos "
                        "alone: the served policy computes the question's rows dense over the "
                        "prefix whatever the config says, and the ladder's configs keep the "
                        "prefix's few text rows dense")
    parser.add_argument("--device", default=None, help="move the captures here, and capture "
                        "there (e.g. cuda) (default: the model's device, cuda if available)")


def run(args) -> int:
    # lazy: the CLI's edge: the search imports torch and the kernels (seconds), which
    # `mminfer calibrate --help` must not wait for
    from mminfer.offline import command
    return command.run(args)
