"""Fuzz targets for the rank protocol's decoder and what a decoded message does to the
monitor: any bytes are a message or a ProtocolError, fast; any message that decodes is applied
or refused (ProtocolError, a budget's refusal), never anything else."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ftd_client import protocol, wire
from ftd_client.messages import ProgressReport
from ftd_client.protocol import ProtocolError
from hypothesis import given
from hypothesis import strategies as st

from ftd.config.ft import RankTimeouts
from ftd.health.links import Link
from ftd.health.messages import deliver
from ftd.health.monitor import Monitor
from tests.support.clock import FakeClock
from tests.support.fuzzing import budget, fuzz_target

BUDGET_S = 0.05

names = st.text(min_size=0, max_size=140)
values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), names,
    st.lists(names, max_size=80), st.lists(st.integers(), max_size=5),
    st.dictionaries(names, st.one_of(st.integers(-5, 2**54), names), max_size=70),
)  # fmt: skip
FIELDS = ("n", "s", "o", "dropped", "m", "id", "a", "d", "stack_signal")
PROGRESS_FIELDS = (*ProgressReport.REQUIRED, *ProgressReport.COUNTS, "auto")
messages = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 1, 1, 2, "1", None]), "t": st.sampled_from(sorted(wire.TYPES))},
    optional={key: values for key in (*FIELDS, *PROGRESS_FIELDS)},
)


@fuzz_target("rank_protocol", 150)
@given(st.binary(max_size=2048))
def test_any_bytes_decode_or_are_refused_quickly(data: bytes) -> None:
    with budget(BUDGET_S), contextlib.suppress(ProtocolError):
        wire.decode(data)


def test_deep_and_oversized_packets_are_refused_before_parsing() -> None:
    for data in (b"[" * 100_000, b'{"v":1,"t":"hb","o":' + b"[" * 300 + b"]" * 300 + b"}"):
        with budget(BUDGET_S), contextlib.suppress(ProtocolError):
            wire.decode(data)
    huge = json.dumps({"v": 1, "t": "st", "o": ["x"] * 100_000}).encode()
    try:
        wire.decode(huge)
    except ProtocolError as error:
        assert error.cause == "oversized"


@fuzz_target("rank_protocol", 100)
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
            envelope = wire.decode(json.dumps(raw).encode())
        except ProtocolError:
            continue
        clock.advance_to(clock.now() + 0.01)
        # ProtocolError: the end of a section that is not open, from a client without state.
        with contextlib.suppress(ProtocolError):
            deliver(monitor, rank, link, envelope, clock.now(), reading_since=0.0)
        assert len(rank.open_sections) <= protocol.MAX_OPEN_SECTIONS
    clock.advance_to(clock.now() + 100)


state_files = st.one_of(
    st.binary(max_size=512),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.floats(), st.integers(), st.text(max_size=20)),
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=30), inner),
        max_leaves=30,
    ).map(lambda value: json.dumps(value).encode()),
    st.builds(
        lambda sections, learned: json.dumps(
            {"timeouts": {"rank_section_timeouts": sections}, "learned": learned}
        ).encode(),
        st.dictionaries(st.text(max_size=8), st.floats(0.05, 100), max_size=300),
        st.lists(st.text(max_size=12).map(lambda name: f"section:{name}"), max_size=300),
    ),
)


@fuzz_target("state_file", 100)
@given(state_files)
def test_a_learned_timeouts_file_is_read_or_ignored(data: bytes) -> None:
    """The daemon's state file is outside input too (a disk filled mid-write, an edit): read,
    or one warning and the configured timeouts; never more sections than the table holds."""
    import tempfile
    from pathlib import Path

    from ftd.health.learning import load_learned

    configured = RankTimeouts(rank_section_timeouts={f"c{i}": 1.0 for i in range(200)})
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state.json"
        path.write_bytes(data)
        with budget():
            timeouts, learned = load_learned(path, configured)
    assert len(timeouts.rank_section_timeouts) <= protocol.MAX_SECTIONS
    assert isinstance(learned, frozenset)


def test_learned_sections_beyond_the_table_are_not_loaded(tmp_path: Path) -> None:
    from ftd.health.learning import load_learned

    saved = {f"x{i}": 2.0 for i in range(256)}
    path = tmp_path / "state.json"
    path.write_text(
        json.dumps(
            {
                "timeouts": {"rank_section_timeouts": saved},
                "learned": [f"section:{n}" for n in saved],
            }
        )
    )
    configured = RankTimeouts(rank_section_timeouts={f"c{i}": 1.0 for i in range(200)})
    timeouts, _ = load_learned(path, configured)
    assert len(timeouts.rank_section_timeouts) == 256
    assert all(timeouts.rank_section_timeouts[f"c{i}"] == 1.0 for i in range(200))
