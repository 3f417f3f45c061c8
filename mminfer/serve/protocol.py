"""The HTTP connection layer under the app: uvicorn's h11 protocol with three guards.

* A header deadline: a request's headers must arrive within ``header_timeout_s`` of the
  connection opening (or of the previous answer on a kept-alive one), else 408 and the
  connection closes. Without it 400 connections sending headers a byte at a time are held
  for as long as they like, bounded only by RLIMIT_NOFILE.
* A connection cap: at most ``max_connections`` open connections, and at most
  ``max_connections_per_client`` from one client address; one over is answered 503 and
  closed as it opens (its bytes are never parsed).
* uvicorn's own refusals (bad Content-Length, malformed chunked encoding, headers over the
  size limit, anything h11 rejects) in the service's JSON error shape, not plain text.

Refusals here happen before a request exists: they are counted in
``mminfer:refused_connections_total`` by reason, never stored as requests.
"""

from __future__ import annotations

import json
import logging

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("mminfer.serve")

HEADER_LIMIT_BYTES = 64 * 1024        # request line + headers at most (h11's default: 16 KiB)
LINGER_S = 1.0                        # a refused connection's answer gets this long to be read


class Connections:
    """Open connections, in all and per client address (event loop only)."""

    def __init__(self, settings, metrics=None):
        self.s = settings
        self.metrics = metrics
        self.total = 0
        self.by_host: dict[str, int] = {}

    def open(self, host: str) -> str | None:
        """Count a new connection; the reason it is refused, or None."""
        if self.total >= self.s.max_connections:
            return "connections"
        if self.by_host.get(host, 0) >= self.s.max_connections_per_client:
            return "connections_per_client"
        self.total += 1
        self.by_host[host] = self.by_host.get(host, 0) + 1
        return None

    def close(self, host: str):
        self.total -= 1
        n = self.by_host.get(host, 1) - 1
        if n <= 0:
            self.by_host.pop(host, None)
        else:
            self.by_host[host] = n

    def refused(self, reason: str):
        if self.metrics is not None:
            self.metrics.refuse(reason)


def _json(status: int, reason: bytes, code: str, message: str, **details) -> list:
    return [status, reason, json.dumps(error_body(code, message, status, **details)).encode()]


class GuardedH11Protocol(H11Protocol):
    guard: Connections                # set on the subclass ``protocol_class`` makes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._counted = None           # the client host this connection is counted under
        self._header_timer = None
        self._protocol_error = None
        self._discard = False
        orig = self.conn.next_event

        def next_event():              # keep h11's reason for the JSON answer
            try:
                return orig()
            except h11.RemoteProtocolError as e:
                self._protocol_error = e
                raise

        self.conn.next_event = next_event

    # ------------------------------------------------------------ connections
    def connection_made(self, transport):
        super().connection_made(transport)
        host = self.client[0] if self.client else "unknown"
        reason = self.guard.open(host)
        if reason is not None:
            self.guard.refused(reason)
            limit = (self.guard.s.max_connections if reason == "connections" else
                     self.guard.s.max_connections_per_client)
            what = "open connections" if reason == "connections" else \
                "open connections from your address"
            self._answer(*_json(503, b"Service Unavailable", "too_many_connections",
                                f"this server already has {limit} {what}, its limit; retry "
                                f"later", limit=limit), retry_after=1)
            return
        self._counted = host
        self._arm()

    def connection_lost(self, exc):
        self._disarm()
        if self._counted is not None:
            self.guard.close(self._counted)
            self._counted = None
        super().connection_lost(exc)

    # ------------------------------------------------------------ the header deadline
    def _arm(self):
        self._disarm()
        self._header_timer = self.loop.call_later(self.guard.s.header_timeout_s,
                                                  self._header_timeout)

    def _disarm(self):
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self):
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return                      # a request is being served: not ours to judge
        if self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            # an idle kept-alive connection: uvicorn's keep-alive timeout closes it
            if self.timeout_keep_alive_task is not None:
                return
        self.guard.refused("header_timeout")
        t = self.guard.s.header_timeout_s
        self._answer(*_json(408, b"Request Timeout", "header_timeout",
                            f"the request's headers did not arrive within this server's "
                            f"header deadline of {t:g} s", header_timeout_s=t))

    def handle_events(self):
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:     # a request's headers are in: the app has it now
            self._disarm()

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()                 # the next request's headers, on a kept-alive one

    # ------------------------------------------------------------ refusals as JSON
    def send_400_response(self, msg: str):
        e = self._protocol_error
        hint = getattr(e, "error_status_hint", 400) or 400
        detail = str(e) if e is not None and str(e) else "malformed request"
        self.guard.refused("bad_http")
        if hint == 431 or "too long" in detail.lower() or "too large" in detail.lower():
            body = _json(431, b"Request Header Fields Too Large", "headers_too_large",
                         f"the request's headers are over this server's limit of "
                         f"{HEADER_LIMIT_BYTES // 1024} KiB")
        else:
            body = _json(400, b"Bad Request", "bad_http",
                         f"the HTTP request is malformed ({detail}): check Content-Length, "
                         f"Transfer-Encoding and the headers")
        if self.cycle is not None and not self.cycle.response_complete:
            # a body cut off mid-way by a framing error: the app sees the client gone
            self.cycle.disconnected = True
            self.cycle.message_event.set()
            if self.cycle.response_started:
                self.transport.close()
                return
        self._answer(*body)

    def _answer(self, status: int, reason: bytes, body: bytes, retry_after: int | None = None):
        """A complete JSON answer, then close (written raw: h11 may be in an error state).
        Our side is shut first and what the client still sends is dropped for up to
        LINGER_S: closing with unread bytes would reset the connection and the client would
        never read the answer."""
        self._disarm()
        head = (f"HTTP/1.1 {status} ".encode() + reason + b"\r\n"
                b"content-type: application/json\r\nconnection: close\r\n"
                + (f"retry-after: {retry_after}\r\n".encode() if retry_after else b"")
                + f"content-length: {len(body)}\r\n\r\n".encode())
        self._discard = True
        try:
            self.transport.write(head + body)
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
                return
        except (OSError, RuntimeError):
            pass
        self.transport.close()

    def data_received(self, data: bytes):
        if self._discard:                # answered and closing: the rest is dropped
            return
        super().data_received(data)

    def eof_received(self):
        if self._discard:
            self.transport.close()
            return None
        return super().eof_received()


def protocol_class(settings, metrics=None):
    """A GuardedH11Protocol subclass bound to this server's limits."""
    return type("GuardedH11", (GuardedH11Protocol,),
                {"guard": Connections(settings, metrics)})


def config(app, **kwargs):
    """``uvicorn.Config`` for ``app`` with the guarded protocol (settings and metrics from
    ``app.state``); ``kwargs`` go to uvicorn (host, port, log_level...)."""
    s = app.state.settings
    return uvicorn.Config(app, http=protocol_class(s, app.state.metrics),
                          h11_max_incomplete_event_size=HEADER_LIMIT_BYTES, **kwargs)
