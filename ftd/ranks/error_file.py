"""A rank's error file (`TORCHELASTIC_ERROR_FILE`, written by torch's `@record`), decoded with
bounds: a file a rank left empty, cut short, huge, nested or of odd types is a refusal with its
reason, never an exception in the daemon.

torch's ErrorHandler writes `{"message": {"message": "<Type>: <text>", "extraInfo":
{"py_callstack": "<traceback>", "timestamp": "<unix seconds>"}, "errorCode": <int>?}}`; the
newer form is `{"message": "<text>", "timestamp": <unix seconds>}`. Nothing else of the file
is read.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import re
import stat
from dataclasses import dataclass

from ftd.refusals import Refusals

MAX_FILE_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_MESSAGE_CHARS = 4096
MAX_TRACEBACK_CHARS = 32 * 1024
MAX_TRACEBACK_LINES = 200
MAX_TIMESTAMP = 1 << 33
"""Later than the year 2242: no clock of a rank's; refused so no date conversion can fail."""

refusals: collections.Counter[str] = Refusals("error_file")
"""Error files refused, by the first word of the reason (this process's count)."""

_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_PAIR = re.compile(r"\[\]|\{\}")


@dataclass(frozen=True)
class RankError:
    """What torch's `@record` wrote, cut to bounds."""

    message: str
    """`RuntimeError: ...`, or "" when the file has none."""
    traceback: str
    """The end of the traceback (py_callstack), or ""."""
    timestamp: int | None
    error_code: int | None
    """`errorCode`: an agent's override of the exit code (a signal), if written."""

    @property
    def shown(self) -> str:
        """What torchrun shows as the failure's traceback."""
        return self.traceback or self.message or "<N/A>"


@dataclass(frozen=True)
class Unreadable:
    reason: str


def read_error_file(path: str) -> RankError | Unreadable | None:
    """The decoded error file at `path`; None when there is none (the rank wrote nothing)."""
    if not path:
        return None
    try:
        data = _read_bounded(path)
    except FileNotFoundError:
        return None
    except OSError as error:
        return _refuse(f"cannot read it: {error.strerror or error}")
    if isinstance(data, Unreadable):
        return _refuse(data.reason)
    decoded = decode_error_json(data)
    return _refuse(decoded.reason) if isinstance(decoded, Unreadable) else decoded


def _refuse(reason: str) -> Unreadable:
    refusals[reason.split(" ", 1)[0]] += 1
    return Unreadable(reason)


def _open_rank_file(path: str) -> int:
    # O_NONBLOCK: a FIFO planted there must not block the daemon; O_NOFOLLOW: nor a link.
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def read_tail(path: str, max_bytes: int) -> bytes | None:
    """The last `max_bytes` of a regular file a rank writes (its stderr.log); None if absent,
    unreadable or not a regular file."""
    try:
        fd = _open_rank_file(path)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        return os.pread(fd, max_bytes, max(0, info.st_size - max_bytes))
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_bounded(path: str) -> bytes | Unreadable:
    try:
        fd = _open_rank_file(path)
    except OSError as error:
        if error.errno == errno.ELOOP:  # the last component is a symbolic link
            return Unreadable("a symbolic link (refused)")
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return Unreadable("not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            return Unreadable(f"larger than {MAX_FILE_BYTES // 1024} KiB ({info.st_size} bytes)")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:  # it grew while read
            return Unreadable(f"larger than {MAX_FILE_BYTES // 1024} KiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_error_json(data: bytes) -> RankError | Unreadable:
    """torch's error-file JSON from at most MAX_FILE_BYTES bytes; linear in its size."""
    if len(data) > MAX_FILE_BYTES:
        return Unreadable(f"larger than {MAX_FILE_BYTES // 1024} KiB")
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        return Unreadable("empty")
    if not nesting_within(text, MAX_DEPTH):
        return Unreadable(f"not JSON (unbalanced or nested deeper than {MAX_DEPTH})")
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        return Unreadable(f"not JSON ({str(error).splitlines()[0][:120]})")
    if not isinstance(document, dict) or "message" not in document:
        return Unreadable("no `message` field (not written by torch's @record)")
    message = document["message"]
    if isinstance(message, str):
        return RankError(_clip(message), "", _timestamp(document.get("timestamp")), None)
    if not isinstance(message, dict):
        return Unreadable(f"`message` is a JSON {type(message).__name__}, not text or object")
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    text_message = message.get("message")
    callstack = extra.get("py_callstack")
    code = message.get("errorCode")
    return RankError(
        _clip(text_message) if isinstance(text_message, str) else "",
        _tail(callstack) if isinstance(callstack, str) else "",
        _timestamp(extra.get("timestamp")),
        code
        if isinstance(code, int) and not isinstance(code, bool) and -256 < code < 256
        else None,
    )


def nesting_within(text: str, limit: int) -> bool:
    """Whether the brackets outside strings balance within `limit` levels: at most `limit`
    passes, each removing the innermost pairs (linear each; no recursion)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(limit):
        if not brackets:
            return True
        fewer = _PAIR.sub("", brackets)
        if fewer == brackets:
            return False
        brackets = fewer
    return not brackets


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def _tail(text: str) -> str:
    """The traceback as written, or its end if it is too long: the last lines name the error."""
    if len(text) <= MAX_TRACEBACK_CHARS and text.count("\n") <= MAX_TRACEBACK_LINES:
        return text
    kept = text[-MAX_TRACEBACK_CHARS:].splitlines()[-MAX_TRACEBACK_LINES:]
    return "\n".join(["(earlier lines cut)", *kept])


def _exit_code(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and -256 < value < 256:
        return value
    return None


def _timestamp(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 12:
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_TIMESTAMP:
        return value
    return None
