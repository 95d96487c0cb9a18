"""A rank's request to learn its timeouts (`calc`): ftd's rule, every observed section blended
with an earlier learned value, or NVRx's (ftd/health/learning.py). Calls of one generation, one
per rank, start from the same timeouts (learning.Generations)."""

from __future__ import annotations

from ftd_client.messages import CalculateTimeouts

from ftd.config.ft import FaultToleranceConfig
from ftd.health.learning import (
    OUT_OF_SECTION,
    Base,
    Generations,
    learn_nvrx,
    learn_timeouts,
    learned_values,
)
from ftd.health.links import RankHealth
from ftd.health.monitor import Monitor


def requested_values(
    message: CalculateTimeouts,
    rank: RankHealth,
    now: float,
    current: Base,
    generations: Generations,
    monitor: Monitor,
    ft: FaultToleranceConfig,
) -> dict[str, float]:
    """The timeouts (by name) that `rank`'s `calc` message learns from what `monitor` observed,
    starting from `current` (or its generation's base); NotReady when NVRx's rule has too few
    observations."""
    sections = None if message.sections is None else sorted(set(message.sections))
    out_of_section, rule, kind = message.out_of_section, message.rule, message.kind
    generation = message.generation
    base = current if generation is None else generations.base((rule, kind, generation), current)
    if rule == "nvrx":
        assert kind != "all"  # refused by the door (wire.decode)
        if kind == "sections" and not rank.open_sections and rank.out_of_section_since:
            # NVRx's maybe_bump_oos_time: the rank's current stretch out of any section.
            monitor.observed.see(OUT_OF_SECTION, now - rank.out_of_section_since)
        return learn_nvrx(
            base,
            monitor.observed,
            ft.safety_factor,
            kind,
            sections,
            out_of_section,
            ft.min_learned_timeout,
        )
    result, names = learn_timeouts(
        base.timeouts,
        base.learned,
        monitor.observed,
        ft.safety_factor,
        sections,
        out_of_section,
        floor=ft.min_learned_timeout,
    )
    return learned_values(result, names)
