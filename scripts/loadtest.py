"""A bounded loopback load test of ``mminfer serve`` (issue 13's closing check).

Starts the server (the embedded model on the CPU unless --model/--device say otherwise) on
a free loopback port and, at once:

  * 20 slow clients trickle a multipart body a few bytes at a time (408 once past the
    server's grace period, or 503 when no slot is free), half of them first;
  * 50 clients upload a sample video to /v1/answer (most find the queue full: 503 with
    Retry-After; the rest are answered);
  * 5 clients ask for attention=sparse and leave once the worker has run their request for
    3 s, inside the sparse prefill (they retry on 503, as Retry-After says, until they get
    the worker);
  * /health is probed every 50 ms throughout.

It prints one JSON summary and exits 1 unless: every request was answered (200) or refused
(503 with Retry-After, 408), none lost (the server counted every request sent), /health
always answered within 0.5 s, the worker was free within 2 s of each abandoned request's
disconnect, and no temp file was left. Loopback only; everything ends within --budget-s.

    TRITON_INTERPRET=1 python scripts/loadtest.py            # CPU: sparse under the interpreter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "samples" / "videos" / "needle_0.mp4"
QUESTION = "What number appears in the video?"


def multipart(fields: dict, video: bytes, boundary: str = "LOADTEST") -> tuple[bytes, bytes]:
    """(headers, body) of a /v1/answer request."""
    b = boundary.encode()
    body = b""
    for k, v in fields.items():
        body += (b"--" + b + b'\r\nContent-Disposition: form-data; name="' + k.encode() +
                 b'"\r\n\r\n' + str(v).encode() + b"\r\n")
    body += (b"--" + b + b'\r\nContent-Disposition: form-data; name="video"; filename="v.mp4"'
             b"\r\nContent-Type: video/mp4\r\n\r\n" + video + b"\r\n--" + b + b"--\r\n")
    return body, b"multipart/form-data; boundary=" + b


async def raw_request(port: int, head_extra: dict, body: bytes, ctype: bytes, *, trickle=None,
                      leave=None, timeout: float = 120.0):
    """Send a request over a plain socket: all at once, a few bytes at a time (``trickle``:
    (bytes, seconds)), or leaving when ``leave`` (an asyncio.Event) is set. Returns
    (status, headers) or ("left", None)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/answer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            .encode() + b"Content-Type: " + ctype + b"\r\n" +
            b"".join(f"{k}: {v}\r\n".encode() for k, v in head_extra.items()) + b"\r\n")
    writer.write(head)

    async def send():
        if trickle is None:
            writer.write(body)
            await writer.drain()
            return
        n, every = trickle
        for i in range(0, len(body), n):
            writer.write(body[i:i + n])
            await writer.drain()
            await asyncio.sleep(every)

    async def answer():
        line = await reader.readline()
        headers = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b""):
                break
            k, _, v = h.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", 0))
        data = await reader.readexactly(n) if n else b""
        return int(line.split()[1]), headers, data

    sender = asyncio.create_task(send())
    reply = asyncio.create_task(answer())
    waits = {reply} | ({asyncio.create_task(leave.wait())} if leave is not None else set())
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if reply in done:
            status, headers, data = reply.result()
            return status, headers, data
        return ("left" if done else "timeout"), None, None
    except (ConnectionError, asyncio.IncompleteReadError) as e:
        return f"connection error: {type(e).__name__}", None, None
    finally:
        for t in (sender, reply, *waits):
            t.cancel()
        writer.close()


async def main(args) -> dict:
    video = SAMPLE.read_bytes()
    data_dir = Path(tempfile.mkdtemp(prefix="mminfer-load-"))
    cmd = [sys.executable, "-m", "mminfer", "serve", "--port", "0", "--data-dir", str(data_dir),
           "--log-level", "warning", "--upload-grace-s", str(args.grace_s),
           "--min-upload-kbps", "16", "--queue-size", str(args.queue_size)]
    if args.model:
        cmd += ["--model", args.model]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("MMINFER_API_KEY", None)
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=ROOT)
    log: list[str] = []
    try:
        port = None
        t_end = time.monotonic() + 300
        while port is None and time.monotonic() < t_end:
            line = await asyncio.to_thread(server.stdout.readline)
            if not line:
                raise SystemExit("the server exited:\n" + "".join(log))
            log.append(line)
            m = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
        threading_drain(server, log)
        return await run_load(args, port, video, data_dir)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def threading_drain(server, log):
    import threading

    def drain():
        for line in server.stdout:
            log.append(line)

    threading.Thread(target=drain, daemon=True).start()


async def run_load(args, port: int, video: bytes, data_dir: Path) -> dict:
    import httpx

    base = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    health_ms: list[float] = []
    health_state: dict = {}

    async def probe():
        async with httpx.AsyncClient(timeout=5) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    h = (await c.get(f"{base}/health")).json()
                    health_state.update(h, seen_at=time.monotonic())
                    health_ms.append((time.monotonic() - t0) * 1e3)
                except httpx.HTTPError:
                    health_ms.append(float("inf"))
                await asyncio.sleep(0.05)

    async def upload(i):
        body, ctype = multipart({"question": QUESTION, "max_new_tokens": 4}, video)
        return await raw_request(port, {"X-Request-ID": f"upload-{i}"}, body, ctype)

    async def slow(i):
        body, ctype = multipart({"question": QUESTION}, video)
        return await raw_request(port, {"X-Request-ID": f"slow-{i}"}, body, ctype,
                                 trickle=(8, 0.5), timeout=args.grace_s + 60)

    freed_s: list[float] = []
    sparse_tries = []

    async def abandoned(i):
        """Ask sparse (retrying on 503 as Retry-After says); leave once the worker has run it
        for --abandon-after-s (by then in the sparse prefill); measure until the worker is
        running something else or nothing."""
        rid = f"abandon-{i}"
        body, ctype = multipart({"question": QUESTION, "attention": "sparse",
                                 "max_new_tokens": 4}, video)
        for attempt in range(200):
            leave = asyncio.Event()
            task = asyncio.create_task(raw_request(port, {"X-Request-ID": rid}, body, ctype,
                                                   leave=leave, timeout=600))
            while not task.done() and health_state.get("running_request_id") != rid:
                await asyncio.sleep(0.02)
            if task.done():                               # refused: come back as told
                status, headers, _ = task.result()
                sparse_tries.append(status)
                if status == 503:
                    await asyncio.sleep(min(float(headers.get("retry-after", 1)), 5))
                    continue
                return {"id": rid, "status": status}
            await asyncio.sleep(args.abandon_after_s)
            t0 = time.monotonic()
            leave.set()
            await task
            while health_state.get("running_request_id") == rid or \
                    health_state.get("seen_at", 0) < t0:
                await asyncio.sleep(0.01)
            freed_s.append(health_state["seen_at"] - t0)
            return {"id": rid, "status": "left", "freed_s": freed_s[-1], "attempts": attempt + 1}
        return {"id": rid, "status": "never ran"}

    prober = asyncio.create_task(probe())
    t0 = time.monotonic()
    # half the slow clients first, so some hold slots (and meet the grace period), half after
    slows = [asyncio.create_task(slow(i)) for i in range(10)]
    await asyncio.sleep(0.3)
    uploads = [asyncio.create_task(upload(i)) for i in range(50)]
    await asyncio.sleep(0.3)
    slows += [asyncio.create_task(slow(i)) for i in range(10, 20)]
    sparse = []
    for i in range(5):                  # one after another: each must reach the worker
        sparse.append(await abandoned(i))
    up_res = await asyncio.gather(*uploads)
    slow_res = await asyncio.gather(*slows)
    wall = time.monotonic() - t0
    await asyncio.sleep(0.5)
    stop.set()
    await prober
    async with httpx.AsyncClient(timeout=10) as c:
        metrics = (await c.get(f"{base}/metrics")).text
    from prometheus_client.parser import text_string_to_metric_families
    samples = [x for fam in text_string_to_metric_families(metrics) for x in fam.samples]
    counted = sum(x.value for x in samples if x.name == "mminfer:requests_total")
    by_status = {x.labels["status"]: int(x.value) for x in samples
                 if x.name == "mminfer:requests_total"}
    stop_sum = sum(x.value for x in samples if x.name == "mminfer:request_stop_seconds_sum")
    left = sorted(os.listdir(data_dir / "uploads"))

    def tally(results):
        out: dict = {}
        for status, headers, _ in results:
            key = str(status)
            if status == 503 and "retry-after" not in (headers or {}):
                key = "503 without Retry-After"
            out[key] = out.get(key, 0) + 1
        return out

    retry_after = [int(h["retry-after"]) for s, h, _ in up_res + slow_res
                   if s == 503 and h and "retry-after" in h]
    sent = 50 + 20 + 5 + len(sparse_tries)
    summary = {
        "wall_s": round(wall, 1),
        "uploads": tally(up_res), "slow_clients": tally(slow_res),
        "sparse_abandoned": sparse, "sparse_refused_before_running": len(sparse_tries),
        "retry_after_s": {"min": min(retry_after), "max": max(retry_after),
                          "median": statistics.median(retry_after)} if retry_after else None,
        "requests_sent": sent, "requests_counted_by_server": int(counted),
        "server_statuses": by_status,
        "health_ms": {"probes": len(health_ms), "max": round(max(health_ms), 1),
                      "p50": round(statistics.median(health_ms), 1)},
        "worker_freed_after_disconnect_s": [round(x, 3) for x in freed_s],
        "server_stop_seconds_sum": round(stop_sum, 3),
        "temp_files_left": left,
    }
    ok_status = {"200", "503", "408"}
    checks = {
        "every request answered or refused": all(
            k in ok_status for k in (*summary["uploads"], *summary["slow_clients"])),
        "none lost": counted == sent,
        "health under 0.5 s": max(health_ms) < 500,
        "worker free within 2 s": len(freed_s) == 5 and max(freed_s) < 2.0,
        "no temp file left": not left,
    }
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    return summary


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--queue-size", type=int, default=16)
    ap.add_argument("--grace-s", type=float, default=5.0,
                    help="the server's upload grace period (slow clients get 408 after it)")
    ap.add_argument("--abandon-after-s", type=float, default=3.0,
                    help="how long the worker runs a sparse request before its client leaves")
    ap.add_argument("--budget-s", type=float, default=900.0, help="give up after this long")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1" and a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"     # sparse on the CPU runs under the interpreter
    result = asyncio.run(asyncio.wait_for(main(a), a.budget_s))
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)
