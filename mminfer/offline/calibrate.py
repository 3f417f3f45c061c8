"""Offline per-head search: which pattern, and which budget, each (layer, head) gets, from
captured q/k/v of several inputs (videos of several lengths and tasks).

Candidates: for every budget (a target density: the kernel's physical tiles as a fraction of
the causal triangle, at the median calibration length) the fixed-count patterns sized to it,
and for every gamma the mass-budget patterns (``sparse/mass.py``: lines or key blocks until
the estimated attention mass covered reaches gamma, within a density floor and ceiling).
Each is planned online exactly as at serving time (``estimate_layer`` -> plan) and run for
all heads at once, on every input. Per head and input it gets:

* error: relative L2 of the attention output against dense (``||o - o_dense|| / ||o_dense||``);
* mass: the share of the dense softmax mass its pairs capture, averaged over rows, read
  from the log-sum-exps (``exp(lse_sparse - lse_dense)``), so no mask is ever formed;
* density: physical tiles / causal triangle, counted per head by the kernel's count mode
  (the reference engine, used on the CPU for small N, reports logical pairs instead).

Choice per head: a candidate's objective (error, or 1 - mass) over the inputs is its
``quantile`` across them (default 1.0: the worst input), its cost its mean density over the
inputs; the head takes the cheapest candidate whose objective is at most ``max_error``. A head
no candidate holds (or only at a dense pass's cost or more) is hard: dense (default), or its
lowest-objective candidate. So easy heads
end up cheap, spread heads get a high gamma, and the report names the hard ones. The dense
reference is computed in query chunks (never N x N), so calibration works at any length the
device holds q/k/v for.

Input: ``.pt`` files (or directories of them), one per calibration input::

    {"index": ModalityIndex.to_dict(), "layers": {i: {"q": [B,Hq,N,D], "k", "v": [B,Hkv,N,D]}},
     "name": "optional", "scale": optional float}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from tqdm import tqdm

from mminfer.errors import Cancelled, ConfigError, InputError
from mminfer.kernels import sparse_attention
from mminfer.kernels.reference import plan_attention
from mminfer.sparse.estimate import estimate_layer
from mminfer.sparse.modality import ModalityIndex
from mminfer.sparse.patterns import (QUERY_MODALITIES, HeadPattern,
                                     HeadPatternConfig, ModelIdentity, a_shape, block,
                                     default_config, dense,
                                     grid, provenance, vertical_slash)

from .cli import FAMILIES, HARD

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
             block_m=16, block_n=16, scale=None, proxy="auto", spread_q: int = 0) -> dict:
    """Per-head error, mass and density of one head-pattern assignment on one input
    (``proxy`` and ``spread_q``: the online estimator's, see ``estimate_layer``)."""
    ref_out, ref_lse = ref
    est = estimate_layer(q, k, index, heads, block_m=block_m, block_n=block_n, scale=scale,
                         proxy=proxy, spread_q=spread_q)
    plan = est.build_plan(q.device)
    if engine == "reference":
        # exact masked attention a chunk of rows at a time: any N, no N x N mask
        out, lse = plan_attention(q, k, v, plan, scale=scale, return_lse=True)
    else:
        out, lse = sparse_attention(q, k, v, plan, scale=scale, return_lse=True)
    logical, physical = head_density(plan)
    diff = (out.float() - ref_out).pow(2).sum((0, 2, 3))
    error = (diff / ref_out.pow(2).sum((0, 2, 3)).clamp(min=1e-30)).sqrt().cpu()
    mass = torch.exp(lse.float() - ref_lse).clamp(max=1.0).mean((0, 2)).cpu()
    # the reference engine's density is its logical pairs (it visits no tiles)
    return {"error": error, "mass": mass, "logical": logical, "physical": physical,
            "density": logical if engine == "reference" else physical}


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
    lines, a block its stride) replaced by the candidate of that kind sized to ``density`` at
    length ``n``: the density sweep of ``benchmarks/quality.py`` and the sparse check of the
    embedded model."""
    c = candidate_patterns(index, n, density, block_m=block_m, block_n=block_n)

    def resize(p):
        if p.kind == "dense":
            return dense()
        if p.kind == "grid":
            key = "grid_cols" if p.lines == "cols" else "grid"
            if key not in c:             # no visual span: what a grid falls back to
                return c["vertical_slash"].patterns["all"]
            return c[key].patterns["all"]
        if p.kind == "block" and (p.stride or p.sink):   # keeps its ranking and sink
            b = c["block"].patterns["all"]
            # A sink sized for long videos (64 keys) would be a large share of a short one:
            # resized, it is the first key block, and it comes out of the top-k's budget.
            sink = min(p.sink, block_n) if p.sink else None
            top_k = max(1, b.top_k - 1) if sink else b.top_k
            return block(top_k=top_k, window=b.window, stride=p.stride, sink=sink)
        return c[p.kind].patterns["all"]

    memo = {}

    def head(hp):
        if id(hp) not in memo:
            memo[id(hp)] = HeadPattern(hp.boundary, {r: resize(p) for r, p in hp.patterns.items()})
        return memo[id(hp)]

    return HeadPatternConfig(base.identity, [[head(hp) for hp in row] for row in base.layers],
                             uncalibrated=base.uncalibrated,
                             provenance={"made_by": "mminfer.offline.calibrate.resize_config",
                                         "density": density, "n": n},
                             estimation=dict(base.estimation))


# ---------------------------------------------------------------------- search
def mass_candidate_patterns(index: ModalityIndex, n: int, gamma: float, *,
                            min_density: float = 0.0, max_density: float = 0.3,
                            block_m: int = 128, block_n: int = 64) -> dict:
    """Candidate head patterns with a mass budget ``gamma`` (``sparse/mass.py``): their
    density follows each input's attention, so one candidate serves every length. Fixed
    parts are small: a window of ``min(256, max(block_m, n / 32))`` tokens and up to 64 sink
    columns; the mass rule adds the rest up to ``max_density``."""
    window = int(min(256, max(block_m, n // 32)))
    sink = int(min(64, max(1, n // 64)))
    bounds = dict(gamma=gamma, min_density=min_density, max_density=max_density)
    vs = vertical_slash(window=window, sink=sink, **bounds)
    cands = {"vertical_slash": HeadPattern.single(vs),
             "block": HeadPattern.single(block(window=block_m, **bounds)),
             # key blocks per row block by antidiagonal scores: content-driven columns that
             # differ from row block to row block (the landmarks of lab/NOTES.md, "Sharper
             # attention by training")
             "block_ad": HeadPattern.single(block(window=block_m, stride=AD_STRIDE, **bounds))}
    if index.visual_spans() and len(index.modalities()) > 1:
        # Each query modality's verticals and slashes from its own last queries; video rows
        # also with grid lines when the lift says there is a grid (else the same mass rule).
        cands["q:vs"] = HeadPattern("q", {"video": vs, "image": vs, "text": vs})
        g = grid(lines="both", sink=sink, window=window, fallback=vs)
        cands["q:grid|vs"] = HeadPattern("q", {"video": g, "image": g, "text": vs})
    return cands


AD_STRIDE = 16            # block_ad's antidiagonal stride: 1/16 of QK^T to rank key blocks
DENSE = ("dense", None, None)        # the key of the dense fallback among the candidates


def _candidate_set(make, index, n_ref, budgets, gammas, min_density, max_density,
                   block_m, block_n) -> dict:
    """(family, budget, gamma) -> HeadPattern: every fixed-budget candidate of ``make`` and
    every mass-budget one, sized at ``n_ref`` on ``index``."""
    cands: dict = {}
    for b in budgets:
        for name, hp in make(index, n_ref, b, block_m=block_m, block_n=block_n).items():
            cands[(name, b, None)] = hp
    for g in gammas:
        for name, hp in mass_candidate_patterns(index, n_ref, g, min_density=min_density,
                                                max_density=max_density, block_m=block_m,
                                                block_n=block_n).items():
            cands[(name, None, g)] = hp
    return cands


def _of_families(cands: dict, families: Sequence[str]) -> dict:
    """The candidates of ``families``; an unknown family, or none of them among ``cands``
    (they depend on the budgets, the gammas and the inputs' modalities), is an error."""
    built = sorted({key[0] for key in cands})
    unknown = sorted(set(families) - set(FAMILIES) - set(built))
    if unknown:
        raise ConfigError(f"unknown candidate families {unknown} (known: "
                          f"{', '.join(FAMILIES)})")
    out = {key: hp for key, hp in cands.items() if key[0] in families}
    if not out:
        raise ConfigError(f"no candidate of families {sorted(families)} with these budgets, "
                          f"gammas and inputs (they give {', '.join(built)}; a_shape, grid, "
                          f"grid_cols, k:vs and 2d are fixed-budget candidates, block_ad and "
                          f"q:vs mass-budget ones)")
    return out


def _choose(score: dict, density: dict, max_error: float, hard: str) -> tuple:
    """One head's choice among candidates (key -> score, key -> mean density):
    ``(key, is_hard)``, the key being ``DENSE`` for the dense fallback."""
    fits = [key for key in score if score[key] <= max_error]
    if fits:
        chosen = min(fits, key=lambda key: (density[key], score[key]))
        # Dense costs 1 (its own tiles); at short lengths a sparse plan can visit more tiles
        # than that, and then dense is the cheaper way to hold the bound.
        if hard == "dense" and density[chosen] >= 1.0:
            chosen = DENSE
    elif hard == "best":
        chosen = min(score, key=lambda key: (score[key], density[key]))
    else:
        chosen = DENSE
    return chosen, chosen == DENSE or not fits


def _sort_report(report: list, objective: str) -> None:
    """Hard heads first, then the worst objective first, then the densest."""
    def score(r):
        return r["error"] if objective == "output_error" else 1 - r["mass"]
    report.sort(key=lambda r: (not r["hard"], -score(r), -r["density"]))


def reselect(cfg: HeadPatternConfig, report: list, index: ModalityIndex, *, max_error: float,
             hard: str = "dense", families: Sequence[str] | None = None):
    """The choice of ``calibrate`` made again under another bound, from the numbers its
    report kept (every candidate's error, mass and mean density per head), without measuring
    anything: a calibration of a large model is expensive, and the bound is best set after
    seeing what each head can hold. ``index`` is the first calibration input's (the
    candidates are sized on it); ``cfg`` gives the identity and the candidate set.
    ``families``: choose only among these candidate families (e.g. ``vertical_slash block``).
    Returns ``(HeadPatternConfig, report)``; heads whose choice changed have no per-input
    numbers (nothing was re-measured)."""
    if hard not in HARD:
        raise ConfigError(f"hard {hard!r} is not one of {', '.join(HARD)}")
    cands = _rebuilt_candidates(cfg, index)
    report = only_families(report, families)
    by_label = {_label(key): key for key in cands}
    prov = cfg.provenance
    objective = prov["objective"]
    layers = [list(row) for row in cfg.layers]
    rows = []
    for r in report:
        got = r["candidates"]
        unknown = sorted(set(got) - set(by_label))
        if unknown:
            raise ConfigError(f"report head L{r['layer']}H{r['head']} has candidates "
                              f"{unknown} this mminfer does not build")
        score = {by_label[lab]: (m["error"] if objective == "output_error" else 1 - m["mass"])
                 for lab, m in got.items()}
        density = {by_label[lab]: m["density"] for lab, m in got.items()}
        chosen, is_hard = _choose(score, density, max_error, hard)
        row = dict(r, pattern=chosen[0], budget=chosen[1], gamma=chosen[2], hard=is_hard)
        if chosen == DENSE:
            layers[r["layer"]][r["head"]] = HeadPattern.single(dense())
            row.update(error=0.0, mass=1.0, density=1.0,
                       per_input={n_: {"error": 0.0, "mass": 1.0, "density": 1.0}
                                  for n_ in r.get("per_input", {})})
        else:
            layers[r["layer"]][r["head"]] = cands[chosen]
            m = got[_label(chosen)]
            same = (r["pattern"], r["budget"], r["gamma"]) == chosen
            row.update(error=m["error"], mass=m["mass"], density=m["density"],
                       per_input=r.get("per_input", {}) if same else {})
        rows.append(row)
    _sort_report(rows, objective)
    new_prov = dict(prov, made_by="mminfer calibrate --reselect", max_error=max_error,
                    hard=hard, reselected_from={"max_error": prov.get("max_error"),
                                                "hard": prov.get("hard"),
                                                "date": prov.get("date")},
                    hard_heads=sorted([r["layer"], r["head"]] for r in rows if r["hard"]),
                    mean_density=_r(sum(r["density"] for r in rows) / max(1, len(rows))),
                    density_per_input={}, **({"families": sorted(families)} if families else {}))
    return HeadPatternConfig(cfg.identity, layers, uncalibrated=cfg.uncalibrated,
                             provenance=new_prov, estimation=dict(cfg.estimation)), rows


def with_dense_text(cfg: HeadPatternConfig) -> HeadPatternConfig:
    """``cfg`` with the text rows of every sparse head dense (``dense_text_head``)."""
    memo: dict = {}

    def head(hp):
        if id(hp) not in memo:
            memo[id(hp)] = dense_text_head(hp)
        return memo[id(hp)]

    return HeadPatternConfig(cfg.identity, [[head(hp) for hp in row] for row in cfg.layers],
                             uncalibrated=cfg.uncalibrated,
                             provenance=dict(cfg.provenance or {}, dense_text=True),
                             estimation=dict(cfg.estimation))


def dense_text_head(hp: HeadPattern) -> HeadPattern:
    """``hp`` with its text rows dense, its visual rows as they were. The question's rows are
    few (about 2 x text tokens / N of density) and they are where the answer reads the
    video: a miss there moves the answer most (lab/NOTES.md, "The question's rows dense"). A
    none/k head becomes a Q-boundary head (a k head's split of the vertical budget across key
    modalities is dropped: its visual rows take their verticals over all keys); a 2D head gets
    every text->* region dense; a dense head stays as it is."""
    if hp.boundary in ("none", "k"):
        p = hp.patterns["all"]
        if p.kind == "dense":
            return hp
        return HeadPattern("q", {"video": p, "image": p, "text": dense()})
    if hp.boundary == "q":
        return HeadPattern("q", {**hp.patterns, "text": dense()})
    return HeadPattern("2d", {**{r: p for r, p in hp.patterns.items()
                                 if not r.startswith("text->")},
                              **{f"text->{m}": dense() for m in QUERY_MODALITIES}})


def only_families(report: list, families: Sequence[str] | None) -> list:
    """``report`` with each head's candidates limited to ``families`` (None: all)."""
    if not families:
        return report
    out = []
    for r in report:
        got = {lab: m for lab, m in r["candidates"].items() if lab.split("@")[0] in families}
        if not got:
            raise ConfigError(f"report head L{r['layer']}H{r['head']} has no candidate of "
                              f"families {sorted(families)} (it has "
                              f"{sorted({lab.split('@')[0] for lab in r['candidates']})})")
        out.append(dict(r, candidates=got))
    return out


def report_candidates(cfg: HeadPatternConfig, index: ModalityIndex) -> dict:
    """label -> HeadPattern: the candidates a calibration (``cfg``, written by ``calibrate``)
    measured, rebuilt on its first input's ``index``, by the labels its report uses."""
    return {_label(key): hp for key, hp in _rebuilt_candidates(cfg, index).items()}


def _rebuilt_candidates(cfg: HeadPatternConfig, index: ModalityIndex) -> dict:
    prov = cfg.provenance or {}
    need = ("calibration_inputs", "budgets", "gammas", "min_density", "max_density",
            "block_m", "block_n", "objective", "candidates")
    missing = [k for k in need if k not in prov]
    if missing:
        raise ConfigError(f"the config's provenance lacks {', '.join(missing)}: only a config "
                          f"written by `mminfer calibrate` can be re-selected")
    first = prov["calibration_inputs"][0]
    if first.get("tokens") != index.n:
        raise InputError(f"the first calibration input {first.get('name')} had "
                         f"{first.get('tokens')} tokens, the index given has {index.n}: give "
                         f"the same video the calibration started with")
    tokens = sorted(c["tokens"] for c in prov["calibration_inputs"])
    n_ref = tokens[len(tokens) // 2]
    cands = _candidate_set(candidate_patterns, index, n_ref, prov["budgets"], prov["gammas"],
                           prov["min_density"], prov["max_density"], prov["block_m"],
                           prov["block_n"])
    # an older calibration measured fewer families: what it measured must still be built
    if not set(prov["candidates"]) <= {key[0] for key in cands}:
        raise ConfigError(f"candidate families {sorted({k[0] for k in cands})} do not include "
                          f"the calibration's {prov['candidates']}: re-selection needs the "
                          f"default candidates")
    return cands


def calibrate(qk_source, identity: ModelIdentity, *, budgets: Sequence[float] = (0.1, 0.2),
              gammas: Sequence[float] = (), min_density: float = 0.0, max_density: float = 0.3,
              candidates: Mapping | Callable | None = None, objective: str = "output_error",
              max_error: float = 0.05, quantile: float = 1.0, hard: str = "dense",
              engine: str = "auto", block_m: int | None = None, block_n: int | None = None,
              progress: bool = True, spread_q: int = 0, cancel: Callable | None = None,
              families: Sequence[str] | None = None):
    """Search every captured layer; returns ``(HeadPatternConfig, report)``. ``cancel()`` is
    checked before every candidate's run (:class:`mminfer.errors.Cancelled`): a server runs
    the search in idle time and stops it when a request arrives.

    Candidates: for each of ``budgets`` (target densities) the fixed-budget patterns of
    ``candidates`` (a mapping name -> HeadPattern used at every budget, or a callable
    ``(index, n, budget, block_m=, block_n=) -> mapping``; default ``candidate_patterns``),
    and for each of ``gammas`` the mass-budget patterns of ``mass_candidate_patterns``
    (floor ``min_density``, ceiling ``max_density``). ``families``: only the candidates of
    these families (e.g. ``grid vertical_slash``; None: all). Every candidate runs on every
    input.

    Choice per head: a candidate's score (output error, or 1 - mass) over the inputs is its
    ``quantile`` across them (1.0: the worst input; ``torch.quantile`` 'higher', so always
    an observed value); its cost is its mean density over the inputs. The head takes the
    cheapest candidate whose score is at most ``max_error``. A head no candidate holds is
    *hard*: with ``hard="dense"`` it goes dense (which holds any bound; so does a head whose
    holding candidates all cost a dense pass or more), with ``"best"`` it takes the lowest
    score. The report lists every head, hard ones first, then by score.

    Every candidate is estimated as serving will estimate it: with ``spread_q`` queries
    spread over the sequence besides the last ones (``estimate_layer``), a setting the
    written config keeps (``estimation.spread_queries``).

    Layers without captures keep ``default_config``'s patterns (the file then stays marked
    uncalibrated)."""
    if objective not in ("output_error", "mass"):
        raise ConfigError(f"objective {objective!r} is not one of output_error, mass")
    if hard not in HARD:
        raise ConfigError(f"hard {hard!r} is not one of {', '.join(HARD)}")
    if not 0 < quantile <= 1:
        raise ConfigError(f"quantile must be in (0, 1], got {quantile}")
    if spread_q < 0:
        raise ConfigError(f"spread_q must be >= 0, got {spread_q}")
    budgets = sorted(float(b) for b in budgets)
    gammas = sorted(float(g) for g in gammas)
    if not budgets and not gammas:
        raise ConfigError("give budgets (target densities) or gammas (mass targets), or both")
    if budgets and budgets[0] <= 0:
        raise ConfigError("budgets must be densities > 0")
    if gammas and not (0 < gammas[0] and gammas[-1] <= 1):
        raise ConfigError("gammas must be in (0, 1]")
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
    cands = _candidate_set(make, caps[0].index, n_ref, budgets, gammas, min_density,
                           max_density, block_m, block_n)
    if families:
        cands = _of_families(cands, families)

    total = sum(len(c.layers) for c in caps) * len(cands)
    bar = _progress(total, progress)
    H = identity.heads
    # metrics[layer][candidate][input name] -> {"error", "mass", "density", "logical"} [H]
    metrics: dict = {i: {key: {} for key in cands} for i in layer_ids}
    for cap in caps:
        for i, (q, k, v) in sorted(cap.layers.items()):
            ref = dense_reference(q, k, v, cap.scale)
            for key, hp in cands.items():
                if cancel is not None and cancel():
                    raise Cancelled("the calibration search was stopped")
                r = evaluate(q, k, v, cap.index, [hp] * H, ref, engine=engine,
                             block_m=block_m, block_n=block_n, scale=cap.scale,
                             spread_q=spread_q)
                metrics[i][key][cap.name] = {m: val.float() for m, val in r.items()}
                bar.update(1)
    bar.close()

    base = default_config(identity)
    layers = [list(row) for row in base.layers]
    report = []
    for i in layer_ids:
        names = sorted({name for per in metrics[i].values() for name in per})
        agg = {key: _aggregate(per, names, objective, quantile) for key, per in metrics[i].items()}
        for h in range(H):
            chosen, is_hard = _choose({key: float(a["score"][h]) for key, a in agg.items()},
                                      {key: float(a["density"][h]) for key, a in agg.items()},
                                      max_error, hard)
            if chosen == DENSE:
                layers[i][h] = HeadPattern.single(dense())
                got = {"error": 0.0, "mass": 1.0, "density": 1.0,
                       "per_input": {n_: {"error": 0.0, "mass": 1.0, "density": 1.0}
                                     for n_ in names}}
            else:
                layers[i][h] = cands[chosen]
                a = agg[chosen]
                got = {"error": _r(a["error"][h]), "mass": _r(a["mass"][h]),
                       "density": _r(a["density"][h]),
                       "per_input": {n_: {m: _r(metrics[i][chosen][n_][m][h])
                                          for m in ("error", "mass", "density")}
                                     for n_ in names if n_ in metrics[i][chosen]}}
            best = min(agg, key=lambda key: float(agg[key]["score"][h]))
            report.append({
                "layer": i, "head": h, "pattern": chosen[0], "budget": chosen[1],
                "gamma": chosen[2], "hard": is_hard, **got,
                # how close the sparse candidates came (for a hard head: how far off)
                "best_sparse": {"candidate": _label(best), "error": _r(agg[best]["error"][h]),
                                "mass": _r(agg[best]["mass"][h]),
                                "density": _r(agg[best]["density"][h])},
                "candidates": {_label(key): {"error": _r(a["error"][h]), "mass": _r(a["mass"][h]),
                                             "density": _r(a["density"][h])}
                               for key, a in agg.items()},
            })
    _sort_report(report, objective)

    names = [c.name for c in caps]
    per_input = {n_: _r(sum(r["per_input"][n_]["density"] for r in report
                            if n_ in r["per_input"]) /
                        max(1, sum(n_ in r["per_input"] for r in report)))
                 for n_ in names}
    cfg = HeadPatternConfig(identity, layers, uncalibrated=len(layer_ids) < identity.layers,
                            provenance=provenance(
                                made_by="mminfer calibrate",
                                calibration_inputs=[{"name": c.name, "tokens": c.n,
                                                     "modalities": {m_: c.index.count(m_) for m_
                                                                    in c.index.modalities()}}
                                                    for c in caps],
                                objective=objective, budgets=budgets, gammas=gammas,
                                min_density=min_density, max_density=max_density,
                                max_error=max_error,
                                error_over_inputs="worst input" if quantile >= 1 else
                                f"quantile {quantile:g} across inputs ('higher')",
                                cost="mean density over inputs", hard=hard,
                                hard_heads=sorted([r["layer"], r["head"]] for r in report
                                                  if r["hard"]),
                                density_per_input=per_input,
                                density="physical tiles / causal triangle" if
                                engine == "kernel" else "logical pairs / causal triangle",
                                engine=engine, block_m=block_m, block_n=block_n,
                                candidates=sorted({key[0] for key in cands}),
                                **({"families": sorted(families)} if families else {}),
                                layers_calibrated=layer_ids, device=_device_name(dev)),
                            estimation={"spread_queries": spread_q} if spread_q else {})
    return cfg, report


def _aggregate(per: dict, names: list, objective: str, quantile: float) -> dict:
    """One candidate's numbers over the inputs (``per``: input name -> metrics [H]): the
    score and error at ``quantile`` across the inputs, mass at the same (low) side, density
    as the mean (the expected cost)."""
    got = [per[n] for n in names if n in per]
    stack = {m: torch.stack([g[m] for g in got]) for m in ("error", "mass", "density")}

    def q(x):
        return torch.quantile(x, quantile, dim=0, interpolation="higher")

    error = q(stack["error"])
    mass = 1 - q(1 - stack["mass"])
    score = error if objective == "output_error" else 1 - mass
    return {"error": error, "mass": mass, "density": stack["density"].mean(0), "score": score}


def _label(key) -> str:
    name, b, g = key
    return f"{name}@{b:g}" if b is not None else f"{name}@g{g:g}"


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
    return tqdm(total=total, desc="calibrate", unit="run", disable=not enabled)


def format_report(report: list, prov: dict) -> str:
    """The printed table: the inputs' density under the chosen config, the hard heads, and
    every head (hard first, then worst objective first)."""
    lines = [f"objective {prov['objective']} <= {prov['max_error']:g} on the "
             f"{prov['error_over_inputs']}, at the least {prov['cost']} ({prov['density']})",
             "density per input under the chosen config (mean over calibrated heads):"]
    tokens = {c["name"]: c["tokens"] for c in prov.get("calibration_inputs", [])}
    for name, d in prov["density_per_input"].items():
        lines.append(f"  {name:<32} {tokens.get(name, 0):>8} tokens  {d:.4f}")
    hard = [f"L{r['layer']}H{r['head']}" for r in report if r["hard"]]
    lines.append(f"hard heads (no candidate holds the bound -> {prov['hard']}): "
                 f"{len(hard)}" + (f": {' '.join(hard)}" if hard else ""))
    top = max(prov.get("gammas") or [0]) if prov.get("gammas") else None
    if top:
        high = [f"L{r['layer']}H{r['head']}" for r in report if r["gamma"] == top]
        lines.append(f"heads at the highest gamma {top:g}: {len(high)}" +
                     (f": {' '.join(high)}" if high else ""))
    lines.append(f"{'layer':>5} {'head':>4}  {'pattern':<16} {'budget':>7} {'density':>8} "
                 f"{'mass':>6} {'error':>7}  hard")
    for r in report:
        size = f"g{r['gamma']:g}" if r["gamma"] is not None else \
            (f"{r['budget']:g}" if r["budget"] is not None else "-")
        lines.append(f"{r['layer']:>5} {r['head']:>4}  {r['pattern']:<16} {size:>7} "
                     f"{r['density']:>8.4f} {r['mass']:>6.3f} {r['error']:>7.4f}  "
                     f"{'HARD' if r['hard'] else ''}")
    return "\n".join(lines)
