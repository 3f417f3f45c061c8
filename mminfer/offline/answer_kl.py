"""Calibration against the answer: per head, the cheapest candidate that keeps the model's
last-token distribution on the calibration videos within a KL bound of dense.

Why: ``calibrate.py`` bounds each head's relative attention-output error, and that is the
wrong thing to bound (lab/NOTES.md, "Sharper attention by training"): a diffuse head can miss
half its mass and move no answer, while a sharp head that misses one landmark flips one. So
this step measures the answer itself, as it is served (:class:`AnswerProbe`: the prefix
prefilled under the config, the question's rows dense over its cache; the prefill engine of
``models/prefill.py`` with the hook in ``models/hooks.py``):

1. **Per-head cost.** Each head's candidates from a calibration report (only those on the
   density/error frontier, cheapest last) are tried one head at a time, every other head
   dense; the mean last-token KL(dense || sparse) over the inputs is that rung's cost.
2. **Greedy, verified.** From all heads dense, the move that saves the most density per unit
   of its own KL (the next cheaper rung of one head) is tried with every move kept so far;
   it stays if the mean KL over the inputs stays within ``target``, else that head stops
   where it is. Per-head KLs do not add exactly (errors compound through the layers), which
   is why every move is verified on the whole config.

Cost: one forward per input per rung (step 1) and per move tried (step 2), on prepared
embeddings (the vision tower runs once per input).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mminfer.errors import ConfigError
from mminfer.models.base import PrepareOptions
from mminfer.models.hooks import PrefillContext
from mminfer.models.prefill import prefill
from mminfer.sparse.patterns import HeadPattern, HeadPatternConfig, dense


@dataclass
class AnswerInput:
    name: str
    prep: object                  # the adapter's Prepared
    embeds: torch.Tensor          # [1, L, hidden], kept; every forward works on a copy
    dense_logp: torch.Tensor      # [V] fp32 log-probabilities of the dense prefill, CPU


@dataclass
class AnswerProbe:
    """Runs a model under a head-pattern config as the server serves it and reads the first
    answer token's log-probabilities (``engine``/``block``: as ``hooks.PrefillContext``): the
    prompt's prefix prefilled sparse, estimated from its own last queries, then the question's
    rows dense over its KV cache (``served_policy.py``). ``one_shot``: the whole prompt in
    one sparse prefill instead, estimated from the question's last queries: what calibration
    measured before it measured the served policy, kept for the benchmark that compares the
    two (``benchmarks/calib_quality.py``)."""
    adapter: object
    engine: str = "kernel"
    block: tuple | None = None
    one_shot: bool = False
    forwards: int = field(default=0, init=False)

    def prepare(self, name: str, decoded, question: str) -> AnswerInput:
        prep = self.adapter.prepare(decoded, question, PrepareOptions())
        with torch.inference_mode():
            embeds = self.adapter.embed(prep)
        logp, _ = self.logprobs(prep, embeds, None)
        return AnswerInput(name, prep, embeds, logp)

    def logprobs(self, prep, embeds, patterns: HeadPatternConfig | None):
        """``(log-probabilities [V] fp32 on CPU, mean density or None)``: dense when
        ``patterns`` is None; the density is the plans' physical tiles / causal triangle
        (logical pairs for the reference engine), mean over heads and the layers that made a
        plan (the prefix's last layer writes its K/V only; a one-shot prefill's last layer
        runs its last row only)."""
        ad = self.adapter
        L = prep.input_ids.shape[1]
        ctx = PrefillContext(index=prep.index if self.one_shot else prep.prefix_index,
                             patterns=patterns,
                             mode="dense" if patterns is None else "sparse", min_sparse_len=0,
                             keep_plans=patterns is not None, engine=self.engine,
                             block=self.block)
        if self.one_shot:
            logits = prefill(ad.text_model, embeds.clone(), None, ad.positions(prep, 0, L),
                             ctx=ctx, lm_head=ad.lm_head)[0, -1]
        else:
            kv = ad.prefill_prefix(prep, embeds.clone(), ctx=ctx)
            logits = ad.continue_on(kv, embeds[:, prep.prefix_len:], rope_delta=prep.rope_delta,
                                    max_new_tokens=1).prefill_logits
        self.forwards += 1
        return torch.log_softmax(logits.float(), -1).cpu(), _density(ctx)

    def kl(self, inp: AnswerInput, patterns: HeadPatternConfig) -> tuple:
        """``(KL(dense || patterns) in nats, density)`` of one input."""
        logp, dens = self.logprobs(inp.prep, inp.embeds, patterns)
        return kl_divergence(inp.dense_logp, logp), dens


def kl_divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats of two log-probability rows."""
    return float((p_log.exp() * (p_log - q_log)).sum().clamp(min=0))


def _density(ctx):
    if not ctx.densities:
        return None
    vals = []
    for plan in ctx.densities.values():
        d = plan.density()
        if isinstance(d, dict):
            vals.append(float(d.get("physical", d["logical"])))
        else:
            vals.append(float(d))
    return sum(vals) / len(vals)


def frontier(candidates: dict) -> list:
    """A head's report candidates (label -> {"error", "density", ...}) reduced to the rungs
    worth trying: sparse ones (density < 1) on the density/error frontier, each with a lower
    error than every cheaper one. Sorted dearest first: ``[(label, density, error)]``."""
    rows = sorted(((lab, float(m["density"]), float(m["error"])) for lab, m in candidates.items()
                   if float(m["density"]) < 1.0), key=lambda r: (-r[1], r[2]))
    out, best = [], float("inf")
    for lab, d, e in reversed(rows):            # cheapest first
        if e < best:
            out.append((lab, d, e))
            best = e
    return list(reversed(out))


def refine(probe: AnswerProbe, inputs: Sequence[AnswerInput], cfg: HeadPatternConfig,
           report: list, candidates: dict, *, target: float, max_rungs: int = 6,
           deadline: float | None = None, log: Callable[[str], None] = lambda s: None):
    """The answer-bound config (see the module docstring). ``cfg``: the calibration's config
    (identity, estimation settings, provenance); ``report``: its rows (``candidates`` per
    head); ``candidates``: label -> HeadPattern (``calibrate.report_candidates``);
    ``max_rungs``: per head at most this many frontier rungs are tried (spread over the
    frontier). ``deadline`` (``time.monotonic()``):
    past it no more heads are measured (those left stay dense) and no more moves are tried;
    every move kept was verified, so the config returned holds the bound either way (its
    provenance says it stopped early). Returns ``(HeadPatternConfig, rows)``: per head its
    rungs with their own KL and the rung chosen, and in the provenance the measured mean KL
    and density per input."""
    if target <= 0:
        raise ConfigError(f"the answer KL bound must be > 0, got {target}")
    if not inputs:
        raise ConfigError("calibrating against the answer needs at least one input")
    if max_rungs < 1:
        raise ConfigError(f"max_rungs must be >= 1, got {max_rungs}")
    ident = cfg.identity
    H = ident.heads
    dense_hp = HeadPattern.single(dense())

    def config(choice: dict) -> HeadPatternConfig:
        layers = [[candidates[choice[(i, h)]] if (i, h) in choice else dense_hp
                   for h in range(H)] for i in range(ident.layers)]
        return HeadPatternConfig(ident, layers, uncalibrated=cfg.uncalibrated,
                                 provenance=dict(cfg.provenance), estimation=dict(cfg.estimation))

    def mean_kl(choice: dict, stop_above: float | None = None):
        """Mean KL and density over the inputs; None for the KL as soon as the sum already
        exceeds what ``stop_above`` allows (the move is lost anyway)."""
        c = config(choice)
        kls, dens = {}, {}
        for inp in inputs:
            kls[inp.name], dens[inp.name] = probe.kl(inp, c)
            if stop_above is not None and sum(kls.values()) > stop_above * len(inputs):
                return None, kls, dens
        return sum(kls.values()) / len(inputs), kls, dens

    # 1. per-head cost of each rung, alone among dense heads
    ladders: dict = {}
    for r in report:
        key = (int(r["layer"]), int(r["head"]))
        missing = sorted(set(r["candidates"]) - set(candidates))
        if missing:
            raise ConfigError(f"report head L{key[0]}H{key[1]} has candidates {missing} that "
                              f"were not rebuilt")
        rungs = frontier(r["candidates"])
        if len(rungs) > max_rungs:      # keep the cheapest and dearest, spread the rest
            pick = sorted({round(j * (len(rungs) - 1) / max(1, max_rungs - 1))
                           for j in range(max_rungs)})
            rungs = [rungs[j] for j in pick]
        ladders[key] = rungs
    late = lambda: deadline is not None and time.monotonic() > deadline
    stopped = None
    own: dict = {}
    # the served prefix's last layer writes its K/V only, and a one-shot prefill runs it for
    # its last row only, a single query that sees every key (models/prefill.py): no pattern
    # there reaches the answer, so those heads take their cheapest rung unmeasured
    free = {key: rungs[-1][0] for key, rungs in ladders.items()
            if key[0] == ident.layers - 1 and rungs}
    for key, lab in free.items():
        own[(key, lab)] = 0.0
        ladders[key] = [r for r in ladders[key] if r[0] == lab]
    for key, rungs in sorted(ladders.items()):
        if key in free:
            continue
        if late():
            stopped = stopped or f"time ran out before measuring L{key[0]}H{key[1]}"
            ladders[key] = []
            continue
        for lab, d, e in rungs:
            own[(key, lab)], _, _ = mean_kl({key: lab})
        log(f"L{key[0]}H{key[1]}: " + ", ".join(f"{lab} d={d:.3f} kl={own[(key, lab)]:.4f}"
                                               for lab, d, e in rungs))

    # 2. greedy from dense: a head's ladder is its rungs on the density / own-KL frontier
    steps: dict = {}
    for key, rungs in ladders.items():
        path, best = [], float("inf")
        for lab, d, e in reversed(rungs):       # cheapest first
            k = own[(key, lab)]
            if k < best:
                path.append((lab, d, k))
                best = k
        steps[key] = list(reversed(path))       # dearest first: the first move from dense
    pos = {key: -1 if key not in free else 0 for key in steps}     # -1: dense
    frozen: set = set()
    choice: dict = dict(free)
    cur_kl, cur_kls, cur_dens = 0.0, {inp.name: 0.0 for inp in inputs}, {}
    while True:
        moves = []
        for key, path in steps.items():
            nxt = pos[key] + 1
            if key in frozen or nxt >= len(path):
                continue
            d_now, k_now = (1.0, 0.0) if pos[key] < 0 else path[pos[key]][1:]
            lab, d, k = path[nxt]
            moves.append(((d_now - d) / max(k - k_now, 1e-5), key, nxt))
        if not moves:
            break
        if late():
            stopped = stopped or "time ran out during the greedy step"
            break
        _, key, nxt = max(moves)
        trial = dict(choice)
        trial[key] = steps[key][nxt][0]
        got, kls, dens = mean_kl(trial, stop_above=target)
        if got is not None and got <= target:
            choice, pos[key] = trial, nxt
            cur_kl, cur_kls, cur_dens = got, kls, dens
            log(f"keep L{key[0]}H{key[1]} -> {trial[key]}: mean KL {got:.4f}")
        else:
            frozen.add(key)
            log(f"stop L{key[0]}H{key[1]} before {trial[key]}: mean KL "
                f"{'over the bound' if got is None else f'{got:.4f}'}")

    rows = []
    for key in sorted(steps):
        lab = choice.get(key)
        d = 1.0 if lab is None else next(dd for ll, dd, _ in steps[key] if ll == lab)
        rows.append({"layer": key[0], "head": key[1], "candidate": lab or "dense",
                     "density": round(d, 5), "own_kl": round(own.get((key, lab), 0.0), 6),
                     "measured": bool(ladders[key]) and key not in free,
                     "last_row_only": key in free,
                     "rungs": [{"candidate": ll, "density": round(dd, 5),
                                "error": round(ee, 5), "own_kl": round(own[(key, ll)], 6)}
                               for ll, dd, ee in ladders[key]]})
    out = config(choice)
    out.provenance = dict(
        cfg.provenance, made_by="mminfer calibrate --answer-kl",
        answer_kl={"target": target, "mean_kl": round(cur_kl, 6),
                   "kl_per_input": {n: round(v, 6) for n, v in cur_kls.items()},
                   "density_per_input": {n: (None if v is None else round(v, 5))
                                         for n, v in cur_dens.items()},
                   "inputs": [inp.name for inp in inputs], "forwards": probe.forwards,
                   "stopped_early": stopped,
                   "engine": probe.engine, "objective": "mean last-token KL(dense || sparse) "
                   "over the inputs"},
        hard_heads=sorted([r["layer"], r["head"]] for r in rows if r["candidate"] == "dense"),
        # over the heads whose every row runs, as the served prefill counts its density
        mean_density=round(sum(r["density"] for r in rows if not r["last_row_only"])
                           / max(1, sum(not r["last_row_only"] for r in rows)), 5))
    return out, rows


def format_rows(rows: list, prov: dict) -> str:
    a = prov["answer_kl"]
    lines = [f"answer KL bound {a['target']:g}: mean KL {a['mean_kl']:.4f} over "
             f"{len(a['inputs'])} inputs ({a['forwards']} forwards); mean head density "
             f"{prov['mean_density']:.3f}"]
    if a.get("stopped_early"):
        lines.append(f"  stopped early: {a['stopped_early']} (what was kept holds the bound)")
    for n, v in a["kl_per_input"].items():
        d = a["density_per_input"].get(n)
        lines.append(f"  {n}: KL {v:.4f}" + ("" if d is None else f", density {d:.3f}"))
    lines.append("head     chosen                       density  own KL   rungs tried")
    for r in rows:
        lines.append(f"L{r['layer']}H{r['head']:<5} {r['candidate']:<28} {r['density']:7.3f}  "
                     f"{r['own_kl']:.4f}   {len(r['rungs'])}")
    return "\n".join(lines)
