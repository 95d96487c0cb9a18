"""The keys, queues and waiters of one TCPStore, and what each query does to them.

The semantics are those of torch's own (libuv) server, which the C++ client expects: a GET of a
missing key answers an empty value (clients wait first), COMPARE_SET answers the value now held,
ADD keeps decimal text, a WAIT is answered when its last missing key appears, a QUEUE_PUSH wakes
one waiter. What ftd adds is a budget: the keys and values held together stay under
`max_bytes`; a write past it is refused (the writer's connection closes) and nothing held is
lost.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Hashable
from typing import Final

from ftd.tcpstore.wire import (
    CheckReply,
    Command,
    Query,
    WaitReply,
    encode_i64,
    encode_string,
    encode_u8,
    encode_u32,
)

DEFAULT_MAX_BYTES: Final = 256 * 1024 * 1024
KEY_OVERHEAD_BYTES: Final = 64
"""Counted for each key held besides its bytes, so many empty keys cannot grow without bound."""
I64_MIN: Final = -(2**63)
I64_MAX: Final = 2**63 - 1
_LEADING_INTEGER: Final = re.compile(rb"[ \t\n\v\f\r]*([+-]?)0*([0-9]+)")
"""What C++'s std::stoll reads of a value (leading space, a sign, digits; the rest ignored)."""

Client = Hashable
Reply = Callable[[Client, bytes], None]


class StoreRefused(Exception):
    """A query the store will not carry out; its text is the refusal's cause."""


class StoreState:
    def __init__(self, send: Reply, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._send = send
        self._max_bytes = max_bytes
        self._values: dict[bytes, bytes | bytearray] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiting: dict[bytes, dict[Client, int]] = {}
        """For each key, who waits for it (and how many times it named the key)."""
        self._awaited: dict[Client, tuple[int, tuple[bytes, ...]]] = {}
        """For each waiting client, how many of its keys are still missing, and which it named."""
        self.bytes_held = 0

    def apply(self, client: Client, query: Query) -> bytes | None:
        """Carry out `query` for `client`: the reply to send it, if any. Waiters woken by the
        query are sent their replies through `send`. StoreRefused when over budget."""
        keys, values = query.keys, query.values
        match query.command:
            case Command.PING:
                return encode_u32(query.number)
            case Command.SET:
                self._set(keys[0], values[0])
            case Command.MULTI_SET:
                pairs = list(zip(keys, values, strict=True))
                self._room_for(sum(self._growth(key, value) for key, value in pairs))
                for key, value in pairs:
                    self._set(key, value)
            case Command.COMPARE_SET:
                return encode_string(self._compare_set(keys[0], values[0], values[1]))
            case Command.GET:
                return encode_string(self._values.get(keys[0], b""))
            case Command.MULTI_GET:
                return b"".join(encode_string(self._values.get(key, b"")) for key in keys)
            case Command.ADD:
                return encode_i64(self._add(keys[0], query.number))
            case Command.APPEND:
                self._append(keys[0], values[0])
            case Command.CHECK:
                ready = CheckReply.READY if self._present(keys) else CheckReply.NOT_READY
                return encode_u8(ready)
            case Command.WAIT:
                return self._wait(client, keys)
            case Command.CANCEL_WAIT:
                self.forget(client)
                return encode_u8(WaitReply.WAIT_CANCELED)
            case Command.GETNUMKEYS:
                return encode_i64(len(self._values))
            case Command.DELETE_KEY:
                return encode_i64(self._delete(keys[0]))
            case Command.QUEUE_PUSH:
                self._push(keys[0], values[0])
            case Command.QUEUE_POP:
                return self._pop(keys[0])
            case Command.QUEUE_LEN:
                return encode_i64(len(self._queues.get(keys[0], ())))
            case Command.VALIDATE:  # pragma: no cover - the decoder answers it
                pass
        return None

    def forget(self, client: Client) -> None:
        """Drop whatever `client` waits for (it cancelled, or it is gone)."""
        _, keys = self._awaited.pop(client, (0, ()))
        for key in keys:
            clients = self._waiting.get(key)
            if clients is not None and clients.pop(client, None) is not None and not clients:
                del self._waiting[key]

    def _growth(self, key: bytes, value: bytes) -> int:
        held = self._values.get(key)
        if held is None:
            return KEY_OVERHEAD_BYTES + len(key) + len(value)
        return len(value) - len(held)

    def _room_for(self, growth: int) -> None:
        if growth > 0 and self.bytes_held + growth > self._max_bytes:
            raise StoreRefused("store_full")

    def _set(self, key: bytes, value: bytes) -> None:
        growth = self._growth(key, value)
        self._room_for(growth)
        self.bytes_held += growth
        self._values[key] = value
        self._wake_all(key)

    def _append(self, key: bytes, value: bytes) -> None:
        held = self._values.get(key)
        if held is None:
            self._set(key, value)
            return
        self._room_for(len(value))
        self.bytes_held += len(value)
        if isinstance(held, bytes):  # appends grow one buffer in place: linear in what came
            held = self._values[key] = bytearray(held)
        held += value
        self._wake_all(key)

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes | bytearray:
        held = self._values.get(key)
        if held is None and expected:
            self._wake_all(key)
            return expected  # torch's server answers the expectation for a missing key
        if held is None or held == expected:
            self._set(key, desired)
            return desired
        self._wake_all(key)
        return held

    def _add(self, key: bytes, amount: int) -> int:
        held = self._values.get(key)
        if held is not None:
            match = _LEADING_INTEGER.match(held)
            if match is None:
                raise StoreRefused("add_to_non_number")
            sign, digits = match.groups()
            if len(digits) > len(str(I64_MAX)):  # stoll's out_of_range, without a huge int()
                raise StoreRefused("add_overflow")
            held_number = int(digits)
            if not I64_MIN <= (-held_number if sign == b"-" else held_number) <= I64_MAX:
                raise StoreRefused("add_overflow")
            amount += -held_number if sign == b"-" else held_number
        if not I64_MIN <= amount <= I64_MAX:
            raise StoreRefused("add_overflow")
        self._set(key, str(amount).encode())
        return amount

    def _delete(self, key: bytes) -> int:
        held = self._values.pop(key, None)
        if held is None:
            return 0
        self.bytes_held -= KEY_OVERHEAD_BYTES + len(key) + len(held)
        return 1

    def _present(self, keys: tuple[bytes, ...]) -> bool:
        return all(key in self._values or self._queues.get(key) for key in keys)

    def _wait(self, client: Client, keys: tuple[bytes, ...]) -> bytes | None:
        self.forget(client)  # a client waits for one thing at a time
        if self._present(keys):
            return encode_u8(WaitReply.STOP_WAITING)
        missing = [key for key in keys if key not in self._values]
        for key in missing:
            clients = self._waiting.setdefault(key, {})
            clients[client] = clients.get(client, 0) + 1
        self._awaited[client] = (len(missing), tuple(dict.fromkeys(missing)))
        return None

    def _wake_all(self, key: bytes) -> None:
        for client, times in self._waiting.pop(key, {}).items():
            self._count_down(client, times)

    def _count_down(self, client: Client, times: int) -> bool:
        """Count `times` of `client`'s missing keys as come; True when it was woken."""
        left, keys = self._awaited.get(client, (0, ()))
        if left > times:
            self._awaited[client] = (left - times, keys)
            return False
        if left:
            self.forget(client)
            self._send(client, encode_u8(WaitReply.STOP_WAITING))
        return bool(left)

    def _push(self, key: bytes, value: bytes) -> None:
        queue = self._queues.get(key)
        growth = len(value) + (KEY_OVERHEAD_BYTES + len(key) if queue is None else 0)
        self._room_for(growth)
        self.bytes_held += growth
        if queue is None:
            queue = self._queues[key] = deque()
        queue.append(value)
        for client in list(self._waiting.get(key, {})):
            clients = self._waiting.get(key)
            if clients is None or client not in clients:
                continue
            times = clients.pop(client)
            if not clients:
                del self._waiting[key]
            if self._count_down(client, times):
                break

    def _pop(self, key: bytes) -> bytes:
        queue = self._queues.get(key)
        if not queue:
            return encode_i64(0)
        reply = encode_i64(len(queue))
        value = queue.popleft()
        self.bytes_held -= len(value)
        if not queue:
            del self._queues[key]
            self.bytes_held -= KEY_OVERHEAD_BYTES + len(key)
        return reply + encode_string(value)
