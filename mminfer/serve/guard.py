"""What one client, a refusal or a full disk may cost the service, kept small.

* ``ClientUploads``: the request bodies one client address sends at once. The upload places
  and queue slots are shared; without a share per address, eight sockets trickling a byte a
  second hold every one of them through the grace period, reconnect, and hold them again.
  Over its share a client gets 429 with Retry-After before its body is read.
* ``StorageFull`` (507): a write under ``--data-dir`` failed for lack of space (ENOSPC,
  EDQUOT); the request is answered 507 and ``/health`` says ``storage_full`` (503) until a
  write succeeds again, or 30 s have passed and the disk has room for an upload.
"""

from __future__ import annotations

import errno
import os
import time

from mminfer.errors import MMInferError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class TooManyFromClient(MMInferError):
    """A client address already sends as many bodies as its share allows."""
    code = "too_many_requests"
    http_status = 429


class StorageFull(MMInferError):
    """The server's data folder is full (HTTP 507 Insufficient Storage)."""
    code = "insufficient_storage"
    http_status = 507


def client_host(http) -> str:
    client = getattr(http, "client", None)
    return client.host if client is not None and client.host else "unknown"


class ClientUploads:
    """Bodies in flight per client address; all calls come from the event loop."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.active: dict[str, int] = {}

    def begin(self, host: str) -> "ClientUpload":
        n = self.active.get(host, 0)
        if self.limit is not None and n >= self.limit:
            raise TooManyFromClient(
                f"your address already sends {n} request bodies at once, this server's limit "
                f"per client; retry when one has arrived", max_uploads_per_client=self.limit)
        self.active[host] = n + 1
        return ClientUpload(self, host)


class ClientUpload:
    def __init__(self, owner: ClientUploads, host: str):
        self.owner, self.host, self.open = owner, host, True

    def end(self):
        if self.open:
            self.open = False
            n = self.owner.active.get(self.host, 1) - 1
            if n <= 0:
                self.owner.active.pop(self.host, None)
            else:
                self.owner.active[self.host] = n


class Storage:
    """Whether writes under the data folder fail for lack of space."""

    HOLD_S = 30.0

    def __init__(self, folder, need_bytes: int):
        self.folder = str(folder)
        self.need_bytes = need_bytes      # free space that counts as "has room again"
        self.full_since: float | None = None

    def free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.folder)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def failed(self, exc: BaseException) -> StorageFull | None:
        """The 507 for ``exc`` when it is (or wraps) a write that found no space, else None."""
        e = exc
        while e is not None and not isinstance(e, OSError):
            e = e.__cause__ or e.__context__
        if not isinstance(e, OSError) or e.errno not in NO_SPACE:
            return None
        if self.full_since is None:
            self.full_since = time.time()
        return StorageFull("the server's storage is full; the video could not be written. "
                           "Retry later or on another instance")

    def ok(self):
        """A write went through."""
        self.full_since = None

    def full(self) -> bool:
        """A write found no space within the last ``HOLD_S`` seconds, or since then the disk
        still has no room for an upload; a successful write ends it at once."""
        if self.full_since is None:
            return False
        free = self.free_bytes()
        if time.time() - self.full_since > self.HOLD_S and (free is None or
                                                            free >= self.need_bytes):
            self.full_since = None
        return self.full_since is not None
