"""Where a user's running daemons are, and when a file that says so can be believed.

Each `ftd serve` with its API on registers itself in a private directory of its user
(`$XDG_RUNTIME_DIR/ftd/`, else `<tmp>/ftd-<uid>/`, mode 0700): one 0600 JSON file naming its
pid, run directory and admin socket, removed when it stops. A daemon killed without a
chance to clean up leaves its file behind; readers skip entries whose process is gone (the
pid *and* its start time must match, so a reused pid does not count).

Files found in shared places (a run directory under /tmp, say) are hostile until checked:
owned by this user, a regular file, not writable (secrets: not readable) by anyone else,
and small. Standard library only: the daemon and `ftd status` share this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REGISTRY_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024
NO_ACCESS_BY_OTHERS = 0o077
"""Mode bits a secret must not have (group and others: nothing)."""
NO_WRITE_BY_OTHERS = 0o022
"""Mode bits a record others may read must not have (group and others: no writing)."""


class UnsafeFile(Exception):
    """A file or directory that cannot be trusted (wrong owner, mode or type); `str()` says
    which and what to do."""


def read_checked(
    path: str | os.PathLike[str], forbidden_mode: int, max_bytes: int = MAX_RECORD_BYTES
) -> str:
    """The text of `path`, a regular file owned by this user without any `forbidden_mode`
    bit, at most `max_bytes` long. UnsafeFile when it is not; OSError when it cannot be read
    (FileNotFoundError when it does not exist)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise UnsafeFile(
                f"{path} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}): "
                "refusing to trust it"
            )
        if info.st_mode & forbidden_mode:
            raise UnsafeFile(
                f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, open to other users: "
                f"refusing to trust it (chmod {0o777 & ~forbidden_mode & ~0o111:o} {path})"
            )
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, max_bytes + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise UnsafeFile(f"{path} is larger than {max_bytes} bytes")
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise UnsafeFile(f"{path} is not UTF-8 text") from None


def check_private_dir(path: Path) -> None:
    """UnsafeFile unless `path` is a directory (not a link) of this user that others cannot
    enter."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFile(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise UnsafeFile(f"{path} is owned by uid {info.st_uid}, not by this user")
    if info.st_mode & NO_ACCESS_BY_OTHERS:
        raise UnsafeFile(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: it must be 0700 (chmod 700 {path})"
        )


def registry_dir() -> Path:
    """This user's registry of running daemons (it may not exist yet)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        return Path(runtime) / "ftd"
    return Path(tempfile.gettempdir()) / f"ftd-{os.geteuid()}"


_UCRED = struct.Struct("3i")


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected unix socket, from
    the kernel (SO_PEERCRED): taken when it connected, not claimed by it. OSError."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None
    when there is no such process. With the pid it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class DaemonEntry:
    """One registered daemon, as parsed from its registry file."""

    pid: int
    started: int
    run_dir: str
    node_id: str
    run_id: str
    socket: str | None
    url: str | None
    path: Path

    @classmethod
    def parse(cls, text: str, path: Path) -> DaemonEntry:
        """ValueError naming the problem when `text` is not a registry entry."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != REGISTRY_VERSION:
            raise ValueError(f"not a version {REGISTRY_VERSION} registry entry")
        pid, started = raw.get("pid"), raw.get("started")
        if not isinstance(pid, int) or not 0 < pid < 2**31 or not isinstance(started, int):
            raise ValueError("pid/started: expected integers")
        texts: dict[str, str | None] = {}
        for name in ("run_dir", "node_id", "run_id", "socket", "url"):
            value = raw.get(name)
            if value is not None and not (isinstance(value, str) and 0 < len(value) <= 4096):
                raise ValueError(f"{name}: expected a string")
            texts[name] = value
        run_dir = texts["run_dir"]
        if run_dir is None or not os.path.isabs(run_dir):
            raise ValueError("run_dir: expected an absolute path")
        return cls(
            pid=pid,
            started=started,
            run_dir=run_dir,
            node_id=texts["node_id"] or "?",
            run_id=texts["run_id"] or "?",
            socket=texts["socket"],
            url=texts["url"],
            path=path,
        )

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.started

    def describe(self) -> str:
        return f"{self.run_dir} (node {self.node_id}, run {self.run_id}, pid {self.pid})"


def running_daemons(directory: Path | None = None) -> list[DaemonEntry]:
    """This user's registered daemons that still run, oldest registration first; [] when
    the registry does not exist. UnsafeFile when the registry directory is not private.
    Files that are not valid entries are skipped."""
    directory = directory or registry_dir()
    try:
        check_private_dir(directory)
    except FileNotFoundError:
        return []
    entries: list[tuple[float, DaemonEntry]] = []
    for path in directory.glob("*.json"):
        try:
            entry = DaemonEntry.parse(read_checked(path, NO_ACCESS_BY_OTHERS), path)
            registered = path.stat().st_mtime
        except (OSError, UnsafeFile, ValueError):
            continue
        if entry.alive():
            entries.append((registered, entry))
    return [entry for _, entry in sorted(entries, key=lambda item: item[0])]


def register(record: dict[str, Any], directory: Path | None = None) -> Path:
    """Write this process's entry (`run_dir`, `node_id`, `run_id`, `socket`, `url`) into the
    registry, creating it 0700 when absent; entries of processes that are gone are removed.
    The entry's path; OSError or UnsafeFile when it cannot be written."""
    directory = directory or registry_dir()
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    check_private_dir(directory)
    _remove_stale(directory)
    pid = os.getpid()
    started = process_start_time(pid)
    if started is None:
        raise UnsafeFile(f"cannot read /proc/{pid}/stat")
    entry = {"version": REGISTRY_VERSION, "pid": pid, "started": started, **record}
    path = directory / f"{pid}-{secrets.token_hex(4)}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")
    tmp.replace(path)
    return path


def _remove_stale(directory: Path) -> None:
    for path in directory.glob("*.json"):
        try:
            entry = DaemonEntry.parse(read_checked(path, NO_ACCESS_BY_OTHERS), path)
        except (OSError, UnsafeFile, ValueError):
            continue  # not ours to judge
        if not entry.alive():
            path.unlink(missing_ok=True)
