"""The failure summary printed when restarts run out, in torchrun's format."""

from __future__ import annotations

from pathlib import Path

from ftd.state import Failure, RankStatus


def failure_summary(
    name: str, root: Failure, others: list[RankStatus], error_files: dict[int, str]
) -> str:
    """torchrun's ChildFailedError report: root cause first, read from the ranks' error.json.

    `others` are the last attempt's other failed ranks. A failure that is no process exit
    (a hang, an operator's request) is shown with its reason instead of an exit code.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures: dict[int, ProcessFailure] = {}
    if root.global_rank is not None and root.exit_code is not None and root.pid is not None:
        failures[root.global_rank] = ProcessFailure(
            local_rank=root.local_rank or 0,
            pid=root.pid,
            exitcode=root.exit_code,
            error_file=root.error_file or "",
        )
    for status in others:
        if status.global_rank in failures or status.pid is None or status.exit_code is None:
            continue
        failures[status.global_rank] = ProcessFailure(
            local_rank=status.local_rank,
            pid=status.pid,
            exitcode=status.exit_code,
            error_file=error_files.get(status.local_rank, ""),
        )
    if not failures:
        bar = "=" * 60
        return f"{bar}\n{name} FAILED\n{'-' * 60}\nreason: {root.reason}\n{bar}"
    if root.global_rank in failures:
        # torchrun picks the root cause by the earliest error-file timestamp; ours is the
        # first exit the daemon observed, so pin it.
        failures[root.global_rank].timestamp = min(f.timestamp for f in failures.values()) - 1
    message: str = ChildFailedError(name, failures).format_msg()
    if root.kind not in ("exit", "signal"):
        message += f"\nreason: {root.reason}"
    if root.error_file and not Path(root.error_file).exists():
        tail = stderr_tail(Path(root.error_file).with_name("stderr.log"))
        if tail:
            message += f"\nthe last lines of rank {root.global_rank}'s stderr:\n{tail}"
    return message


def stderr_tail(path: Path, lines: int = 20, max_bytes: int = 8192) -> str:
    """The end of a rank's captured stderr (with -r/-t), for a failure with no error file."""
    try:
        with path.open("rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - max_bytes))
            data = file.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
