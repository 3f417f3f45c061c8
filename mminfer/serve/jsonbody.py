"""JSON request bodies, parsed where they cannot hold the event loop, and bounded before any
schema sees them.

``json.loads`` and pydantic's validation hold the GIL for as long as they run, thread or not:
a legal 59 MB chat body with 2M text parts holds ``/health`` for 7 s. So a body
over ``IN_PROCESS_BYTES`` is parsed in a child process (a small pool of spawned
interpreters that import nothing but this module), which also counts what the body holds
(every value: objects, arrays, strings, numbers) and its nesting, and refuses a body over
``max_items`` or ``max_depth`` there (413 / 400): the server process only ever unpickles
and validates a bounded body. Small bodies are parsed and counted in the thread that asks
(a few milliseconds at most).

Strings the body decodes to must be valid Unicode: a lone surrogate (``"\\ud800"``, legal
JSON) is refused here with a 400 instead of reaching the tokenizer (a TypeError, once a 500).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

from mminfer.errors import InputError, TooLarge

IN_PROCESS_BYTES = 256 * 1024     # parsed in the calling thread below this size
WORKERS = 2
CHILD_MEMORY_BYTES = 6 * 2**30    # address space of a parsing child (a bad body: MemoryError)

_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_lock = threading.Lock()
_users = 0                        # servers of this process between start() and stop()


def check(data, max_items: int, max_depth: int):
    """None if ``data`` (parsed JSON) holds at most ``max_items`` values nested at most
    ``max_depth`` deep and every string is valid Unicode, else (status, message)."""
    n = 1
    stack = [(data, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            n += len(v)              # counted before any is visited: a 2M-item list is
            if n > max_items:        # refused at once, not walked
                return 413, (f"the request body holds more than {max_items} JSON values "
                             f"(messages, parts, fields...), this server's limit")
        if isinstance(v, dict):
            if depth > max_depth:
                return 400, f"the request body is nested deeper than {max_depth} levels"
            for k, x in v.items():
                if not k.isascii():
                    _check_text(k)
                stack.append((x, depth + 1))
        elif isinstance(v, list):
            if depth > max_depth:
                return 400, f"the request body is nested deeper than {max_depth} levels"
            stack.extend((x, depth + 1) for x in v)
        elif isinstance(v, str) and not v.isascii():
            bad = _check_text(v)
            if bad:
                return 400, bad
    return None


def _check_text(s: str) -> str | None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"the request body has a string that is not valid Unicode (a lone surrogate "
                f"{s[e.start]!r} at character {e.start}); send UTF-8 text")
    return None


def parse(raw: bytes, max_items: int, max_depth: int):
    """("ok", data) or ("error", status, message): runs in the child (or a thread)."""
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        return "error", 400, "the request body is not valid UTF-8 JSON"
    except RecursionError:
        return "error", 400, "the request body is not valid JSON: nested too deeply"
    except MemoryError:
        return "error", 413, "the request body is too large to parse on this server"
    except ValueError as e:
        return "error", 400, f"the request body is not valid JSON: {e}"
    bad = check(data, max_items, max_depth)
    if bad is not None:
        return ("error", *bad)
    return "ok", data


def _child_init(parent: int):
    # Ctrl-C in a terminal reaches the whole process group: the server shuts its children
    # down itself, and a child's KeyboardInterrupt traceback would only be noise
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import resource  # lazy: POSIX only
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    # A pool worker holds both ends of its call queue's pipe, so it never reads EOF when the
    # server dies (SIGKILL, a crash): without this, two orphans per server stayed behind.
    # The server's pid comes from the server: a child still starting when the server died
    # would otherwise read its new parent's.
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int, every: float = 0.5):
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(0)


def parser_pool() -> concurrent.futures.ProcessPoolExecutor:
    """The parsing processes (spawned once per server process, on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                WORKERS, mp_context=multiprocessing.get_context("spawn"),
                initializer=_child_init, initargs=(os.getpid(),))
            atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
        return _pool


def start():
    """Spawn every parsing process now (at server start), not in a client's request: the
    pool spawns a process on a submit that finds none idle, so ``WORKERS`` busy ones."""
    global _users
    with _pool_lock:
        _users += 1
    p = parser_pool()
    for _ in range(WORKERS):
        p.submit(time.sleep, 0.5)


def stop():
    """At server shutdown (after start()): the last server of this process ends the parsing
    processes and frees their queues. Not left to atexit: uvicorn ends a server stopped by
    SIGTERM by raising the signal again once it has shut down, which kills the process
    before atexit runs, and the resource tracker then reports the queues' semaphores as
    leaked."""
    global _pool, _users
    with _pool_lock:
        _users = max(_users - 1, 0)
        if _users:
            return
        p, _pool = _pool, None
    if p is not None:
        p.shutdown(wait=True, cancel_futures=True)


def _reset(broken):
    global _pool
    with _pool_lock:
        if _pool is broken:
            _pool = None
    broken.shutdown(wait=False, cancel_futures=True)


async def parse_body(raw: bytes, max_items: int, max_depth: int):
    """The parsed body, or InputError (400) / TooLarge (413) saying what is wrong."""
    if len(raw) <= IN_PROCESS_BYTES:
        out = await asyncio.to_thread(parse, raw, max_items, max_depth)
    else:
        p = parser_pool()
        try:
            out = await asyncio.wrap_future(p.submit(parse, raw, max_items, max_depth))
        except BrokenProcessPool:          # the child died (memory): this body's doing
            _reset(p)
            out = ("error", 413, "the request body could not be parsed within this server's "
                                 "memory limit")
    if out[0] == "ok":
        return out[1]
    _, status, message = out
    if status == 413:
        raise TooLarge(message, limit_items=max_items)
    raise InputError(message)
