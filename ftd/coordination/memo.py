"""Decoded records kept with the bytes they came from (both backends' cluster views).

A record's decoding checks its MAC and validates it: at 1,024 summaries most of a cluster
view's CPU, and a dashboard's read every 2 s finds most of them unchanged. The same bytes
under the same key decode to the same record (the MAC binds the key), so a read that finds
them again takes what they gave last time; bytes that changed, or a key new to the read, are
decoded. It holds one read's: a key gone from a read is forgotten."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")
P = TypeVar("P")


class BytesMemo(Generic[T]):
    """The valid values of the last read, by key, with the bytes each was decoded from."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, T]] = {}

    def take(
        self, found: Iterable[tuple[str, bytes, P]], decode: Callable[[P], T | None]
    ) -> dict[str, T]:
        """`found`'s (key, bytes, what `decode` reads) as values: decoded where the bytes
        under a key are new (None: invalid, left out), kept where they are not."""
        kept: dict[str, tuple[bytes, T]] = {}
        for name, raw, source in found:
            had = self._last.get(name)
            if had is not None and had[0] == raw:
                kept[name] = had
            elif (value := decode(source)) is not None:
                kept[name] = (raw, value)
        self._last = kept
        return {name: value for name, (_, value) in kept.items()}
