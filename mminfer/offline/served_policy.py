"""Calibration that measures what is served: a head-pattern config is scored by the answers it
gives under the serving policy, against dense.

What the server runs for a question about a video (``Pipeline.answer``, the video cache's
policy): the *prefix* (up to and including the video) is prefilled on its own, sparse, each
layer's positions estimated from the prefix's own last queries (``ctx.index`` is the prefix's
ModalityIndex); then the *suffix* (the question) is computed dense over the prefix's KV cache
(``Adapter.continue_on``) and the answer decoded. A one-shot prefill of the whole prompt, which
estimates from the question's last queries and makes the question's rows sparse too, measures
something else. So here:

* :func:`run_served` runs exactly that on an input's kept embeddings: the prefix under a config
  (or dense), the question dense over it, ``max_new_tokens`` greedy tokens. The dense run can
  also capture every layer's q/k/v of the prefix, which the per-head search (``calibrate.py``)
  then measures its candidates on: the rows and the estimation serving has.
* :func:`compare` / :func:`summarize`: agreement of greedy answers with dense, first-token
  agreement, last-token KL(dense || sparse), density.
* :class:`ServedCalibration`: the whole calibration as small steps (one prefill each, or one
  candidate on one layer of one input), so that a server can run it in idle time and stop
  between any two steps: dense references (and captures) of the inputs, the per-head search on
  the captures, a ladder of configs from it (the per-head bound loosened rung by rung, the
  question's rows dense), each scored on the calibration inputs by what is served; the winner
  is the cheapest rung that holds the thresholds (agreement >= ``min_agreement``, mean KL <=
  ``max_kl``). :func:`run_all` runs the steps one after the other (offline); the server's
  self-calibration (serve/selfcal.py) runs them in its idle time.

Inputs are kept on the host: the prompt embeddings after the vision tower ``[1, L, hidden]``
(L x hidden x 2 bytes in bf16), the prefix's positions, its ModalityIndex and length, and the
M-RoPE offset of what follows it. No frames, no pixels.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mminfer.engine.rerun import to_host
from mminfer.errors import Cancelled, ConfigError
from mminfer.kernels import sparsity
from mminfer.models.base import PrepareOptions
from mminfer.models.hooks import PrefillContext
from mminfer.models.kv import PrefixKV
from mminfer.models.prefill import DEFAULT_CHUNK, prefill
from mminfer.sparse.patterns import HeadPatternConfig, default_config

from .calibrate import Capture, calibrate, reselect, with_dense_text
from .thresholds import MAX_KL, MAX_SERVED_DENSITY, MIN_AGREEMENT


# ---------------------------------------------------------------------- inputs
@dataclass
class ServedRun:
    logits: torch.Tensor               # [vocab] fp32 CPU: the first answer token's logits
    token_ids: list                    # greedy tokens (with EOS when it came)
    density: float | None = None       # the prefix's plans' (plans_density), None when dense
    seconds: float = 0.0


@dataclass
class ServedInput:
    """One prompt kept for calibration (see the module doc)."""
    name: str
    embeds: torch.Tensor               # [1, L, hidden] CPU, model dtype
    positions: object                  # the prefix's position_ids (CPU) or None
    prefix_len: int
    prefix_index: object               # ModalityIndex of the prefix
    rope_delta: int = 0
    source: str = "synthetic"          # "synthetic" | "request" | "video" (a file, offline)
    reference: ServedRun | None = None     # the dense run
    capture: dict | None = None        # layer -> (q, k, v) of the dense prefix prefill

    @property
    def tokens(self) -> int:
        return int(self.embeds.shape[1])

    @property
    def nbytes(self) -> int:
        n = self.embeds.numel() * self.embeds.element_size()
        if self.positions is not None:
            n += self.positions.numel() * self.positions.element_size()
        return n


def keep(adapter, prep, embeds, name: str, source: str = "request") -> ServedInput:
    """A :class:`ServedInput` of a prepared prompt whose embeddings ``embeds`` (the vision
    tower's output spliced in) are about to be prefilled: copied to the host now, since the
    prefill overwrites them."""
    P = prep.prefix_len
    return ServedInput(name=name, embeds=to_host(embeds), positions=to_host(adapter.positions(
        prep, 0, P)), prefix_len=P, prefix_index=prep.prefix_index,
        rope_delta=int(prep.rope_delta), source=source)


def prepare(adapter, decoded, question: str, name: str, source: str = "synthetic",
            cancel=None) -> ServedInput:
    """A decoded video and a question through the adapter's preprocessing and vision tower."""
    prep = adapter.prepare(decoded, question, PrepareOptions())
    with torch.inference_mode():
        embeds = adapter.embed(prep, cancel=cancel)
    return keep(adapter, prep, embeds, name, source)


# ---------------------------------------------------------------------- one served run
def run_served(adapter, inp: ServedInput, patterns: HeadPatternConfig | None = None, *,
               max_new_tokens: int = 8, engine: str = "kernel", block: tuple | None = None,
               cancel: Callable[[], bool] | None = None, capture: bool = False) -> ServedRun:
    """What the server answers for ``inp`` with ``patterns`` (None: dense): the prefix
    prefilled (sparse under ``patterns``, estimated from the prefix's own last queries), the
    question's rows dense over its KV cache, then greedy tokens. ``capture`` (dense only):
    keep every layer's q/k/v of the prefix in ``inp.capture``. ``cancel`` is checked before
    every decoder layer and decode step (:class:`Cancelled`)."""

    if capture and patterns is not None:
        raise ConfigError("a capture is of the dense prefill")
    t0 = time.perf_counter()
    ad = adapter
    P = inp.prefix_len
    embeds = inp.embeds.to(ad.device, copy=True)
    positions = None if inp.positions is None else inp.positions.to(ad.device)
    ctx = PrefillContext(index=inp.prefix_index, patterns=patterns,
                         mode="dense" if patterns is None else "sparse", min_sparse_len=0,
                         keep_plans=patterns is not None, engine=engine, block=block,
                         cancel=cancel, capture={} if capture else None)
    kv = PrefixKV.for_model(ad.text_model, inp.tokens - P + max_new_tokens + 1,
                            dtype=ad.kv_cache_dtype)
    with torch.inference_mode():
        prefill(ad.text_model, embeds[:, :P], kv, positions, chunk=ad.prefill_chunk or
                DEFAULT_CHUNK, ctx=ctx, kv_only_last=True)
        if cancel is not None and cancel():
            raise Cancelled("stopped before the question's rows")
        gen = ad.continue_on(kv, embeds[:, P:], rope_delta=inp.rope_delta,
                             max_new_tokens=max_new_tokens, cancel=cancel)
    if capture:
        inp.capture = ctx.capture
    return ServedRun(logits=gen.prefill_logits.detach().float().cpu(),
                     token_ids=list(gen.token_ids), density=plans_density(ctx.densities),
                     seconds=time.perf_counter() - t0)


def captures(settings: "SearchSettings", searched: bool, inp: ServedInput) -> bool:
    """A dense reference run of ``inp`` keeps its prefix's q/k/v for the per-head search:
    the search is still to come and the prefix is short enough for it."""
    return not searched and inp.prefix_len <= settings.search_tokens


def answered_reference(gen, max_new_tokens: int, eos_token_ids) -> ServedRun | None:
    """The dense reference :func:`run_served` would compute for a prompt, taken from a greedy
    dense answer the server already gave it (``gen``, models.base.Generated): its first
    token's logits and its first ``max_new_tokens`` tokens. None where that answer cannot
    stand for it: one that stopped (at its own token limit or a stop string) before
    ``max_new_tokens`` tokens and not at an end token."""
    tokens = list(gen.token_ids)
    if len(tokens) < max_new_tokens and not (tokens and tokens[-1] in eos_token_ids):
        return None
    return ServedRun(logits=gen.prefill_logits.detach().float().cpu(),
                     token_ids=tokens[:max_new_tokens])


def plans_density(plans: dict) -> float | None:
    """The density the server reports of these plans (``mminfer.kernels.sparsity``: the
    pairs computed over the causal triangle, mean over heads and planned layers), None
    without plans."""
    if not plans:
        return None
    out = sparsity(plans)
    return None if out is None else float(out["mean_density"])


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats of two logit rows."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return max(float((p.exp() * (p - q)).sum()), 0.0)


def compare(reference: ServedRun, run: ServedRun) -> dict:
    """One input: the greedy answers agree (both decoded the same number of tokens at most,
    each stopping at its end token: an answer that ends where the other goes on differs), the
    first tokens agree, KL(dense || sparse) of the first answer token."""
    return {"kl": kl_divergence(reference.logits, run.logits),
            "argmax_agree": int(reference.logits.argmax()) == int(run.logits.argmax()),
            "answer_agree": list(reference.token_ids) == list(run.token_ids),
            "density": run.density}


def summarize(rows: Sequence[dict]) -> dict:
    """Comparisons over inputs: how many, answer and first-token agreement, mean and largest
    KL, mean density."""
    n = len(rows)
    if not n:
        return {"n": 0, "agreement": None, "argmax_agreement": None, "mean_kl": None,
                "max_kl": None, "mean_density": None}
    dens = [r["density"] for r in rows if r.get("density") is not None]
    return {"n": n, "agreement": sum(r["answer_agree"] for r in rows) / n,
            "argmax_agreement": sum(r["argmax_agree"] for r in rows) / n,
            "mean_kl": sum(r["kl"] for r in rows) / n, "max_kl": max(r["kl"] for r in rows),
            "mean_density": sum(dens) / len(dens) if dens else None}


def holds(summary: dict, min_agreement: float, max_kl: float) -> bool:
    return bool(summary["n"]) and summary["agreement"] >= min_agreement and \
        summary["mean_kl"] <= max_kl


# ---------------------------------------------------------------------- the calibration
@dataclass
class SearchSettings:
    """The candidates and the ladder. ``budgets``/``gammas``/``min_density``/``max_density``:
    the per-head search's (``calibrate.calibrate``); ``bounds``: the per-head output-error
    bounds of the ladder's rungs, tightest first (each rung is the search re-selected under
    one bound, ``calibrate.reselect``, with the text rows dense); ``hard``: what a head that
    no candidate holds a rung's bound for becomes (``"dense"``, or ``"best"``: its
    lowest-error candidate), at every rung; ``families``: the candidate families the search
    measures and every rung chooses among (None: all); ``search_tokens``:
    inputs longer than this are scored but not searched (their q/k/v of every layer would
    not fit the host: 8 GB at 32K tokens for a 7B); ``engine``/``block``: how a sparse layer
    runs while measuring (None: the kernels with 128 x 64 tiles on a GPU; on a CPU the exact
    reference engine with 16 x 16 tiles, which needs no Triton interpreter);
    ``max_served_density``: a rung that holds at a higher mean density is no winner, and the
    calibration ends there (tighter rungs are denser still): it would serve no faster than
    dense. The default is reasoned from one measurement, not a sweep: on an H100 a config
    holding at density 0.999 answered 1.08x dense's TTFT (the estimate on top of nearly all
    the work), and attention is not all of a prefill, so the break-even lies below 0.9
    (BENCHMARKS.md, self-calibration)."""
    budgets: tuple = (0.1, 0.2)
    gammas: tuple = (0.9, 0.95, 0.99)
    min_density: float = 0.0
    max_density: float = 0.3
    bounds: tuple = (0.02, 0.05, 0.1, 0.2, 0.4)
    hard: str = "dense"
    families: tuple | None = None
    max_new_tokens: int = 8
    search_tokens: int = 32768
    engine: str | None = None
    block: tuple | None = None
    max_served_density: float = MAX_SERVED_DENSITY

    @classmethod
    def for_device(cls, device) -> "SearchSettings":
        """The defaults on ``device``; on a CPU (sparse serving there is the Triton
        interpreter's, for tests) one fixed budget and one mass target, three rungs."""
        if getattr(device, "type", str(device)) == "cuda":
            return cls()
        return cls(budgets=(0.3,), gammas=(0.9,), bounds=(0.05, 0.2, 0.5), max_new_tokens=4)

    def resolved(self, device) -> tuple:
        cuda = getattr(device, "type", str(device)) == "cuda"
        engine = self.engine or ("kernel" if cuda else "reference")
        block = self.block or ((128, 64) if cuda else (16, 16))
        return engine, block


class Step:
    """One unit of calibration work: ``run(cancel)``; a Cancelled one may be run again."""

    def __init__(self, what: str, fn: Callable):
        self.what = what
        self.fn = fn

    def __call__(self, cancel=None):
        return self.fn(cancel)

    def __repr__(self):
        return f"Step({self.what})"


@dataclass
class Rung:
    bound: float
    config: HeadPatternConfig
    rows: list = field(default_factory=list)    # per calibration input: compare()

    def summary(self) -> dict:
        return summarize(self.rows)


class ServedCalibration:
    """The calibration of ``adapter``'s head patterns on ``inputs`` as steps (see the module
    doc). Use: ``for step in cal.steps(): step(cancel)`` (a Cancelled step may be run again
    before going on); then ``cal.winner`` (a Rung, or None when no rung holds) and
    ``cal.config()``. ``inputs`` may grow until the ladder is scored (``freeze``)."""

    def __init__(self, adapter, inputs: list, *, min_agreement: float = MIN_AGREEMENT,
                 max_kl: float = MAX_KL, settings: SearchSettings | None = None,
                 log: Callable[[str], None] = lambda s: None):
        self.adapter = adapter
        self.inputs = inputs
        self.min_agreement = float(min_agreement)
        self.max_kl = float(max_kl)
        self.settings = settings or SearchSettings.for_device(adapter.device)
        self.engine, self.block = self.settings.resolved(adapter.device)
        self.log = log
        self.head_config: HeadPatternConfig | None = None
        self.head_report: list | None = None
        self.rungs: list[Rung] = []
        self.winner: Rung | None = None
        self.too_dense: Rung | None = None     # the rung that held, but too densely to pay
        self.searched: list[str] = []
        self.frozen: list | None = None
        self.select: Callable | None = None
        self.forwards = 0

    # ------------------------------------------------------------ pieces
    def reference_step(self, inp: ServedInput) -> Step:
        """The dense served run of ``inp`` (its reference), capturing the prefix's q/k/v for
        the search when it is short enough."""
        def fn(cancel):
            inp.reference = run_served(self.adapter, inp, None, cancel=cancel,
                                       max_new_tokens=self.settings.max_new_tokens,
                                       capture=self.captures(inp))
            self.forwards += 1
        return Step(f"dense reference of {inp.name}", fn)

    def captures(self, inp: ServedInput) -> bool:
        """``inp``'s dense reference run keeps its prefix's q/k/v for the per-head search."""
        return captures(self.settings, self.head_config is not None, inp)

    def score(self, inp: ServedInput, patterns: HeadPatternConfig, cancel=None) -> dict:
        """``patterns`` served on ``inp`` against its dense reference."""
        run = run_served(self.adapter, inp, patterns, cancel=cancel, engine=self.engine,
                         block=self.block, max_new_tokens=self.settings.max_new_tokens)
        self.forwards += 1
        return compare(inp.reference, run)

    def freeze(self) -> list:
        """The calibration inputs from now on: ``select(inputs)`` of those there now (all of
        them without it); the others, and later ones, are held out (e.g. for a gate)."""
        if self.frozen is None:
            self.frozen = list(self.select(list(self.inputs)) if self.select else self.inputs)
        return self.frozen

    # ------------------------------------------------------------ the plan
    def steps(self, ready: Callable[[], bool] = lambda: True):
        """The steps, in order. ``ready()`` is asked before the ladder is scored (the inputs
        are frozen then): while it says False, the generator yields None (nothing to do now;
        ask again later) and keeps taking new inputs' references."""
        # 1. dense references (and captures) of what is there
        while True:
            todo = [i for i in self.inputs if i.reference is None]
            if not todo:
                break
            yield self.reference_step(todo[0])
        # 2. the per-head search on the captured inputs, one layer at a time (unless the
        # caller gave this calibration an earlier one's: head_config and head_report)
        if self.head_config is None:
            caps = [i for i in self.inputs if i.capture]
            if not caps:
                raise ConfigError("no calibration input is short enough to search "
                                  f"(at most {self.settings.search_tokens} prefix tokens)")
            yield from self._search(caps)
        # 3. more inputs until the caller is ready to freeze them
        while True:
            todo = [i for i in (self.select(list(self.inputs)) if self.select else self.inputs)
                    if i.reference is None]
            if todo:
                yield self.reference_step(todo[0])
                continue
            if ready():
                break
            yield None
        self.freeze()
        # 4. the ladder, scored on the frozen inputs
        self.rungs = self._ladder()
        yield from self.ladder_steps()

    def ladder_steps(self, tighter_than: float | None = None):
        """Score the rungs on the frozen inputs, loosest (cheapest) first, only those with a
        bound below ``tighter_than`` (a caller whose winner failed elsewhere asks for the
        next): the first that holds is the winner (``self.winner``, None when none does). A
        rung with more answers off than the agreement bound allows skips its other inputs."""
        self.winner = self.too_dense = None
        inputs = self.frozen
        for rung in sorted(self.rungs, key=lambda r: -r.bound):
            if tighter_than is not None and rung.bound >= tighter_than:
                continue
            for inp in inputs[len(rung.rows):]:
                if not self._can_hold(rung, len(inputs)):
                    break
                yield Step(f"rung {rung.bound:g} on {inp.name}",
                           lambda cancel, r=rung, i=inp: r.rows.append(
                               self.score(i, r.config, cancel)))
            s = rung.summary()
            self.log(f"per-head bound {rung.bound:g}: agreement "
                     f"{s['agreement']:.3f}, mean KL {s['mean_kl']:.4f}, density "
                     f"{_fmt(s['mean_density'])} on {s['n']} of {len(inputs)} inputs")
            if s["n"] == len(inputs) and holds(s, self.min_agreement, self.max_kl):
                if s["mean_density"] is not None and \
                        s["mean_density"] > self.settings.max_served_density:
                    self.too_dense = rung
                    self.log(f"per-head bound {rung.bound:g} holds, but at density "
                             f"{s['mean_density']:.3f} (more than "
                             f"{self.settings.max_served_density:g}): it would serve no faster "
                             "than dense, and tighter rungs are denser")
                    return
                self.winner = rung
                return

    def why_none(self) -> str:
        """Why no rung won (after :meth:`ladder_steps`), in words."""
        if self.too_dense is not None:
            d = self.too_dense.summary()["mean_density"]
            return (f"the loosest rung that holds the thresholds (per-head bound "
                    f"{self.too_dense.bound:g}) does so at density {d:.3f}, above "
                    f"{self.settings.max_served_density:g}: sparse would be no faster than "
                    "dense")
        return "no config of the ladder held the thresholds on the calibration inputs"

    def _can_hold(self, rung: Rung, n: int) -> bool:
        misses = sum(not r["answer_agree"] for r in rung.rows)
        return misses <= math.floor((1 - self.min_agreement) * n + 1e-9)

    def _search(self, caps: list):
        ident = self.adapter.identity
        s = self.settings
        layers = sorted({i for c in caps for i in c.capture})
        results = {}
        self.searched = [c.name for c in caps]
        for layer in layers:
            def fn(cancel, layer=layer):
                # the captures wait on the host (every layer of them would not fit beside
                # the served model); the search runs where the model does, a layer at a time
                dev = self.adapter.device
                got = [Capture(c.name, c.prefix_index,
                               {layer: tuple(t.to(dev) for t in c.capture[layer])})
                       for c in caps if layer in c.capture]
                results[layer] = calibrate(
                    got, ident, budgets=s.budgets, gammas=s.gammas, min_density=s.min_density,
                    max_density=s.max_density, max_error=max(s.bounds), hard=s.hard,
                    engine=self.engine, block_m=self.block[0], block_n=self.block[1],
                    progress=False, cancel=cancel, families=s.families)
            yield Step(f"per-head search of layer {layer}", fn)
        cfg, report = _merge(results, ident)
        self.head_config, self.head_report = cfg, report
        for c in caps:                   # what the search needed of them
            c.capture = None

    def _ladder(self) -> list:
        """One config per bound, from the search's numbers (``reselect``: nothing measured;
        the settings' ``hard`` and ``families``), with the text rows dense: the question's
        rows are dense by the policy already, and the prefix's few text rows (the chat
        template around the video) cost nothing dense."""
        index = self.head_config_index
        s = self.settings
        rungs = []
        for b in s.bounds:
            cfg, _ = reselect(self.head_config, self.head_report, index, max_error=b,
                              hard=s.hard, families=s.families)
            cfg = with_dense_text(cfg)
            cfg.uncalibrated = False
            rungs.append(Rung(b, cfg))
        return rungs

    @property
    def head_config_index(self):
        first = self.head_config.provenance["calibration_inputs"][0]["name"]
        return next(i.prefix_index for i in self.inputs if i.name == first)

    # ------------------------------------------------------------ the result
    def config(self, gate: dict | None = None,
               made_by: str = "mminfer self-calibration (served policy)"
               ) -> HeadPatternConfig | None:
        """The winner's config with how it was measured in its provenance (``gate``: what a
        gate then measured on held-out inputs)."""
        if self.winner is None:
            return None
        cfg = self.winner.config
        s = self.winner.summary()
        inputs = self.freeze()
        cfg.provenance = dict(
            cfg.provenance, made_by=made_by,
            served_policy={
                "objective": OBJECTIVE,
                "per_head_bound": self.winner.bound, "hard": self.settings.hard,
                **({"families": sorted(self.settings.families)} if self.settings.families
                   else {}),
                "min_agreement": self.min_agreement,
                "max_kl": self.max_kl, "max_density": self.settings.max_served_density,
                "engine": self.engine, "block": list(self.block),
                "max_new_tokens": self.settings.max_new_tokens,
                "inputs": [{"name": i.name, "source": i.source, "tokens": i.tokens}
                           for i in inputs],
                "searched": self.searched,
                "rungs": [{"bound": r.bound, **_round(r.summary())} for r in self.rungs
                          if r.rows],
                "calibration": _round(s), "forwards": self.forwards,
                **({"gate": gate} if gate is not None else {})})
        return cfg


OBJECTIVE = ("the served policy (the prefix sparse, estimated from its own last queries; the "
             "question's rows dense over it) against dense: greedy answers agree, last-token "
             "KL(dense || sparse)")


def _merge(results: dict, identity) -> tuple:
    """Per-layer search results into one config and report (each layer's choice is its own:
    the same as one search over every layer)."""
    layers = [list(row) for row in default_config(identity).layers]
    report, prov = [], None
    calibrated = []
    for layer, (cfg, rep) in sorted(results.items()):
        layers[layer] = list(cfg.layers[layer])
        report += rep
        calibrated.append(layer)
        prov = prov or dict(cfg.provenance)
    prov["layers_calibrated"] = calibrated
    prov["hard_heads"] = sorted([r["layer"], r["head"]] for r in report if r["hard"])
    out = HeadPatternConfig(identity, layers, uncalibrated=len(calibrated) < identity.layers,
                            provenance=prov)
    return out, report


def _round(s: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.items()}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_all(cal: ServedCalibration) -> ServedCalibration:
    """Every step at once (offline)."""
    for step in cal.steps():
        if step is not None:
            step()
    return cal


__all__ = ["ServedInput", "ServedRun", "ServedCalibration", "SearchSettings", "Step", "keep",
           "prepare", "run_served", "compare", "summarize", "holds", "run_all"]
