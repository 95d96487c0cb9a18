"""The node's memory directory for snapshots: its name (whose daemon made it), where it goes,
how much of the tmpfs it may hold, and the directories of daemons that died before their end."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

DEFAULT_BASE = Path("/dev/shm")
DIRECTORY_RECORD = "checkpoint.json"
"""The run directory's file that names the memory directory of the daemon that last ran there."""
PREFIX = "ftd-checkpoint-"
OWNED = re.compile(PREFIX + r"(?P<ns>\d{1,20})-(?P<pid>\d{1,10})-[A-Za-z0-9_]{1,32}")
"""The memory directory's name: the daemon's pid namespace and pid, then mkdtemp's letters."""
MAX_SCANNED = 10_000
"""Memory directories (by their name) looked at in one sweep."""
MAX_ENTRIES = 1_000_000
"""Entries of the tmpfs read in one sweep, whoever put them there (a name costs no stat)."""
AUTO_SHARE = 0.5
"""--checkpoint-memory auto: this share of the tmpfs's free space when the daemon starts."""


def remove_stale(run_dir: Path, base: Path) -> None:
    """Directories that daemons killed before their end left behind: this run's (named in
    its record), and any of this user's whose daemon, named in the directory's name with
    its pid namespace, is gone (memory a SIGKILL would otherwise hold until a reboot)."""
    try:
        record = json.loads((run_dir / DIRECTORY_RECORD).read_bytes()[:4096])
        stale = Path(record["directory"])
    except (OSError, ValueError, TypeError, KeyError):
        stale = None
    if stale is not None and stale.parent == base and stale.name.startswith(PREFIX):
        shutil.rmtree(stale, ignore_errors=True)
    for entry in _named_like_ours(base):
        owner = OWNED.fullmatch(entry.name)
        if owner is None or owner["ns"] != pid_namespace() or _alive(int(owner["pid"])):
            continue
        with contextlib.suppress(OSError):
            if (
                entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_uid == os.getuid()
            ):
                shutil.rmtree(entry.path, ignore_errors=True)


def _named_like_ours(base: Path) -> Iterator[os.DirEntry[str]]:
    """The entries of `base` named like a memory directory, read as a stream (what others
    put there is skipped by its name, never listed whole): at most MAX_SCANNED of them, and
    at most MAX_ENTRIES entries read in all."""
    try:
        with os.scandir(base) as entries:
            named = (e for e in itertools.islice(entries, MAX_ENTRIES) if e.name.startswith(PREFIX))
            yield from itertools.islice(named, MAX_SCANNED)
    except OSError:
        return


def owner_prefix() -> str:
    return f"{PREFIX}{pid_namespace()}-{os.getpid()}-"


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def auto_budget(base: Path) -> int:
    try:
        stats = os.statvfs(base)
    except OSError:
        return 0
    return int(stats.f_bavail * stats.f_frsize * AUTO_SHARE)


def open_slot(path: Path) -> int:
    """A read-only descriptor of the regular file of this user's at `path` (a rank's snapshot
    slot): never through a link, never blocking on a FIFO planted there (O_NONBLOCK, then
    fstat before any read); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, f"{path.name} is not a regular file")
        if info.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{path.name} belongs to uid {info.st_uid}")
    except OSError:
        os.close(fd)
        raise
    return fd
