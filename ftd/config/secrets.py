"""Secrets given to `ftd serve` by environment (FTD_RDZV_SECRET, FTD_API_TOKEN) leave every
process's initial environment.

Taking a variable out of `os.environ` does not change `/proc/<pid>/environ`, which shows the
block the process was exec'd with, to every process of the same user: every rank. So a daemon
started with a secret in its environment re-execs itself at once, before it has done anything
else, with the secrets out of its environment and in a pipe whose read end it inherits
(FTD_SECRETS_FD names it); the new image reads the pipe, closes it, and keeps the secrets in
this module's memory. Nothing the daemon starts afterwards (the orphan guard, the zygote, the
ranks) can inherit them, and the daemon's own environment block no longer holds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

NAMES = ("FTD_RDZV_SECRET", "FTD_API_TOKEN")
"""ftd.coordination.secret.SECRET_ENV and ftd.api.security.TOKEN_ENV: spelled out, since this
runs before the re-exec, where importing those packages would cost twice."""
FD_ENV = "FTD_SECRETS_FD"
MAX_VALUE_CHARS = 4100
"""Longer than any valid secret or token (their readers refuse such lengths); it keeps the
pipe's content (JSON: at most 6 bytes a character) under its buffer (64 KiB), so the write
never blocks before the exec."""

_held: dict[str, str] = {}


def isolate() -> None:
    """At `ftd serve`'s start: re-exec without the secrets when the environment holds one (this
    call then does not return); in the re-exec'd daemon, take them from the pipe."""
    if FD_ENV in os.environ:
        _receive(os.environ.pop(FD_ENV))
        return
    given = {name: os.environ[name] for name in NAMES if os.environ.get(name)}
    if not given:
        return
    payload = json.dumps({name: value[:MAX_VALUE_CHARS] for name, value in given.items()})
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, payload.encode())
    finally:
        os.close(write_fd)
    os.set_inheritable(read_fd, True)
    env = {key: value for key, value in os.environ.items() if key not in NAMES}
    env[FD_ENV] = str(read_fd)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as error:
        print(f"ftd serve: error: cannot restart without the secrets: {error}", file=sys.stderr)
        raise SystemExit(1) from None


def _receive(fd_text: str) -> None:
    """Take the secrets from the pipe; a daemon that cannot must not go on without them (it
    would run with an open store, or make a token of its own): one line and exit 1."""
    try:
        fd = int(fd_text)
    except ValueError:
        _give_up(f"{FD_ENV}={fd_text[:20]!r} is not a descriptor")
    chunks: list[bytes] = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 65536:
                _give_up("more than 64 KiB in the pipe")
    except OSError as error:
        _give_up(str(error))
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    try:
        data = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or not all(
        k in NAMES and isinstance(v, str) for k, v in data.items()
    ):
        _give_up("not what ftd serve writes")
    _held.update(data)


def _give_up(why: str) -> NoReturn:
    message = f"ftd serve: error: cannot read the secrets handed over at restart: {why}"
    print(message, file=sys.stderr)
    raise SystemExit(2)


def get(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The secret `name` was given: from the pipe of the re-exec, else from `environ` (a daemon
    run in-process, by a test)."""
    return _held.get(name) or environ.get(name, "")
