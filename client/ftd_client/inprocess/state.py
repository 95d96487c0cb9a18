"""What the Wrapper's callbacks (abort, finalize, health check) are shown: a read-only view."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from ftd_client.inprocess.keys import Fault


class Mode(enum.Enum):
    """A rank's part in a round (NVRx's names): ACTIVE ranks call the function, INACTIVE ones
    wait as reserves; INITIALIZED before a rank assignment ran, TERMINATED once discarded."""

    INITIALIZED = enum.auto()
    ACTIVE = enum.auto()
    INACTIVE = enum.auto()
    TERMINATED = enum.auto()


@dataclass(frozen=True)
class FrozenState:
    """The Wrapper's state at one moment, read-only (assigning to a field raises
    `dataclasses.FrozenInstanceError`); `replace()` makes a changed copy to forward."""

    initial_rank: int
    """The rank's RANK when its process started: its name across rounds (its slot)."""
    initial_world_size: int
    rank: int
    """RANK in the current round (the index of the slot among the round's members)."""
    world_size: int
    iteration: int
    """The round: 0 for the first call of the function, +1 for each in-process restart."""
    fault: Fault | None = None
    """What ended the round, once known."""
    active_rank: int | None = None
    """RANK given to the function (None: an inactive rank); `rank` unless a rank assignment
    made some ranks reserves."""
    active_world_size: int | None = None
    mode: Mode = Mode.ACTIVE

    def replace(self, **changes: object) -> FrozenState:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
