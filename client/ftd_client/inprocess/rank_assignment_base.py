"""What every rank assignment is (rank_assignment.py's flat ones, rank_tree.py's tree): its
context, its interface, and the error of a rank it discards."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from ftd_client.inprocess.exceptions import RestartError
from ftd_client.inprocess.state import FrozenState


class RankDiscarded(RestartError):
    """This rank takes no part in the job any more (its process exits)."""


@dataclass
class RankAssignmentCtx:
    state: FrozenState
    store: Any = None
    """The round's store (torch's TCPStore API), for assignments that must talk."""
    terminated_ranks: set[int] = field(default_factory=set)


class RankAssignment(abc.ABC):
    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Reassign `ctx.state`'s rank and world size, or its mode; return the context."""
