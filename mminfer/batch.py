"""``mminfer batch DIR``: answer questions about every video under a folder, resumably.

Output is append-only JSONL, one record per (video, question), each line flushed and fsynced
before the next item starts, so a killed job loses at most the item in flight. A record's
``custom_id`` is stable across runs: sha256 of the video's relative path, size, mtime and
the question's hash; editing or replacing a video makes it a new item.

Rerunning with the same ``--out`` skips items that already have a success record and, with
``--retry-errors``, runs again the ones whose records are errors (a new record is appended;
earlier ones are never rewritten). The configuration fingerprint (model, attention, fps,
max_frames, max_new_tokens) is in every record, and a file holding records of another
fingerprint is refused: results of two configurations never mix in one file (write the new
configuration to another ``--out``).

Input is a folder scanned recursively (hidden entries, folder symlinks, non-regular and
non-video files are skipped and counted in the summary's ``ignored``), or a manifest
(``--manifest FILE``: one JSON object a line, ``{"video": PATH, "question": Q, "id": ID}``
or ``{"video": PATH, "questions": [Q, ...], "id": ID}``, paths relative to the manifest,
``id`` optional: with several questions the items are ``ID:0``, ``ID:1``, ...), as
``vllm run-batch`` takes a file.

Many questions per video is the workload (Video-MME asks 3, LVBench about 15): a video's
first item runs alone and prefills the video's prefix, and the others then answer from the
engine's video cache together (each record's ``response.cache`` says ``miss``, ``hit`` or
``host``): each in a thread of its own with a turn of one scheduler
(mminfer.engine.scheduler), so their questions' rows run one after the other and their
answers decode in the same batched steps, each over its own fork of the cached prefix (the
summary's ``decode`` counts the steps and the batches they took). Records are written in
the items' order, each as soon as it and the ones before it are done. A manifest keeps the
order of its first mention of each video and, per video, of its questions; a folder runs
every ``--question`` (repeatable) on each video in turn.

Items are isolated: ``--item-timeout-s`` stops one that runs too long (an error record,
``timeout``), and an item during which the process died (out of memory, killed: with the
other items of its video in flight) is retried last on the next run and, after
``--quarantine-after`` such deaths, skipped with a ``quarantined`` error record instead of
killing every rerun. Attempts are tracked in
``OUT.attempts`` next to the results.

``--ray ADDRESS|auto|local`` runs the same job on a Ray cluster: one actor per GPU (or one
on the CPU when the cluster has no GPU) holds the model, one task per video answers all its
questions, and the driver alone writes the JSONL, so records stay exactly-once. The nodes
need mminfer installed and the video folder and model at the same paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from tqdm import tqdm
from transformers.utils import logging as hf_logging

from mminfer.engine import lockstep
from mminfer.engine.interrupt import Guard, Interrupted
from mminfer.engine.pipeline import Pipeline, check_request
from mminfer.engine.scheduler import Scheduler
from mminfer.errors import Cancelled, ConfigError, InputError, MMInferError
from mminfer.models.embedded import resolve_model

VIDEO_EXTS = frozenset((".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg",
                        ".ts", ".mts", ".m2ts", ".flv", ".wmv", ".3gp", ".ogv"))
SCHEMA = 1


# ------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Video:
    rel: str          # POSIX path relative to the scanned folder: the stable name
    path: str         # absolute path
    size: int
    mtime_ns: int


def scan(root, ignored: dict | None = None) -> list[Video]:
    """Video files under ``root``, recursively, sorted by relative path (byte order, so the
    order does not depend on the locale or the file system). What is passed over is counted
    in ``ignored`` by reason."""
    root = Path(root)
    if not root.is_dir():
        raise InputError(f"{root} is not a directory")
    skip = ignored if ignored is not None else {}

    def count(reason):
        skip[reason] = skip.get(reason, 0) + 1

    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for d in sorted(dirnames):
            if d.startswith("."):
                count("hidden")
            elif os.path.islink(os.path.join(dirpath, d)):
                count("symlinked folder")      # not followed: it could loop or leave root
            else:
                keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            if name.startswith("."):
                count("hidden")
                continue
            if Path(name).suffix.lower() not in VIDEO_EXTS:
                count("not a video file")
                continue
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                count("unreadable or a dangling link")
                continue
            if not p.is_file():
                count("not a regular file")     # a FIFO, socket or device
                continue
            out.append(Video(p.relative_to(root).as_posix(), str(p.resolve()), st.st_size,
                             st.st_mtime_ns))
    out.sort(key=lambda v: v.rel.encode("utf-8", "surrogateescape"))
    return out


def read_manifest(path) -> list[tuple[Video, str, str]]:
    """(video, question, custom_id) per question of a JSONL manifest, in its order."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read the manifest {path}: {e}") from None
    items, seen = [], set()
    shape = ('{"video": PATH, "question": Q} or {"video": PATH, "questions": [Q, ...]} (and '
             'an optional "id")')
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path.name} line {n}"
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise InputError(f"{where} is not JSON: {e}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("video"), str):
            raise InputError(f"{where} must be {shape}")
        if ("question" in entry) == ("questions" in entry):
            raise InputError(f"{where} must be {shape}: one of \"question\" and "
                             f"\"questions\", not both")
        several = "questions" in entry
        qs = entry["questions"] if several else [entry["question"]]
        if not isinstance(qs, list) or not qs or \
                not all(isinstance(q, str) and q.strip() for q in qs):
            raise InputError(f"{where} must be {shape}, each question a non-empty string")
        rel = entry["video"]
        p = (path.parent / rel).expanduser()
        try:
            st = p.stat()
        except OSError:
            raise InputError(f"{where}: the video {rel} does not exist") from None
        if not p.is_file():
            raise InputError(f"{where}: {rel} is not a regular file")
        video = Video(rel, str(p.resolve()), st.st_size, st.st_mtime_ns)
        given = entry.get("id") or entry.get("custom_id")
        for k, q in enumerate(qs):
            question = q.strip()
            if given:
                cid = f"{given}:{k}" if several else str(given)
            else:
                cid = item_id(video, question)
            if cid in seen:
                raise InputError(f"{where}: the id {cid!r} is used twice")
            seen.add(cid)
            items.append((video, question, cid))
    if not items:
        raise InputError(f"the manifest {path} lists no item")
    return items


def by_video(listed: list) -> list:
    """The items of ``listed`` ((video, question, id), ...) with those of one video together,
    so that all but the first answer from the video cache: videos in the order of their first
    item, each video's items in their order (a stable sort on the first position of the
    video's file)."""
    first: dict[str, int] = {}
    for i, (v, _, _) in enumerate(listed):
        first.setdefault(v.path, i)
    return sorted(listed, key=lambda item: first[item[0].path])


def read_questions(question: list[str] | None, questions_file: str | None) -> list[str]:
    qs = [q for q in (question or [])]
    if questions_file:
        try:
            text = Path(questions_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read the questions file {questions_file}: {e}") from None
        qs += [ln.strip() for ln in text.splitlines()
               if ln.strip() and not ln.lstrip().startswith("#")]
    qs = [q.strip() for q in qs if q and q.strip()]
    if not qs:
        raise InputError("no question: pass --question Q or --questions FILE (one a line)")
    return list(dict.fromkeys(qs))      # the same question twice would be the same item


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def item_id(video: Video, question: str) -> str:
    return _sha(f"{video.rel}\0{video.size}\0{video.mtime_ns}\0{_sha(question)}")[:32]


def model_identity(model: str) -> str:
    """A local checkpoint: its real path and a hash of its small JSON files (config,
    tokenizer, generation config), so a retrained model in the same folder is a new
    configuration; a hub id: the id."""
    p = Path(model).expanduser()
    if not p.is_dir():
        return model
    h = hashlib.sha256()
    for f in sorted(p.glob("*.json")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return f"{p.resolve()}#{h.hexdigest()[:16]}"


def config_of(model, attention, fps, max_frames, max_new_tokens, quantization=None) -> dict:
    cfg = {"model": model_identity(model), "attention": attention, "fps": float(fps),
           "max_frames": int(max_frames), "max_new_tokens": int(max_new_tokens)}
    if quantization:              # absent for bf16: earlier files keep their fingerprint
        cfg["quantization"] = quantization
    return cfg


def fingerprint(config: dict) -> str:
    return _sha(json.dumps(config, sort_keys=True))[:16]


# ------------------------------------------------------------------- output

class Results:
    """The JSONL file: what it already holds, and appending to it durably."""

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a+b")
        try:
            import fcntl  # lazy: POSIX only
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:          # not POSIX: no lock
            pass
        except OSError:
            self.f.close()
            raise ConfigError(f"another batch job is writing {self.path}") from None
        self._drop_torn_tail()
        self.records = self._read()

    def _drop_torn_tail(self):
        """A kill during a write can leave half a line at the end; it is no record, and
        the next one must start on a line of its own."""
        self.f.seek(0, os.SEEK_END)
        size = self.f.tell()
        if size == 0:
            return
        self.f.seek(max(0, size - 1))
        if self.f.read(1) == b"\n":
            return
        self.f.seek(0)
        data = self.f.read()
        keep = data.rfind(b"\n") + 1
        self.f.truncate(keep)
        self.f.flush()
        os.fsync(self.f.fileno())

    def _read(self) -> list[dict]:
        self.f.seek(0)
        out = []
        for line in self.f.read().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and "custom_id" in r:
                out.append(r)
        return out

    def append(self, record: dict):
        self.f.seek(0, os.SEEK_END)
        self.f.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


class Attempts:
    """``OUT.attempts``: a line when an item starts and one when it ends, fsynced, so a rerun
    can tell the items during which the process died (started, never ended)."""

    def __init__(self, path):
        self.path = Path(path)
        self.died: dict[str, int] = {}
        if self.path.exists():
            for line in self.path.read_bytes().splitlines():
                try:
                    e = json.loads(line)
                    cid, event = e["id"], e["event"]
                except (ValueError, KeyError, TypeError):
                    continue                       # a line torn by the kill
                self.died[cid] = self.died.get(cid, 0) + (1 if event == "start" else -1)
        self.f = open(self.path, "ab")

    def mark(self, cid: str, event: str):
        self.f.write(json.dumps({"id": cid, "event": event}).encode() + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self):
        self.f.close()


# ------------------------------------------------------------------- answering

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def answer_one(pipe, video: dict, question: str, cid: str, cfg: dict, fp: str,
               attempt: int, timeout_s: float | None = None, sched=None) -> dict:
    """One record; any error of this item becomes an error record, never an exception.
    ``timeout_s``: asked to stop after that long (between stages and layers), interrupted a
    second later if it has not. ``sched``: the Scheduler this item takes turns on the model
    with (None: it has the model to itself)."""
    rec = {"custom_id": cid, "video": video["rel"], "question": question,
           "size": video["size"], "mtime_ns": video["mtime_ns"], "config_fingerprint": fp,
           "config": cfg, "attempt": attempt, "status": "ok", "response": None,
           "error": None, "timings_ms": {}, "host": socket.gethostname(), "schema": SCHEMA}
    t0 = time.perf_counter()
    guard, timer, cancel = Guard(), None, None
    if timeout_s:
        end = time.monotonic() + timeout_s
        cancel = lambda: time.monotonic() > end            # noqa: E731
        # tensor parallel: no hard interrupt (it would leave the other ranks mid-collective)
        if getattr(pipe, "interruptible", True):
            timer = threading.Timer(timeout_s + 1.0, guard.interrupt)
            timer.daemon = True
            timer.start()
    turn = sched.turn(cid, stop=cancel) if sched is not None else None
    try:
        try:
            res = guard.run(pipe.answer, video["path"], question, fps=cfg["fps"],
                            max_frames=cfg["max_frames"],
                            max_new_tokens=cfg["max_new_tokens"], cancel=cancel,
                            **({"turn": turn} if turn is not None else {}))
        except Interrupted:
            guard.disarm()
            raise Cancelled("interrupted") from None
        finally:
            if timer is not None:
                timer.cancel()
            if turn is not None:
                turn.close()
        d = res.to_dict()
        d["video"].pop("path", None)
        rec["response"] = {"answer": d["answer"], "model": d["model"],
                           "attention": d["attention"], "cache": d.get("cache"),
                           "tokens": d["tokens"],
                           "sparsity": d["sparsity"], "video": d["video"]}
        rec["timings_ms"] = d["timings_ms"]
    except Cancelled:
        rec["status"] = "error"
        rec["error"] = {"code": "timeout", "message": f"the item did not finish within "
                                                     f"--item-timeout-s {timeout_s:g}"}
    except MMInferError as e:
        rec["status"] = "error"
        rec["error"] = {"code": e.code, "message": e.message.replace(video["path"], video["rel"])}
    except Exception as e:      # noqa: BLE001 - one bad item must not end the job
        rec["status"] = "error"
        rec["error"] = {"code": "internal", "message": f"{type(e).__name__}: {e}"}
    if not rec["timings_ms"]:
        rec["timings_ms"] = {"total": round((time.perf_counter() - t0) * 1e3, 3)}
    rec["finished_at"] = _now()
    return rec


def load_pipeline(load_args: dict):
    hf_logging.disable_progress_bar()
    return Pipeline(load_args["model"], attention=load_args["attention"],
                    device=load_args.get("device"), dtype=load_args.get("dtype"),
                    min_sparse_len=load_args.get("min_sparse_len"),
                    kv_cache_dtype=load_args.get("kv_cache_dtype", "auto"),
                    tensor_parallel=load_args.get("tensor_parallel", 1),
                    quantization=load_args.get("quantization"))


def answer_video(pipe, video: dict, items: list, cfg: dict, fp: str,
                 timeout_s: float | None = None, *, start=None, decode: dict | None = None):
    """The records of one video's ``items`` ``[(custom_id, question, attempt)]``, yielded in
    their order, each as soon as it and the ones before it are done. The first runs alone
    and prefills the video's prefix (kept in the video cache); the others then run together,
    in threads of their own taking turns on one Scheduler, so their answers decode in the
    same batched steps over their forks of the cached prefix. One after the other instead
    where the model is not shared between threads (tensor parallel: engine.lockstep.Leader)
    or the video cache is off. ``start(cid)``: called as an item starts; ``decode``: the
    batched steps and batches they took are added to its ``steps``/``batches``."""
    def run(item, sched=None):
        cid, q, attempt = item
        return answer_one(pipe, video, q, cid, cfg, fp, attempt, timeout_s, sched)

    together = isinstance(pipe, Pipeline) and pipe.video_cache.enabled and len(items) > 2
    for item in items[:1] if together else items:
        if start is not None:
            start(item[0])
        yield run(item)
    if not together:
        return
    rest = items[1:]
    sched = Scheduler()
    for item in rest:
        if start is not None:
            start(item[0])
    pool = ThreadPoolExecutor(max_workers=len(rest), thread_name_prefix="batch-item")
    try:
        futures = [pool.submit(run, item, sched) for item in rest]
        for fut in futures:
            yield fut.result()
    finally:
        pool.shutdown(wait=True)
        if decode is not None:
            decode["steps"] = decode.get("steps", 0) + sched.batched_steps
            decode["batches"] = decode.get("batches", 0) + sched.batches


class _Answerer:
    """The Ray actor: loads the model once, answers one video's questions per call."""

    def __init__(self, load_args: dict):
        self.pipe = load_pipeline(load_args)

    def answer_video(self, video: dict, items: list, cfg: dict, fp: str,
                     timeout_s: float | None = None) -> list[dict]:
        return list(answer_video(self.pipe, video, items, cfg, fp, timeout_s))


# ------------------------------------------------------------------- the job

@dataclass
class Summary:
    items: int = 0
    done: int = 0          # answered in this run
    skipped: int = 0       # already done (or errored, without --retry-errors)
    errors: int = 0        # failed in this run
    quarantined: int = 0   # skipped: the process died on them --quarantine-after times
    ignored: dict = field(default_factory=dict)   # scanned entries passed over, by reason
    latencies_ms: list = field(default_factory=list)
    cache: dict = field(default_factory=dict)     # answers of this run by video-cache outcome
    # the decode steps of a video's questions answered together, and the batches they took
    decode: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        xs = sorted(self.latencies_ms)
        pct = lambda q: xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa
        return {"items": self.items, "done": self.done, "skipped": self.skipped,
                "errors": self.errors, "quarantined": self.quarantined,
                "ignored": dict(sorted(self.ignored.items())),
                "cache": dict(sorted(self.cache.items())),
                "decode": dict(sorted(self.decode.items())),
                "latency_ms": {"mean": round(sum(xs) / len(xs), 1), "p50": round(pct(.5), 1),
                               "p95": round(pct(.95), 1)} if xs else None}

    def line(self) -> str:
        d = self.to_dict()
        s = (f"batch: {d['items']} items: {d['done']} answered, {d['skipped']} skipped, "
             f"{d['errors']} errors")
        if d["quarantined"]:
            s += f", {d['quarantined']} quarantined"
        if d["ignored"]:
            s += " (ignored: " + ", ".join(f"{n} {why}" for why, n in d["ignored"].items()) + ")"
        if d["cache"]:
            s += "; prefixes: " + ", ".join(f"{n} {c}" for c, n in d["cache"].items())
        if d["decode"].get("batches"):
            s += (f"; decoded together: {d['decode']['steps']} steps in "
                  f"{d['decode']['batches']} batches")
        if d["latency_ms"]:
            lat = d["latency_ms"]
            s += (f"; latency per answer mean {lat['mean']:.0f} ms, p50 {lat['p50']:.0f} ms, "
                  f"p95 {lat['p95']:.0f} ms")
        return s


def run_batch(root, questions: list[str], out, *, model: str, attention: str = "auto",
              fps: float = 2.0, max_frames: int = 768, max_new_tokens: int = 32,
              device=None, dtype=None, min_sparse_len: int | None = None,
              kv_cache_dtype: str = "auto", retry_errors: bool = False,
              ray_address: str | None = None, ray_workers: int | None = None,
              progress: bool = True, manifest=None, item_timeout_s: float | None = None,
              quarantine_after: int = 2, pipe=None, quantization: str | None = None) -> Summary:
    """Answer every (video, question) of ``root`` x ``questions``, or every line of
    ``manifest``, into the JSONL ``out``. ``pipe``: a model already loaded (tensor parallel:
    rank 0's ``engine.lockstep.Leader``) instead of one loaded when there is work."""
    summary = Summary()
    if manifest is not None:
        listed = by_video(read_manifest(manifest))
    else:
        listed = [(v, q, item_id(v, q)) for v in scan(root, summary.ignored) for q in questions]
    for q in dict.fromkeys(q for _, q, _ in listed):
        check_request(q, fps, max_frames, max_new_tokens, None, None, attention)
    cfg = config_of(model, attention, fps, max_frames, max_new_tokens, quantization)
    fp = fingerprint(cfg)
    results = Results(out)
    tracker = None
    try:
        other = next((r for r in results.records if r.get("config_fingerprint") != fp), None)
        if other is not None:
            raise ConfigError(
                f"{out} holds results of another configuration (fingerprint "
                f"{other.get('config_fingerprint')}: {json.dumps(other.get('config'))}; this "
                f"run is {fp}: {json.dumps(cfg)}); write this run to another --out file")
        tracker = Attempts(str(out) + ".attempts")
        ok = {r["custom_id"] for r in results.records if r.get("status") == "ok"}
        attempts: dict[str, int] = {}
        quarantined = set()
        for r in results.records:
            attempts[r["custom_id"]] = attempts.get(r["custom_id"], 0) + 1
            if (r.get("error") or {}).get("code") == "quarantined":
                quarantined.add(r["custom_id"])
        groups: list[tuple[Video, list]] = []   # runs of one video: [(id, question, attempt)]
        for v, q, cid in listed:
            summary.items += 1
            died = tracker.died.get(cid, 0)
            if cid in ok or (cid in attempts and not retry_errors and cid not in quarantined):
                summary.skipped += 1
                continue
            if quarantine_after and died >= quarantine_after:
                summary.quarantined += 1
                if cid not in quarantined:
                    results.append(_quarantine_record(v, q, cid, cfg, fp, died,
                                                      attempts.get(cid, 0) + 1))
                continue
            if not groups or groups[-1][0] != v:       # listed is by video
                groups.append((v, []))
            groups[-1][1].append((cid, q, attempts.get(cid, 0) + 1))
        # videos the process died on go last, so they cannot starve the others
        todo = sorted(groups, key=lambda g: max(tracker.died.get(c, 0) for c, _, _ in g[1]) > 0)
        n = sum(len(items) for _, items in todo)
        if n == 0:
            return summary
        bar = tqdm(total=n, unit="answer", disable=not progress, file=sys.stderr,
                   dynamic_ncols=True, desc="batch")
        load_args = {"model": model, "attention": attention, "device": device, "dtype": dtype,
                     "min_sparse_len": min_sparse_len, "kv_cache_dtype": kv_cache_dtype,
                     "quantization": quantization}

        def record(rec):
            results.append(rec)
            if rec["status"] == "ok":
                summary.done += 1
                summary.latencies_ms.append(rec["timings_ms"].get("total", 0.0))
                c = (rec["response"] or {}).get("cache") or "unknown"
                summary.cache[c] = summary.cache.get(c, 0) + 1
            else:
                summary.errors += 1
            bar.update(1)
            bar.set_postfix(errors=summary.errors, refresh=False)

        try:
            if ray_address:
                _run_ray(ray_address, ray_workers, load_args, todo, cfg, fp, record,
                         item_timeout_s)
            else:
                pipe = pipe or load_pipeline(load_args)
                for v, items in todo:
                    vd = {"rel": v.rel, "path": v.path, "size": v.size, "mtime_ns": v.mtime_ns}
                    for rec in answer_video(pipe, vd, items, cfg, fp, item_timeout_s,
                                            start=lambda cid: tracker.mark(cid, "start"),
                                            decode=summary.decode):
                        record(rec)
                        tracker.mark(rec["custom_id"], "end")
        finally:
            bar.close()
        return summary
    finally:
        if tracker is not None:
            tracker.close()
        results.close()


def _quarantine_record(v: Video, q: str, cid: str, cfg: dict, fp: str, died: int,
                       attempt: int) -> dict:
    return {"custom_id": cid, "video": v.rel, "question": q, "size": v.size,
            "mtime_ns": v.mtime_ns, "config_fingerprint": fp, "config": cfg,
            "attempt": attempt, "status": "error", "response": None,
            "error": {"code": "quarantined", "message": f"the process died {died} times while "
                      f"answering this item (out of memory? killed?); it is skipped from now "
                      f"on (rerun with --quarantine-after 0 to try it again)"},
            "timings_ms": {}, "finished_at": _now(), "schema": SCHEMA}


def _run_ray(address: str, workers: int | None, load_args: dict, todo, cfg, fp, record,
             timeout_s: float | None = None):
    try:
        import ray  # lazy: an optional dependency (the ray extra)
    except ImportError:
        raise ConfigError("--ray needs the ray package: pip install 'mminfer[ray]'") from None
    if not ray.is_initialized():
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, RuntimeError) as e:
                raise ConfigError(
                    f"no Ray cluster at --ray {address} ({str(e).splitlines()[0][:200]}); "
                    f"start one (ray start --head) or pass --ray local to run one on this "
                    f"machine for the job") from None
    gpus = ray.cluster_resources().get("GPU", 0)
    opts = {"num_gpus": 1} if gpus >= 1 else {"num_cpus": 1}
    n = workers or (int(gpus) if gpus >= 1 else 1)
    n = max(1, min(n, len(todo)))
    actor_cls = ray.remote(**opts)(_Answerer)
    idle = [actor_cls.remote(load_args) for _ in range(n)]
    pending = list(reversed(todo))                 # pop() from the end keeps the scan order
    running = {}
    answered = set()                               # actors that finished a task
    while pending or running:
        while idle and pending:
            v, items = pending.pop()
            actor = idle.pop()
            vd = {"rel": v.rel, "path": v.path, "size": v.size, "mtime_ns": v.mtime_ns}
            ref = actor.answer_video.remote(vd, items, cfg, fp, timeout_s)
            running[ref] = (actor, vd, items)
        ready, _ = ray.wait(list(running), num_returns=1)
        ref = ready[0]
        actor, vd, items = running.pop(ref)
        try:
            recs = ray.get(ref)
            answered.add(actor)
        except ray.exceptions.RayError as e:
            if actor not in answered and not answered:
                # no actor has ever answered: the model does not load there, and new
                # actors would fail the same way on every video
                raise ConfigError(f"the Ray workers cannot start: {str(e)[-800:]}") from None
            # The actor (or its node) died: these items get error records, a new actor
            # takes its place.
            recs = [{"custom_id": cid, "video": vd["rel"], "question": q, "size": vd["size"],
                     "mtime_ns": vd["mtime_ns"], "config_fingerprint": fp, "config": cfg,
                     "attempt": attempt, "status": "error", "response": None,
                     "error": {"code": "ray_worker_died", "message": str(e)[:500]},
                     "timings_ms": {}, "finished_at": _now(), "schema": SCHEMA}
                    for cid, q, attempt in items]
            actor = actor_cls.remote(load_args)
        for rec in recs:
            record(rec)
        idle.append(actor)


# ------------------------------------------------------------------- the command (mminfer/batch_cli.py: its options)
def run(args) -> int:
    if (args.dir is None) == (args.manifest is None):
        raise InputError("give a folder (DIR) or --manifest FILE, one of them")
    questions = read_questions(args.question, args.questions) if args.dir is not None else []
    model = resolve_model(args.model)
    pipe = None
    if args.tensor_parallel > 1:         # rank 0 runs the job, the others follow its items
        if args.ray:
            raise ConfigError("--tensor-parallel and --ray do not go together: Ray spreads "
                              "whole videos over GPUs, tensor parallel one video over several")
        try:
            pipe = lockstep.lead_or_follow(lambda: load_pipeline(
                {"model": model, "attention": args.attention, "device": args.device,
                 "dtype": args.dtype, "min_sparse_len": args.min_sparse_len,
                 "kv_cache_dtype": args.kv_cache_dtype,
                 "tensor_parallel": args.tensor_parallel, "quantization": args.quantization}))
        except (lockstep.LockstepBroken, RuntimeError) as e:   # RuntimeError: gloo lost rank 0
            print(f"error: tensor-parallel rank: {e}", file=sys.stderr)
            return 1
        if pipe is None:
            return 0
    try:
        summary = run_batch(args.dir, questions, args.out, model=model, attention=args.attention,
                            manifest=args.manifest, item_timeout_s=args.item_timeout_s,
                            quarantine_after=args.quarantine_after,
                            fps=args.fps, max_frames=args.max_frames,
                            max_new_tokens=args.max_new_tokens, device=args.device,
                            dtype=args.dtype, min_sparse_len=args.min_sparse_len,
                            kv_cache_dtype=args.kv_cache_dtype,
                            retry_errors=args.retry_errors, ray_address=args.ray,
                            ray_workers=args.ray_workers, progress=not args.no_progress,
                            pipe=pipe, quantization=args.quantization)
    except BaseException as e:
        if pipe is None or pipe.broken is None:
            raise
        print(f"error: the tensor-parallel group broke: {e}", file=sys.stderr)
        return 1
    finally:
        if pipe is not None:
            pipe.close()
    print(summary.line())
    print(json.dumps({"summary": summary.to_dict(), "out": str(args.out)}))
    return 1 if summary.errors else 0
