"""How long a video cache entry's spill to the host takes, by how the host memory is had.

Why: the load run at `4667ff1` on an H100 (benchmarks/results/2026-12-06-load-h100-4667ff1/)
gave the second new video a ``room`` stage of ~21.5 s: its prefill made room by spilling the
cached videos' KV (4 entries of ~5 GB) to the host, holding the model's turn and the cache's
lock, and the hits' ``wait`` p99 was 20.3 s. A spill (mminfer.models.kv.SlabLayer._copied)
allocates two pinned buffers a layer (``torch.empty(pin_memory=True)``: PyTorch's caching
host allocator, cudaHostAlloc for every new block, sizes rounded up to a power of two) and
copies into them; at ~1 GB/s the allocation, not the copy, is the suspect.

Each mode runs in a process of its own (the allocator's settings are read once):
``default``; ``register`` (``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
pinned_num_register_threads:8``: malloc, pages mapped by 8 threads, cudaHostRegister);
``pageable`` (no pinning). Per mode: an entry of ``--layers`` x 2 buffers of ``--rows`` rows
(Qwen2.5-VL-7B's 4 KV heads of 128, bf16) spilled ``--entries`` times into fresh buffers (the
first spills of a server), then once more after the spilled buffers are freed (the
allocator's cache), and restored to the device: GB/s of each.

    python lab/experiments/pinned_spill.py --out $OUT/pinned_spill.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {"default": None,
         "register": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
         "pageable": None}


def _one(mode: str, layers: int, rows: int, entries: int) -> dict:
    import torch
    dev = "cuda"
    pin = mode != "pageable"
    src = [torch.randn(1, 4, rows, 128, device=dev, dtype=torch.bfloat16)
           for _ in range(2 * layers)]
    gb = sum(t.numel() * t.element_size() for t in src) / 1e9

    def spill():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = []
        for t in src:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            h.copy_(t, non_blocking=pin)
            out.append(h)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    kept, fresh = [], []
    for _ in range(entries):
        out, s = spill()
        kept.append(out)
        fresh.append(round(gb / s, 2))
    kept.pop()                       # one entry's buffers back to the allocator's cache
    out, s = spill()
    again = round(gb / s, 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    back = [h.to(dev, non_blocking=pin) for h in out]
    torch.cuda.synchronize()
    restore = round(gb / (time.perf_counter() - t0), 2)
    del back
    return {"mode": mode, "entry_gb": round(gb, 3), "fresh_gb_s": fresh,
            "reused_gb_s": again, "restore_gb_s": restore}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, default=92000)
    ap.add_argument("--entries", type=int, default=3)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)    # the child
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.mode:
        print(json.dumps(_one(args.mode, args.layers, args.rows, args.entries)))
        return
    rows = []
    for mode, conf in MODES.items():
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        got = subprocess.run([sys.executable, __file__, "--mode", mode, "--layers",
                              str(args.layers), "--rows", str(args.rows), "--entries",
                              str(args.entries)], env=env, capture_output=True, text=True,
                             timeout=300)
        row = (json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0
               else {"mode": mode, "error": got.stderr[-2000:]})
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
