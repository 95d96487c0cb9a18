"""The cells of the CLI's tables: any value a record holds, as one escaped line, a missing one
an en dash (NO_VALUE); a list where a list belongs, else none. Standard library only."""

from __future__ import annotations

from typing import Any

from ftd.cli.event_lines import MAX_VALUE_CHARS
from ftd.text import NO_VALUE, escape


def listed(item: object) -> list[Any]:
    """`item` if it is a list, else none: a record may hold anything where a list belongs."""
    return item if isinstance(item, list) else []


def value(item: object) -> str:
    if item is None:
        return NO_VALUE
    if isinstance(item, float):
        return f"{item:.1f}"
    return escape(str(item), MAX_VALUE_CHARS)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
