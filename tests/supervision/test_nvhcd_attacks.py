"""nvhcd's socket is a door: whatever listens there is hostile until ftd's decoder has read it
(ftd/supervision/nvhcd_wire.py). A raw unix-socket server (plain asyncio, no gRPC) sends what
no real service would; each is refused (counted) or judged, within the call's timeout and
bounded memory, never an exception; the fuzz target feeds the decoder anything."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.supervision.nvhcd import Nvhcd, verdict
from ftd.supervision.nvhcd_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_FRAME,
    PING,
    RST_STREAM,
    SETTINGS,
    AnswerReader,
    HealthCheckResponse,
    Unhealthy,
    frame,
)
from tests.conftest import ServeFactory
from tests.supervision.test_nvhcd import response
from tests.support.fuzzing import budget, fuzz_target

Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT_S = 3.0


def answer(message: bytes) -> bytes:
    """A whole h2 answer around one gRPC message: SETTINGS, headers (never decoded: any
    bytes), the message in DATA frames of at most 16 KiB, trailers ending the stream."""
    grpc = b"\x00" + len(message).to_bytes(4, "big") + message
    data = [grpc[at : at + MAX_FRAME] for at in range(0, len(grpc), MAX_FRAME)]
    return b"".join(
        (
            frame(SETTINGS, 0, 0, b""),
            frame(HEADERS, END_HEADERS, 1, b"\x88"),
            *(frame(DATA, 0, 1, chunk) for chunk in data),
            frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x40\x0bgrpc-status\x010"),
        )
    )


async def repeat(writer: asyncio.StreamWriter, head: bytes, chunk: bytes, total: int) -> None:
    """`head`, then `chunk` again and again up to `total` bytes or until the client leaves."""
    writer.write(head)
    sent = 0
    while sent < total and not writer.is_closing():
        writer.write(chunk)
        sent += len(chunk)
        await writer.drain()


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Say nothing, keep the socket until the client leaves."""
    while await reader.read(4096):
        pass


async def huge_frame(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"\xff\xff\xff" + bytes((DATA, 0)) + (1).to_bytes(4, "big"))
    await hold(reader, writer)


async def continuation_flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = frame(SETTINGS, 0, 0, b"") + frame(HEADERS, 0, 1, b"\x88")
    await repeat(writer, head, frame(CONTINUATION, 0, 1, b"\x00" * 7), 1 << 30)


async def ping_flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await repeat(writer, b"", frame(PING, 0, 0, b"12345678"), 1 << 30)


async def data_flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = frame(HEADERS, END_HEADERS, 1, b"\x88")
    await repeat(writer, head, frame(DATA, 0, 1, b"\x00" * MAX_FRAME), 10 * 1024 * 1024)


async def deep_json(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(answer(response(True, output="[" * 30_000 + "]" * 30_000)))
    await hold(reader, writer)


async def healthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(answer(response(True, output={"fail_count": 0})))
    await hold(reader, writer)


class Hostile:
    """A unix-socket server answering each connection with `reply` (the test may change it)."""

    def __init__(self, path: str, reply: Reply) -> None:
        self.path, self.reply = path, reply
        self.tasks: set[asyncio.Task[None]] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.add(task := asyncio.current_task())  # type: ignore[arg-type]
        try:
            await self.reply(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)  # type: ignore[arg-type]


@pytest.fixture
async def hostile() -> AsyncIterator[Hostile]:
    with tempfile.TemporaryDirectory(prefix="nvhcd-") as directory:
        listener = Hostile(str(Path(directory) / "nvhcd.sock"), hold)
        server = await asyncio.start_unix_server(listener._serve, listener.path)
        yield listener
        server.close()
        for task in list(listener.tasks):
            task.cancel()
        await asyncio.gather(*listener.tasks, return_exceptions=True)
        await server.wait_closed()


@pytest.mark.parametrize(
    ("reply", "cause", "said"),
    [
        (huge_frame, "oversized_frame", "nvhcd sent a frame of 16777215 bytes"),
        (continuation_flood, "too_many_frames", "nvhcd sent over 1024 frames"),
        (ping_flood, "too_many_frames", "nvhcd sent over 1024 frames"),
        (data_flood, "oversized_message", "nvhcd's answer is over 64 KiB"),
        (deep_json, "output_too_deep", "its output is not JSON (unbalanced or nested deeper"),
        (hold, None, f"no answer within {TIMEOUT_S:g}s"),
    ],
)
async def test_a_hostile_service_is_refused_or_judged_in_time_and_bounded_memory(
    hostile: Hostile, reply: Reply, cause: str | None, said: str
) -> None:
    hostile.reply = reply
    nvhcd = Nvhcd(hostile.path, TIMEOUT_S)
    started = time.monotonic()
    tracemalloc.start()
    try:
        reason = await nvhcd.check()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if cause == "output_too_deep":  # an answer, whose output is not JSON: unhealthy, as NVRx
        assert reason is not None and reason.startswith(f"nvhcd at {hostile.path}: {said}")
    else:  # no answer ftd reads: the check is skipped, as NVRx skips it
        assert reason is None and (nvhcd.skipped or "").startswith(f"gave no answer ({said}")
    assert time.monotonic() - started < TIMEOUT_S + 5
    assert peak < 4 * 1024 * 1024, peak
    assert dict(nvhcd.refused) == ({cause: 1} if cause else {})


async def test_a_live_daemon_sits_out_a_deep_answer_and_skips_a_flooding_service(
    serve: ServeFactory, hostile: Hostile
) -> None:
    """`ftd serve` asking a service whose output nests 30,000 deep: a reason (the node sits
    out), the daemon unharmed; then one that sends 10 MB of DATA: refused, the check skipped
    with a warning, and the job runs to its end."""
    hostile.reply = deep_json
    run = await serve(
        *("--ft-node_health_check_endpoint", f"unix://{hostile.path}"),
        *("--ft-node-health-check-interval", "0.2", "--ft-node-health-check-failures", "0"),
        *("--ft-node-health-check-timeout", "10"),
    )
    await run.stderr.expect("sitting out of the rendezvous: nvhcd at .*: its output is not JSON")
    hostile.reply = data_flood
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert "gave no answer (nvhcd's answer is over 64 KiB): its check is skipped" in (
        run.stderr.text
    )
    reasons = {event["reason"][:50] for event in run.event_data("node_unhealthy")}
    assert reasons == {f"nvhcd at {hostile.path}: its output is not JSON"[:50]}, reasons


# -- the decoder, fuzzed ----------------------------------------------------------------------

_frames = st.lists(
    st.tuples(
        st.sampled_from([DATA, HEADERS, 2, 3, SETTINGS, 5, PING, 7, 8, CONTINUATION, 200]),
        st.integers(0, 255),
        st.sampled_from([0, 1, 3, 0x7FFF_FFFF]),
        st.binary(max_size=64),
    ),
    max_size=30,
).map(lambda frames: b"".join(frame(*each) for each in frames))
_real = st.builds(
    lambda success, code, output, error: answer(response(success, code, output, error)),
    st.booleans(),
    st.integers(-(2**31), 2**31 - 1),
    st.one_of(
        st.text(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner)
            ),
            max_leaves=20,
        ).map(lambda tree: json.dumps({"fail_count": 1, "failed_checks": tree})),
    ),
    st.text(max_size=100),
)
_mutated = st.tuples(_real, st.integers(0, 2000), st.binary(min_size=1, max_size=8)).map(
    lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]) :]
)


@fuzz_target("nvhcd_response", 300)
@given(st.one_of(st.binary(max_size=3000), _frames, _real, _mutated), st.integers(1, 4096))
def test_fuzz_any_bytes_are_an_answer_a_refusal_or_more_to_read(data: bytes, chunk: int) -> None:
    reader = AnswerReader()
    with budget():
        for at in range(0, len(data), chunk):
            replies = reader.feed(data[at : at + chunk])
            assert len(replies) <= 17 * (chunk // 9 + 1)
        outcome = reader.ended()
        unhealthy = verdict(outcome) if isinstance(outcome, HealthCheckResponse) else outcome
    assert isinstance(outcome, HealthCheckResponse | Unhealthy)
    if unhealthy is not None:
        said = unhealthy.reason
        assert len(said) <= 300 and "\n" not in said and "\x1b" not in said, said


def test_the_reader_acknowledges_settings_and_pings_and_honours_goaway_and_reset() -> None:
    reader = AnswerReader()
    replies = reader.feed(
        frame(SETTINGS, 0, 0, b"\x00\x04\x00\x01\x00\x00") + frame(PING, 0, 0, b"8 bytes!")
    )
    assert replies == frame(SETTINGS, 1, 0, b"") + frame(PING, 1, 0, b"8 bytes!")
    assert reader.outcome is None
    graceful = frame(GOAWAY, 0, 0, (1).to_bytes(4, "big") + bytes(4))
    padded = frame(DATA, END_STREAM | 0x8, 1, b"\x03" + answer_message() + b"pad")
    assert reader.feed(graceful + padded) == b""
    assert reader.ended() == HealthCheckResponse(True, -1, '{"fail_count": 0}', "")
    went = AnswerReader()
    went.feed(frame(GOAWAY, 0, 0, bytes(4) + (2).to_bytes(4, "big")))
    assert went.ended() == Unhealthy("nvhcd went away (GOAWAY, error code 2)")
    reset = AnswerReader()
    reset.feed(frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
    assert reset.ended() == Unhealthy("nvhcd reset the call (RST_STREAM, error code 8)")
    closed = AnswerReader()
    closed.feed(frame(HEADERS, END_HEADERS, 1, b"\x88")[:12])
    assert closed.ended() == Unhealthy("nvhcd closed the connection before it answered")


def answer_message() -> bytes:
    """A gRPC message whose protobuf has a field ftd does not know (skipped) and a negative
    exit code (int32, sign-extended to ten bytes)."""
    body = b"\x08\x01" + b"\x10" + b"\xff" * 9 + b"\x01" + b"\x2a\x02hi" + b"\x35abcd"
    body += b"\x1a\x11" + b'{"fail_count": 0}'
    return b"\x00" + len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (b"\x08" + b"\xff" * 10 + b"\x01", "a number over 10 bytes"),
        (b"\x1a\x7f" + b"x", "a field cut short"),
        (b"\x0b", "a field of wire type 3"),
        (b"\x1a\x01", "a field cut short"),
        (b"\x00\x01", "a field numbered out of range"),
        (b"\x0a\x01x", "success or exit_code as bytes"),
    ],
)
def test_malformed_protobuf_is_refused_by_name(body: bytes, said: str) -> None:
    reader = AnswerReader()
    message = b"\x00" + len(body).to_bytes(4, "big") + body
    reader.feed(frame(DATA, END_STREAM, 1, message))
    outcome = reader.ended()
    assert isinstance(outcome, Unhealthy) and outcome.cause == "malformed_protobuf", outcome
    assert outcome.reason.endswith(said), outcome
