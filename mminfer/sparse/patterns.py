"""Head patterns: the offline choice per (layer, global head), and the config files holding them.

A ``HeadPattern`` is a boundary type plus one intra-modality ``Pattern`` per region:

* ``none`` / ``k``: one pattern for the whole head, key ``"all"`` (``k``: vertical budgets
  are split across key modalities, see ``estimate.py``);
* ``q``: one pattern per *query* modality (``"text"``, ``"video"``, ``"image"``);
* ``2d``: one pattern per (query modality, key modality) pair, key ``"video->text"``.

A config names every head of every layer (global head ids, so tensor-parallel rank r reads
``r * local_heads + h``), says which model it is for and how it was made. Loading one for a
different model is a ``ConfigError``, never a warning. The JSON layout (see
``configs/README.md``) keeps a table of named head patterns plus, per layer, a default name
and per-head overrides, so a 28 x 28 file stays readable.

No torch here: configs load in the CLI and the server without heavy imports.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from mminfer.errors import ConfigError

SCHEMA_VERSION = 1
KINDS = ("a_shape", "vertical_slash", "grid", "block", "dense")
BOUNDARIES = ("none", "k", "q", "2d")
QUERY_MODALITIES = ("text", "video", "image")
LINES = ("rows", "cols", "both")

# Budget fields of each kind, with their defaults. At 1M tokens with 128 x 64 tiles these
# cost about (physical tiles / causal triangle): a_shape 0.8 %, vertical_slash 2-3 %,
# grid at LongVILA's frame stride 257 2.0 %, block 1.6 % (configs/README.md: how checked).
# ``gamma`` (with ``min_density``/``max_density``) is the other way to size vertical_slash and
# block: by the proxy mass the selection covers instead of by counts (_MASS_KINDS below).
_FIELDS: dict[str, dict[str, Any]] = {
    "a_shape": {"sink": 128, "window": 4096},
    "vertical_slash": {"n_vertical": 1024, "n_slash": 64, "window": 256, "sink": 64,
                       "gamma": None, "min_density": None, "max_density": None},
    "grid": {"lines": "both", "sink": 128, "window": 6144, "min_lift": 3.0, "fallback": None},
    "block": {"top_k": 128, "window": 256, "gamma": None, "min_density": None,
              "max_density": None, "stride": None, "sink": None},
    "dense": {},
}
_ALL_FIELDS = ("kind", "sink", "window", "n_vertical", "n_slash", "lines", "min_lift",
               "fallback", "top_k", "gamma", "min_density", "max_density", "stride")
# Kinds that take a mass budget, and the count fields the mass budget replaces: a pattern has
# one or the other, never both (a file saying both would leave unclear which one rules).
_MASS_KINDS = {"vertical_slash": ("n_vertical", "n_slash"), "block": ("top_k",)}
_MASS_FIELDS = ("gamma", "min_density", "max_density")
MASS_DEFAULTS = {"min_density": 0.0, "max_density": 0.3}


@dataclass(frozen=True)
class Pattern:
    """One intra-modality pattern with its budget. Fields that a kind does not use stay None;
    fields it uses and that are left None get the kind's default (``_FIELDS``).

    * ``a_shape(sink, window)``: the first ``sink`` keys + a local window;
    * ``vertical_slash(n_vertical, n_slash, window, sink)``: top verticals and diagonals of
      the proxy; the first ``sink`` columns are forced-in verticals, diagonals closer than
      ``window`` are the near range;
    * ``grid(lines, sink, window, min_lift, fallback)``: lines every ``stride`` tokens at the
      best phase (estimated online); rows, columns or both; a best lift under ``min_lift``
      uses ``fallback`` (default: vertical_slash with its defaults);
    * ``block(top_k, window, stride)``: ``top_k`` key blocks per query block, ranked by the
      attention of mean-pooled queries on mean-pooled keys, or, with ``stride`` S, by the
      antidiagonal scores of S x S groups (XAttention's proxy: every query and key read,
      1/S of QK^T; a single landmark key is not averaged away as it is by pooling);
      ``sink`` (default none): every row block also keeps the key blocks holding the first
      ``sink`` keys, outside its budget (the attention sink and the video's first frames,
      which a ranking by share misses: lab/NOTES.md section 4);
    * ``dense``: every causal pair.

    Mass budgets (vertical_slash and block): with ``gamma`` set instead of the counts, the
    estimate keeps verticals and slashes (by mass per cost: a slash costs ``block_n`` keys
    per row; block: key blocks, per row block, by mass) until the mass covered, counting the
    near window and the sinks first, reaches ``gamma`` of the total, then clamps what it
    kept to ``[min_density, max_density]`` of the layer's keys (vertical_slash: the lines'
    cost; block: key blocks of its key blocks). Per head and per request, on the device
    (``mass.py``, ``configs/README.md``).
    """
    kind: str
    sink: Optional[int] = None
    window: Optional[int] = None
    n_vertical: Optional[int] = None
    n_slash: Optional[int] = None
    lines: Optional[str] = None
    min_lift: Optional[float] = None
    fallback: Optional["Pattern"] = None
    top_k: Optional[int] = None
    gamma: Optional[float] = None
    min_density: Optional[float] = None
    max_density: Optional[float] = None
    stride: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"pattern kind {self.kind!r} is not one of {', '.join(KINDS)}")
        own = _FIELDS[self.kind]
        mass = self.gamma is not None
        for name in _ALL_FIELDS[1:]:
            value = getattr(self, name)
            if name not in own:
                if value is not None:
                    raise ConfigError(f"{self.kind} pattern has no field {name!r} "
                                      f"(its fields: {', '.join(own) or 'none'})")
            elif name in _MASS_KINDS.get(self.kind, ()) and mass:
                if value is not None:
                    raise ConfigError(f"{self.kind} pattern: gamma (a mass budget) and "
                                      f"{name} (a count) are exclusive; give one of them")
            elif name in _MASS_FIELDS:
                if not mass and value is not None:
                    raise ConfigError(f"{self.kind} pattern: {name} bounds a mass budget and "
                                      f"needs gamma")
                if mass and value is None and name in MASS_DEFAULTS:
                    object.__setattr__(self, name, MASS_DEFAULTS[name])
            elif value is None:
                default = own[name]
                if name == "fallback" and default is None:
                    default = Pattern("vertical_slash")
                object.__setattr__(self, name, default)
        for name in ("sink", "window", "n_vertical", "n_slash", "top_k"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 0):
                raise ConfigError(f"{self.kind} {name} must be an int >= 0, got {value!r}")
        if self.stride is not None and (not isinstance(self.stride, int)
                                        or isinstance(self.stride, bool) or self.stride < 1
                                        or self.stride & (self.stride - 1)):
            raise ConfigError(f"block stride must be a power of two >= 1, got {self.stride!r}")
        if self.kind == "grid":
            if self.lines not in LINES:
                raise ConfigError(f"grid lines {self.lines!r} is not one of {', '.join(LINES)}")
            if not isinstance(self.min_lift, (int, float)) or self.min_lift < 0:
                raise ConfigError(f"grid min_lift must be a number >= 0, got {self.min_lift!r}")
            object.__setattr__(self, "min_lift", float(self.min_lift))
            if not isinstance(self.fallback, Pattern) or self.fallback.kind == "grid":
                raise ConfigError("grid fallback must be a non-grid pattern")
        if mass:
            for name in _MASS_FIELDS:
                value = getattr(self, name)
                if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                        not 0 <= value <= 1:
                    raise ConfigError(f"{self.kind} {name} must be a number in [0, 1], "
                                      f"got {value!r}")
                object.__setattr__(self, name, float(value))
            if self.gamma <= 0:
                raise ConfigError(f"{self.kind} gamma must be > 0, got {self.gamma!r}")
            if self.min_density > self.max_density:
                raise ConfigError(f"{self.kind} min_density {self.min_density} is above "
                                  f"max_density {self.max_density}")

    @property
    def mass(self) -> bool:
        """True when the budget is a mass target (``gamma``), not counts."""
        return self.gamma is not None

    def params(self) -> dict:
        """The kind's own fields that are set (what goes into the JSON besides ``kind``): a
        count budget writes its counts, a mass budget gamma and its bounds."""
        return {name: getattr(self, name) for name in _FIELDS[self.kind]
                if getattr(self, name) is not None}

    def to_dict(self) -> dict:
        d = {"kind": self.kind}
        for name, value in self.params().items():
            d[name] = value.to_dict() if isinstance(value, Pattern) else value
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "pattern") -> "Pattern":
        if not isinstance(d, dict):
            raise ConfigError(f"config {where} must be an object, got {type(d).__name__}")
        if "kind" not in d:
            raise ConfigError(f"config {where} is missing field 'kind'")
        kind = d["kind"]
        if kind not in KINDS:
            raise ConfigError(f"config {where}.kind = {kind!r} is not one of {', '.join(KINDS)}")
        extra = set(d) - {"kind"} - set(_FIELDS[kind])
        if extra:
            own = ", ".join(_FIELDS[kind]) or "none"
            raise ConfigError(f"config {where}: unknown field(s) {', '.join(sorted(extra))} for "
                              f"a {kind} pattern (its fields: {own})")
        kw = {k: v for k, v in d.items() if k != "kind"}
        if kw.get("fallback") is not None:
            kw["fallback"] = cls.from_dict(kw["fallback"], f"{where}.fallback")
        try:
            return cls(kind, **kw)
        except ConfigError as e:
            raise ConfigError(f"config {where}: {e.message}") from None


def a_shape(sink: int | None = None, window: int | None = None) -> Pattern:
    return Pattern("a_shape", sink=sink, window=window)


def vertical_slash(n_vertical=None, n_slash=None, window=None, sink=None, *, gamma=None,
                   min_density=None, max_density=None) -> Pattern:
    return Pattern("vertical_slash", n_vertical=n_vertical, n_slash=n_slash, window=window,
                   sink=sink, gamma=gamma, min_density=min_density, max_density=max_density)


def grid(lines=None, sink=None, window=None, min_lift=None, fallback=None) -> Pattern:
    return Pattern("grid", lines=lines, sink=sink, window=window, min_lift=min_lift,
                   fallback=fallback)


def block(top_k=None, window=None, *, gamma=None, min_density=None,
          max_density=None, stride=None, sink=None) -> Pattern:
    return Pattern("block", top_k=top_k, window=window, gamma=gamma, min_density=min_density,
                   max_density=max_density, stride=stride, sink=sink)


def dense() -> Pattern:
    return Pattern("dense")


@dataclass(frozen=True)
class HeadPattern:
    """Boundary type + pattern per region (see the module docstring for the keys)."""
    boundary: str
    patterns: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.boundary not in BOUNDARIES:
            raise ConfigError(f"boundary {self.boundary!r} is not one of {', '.join(BOUNDARIES)}")
        for key, p in self.patterns.items():
            if not isinstance(p, Pattern):
                raise ConfigError(f"head pattern {key!r} must be a Pattern")
            _check_key(self.boundary, key)
        if self.boundary in ("none", "k") and "all" not in self.patterns:
            raise ConfigError(f"a {self.boundary}-boundary head needs the pattern 'all'")
        if self.boundary in ("q", "2d") and not self.patterns:
            raise ConfigError(f"a {self.boundary}-boundary head needs at least one pattern")

    @classmethod
    def single(cls, pattern: Pattern, boundary: str = "none") -> "HeadPattern":
        return cls(boundary, {"all": pattern})

    def for_region(self, qmod: str | None, kmod: str | None = None) -> Pattern:
        """The pattern of the rows of ``qmod`` (and, for 2D, the keys of ``kmod``).
        Lookup: the exact key, then the other visual modality (image <-> video), then
        ``"all"``; a region with none of them is dense (never silently skipped)."""
        p = self.patterns
        if self.boundary in ("none", "k") or qmod is None:
            return p.get("all") or next(iter(p.values()))
        alias = {"image": "video", "video": "image"}
        if self.boundary == "q":
            keys = [qmod, alias.get(qmod)]
        else:
            keys = [f"{qmod}->{kmod}", f"{alias.get(qmod, qmod)}->{kmod}",
                    f"{qmod}->{alias.get(kmod, kmod)}",
                    f"{alias.get(qmod, qmod)}->{alias.get(kmod, kmod)}"]
        for key in keys + ["all"]:
            if key in p:
                return p[key]
        return dense()

    def kinds(self) -> set:
        return {p.kind for p in self.patterns.values()}

    def to_dict(self) -> dict:
        return {"boundary": self.boundary,
                "patterns": {k: v.to_dict() for k, v in self.patterns.items()}}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "HeadPattern":
        if not isinstance(d, dict):
            raise ConfigError(f"config {where} must be an object, got {type(d).__name__}")
        for name in ("boundary", "patterns"):
            if name not in d:
                raise ConfigError(f"config {where} is missing field {name!r}")
        extra = set(d) - {"boundary", "patterns"}
        if extra:
            raise ConfigError(f"config {where}: unknown field(s) {', '.join(sorted(extra))}")
        if d["boundary"] not in BOUNDARIES:
            raise ConfigError(f"config {where}.boundary = {d['boundary']!r} is not one of "
                              f"{', '.join(BOUNDARIES)}")
        if not isinstance(d["patterns"], dict):
            raise ConfigError(f"config {where}.patterns must be an object")
        pats = {}
        for key, pd in d["patterns"].items():
            try:
                _check_key(d["boundary"], key)
            except ConfigError as e:
                raise ConfigError(f"config {where}.patterns: {e.message}") from None
            pats[key] = Pattern.from_dict(pd, f"{where}.patterns.{key}")
        try:
            return cls(d["boundary"], pats)
        except ConfigError as e:
            raise ConfigError(f"config {where}: {e.message}") from None


def _check_key(boundary: str, key: str):
    if key == "all":
        return
    if boundary in ("none", "k"):
        raise ConfigError(f"a {boundary}-boundary head takes only the key 'all', got {key!r}")
    if boundary == "q" and key not in QUERY_MODALITIES:
        raise ConfigError(f"q-boundary key {key!r} is not one of all, "
                          f"{', '.join(QUERY_MODALITIES)}")
    if boundary == "2d":
        parts = key.split("->")
        if len(parts) != 2 or any(x not in QUERY_MODALITIES for x in parts):
            raise ConfigError(f"2d-boundary key {key!r} must be 'qmod->kmod' with modalities "
                              f"in {', '.join(QUERY_MODALITIES)}")


@dataclass(frozen=True)
class ModelIdentity:
    id: str
    revision: str = "main"
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


_IDENTITY_TYPES = {"id": str, "revision": str, "layers": int, "heads": int, "kv_heads": int,
                   "head_dim": int}


@dataclass
class HeadPatternConfig:
    identity: ModelIdentity
    layers: list                       # [layer][global head] -> HeadPattern
    uncalibrated: bool = True
    provenance: dict = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # Names of the head patterns in the file's table (canonical JSON -> name), kept so a
    # loaded and saved file keeps its names.
    names: dict = field(default_factory=dict, repr=False, compare=False)
    # How online estimation reads this model (ESTIMATION's keys); empty: the method's default.
    estimation: dict = field(default_factory=dict)
    # piece_layer's layers, derived once per share (init=False: a replace() starts afresh)
    _pieces: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def spread_queries(self) -> int:
        """Queries spread over the sequence that estimation adds to the last ones (0: none)."""
        return int(self.estimation.get("spread_queries", 0))

    @property
    def piece_lines(self) -> float:
        """The share of a count budget's lines a piece's plan takes (1: all; ESTIMATION)."""
        return float(self.estimation.get("piece_lines", 1.0))

    def piece_layer(self, i: int) -> list:
        """Layer ``i``'s HeadPatterns as the plan of rows appended at an offset (a live
        stream's piece) uses them: vertical_slash's count budgets (also as a grid's fallback)
        scaled by :attr:`piece_lines`. A one-shot prefill's row sees on average half of its
        plan's lines (those before it), a piece's rows nearly all of theirs: at 0.5 a video
        ingested in pieces computes about the tiles of its one-shot prefill
        (lab/experiments/piece_tiles.py). The layer itself when the share is 1."""
        row, share = self.layer(i), self.piece_lines
        if share >= 1.0:
            return row
        if share not in self._pieces:
            made: dict = {}                    # a pattern several heads share: scaled once
            for hp in (hp for layer in self.layers for hp in layer):
                if id(hp) not in made:
                    made[id(hp)] = _piece_head(hp, share)
            self._pieces[share] = [[made[id(hp)] for hp in layer] for layer in self.layers]
        return self._pieces[share][i]

    # ------------------------------------------------------------------ access
    def layer(self, i: int) -> list:
        """HeadPattern of every global head of layer ``i``."""
        if not 0 <= i < len(self.layers):
            raise ConfigError(f"layer {i} is outside the config's {len(self.layers)} layers")
        return self.layers[i]

    def heads_for_rank(self, layer: int, rank: int, local_heads: int,
                       piece: bool = False) -> list:
        """Tensor parallelism: rank ``r`` holds global heads ``r * local_heads + h``;
        ``piece``: as a piece's plan uses them (:meth:`piece_layer`)."""
        row = self.piece_layer(layer) if piece else self.layer(layer)
        lo = rank * local_heads
        if rank < 0 or lo + local_heads > len(row):
            raise ConfigError(f"rank {rank} x {local_heads} local heads exceeds the "
                              f"{len(row)} heads of layer {layer}")
        return row[lo:lo + local_heads]

    @classmethod
    def uniform(cls, identity: ModelIdentity, head: HeadPattern, **kw) -> "HeadPatternConfig":
        return cls(identity, [[head] * identity.heads for _ in range(identity.layers)], **kw)

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict:
        names: dict[str, str] = {}     # canonical JSON of a head pattern -> its name
        table: dict[str, dict] = {}
        layers = []
        for row in self.layers:
            ids = []
            for hp in row:
                key = json.dumps(hp.to_dict(), sort_keys=True)
                if key not in names:
                    names[key] = self.names.get(key) or _auto_name(hp, table)
                    if names[key] in table:
                        names[key] = _auto_name(hp, table)
                    table[names[key]] = hp.to_dict()
                ids.append(names[key])
            default = max(dict.fromkeys(ids), key=ids.count)   # ties: first seen
            over = {str(h): n for h, n in enumerate(ids) if n != default}
            layers.append({"default": default, "heads": over} if over else {"default": default})
        out = {"schema_version": self.schema_version, "model": self.identity.to_dict(),
               "uncalibrated": self.uncalibrated, "provenance": self.provenance}
        if self.estimation:          # absent from files that keep the default
            out["estimation"] = dict(self.estimation)
        return {**out, "patterns": table, "layers": layers}

    def save(self, path) -> None:
        d = self.to_dict()
        # One layer per line keeps a 28-layer file diffable without a line per head.
        head = {k: v for k, v in d.items() if k != "layers"}
        text = json.dumps(head, indent=2)[:-2]
        text += ',\n  "layers": [\n' + ",\n".join(
            "    " + json.dumps(row) for row in d["layers"]) + "\n  ]\n}\n"
        Path(path).write_text(text)

    @classmethod
    def from_dict(cls, d: Any, expect: ModelIdentity | None = None) -> "HeadPatternConfig":
        if not isinstance(d, dict):
            raise ConfigError("config must be a JSON object")
        for name in ("schema_version", "model", "uncalibrated", "provenance", "patterns",
                     "layers"):
            if name not in d:
                raise ConfigError(f"config is missing field {name!r}")
        extra = set(d) - {"schema_version", "model", "uncalibrated", "provenance", "patterns",
                          "layers", "estimation"}
        if extra:
            raise ConfigError(f"config: unknown field(s) {', '.join(sorted(extra))}")
        if d["schema_version"] != SCHEMA_VERSION:
            raise ConfigError(f"config schema_version = {d['schema_version']!r} but this mminfer "
                              f"reads {SCHEMA_VERSION}")
        identity = _identity(d["model"])
        if expect is not None:
            for f in fields(ModelIdentity):
                got, want = getattr(identity, f.name), getattr(expect, f.name)
                if got != want:
                    raise ConfigError(f"config model.{f.name} = {got!r} but the model has "
                                      f"{want!r}", field=f"model.{f.name}")
        if not isinstance(d["uncalibrated"], bool):
            raise ConfigError(f"config uncalibrated must be true or false, "
                              f"got {d['uncalibrated']!r}")
        if not isinstance(d["provenance"], dict):
            raise ConfigError("config provenance must be an object")
        if not isinstance(d["patterns"], dict):
            raise ConfigError("config patterns must be an object of named head patterns")
        table = {name: HeadPattern.from_dict(hp, f"patterns.{name}")
                 for name, hp in d["patterns"].items()}
        rows = d["layers"]
        if not isinstance(rows, list):
            raise ConfigError("config layers must be a list")
        if len(rows) != identity.layers:
            raise ConfigError(f"config has {len(rows)} layers but model.layers = "
                              f"{identity.layers}")
        layers = [_layer_row(row, i, table, identity.heads) for i, row in enumerate(rows)]
        names = {json.dumps(hp.to_dict(), sort_keys=True): name for name, hp in table.items()}
        return cls(identity, layers, d["uncalibrated"], d["provenance"], d["schema_version"],
                   names, _estimation(d.get("estimation", {})))

    @classmethod
    def load(cls, path, expect: ModelIdentity | None = None) -> "HeadPatternConfig":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"head-pattern config {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"head-pattern config {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d, expect)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e.message}", **e.details) from None


# Estimation settings a config may carry: name -> (type, what it is).
ESTIMATION = {"spread_queries": (int, "queries spread evenly over the sequence (past its "
                                      "first eighth) that the proxy reads besides the last ones: "
                                      "for heads whose attention depends on content, which the "
                                      "last queries alone do not show"),
              "piece_lines": (float, "the share (0, 1] of vertical_slash's count budgets "
                                     "(n_vertical, n_slash) that the plan of a piece appended "
                                     "at an offset (a live stream's) takes: its rows see nearly "
                                     "all of its lines, a one-shot's rows half on average")}


def _piece_pattern(p: Pattern, share: float) -> Pattern:
    if p.kind == "vertical_slash" and p.gamma is None:
        return replace(p, n_vertical=max(1, math.ceil(p.n_vertical * share)),
                       n_slash=max(1, math.ceil(p.n_slash * share)))
    if p.kind == "grid" and p.fallback is not None:
        return replace(p, fallback=_piece_pattern(p.fallback, share))
    return p


def _piece_head(hp: HeadPattern, share: float) -> HeadPattern:
    return HeadPattern(hp.boundary, {k: _piece_pattern(p, share) for k, p in hp.patterns.items()})


def _estimation(e: Any) -> dict:
    if not isinstance(e, dict):
        raise ConfigError("config estimation must be an object")
    extra = set(e) - set(ESTIMATION)
    if extra:
        raise ConfigError(f"config estimation: unknown field(s) {', '.join(sorted(extra))} "
                          f"(known: {', '.join(ESTIMATION)})")
    for name, (typ, _) in ESTIMATION.items():
        ok = (int, float) if typ is float else typ       # a share may be written as 1
        if name in e and (not isinstance(e[name], ok) or isinstance(e[name], bool)
                          or e[name] < 0):
            raise ConfigError(f"config estimation.{name} must be a {typ.__name__} >= 0, "
                              f"got {e[name]!r}")
    if "piece_lines" in e and not 0 < e["piece_lines"] <= 1:
        raise ConfigError(f"config estimation.piece_lines must be in (0, 1], "
                          f"got {e['piece_lines']!r}")
    return dict(e)


def _identity(m: Any) -> ModelIdentity:
    if not isinstance(m, dict):
        raise ConfigError("config model must be an object")
    for name, typ in _IDENTITY_TYPES.items():
        if name not in m:
            raise ConfigError(f"config is missing field model.{name}")
        if not isinstance(m[name], typ) or isinstance(m[name], bool):
            raise ConfigError(f"config model.{name} must be {typ.__name__}, got {m[name]!r}")
        if typ is int and m[name] <= 0:
            raise ConfigError(f"config model.{name} must be > 0, got {m[name]}")
    extra = set(m) - set(_IDENTITY_TYPES)
    if extra:
        raise ConfigError(f"config model: unknown field(s) {', '.join(sorted(extra))}")
    if m["heads"] % m["kv_heads"]:
        raise ConfigError(f"config model.heads = {m['heads']} is not a multiple of "
                          f"model.kv_heads = {m['kv_heads']}")
    return ModelIdentity(**m)


def _layer_row(row: Any, i: int, table: dict, n_heads: int) -> list:
    where = f"layers[{i}]"

    def resolve(ref, at):
        if isinstance(ref, str):
            if ref not in table:
                raise ConfigError(f"config {at} names pattern {ref!r}, which is not in patterns")
            return table[ref]
        return HeadPattern.from_dict(ref, at)   # an inline head pattern is fine too

    if not isinstance(row, dict) or "default" not in row:
        raise ConfigError(f"config {where} must be an object with a 'default' pattern")
    extra = set(row) - {"default", "heads"}
    if extra:
        raise ConfigError(f"config {where}: unknown field(s) {', '.join(sorted(extra))}")
    out = [resolve(row["default"], f"{where}.default")] * n_heads
    for h, ref in (row.get("heads") or {}).items():
        if not (isinstance(h, str) and h.isdigit() and int(h) < n_heads):
            raise ConfigError(f"config {where}.heads: head {h!r} is not in [0, {n_heads})")
        out[int(h)] = resolve(ref, f"{where}.heads.{h}")
    return out


def _auto_name(hp: HeadPattern, table: dict) -> str:
    kinds = "+".join(sorted(hp.kinds()))
    base = f"{hp.boundary}:{kinds}"
    name, i = base, 1
    while name in table:
        i += 1
        name = f"{base}#{i}"
    return name


def provenance(**kw) -> dict:
    """Provenance with today's date (UTC) filled in."""
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"), **kw}


# ---------------------------------------------------------------------- shipped defaults
KNOWN_MODELS = {
    "Qwen/Qwen2.5-VL-7B-Instruct": ModelIdentity(
        "Qwen/Qwen2.5-VL-7B-Instruct", "main", layers=28, heads=28, kv_heads=4, head_dim=128),
    "Efficient-Large-Model/qwen2-7b-longvila-1M": ModelIdentity(
        "Efficient-Large-Model/qwen2-7b-longvila-1M", "main", layers=28, heads=28, kv_heads=4,
        head_dim=128),
}


def default_head_patterns() -> dict[str, HeadPattern]:
    """The named head patterns of the uncalibrated configs (configs/README.md)."""
    vs = vertical_slash()
    return {
        # Video rows: grid lines at the estimated stride/phase (vertical_slash when the lift
        # is weak); text rows (the question): vertical_slash over everything before them.
        "q_grid": HeadPattern("q", {"video": grid(fallback=vs), "image": grid(fallback=vs),
                                    "text": vs}),
        # Verticals split between text and visual keys (text keys are few but heavy).
        "k_vs": HeadPattern("k", {"all": vs}),
        "a_shape": HeadPattern("none", {"all": a_shape()}),
        "vs": HeadPattern("none", {"all": vs}),
    }


def default_config(identity: ModelIdentity) -> HeadPatternConfig:
    """An uncalibrated mix: the first two layers vertical_slash (their attention is broad and
    local, little grid structure); elsewhere, per GQA group (7 heads for 28/4), one
    K-boundary vertical_slash head, one A-shape head and the rest Q-boundary grid heads. ``mminfer
    calibrate`` replaces it with measured choices."""
    named = default_head_patterns()
    group = identity.heads // identity.kv_heads
    layers = []
    for layer in range(identity.layers):
        row = []
        for h in range(identity.heads):
            if layer < 2 or h % group == 0:
                row.append(named["k_vs"])
            elif group > 3 and h % group == 3:
                row.append(named["a_shape"])
            else:
                row.append(named["q_grid"])
        layers.append(row)
    cfg = HeadPatternConfig(identity, layers, uncalibrated=True, provenance=provenance(
        made_by="mminfer.sparse.patterns.default_config", calibration_inputs=[],
        objective=None, budgets=None, device=None,
        note="uncalibrated starting point; run `mminfer calibrate` to replace it"))
    cfg.names = {json.dumps(hp.to_dict(), sort_keys=True): name for name, hp in named.items()}
    return cfg
