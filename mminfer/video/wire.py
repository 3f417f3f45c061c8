"""The messages between a decode worker process and its parent, over a Unix socket.

A message: 12 bytes (payload length, number of file descriptors, the descriptors riding
along as SCM_RIGHTS), then the pickled payload. Only small control messages and facts
travel here; frames go through shared memory.
"""
from __future__ import annotations

import array
import pickle
import socket
import struct
import time

_HEAD = struct.Struct("<QI")


def send(sock, obj, fds=()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = _HEAD.pack(len(data), len(fds))
    if fds:
        n = sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", fds))])
        if n < len(head):
            sock.sendall(head[n:])
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _timeout(sock, deadline)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _timeout(sock, deadline):
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout
    sock.settimeout(left)


def recv(sock, deadline: float | None = None):
    head, fds = b"", []
    while len(head) < _HEAD.size:
        _timeout(sock, deadline)
        msg, anc, _, _ = sock.recvmsg(_HEAD.size - len(head), socket.CMSG_SPACE(16))
        if not msg:
            raise EOFError
        head += msg
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[:len(data) - len(data) % 4]))
    n, _ = _HEAD.unpack(head)
    return pickle.loads(_recv_exact(sock, n, deadline)), fds

