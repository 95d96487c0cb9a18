"""Initialize: run at the start of every round, the first included, before the function.

An Exception ends the round like the function's own (another round follows); a
BaseException such as RestartAbort ends the Wrapper. Names follow NVRx's
`inprocess.initialize`.
"""

from __future__ import annotations

import abc

from ftd_client.inprocess.exceptions import RestartAbort
from ftd_client.inprocess.state import FrozenState


class Initialize(abc.ABC):
    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState:
        """Check or prepare the round; return `state` (or a copy)."""


class RetryController(Initialize):
    """RestartAbort once the round's iteration reaches `max_iterations` (None: no limit), or
    its world is smaller than `min_world_size` / `min_active_world_size` (under ftd every
    member of a round is active, so both compare with the round's world size)."""

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ) -> None:
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __repr__(self) -> str:
        return (
            f"RetryController(max_iterations={self.max_iterations}, "
            f"min_world_size={self.min_world_size}, "
            f"min_active_world_size={self.min_active_world_size})"
        )

    def __call__(self, state: FrozenState) -> FrozenState:
        too_small = state.world_size < max(self.min_world_size, self.min_active_world_size)
        too_many = self.max_iterations is not None and state.iteration >= self.max_iterations
        if too_small or too_many:
            raise RestartAbort(
                f"iteration={state.iteration} max_iterations={self.max_iterations} "
                f"world_size={state.world_size} min_world_size={self.min_world_size} "
                f"min_active_world_size={self.min_active_world_size}"
            )
        return state
