"""Learning timeouts from several ranks: NVRx's rule, and one result whoever calls last.

Every rank of a job calls `calculate_and_set_*` (NVRx makes it a collective). The daemon sees
each rank's call separately; if each call blended its result into the previous one, the value
would depend on how many ranks called and in which order. So the calls are grouped: the n-th
call of a kind by any rank belongs to generation n, and every call of a generation starts from
the timeouts in force before that generation's first call. The observations are the longest
intervals of every rank of the node (Observations keeps the maximum), so the last
call of a generation gives the maximum across the node's ranks, merged once into the previous
value, however many ranks called and in whatever order.

`learn_nvrx` is NVRx's rule (nvidia_resiliency_ext.fault_tolerance.timeouts_calc, 0.4.x):
- heartbeats: both the first heartbeat and a later interval must have been seen; initial =
  safety_factor * longest wait for the first heartbeat, subsequent = safety_factor * longest
  interval;
- sections: `sections=None` relearns every section of the configuration, a list relearns
  those only (`[]`: none: only the out-of-section timeout, if asked); readiness needs an
  observation of every listed section (of every configured one when the list is empty or
  None, as NVRx checks) and of out-of-section time when that is asked for;
- a value that was itself calculated is merged 50/50 with the new one (NVRx's EMA), others
  are replaced; sections not selected keep their value.
ftd adds a floor: a learned value is never below `min_learned_timeout`.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from ftd.config.ft import MAX_SECTIONS, MAX_TIMEOUT_S, RankTimeouts
from ftd.refusals import refused

log = logging.getLogger("ftd.health")
MAX_STATE_FILE_BYTES = 1 << 20

HB_INITIAL = "initial_rank_heartbeat_timeout"
HB_SUBSEQUENT = "rank_heartbeat_timeout"
OOS = "rank_out_of_section_timeout"
MAX_GENERATIONS = 64
Kind = Literal["hb", "sections"]
HEARTBEATS = "heartbeats"
OUT_OF_SECTION = "out_of_section"


@dataclass
class Observations:
    """The longest intervals seen on this node, the material timeouts are learned from."""

    first_heartbeat: float | None = None
    heartbeat_interval: float | None = None
    sections: dict[str, float] = field(default_factory=dict)
    out_of_section: float | None = None

    def see(self, name: str, seconds: float) -> None:
        if name == "first_heartbeat":
            self.first_heartbeat = max(self.first_heartbeat or 0.0, seconds)
        elif name == HEARTBEATS:
            self.heartbeat_interval = max(self.heartbeat_interval or 0.0, seconds)
        elif name == OUT_OF_SECTION:
            self.out_of_section = max(self.out_of_section or 0.0, seconds)
        else:
            self.sections[name] = max(self.sections.get(name, 0.0), seconds)


def learn_timeouts(
    current: RankTimeouts,
    learned: frozenset[str],
    seen: Observations,
    safety_factor: float,
    sections: list[str] | None = None,
    out_of_section: bool = True,
    floor: float = 0.0,
) -> tuple[RankTimeouts, frozenset[str]]:
    """ft_launcher's rule: timeout = longest observed interval * safety_factor (at least
    `floor`), blended 50/50 with the previous value when that one was itself learned. Returns
    the new timeouts and the names of those now learned (`sections` None: every observed
    section). The table never outgrows MAX_SECTIONS: new names beyond it are not learned."""
    values = current.model_dump()
    now_learned = set(learned)

    def blend(key: str, previous: float | None, observed: float) -> float:
        value = min(max(observed * safety_factor, floor), MAX_TIMEOUT_S)
        if key in learned and previous is not None:
            value = (previous + value) / 2
        now_learned.add(key)
        return round(value, 6)

    if seen.first_heartbeat is not None:
        values["initial_rank_heartbeat_timeout"] = blend(
            "initial_rank_heartbeat_timeout",
            current.initial_rank_heartbeat_timeout,
            seen.first_heartbeat,
        )
    if seen.heartbeat_interval is not None:
        values["rank_heartbeat_timeout"] = blend(
            "rank_heartbeat_timeout", current.rank_heartbeat_timeout, seen.heartbeat_interval
        )
    section_values = dict(current.rank_section_timeouts)
    for name, observed in seen.sections.items():
        if name not in section_values and len(section_values) >= MAX_SECTIONS:
            continue  # the table is full (its bound): a new name is not learned
        if sections is None or name in sections:
            section_values[name] = blend(f"section:{name}", section_values.get(name), observed)
    values["rank_section_timeouts"] = section_values
    if out_of_section and seen.out_of_section is not None:
        values["rank_out_of_section_timeout"] = blend(
            "rank_out_of_section_timeout",
            current.rank_out_of_section_timeout,
            seen.out_of_section,
        )
    return RankTimeouts.model_validate(values), frozenset(now_learned)


class NotReady(ValueError):
    """Not enough observed yet to calculate these timeouts."""


def section_key(name: str) -> str:
    return f"section:{name}"


@dataclass(frozen=True)
class Base:
    """What a generation's calls start from."""

    timeouts: RankTimeouts
    learned: frozenset[str]


class Generations:
    """The base of each (rule, kind, generation) seen in this attempt (bounded)."""

    def __init__(self) -> None:
        self._bases: OrderedDict[tuple[str, str, int], Base] = OrderedDict()

    def base(self, key: tuple[str, str, int], current: Base) -> Base:
        base = self._bases.get(key)
        if base is None:
            base = self._bases[key] = current
            while len(self._bases) > MAX_GENERATIONS:
                self._bases.popitem(last=False)
        return base

    def reset(self) -> None:
        self._bases.clear()


def _ema(previous: float, new: float) -> float:
    return 0.5 * previous + 0.5 * new


def learn_nvrx(
    base: Base,
    seen: Observations,
    safety_factor: float,
    kind: Kind,
    sections: list[str] | None = None,
    out_of_section: bool = True,
    floor: float = 0.0,
) -> dict[str, float]:
    """The learned values, by learned-name (HB_*, OOS, section_key(name)); NotReady when the
    observations do not allow them. Pure."""

    def merged(name: str, previous: float | None, observed: float) -> float:
        value = safety_factor * observed
        if name in calculated and previous is not None:
            value = _ema(previous, value)
        return round(max(value, floor), 6)

    current = base.timeouts
    calculated = base.learned
    if kind == "hb":
        # NVRx has one were_calculated flag for both heartbeat timeouts.
        if not {HB_INITIAL, HB_SUBSEQUENT} <= calculated:
            calculated = calculated - {HB_INITIAL, HB_SUBSEQUENT}
        if not (seen.first_heartbeat or 0) > 0 or not (seen.heartbeat_interval or 0) > 0:
            raise NotReady("no heartbeat interval observed yet")
        assert seen.first_heartbeat is not None and seen.heartbeat_interval is not None
        return {
            HB_INITIAL: merged(
                HB_INITIAL, current.initial_rank_heartbeat_timeout, seen.first_heartbeat
            ),
            HB_SUBSEQUENT: merged(
                HB_SUBSEQUENT, current.rank_heartbeat_timeout, seen.heartbeat_interval
            ),
        }
    configured = list(current.rank_section_timeouts)
    unknown = [name for name in sections or [] if name not in configured]
    if unknown:
        raise NotReady(f"sections {unknown} have no entry in rank_section_timeouts")
    required = sections or configured  # NVRx checks them all when the list is empty
    missing = [name for name in required if not seen.sections.get(name, 0.0) > 0]
    if missing:
        raise NotReady(f"sections {missing} not observed yet")
    if out_of_section and not (seen.out_of_section or 0) > 0:
        raise NotReady("no out-of-section time observed yet")
    values: dict[str, float] = {}
    for name in configured if sections is None else sections:
        key = section_key(name)
        values[key] = merged(key, current.rank_section_timeouts.get(name), seen.sections[name])
    if out_of_section:
        assert seen.out_of_section is not None
        values[OOS] = merged(OOS, current.rank_out_of_section_timeout, seen.out_of_section)
    return values


def apply_values(current: RankTimeouts, values: dict[str, float]) -> RankTimeouts:
    """`current` with the learned values (by learned-name) in place."""
    fields = current.model_dump()
    for name, value in values.items():
        if name.startswith("section:"):
            fields["rank_section_timeouts"][name.removeprefix("section:")] = value
        else:
            fields[name] = value
    return RankTimeouts.model_validate(fields)


def learned_values(timeouts: RankTimeouts, names: frozenset[str]) -> dict[str, float]:
    """The values of `names` in `timeouts` (those set)."""
    values: dict[str, float] = {}
    for name in names:
        if name.startswith("section:"):
            value = timeouts.rank_section_timeouts.get(name.removeprefix("section:"))
        else:
            value = getattr(timeouts, name, None)
        if isinstance(value, float | int):
            values[name] = float(value)
    return values


def load_learned(path: Path, configured: RankTimeouts) -> tuple[RankTimeouts, frozenset[str]]:
    """Learned values saved by an earlier run override the configured ones they replaced.
    The file is read as outside input (a disk filled mid-write, an edit by hand): bounded,
    every field checked, and anything wrong is one warning and the configured timeouts."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_STATE_FILE_BYTES + 1)
    except FileNotFoundError:
        return configured, frozenset()
    except OSError as error:
        log.warning("ignoring the unreadable state file %s: %s", path, error)
        refused("state_file", "unreadable")
        return configured, frozenset()
    try:
        if len(data) > MAX_STATE_FILE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
        state = json.loads(data)
        saved = RankTimeouts.model_validate(state["timeouts"])
        learned = _learned_names(state.get("learned", []))
        merged = _merge_learned(configured, saved, learned)
        log.info("loaded learned timeouts from %s", path)
        return merged, learned
    except (ValueError, KeyError, TypeError, RecursionError, ValidationError) as error:
        log.warning("ignoring the unreadable state file %s: %s", path, str(error)[:300])
        refused("state_file", "invalid")
        return configured, frozenset()


def _learned_names(value: object) -> frozenset[str]:
    if not isinstance(value, list) or len(value) > MAX_SECTIONS + 8:
        raise ValueError("learned must be a list of timeout names")
    if not all(isinstance(name, str) and len(name) <= 200 for name in value):
        raise ValueError("learned must be a list of timeout names")
    return frozenset(value)


def _merge_learned(
    configured: RankTimeouts, saved: RankTimeouts, learned: frozenset[str]
) -> RankTimeouts:
    values: dict[str, Any] = configured.model_dump()
    sections: dict[str, float | None] = values["rank_section_timeouts"]
    for name in sorted(learned):
        if name.startswith("section:"):
            section = name.removeprefix("section:")
            full = section not in sections and len(sections) >= MAX_SECTIONS
            if section in saved.rank_section_timeouts and not full:
                sections[section] = saved.rank_section_timeouts[section]
        elif name in values and name != "rank_section_timeouts":
            values[name] = getattr(saved, name)
    return RankTimeouts.model_validate(values)
