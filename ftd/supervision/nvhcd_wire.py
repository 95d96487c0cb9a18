"""nvhcd's wire: one gRPC unary call over HTTP/2 cleartext (h2c, prior knowledge), no library.

What ftd sends is fixed (`request`): the connection preface, SETTINGS, one HEADERS frame of
HPACK literals (never indexed, never Huffman-coded) and one DATA frame that ends the stream,
carrying the length-prefixed protobuf `HealthCheckRequest { repeated string args = 1; }`.

What the service sends is hostile until `AnswerReader` has decoded it, sans I/O (it is fed bytes
and says what to send back): frames of at most 16 KiB (SETTINGS_MAX_FRAME_SIZE's default),
at most MAX_READ bytes and MAX_FRAMES frames in all, the gRPC message at most MAX_MESSAGE bytes,
its protobuf fields decoded in one pass (varints of at most 10 bytes, unknown fields skipped by
their wire type, every length checked). The server's header blocks are not decoded (HPACK,
maybe Huffman-coded): the answer is the DATA; a stream that ends without one has no answer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
METHOD_PATH = "/nvhcd.HealthCheckService/RunHealthCheck"
MAX_FRAME = 16 * 1024
MAX_READ = 256 * 1024
"""Bytes read from the service in one call, whatever they are."""
MAX_FRAMES = 1024
MAX_MESSAGE = 64 * 1024
MAX_VARINT_BYTES = 10
DEFAULT_WINDOW = 65_535

DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0,
    1,
    3,
    4,
    6,
    7,
    8,
    9,
)
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE = 2, 4
STREAM = 1
"""The call's stream: the first a client opens."""


@dataclass(frozen=True)
class HealthCheckResponse:
    """nvhcd's `HealthCheckResponse`, decoded: what its health check script said."""

    success: bool
    exit_code: int
    output: str
    error: str


@dataclass(frozen=True)
class Unhealthy:
    """Why the call finds the node unhealthy, and the decoder's cause where it refused what the
    service sent (counted); None where the service said so, or the protocol ended the call
    (GOAWAY, RST_STREAM, a stream without a message)."""

    reason: str
    cause: str | None = None


class Refused(Exception):
    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause
        self.reason = reason


def request(args: tuple[str, ...], timeout_s: float) -> bytes:
    """Everything ftd sends for one call of RunHealthCheck(args), in order."""
    settings = struct.pack(">HIHI", SETTINGS_ENABLE_PUSH, 0, SETTINGS_INITIAL_WINDOW_SIZE, MAX_READ)
    fields = (
        (":method", "POST"),
        (":scheme", "http"),
        (":path", METHOD_PATH),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", f"{max(1, min(int(timeout_s * 1000), 99_999_999))}m"),
    )
    block = b"".join(b"\x00" + _literal(name) + _literal(value) for name, value in fields)
    body = b"".join(b"\x0a" + _varint(len(arg.encode())) + arg.encode() for arg in args)
    message = b"\x00" + struct.pack(">I", len(body)) + body
    return b"".join(
        (
            PREFACE,
            frame(SETTINGS, 0, 0, settings),
            # the connection's window grows as the stream's did (SETTINGS_INITIAL_WINDOW_SIZE)
            frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_READ - DEFAULT_WINDOW)),
            frame(HEADERS, END_HEADERS, STREAM, block),
            frame(DATA, END_STREAM, STREAM, message),
        )
    )


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    head = struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream)
    return head + payload


def _literal(text: str) -> bytes:
    """An HPACK string literal, not Huffman-coded (RFC 7541 5.2): a 7-bit prefix length."""
    data = text.encode()
    if len(data) < 127:
        return bytes((len(data),)) + data
    prefix, size = b"\x7f", len(data) - 127
    while size >= 128:
        prefix += bytes((size % 128 + 128,))
        size //= 128
    return prefix + bytes((size,)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class AnswerReader:
    """What the service sends, fed as it arrives: `outcome` once the call is over."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._read = 0
        self._frames = 0
        self._message = bytearray()
        self.outcome: HealthCheckResponse | Unhealthy | None = None

    def feed(self, data: bytes) -> bytes:
        """Take `data`; the frames to send back (SETTINGS and PING acknowledgements)."""
        if self.outcome is not None:
            return b""
        try:
            return self._feed(data)
        except Refused as refused:
            self.outcome = Unhealthy(refused.reason, refused.cause)
            return b""

    def ended(self) -> HealthCheckResponse | Unhealthy:
        """The outcome once the service closed the connection (where it had not answered,
        that it did not)."""
        if self.outcome is None:
            self.outcome = Unhealthy("nvhcd closed the connection before it answered")
        return self.outcome

    def _feed(self, data: bytes) -> bytes:
        self._read += len(data)
        if self._read > MAX_READ:
            raise Refused("too_much", f"nvhcd sent over {MAX_READ // 1024} KiB")
        self._pending += data
        replies = bytearray()
        start = 0
        while self.outcome is None and len(self._pending) - start >= 9:
            length = int.from_bytes(self._pending[start : start + 3], "big")
            if length > MAX_FRAME:
                raise Refused("oversized_frame", f"nvhcd sent a frame of {length} bytes")
            if len(self._pending) - start < 9 + length:
                break
            kind, flags = self._pending[start + 3], self._pending[start + 4]
            stream = int.from_bytes(self._pending[start + 5 : start + 9], "big") & 0x7FFF_FFFF
            payload = bytes(self._pending[start + 9 : start + 9 + length])
            start += 9 + length
            self._frames += 1
            if self._frames > MAX_FRAMES:
                raise Refused("too_many_frames", f"nvhcd sent over {MAX_FRAMES} frames")
            replies += self._frame(kind, flags, stream, payload)
        del self._pending[:start]
        return bytes(replies)

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        if kind == SETTINGS and stream == 0:
            if flags & ACK:
                return b""
            if len(payload) % 6:
                raise Refused("malformed_frame", "nvhcd sent a SETTINGS frame of a bad size")
            return frame(SETTINGS, ACK, 0, b"")
        if kind == PING and stream == 0:
            if len(payload) != 8:
                raise Refused("malformed_frame", "nvhcd sent a PING frame of a bad size")
            return b"" if flags & ACK else frame(PING, ACK, 0, payload)
        if kind == GOAWAY and len(payload) >= 8:
            last_stream = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
            code = int.from_bytes(payload[4:8], "big")
            if code or last_stream < STREAM:
                self.outcome = Unhealthy(f"nvhcd went away (GOAWAY, error code {code})")
            return b""  # a graceful GOAWAY that covers the call: its answer still comes
        if stream != STREAM:
            return b""  # WINDOW_UPDATE, PRIORITY, unknown kinds, other streams: nothing to do
        if kind == RST_STREAM:
            code = int.from_bytes(payload[:4], "big") if len(payload) == 4 else -1
            self.outcome = Unhealthy(f"nvhcd reset the call (RST_STREAM, error code {code})")
        elif kind == DATA:
            self._data(flags, payload)
        if kind in (DATA, HEADERS) and flags & END_STREAM and self.outcome is None:
            self.outcome = decode_message(bytes(self._message))
        return b""

    def _data(self, flags: int, payload: bytes) -> None:
        if flags & PADDED:
            padding = payload[0] if payload else 256
            if padding >= len(payload):
                raise Refused("malformed_frame", "nvhcd sent a DATA frame padded beyond itself")
            payload = payload[1 : len(payload) - padding]
        if len(self._message) + len(payload) > 5 + MAX_MESSAGE:
            raise Refused("oversized_message", f"nvhcd's answer is over {MAX_MESSAGE // 1024} KiB")
        self._message += payload


def decode_message(data: bytes) -> HealthCheckResponse | Unhealthy:
    """The one length-prefixed gRPC message of a finished stream, decoded."""
    if not data:
        return Unhealthy("no answer (grpc status unknown)")
    if len(data) < 5:
        return Unhealthy("nvhcd's answer is cut short", "malformed_message")
    if data[0] != 0:
        return Unhealthy("nvhcd's answer is compressed (none was offered)", "malformed_message")
    if int.from_bytes(data[1:5], "big") != len(data) - 5:
        return Unhealthy("nvhcd's answer is not one whole message", "malformed_message")
    try:
        return decode_response(data[5:])
    except Refused as refused:
        return Unhealthy(refused.reason, refused.cause)


def decode_response(data: bytes) -> HealthCheckResponse:
    """protobuf `HealthCheckResponse` (Refused where it is none), in one pass: the last value
    of a field counts, as protobuf's own decoders have it."""
    values: dict[int, int | bytes] = {}
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, wire = key >> 3, key & 7
        if number == 0 or number > 0x1FFF_FFFF:
            raise Refused("malformed_protobuf", "nvhcd's answer has a field numbered out of range")
        value: int | bytes
        if wire == 0:
            value, at = _read_varint(data, at)
        elif wire == 2:
            size, at = _read_varint(data, at)
            if size > len(data) - at:
                raise Refused("malformed_protobuf", "nvhcd's answer has a field cut short")
            value, at = data[at : at + size], at + size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
            if at > len(data):
                raise Refused("malformed_protobuf", "nvhcd's answer has a field cut short")
            continue
        else:
            raise Refused("malformed_protobuf", f"nvhcd's answer has a field of wire type {wire}")
        if number <= 4:
            values[number] = value
    success, code, output, error = (values.get(number) for number in (1, 2, 3, 4))
    if isinstance(success, bytes) or isinstance(code, bytes):
        raise Refused("malformed_protobuf", "nvhcd's answer has success or exit_code as bytes")
    if isinstance(output, int) or isinstance(error, int):
        raise Refused("malformed_protobuf", "nvhcd's answer has output or error as a number")
    exit_code = (code or 0) & 0xFFFF_FFFF  # int32: a negative one is sign-extended to 64 bits
    return HealthCheckResponse(
        success=bool(success),
        exit_code=exit_code - (1 << 32) if exit_code >= 1 << 31 else exit_code,
        output=(output or b"").decode(errors="replace"),
        error=(error or b"").decode(errors="replace"),
    )


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 7 * MAX_VARINT_BYTES, 7):
        if at >= len(data):
            raise Refused("malformed_protobuf", "nvhcd's answer ends inside a number")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFF_FFFF_FFFF_FFFF, at
    raise Refused("malformed_protobuf", "nvhcd's answer has a number over 10 bytes")
