"""The JSON-parsing processes of the server (mminfer.serve.jsonbody) end with it: a server
killed outright (SIGKILL) leaves no parsing process behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Starts the pool as the server does, prints the workers' pids, then waits to be killed.
_SERVER = """
import sys, time
from mminfer.serve import jsonbody
jsonbody.start()
p = jsonbody.parser_pool()
deadline = time.time() + 60
while len(p._processes) < jsonbody.WORKERS and time.time() < deadline:
    time.sleep(0.05)
print(" ".join(str(pid) for pid in p._processes), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie reaped by nobody yet counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_parsing_processes_end_when_the_server_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30      # they look every 0.5 s; a busy machine is slow
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"parsing processes {left} outlived the server"
