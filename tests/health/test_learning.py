"""Learned timeouts (ftd.health.learning): multiplied, then blended, never below the floor."""

from __future__ import annotations

from ftd.config.ft import RankTimeouts
from ftd.health.learning import Observations, learn_timeouts


def test_learning_multiplies_then_blends_with_learned_values() -> None:
    seen = Observations()
    for name, seconds in [("heartbeats", 1.0), ("heartbeats", 2.0), ("step", 0.5), ("eval", 3)]:
        seen.see(name, seconds)
    first, learned = learn_timeouts(RankTimeouts(), frozenset(), seen, 5.0, sections=["step"])
    assert first.rank_heartbeat_timeout == 10.0
    assert first.rank_section_timeouts == {"step": 2.5}
    assert learned == {"rank_heartbeat_timeout", "section:step"}
    seen.see("heartbeats", 4.0)
    second, _ = learn_timeouts(first, learned, seen, 5.0)
    assert second.rank_heartbeat_timeout == (10.0 + 20.0) / 2  # blended with the learned value
    assert second.rank_section_timeouts["eval"] == 15.0  # first time: not blended
    configured = RankTimeouts(rank_heartbeat_timeout=100)
    third, _ = learn_timeouts(configured, frozenset(), seen, 5.0)
    assert third.rank_heartbeat_timeout == 20.0  # a configured value is replaced, not blended


def test_learning_never_goes_below_the_floor() -> None:
    seen = Observations()
    seen.see("first_heartbeat", 0.0005)  # handshake, then a heartbeat at once
    seen.see("heartbeats", 0.02)
    learned, _ = learn_timeouts(RankTimeouts(), frozenset(), seen, 5.0, floor=1.0)
    assert learned.initial_rank_heartbeat_timeout == 1.0
    assert learned.rank_heartbeat_timeout == 1.0
