"""Stopping an answer that does not stop when asked.

``Pipeline.answer(cancel=...)`` checks its callable between stages and before every decoder
layer. Between two checks lies one stage or one layer, and there one kernel launch can hold
the thread for seconds (the Triton interpreter on a CPU runs a launch as Python), a video
decode for longer. A :class:`Guard` lets another thread end that wait: ``interrupt()`` raises
:class:`Interrupted` asynchronously in the guarded thread, which unwinds through the
libraries' ``finally`` blocks and context managers like any exception (the interpreter
restores its patched ``tl`` functions, the prefill context resets, the cache is dropped with
the request). It is a BaseException so that no ``except Exception`` in a library swallows or
rewraps it.

Use: ``guard.run(fn, ...)`` in the working thread; on ``Interrupted``, call
``guard.disarm()`` again (the interrupt can land while ``run`` is returning) and treat the
call as cancelled.
"""

from __future__ import annotations

import ctypes
import threading


class Interrupted(BaseException):
    """Raised in a guarded thread by :meth:`Guard.interrupt`."""


def raise_in_thread(ident: int, exc_type) -> int:
    """Schedule ``exc_type`` in thread ``ident``, or clear a scheduled one (None)."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc_type) if exc_type is not None else None)


class Guard:
    """One call that another thread may interrupt, once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ident: int | None = None
        self._armed = False
        self._injected = False
        self.interrupted = False

    def run(self, fn, *args, **kwargs):
        with self._lock:
            self._ident, self._armed = threading.get_ident(), True
        try:
            return fn(*args, **kwargs)
        finally:
            self.disarm()

    def disarm(self):
        with self._lock:
            self._armed = False
            if self._injected:
                self._injected = False
                raise_in_thread(self._ident, None)     # one not delivered yet

    def interrupt(self) -> bool:
        """Raise Interrupted in the guarded call, if it is still running; True if so."""
        with self._lock:
            if not self._armed or self._injected or self.interrupted:
                return False
            self._injected = self.interrupted = True
            raise_in_thread(self._ident, Interrupted)
            return True
