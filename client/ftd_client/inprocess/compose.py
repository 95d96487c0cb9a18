"""Compose: several callbacks of one kind applied as one, like function composition."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Compose(Generic[T]):
    """`Compose(f, g, h)(x) == f(g(h(x)))`: the rightmost runs first, each gets what the one
    before returned, and the last result is returned. With aborts: `Compose(AbortA(),
    AbortB())` runs AbortB, then AbortA, and forwards the FrozenState."""

    def __init__(self, *instances: Callable[[T], T]) -> None:
        if not instances:
            raise ValueError("Compose needs at least one callable")
        self.instances = instances

    def __call__(self, state: T) -> T:
        for instance in reversed(self.instances):
            forwarded = instance(state)
            if not isinstance(forwarded, type(state)):
                raise TypeError(
                    f"{instance!r} returned {type(forwarded).__name__}; each step of a Compose "
                    f"must return the {type(state).__name__} it was given (or a copy)"
                )
            state = forwarded
        return state

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.instances))})"
