"""How clients find a daemon's API: `<run dir>/api.json` (the URL it really bound, the admin
socket, the token file), the admin unix socket itself, and this user's registry entry
(`ftd_client.discovery`). Each is best effort once the API listens: a file that cannot be
written costs clients a way to find the daemon, never the daemon its job."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from ftd_client import discovery

from ftd.status.persist import atomic_write

log = logging.getLogger("ftd.api")

API_FILE = "api.json"
SOCKET_FILE = "api.sock"
MAX_UNIX_PATH_BYTES = 100
"""sun_path holds 108 bytes with its terminator; leave room."""


class AdminSocketUnavailable(Exception):
    """The admin socket cannot be bound (why, for the one warning)."""


def admin_socket_path(run_dir: Path) -> Path:
    """`<run dir>/api.sock`, or a socket in this user's private registry directory when
    that path is too long for AF_UNIX."""
    path = run_dir.resolve() / SOCKET_FILE
    if len(os.fsencode(path)) <= MAX_UNIX_PATH_BYTES:
        return path
    directory = discovery.registry_dir()
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    short = directory / f"{digest}.sock"
    if len(os.fsencode(short)) > MAX_UNIX_PATH_BYTES:
        raise AdminSocketUnavailable(f"{path} and {short} are too long for a unix socket")
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        discovery.check_private_dir(directory)
    except (OSError, discovery.UnsafeFile) as error:
        raise AdminSocketUnavailable(f"{path} is too long for a unix socket and {error}") from None
    return short


def bind_admin_socket(path: Path) -> socket.socket:
    """A unix stream socket bound at `path`, mode 0600, not yet listening (nobody can connect
    before the mode is set). A stale socket there is replaced; a live one (another daemon on
    this run directory) or anything that is not a socket is left alone."""
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(existing.st_mode):
            raise AdminSocketUnavailable(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(os.fspath(path))
        except OSError:
            path.unlink(missing_ok=True)  # nobody listens: a daemon's leftover
        else:
            raise AdminSocketUnavailable(f"another process listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, 0o600)
    except OSError as error:
        sock.close()
        raise AdminSocketUnavailable(f"cannot bind {path}: {error}") from None
    return sock


def remove_socket(path: Path, inode: int) -> None:
    """Unlink the admin socket if it is still the one this daemon bound."""
    with contextlib.suppress(FileNotFoundError):
        if os.lstat(path).st_ino == inode:
            path.unlink()


def publish_api_file(path: Path, info: dict[str, Any]) -> bool:
    """Write api.json atomically (readers never see half of it; nothing is written through
    a link planted at its name or a temporary one); False, with a warning, when it cannot be
    written."""
    try:
        atomic_write(path, (json.dumps(info, indent=1) + "\n").encode(), durable=False)
    except OSError as error:
        log.warning("cannot write %s (clients will not find the API there): %s", path, error)
        return False
    return True


def register(record: dict[str, Any]) -> Path | None:
    """This daemon's entry in the user's registry; None, with a warning, when it cannot be
    written (`ftd status` without --run-dir will then not find this daemon)."""
    try:
        return discovery.register(record)
    except (OSError, discovery.UnsafeFile) as error:
        log.warning(
            "cannot register this daemon in %s (`ftd status` needs --run-dir then): %s",
            discovery.registry_dir(),
            error,
        )
        return None
