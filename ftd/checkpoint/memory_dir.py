"""The node's memory directory for snapshots: its name (whose daemon made it), where it goes,
how much of the tmpfs it may hold, and the directories of daemons that died before their end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

DEFAULT_BASE = Path("/dev/shm")
DIRECTORY_RECORD = "checkpoint.json"
"""The run directory's file that names the memory directory of the daemon that last ran there."""
PREFIX = "ftd-checkpoint-"
OWNED = re.compile(PREFIX + r"(?P<ns>\d{1,20})-(?P<pid>\d{1,10})-[A-Za-z0-9_]{1,32}")
"""The memory directory's name: the daemon's pid namespace and pid, then mkdtemp's letters."""
MAX_SCANNED = 10_000
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
    namespace = pid_namespace()
    try:
        entries = list(os.scandir(base))[:MAX_SCANNED]
    except OSError:
        return
    for entry in entries:
        owner = OWNED.fullmatch(entry.name)
        if owner is None or owner["ns"] != namespace or _alive(int(owner["pid"])):
            continue
        with contextlib.suppress(OSError):
            if (
                entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_uid == os.getuid()
            ):
                shutil.rmtree(entry.path, ignore_errors=True)


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
