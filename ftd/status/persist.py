"""The daemon's files, written so that a full disk or a hostile directory never stops it.

Every file is written whole or not at all: a temporary file created next to it (O_EXCL,
O_NOFOLLOW, mode 0600: nobody else's file is ever opened, a planted link is never followed),
flushed to disk, then renamed over the old one (which replaces a planted link itself, never
its target). A failed write is logged and recorded once per file and cause, the in-memory state
stays the truth (the API reads memory, not files), and the next successful write says so.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftd import containment

log = logging.getLogger("ftd.persist")

FILE_MODE = 0o600
_names = itertools.count()


def atomic_write(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace `path` with `data` (raises OSError; the temporary file is removed then)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_names)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cause_of(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, "error").lower()


class Persistence:
    """Writes files for the daemon; never raises; says once what it could not write."""

    def __init__(
        self,
        on_failure: Callable[[str, str, str], object] | None = None,
        on_recovery: Callable[[str], object] | None = None,
    ) -> None:
        self.failing: dict[str, str] = {}
        """Files whose last write failed: path → cause."""
        self.failures = 0
        self._on_failure = on_failure
        """(path, cause, detail) for the first failure of a file and cause (an event)."""
        self._on_recovery = on_recovery
        """(path) when a file that was failing is written again (an event)."""

    def write_text(self, path: Path, text: str, durable: bool = True) -> bool:
        return self.write_bytes(path, text.encode(), durable)

    def write_json(self, path: Path, value: Any, durable: bool = True) -> bool:
        try:
            containment.inject("persistence")
            text = json.dumps(value, default=str)
        except Exception as error:  # a value that cannot be written: a bug of ours
            containment.record("persistence", error)
            return False
        return self.write_text(path, text, durable)

    def write_bytes(self, path: Path, data: bytes, durable: bool = True) -> bool:
        key = str(path)
        try:
            atomic_write(path, data, durable)
        except OSError as error:
            self.failures += 1
            cause = cause_of(error)
            if self.failing.get(key) != cause:
                self.failing[key] = cause
                detail = f"{error.strerror or error}"
                log.error(
                    "could not write %s (%s): %s; supervision goes on, the API shows the "
                    "current state",
                    path,
                    cause,
                    detail,
                )
                if self._on_failure is not None:
                    with contextlib.suppress(Exception):
                        self._on_failure(key, cause, detail)
            return False
        if self.failing.pop(key, None) is not None:
            log.warning("%s is written again", path)
            if self._on_recovery is not None:
                with contextlib.suppress(Exception):
                    self._on_recovery(key)
        return True
