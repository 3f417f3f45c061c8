"""Offline per-head search: which pattern each (layer, head) gets, from captured q/k/v.

For every captured layer and every budget (a target density: the kernel's physical tiles as
a fraction of the causal triangle, at the calibration length), each candidate head pattern
is sized to that budget, planned online exactly as at serving time (``estimate_layer`` ->
plan) and run for all heads at once. Per head it gets:

* error: relative L2 of the attention output against dense (``||o - o_dense|| / ||o_dense||``);
* mass: the share of the dense softmax mass its pairs capture, averaged over rows, read
  from the log-sum-exps (``exp(lse_sparse - lse_dense)``), so no mask is ever formed;
* density: physical tiles / causal triangle, counted per head by the kernel's count mode
  (the reference engine, used on the CPU for small N, reports logical pairs instead).

Choice: per budget, the candidate with the lowest objective (error, or 1 - mass) among
those whose density is within ``1.5 x`` the budget; per head, the smallest budget whose
winner's objective is at most ``max_error`` (else the largest budget's winner). So easy
heads end up cheap and hard heads get the larger budgets. The dense reference is computed
in query chunks (never N x N), so calibration works at any length the device holds q/k/v for.

Input: ``.pt`` files (or directories of them), one per calibration input::

    {"index": ModalityIndex.to_dict(), "layers": {i: {"q": [B,Hq,N,D], "k", "v": [B,Hkv,N,D]}},
     "name": "optional", "scale": optional float}
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from mminfer.errors import ConfigError, InputError
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (KNOWN_MODELS, HeadPattern, HeadPatternConfig, ModelIdentity, a_shape,
                       block, default_config, dense, grid, provenance, vertical_slash)

DENSITY_SLACK = 1.5     # a candidate may exceed its budget by this factor and still compete
_REF_ELEMS = {"cuda": 1 << 28, "cpu": 1 << 25}   # fp32 scores per dense-reference chunk


@dataclass
class Capture:
    name: str
    index: ModalityIndex
    layers: dict          # layer -> (q, k, v)
    scale: float | None = None

    @property
    def n(self) -> int:
        return self.index.n


# ---------------------------------------------------------------------- inputs
def load_captures(source) -> list:
    """``source``: a path (file or directory of ``.pt`` files), a list of paths, a capture
    dict, or a list of those."""
    items = source if isinstance(source, (list, tuple)) else [source]
    out = []
    for item in items:
        if isinstance(item, Capture):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(_capture(item, f"input{len(out)}"))
        else:
            p = Path(item)
            files = sorted(p.glob("*.pt")) if p.is_dir() else [p]
            if not files or not all(f.is_file() for f in files):
                raise InputError(f"calibration input {p} has no .pt files")
            for f in files:
                out.append(_capture(torch.load(f, map_location="cpu", weights_only=True),
                                    f.stem))
    if not out:
        raise InputError("no calibration inputs")
    return out


def _capture(d, default_name) -> Capture:
    for key in ("index", "layers"):
        if key not in d:
            raise InputError(f"calibration input {default_name} is missing {key!r}")
    index = ModalityIndex.from_dict(d["index"])
    layers = {}
    for i, lay in d["layers"].items():
        q, k, v = lay["q"], lay["k"], lay["v"]
        if q.dim() != 4 or q.shape[2] != index.n or k.shape != v.shape or k.shape[2] != index.n:
            raise InputError(f"calibration input {default_name} layer {i}: q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit "
                             f"N = {index.n}")
        layers[int(i)] = (q, k, v)
    return Capture(d.get("name", default_name), index, layers, d.get("scale"))


# ---------------------------------------------------------------------- references
def dense_reference(q, k, v, scale=None, rows: int | None = None):
    """Causal attention in fp32, query chunk by query chunk: ``(out [B,Hq,N,D], lse [B,Hq,N])``."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    budget = _REF_ELEMS["cuda" if q.is_cuda else "cpu"]
    rows = rows or max(1, budget // max(1, B * Hq * N))
    kf, vf = k.float(), v.float()
    out = torch.empty(B, Hq, N, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    for a in range(0, N, rows):
        b = min(a + rows, N)
        qs = q[:, :, a:b].float().reshape(B, Hkv, g * (b - a), D)
        s = torch.matmul(qs, kf[:, :, :b].transpose(-1, -2)).view(B, Hq, b - a, b) * scale
        i = torch.arange(a, b, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(b, device=q.device)[None, :] > i, float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - l[..., None]).view(B, Hkv, g * (b - a), b)
        out[:, :, a:b] = torch.matmul(p, vf[:, :, :b]).view(B, Hq, b - a, D)
        lse[:, :, a:b] = l
    return out, lse


def head_density(plan) -> tuple:
    """Per head ``(logical [H], physical [H])`` fractions of the causal triangle, from the
    kernel's count mode."""
    d = plan.density()
    return d["logical_per_head"], d["physical_per_head"]


def evaluate(q, k, v, index, heads: Sequence[HeadPattern], ref, *, engine="kernel",
             block_m=16, block_n=16, scale=None) -> dict:
    """Per-head error, mass and density of one head-pattern assignment on one input."""
    from mminfer.sparse.estimate import estimate_layer
    from mminfer.kernels import masked_attention, sparse_attention
    ref_out, ref_lse = ref
    est = estimate_layer(q, k, index, heads, block_m=block_m, block_n=block_n, scale=scale)
    plan = est.build_plan(q.device)
    if engine == "reference":
        m = plan.masks()
        out, lse = masked_attention(q, k, v, m.to(q.device), scale=scale)
        n = q.shape[2]
        dens = (m.double().sum((0, 2, 3)) / (q.shape[0] * n * (n + 1) / 2)).cpu()
        logical = physical = dens
    else:
        out, lse = sparse_attention(q, k, v, plan, scale=scale, return_lse=True)
        logical, physical = head_density(plan)
    diff = (out.float() - ref_out).pow(2).sum((0, 2, 3))
    error = (diff / ref_out.pow(2).sum((0, 2, 3)).clamp(min=1e-30)).sqrt().cpu()
    mass = torch.exp(lse.float() - ref_lse).clamp(max=1.0).mean((0, 2)).cpu()
    return {"error": error, "mass": mass, "density": physical, "logical": logical}


# ---------------------------------------------------------------------- candidates
def candidate_patterns(index: ModalityIndex, n: int, budget: float, *, block_m: int = 128,
                       block_n: int = 64) -> dict:
    """Candidate head patterns sized to ``budget`` (physical density at length ``n``) by a
    simple cost model: a row visits about ``K = budget * (n + 1) / 2`` keys; a window costs
    its width + block_m / 2, a vertical one key, a slash block_m + block_n keys (slash tiles
    are row-block wide), a key block block_n keys, grid lines ``visual / stride`` keys (rows
    and columns together, half for columns only). The measured density decides in the end."""
    K = max(budget * (n + 1) / 2, 4 * block_m)
    half = block_m // 2
    sink = int(min(64, K / 16))

    def vs(keys):
        w = int(keys / 4)
        return vertical_slash(n_vertical=max(int(keys / 2) - sink, 1),
                              n_slash=max(int(keys / 4 // (block_m + block_n)), 1),
                              window=w, sink=sink)

    cands = {
        "a_shape": HeadPattern.single(a_shape(sink=sink, window=max(int(K - sink - half), 0))),
        "vertical_slash": HeadPattern.single(vs(K)),
        "block": HeadPattern.single(block(top_k=max(int((K - block_m - half) // block_n), 1),
                                          window=block_m)),
    }
    vis = index.visual_spans()
    if vis:
        stride = vis[0].frame_stride
        n_vis = sum(s.length for s in vis)
        lines = n_vis / stride

        def grid_at(keys, how):
            cost = lines if how == "both" else lines / 2
            return grid(lines=how, sink=sink, window=max(int(keys - cost - sink - half), block_m),
                        fallback=vs(keys))

        cands["grid"] = HeadPattern.single(grid_at(K, "both"))
        cands["grid_cols"] = HeadPattern.single(grid_at(K, "cols"))
        if len(index.modalities()) > 1:
            g = grid_at(K, "both")
            cands["q:grid|vs"] = HeadPattern("q", {"video": g, "image": g, "text": vs(K)})
            cands["k:vs"] = HeadPattern("k", {"all": vs(K)})
            # 2D (per the MMInference paper): visual->visual grid, text->visual and
            # text->text vertical_slash, visual->text a local band over the few text keys.
            pairs = {}
            for qm in ("video", "image"):
                for km in ("video", "image"):
                    pairs[f"{qm}->{km}"] = grid_at(K, "both") if qm == km else vs(K)
                pairs[f"{qm}->text"] = a_shape(sink=sink, window=int(K / 4))
                pairs[f"text->{qm}"] = vs(K)
            pairs["text->text"] = vs(K)
            cands["2d"] = HeadPattern("2d", pairs)
    return cands


def resize_config(base: HeadPatternConfig, index: ModalityIndex, n: int, density: float, *,
                  block_m: int = 128, block_n: int = 64) -> HeadPatternConfig:
    """``base`` with every head's pattern (kind, boundary and regions kept; a grid keeps its
    lines) replaced by the candidate of that kind sized to ``density`` at length ``n``: the
    density sweep of ``benchmarks/quality.py`` and the sparse check of the embedded model."""
    c = candidate_patterns(index, n, density, block_m=block_m, block_n=block_n)

    def resize(p):
        if p.kind == "dense":
            return dense()
        if p.kind == "grid":
            key = "grid_cols" if p.lines == "cols" else "grid"
            if key not in c:             # no visual span: what a grid falls back to
                return c["vertical_slash"].patterns["all"]
            return c[key].patterns["all"]
        return c[p.kind].patterns["all"]

    memo = {}

    def head(hp):
        if id(hp) not in memo:
            memo[id(hp)] = HeadPattern(hp.boundary, {r: resize(p) for r, p in hp.patterns.items()})
        return memo[id(hp)]

    return HeadPatternConfig(base.identity, [[head(hp) for hp in row] for row in base.layers],
                             uncalibrated=base.uncalibrated,
                             provenance={"made_by": "mminfer.offline.calibrate.resize_config",
                                         "density": density, "n": n})


# ---------------------------------------------------------------------- search
def calibrate(qk_source, identity: ModelIdentity, *, budgets: Sequence[float] = (0.1, 0.2),
              candidates: Mapping | Callable | None = None, objective: str = "output_error",
              max_error: float = 0.05, engine: str = "auto", block_m: int | None = None,
              block_n: int | None = None, progress: bool = True):
    """Search every captured layer; returns ``(HeadPatternConfig, report)``. ``candidates``:
    a mapping name -> HeadPattern (used at every budget) or a callable
    ``(index, n, budget, block_m=, block_n=) -> mapping`` (default ``candidate_patterns``).
    Layers without captures keep ``default_config``'s patterns (the file then stays marked
    uncalibrated)."""
    if objective not in ("output_error", "mass"):
        raise ConfigError(f"objective {objective!r} is not one of output_error, mass")
    budgets = sorted(float(b) for b in budgets)
    if not budgets or budgets[0] <= 0:
        raise ConfigError("budgets must be densities > 0")
    caps = load_captures(qk_source)
    layer_ids = sorted({i for c in caps for i in c.layers})
    for c in caps:
        for i, (q, k, _) in c.layers.items():
            _check_identity(identity, q, k, i, c.name)
            if i >= identity.layers:
                raise ConfigError(f"input {c.name} has layer {i} but model.layers = "
                                  f"{identity.layers}")
    dev = next(iter(caps[0].layers.values()))[0].device
    cuda = dev.type == "cuda"
    block_m = block_m or (128 if cuda else 16)
    block_n = block_n or (64 if cuda else 16)
    if engine == "auto":
        engine = "kernel" if cuda or max(c.n for c in caps) > 4096 else "reference"
    n_ref = sorted(c.n for c in caps)[len(caps) // 2]
    make = candidates if callable(candidates) else (
        (lambda *a, **kw: dict(candidates)) if candidates is not None else candidate_patterns)
    cands = {b: make(caps[0].index, n_ref, b, block_m=block_m, block_n=block_n)
             for b in budgets}

    total = sum(len(c.layers) for c in caps) * sum(len(v) for v in cands.values())
    bar = _progress(total, progress)
    H = identity.heads
    # metrics[layer][(budget, name)] -> {"error", "mass", "density"} summed over inputs
    metrics: dict = {i: {} for i in layer_ids}
    counts: dict = {i: 0 for i in layer_ids}
    for cap in caps:
        for i, (q, k, v) in sorted(cap.layers.items()):
            ref = dense_reference(q, k, v, cap.scale)
            counts[i] += 1
            for b in budgets:
                for name, hp in cands[b].items():
                    r = evaluate(q, k, v, cap.index, [hp] * H, ref, engine=engine,
                                 block_m=block_m, block_n=block_n, scale=cap.scale)
                    acc = metrics[i].setdefault((b, name), {key: torch.zeros(H) for key in r})
                    for key, val in r.items():
                        acc[key] += val.float()
                    bar.update(1)
    bar.close()

    base = default_config(identity)
    layers = [list(row) for row in base.layers]
    report = []
    for i in layer_ids:
        m = {key: {s: v / counts[i] for s, v in val.items()} for key, val in metrics[i].items()}
        score = {key: (val["error"] if objective == "output_error" else 1 - val["mass"])
                 for key, val in m.items()}
        for h in range(H):
            chosen = None
            for b in budgets:
                fits = [key for key in m if key[0] == b and
                        m[key]["density"][h] <= DENSITY_SLACK * b]
                if not fits:
                    continue
                best = min(fits, key=lambda key: float(score[key][h]))
                chosen = best
                if float(score[best][h]) <= max_error:
                    break
            if chosen is None:   # nothing within budget: the cheapest candidate measured
                chosen = min(m, key=lambda key: float(m[key]["density"][h]))
            layers[i][h] = cands[chosen[0]][chosen[1]]
            report.append({
                "layer": i, "head": h, "pattern": chosen[1], "budget": chosen[0],
                "density": _r(m[chosen]["density"][h]), "mass": _r(m[chosen]["mass"][h]),
                "error": _r(m[chosen]["error"][h]),
                "candidates": {f"{name}@{b:g}": {"error": _r(val["error"][h]),
                                                 "mass": _r(val["mass"][h]),
                                                 "density": _r(val["density"][h])}
                               for (b, name), val in m.items()},
            })
    if objective == "output_error":
        report.sort(key=lambda r: -r["error"])
    else:
        report.sort(key=lambda r: r["mass"])

    cfg = HeadPatternConfig(identity, layers, uncalibrated=len(layer_ids) < identity.layers,
                            provenance=provenance(
                                made_by="mminfer calibrate",
                                calibration_inputs=[{"name": c.name, "tokens": c.n,
                                                     "modalities": {m_: c.index.count(m_) for m_
                                                                    in c.index.modalities()}}
                                                    for c in caps],
                                objective=objective, budgets=budgets, max_error=max_error,
                                density="physical tiles / causal triangle" if
                                engine == "kernel" else "logical pairs / causal triangle",
                                engine=engine, block_m=block_m, block_n=block_n,
                                candidates=sorted({n for v in cands.values() for n in v}),
                                layers_calibrated=layer_ids, device=_device_name(dev)))
    return cfg, report


def _check_identity(identity, q, k, layer, name):
    got = {"heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[3]}
    for field_, value in got.items():
        if getattr(identity, field_) != value:
            raise ConfigError(f"model.{field_} = {getattr(identity, field_)} but input {name} "
                              f"layer {layer} has {value}")


def _r(x) -> float:
    return round(float(x), 5)


def _device_name(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"


def _progress(total, enabled):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc="calibrate", unit="run", disable=not enabled)
    except ImportError:      # tqdm is a dependency; keep calibration working without it
        class _Null:
            def update(self, n=1): pass
            def close(self): pass
        return _Null()


# ---------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*",
                        help="captured q/k/v: .pt files or directories of them")
    parser.add_argument("--model", help="capture q/k/v from this checkpoint first "
                        "(with --videos): a prefill per video, dense")
    parser.add_argument("--videos", nargs="+", default=[],
                        help="calibration videos: files, or synthetic sources "
                        "synth:TASK:FRAMES:SEED rendered in-process (no decoder needed)")
    parser.add_argument("--question", default="What happens in the video?",
                        help="question placed after each calibration video")
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--max-frames", type=int, default=768)
    parser.add_argument("--capture-dir", help="where captured .pt files go "
                        "(default: a folder next to --out)")
    parser.add_argument("--out", required=True, help="head-pattern config to write (JSON)")
    parser.add_argument("--report", help="per-head report (JSON; default: OUT.report.json)")
    parser.add_argument("--model-id", help="model id (known ids fill in the shape; others "
                        "take it from the captures)")
    parser.add_argument("--revision", help="model revision (default: the checkpoint's own, "
                        "'local' for a plain directory, else 'main')")
    parser.add_argument("--layers", type=int, help="number of layers of the model "
                        "(default: known model, else highest captured layer + 1)")
    parser.add_argument("--budget", type=float, nargs="+", default=[0.1, 0.2],
                        help="target densities (physical tiles / causal triangle at the "
                        "calibration length), smallest tried first")
    parser.add_argument("--objective", choices=["output_error", "mass"], default="output_error")
    parser.add_argument("--max-error", type=float, default=0.05,
                        help="a head takes the smallest budget whose best objective (error, "
                        "or 1 - mass) is at most this")
    parser.add_argument("--engine", choices=["auto", "kernel", "reference"], default="auto")
    parser.add_argument("--block-m", type=int)
    parser.add_argument("--block-n", type=int)
    parser.add_argument("--device", default=None, help="move the captures here (e.g. cuda)")


def run(args) -> int:
    inputs = list(args.inputs)
    if args.model or args.videos:
        if not (args.model and args.videos):
            raise InputError("capturing needs both --model and --videos")
        from .capture import capture_qkv
        cap_dir = Path(args.capture_dir or str(Path(args.out).with_suffix("")) + ".captures")
        paths = capture_qkv(args.model, args.videos, args.question, cap_dir, fps=args.fps,
                            max_frames=args.max_frames, device=args.device,
                            progress=lambda p, n: print(f"captured {p} ({n} tokens)"))
        inputs += [str(p) for p in paths]
        from mminfer.engine.pipeline import resolve_checkpoint
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
    cfg, report = calibrate(caps, identity, budgets=args.budget, objective=args.objective,
                            max_error=args.max_error, engine=args.engine,
                            block_m=args.block_m, block_n=args.block_n)
    cfg.save(args.out)
    report_path = args.report or str(Path(args.out).with_suffix("")) + ".report.json"
    Path(report_path).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} and {report_path}")
    print(f"{'layer':>5} {'head':>4}  {'pattern':<16} {'budget':>6} {'density':>8} "
          f"{'mass':>6} {'error':>7}")
    for r in report[:10]:
        print(f"{r['layer']:>5} {r['head']:>4}  {r['pattern']:<16} {r['budget']:>6g} "
              f"{r['density']:>8.4f} {r['mass']:>6.3f} {r['error']:>7.4f}")
    return 0

