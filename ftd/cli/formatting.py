"""How ftd's command lines present themselves: one-line usage errors, help within 100 columns.

Standard library only (the CLI's `--help` must not import pydantic or torch).
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import NoReturn

EXIT_USAGE = 2
HELP_WIDTH = 100


class UsageParser(argparse.ArgumentParser):
    """A usage error is one line, `<prog>: error: ...`, and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def unrecognized(unknown: Sequence[str], options: Iterable[str]) -> str:
    """`unrecognized arguments: ...`, naming the closest option for each unknown one that looks
    like a typo of it (`--nproc-per-nod`: did you mean --nproc-per-node?)."""
    known = sorted(option for option in options if option.startswith("--"))
    hints: list[str] = []
    several = sum(word.startswith("--") for word in unknown) > 1
    for word in unknown:
        name = word.partition("=")[0]
        if not name.startswith("--") or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            hints.append(f"{close[0]} for {name}" if several else close[0])
    hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint}"


def parse_or_exit(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, where an unknown option's error suggests the closest of the
    chosen subcommand's options."""
    namespace, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(unrecognized(unknown, options_in_use(parser, namespace)))
    return namespace


def options_in_use(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> list[str]:
    """The option strings of `parser` and of the subcommands `namespace` chose."""
    options = list(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
            if isinstance(chosen, argparse.ArgumentParser):
                options += options_in_use(chosen, namespace)
    return options


class HelpFormatter(argparse.HelpFormatter):
    """Lines of at most 100 characters; a default is shown only when it says something; of a
    flag's spellings, only those that differ by more than snake_case or the ft_launcher forms
    the group description already explains."""

    def __init__(self, prog: str) -> None:
        columns = shutil.get_terminal_size((HELP_WIDTH, 24)).columns
        super().__init__(prog, max_help_position=34, width=max(60, min(HELP_WIDTH, columns) - 2))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == ""
            or default == argparse.SUPPRESS
            or action.option_strings == []
        ):
            return text
        return f"{text} (default: %(default)s)"

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = shown_spellings(action.option_strings)
        if action.nargs == 0:
            return ", ".join(shown)
        metavar = self._metavar_formatter(action, action.dest.upper())(1)[0]
        return ", ".join([*shown[:-1], f"{shown[-1]} {metavar}"])


def shown_spellings(options: Sequence[str]) -> list[str]:
    """`--nproc-per-node` for [--nproc-per-node, --nproc_per_node]; an ft parameter by its
    `--ft-param-NAME` spelling only (the group's description gives the other forms)."""
    if options[0].startswith("--ft-param-"):
        return [options[0]]
    shown: list[str] = []
    for option in options:
        kebab = option[:2] + option[2:].replace("_", "-") if option.startswith("--") else option
        if option != kebab and kebab in options:
            continue
        shown.append(option)
    return shown


def memory_size(text: str) -> str | int:
    """`auto`, or bytes: `123`, `512K`, `512M`, `8G`, `1T` (powers of 1024; `MiB`, `MB` too)."""
    size = re.fullmatch(r"(\d{1,15})([KMGT]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if size:
        return int(size[1]) << 10 * " KMGT".index(size[2].upper() or " ")
    if text.strip() == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"{text!r:.40} is no size (auto, 0, 512M, 8G, ...)")
