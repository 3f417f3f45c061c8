"""/health latency while the server works on something, net of what the machine itself stalled.

A fixed bound alone fails on a loaded CI machine for reasons that are not the server's (issue
32, item 9: 0.959 s against 0.5 s on a busy 2-core machine, passing alone 3 of 3; a 2.5 s
probe with the machine four times oversubscribed). So the probes run in a process of their
own (the server under test runs in a thread of the test's process: a prober there would
wait on the same interpreter lock as the loop it measures), beside a control: the same
probe against a trivial HTTP server in that process. A stall of the machine delays both; a
held event loop delays only /health. Each /health probe's *excess* is its latency minus the
longest control probe that overlapped it in time, and the bound is the issue's budget plus
the worst probe of an idle baseline measured first, in the same run.
"""

import subprocess
import sys
import time

BUDGET_S = 0.5      # issue 32: /health within 0.5 s under any body up to the size limit

# The probe process: GET <url>/health and GET <control>/ every 20 ms each, from two threads
# on kept-alive connections, one line per probe: "<tag> <start> <end>" (CLOCK_MONOTONIC).
# It ends when its stdin closes.
_PROBE = r"""
import http.client, http.server, os, sys, threading, time, urllib.parse

class Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

ctl = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
threading.Thread(target=ctl.serve_forever, daemon=True).start()
lock = threading.Lock()

def probe(tag, host, port, path):
    conn = http.client.HTTPConnection(host, port, timeout=120)
    while True:
        t0 = time.monotonic()
        try:
            conn.request("GET", path)
            conn.getresponse().read()
        except Exception:
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=120)
            continue
        t1 = time.monotonic()
        with lock:
            sys.stdout.write(f"{tag} {t0} {t1}\n")
            sys.stdout.flush()
        time.sleep(0.02)

u = urllib.parse.urlsplit(sys.argv[1])
for args in (("s", u.hostname, u.port, "/health"), ("c", "127.0.0.1", ctl.server_address[1], "/")):
    threading.Thread(target=probe, args=args, daemon=True).start()
sys.stdin.read()
os._exit(0)
"""


class Prober:
    """/health (and the control) every 20 ms from a process of their own: ``measure(seconds)``
    (the baseline: /health latencies), or as a context manager around the work (``times``:
    /health latencies; ``excess``: each net of the longest overlapping control probe)."""

    def __init__(self, url):
        self.url = url
        self.times: list[float] = []
        self.excess: list[float] = []
        self._proc = None

    def _start(self):
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _stop(self):
        out, _ = self._proc.communicate("", timeout=180)
        server, control = [], []
        for line in out.splitlines():
            tag, t0, t1 = line.split()
            (server if tag == "s" else control).append((float(t0), float(t1)))
        self.times = [b - a for a, b in server]
        self.excess = [(b - a) - max((d - c for c, d in control if c < b and d > a),
                                     default=0.0) for a, b in server]
        return self.times

    def measure(self, seconds) -> list[float]:
        self._start()
        time.sleep(seconds)
        return list(self._stop())

    def __enter__(self):
        self._start()
        return self

    def __exit__(self, *exc):
        self._stop()


def health_bound(baseline: list[float]) -> float:
    """The largest /health excess allowed while the server works: the issue's 0.5 s plus
    the worst probe of the idle baseline (what the machine itself added, by scheduling,
    in this run). A held event loop exceeds it by seconds (7 s for the 2M-part body)."""
    return BUDGET_S + max(baseline)
