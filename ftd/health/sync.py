"""Section state that heals itself, and what one rank may make the daemon hold.

Section events travel as lossy packets (ftd_client/protocol.py). Each connection numbers its
messages; section events carry the sections open on that connection after them, and after a
drop every message does. So:

- a gap in the numbers means messages were lost: the connection's sections, and the time out
  of any section, are untimed until its state arrives (a fresh grace, never a verdict on a
  state nobody knows);
- a state replaces what the daemon believed of that connection: sections it no longer lists
  are closed (their length unknown: nothing is learned from them), sections it lists that
  the daemon did not know were opened *now* (the latest they could have been).

Budgets: at most MAX_OPEN_SECTIONS sections open per rank, and at most MAX_SECTIONS distinct
section names per node (the timeouts table's own bound, so learning can never outgrow it).
Over a budget the section is not timed and the refusal is counted; nothing raises past the
rank socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ftd_client.protocol import MAX_OPEN_SECTIONS, MAX_SECTIONS, ProtocolError

from ftd.health.links import RankHealth

NO_LINK = 0
"""The connection id of sections opened where no sequence is kept (NVRx's stream socket)."""
OPEN_SECTIONS = "open_sections"
SECTION_NAMES = "section_names"


class BudgetExceeded(ProtocolError):
    """A rank asked the daemon to hold more than a budget allows; `budget` names which."""

    def __init__(self, budget: str, detail: str) -> None:
        super().__init__(f"budget_{budget}", detail)
        self.budget = budget


class SectionNames:
    """The distinct section names this node times: configured ones first, then those ranks
    open, up to MAX_SECTIONS."""

    def __init__(self, configured: Iterable[str] = ()) -> None:
        self._names: set[str] = set(configured)

    def include(self, names: Iterable[str]) -> None:
        """Names of the timeouts in force are always timed."""
        self._names.update(names)

    def admit(self, name: str) -> bool:
        if name in self._names:
            return True
        if len(self._names) >= MAX_SECTIONS:
            return False
        self._names.add(name)
        return True


def open_section(
    rank: RankHealth,
    name: str,
    link: int,
    now: float,
    names: SectionNames,
    heard: float | None = None,
) -> None:
    """Open (or reopen: its clock restarts) `name` on `link` at `now`, the daemon hearing of
    it at `heard` (default: then); BudgetExceeded if it may not."""
    if name not in rank.open_sections:
        if not names.admit(name):
            raise BudgetExceeded(SECTION_NAMES, f"more than {MAX_SECTIONS} section names")
        if len(rank.open_sections) >= MAX_OPEN_SECTIONS:
            raise BudgetExceeded(OPEN_SECTIONS, f"more than {MAX_OPEN_SECTIONS} open sections")
    rank.open_sections[name] = now
    rank.section_seen[name] = now if heard is None else heard
    rank.section_links[name] = link
    rank.out_of_section_since = rank.out_of_section_seen = None


def close_section(
    rank: RankHealth, name: str, now: float, heard: float | None = None
) -> float | None:
    """Close `name` at `now` (heard of at `heard`); when it had opened, or None when it was
    not open."""
    started = rank.open_sections.pop(name, None)
    rank.section_seen.pop(name, None)
    rank.section_links.pop(name, None)
    if not rank.open_sections and rank.out_of_section_since is None:
        rank.out_of_section_since = now
        rank.out_of_section_seen = now if heard is None else heard
    return started


def apply_state(
    rank: RankHealth,
    link: int,
    state: Sequence[str],
    now: float,
    names: SectionNames,
    fresh: bool = False,
    heard: float | None = None,
) -> list[BudgetExceeded]:
    """Make the sections open on `link` exactly `state` (see the module's docstring); the
    link's state is known again. `fresh` (or a link whose state was unknown): the sections
    that stay open may have closed and opened again unseen, so their clocks restart now.
    Returns what a budget refused."""
    fresh = fresh or link in rank.unknown_links
    wanted = dict.fromkeys(state)
    for name in [n for n, owner in rank.section_links.items() if owner == link]:
        if name not in wanted:
            close_section(rank, name, now, heard)
    refused: list[BudgetExceeded] = []
    for name in wanted:
        if name in rank.open_sections:
            rank.section_links[name] = link
            if fresh:
                rank.open_sections[name] = now
                rank.section_seen[name] = now if heard is None else heard
            continue
        try:
            open_section(rank, name, link, now, names, heard)
        except BudgetExceeded as error:
            refused.append(error)
    rank.unknown_links.discard(link)
    if not rank.open_sections and rank.out_of_section_since is None:
        rank.out_of_section_since = now
        rank.out_of_section_seen = now if heard is None else heard
    return refused


def lose(rank: RankHealth, link: int, lost: int) -> None:
    """`lost` messages of `link` never arrived: its section state is unknown until it says."""
    if lost > 0:
        rank.lost_messages += lost
        rank.unknown_links.add(link)


def patched_sections(patch: Mapping[str, object]) -> list[str]:
    """The section names a timeouts patch sets."""
    sections = patch.get("rank_section_timeouts")
    return list(sections) if isinstance(sections, dict) else []
