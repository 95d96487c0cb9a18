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
import math
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


NO_VALUE = "\u2013"
"""What every surface shows for a value that is not there (null, missing, not a number)."""

MAX_DAYS = 100_000


def _nearest(value: float) -> int:
    """Half up (floor(x + 0.5)), as JavaScript's Math.round: the dashboard's twin agrees."""
    return math.floor(value + 0.5)


def duration(seconds: object) -> str:
    """A duration for people, the one formatter of every CLI surface (`ftd status`, `ftd top`,
    `ftd events`); the dashboard's JavaScript twin follows the same rules:

    - not a finite number (None, NaN, a bool, text): an en dash (NO_VALUE);
    - each form rounds half up to its last digit, then takes the first form whose rounded
      value stays below the form's limit, so a carry moves to the next form and no form shows
      1000 ms, 60 s, 60 min or 24 h;
    - `0 ms`, `<1 ms` (above 0, rounds to 0 ms), `1 ms` … `999 ms`;
    - `1.00 s` … `9.99 s` (hundredths); `10.0 s` … `59.9 s` (tenths);
    - `1 min 0 s` … `59 min 59 s`; `1 h 0 min` … `23 h 59 min`; `1 d 0 h` … `99999 d 23 h`,
      then `>99999 d`;
    - a negative duration is the same text after a `-`.

    0.9996 s -> `1.00 s`; 59.9996 s -> `1 min 0 s`; 86400 s -> `1 d 0 h`; 0.0004 s -> `<1 ms`.
    """
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        return NO_VALUE
    if not math.isfinite(seconds):
        return NO_VALUE
    if seconds < 0:
        return "-" + duration(-seconds)
    if seconds >= MAX_DAYS * 86400 - 1800:
        return f">{MAX_DAYS - 1} d"
    millis = _nearest(seconds * 1000)
    if millis < 1000:
        return "<1 ms" if millis == 0 and seconds > 0 else f"{millis} ms"
    hundredths = _nearest(seconds * 100)
    if hundredths < 1000:
        return f"{hundredths // 100}.{hundredths % 100:02d} s"
    tenths = _nearest(seconds * 10)
    if tenths < 600:
        return f"{tenths // 10}.{tenths % 10} s"
    whole_s = _nearest(seconds)
    if whole_s < 3600:
        return f"{whole_s // 60} min {whole_s % 60} s"
    minutes = _nearest(seconds / 60)
    if minutes < 1440:
        return f"{minutes // 60} h {minutes % 60} min"
    hours = _nearest(seconds / 3600)
    return f"{hours // 24} d {hours % 24} h"
