"""/health latency while the server works on something, against a baseline of the same run.

A fixed bound alone fails on a loaded CI machine for reasons that are not the server's (issue
32, item 9: 0.959 s against 0.5 s on a busy 2-core machine, passing alone 3 of 3). So the
probe first measures an idle server for a second, in the same run and process, and the
bound is the issue's budget plus what the machine added by itself then.
"""

import threading
import time

import httpx

BUDGET_S = 0.5      # issue 32: /health within 0.5 s under any body up to the size limit


class Prober:
    """/health every 20 ms from a thread: ``measure(seconds)`` (the baseline), or as a
    context manager around the work (``times``)."""

    def __init__(self, url):
        self.url = url
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self, out):
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                c.get(f"{self.url}/health")
                out.append(time.monotonic() - t0)
                time.sleep(0.02)

    def measure(self, seconds) -> list[float]:
        out: list[float] = []
        self._stop.clear()
        t = threading.Thread(target=self._run, args=(out,))
        t.start()
        time.sleep(seconds)
        self._stop.set()
        t.join()
        return out

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(self.times,))
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def health_bound(baseline: list[float]) -> float:
    """The largest /health latency allowed while the server works: the issue's 0.5 s plus
    the worst probe of the idle baseline (what the machine itself added, by scheduling,
    in this run). A held event loop exceeds it by seconds (7 s for the 2M-part body)."""
    return BUDGET_S + max(baseline)
