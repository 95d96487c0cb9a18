"""The run directory: where the daemon writes, and what it refuses to write into.

A directory another local user can write to (or owns) lets that user plant links and files the
daemon would follow or trust (status.json, events.jsonl, api.token, ft_state.json). So the run
directory must belong to the daemon's user and be writable by nobody else; directories the
daemon creates are 0700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ftd.errors import StartupError

DIR_MODE = 0o700


def prepare_run_dir(run_dir: Path) -> None:
    """Create `run_dir` (and missing parents, 0700) or check the existing one: owned by this
    user, not writable by group or others. StartupError saying why otherwise."""
    missing: list[Path] = []
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if missing:  # nothing is created inside a directory another user could tamper with
        check_ancestors(missing[-1], run_dir)
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
        except OSError as error:
            raise StartupError(f"cannot create {path}: {error.strerror}") from None
    check_private_dir(run_dir)
    check_ancestors(run_dir)


def check_private_dir(path: Path) -> None:
    try:
        info = os.lstat(path)
    except OSError as error:
        raise StartupError(f"run directory {path}: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise StartupError(f"run directory {path} is a symbolic link: give the real path")
    if not stat.S_ISDIR(info.st_mode):
        raise StartupError(f"run directory {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise StartupError(
            f"run directory {path} belongs to uid {info.st_uid}, not to this user "
            f"({os.geteuid()}): another user could plant files there; use a --log-dir of "
            "your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StartupError(
            f"run directory {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"`chmod go-w {path}` or use another --log-dir"
        )


def check_ancestors(run_dir: Path, named: Path | None = None) -> None:
    """Whoever may rename entries of a directory above the run directory could swap it for a
    link: each must belong to this user or root, and be writable by others only if sticky.
    (`named`: the run directory to name, when `run_dir` is the first of its missing parents.)"""
    me = os.geteuid()
    for path in run_dir.resolve().parents:
        try:
            info = os.stat(path)
        except OSError as error:
            raise StartupError(f"{path}: {error.strerror}") from None
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (me, 0) or shared:
            where = named or run_dir
            raise StartupError(
                f"{path} (above the run directory {where}) belongs to uid {info.st_uid} "
                f"with mode {stat.S_IMODE(info.st_mode):o}: another user could replace the "
                "run directory; use a --log-dir of your own"
            )
        if info.st_uid == 0:
            return  # root's, and not shared: nothing above it is anyone else's either
