"""Fuzz targets for the rank protocol's decoder and what a decoded message does to the
monitor: any bytes are a message or a ProtocolError, fast; any message that decodes is applied
or refused (ProtocolError, a budget's refusal), never anything else."""

from __future__ import annotations

import contextlib
import json
import time

from ftd_client import protocol
from ftd_client.protocol import ProtocolError
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.ft_config import RankTimeouts
from ftd.monitor import Monitor
from ftd.rank_health import Link
from ftd.rank_messages import deliver
from tests.test_deadlines import FakeClock

BUDGET_S = 0.05

names = st.text(min_size=0, max_size=140)
values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), names,
    st.lists(names, max_size=80), st.lists(st.integers(), max_size=5),
)  # fmt: skip
messages = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, "1", None]), "t": st.sampled_from(sorted(protocol.TYPES))},
    optional={
        key: values for key in ("n", "s", "o", "dropped", "m", "id", "a", "d", "stack_signal")
    },
)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_decode_or_are_refused_quickly(data: bytes) -> None:
    started = time.perf_counter()
    with contextlib.suppress(ProtocolError):
        protocol.decode(data)
    assert time.perf_counter() - started < BUDGET_S


def test_deep_and_oversized_packets_are_refused_before_parsing() -> None:
    for data in (b"[" * 100_000, b'{"v":1,"t":"hb","o":' + b"[" * 300 + b"]" * 300 + b"}"):
        started = time.perf_counter()
        with contextlib.suppress(ProtocolError):
            protocol.decode(data)
        assert time.perf_counter() - started < BUDGET_S
    huge = json.dumps({"v": 1, "t": "st", "o": ["x"] * 100_000}).encode()
    try:
        protocol.decode(huge)
    except ProtocolError as error:
        assert error.cause == "oversized"


@settings(max_examples=100, deadline=None)
@given(st.lists(messages, max_size=20))
def test_decoded_messages_are_applied_or_refused(batch: list[dict[str, object]]) -> None:
    clock = FakeClock()
    timeouts = RankTimeouts(rank_heartbeat_timeout=5, rank_section_timeouts={"step": 1})
    monitor = Monitor(timeouts, lambda verdict: None, clock, lambda: set())
    monitor.attach([(0, 0, 7)])
    rank = monitor.rank_of(7)
    assert rank is not None
    link = Link(1, 7)
    for raw in batch:
        try:
            message = protocol.decode(json.dumps(raw).encode())
        except ProtocolError:
            continue
        clock.advance_to(clock.now() + 0.01)
        # ProtocolError: the end of a section that is not open, from a client without state.
        with contextlib.suppress(ProtocolError):
            deliver(monitor, rank, link, message, clock.now(), reading_since=0.0)
        assert len(rank.open_sections) <= protocol.MAX_OPEN_SECTIONS
    clock.advance_to(clock.now() + 100)
