"""Bounded readers of one decoded JSON object's fields, for the records' `read`: each returns
the typed value or raises ProtocolError with a countable cause."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeGuard

from ftd_client.protocol import MAX_SECTION_NAME, ProtocolError

Fields = Mapping[str, object]
"""One decoded JSON object, before its kind's record is built from it (never past the door)."""
Names = tuple[str, ...]


def section_name(value: object, what: str, cause: str = "bad_section_name") -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_SECTION_NAME:
        raise ProtocolError(cause, f"{what} {value!r:.40}")
    return value


def names(value: object, what: str, most: int, cause: str) -> Names:
    if (
        not isinstance(value, list)
        or len(value) > most
        or not all(isinstance(n, str) and 0 < len(n) <= MAX_SECTION_NAME for n in value)
    ):
        raise ProtocolError(cause, f"{what} must be a list of at most {most} names")
    return tuple(value)


def timeout_value(value: object) -> float | str | None:
    if value is None or (isinstance(value, str) and len(value) <= 32):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    raise ProtocolError("bad_request", f"timeout {value!r:.40}")


def integer(fields: Fields, key: str, low: int, high: int, cause: str) -> int:
    value = fields.get(key)
    if value is None:
        raise ProtocolError(cause, f"{key} is missing")
    if not is_int(value) or not low <= value <= high:
        raise ProtocolError(cause, f"{key} {value!r:.40}")
    return value


def optional_integer(fields: Fields, key: str, low: int, high: int, cause: str) -> int | None:
    """`key`'s integer in low..high, or None where it is absent or null (a count not sent)."""
    return None if fields.get(key) is None else integer(fields, key, low, high, cause)


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
