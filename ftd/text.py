"""Text from the job, made safe for a terminal: the one escaping function for everything ftd
prints that a rank, a store or another daemon supplied (section names, failure reasons, node
states, event fields, error files, log lines). Standard library only.

Control characters (C0, DEL, C1), Unicode format characters that reorder or hide text (bidi
overrides and isolates, zero-width characters, the BOM), line and paragraph separators and
lone surrogates are shown as `\\xNN` / `\\uNNNN`: no value can move the cursor, clear the
screen, retitle the terminal, ring its bell or display as something it is not.
"""

from __future__ import annotations

import logging
import re

_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)
_UNSAFE_BUT_LINES = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
    "\ufeff\ufff9-\ufffb\ud800-\udfff]"
)


def _code(match: re.Match[str]) -> str:
    point = ord(match.group())
    return f"\\x{point:02x}" if point < 0x100 else f"\\u{point:04x}"


def escape(text: str, limit: int | None = None, lines: bool = False) -> str:
    """`text` with every character that could act on a terminal shown as an escape, cut to
    `limit` characters (None: whole). `lines`: newlines and tabs stay (a traceback, a
    multi-line summary); otherwise the result is one line."""
    shown = (_UNSAFE_BUT_LINES if lines else _UNSAFE).sub(_code, text)
    if limit is None or len(shown) <= limit:
        return shown
    return shown[: max(0, limit - 1)] + "…"


class EscapingFormatter(logging.Formatter):
    """Log lines with what the job supplied escaped; a message's own lines stay lines."""

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record), lines=True)


def is_decimal(text: str) -> bool:
    """Whether `text` is ASCII digits only, as every number ftd reads must be: `str.isdigit`
    also takes "¹" (which int() refuses) and "٣" (which int() reads as 3)."""
    return text.isascii() and text.isdigit()
