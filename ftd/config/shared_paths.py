"""Directories the daemon's job writes its state into on a machine other users share
(--checkpoint-persist DIR; the memory tier's base on /dev/shm): the one check of such a path.

A directory another local user owns or can write to lets that user read what is put there and
plant entries the job would read back (a "newer" checkpoint, a link to follow). So a directory
is used only when it is a real directory (never reached through a link: lstat), belongs to this
user and is writable by nobody else; one that is missing is created 0700, with its missing
parents, and only below directories nobody else could rename it in. Checked as the run
directory is (rundir.py), but a refusal is a reason to say, not a start that fails: the caller
decides what refusing costs.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE = 0o700
GIVE_YOUR_OWN = "give a directory of your own"


class PathRefused(Exception):
    """A directory the job must not use; the message says why and what to do."""


def prepare_private_dir(path: Path, what: str, remedy: str = GIVE_YOUR_OWN) -> None:
    """Create `path` (and its missing parents, 0700) or check the existing one; PathRefused
    naming `what` (e.g. "--checkpoint-persist directory"), the reason and `remedy` otherwise.
    Nothing is created below a directory another user could tamper with, nor inside a refused
    one."""
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if missing:
        check_ancestors(missing[-1], what, path, remedy)
    for made in reversed(missing):
        try:
            os.mkdir(made, DIR_MODE)
        except FileExistsError:
            pass
        except OSError as error:
            raise PathRefused(f"{what} {path}: cannot create {made}: {error.strerror}") from None
    check_private_dir(path, what, remedy)
    check_ancestors(path, what, remedy=remedy)


def check_private_dir(path: Path, what: str, remedy: str = GIVE_YOUR_OWN) -> None:
    """`path` itself, not followed if a link: a directory of this user's that only it writes."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise PathRefused(f"{what} {path}: {error.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise PathRefused(f"{what} {path} is a symbolic link: give the real path")
    if not stat.S_ISDIR(info.st_mode):
        raise PathRefused(f"{what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise PathRefused(
            f"{what} {path} belongs to uid {info.st_uid}, not to this user ({os.geteuid()}): "
            f"its owner could read what is written there and plant what is read back; {remedy}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PathRefused(
            f"{what} {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): "
            f"`chmod go-w {path}`, or {remedy}"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise PathRefused(f"{what} {path} is not writable")


def check_ancestors(
    path: Path, what: str, named: Path | None = None, remedy: str = GIVE_YOUR_OWN
) -> None:
    """Whoever may rename entries of a directory above `path` could swap it for one of theirs:
    each must belong to this user or root and be writable by others only if sticky. (`named`:
    the directory to name, when `path` is the first of its missing parents.)"""
    me = os.geteuid()
    for parent in path.resolve().parents:
        try:
            info = os.stat(parent)
        except OSError as error:
            raise PathRefused(f"{what} {named or path}: {parent}: {error.strerror}") from None
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (me, 0) or shared:
            raise PathRefused(
                f"{parent} (above the {what} {named or path}) belongs to uid {info.st_uid} "
                f"with mode {stat.S_IMODE(info.st_mode):o}: another user could replace the "
                f"directory; {remedy} (under directories only you, or root, can change)"
            )
        if info.st_uid == 0:
            return  # root's, and not shared: nothing above it is anyone else's either
