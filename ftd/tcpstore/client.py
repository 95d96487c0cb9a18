"""A blocking client of c10d's TCPStore protocol, without torch: the daemon's own connections
to the stores it uses (the in-process rounds'), where torch's client would cost the daemon
`import torch` (2.2 CPU-s, ~300 MB, and seconds of a held GIL while a lease or keepalive runs).

It speaks to torch 2.13's server as torch's C++ client does (tests/tcpstore/test_tcpstore.py
holds both clients to the same answers), with torch's semantics where the daemon relies on
them: `get` and `multi_get` wait for their keys, `wait` and a blocking `queue_pop` give up at
the timeout (StoreTimeout, after cancelling the wait so that the stream stays in step), and a
closed or broken connection is StoreGone. Replies are read bounded: a value is at most
wire.MAX_VALUE_BYTES, a count at most wire.MAX_KEYS; anything else is StoreGone.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Sequence
from datetime import timedelta

from ftd.tcpstore.wire import (
    MAX_VALUE_BYTES,
    VALIDATION_MAGIC,
    Command,
    Query,
    WaitReply,
    encode_query,
)

_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")

Text = str | bytes
MIN_TIMEOUT_S = 0.001
"""A socket timeout of 0 would make the socket non-blocking: a timeout is at least this."""
READ_BYTES = 64 << 10
"""What one receive asks for at least: a reply and its value come whole where they can."""
MAX_READ_BYTES = 1 << 20


class StoreGone(ConnectionError):
    """The store closed the connection, broke the protocol, or could not be reached."""


class StoreTimeout(TimeoutError):
    """A wait (or a blocking read) reached its timeout: the connection is still usable."""


KEY_PREFIX = b"/"
"""torch's client puts every key of its user under "/" (TCPStore's keyPrefix_, apart from its
own keys): so does this one, and the two see the same keys."""


def _bytes(value: Text) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key(key: Text) -> bytes:
    return KEY_PREFIX + _bytes(key)


def _keys(keys: Sequence[Text]) -> tuple[bytes, ...]:
    return tuple(map(_key, keys))


class StoreClient:
    """One connection, used by one thread at a time (as torch's client)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        """How long `get`, `multi_get`, `wait` and a blocking `queue_pop` wait (set_timeout)."""
        self._buffer = bytearray()  # received, not yet read: only ever the replies asked for
        self._sock_timeout_s = timeout_s
        self._asked = Command.VALIDATE
        """The last query sent: what a reply that never came was the answer to."""
        try:
            self._sock = socket.create_connection((host.strip("[]"), port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as error:
            raise StoreGone(f"cannot reach the store at {host}:{port}: {error}") from None
        self._send(Query(Command.VALIDATE, number=VALIDATION_MAGIC))

    def close(self) -> None:
        """Close the connection; a thread blocked on it wakes (StoreGone)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def set_timeout(self, timeout: timedelta | float) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.timeout_s = max(0.0, seconds)

    # -- operations ---------------------------------------------------------------------------

    def set(self, key: Text, value: Text) -> None:
        self._send(Query(Command.SET, (_key(key),), (_bytes(value),)))

    def get(self, key: Text) -> bytes:
        self.wait([key])
        self._send(Query(Command.GET, (_key(key),)))
        return self._string()

    def add(self, key: Text, amount: int) -> int:
        self._send(Query(Command.ADD, (_key(key),), number=amount))
        return self._i64()

    def check(self, keys: Sequence[Text]) -> bool:
        self._send(Query(Command.CHECK, _keys(keys)))
        return self._u8() == 0  # CheckReply.READY

    def compare_set(self, key: Text, expected: Text, desired: Text) -> bytes:
        values = (_bytes(expected), _bytes(desired))
        self._send(Query(Command.COMPARE_SET, (_key(key),), values))
        return self._string()

    def multi_get(self, keys: Sequence[Text]) -> list[bytes]:
        self.wait(keys)
        self._send(Query(Command.MULTI_GET, _keys(keys)))
        return [self._string() for _ in keys]

    def multi_set(self, keys: Sequence[Text], values: Sequence[Text]) -> None:
        if len(keys) != len(values):
            raise ValueError("multi_set: as many values as keys")
        self._send(Query(Command.MULTI_SET, _keys(keys), tuple(map(_bytes, values))))

    def delete_key(self, key: Text) -> bool:
        self._send(Query(Command.DELETE_KEY, (_key(key),)))
        return self._i64() > 0

    def queue_push(self, key: Text, value: Text) -> None:
        self._send(Query(Command.QUEUE_PUSH, (_key(key),), (_bytes(value),)))

    def queue_pop(self, key: Text, block: bool = True) -> bytes:
        """The queue's first value; blocking: waits for one up to the timeout (StoreTimeout);
        not blocking: StoreTimeout at once when the queue is empty."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if block:
                self.wait([key], max(0.0, deadline - time.monotonic()))
            self._send(Query(Command.QUEUE_POP, (_key(key),)))
            if self._i64() > 0:
                return self._string()
            if not block or time.monotonic() >= deadline:  # another client popped it first
                raise StoreTimeout(f"queue {key!r} is empty")

    def wait(self, keys: Sequence[Text], timeout_s: float | None = None) -> None:
        """Until every key exists (or holds a queue); StoreTimeout after `timeout_s` (None:
        this client's timeout)."""
        self._send(Query(Command.WAIT, _keys(keys)))
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            reply = self._u8(limit)
        except StoreTimeout:
            # Cancel, then read what the server says: a wake that crossed the cancel first.
            self._send(Query(Command.CANCEL_WAIT))
            reply = self._u8()
            if reply == WaitReply.STOP_WAITING:
                self._expect(self._u8(), WaitReply.WAIT_CANCELED)
                return
            self._expect(reply, WaitReply.WAIT_CANCELED)
            raise StoreTimeout(f"keys {list(keys)[:4]!r} not set within {limit:.1f} s") from None
        self._expect(reply, WaitReply.STOP_WAITING)

    def waited(self, keys: Sequence[Text], timeout_s: float) -> bool:
        """Whether every key was set within `timeout_s` (`wait` without the exception)."""
        try:
            self.wait(keys, timeout_s)
        except StoreTimeout:
            return False
        return True

    # -- the wire -----------------------------------------------------------------------------

    def _send(self, query: Query) -> None:
        """A query whole, or StoreGone (a query cut by a timeout would put the stream out of
        step: the connection is then of no use)."""
        self._asked = query.command
        try:
            self._timeout(max(self.timeout_s, MIN_TIMEOUT_S))
            self._sock.sendall(encode_query(query))
        except OSError as error:  # TimeoutError included
            raise StoreGone(f"the store's connection broke: {error}") from None

    def _timeout(self, seconds: float) -> None:
        # Each settimeout is a system call: made only when the timeout changes.
        if seconds != self._sock_timeout_s:
            self._sock.settimeout(seconds)
            self._sock_timeout_s = seconds

    def _read(self, size: int, wait_s: float | None = None) -> bytes:
        """Exactly `size` bytes, each within this client's timeout, or StoreGone (a reply cut
        or late puts the stream out of step). With `wait_s` (a WAIT's reply) the first byte may
        take that long, and not coming is StoreTimeout: nothing was read, the stream is in step.
        Bytes come through a buffer: a reply's parts (its size, then its value) are one
        receive, not one each."""
        buffer = self._buffer
        if len(buffer) < size:
            limit = max(self.timeout_s, MIN_TIMEOUT_S)
            self._timeout(limit if wait_s is None or buffer else max(wait_s, MIN_TIMEOUT_S))
            try:
                while len(buffer) < size:
                    want = max(min(size - len(buffer), MAX_READ_BYTES), READ_BYTES)
                    chunk = self._sock.recv(want)
                    if not chunk:
                        raise StoreGone("the store closed the connection")
                    buffer += chunk
                    self._timeout(limit)
            except TimeoutError:
                if buffer or wait_s is None:
                    raise StoreGone(
                        f"the store did not answer {self._asked.name} within {limit:g} s"
                    ) from None
                raise StoreTimeout("no reply within the timeout") from None
            except OSError as error:
                raise StoreGone(f"the store's connection broke: {error}") from None
        data = bytes(buffer[:size])
        del buffer[:size]
        return data

    def _u8(self, wait_s: float | None = None) -> int:
        return self._read(1, wait_s)[0]

    def _i64(self) -> int:
        value: int = _I64.unpack(self._read(8))[0]
        return value

    def _string(self) -> bytes:
        size: int = _U64.unpack(self._read(8))[0]
        if size > MAX_VALUE_BYTES:
            raise StoreGone(f"a reply of {size} bytes (at most {MAX_VALUE_BYTES})")
        return self._read(size)

    @staticmethod
    def _expect(reply: int, wanted: WaitReply) -> None:
        if reply != wanted:
            raise StoreGone(f"the store answered {reply} to a wait, not {wanted.name}")
