"""What does decoding in the sandbox cost? The decode stage of a long video, in-process
against in a decode worker process (mminfer.video.sandbox: frames through shared
memory), in the same run.

    python benchmarks/decode.py                       # the longvila1m case of e2e.py
    python benchmarks/decode.py --frames 512 --repeats 5 --out results/decode_cpu.json

The video is e2e.py's synthetic file for its ``longvila1m`` case (4096 frames of 640x360 at
2 fps, H.264, written by the same function, reused from ``--work``), read as the pipeline
reads it for LongVILA: ``open_stream`` with the uniform sampler taking every frame (1,052,672
visual tokens at 257 per frame), frames handed over in chunks of 32 (the vision batch) to a
consumer that touches and drops them. The figure is the stream's ``decode_ms`` (the decoder
thread's busy time: what ``timings_ms.decode`` reports), median over ``--repeats``, the two
modes alternating; the worker's start-up (once per server, not per request) is excluded and
reported apart. Target (issue 32): the sandbox adds at most 5 % to the decode stage.
Runs on any machine with decord or PyAV (no GPU needed; nothing here uses one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _e2e():
    import importlib.util
    spec = importlib.util.spec_from_file_location("e2e_bench", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod             # its dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


def run_once(path: str, frames: int, chunk: int) -> dict:
    from mminfer import video
    t0 = time.perf_counter()
    with video.open_stream(path, sampling="uniform", fps=2.0, max_frames=frames) as s:
        n, touched = 0, 0
        for c in s.chunks(chunk):
            touched += int(c[:, ::64, ::64, 0].sum())     # read every chunk, as a consumer
            n += len(c)
        backend = s.backend
    wall = time.perf_counter() - t0
    return {"frames": n, "decode_ms": s.decode_ms, "wall_ms": wall * 1e3,
            "wait_ms": s.wait_ms, "backend": backend}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=4096)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=32, help="frames per consumer chunk")
    ap.add_argument("--work", default=str(ROOT / "benchmarks" / "work"),
                    help="where the synthetic video is written (and reused)")
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--nice", type=int, default=None,
                    help="the workers' niceness (default: the sandbox's, 5; on a machine "
                         "shared with other work, 0 measures the mechanism alone)")
    args = ap.parse_args(argv)

    from mminfer.video import sandbox
    e2e = _e2e()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"longvila1m_{args.frames}f_{args.width}x{args.height}.mp4"
    if not path.exists():
        t0 = time.perf_counter()
        e2e.write_video(path, args.frames, args.height, args.width, 2.0)
        print(f"wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)

    sandbox.configure(sandbox=True)
    if args.nice is not None:
        sandbox.configure(nice=args.nice)
    t0 = time.perf_counter()
    w = sandbox.decoder_pool().acquire()
    w.wait_ready()
    sandbox.decoder_pool().release(w, True)
    start_ms = (time.perf_counter() - t0) * 1e3

    runs = {"in_process": [], "sandbox": []}
    for r in range(args.repeats + 1):            # the first round warms the page cache
        for mode in (("in_process", "sandbox") if r % 2 else ("sandbox", "in_process")):
            sandbox.configure(sandbox=mode == "sandbox")
            res = run_once(str(path), args.frames, args.chunk)
            if r:
                runs[mode].append(res)
            print(f"round {r} {mode:10s} {res['frames']} frames decode "
                  f"{res['decode_ms']:9.1f} ms  wall {res['wall_ms']:9.1f} ms "
                  f"({res['backend']})", flush=True)
    sandbox.configure(sandbox=True)

    rows = {}
    for mode, rs in runs.items():
        d = statistics.median(x["decode_ms"] for x in rs)
        rows[mode] = {"decode_ms": round(d, 1),
                      "wall_ms": round(statistics.median(x["wall_ms"] for x in rs), 1),
                      "frames_per_s": round(rs[0]["frames"] / (d / 1e3), 1),
                      "runs_decode_ms": [round(x["decode_ms"], 1) for x in rs]}
    over = rows["sandbox"]["decode_ms"] / rows["in_process"]["decode_ms"] - 1
    result = {"video": {"path": str(path), "frames": args.frames, "width": args.width,
                        "height": args.height, "bytes": path.stat().st_size},
              "chunk": args.chunk, "repeats": args.repeats, "rows": rows,
              "sandbox_overhead_pct": round(100 * over, 2), "target_pct": 5.0,
              "worker_start_ms": round(start_ms, 1), "worker_nice": sandbox.config().nice,
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                       "python": platform.python_version(),
                       "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}}
    print(f"\n{'mode':12s} {'decode ms':>10s} {'frames/s':>9s} {'wall ms':>9s}")
    for mode, row in rows.items():
        print(f"{mode:12s} {row['decode_ms']:10.1f} {row['frames_per_s']:9.1f} "
              f"{row['wall_ms']:9.1f}")
    print(f"sandbox overhead on the decode stage: {100 * over:+.2f} % (target <= 5 %); "
          f"worker start {start_ms:.0f} ms (once), nice {sandbox.config().nice}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
