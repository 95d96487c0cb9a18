"""`ftd serve`'s configuration errors in the operator's words: pydantic names a ServeConfig field
(`api_port`, `progress_timeout_floor_s`); the operator typed a flag (`--api-port`). The table
from field to flag is derived from the serve parser itself, so a new flag needs no entry here."""

from __future__ import annotations

import argparse
import difflib
import re

from ftd.config.resolve import field_dest

_QUOTED = re.compile(r"'([^']{1,80})'")


def dest_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's destination -> its first long spelling (`api_port` -> `--api-port`)."""
    flags: dict[str, str] = {}
    for action in parser._actions:
        long = [option for option in action.option_strings if option.startswith("--")]
        if long and action.dest not in flags:
            flags[action.dest] = long[0]
    return flags


def in_flags(message: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """A UsageError's `field: problem; ...` with each field named by its flag, and the closest
    allowed value suggested where the problem lists them and the value given is near one."""
    dests = dest_flags(parser)
    problems = []
    for problem in message.split("; "):
        field, sep, text = problem.partition(": ")
        dest = field_dest(field, dests) if sep else None
        if dest is None or dest not in dests:
            problems.append(problem)
            continue
        problems.append(f"{dests[dest]}: {text}{_suggestion(text, getattr(args, dest, None))}")
    return "; ".join(problems)


def _suggestion(text: str, given: object) -> str:
    allowed = _QUOTED.findall(text)
    if not allowed or not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close and close[0] != given else ""
