"""Self-calibration: a server whose weights have no measured head-pattern config measures one
itself, in idle time, from its own traffic and from synthetic videos, gates it, serves it, and
keeps checking it.

When it runs: ``--attention auto`` where sparse attention can run and "auto" would go sparse
(a GPU, or the CPU's Triton interpreter with ``--min-sparse-len``), one process (no tensor
parallelism), and the loaded config is uncalibrated (the shipped 7B configs are a starting
point nobody measured on the real weights). A config that serves already (measured before,
shipped measured) is only checked (below).

The weights are identified by a digest of their files, not by a path (:func:`weights_digest`):
a copy of a checkpoint elsewhere, or under another name, finds its config; a fine-tune does not.
The calibration cache (``--calibration-dir``, default ``<data-dir>/calibration``) holds
``<digest>.json``, a head-pattern config whose provenance says how it was measured; the next
start with the same weights serves it at once. A calibration that ends with no config (no rung
holds, or only too densely; every candidate failed the gate) leaves ``<digest>.failed.json``:
why, and the thresholds it ran under. A start with the same weights and thresholds serves
dense at once and says so; other thresholds, or removing the file, calibrate again.

Until a config passes, the server serves dense, and in idle time it works through small steps
(offline/served_policy.py). A step starts only while nothing is queued, uploading or in
progress. It checks before every decoder layer, decode step and candidate's run; a request
that arrives meanwhile pauses it there (the scheduler's IDLE work, serve/worker.py): the step
keeps its frame and resumes where it stopped once no request is left, unless a request
building a prefix finds the device short (VideoCache.make_room), or one runs out of memory;
then it gives up the room it holds and runs again from its start later (as every step does
under ``--max-num-seqs 1``). The steps:

1. synthetic videos (``synth:TASK:FRAMES:SEED``, rendered in-process) prepared and run through
   the vision tower, before any request arrives; with ``--calibrate-from-requests`` (the
   default) the first requests' prompts are kept too, on the host (their embeddings after the
   vision tower, never the video), within ``--calibration-capture-mb``;
2. each input's dense served run (the reference), capturing q/k/v of its prefix for the
   per-head search (a request answered greedy and dense, with nothing to capture, has its
   answer as its reference: no run of its own); the search (per layer); a ladder of configs
   from it;
3. once ``--calibration-requests`` requests are kept, the ladder scored on the inputs by what is
   served (the prefix sparse, the question's rows dense over it), cheapest rung first: the
   first that holds the thresholds (``--calibration-min-agreement`` of greedy answers agreeing
   with dense, mean last-token KL at most ``--calibration-max-kl``) is the candidate;
4. the gate: the candidate is run on ``--calibration-gate-requests`` later requests it was not
   calibrated on (held-out synthetic videos with ``--no-calibrate-from-requests``) and serves
   only if it holds the thresholds there too. Then it is stored under the digest and "auto"
   goes sparse. A candidate that fails the gate: the next tighter rung that holds on the
   calibration inputs is gated on new requests (at most ``MAX_ROUNDS`` candidates; then the
   server stays dense and says why).

Host memory: the kept prompts stay within ``--calibration-capture-mb``, half of it for the
calibration's requests (it goes with fewer when they fill it), half for the gate's waiting
their turn (a prompt is dropped once the gate scored it); all are dropped once a config serves.

Keeps checking: every shadow comparison (serve/shadow.py, ``--shadow-rate``) of the config that
serves goes into a window of the last ``--calibration-window``; once the window is full, an
agreement below the threshold or a mean KL above it puts the uncalibrated config back ("auto"
is dense again), marks the stored config rejected (``<digest>.rejected.json``) and starts a new
calibration.

What it says: the log at each change; ``/v1/models`` (``mminfer.self_calibration``) and
``/report``: which config serves, where it came from, measured how and on how many inputs,
the thresholds, the drift window, the counts; ``/metrics`` the same as series
(:class:`SelfCalibrationCollector`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mminfer.engine.scheduler import device_drain
from mminfer.errors import Cancelled
from mminfer.models.base import resolve_checkpoint
from mminfer.offline.capture import synthetic_video
from mminfer.offline.served_policy import (SearchSettings, ServedCalibration, Step,
                                           answered_reference, captures, holds, keep, prepare,
                                           summarize)
from mminfer.offline.thresholds import MAX_KL, MAX_SERVED_DENSITY, MIN_AGREEMENT
from mminfer.models.hooks import AUTO_NEVER
from mminfer.sparse.patterns import HeadPatternConfig, default_config

from .worker import _is_oom, is_fatal

log = logging.getLogger("mminfer.serve")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
EDGE_BYTES = 1 << 20          # of each weight file, the first and the last MiB are hashed
MAX_ROUNDS = 3                # candidates gated before a server gives up and stays dense
SYNTH_TASKS = ("needle", "count", "order", "colour")
SYNTH_SEED = 920000           # synthetic calibration videos: seeds no training or eval uses
SYNTH_TOKENS = 16384          # "auto" frames: the most whose visual tokens fit this
SYNTH_MAX_FRAMES = 768


def weights_digest(path) -> str:
    """A digest of a checkpoint's weights, cheap at any size: sha256 over every weight file
    under ``path`` (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``; and every
    ``config.json``, which says how the weights are read), in the order of their paths
    relative to ``path``, of each its relative path, its size, its first and its last MiB.
    The same files anywhere have the same digest; any change of size, of either end of a
    file, or of a file's name or place changes it (a change only in the middle of a file
    does not: the price of reading 2 MiB of a 15 GB checkpoint instead of all of it)."""
    root = Path(path)
    files = sorted((p for p in root.rglob("*") if p.is_file() and (
        p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")),
        key=lambda p: p.relative_to(root).as_posix())
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise ValueError(f"{root} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    h = hashlib.sha256()
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(root).as_posix()}\0{size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                h.update(f.read(EDGE_BYTES))
    return h.hexdigest()[:32]


class CalibrationCache:
    """Measured configs by weights digest: ``<dir>/<digest>.json`` (a HeadPatternConfig
    file), ``<digest>.rejected.json`` once drift retired it, ``<digest>.failed.json`` when a
    calibration found none."""

    def __init__(self, root):
        self.root = Path(root)

    def path(self, digest: str) -> Path:
        return self.root / f"{digest}.json"

    def load(self, digest: str, identity):
        """The stored config for these weights, with the loaded model's identity (the
        weights are the same; the folder's name may not be), or None. A file of another
        shape is an error."""
        p = self.path(digest)
        if not p.is_file():
            return None
        cfg = HeadPatternConfig.load(p)
        got, want = cfg.identity, identity
        if (got.layers, got.heads, got.kv_heads, got.head_dim) != \
                (want.layers, want.heads, want.kv_heads, want.head_dim):
            raise ValueError(f"{p}: a config for {got.layers} layers x {got.heads} heads, "
                             f"the model has {want.layers} x {want.heads}")
        cfg.identity = identity
        return cfg

    def save(self, digest: str, cfg) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.path(digest)
        tmp = p.with_suffix(".tmp")
        cfg.save(tmp)
        tmp.replace(p)
        self.failed_path(digest).unlink(missing_ok=True)    # other thresholds found one
        return p

    def failed_path(self, digest: str) -> Path:
        return self.root / f"{digest}.failed.json"

    def load_failure(self, digest: str) -> dict | None:
        """The verdict of a calibration of these weights that ended with no config, or None
        (an unreadable record is none: the next calibration writes it again)."""
        p = self.failed_path(digest)
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) and isinstance(d.get("thresholds"), dict) else None

    def save_failure(self, digest: str, record: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        p = self.failed_path(digest)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(p)
        return p

    def reject(self, digest: str, why: str):
        p = self.path(digest)
        if p.is_file():
            out = self.root / f"{digest}.rejected.json"
            d = json.loads(p.read_text())
            d.setdefault("provenance", {})["rejected"] = {"why": why, "date": _now()}
            out.write_text(json.dumps(d, indent=1))
            p.unlink()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")


class SelfCalibration:
    """The server's self-calibration (see the module doc). The worker calls :meth:`ready`
    (under its lock, when idle), :meth:`run_step` (on its dispatching thread) and
    :meth:`preempt` (a request arrived); the pipeline calls the observer it is given
    (:meth:`observe`, a request's prompt before its prefill); the shadow monitor calls
    :meth:`on_comparison`; everything else reads :meth:`status`."""

    def __init__(self, *, model_path: str, cache_dir, from_requests: bool = True,
                 capture_bytes: int = 8 << 30, min_agreement: float = MIN_AGREEMENT,
                 max_kl: float = MAX_KL, max_density: float = MAX_SERVED_DENSITY,
                 requests: int = 8, gate_requests: int = 16,
                 window: int = 50, synthetic: int = 3, synthetic_frames: int = 0,
                 settings=None):
        if not 0 <= min_agreement <= 1 or max_kl < 0 or not 0 < max_density <= 1:
            raise ValueError("min_agreement must be in [0, 1], max_kl >= 0 and max_density "
                             "in (0, 1]")
        if gate_requests < 1 or window < 1 or synthetic < 1 or requests < 0:
            raise ValueError("gate_requests, window and synthetic must be >= 1, requests >= 0")
        self.model_path = model_path
        self.cache = CalibrationCache(cache_dir)
        self.from_requests = bool(from_requests)
        self.capture_bytes = int(capture_bytes)
        self.min_agreement = float(min_agreement)
        self.max_kl = float(max_kl)
        self.requests = int(requests) if from_requests else 0
        self.gate_requests = int(gate_requests)
        self.window = collections.deque(maxlen=int(window))
        self.synthetic = int(synthetic)
        self.synthetic_frames = int(synthetic_frames)
        self.search = settings               # served_policy.SearchSettings (None: device's)
        self.max_density = float(max_density)   # the settings' max_served_density
        self.state = "new"     # new | off | calibrating | gating | serving | failed | error
        self.source: str | None = None       # where the config that serves came from
        self.digest: str | None = None
        self.why: str | None = None           # off / failed / error: why; fallback: what
        self.fallbacks: list = []
        self.measured: dict | None = None     # the served config's served_policy provenance
        self.step_seconds: list = []          # each calibration step's wall time
        self.steps_run = 0
        self.steps_stopped = 0                # stopped by a request, run again later
        self.steps_paused = 0                 # pauses for requests, each resumed in place
        self.references_from_answers = 0      # dense references the requests' answers gave
        self.round = 0
        self.pipeline = None
        self.baseline = None                  # the uncalibrated config: what dense falls to
        self.inputs: list = []                # served_policy.ServedInput
        self.cal = None                       # the round's served_policy.ServedCalibration
        self.gate_rows: list = []
        self.gates_failed: list = []          # candidates the gate turned down
        self._calib_full = False              # half the capture budget held: go with those
        self._gen = None
        self._step = None
        self._waiting = False                 # the plan waits for a new input
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._n_kept = 0
        self._version = 0                     # inputs added so far
        # counts since the start, for /metrics (SelfCalibrationCollector)
        self._tried_before = 0                # configs scored by earlier calibrations
        self.gates = {"pass": 0, "fail": 0}   # candidates gated, by result
        self.last_gate: dict | None = None    # the last gate's numbers and result
        self.drift_checks = {"held": 0, "drift": 0}     # full windows judged, by result

    # ------------------------------------------------------------ set-up
    def attach(self, pipeline):
        """Look at the loaded pipeline once: off, serve a stored config, check a measured
        one, or start calibrating."""
        self.pipeline = pipeline
        pipeline.calibration_status = self.status
        why = _why_off(pipeline)
        if why:
            self.state, self.why = "off", why
            log.info("self-calibration off: %s", why)
            return
        ad = pipeline.adapter
        self.baseline = default_config(ad.identity)
        try:
            self.digest = weights_digest(resolve_checkpoint(str(self.model_path))[0])
            stored = self.cache.load(self.digest, ad.identity)
        except (OSError, ValueError) as e:
            self.state, self.why = "error", f"the calibration cache: {e}"
            log.warning("self-calibration off: %s", self.why)
            return
        if stored is not None:
            self._install(stored, "calibration cache")
            return
        if not ad.patterns.uncalibrated:
            self.source = "the checkpoint's config"
            self.state = "serving"
            self.measured = (ad.patterns.provenance or {}).get("served_policy")
            log.info("self-calibration: serving the checkpoint's measured config; checking it "
                     "on the shadow monitor's comparisons")
            return
        failure = self.cache.load_failure(self.digest)
        if failure is not None and failure["thresholds"] == self.thresholds():
            self.state = "failed"
            self.why = (f"a calibration of these weights ({failure.get('date', '?')}) ended "
                        f"with no config under the same thresholds: {failure.get('why')}; "
                        f"other thresholds calibrate again, as does removing "
                        f"{self.cache.failed_path(self.digest)}")
            log.warning("self-calibration: %s; serving dense", self.why)
            return
        self._start("no measured config for these weights (digest %s)" % self.digest)

    def thresholds(self) -> dict:
        return {"min_agreement": self.min_agreement, "max_kl": self.max_kl,
                "max_density": self.max_density}

    def _start(self, why: str):
        self._tried_before = self.configs_tried()
        self.state = "calibrating"
        self.round = 0
        self.inputs, self.gate_rows, self.cal = [], [], None
        self._calib_full = False
        self._gen, self._step, self._waiting = self._plan(), None, False
        self.pipeline.prefix_observer = self.observe if self.from_requests else None
        log.info("self-calibration: %s; serving dense, calibrating in idle time from %s",
                 why, "the first requests and synthetic videos" if self.from_requests
                 else "synthetic videos only")

    # ------------------------------------------------------------ the worker's hooks
    def ready(self) -> bool:
        """(The worker's lock held, nothing in progress.) There is a step to run now."""
        if self.state == "new" or self._gen is None or self._waiting:
            return self.state == "new"
        self._stop.clear()
        return True

    def preempt(self):
        """A request arrived: the running step stops at its next check."""
        self._stop.set()

    def run_step(self, pipeline, check=None):
        """One step (on the thread holding the model). ``check()`` is the step's check
        (before a decoder layer, a decode step, a candidate's run): True stops it (Cancelled;
        it runs again later), and it may pause inside (the scheduler's idle work); by default
        the preempt flag. Raises only what the worker must die of."""
        if self.state == "new":
            self.attach(pipeline)
            return
        step = self._step
        if step is None:
            seen = self._version
            try:
                step = next(self._gen)
            except StopIteration:
                self._gen = None
                return
            except Exception as e:          # noqa: BLE001 - a bad plan stops calibrating
                self._error(e)
                return
            if step is None:
                with self._lock:             # unless an input came meanwhile
                    self._waiting = self._version == seen
                return
            self._step = step
        base, paused = check or self._stop.is_set, [0.0]
        # the preempt flag is looked at only once the GPU caught up (device_drain); a
        # caller's check (the scheduler's turn checkpoint) drains the queue itself
        drain = (lambda: None) if check is not None else device_drain(
            getattr(getattr(pipeline, "adapter", None), "device", None))

        def timed_check():              # a pause inside is not the step's time
            drain()
            t = time.perf_counter()
            try:
                return base()
            finally:
                paused[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            step(timed_check)
        except Cancelled:
            self.steps_stopped += 1
            return
        except BaseException as e:           # noqa: BLE001
            if is_fatal(e) and not _is_oom(e):
                raise
            self._error(e, step)
            return
        self._step = None
        self.steps_run += 1
        self.step_seconds.append(time.perf_counter() - t0 - paused[0])

    def _error(self, e, step=None):
        self.state, self.why = "error", f"{type(e).__name__}: {e}"
        self._gen = self._step = None
        self.inputs = []
        self.pipeline.prefix_observer = None
        log.warning("self-calibration stopped%s: %s; serving dense", f" at {step}" if step
                    else "", self.why)

    # ------------------------------------------------------------ inputs
    def observe(self, adapter, prep, embeds):
        """A request's prompt before its prefix's prefill (its thread, holding the model):
        kept on the host while the calibration or the gate wants requests, within the
        capture budget: half of it for the calibration's requests, half for the gate's
        waiting their turn (a gated prompt is dropped once scored). Returns, for a kept
        prompt, the callback of its answer (Pipeline.prefix_observer)."""
        if self.state not in ("calibrating", "gating"):
            return
        n_bytes = prep.input_ids.shape[1] * embeds.shape[-1] * embeds.element_size()
        half = self.capture_bytes // 2
        with self._lock:
            reqs = [i for i in self.inputs if i.source == "request"]
            if self.cal is None or self.cal.frozen is None:
                calib, held = reqs[:self.requests], reqs[self.requests:]
                if len(calib) < self.requests:      # the calibration's
                    if sum(i.nbytes for i in calib) + n_bytes > half:
                        self._calib_full = True      # it goes with what it has
                        return
                    held = None
                wanted = self.gate_requests
            else:
                held = [i for i in reqs if not self._in_calibration(i)]
                wanted = self.gate_requests - len(self.gate_rows)
            if held is not None and (len(held) >= wanted or
                                     sum(i.nbytes for i in held) + n_bytes > half):
                return
            self._n_kept += 1
            name = f"request-{self._n_kept}"
        inp = keep(adapter, prep, embeds, name, source="request")
        with self._lock:
            self.inputs.append(inp)
            self._version += 1
            self._waiting = False

        def answered(gen, dense: bool, greedy: bool):
            """The request's own answer, when it is what the input's dense reference run
            would give (dense, greedy, enough tokens) and that run would keep no capture for
            the search: the reference, so idle time does not prefill the prompt again. A
            failure here is the calibration's (the input keeps no reference), never the
            request's."""
            cal = self.cal
            settings = cal.settings if cal is not None else self._settings()
            searched = cal is not None and cal.head_config is not None
            if not (dense and greedy) or inp.reference is not None or \
                    captures(settings, searched, inp):
                return
            try:
                ref = answered_reference(gen, settings.max_new_tokens, adapter.eos_token_ids)
            except Exception:        # noqa: BLE001 - see the docstring
                log.exception("self-calibration: the answer of %s could not be kept as its "
                              "reference; it gets a reference run", inp.name)
                return
            if ref is not None:
                inp.reference = ref
                self.references_from_answers += 1
        return answered

    def _in_calibration(self, inp) -> bool:
        frozen = self.cal.frozen if self.cal is not None else None
        return frozen is not None and any(i is inp for i in frozen)

    # ------------------------------------------------------------ the plan
    def _plan(self):
        ad = self.pipeline.adapter
        for k in range(self.synthetic):
            yield self._synthetic_step(k)
        # the live pool: what is kept until the ladder is scored calibrates (``_select``),
        # what comes after is held out for the gate
        self.round = 1
        self.cal = cal = ServedCalibration(ad, self.inputs, min_agreement=self.min_agreement,
                                           max_kl=self.max_kl, settings=self._settings(),
                                           log=lambda m: log.info("self-calibration: %s", m))
        cal.select = self._select
        yield from cal.steps(ready=self._enough_requests)
        held_k = 0
        while True:
            if cal.winner is None:
                self._give_up(cal.why_none())
                return
            self.state = "gating"
            self.gate_rows = []
            log.info("self-calibration: a candidate (per-head bound %g) holds on %d inputs; "
                     "gating it on %d %s it was not calibrated on", cal.winner.bound,
                     len(cal.frozen), self.gate_requests,
                     "requests" if self.from_requests else "synthetic videos")
            while len(self.gate_rows) < self.gate_requests:
                held = self._held_out()
                if not held:
                    if self.from_requests:
                        yield None
                        continue
                    yield self._synthetic_step(self.synthetic + held_k, held_out=True)
                    held_k += 1
                    continue
                inp = held[0]
                if inp.reference is None:
                    yield cal.reference_step(inp)
                    continue
                yield _gate_step(self, cal, inp)
            s = summarize(self.gate_rows)
            passed = holds(s, self.min_agreement, self.max_kl)
            self.gates["pass" if passed else "fail"] += 1
            self.last_gate = {"n": s["n"], "agreement": s["agreement"], "mean_kl": s["mean_kl"],
                              "passed": passed}
            if passed:
                gate = {"n": s["n"], "source": "requests" if self.from_requests else
                        "synthetic videos", **_rounded(s)}
                cfg = cal.config(gate=gate)
                self._install(cfg, "self-calibration")
                try:
                    path = self.cache.save(self.digest, cfg)
                    log.info("self-calibration: stored %s", path)
                except OSError as e:
                    log.warning("self-calibration: could not store the config: %s", e)
                return
            self.gates_failed.append({"per_head_bound": cal.winner.bound, **_rounded(s),
                                      "n": s["n"]})
            log.warning("self-calibration: the candidate (per-head bound %g) failed the gate "
                        "(agreement %.3f, mean KL %.4f on %d held-out inputs); trying the next "
                        "tighter rung", cal.winner.bound, s["agreement"], s["mean_kl"], s["n"])
            if self.round >= MAX_ROUNDS:
                self._give_up(f"no candidate passed the gate in {MAX_ROUNDS} rounds")
                return
            self.round += 1
            self.state = "calibrating"
            yield from cal.ladder_steps(tighter_than=cal.winner.bound)

    def _settings(self):
        s = self.search or SearchSettings.for_device(self.pipeline.adapter.device)
        return replace(s, max_served_density=self.max_density)

    def _select(self, inputs: list) -> list:
        """The calibration inputs among those kept: the synthetic ones and the first
        ``requests`` requests (later requests are the gate's)."""
        reqs = [i for i in inputs if i.source == "request"][:self.requests]
        return [i for i in inputs if i.source != "request" or any(i is r for r in reqs)]

    def _enough_requests(self) -> bool:
        """The calibration has its requests: ``requests`` of them, or as many as half the
        capture budget held (the other half is the gate's)."""
        with self._lock:
            return self._calib_full or \
                sum(i.source == "request" for i in self.inputs) >= self.requests

    def _held_out(self) -> list:
        with self._lock:
            return [i for i in self.inputs if not self._in_calibration(i)
                    and (i.source == "request") == self.from_requests]

    def _synthetic_step(self, k: int, held_out: bool = False):
        task = SYNTH_TASKS[k % len(SYNTH_TASKS)]
        spec = f"synth:{task}:{self._frames()}:{SYNTH_SEED + k}"

        def fn(cancel):
            decoded, question, name = synthetic_video(spec)
            inp = prepare(self.pipeline.adapter, decoded, question, name, cancel=cancel)
            with self._lock:
                self.inputs.append(inp)
                self._version += 1
        return Step(f"synthetic video {spec}" + (" (held out)" if held_out else ""), fn)

    def _frames(self) -> int:
        """Frames of a synthetic video: the setting, else the most (up to 768) whose visual
        tokens at 224 x 224 fit SYNTH_TOKENS."""
        if self.synthetic_frames:
            return self.synthetic_frames
        ad = self.pipeline.adapter
        n = SYNTH_MAX_FRAMES
        while n > 8:
            t = ad.visual_tokens(n, 224, 224)
            if t is None or t <= SYNTH_TOKENS:
                break
            n //= 2
        return n

    def _give_up(self, why: str):
        """No config holds: serve dense, and store the verdict under the digest, so the next
        start with these weights and thresholds does not spend its idle time on the same
        calibration again (a run with other thresholds, or without the file, does)."""
        self.state, self.why = "failed", why
        self.pipeline.prefix_observer = None
        sources = _count_sources([{"source": i.source} for i in self.inputs])
        self.inputs = []
        log.warning("self-calibration: %s; serving dense", why)
        if self.digest is None:
            return
        record = {"why": why, "date": _now(), "thresholds": self.thresholds(),
                  "inputs": sources, "configs_tried": self.configs_tried(),
                  "gates_failed": list(self.gates_failed)}
        try:
            log.info("self-calibration: stored the verdict in %s",
                     self.cache.save_failure(self.digest, record))
        except OSError as e:
            log.warning("self-calibration: could not store the verdict: %s", e)

    # ------------------------------------------------------------ serving and checking
    def _install(self, cfg, source: str):
        """``cfg`` serves from now on (the worker is idle: no request reads the adapter's
        patterns meanwhile)."""
        self.pipeline.adapter.patterns = cfg
        self.pipeline.prefix_observer = None
        self.state, self.source, self.why = "serving", source, None
        self.measured = (cfg.provenance or {}).get("served_policy")
        self.window.clear()
        self.inputs = []
        m = self.measured or {}
        cal, gate = m.get("calibration") or {}, m.get("gate") or {}
        log.info("self-calibration: serving the config from %s (%s): %s", source,
                 self.digest, _measured_line(cal, gate))

    def on_comparison(self, c: dict):
        """A shadow comparison (serve/shadow.py; on the worker's thread, idle) of a request
        the serving config answered."""
        if self.state != "serving":
            return
        self.window.append((bool(c["answer_agree"]), float(c["kl"])))
        if len(self.window) < self.window.maxlen:
            return
        agree = sum(a for a, _ in self.window) / len(self.window)
        kl = sum(k for _, k in self.window) / len(self.window)
        if agree >= self.min_agreement and kl <= self.max_kl:
            self.drift_checks["held"] += 1
            return
        self.drift_checks["drift"] += 1
        what = (f"drift: over the last {len(self.window)} shadow comparisons agreement "
                f"{agree:.3f} (min {self.min_agreement:g}), mean KL {kl:.4f} (max "
                f"{self.max_kl:g})")
        log.warning("self-calibration: %s; falling back to dense and recalibrating", what)
        self.fallbacks.append({"date": _now(), "why": what, "source": self.source})
        if self.digest is not None:
            try:
                self.cache.reject(self.digest, what)
            except OSError as e:
                log.warning("self-calibration: could not mark the stored config: %s", e)
        self.pipeline.adapter.patterns = self.baseline
        self.source, self.measured = None, None
        self.window.clear()
        self._start("recalibrating after " + what)

    # ------------------------------------------------------------ what it says
    def configs_tried(self) -> int:
        """Configs scored on calibration inputs (ladder rungs), every calibration so far."""
        cal = self.cal
        return self._tried_before + (sum(1 for r in cal.rungs if r.rows) if cal else 0)

    def status(self) -> dict:
        win = list(self.window)
        out = {"state": self.state,
               "serving": "sparse" if self.state == "serving" else "dense",
               "config": self.source, "weights_digest": self.digest,
               "thresholds": self.thresholds(),
               "measured": self.measured and {
                   "how": self.measured.get("objective"),
                   "calibration": self.measured.get("calibration"),
                   "gate": self.measured.get("gate"),
                   "inputs": _count_sources(self.measured.get("inputs") or [])},
               "monitor": {"window": self.window.maxlen, "compared": len(win),
                           "agreement": (sum(a for a, _ in win) / len(win)) if win else None,
                           "mean_kl": (sum(k for _, k in win) / len(win)) if win else None},
               "fallbacks": list(self.fallbacks),
               "counts": {"configs_tried": self.configs_tried(), "gates": dict(self.gates),
                          "last_gate": self.last_gate and dict(self.last_gate),
                          "drift_checks": dict(self.drift_checks),
                          "steps_run": self.steps_run, "steps_stopped": self.steps_stopped,
                          "steps_paused": self.steps_paused,
                          "references_from_answers": self.references_from_answers}}
        if self.why:
            out["why"] = self.why
        if self.state in ("calibrating", "gating"):
            with self._lock:
                kept = list(self.inputs)
            out["progress"] = {
                "round": self.round, "inputs": _count_sources(
                    [{"source": i.source} for i in kept]),
                "requests_wanted": self.requests, "gates_failed": list(self.gates_failed),
                "gate": f"{len(self.gate_rows)} of "
                f"{self.gate_requests}", "kept_mb": round(sum(i.nbytes for i in kept) / 2**20, 3),
                "steps_run": self.steps_run, "steps_stopped": self.steps_stopped,
                "steps_paused": self.steps_paused,
                "longest_step_s": round(max(self.step_seconds), 3) if self.step_seconds
                else None}
        out["summary"] = self.summary()
        out["checks"] = self.checks()
        return out

    def checks(self) -> str:
        """One sentence: the thresholds, the drift window now, what was tried and judged."""
        win = list(self.window)
        window = (f"{len(win)} of {self.window.maxlen} shadow comparisons in the drift window"
                  + (f" (agreement {sum(a for a, _ in win) / len(win):.3f}, mean KL "
                     f"{sum(k for _, k in win) / len(win):.4f})" if win else ""))
        last = self.fallbacks[-1]["why"] if self.fallbacks else None
        return (f"thresholds: agreement >= {self.min_agreement:g}, mean KL <= "
                f"{self.max_kl:g}, density <= {self.max_density:g}; {window}; "
                f"{self.configs_tried()} configs tried, "
                f"{self.gates['pass']} gates passed, {self.gates['fail']} failed; "
                f"{sum(self.drift_checks.values())} drift checks, {len(self.fallbacks)} "
                f"fallbacks to dense" + (f" (last: {last})" if last else ""))

    def summary(self) -> str:
        """One sentence: which config serves, measured how, on how many."""
        if self.state == "off":
            return f"off: {self.why}"
        if self.state == "serving":
            m = self.measured or {}
            how = _measured_line(m.get("calibration") or {}, m.get("gate") or {}) if m else \
                "not measured by self-calibration; checked on shadow comparisons"
            return f"sparse: the config from {self.source} ({how})"
        if self.state in ("calibrating", "gating"):
            extra = f" after a fallback ({self.fallbacks[-1]['why']})" if self.fallbacks else ""
            doing = "calibrating" if self.state == "calibrating" else "gating a candidate"
            return f"dense while {doing} in idle time{extra}"
        return f"dense: {self.why}" if self.why else "dense"


STATES = ("new", "off", "calibrating", "gating", "serving", "failed", "error")


class SelfCalibrationCollector:
    """Self-calibration on ``/metrics``, read at scrape time (registered on the app's
    registry; ``model_name`` as every mminfer series):

    * ``mminfer:self_calibration_state{state}``: 1 for the state it is in (new, off,
      calibrating, gating, serving, failed, error), 0 for the others;
      ``mminfer:self_calibration_sparse``: 1 while a measured config serves sparse (0: dense);
    * ``mminfer:self_calibration_configs_tried_total``: configs (ladder rungs) scored on the
      calibration inputs; ``..._gates_total{result}``: candidates gated (pass, fail);
      ``..._gate_agreement``, ``..._gate_mean_kl``, ``..._gate_inputs``: the last gate's
      numbers and how many held-out inputs it measured (absent before the first gate);
    * ``..._drift_checks_total{result}``: full windows of shadow comparisons judged (held,
      drift); ``..._fallbacks_total``: falls back to dense; ``..._window_compared``,
      ``..._window_agreement``, ``..._window_mean_kl``: the window now;
    * ``..._steps_total{outcome}``: idle-time steps run to the end (run) or stopped by a
      request arriving, to run again later (stopped).
    """

    def __init__(self, sc: SelfCalibration, model: str):
        self.sc, self.model = sc, model

    def describe(self):
        return []                       # collected at scrape time only

    def collect(self):
        sc, m, lab = self.sc, [self.model], ["model_name"]
        pre = "mminfer:self_calibration_"

        def gauge(name, doc, value, extra=None, labels=()):
            f = GaugeMetricFamily(pre + name, doc, labels=lab + list(labels))
            for key, v in (extra or [((), value)]):
                f.add_metric(m + list(key), v)
            return f

        def counter(name, doc, values: dict | None = None, label=None, value=None):
            f = CounterMetricFamily(pre + name, doc, labels=lab + ([label] if label else []))
            if values is None:
                f.add_metric(m, value)
            else:
                for k, v in values.items():
                    f.add_metric(m + [k], v)
            return f

        yield gauge("state", "1 for the state self-calibration is in", None,
                    [((st,), float(sc.state == st)) for st in STATES], ["state"])
        yield gauge("sparse", "1 while a measured config serves sparse, 0 while dense",
                    float(sc.state == "serving"))
        yield counter("configs_tried", "Configs (ladder rungs) scored on calibration inputs",
                      value=sc.configs_tried())
        yield counter("gates", "Candidates gated on inputs they were not calibrated on, by "
                      "result", dict(sc.gates), "result")
        g = sc.last_gate
        if g is not None:
            yield gauge("gate_agreement", "The last gate's share of greedy answers equal to "
                        "dense's", g["agreement"])
            yield gauge("gate_mean_kl", "The last gate's mean last-token KL(dense || sparse), "
                        "nats", g["mean_kl"])
            yield gauge("gate_inputs", "Held-out inputs (requests or synthetic videos) the "
                        "last gate measured", g["n"])
        yield counter("drift_checks", "Full windows of shadow comparisons of the serving "
                      "config judged against the thresholds, by result", dict(sc.drift_checks),
                      "result")
        yield counter("fallbacks", "Falls back to dense after a drift",
                      value=len(sc.fallbacks))
        win = list(sc.window)
        yield gauge("window_compared", "Shadow comparisons in the drift window now", len(win))
        if win:
            yield gauge("window_agreement", "Share of the window's answers equal to dense's",
                        sum(a for a, _ in win) / len(win))
            yield gauge("window_mean_kl", "The window's mean last-token KL, nats",
                        sum(k for _, k in win) / len(win))
        yield counter("steps", "Idle-time calibration steps, by outcome (run: to the end; "
                      "stopped: a request stopped it or needed its memory, run again later)",
                      {"run": sc.steps_run, "stopped": sc.steps_stopped}, "outcome")
        yield counter("step_pauses", "Pauses of a calibration step while requests ran, each "
                      "resumed where it stopped", value=sc.steps_paused)


def _gate_step(sc: SelfCalibration, cal, inp):

    def fn(cancel):
        row = cal.score(inp, cal.winner.config, cancel)
        sc.gate_rows.append(row)
        with sc._lock:                 # scored: its prompt is not needed any more
            sc.inputs.remove(inp)
    return Step(f"gate on {inp.name}", fn)


def _why_off(pipeline) -> str | None:
    if not hasattr(pipeline, "adapter") or not hasattr(pipeline, "attention"):
        return "the served model is not a Pipeline (a stand-in)"
    if getattr(pipeline, "tensor_parallel", 1) > 1:
        return "tensor parallel (every rank would have to calibrate in lockstep)"
    if pipeline.attention != "auto":
        return f"--attention {pipeline.attention}"
    if pipeline.adapter.patterns is None:
        return "the model has no head-pattern config"
    if pipeline.sparse_unavailable:
        return "sparse kernels cannot run here"
    if pipeline.min_sparse_len >= AUTO_NEVER:
        return ("attention auto stays dense on the CPU (the Triton interpreter is for "
                "tests); give --min-sparse-len to calibrate here")
    return None


def _count_sources(items) -> dict:
    """Inputs by source: requests, synthetic videos, and (a config ``mminfer calibrate``
    measured) video files, the last only where there are any."""
    out = {"requests": 0, "synthetic": 0}
    for i in items:
        key = {"request": "requests", "video": "videos"}.get(i.get("source"), "synthetic")
        out[key] = out.get(key, 0) + 1
    return out


def _rounded(s: dict) -> dict:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in s.items() if k != "n"}


def _measured_line(cal: dict, gate: dict) -> str:
    parts = []
    if cal:
        parts.append(f"calibrated on {cal.get('n')} inputs: agreement {cal.get('agreement'):.3f}, "
                     f"mean KL {cal.get('mean_kl'):.4f}, density {_f(cal.get('mean_density'))}")
    if gate:
        parts.append(f"gate on {gate.get('n')} held-out {gate.get('source', 'inputs')}: "
                     f"agreement {gate.get('agreement'):.3f}, mean KL {gate.get('mean_kl'):.4f}")
    return "; ".join(parts) or "no measurement recorded"


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"
