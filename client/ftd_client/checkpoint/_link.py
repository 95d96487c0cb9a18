"""Requests to the rank's node daemon, on a connection of the checkpoint's own (no sign of life).

Blocking with a deadline: a daemon that does not answer in time is the same as no daemon (the
save is skipped, a load finds nothing); the connection is then opened afresh on the next request,
so a late reply is never taken for another's.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from typing import Any

from ftd_client import protocol, wire
from ftd_client.checkpoint_messages import CheckpointMessage

REPLY_TIMEOUT_S = 5.0


class CheckpointLink:
    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def request(
        self, message: CheckpointMessage, timeout_s: float = REPLY_TIMEOUT_S
    ) -> dict[str, Any] | None:
        with self._lock:
            request_id = next(self._ids)
            try:
                sock = self._sock or self._connect()
                sock.settimeout(timeout_s)
                sock.send(wire.encode(message, id=request_id), socket.MSG_NOSIGNAL)
                deadline = time.monotonic() + timeout_s
                while True:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    data = sock.recv(protocol.MAX_MESSAGE_BYTES)
                    if not data:
                        raise ConnectionError("the daemon closed the connection")
                    reply = json.loads(data)
                    if isinstance(reply, dict) and reply.get("id") == request_id:
                        return reply
            except (OSError, ValueError):
                self.close()
                return None

    def notify(self, message: CheckpointMessage) -> None:
        """Send a message that has no answer, if the connection is free and the daemon keeps up;
        else drop it (the next one says more)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            sock = self._sock or self._connect()
            sock.send(wire.encode(message), socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError:
            self.close()
        finally:
            self._lock.release()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
