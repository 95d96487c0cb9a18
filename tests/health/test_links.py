"""A rank's next deadline (ftd.health.links.next_deadline): which check is due, and when."""

from __future__ import annotations

from ftd.config.ft import RankTimeouts
from ftd.health.links import RankHealth, next_deadline


def rank(**fields: object) -> RankHealth:
    health = RankHealth(local_rank=0, global_rank=3, pid=42)
    for name, value in fields.items():
        setattr(health, name, value)
    return health


TIMEOUTS = RankTimeouts(
    initial_rank_heartbeat_timeout=60,
    rank_heartbeat_timeout=10,
    rank_section_timeouts={"step": 2, "checkpointing": None},
    rank_out_of_section_timeout=5,
)


def test_no_deadline_before_the_handshake() -> None:
    assert next_deadline(rank(), TIMEOUTS) is None


def test_initial_heartbeat_then_heartbeat_deadline() -> None:
    connected = rank(connected_at=100.0)
    deadline = next_deadline(connected, TIMEOUTS)
    assert deadline is not None
    assert (deadline.kind, deadline.at) == ("initial_heartbeat", 160.0)
    beating = rank(connected_at=100.0, last_heartbeat=150.0, out_of_section_since=None)
    deadline = next_deadline(beating, TIMEOUTS)
    assert deadline is not None and (deadline.kind, deadline.at) == ("heartbeat", 160.0)


def test_open_section_sets_the_nearest_deadline() -> None:
    in_step = rank(connected_at=0.0, last_heartbeat=9.0, open_sections={"step": 10.0})
    deadline = next_deadline(in_step, TIMEOUTS)
    assert deadline is not None
    assert (deadline.kind, deadline.section, deadline.at) == ("section", "step", 12.0)
    assert "section 'step'" in deadline.reason(in_step, now=12.5)
    assert "overdue by 500.0 ms" in deadline.reason(in_step, now=12.5)


def test_section_without_timeout_and_out_of_section() -> None:
    checkpointing = rank(connected_at=0.0, last_heartbeat=0.0, open_sections={"checkpointing": 1.0})
    deadline = next_deadline(checkpointing, TIMEOUTS)
    assert deadline is not None and deadline.kind == "heartbeat"
    between = rank(connected_at=0.0, last_heartbeat=20.0, out_of_section_since=18.0)
    deadline = next_deadline(between, TIMEOUTS)
    assert deadline is not None and (deadline.kind, deadline.at) == ("out_of_section", 23.0)


def test_none_disables_every_check() -> None:
    assert next_deadline(rank(connected_at=0.0, out_of_section_since=0.0), RankTimeouts()) is None
