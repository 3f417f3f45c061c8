"""What `mminfer calibrate` costs on a real 7B: minutes and memory, per model shape.

Writes a full-size random-weight checkpoint (Qwen2.5-VL-7B's or LongVILA-7B's shapes, by
``benchmarks/e2e.py``'s writers) and runs the command a user runs,

    mminfer calibrate --model CKPT --videos synth:needle:FRAMES:SEED ... --device cuda --out ...

in a child process, as it is: the dense capture prefill, the per-head search, the config and
its report. Measured from outside: the wall time of the whole command and of its capture
(the child prints ``captured PATH (N tokens)`` as each video's capture ends), the peak GPU
memory in use on the device (polled with ``nvidia-smi``, or ``torch.cuda.mem_get_info`` without
it) and the child's peak resident host memory (``RUSAGE_CHILDREN``), the tokens per video
and the size of the captures on disk.

    python benchmarks/calibrate.py --model qwen --frames 448 --out out/calibrate
    python benchmarks/calibrate.py --model longvila --frames 128 --out out/calibrate
    python benchmarks/calibrate.py --tiny --model qwen --out /tmp/cal     # CPU smoke test

Random weights make the chosen patterns meaningless; what this measures is whether the
command fits on one GPU and how long it takes at 32K-64K tokens. ``calibrate.json`` in
``--out`` holds the figures (one record per model, appended).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import e2e  # noqa: E402  (the checkpoint writers)

# Frames of a 224 x 224 synthetic video (mminfer.offline.synthetic) for ~32K tokens each
# (Qwen2.5-VL: 72 tokens a frame, measured: 1024 frames gave 73,751 tokens on the H200).
DEFAULT_FRAMES = {"qwen": 448, "longvila": 128}
CAPTURED = re.compile(r"^captured (\S+) \((\d+) tokens\)")
# tqdm's bar of the search ("calibrate:  41%|...| 290/700 [01:02<01:28, 4.6run/s]")
PROGRESS = re.compile(r"^calibrate:\s+\d+%.*?(\d+)/(\d+) \[")


class GpuPeak:
    """The most device memory in use while it runs (GiB), polled every ``every`` s."""

    def __init__(self, every: float = 0.5):
        self.every, self.peak, self.how = every, None, None
        self._stop = threading.Event()
        self._read = self._reader()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _reader(self):
        if shutil.which("nvidia-smi"):
            self.how = "nvidia-smi memory.used"

            def read():
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=10).stdout
                return float(out.split()[0]) / 1024
            return read
        try:
            import torch   # lazy: only where nvidia-smi is missing
            if torch.cuda.is_available():
                self.how = "torch.cuda.mem_get_info"

                def read():
                    free, total = torch.cuda.mem_get_info()
                    return (total - free) / 2**30
                return read
        except ImportError:
            pass
        return None

    def _loop(self):
        while not self._stop.is_set():
            try:
                v = self._read()
                self.peak = v if self.peak is None else max(self.peak, v)
            except Exception:      # noqa: BLE001 - a failed poll is a missing sample
                pass
            self._stop.wait(self.every)

    def __enter__(self):
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def write_checkpoint(model: str, path: Path, device: str, tiny: bool, frames: int) -> float:
    t0 = time.perf_counter()
    if not (path / "config.json").is_file():
        if model == "qwen":
            e2e.write_qwen(path, device, tiny=tiny)
        else:
            e2e.write_longvila(path, device, tiny=tiny, max_position=131072,
                               num_frames=max(frames, 8))
        e2e.free_memory()
    return time.perf_counter() - t0


def run_calibrate(ckpt: Path, videos: list[str], out: Path, device: str, extra: list[str],
                  log, deadline_s: float | None = None) -> dict:
    """Runs the command; past ``deadline_s`` it is stopped and the record says how far the
    search got (runs done of total), so the minutes a whole search takes can be read off."""
    cmd = [sys.executable, "-m", "mminfer", "calibrate", "--model", str(ckpt),
           "--videos", *videos, "--device", device, "--out", str(out / "heads.json"), *extra]
    log("$ " + " ".join(cmd))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    captured, t_capture, done, stopped = [], None, None, False
    t0 = time.perf_counter()
    with GpuPeak() as gpu:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=ROOT)
        timer = None
        if deadline_s:
            def stop():
                nonlocal stopped
                stopped = True
                proc.kill()
            timer = threading.Timer(deadline_s, stop)
            timer.start()
        tail, last_log = [], 0.0
        for line in proc.stdout:      # tqdm's \r updates arrive as lines (universal newlines)
            line = line.rstrip()
            if not line:
                continue
            tail = (tail + [line])[-40:]
            now = time.perf_counter() - t0
            m = CAPTURED.match(line)
            if m:
                captured.append({"path": m.group(1), "tokens": int(m.group(2))})
                t_capture = now
                log(f"{now:8.1f} s  {line}")
            m = PROGRESS.match(line)
            if m:
                done = (int(m.group(1)), int(m.group(2)), round(now, 1))
                if now - last_log >= 15:
                    last_log = now
                    log(f"{now:8.1f} s  search {done[0]}/{done[1]}")
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
    total = time.perf_counter() - t0
    search = None
    if done is not None and t_capture is not None:
        runs, of, at = done
        search = {"runs_done": runs, "runs_total": of, "at_s": at,
                  # a stopped search: its whole length at the rate it ran
                  "projected_search_s": round((at - t_capture) * of / max(runs, 1), 1)}
    if rc != 0:
        log("\n".join(tail))
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20   # KiB -> GiB
    return {"rc": rc, "stopped_at_deadline": stopped, "search_progress": search,
            "command": " ".join(cmd[1:]), "total_s": round(total, 1),
            "capture_s": None if t_capture is None else round(t_capture, 1),
            "search_s": None if t_capture is None else round(total - t_capture, 1),
            "tokens": [c["tokens"] for c in captured],
            "capture_bytes": sum(Path(c["path"]).stat().st_size for c in captured
                                 if Path(c["path"]).is_file()),
            "peak_gpu_gib": None if gpu.peak is None else round(gpu.peak, 2),
            "peak_gpu_how": gpu.how, "peak_host_rss_gib": round(rss, 2),
            "tail": tail[-12:] if rc else []}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("qwen", "longvila"), default="qwen")
    p.add_argument("--frames", type=int, default=None,
                   help="frames per synthetic video (default: ~32K tokens: "
                        f"{DEFAULT_FRAMES}; --tiny: 8)")
    p.add_argument("--videos", type=int, default=1, help="synthetic videos (seeds) to capture")
    p.add_argument("--task", default="needle", help="synthetic task (needle, colour, count, order)")
    p.add_argument("--tiny", action="store_true", help="the test checkpoints' shapes, on the CPU")
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--work-dir", default="/tmp/mminfer_calibrate",
                   help="checkpoints and captures (local disk; never under --out)")
    p.add_argument("--out", default="out/calibrate")
    p.add_argument("--keep-captures", action="store_true")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop the command after this long and record how far its search got")
    p.add_argument("calibrate_args", nargs="*",
                   help="more arguments for mminfer calibrate (after --)")
    a = p.parse_args(argv)
    device = a.device or ("cpu" if a.tiny else "cuda")
    frames = a.frames or (8 if a.tiny else DEFAULT_FRAMES[a.model])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    logf = (out / "calibrate.log").open("a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    ckpt = work / f"{a.model}{'-tiny' if a.tiny else '7b'}"
    write_s = write_checkpoint(a.model, ckpt, device, a.tiny, frames)
    log(f"checkpoint {ckpt} ready in {write_s:.1f} s")
    videos = [f"synth:{a.task}:{frames}:{910000 + i}" for i in range(a.videos)]
    run_dir = out / f"{a.model}{'-tiny' if a.tiny else ''}"
    run_dir.mkdir(parents=True, exist_ok=True)
    extra = list(a.calibrate_args)
    if not any(x.startswith("--capture-dir") for x in extra):
        extra += ["--capture-dir", str(work / f"{a.model}.captures")]
    rec = run_calibrate(ckpt, videos, run_dir, device, extra, log,
                        deadline_s=a.deadline_s and max(1.0, a.deadline_s - write_s))
    rec.update(model=a.model, tiny=a.tiny, device=device, frames=frames, videos=videos,
               checkpoint_write_s=round(write_s, 1),
               commit=os.environ.get("E2E_COMMIT") or e2e._git_commit(),
               date=time.strftime("%Y-%m-%d"))
    if not a.keep_captures:
        shutil.rmtree(work / f"{a.model}.captures", ignore_errors=True)
    path = out / "calibrate.json"
    runs = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(runs + [rec], indent=1))
    log(json.dumps({k: v for k, v in rec.items() if k != "tail"}))
    return 0 if rec["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
