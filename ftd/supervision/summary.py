"""The failure summary printed when restarts run out, in torchrun's format (ChildFailedError's),
built from the ranks' error files as ftd.ranks.error_file decodes them: a file a rank left
unreadable
is named with its reason, never handed to torch."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from ftd import containment
from ftd.ranks.error_file import RankError, Unreadable, read_error_file, read_tail
from ftd.status.model import Failure, NodeStatus, RankStatus
from ftd.supervision.policy import CANNOT_HELP, NO_RESTARTS_LEFT, NOT_RESTARTED
from ftd.text import escape

log = logging.getLogger("ftd.summary")

NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
NOT_AVAILABLE = "<N/A>"
MAX_WIDTH = 60
NO_ERROR_FILE = "exited before writing an error file: see the output above"
"""The cause of a rank that died before torch's error file existed (an interpreter that could
not find its module) when its stderr went to the terminal of `ftd serve`, not to a file."""
CAUSE_LINES = 8
MAX_CAUSE_CHARS = 2000


@dataclass(frozen=True)
class RankFailure:
    """One failed rank as the summary shows it."""

    global_rank: int
    local_rank: int
    pid: int
    exit_code: int
    error_file: str
    """The path shown (`<N/A>` when the rank wrote none)."""
    traceback: str
    timestamp: float
    """When the rank failed: the moment it wrote its error file (the file's time, to the
    millisecond, where it agrees with the whole second torch records in it), else when the
    daemon saw it exit."""


def rank_failure(
    global_rank: int,
    local_rank: int,
    pid: int,
    exit_code: int,
    error_file: str,
    exited_at: float | None = None,
) -> RankFailure:
    """What torch's ProcessFailure would hold, from our decoder instead of json.load.
    `exited_at`: when the daemon saw the rank exit."""
    decoded = read_error_file(error_file)
    shown_file, timestamp, traceback = NOT_AVAILABLE, None, ""
    if isinstance(decoded, RankError):
        shown_file, timestamp = error_file, _written_at(error_file, decoded.timestamp)
        traceback = decoded.shown if (decoded.message or decoded.traceback) else ""
    elif isinstance(decoded, Unreadable):
        log.warning(
            "rank %d's error file %s is unreadable: %s", global_rank, error_file, decoded.reason
        )
        shown_file = f"{error_file} (unreadable: {decoded.reason})"
        traceback = f"error file unreadable: {decoded.reason}"
    if not traceback:
        traceback = (
            f"Signal {-exit_code} ({_signal_name(exit_code)}) received by PID {pid}"
            if exit_code < 0
            else NO_TRACEBACK
        )
    return RankFailure(
        global_rank,
        local_rank,
        pid,
        exit_code,
        shown_file,
        traceback,
        timestamp if timestamp is not None else exited_at if exited_at else time.time(),
    )


def failure_cause(failure: Failure) -> str | None:
    """What the job said of a rank's failure, escaped and bounded: the exception its error
    file names, else the last lines of its stderr (captured with -r/-t), else that it exited
    before writing an error file (its stderr went to the terminal above). None for a failure
    that is no rank's exit (a hang, a request: the reason says it) or a rank killed by a
    signal that left nothing."""
    try:
        return _cause(failure)
    except Exception as error:  # a bug of ours: supervision goes on without the cause
        containment.record("summary", error)
        return None


def _cause(failure: Failure) -> str | None:
    if failure.kind not in ("exit", "signal") or not failure.error_file:
        return None
    decoded = read_error_file(failure.error_file)
    if isinstance(decoded, RankError) and decoded.message:
        return escape(decoded.message, MAX_CAUSE_CHARS, lines=True)
    captured = Path(failure.error_file).with_name("stderr.log")
    tail = stderr_tail(captured, CAUSE_LINES)
    if tail.strip():
        return escape(tail.strip(), MAX_CAUSE_CHARS, lines=True)
    if isinstance(decoded, Unreadable):
        return escape(f"error file unreadable: {decoded.reason}", MAX_CAUSE_CHARS)
    if failure.kind != "exit":
        return None
    if captured.exists():  # its last lines may still be on their way from the pipe
        return escape(f"exited before writing an error file: see {captured}", MAX_CAUSE_CHARS)
    return NO_ERROR_FILE


def final_cause(status: NodeStatus) -> str | None:
    """The last failure's cause read as the job ends: the attempt is over and its ranks'
    output all written (at the failure itself, the last stderr lines may still have been in
    the pipe)."""
    failure = status.last_failure
    return None if failure is None else failure_cause(failure) or failure.cause


def _written_at(error_file: str, recorded: int | None) -> float | None:
    """When the error file was written: its modification time where that falls in the
    second torch recorded in it (torch keeps whole seconds, cut down: shown as they are, a
    failure at 53.9 s reads 53 s while the daemon's log says 54 s), else the recorded
    second."""
    if recorded is None:
        return None
    try:
        written = os.stat(error_file).st_mtime
    except OSError:
        return float(recorded)
    return written if recorded <= written < recorded + 1 else float(recorded)


def ending_headline(reason: str) -> str:
    """The job's last line for a failed end whose decision said `reason`: restarts exhausted
    only when they were; a rank's request to stop (NVRx ShutdownWorkload, a workload-control
    message) named as such; any other end (a fatal reason, another node's decision) as a
    failure without a restart."""
    if CANNOT_HELP in reason:
        why = reason.split(CANNOT_HELP, 1)[1]
        return f"the job failed and was not restarted: restarting cannot help: {escape(why, 300)}"
    if NOT_RESTARTED in reason:
        request = reason.split(NOT_RESTARTED, 1)[1]
        return f"the job failed and was not restarted, as a rank asked: {escape(request, 300)}"
    if NO_RESTARTS_LEFT in reason:
        return "restarts exhausted, the job failed"
    return "the job failed and was not restarted"


def failure_summary(
    name: str, root: Failure, others: list[RankStatus], error_files: dict[int, str]
) -> str:
    """torchrun's ChildFailedError report: root cause first, read from the ranks' error.json.

    `others` are the last attempt's other failed ranks. A failure that is no process exit
    (a hang, an operator's request) is shown with its reason instead of an exit code. Every
    text that came from the job is escaped (ftd.text).
    """
    failures: dict[int, RankFailure] = {}
    root_unreadable = False
    if root.global_rank is not None and root.exit_code is not None and root.pid is not None:
        first = rank_failure(
            root.global_rank,
            root.local_rank or 0,
            root.pid,
            root.exit_code,
            root.error_file or "",
            root.timestamp or None,
        )
        if first.traceback == NO_TRACEBACK:  # no error file: what the rank said instead
            cause = failure_cause(root) or root.cause  # read now: the output is all written
            first = replace(first, traceback=cause) if cause else first
        failures[root.global_rank] = first
        root_unreadable = first.traceback.startswith("error file unreadable")
    for status in others:
        if status.global_rank in failures or status.pid is None or status.exit_code is None:
            continue
        failures[status.global_rank] = rank_failure(
            status.global_rank,
            status.local_rank,
            status.pid,
            status.exit_code,
            error_files.get(status.local_rank, ""),
            status.ended_at,
        )
    if not failures:
        bar = "=" * MAX_WIDTH
        return escape(f"{bar}\n{name} FAILED\n{'-' * 60}\nreason: {root.reason}\n{bar}", lines=True)
    # torchrun picks the root cause by the earliest error-file timestamp; ours is the first
    # exit the daemon observed, so it is pinned.
    root_rank = root.global_rank if root.global_rank in failures else None
    if root_rank is None:
        root_rank = min(failures, key=lambda rank: failures[rank].timestamp)
    message = format_failures(name, failures, root_rank)
    if root.kind not in ("exit", "signal"):
        message += f"\nreason: {root.reason}"
    if root.error_file and root_unreadable:
        tail = stderr_tail(Path(root.error_file).with_name("stderr.log"))
        if tail:
            message += f"\nthe last lines of rank {root.global_rank}'s stderr:\n{tail}"
    return escape(message, lines=True)


def format_failures(name: str, failures: dict[int, RankFailure], root_rank: int) -> str:
    """torch's ChildFailedError.format_msg, line for line."""
    host = socket.getfqdn()
    title = f"{name} FAILED"
    width = len(title)
    root_text, others = "", []
    for index, (rank, failure) in enumerate(failures.items()):
        text = _format_failure(index, rank, failure, host)
        width = max(width, *(len(line) for line in text.split("\n")))
        if rank == root_rank:
            root_text = text
        else:
            others.append(text)
    width = min(width, MAX_WIDTH)
    return "\n".join(
        [
            "",
            "=" * width,
            title,
            "-" * width,
            "Failures:",
            "\n".join(others or ["  <NO_OTHER_FAILURES>"]),
            "-" * width,
            "Root Cause (first observed failure):",
            root_text,
            "=" * width,
        ]
    )


def _format_failure(index: int, rank: int, failure: RankFailure, host: str) -> str:
    signal_name = _signal_name(failure.exit_code)
    shown_signal = f" ({signal_name})" if signal_name != NOT_AVAILABLE else ""
    # torch's whole second where that is all there is; else the millisecond we know
    precision = "milliseconds" if failure.timestamp % 1 else "seconds"
    when = datetime.fromtimestamp(failure.timestamp).isoformat(sep="_", timespec=precision)
    return "\n".join(
        [
            f"[{index}]:",
            f"  time      : {when}",
            f"  host      : {host}",
            f"  rank      : {rank} (local_rank: {failure.local_rank})",
            f"  exitcode  : {failure.exit_code} (pid: {failure.pid}) {shown_signal}",
            f"  error_file: {failure.error_file}",
            "  traceback : " + failure.traceback.replace("\n", "\n  "),
        ]
    )


def _signal_name(exit_code: int) -> str:
    if exit_code >= 0:
        return NOT_AVAILABLE
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return NOT_AVAILABLE


def stderr_tail(path: Path, lines: int = 20, max_bytes: int = 8192) -> str:
    """The end of a rank's captured stderr (with -r/-t), for a failure with no error file."""
    data = read_tail(str(path), max_bytes)
    return "" if data is None else "\n".join(data.decode(errors="replace").splitlines()[-lines:])
