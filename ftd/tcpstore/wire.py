"""c10d's TCPStore protocol, as torch 2.13's C++ client speaks it: one bounded decoder.

A client's stream is a run of queries: a command byte, then the command's fields, each a
little-endian integer or a string (a u64 length, then that many bytes). The first query must be
VALIDATE with c10d's magic number. Keys are at most 8 KiB and values 8 MiB (torch's own
server's limits); a query's fields together at most 16 MiB and 128 Ki keys, so a WAIT cannot
make the daemon hold a gigabyte of key names.

The decoder is sans-IO and resumable: `feed` appends bytes, `next` returns the next whole query
or None. Each field is cut from the buffer once, where it ends, so a query that arrives a byte
at a time costs the same as one that arrives whole (linear time). A query outside the protocol
ends the stream: `refusal` then names why, and the connection is closed.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import Final

VALIDATION_MAGIC: Final = 0x3C85F7CE
MAX_KEY_BYTES: Final = 8 * 1024
MAX_VALUE_BYTES: Final = 8 * 1024 * 1024
MAX_KEYS: Final = 128 * 1024
MAX_QUERY_BYTES: Final = 16 * 1024 * 1024
COMPACT_AFTER_BYTES: Final = 64 * 1024

_U32: Final = struct.Struct("<I")
_I64: Final = struct.Struct("<q")
_U64: Final = struct.Struct("<Q")


class Command(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16


class CheckReply(enum.IntEnum):
    READY = 0
    NOT_READY = 1


class WaitReply(enum.IntEnum):
    STOP_WAITING = 0
    WAIT_CANCELED = 1


@dataclass(frozen=True, slots=True)
class Query:
    command: Command
    keys: tuple[bytes, ...] = ()
    values: tuple[bytes, ...] = ()
    number: int = 0
    """ADD's amount, PING's nonce."""


class _Refused(Exception):
    pass


_Parser = Generator[int, bytes, None]
"""Yields how many bytes it needs next; is sent exactly that many."""


class QueryDecoder:
    def __init__(self) -> None:
        self._buffer = bytearray()
        self._offset = 0
        self._ready: deque[Query] = deque()
        self._parser = self._queries()
        self._need = next(self._parser)
        self.refusal: str | None = None
        self._query_bytes = 0

    def feed(self, data: bytes) -> None:
        if self.refusal is not None:
            return
        if self._offset >= COMPACT_AFTER_BYTES:
            del self._buffer[: self._offset]
            self._offset = 0
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet decoded."""
        return len(self._buffer) - self._offset

    def next(self) -> Query | None:
        """The next whole query, or None until more bytes come (or for good, with `refusal`)."""
        while not self._ready:
            if self.refusal is not None or self.buffered < self._need:
                return None
            field = bytes(self._buffer[self._offset : self._offset + self._need])
            self._offset += self._need
            try:
                self._need = self._parser.send(field)
            except _Refused as refusal:
                self.refusal = str(refusal)
                self._buffer, self._offset = bytearray(), 0
                return None
        return self._ready.popleft()

    def _queries(self) -> _Parser:
        validated = False
        while True:
            self._query_bytes = 0
            code = (yield 1)[0]
            try:
                command = Command(code)
            except ValueError:
                raise _Refused("unknown_command") from None
            if not validated:
                if command is not Command.VALIDATE:
                    raise _Refused("not_validated")
                if _U32.unpack((yield 4))[0] != VALIDATION_MAGIC:
                    raise _Refused("bad_magic")
                validated = True
                continue
            self._ready.append((yield from self._fields(command)))

    def _fields(self, command: Command) -> Generator[int, bytes, Query]:
        match command:
            case Command.VALIDATE:
                raise _Refused("validated_twice")
            case Command.PING:
                return Query(command, number=_U32.unpack((yield 4))[0])
            case Command.GETNUMKEYS | Command.CANCEL_WAIT:
                return Query(command)
            case Command.GET | Command.DELETE_KEY | Command.QUEUE_POP | Command.QUEUE_LEN:
                return Query(command, keys=((yield from self._key()),))
            case Command.SET | Command.APPEND | Command.QUEUE_PUSH:
                key = yield from self._key()
                return Query(command, keys=(key,), values=((yield from self._value()),))
            case Command.COMPARE_SET:
                key = yield from self._key()
                expected = yield from self._value()
                return Query(command, keys=(key,), values=(expected, (yield from self._value())))
            case Command.ADD:
                key = yield from self._key()
                return Query(command, keys=(key,), number=_I64.unpack((yield 8))[0])
            case Command.CHECK | Command.WAIT | Command.MULTI_GET:
                count = yield from self._count()
                keys = []
                for _ in range(count):
                    keys.append((yield from self._key()))
                return Query(command, keys=tuple(keys))
            case Command.MULTI_SET:
                count = yield from self._count()
                keys, values = [], []
                for _ in range(count):
                    keys.append((yield from self._key()))
                    values.append((yield from self._value()))
                return Query(command, keys=tuple(keys), values=tuple(values))
        raise _Refused("unknown_command")  # pragma: no cover - every command is matched

    def _count(self) -> Generator[int, bytes, int]:
        count: int = _U64.unpack((yield 8))[0]
        if count > MAX_KEYS:
            raise _Refused("too_many_keys")
        return count

    def _key(self) -> Generator[int, bytes, bytes]:
        return (yield from self._string(MAX_KEY_BYTES, "key_too_long"))

    def _value(self) -> Generator[int, bytes, bytes]:
        return (yield from self._string(MAX_VALUE_BYTES, "value_too_long"))

    def _string(self, limit: int, cause: str) -> Generator[int, bytes, bytes]:
        size: int = _U64.unpack((yield 8))[0]
        if size > limit:
            raise _Refused(cause)
        self._query_bytes += 8 + size
        if self._query_bytes > MAX_QUERY_BYTES:
            raise _Refused("query_too_large")
        return (yield size)


def encode_u8(value: int) -> bytes:
    return bytes((value,))


def encode_u32(value: int) -> bytes:
    return _U32.pack(value)


def encode_i64(value: int) -> bytes:
    return _I64.pack(value)


def encode_string(value: bytes | bytearray) -> bytes:
    return _U64.pack(len(value)) + value


def encode_query(query: Query) -> bytes:
    """A query as a client sends it (for tests and the fuzzers' round trips)."""
    head = encode_u8(query.command)
    match query.command:
        case Command.VALIDATE | Command.PING:
            return head + encode_u32(query.number)
        case Command.ADD:
            return head + encode_string(query.keys[0]) + encode_i64(query.number)
        case Command.CHECK | Command.WAIT | Command.MULTI_GET:
            return head + _U64.pack(len(query.keys)) + b"".join(map(encode_string, query.keys))
        case Command.MULTI_SET:
            pairs = zip(query.keys, query.values, strict=True)
            body = b"".join(encode_string(k) + encode_string(v) for k, v in pairs)
            return head + _U64.pack(len(query.keys)) + body
    return head + b"".join(map(encode_string, query.keys + query.values))
