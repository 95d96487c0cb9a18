"""Fuzz target of the replica frames' decoder (ftd/checkpoint/replica_frame.py): what a peer, or
anyone who reaches a node's replica port, sends. Any prefix and header give a verified header or
the decoder's own refusal (FrameError with one of its causes), within the per-input budget; a
prefix announcing more than the receiver takes is refused from the prefix alone; only a frame
signed with the job's key, for this node, passes; a handshake frame carries a nonce, every other
frame echoes one, and a frame read on a connection echoes that connection's nonce or is refused
(`replayed`). Plus the decoder's plain cases."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoint.replica_frame import (
    MAGIC,
    MAX_HEADER_BYTES,
    PREFIX,
    VERSION,
    FrameError,
    FrameHeader,
    decode_header,
    decode_prefix,
    encode,
)
from ftd.checkpoint.replica_wire import read_header
from ftd.coordination.records import RecordCodec
from tests.support.fuzzing import budget, fuzz_target

KEY = RecordCodec("job", b"the job's secret, 16+ bytes").replica_key()
assert KEY is not None
CAUSES = {"malformed", "oversized", "bad_signature", "invalid", "misdirected"}
MAX_BODY = 1 << 30
NONCE = "5" * 32
OTHER_NONCE = "6" * 32

_fields = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(
            ["hello", "challenge", "push", "ack", "pull", "snapshot", "end", "refused", "x"]
        )
    },
    optional={
        "source": st.text(max_size=10),
        "to": st.sampled_from(["a", "b", ""]),
        "rank": st.integers(-2, 2**21),
        "world": st.integers(-1, 2**21),
        "step": st.one_of(st.integers(-1, 2**54), st.floats(), st.text(max_size=3)),
        "body_bytes": st.integers(-1, 2**64),
        "body_sha256": st.text("0123456789abcdefg", max_size=65),
        "extra": st.none(),
        "nonce": st.sampled_from(["", NONCE, "0" * 31, "g" * 32, "A" * 32]),
        "echo": st.sampled_from(["", NONCE, OTHER_NONCE, "0" * 33]),
    },
)


def _signed(fields: dict[str, object], body_bytes: int, key: bytes) -> tuple[bytes, bytes]:
    head = json.dumps(fields).encode()[:MAX_HEADER_BYTES]
    signed = PREFIX.pack(MAGIC, VERSION, 0, len(head), body_bytes, b"")[:-32]
    return signed + hmac.new(key, signed + head, hashlib.sha256).digest(), head


frames = st.one_of(
    st.tuples(st.binary(min_size=PREFIX.size, max_size=PREFIX.size), st.binary(max_size=300)),
    st.builds(_signed, _fields, st.integers(0, 2**64 - 1), st.sampled_from([KEY, b"\0" * 32])),
)


@fuzz_target("replica_frame", 300)
@given(frames)
def test_any_frame_is_verified_or_refused(data: tuple[bytes, bytes]) -> None:
    raw_prefix, head = data
    with budget(0.05):
        try:
            prefix = decode_prefix(raw_prefix, MAX_BODY)
            header = decode_header(KEY, prefix, head[: prefix.header_bytes], "a")
        except FrameError as error:
            assert error.cause in CAUSES, error
            return
    assert prefix.body_bytes <= MAX_BODY and header.body_bytes == prefix.body_bytes
    assert header.to == "a"
    assert header.kind not in ("push", "snapshot") or header.rank < header.world
    assert bool(header.nonce) == (header.kind in ("hello", "challenge"))
    assert bool(header.echo) == (header.kind != "hello")


def _read_on_a_connection(data: bytes, echo: str | None) -> object:
    async def read() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        try:
            return await read_header(reader, KEY, "a", MAX_BODY, echo)
        except (FrameError, EOFError) as error:
            return error

    return asyncio.run(read())


@fuzz_target("replica_frame", 100)
@given(frames, st.sampled_from([None, NONCE]))
def test_a_frame_on_a_connection_answers_its_nonce_or_is_refused(
    data: tuple[bytes, bytes], echo: str | None
) -> None:
    """The handshake's reading (replica_wire.read_header): a frame that echoes another
    connection's nonce is refused as `replayed`, never taken."""
    raw_prefix, head = data
    with budget(0.2):
        got = _read_on_a_connection(raw_prefix + head, echo)
    if isinstance(got, FrameError):
        assert got.cause in {*CAUSES, "replayed", "truncated"}, got
    elif not isinstance(got, EOFError):
        assert isinstance(got, FrameHeader) and got.to == "a"
        assert echo is None or got.echo == echo


def test_a_frame_round_trips_and_every_alteration_is_refused() -> None:
    header = FrameHeader(
        kind="push", source="b", to="a", rank=1, world=2, step=7, body_bytes=9, echo=NONCE
    )
    data = encode(KEY, header)
    prefix = decode_prefix(data[: PREFIX.size], MAX_BODY)
    assert decode_header(KEY, prefix, data[PREFIX.size :], "a") == header
    for at in range(len(data)):  # one bit anywhere: the MAC or a bound refuses it
        bad = bytearray(data)
        bad[at] ^= 1
        with pytest.raises(FrameError):
            prefix = decode_prefix(bytes(bad[: PREFIX.size]), MAX_BODY)
            decode_header(KEY, prefix, bytes(bad[PREFIX.size :]), "a")
    with pytest.raises(FrameError, match="misdirected"):
        decode_header(KEY, prefix, data[PREFIX.size :], "c")
    with pytest.raises(FrameError, match="oversized"):
        decode_prefix(data[: PREFIX.size], 8)
    other = RecordCodec("another-job", b"the job's secret, 16+ bytes").replica_key()
    assert other is not None and other != KEY
    with pytest.raises(FrameError, match="bad_signature"):
        decode_header(other, decode_prefix(data[: PREFIX.size], MAX_BODY), data[56:], "a")
    replayed = encode(KEY, header.model_copy(update={"echo": OTHER_NONCE}))
    refused = _read_on_a_connection(replayed, NONCE)
    assert isinstance(refused, FrameError) and refused.cause == "replayed"
    assert _read_on_a_connection(data, NONCE) == header
    for unbound in (  # a handshake frame without its nonce, any other frame without an echo
        FrameHeader(kind="hello", source="b", to="a"),
        FrameHeader(kind="challenge", source="b", to="a", echo=NONCE),
        FrameHeader(kind="pull", source="b", to="a"),
        FrameHeader(kind="pull", source="b", to="a", nonce=NONCE, echo=NONCE),
    ):
        raw = encode(KEY, unbound)
        with pytest.raises(FrameError, match="invalid"):
            decode_header(KEY, decode_prefix(raw[: PREFIX.size], MAX_BODY), raw[56:], "a")
