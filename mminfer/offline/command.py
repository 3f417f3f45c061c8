"""``mminfer calibrate``: the command (its options are ``offline/cli.py``). With a model and
videos it calibrates the served policy as the server's self-calibration does: the per-head
search (``calibrate.py``) on the videos' captured prefixes, then a ladder of its choices scored
as served against dense (``served_policy.py``) and a PASS/FAIL verdict by the server's
thresholds (``thresholds.py``); from captures alone, the search; ``--reselect`` chooses again
from a search's numbers; ``--answer-kl`` refines a search against the answer
(``answer_kl.py``)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from mminfer.engine.pipeline import Pipeline, resolve_checkpoint
from mminfer.errors import InputError
from mminfer.models.base import PrepareOptions
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import KNOWN_MODELS, HeadPatternConfig, ModelIdentity

from .answer_kl import AnswerProbe, format_rows, refine
from .calibrate import (calibrate, dense_text_head, format_report, load_captures,
                        only_families, report_candidates, reselect, with_dense_text)
from .capture import capture_qkv, load_video
from .cli import MAX_ERROR
from .served_policy import (OBJECTIVE, SearchSettings, ServedCalibration, holds, prepare,
                            run_all, summarize)
from .thresholds import check_thresholds


def run(args) -> int:
    problem = check_thresholds(args.calibration_min_agreement, args.calibration_max_kl,
                               args.calibration_max_density)
    if problem:
        raise InputError(problem)
    served = bool(args.model and args.videos) and args.answer_kl is None and not args.reselect
    bounds = list(args.max_error or [])
    if not served:
        if len(bounds) > 1:
            raise InputError("several --max-error bounds make a ladder scored on the answers: "
                             "that needs --model and --videos (and no --answer-kl or "
                             "--reselect)")
        args.max_error = bounds[0] if bounds else MAX_ERROR
    if served and args.dense_text is not None:
        raise InputError(f"--{'' if args.dense_text else 'no-'}dense-text does not apply to "
                         "the ladder scored as served (--model with --videos): the served "
                         "policy computes the question's rows dense over the prefix's cache "
                         "whatever the config says, and every rung keeps the prefix's few text "
                         "rows dense; it applies to a search from captures, --reselect and "
                         "--answer-kl")
    if args.gate_videos and not served:
        raise InputError("--gate-videos are scored with the model: give --model and --videos "
                         "(not with --answer-kl, which holds its own KL bound, or --reselect, "
                         "which measures nothing)")
    if args.reselect:
        return _run_reselect(args)
    inputs = list(args.inputs)
    pipe = None
    if args.model or args.videos:
        if not (args.model and args.videos):
            raise InputError("capturing needs both --model and --videos")
        pipe = Pipeline(model=args.model, attention="dense", device=args.device)
        cap_dir = Path(args.capture_dir or str(Path(args.out).with_suffix("")) + ".captures")
        paths = capture_qkv(pipe, args.videos, args.question, cap_dir, fps=args.fps,
                            max_frames=args.max_frames,
                            progress=lambda p, n: print(f"captured {p} ({n} tokens)"))
        # the model's captures first: the ladder's candidates are sized on the first input
        inputs = [str(p) for p in paths] + inputs
        _, model_id, revision = resolve_checkpoint(args.model)
        # the identity the adapter will check this config against when it loads it
        args.model_id = args.model_id or model_id
        args.revision = args.revision or revision or "local"
    if not inputs:
        raise InputError("give captured .pt inputs, or --model with --videos to capture them")
    caps = load_captures(inputs)
    if args.device:
        for c in caps:
            c.layers = {i: tuple(t.to(args.device) for t in qkv) for i, qkv in c.layers.items()}
    args.revision = args.revision or "main"
    q, k, _ = next(iter(caps[0].layers.values()))
    known = KNOWN_MODELS.get(args.model_id or "")
    if known is not None:
        identity = ModelIdentity(known.id, args.revision, args.layers or known.layers,
                                 known.heads, known.kv_heads, known.head_dim)
    else:
        n_layers = args.layers or max(i for c in caps for i in c.layers) + 1
        identity = ModelIdentity(args.model_id or "unknown", args.revision, n_layers,
                                 q.shape[1], k.shape[1], q.shape[3])
    if served:
        ladder = tuple(sorted(bounds or SearchSettings.for_device(pipe.adapter.device).bounds))
        args.max_error = ladder[-1]
    cfg, report = calibrate(caps, identity, budgets=args.budget, gammas=args.gamma,
                            min_density=args.min_density, max_density=args.max_density,
                            objective=args.objective, max_error=args.max_error,
                            quantile=args.error_quantile, hard=args.hard, engine=args.engine,
                            block_m=args.block_m, block_n=args.block_n,
                            spread_q=args.spread_queries, families=args.families)
    if args.dense_text is not False and len(caps[0].index.modalities()) > 1:
        cfg = with_dense_text(cfg)
    if args.answer_kl is not None:
        cfg.save(_sibling(args.out, ".heads.json"))
        Path(_sibling(args.out, ".heads.report.json")).write_text(json.dumps(report, indent=1))
        print(format_report(report, cfg.provenance))
        return _answer_step(args, cfg, report, caps[0].index)
    if served:
        print(format_report(report, cfg.provenance))
        del caps                       # the search's q/k/v; the ladder runs the model
        return _served_step(args, pipe.adapter, cfg, report, ladder)
    cfg.save(args.out)
    report_path = args.report or _sibling(args.out, ".report.json")
    Path(report_path).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} and {report_path}")
    print(format_report(report, cfg.provenance))
    print("not scored on answers (no --model): no PASS/FAIL; a server that loads it checks it "
          "on its shadow comparisons")
    return 0


def _served_inputs(ad, videos, args) -> list:
    """The videos prepared as served_policy inputs (the vision tower once each)."""
    out = []
    for v in videos:
        decoded, question, name = load_video(v, ad, args.question, fps=args.fps,
                                              max_frames=args.max_frames)
        out.append(prepare(ad, decoded, question, name, source="synthetic" if str(v).startswith(
            "synth:") else "video"))
    return out


def _served_step(args, ad, cfg, report, ladder) -> int:
    """``--model`` with ``--videos``: what the server's self-calibration does, offline. The
    search's numbers (``cfg``/``report``) re-selected at each bound of ``ladder`` (the
    question's rows dense), each config scored on the videos as served against dense, the
    loosest that holds the thresholds first; then on ``--gate-videos`` (a rung that fails
    there gives way to the next tighter one that holds on the videos). PASS writes the
    winner; FAIL writes the search's config marked uncalibrated (``--attention auto`` stays
    dense with it, as a server stays dense when its gate fails) with the rungs' numbers."""
    lo, hi = args.calibration_min_agreement, args.calibration_max_kl
    settings = replace(SearchSettings.for_device(ad.device), bounds=ladder, hard=args.hard,
                       families=tuple(args.families) if args.families else None,
                       engine=None if args.engine == "auto" else args.engine,
                       max_served_density=args.calibration_max_density)
    cal = ServedCalibration(ad, _served_inputs(ad, args.videos, args), min_agreement=lo,
                            max_kl=hi, settings=settings, log=print)
    cal.head_config, cal.head_report = cfg, report
    run_all(cal)
    held = _served_inputs(ad, args.gate_videos, args)
    gate, gate_s, failed = None, None, []
    while cal.winner is not None and held:
        rows = []
        for inp in held:
            if inp.reference is None:
                cal.reference_step(inp)()
            rows.append(cal.score(inp, cal.winner.config))
        s = summarize(rows)
        print(f"gate: per-head bound {cal.winner.bound:g} on {s['n']} held-out videos: "
              f"agreement {s['agreement']:.3f}, mean KL {s['mean_kl']:.4f}")
        if holds(s, lo, hi):
            gate_s = s
            gate = {"n": s["n"], "source": "videos",
                    **{k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()
                       if k != "n"}}
            break
        failed.append(cal.winner.bound)
        for step in cal.ladder_steps(tighter_than=cal.winner.bound):
            step()
    want = f"agreement >= {lo:g}, mean KL <= {hi:g}"
    report_path = args.report or _sibling(args.out, ".report.json")
    if cal.winner is not None:
        out = cal.config(gate=gate, made_by="mminfer calibrate (served policy)")
        out.provenance["served_policy"]["verdict"] = "pass"
        _, rows = reselect(cfg, report, cal.head_config_index, max_error=cal.winner.bound,
                           hard=settings.hard, families=settings.families)
        out.save(args.out)
        Path(report_path).write_text(json.dumps(rows, indent=1))
        c = cal.winner.summary()
        where = (f"and on {gate_s['n']} held-out videos (agreement {gate_s['agreement']:.3f}, "
                 f"mean KL {gate_s['mean_kl']:.4f})" if gate else
                 "(no --gate-videos: not checked on videos it was not calibrated on)")
        print(f"PASS ({want}): per-head bound {cal.winner.bound:g} holds on {c['n']} videos "
              f"(agreement {c['agreement']:.3f}, mean KL {c['mean_kl']:.4f}, density "
              f"{_fmt_density(c['mean_density'])}) {where}; wrote {args.out} and {report_path}")
        return 0
    why = (cal.why_none() if cal.too_dense is not None else
           f"no rung of the ladder (per-head bounds {' '.join(f'{b:g}' for b in ladder)}) "
           f"holds {want} on the {len(cal.frozen or [])} videos" if not failed else
           f"the rungs that held on the videos ({' '.join(f'{b:g}' for b in failed)}) failed "
           f"on the held-out videos and no tighter one holds")
    cfg.uncalibrated = True
    cfg.provenance = dict(cfg.provenance, served_policy={
        "objective": OBJECTIVE, "verdict": "fail", "why": why, "min_agreement": lo,
        "max_kl": hi, "max_density": settings.max_served_density,
        "rungs": [{"bound": r.bound, **{k: round(v, 6) if isinstance(v, float) else v
                                        for k, v in r.summary().items()}}
                  for r in cal.rungs if r.rows],
        "gates_failed": failed})
    cfg.save(args.out)
    Path(report_path).write_text(json.dumps(report, indent=1))
    print(f"FAIL: {why}; wrote {args.out} marked uncalibrated (--attention auto stays dense "
          f"with it) and {report_path} (--reselect chooses again from it)")
    return 1


def _fmt_density(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _sibling(out, suffix: str) -> str:
    return str(Path(out).with_suffix("")) + suffix


def _answer_step(args, cfg, report, index) -> int:
    """``--answer-kl``: the per-head calibration ``cfg``/``report`` refined against the
    answer on ``--videos`` (``answer_kl.py``); writes the refined config as OUT."""
    if not (args.model and args.videos):
        raise InputError("--answer-kl runs the model on the calibration videos: give --model "
                         "and --videos")
    pipe = Pipeline(model=args.model, attention="dense", device=args.device)
    ad = pipe.adapter
    cuda = ad.device.type == "cuda"
    prov = cfg.provenance
    # on a CPU the reference engine: exact like the kernel, without the interpreter's cost
    engine = args.engine if args.engine != "auto" else ("kernel" if cuda else "reference")
    probe = AnswerProbe(ad, engine=engine, block=(prov["block_m"], prov["block_n"]))
    inputs = []
    for v in args.videos:
        decoded, question, name = load_video(v, ad, args.question, fps=args.fps,
                                              max_frames=args.max_frames)
        inputs.append(probe.prepare(name, decoded, question))
        print(f"answer step: prepared {name} ({inputs[-1].prep.total_tokens} tokens)")
    deadline = (time.monotonic() + 60 * args.answer_minutes) if args.answer_minutes else None
    cands = report_candidates(cfg, index)
    if cfg.provenance.get("dense_text"):
        cands = {lab: dense_text_head(hp) for lab, hp in cands.items()}
    new, rows = refine(probe, inputs, cfg, only_families(report, args.families), cands,
                       target=args.answer_kl, max_rungs=args.answer_rungs, deadline=deadline,
                       log=print)
    new.save(args.out)
    report_path = args.report or _sibling(args.out, ".report.json")
    # the per-head numbers the answer step chose from stay with it (for --reselect)
    Path(report_path).write_text(json.dumps(report, indent=1))
    Path(_sibling(args.out, ".answer.json")).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}, {report_path} and {_sibling(args.out, '.answer.json')}")
    print(format_rows(rows, new.provenance))
    return 0


def _run_reselect(args) -> int:
    src = Path(args.reselect)
    if not src.is_file():
        raise InputError(f"--reselect {src}: no such config file")
    cfg = HeadPatternConfig.load(src)
    rep_path = Path(str(src.with_suffix("")) + ".report.json")
    if not rep_path.is_file():
        raise InputError(f"--reselect {src}: its report {rep_path} is missing (calibrate "
                         f"writes it next to the config)")
    report = json.loads(rep_path.read_text())
    if args.inputs:
        index = load_captures(args.inputs[:1])[0].index
    elif args.model and args.videos:
        index = _first_index(args.model, args.videos[0], args)
    else:
        raise InputError("--reselect needs the first calibration input: its capture (.pt), "
                         "or --model with that video (--videos)")
    new, rows = reselect(cfg, report, index, max_error=args.max_error, hard=args.hard,
                         families=args.families)
    # as the calibration did unless told otherwise
    want = args.dense_text if args.dense_text is not None else cfg.provenance.get("dense_text")
    if want and len(index.modalities()) > 1:
        new = with_dense_text(new)
    elif new.provenance.get("dense_text"):
        new.provenance = {k: v for k, v in new.provenance.items() if k != "dense_text"}
    if args.answer_kl is not None:
        print(format_report(rows, new.provenance))
        return _answer_step(args, new, rows, index)
    new.save(args.out)
    report_path = args.report or str(Path(args.out).with_suffix("")) + ".report.json"
    Path(report_path).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out} and {report_path} (re-selected from {src}, nothing measured; "
          f"mean density over heads {new.provenance['mean_density']:.4f})")
    print(format_report(rows, new.provenance))
    return 0


def _first_index(model, video, args) -> ModalityIndex:
    """The ModalityIndex of one calibration video's prefix, as the capture step built it
    (no prefill: only the adapter's preprocessing)."""
    ad = Pipeline(model=model, attention="dense", device="cpu").adapter
    decoded, question, _ = load_video(video, ad, args.question, fps=args.fps,
                                      max_frames=args.max_frames)
    return ad.prepare(decoded, question, PrepareOptions()).prefix_index
