"""--checkpoint-persist DIR as the ranks see it: its layout, its listing, and the rule for every
directory and file of it they write or read (docs/checkpoint.md "Persistence to disk").

Only this user's own entries are used: a directory or file that is a link, belongs to another
user or is writable by group or others is refused (another user who could plant a "newer" step
there would choose the job's next state). Everything written is 0700 (directories) and 0600
(files). The daemon checks DIR itself the same way before it names it (ftd/config/shared_paths.py).
"""

from __future__ import annotations

import itertools
import os
import re
import stat
from pathlib import Path

from ftd_client.checkpoint._errors import CheckpointError

MAX_LISTED = 10_000
"""Entries read from a directory of DIR at most (a listing is bounded, whatever DIR holds)."""
SKELETON = "ftd.skeleton"
INDEX = "ftd.index"
"""Where each tensor's bytes are in DCP's files (_skeleton.py's format): read instead of DCP's
`.metadata`, which is a pickle."""
METADATA = ".metadata"
DIR_MODE = 0o700
FILE_MODE = 0o600
_STEP = re.compile(r"step_(0|[1-9][0-9]{0,15})")


def world_dir(directory: str | Path, world: int) -> Path:
    return Path(directory) / f"w{world}"


def steps_of(directory: Path, rank: int) -> list[int]:
    """The steps of `rank` complete in `directory` (a DIR/w<world>), oldest first: only
    `step_<digits>` directories holding a `rank_<r>` with DCP's metadata, the skeleton and the
    index. (Whose they are is checked when one is read: a step refused then is named.)"""
    steps = []
    try:
        with os.scandir(directory) as entries:
            for entry in itertools.islice(entries, MAX_LISTED):
                name = _STEP.fullmatch(entry.name)
                if name is None or not entry.is_dir(follow_symlinks=False):
                    continue
                mine = Path(entry.path) / f"rank_{rank}"
                if all((mine / part).is_file() for part in (METADATA, SKELETON, INDEX)):
                    steps.append(int(name[1]))
    except OSError:
        return []
    return sorted(steps)


def refusal(info: os.stat_result, want_dir: bool) -> str | None:
    """Why an entry (lstat'ed or fstat'ed) is not one of this user's own, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if want_dir and not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if not want_dir and not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def check_dirs(*paths: Path) -> None:
    """Each of `paths` (never followed if a link) a directory of this user's only."""
    for path in paths:
        try:
            reason = refusal(os.lstat(path), want_dir=True)
        except OSError as error:
            raise CheckpointError(f"{path}: {error.strerror}") from None
        if reason is not None:
            raise CheckpointError(f"{path} is {reason}")


def open_private(path: Path) -> int:
    """A file of this user's only, opened for reading without following a link or waiting on
    a FIFO; its descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise CheckpointError(f"{path}: {error.strerror}") from None
    reason = refusal(os.fstat(fd), want_dir=False)
    if reason is not None:
        os.close(fd)
        raise CheckpointError(f"{path} is {reason}")
    return fd


def read_private(path: Path, limit: int) -> bytes:
    """The whole of a file of this user's only, of at most `limit` bytes."""
    fd = open_private(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{path} holds {size} bytes (at most {limit})")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    if len(data) != size:
        raise CheckpointError(f"{path} changed while it was read")
    return data


def make_private(tree: Path) -> None:
    """What DCP wrote under `tree` (with the process's umask) made 0700 / 0600; `tree` is this
    process's own 0700 directory, so nobody else could open an entry before this."""
    os.chmod(tree, DIR_MODE, follow_symlinks=False)
    with os.scandir(tree) as entries:
        for entry in itertools.islice(entries, MAX_LISTED):
            if entry.is_dir(follow_symlinks=False):
                make_private(Path(entry.path))
            elif not entry.is_symlink():
                os.chmod(entry.path, FILE_MODE)
