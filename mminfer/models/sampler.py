"""Choosing each answer token from the model's logits: greedy, or sampled (temperature, top-p,
a seed), with the log-probabilities a client asked for.

``pick(logits [B, vocab], params, generators)`` chooses one token per row, each row with its own
:class:`SamplingParams` and random stream, so decode steps of several requests can share one
pass; :class:`Sampler` is one answer's state (its params, its generator, the logprobs it kept)
and what the decode loop calls with each logits row.

* Greedy (``temperature`` 0, the default) is ``argmax``, the token the decode step's own
  ``argmax`` gives (the loop does not even ask for logits when nothing else is wanted).
* Sampling draws from ``softmax(logits / temperature)`` restricted to the top-p nucleus (the
  fewest most likely tokens whose mass reaches ``top_p``), by inverse CDF with one uniform
  number per step from the row's own CPU generator. A seed gives the same draws on every
  device and whatever else is batched with it, so the same seed gives the same answer (on the
  same logits: the same model, dtype and kernels); without one, a seed is drawn.
* Logprobs are the model's own log-softmax (temperature 1, no nucleus: what evaluation
  harnesses score), of the chosen token and of the ``top_logprobs`` most likely ones.

Stop strings are text, not tokens: mminfer.models.detokenize cuts the answer at them.
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

from mminfer.errors import InputError

MAX_TOP_LOGPROBS = 20          # OpenAI's limit
MAX_STOP = 16                  # stop strings per request
MAX_STOP_CHARS = 200           # characters per stop string
MAX_TEMPERATURE = 2.0          # OpenAI's range: [0, 2]


@dataclass(frozen=True)
class SamplingParams:
    """How one answer chooses its tokens. The defaults are greedy decoding with no stop
    string and no logprobs."""
    temperature: float = 0.0           # 0: greedy
    top_p: float = 1.0                 # nucleus mass in (0, 1]; 1: every token
    seed: int | None = None            # sampling without one: a random seed, drawn here
    stop: tuple[str, ...] = ()         # the answer ends before the first of these
    logprobs: bool = False             # report the chosen tokens' logprobs
    top_logprobs: int = 0              # and this many most likely alternatives (logprobs)

    def __post_init__(self):
        t, p = self.temperature, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
            raise InputError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], not {t!r}",
                             field="temperature")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (
                math.isfinite(p) and 0 < p <= 1):
            raise InputError(f"top_p must be in (0, 1], not {p!r}", field="top_p")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int)):
            raise InputError(f"seed must be an integer, not {self.seed!r}", field="seed")
        stop = self.stop
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise InputError("stop must be a list of strings", field="stop")
        if len(stop) > MAX_STOP:
            raise InputError(f"at most {MAX_STOP} stop strings, not {len(stop)}", field="stop")
        for s in stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise InputError(f"a stop string must have 1 to {MAX_STOP_CHARS} characters, "
                                 f"not {len(s)}", field="stop")
        k = self.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InputError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {k!r}",
                             field="top_logprobs")
        if k and not self.logprobs:
            raise InputError("top_logprobs needs logprobs=true", field="top_logprobs")
        if self.seed is None and not self.greedy:
            # drawn once, here: every copy of the params (tensor-parallel ranks) samples
            # alike, and the answer can say which seed it used
            object.__setattr__(self, "seed", secrets.randbits(63))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_logits(self) -> bool:
        """Whether a step must hand over its logits (else its own argmax is the token)."""
        return not self.greedy or self.logprobs


GREEDY = SamplingParams()


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's logprob and the ``top`` alternatives, most likely first."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def generator(seed: int | None) -> torch.Generator:
    """A CPU random stream: seeded (any integer, taken mod 2**64), or from the OS."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed % 2**64)
    return g


def pick(logits, params: Sequence[SamplingParams],
         generators: Sequence[torch.Generator | None]):
    """One token per row of ``logits`` ``[B, vocab]``, row ``i`` chosen by ``params[i]`` with
    ``generators[i]`` (needed where it samples). Returns ``(tokens, logprobs)``: a LongTensor
    ``[B]`` on the logits' device, and per row a :class:`TokenLogprob` where its params ask
    for logprobs, else None."""
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(f"{B} rows need {B} params and generators, not {len(params)} and "
                         f"{len(generators)}")
    x = logits.float()                 # exact upcast: the argmax of the rows is unchanged
    tokens = x.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        tokens[rows] = _sample(x[rows], [params[i] for i in rows],
                               [generators[i] for i in rows])
    out: list[TokenLogprob | None] = [None] * B
    asked = [i for i, p in enumerate(params) if p.logprobs]
    if asked:
        lp = torch.log_softmax(x[asked], -1)
        chosen = lp.gather(1, tokens[asked].unsqueeze(1)).squeeze(1).tolist()
        k = max(params[i].top_logprobs for i in asked)
        top_v, top_i = (lp.topk(k, -1) if k else (lp[:, :0], lp[:, :0].long()))
        top_v, top_i = top_v.tolist(), top_i.tolist()
        ids = tokens[asked].tolist()
        for j, i in enumerate(asked):
            n = params[i].top_logprobs
            out[i] = TokenLogprob(ids[j], chosen[j],
                                  tuple(zip(top_i[j][:n], top_v[j][:n])))
    return tokens, out


def _sample(x, params, generators):
    """Rows of fp32 logits ``x`` ``[R, vocab]`` sampled by temperature and top-p."""
    dev = x.device
    if any(g is None for g in generators):
        raise ValueError("a sampled row needs a generator")
    t = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    probs = torch.softmax(x / t.unsqueeze(1), -1)
    sp, order = probs.sort(dim=-1, descending=True, stable=True)
    # the nucleus: a token stays while the mass before it is under top_p (the first always)
    before = sp.cumsum(-1) - sp
    sp = torch.where(before < top_p.unsqueeze(1), sp, torch.zeros_like(sp))
    cdf = sp.cumsum(-1)
    # one uniform draw per row from its own CPU stream: the same draws on any device
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    target = (u.to(dev, torch.float32) * cdf[:, -1]).unsqueeze(1)
    j = torch.searchsorted(cdf, target, right=True).clamp_max(x.shape[1] - 1)
    return order.gather(1, j).squeeze(1)


class Sampler:
    """One answer's token choice: ``sampler(logits)`` (the last row of ``[..., vocab]``) →
    the token id, keeping its logprobs in ``logprobs`` when the params ask for them."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or GREEDY
        self.generator = None if self.params.greedy else generator(self.params.seed)
        self.logprobs: list[TokenLogprob] = []

    @property
    def needs_logits(self) -> bool:
        return self.params.needs_logits

    def __call__(self, logits) -> int:
        row = logits.reshape(-1, logits.shape[-1])[-1:]
        tokens, lps = pick(row, [self.params], [self.generator])
        if lps[0] is not None:
            self.logprobs.append(lps[0])
        return int(tokens[0])


# ------------------------------------------------------------------ logprobs as clients read them
def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """``(text, bytes)`` of one token: its text as decoded alone (special tokens included),
    and its exact UTF-8 bytes (a byte-level BPE piece of a character gives its own bytes, whose
    text alone is U+FFFD)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        table = _unicode_to_byte()
        if isinstance(piece, str) and piece and all(c in table for c in piece):
            return text, [table[c] for c in piece]
    return text, list(text.encode("utf-8"))


def openai_logprobs(tokenizer, logprobs: Sequence[TokenLogprob]) -> list[dict]:
    """OpenAI's ``choices[0].logprobs.content``: per answer token ``{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}, ...]}``."""
    texts: dict[int, tuple[str, list[int]]] = {}

    def entry(token_id: int, logprob: float) -> dict:
        if token_id not in texts:
            texts[token_id] = token_text(tokenizer, token_id)
        text, raw = texts[token_id]
        # -inf (a token the model gives no mass) is not JSON: OpenAI's floor instead
        return {"token": text, "logprob": max(float(logprob), -9999.0), "bytes": raw}

    return [{**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in logprobs]


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet (byte-level BPE vocabularies spell bytes with it),
    character -> byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}
