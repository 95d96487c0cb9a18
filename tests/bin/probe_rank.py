"""A rank that looks at what it was given and at its ancestors, writes it to --out/<rank>.json
and exits: the socket paths in its environment (is each one served: does it connect? whose is
its directory, with what mode?) and the initial environment (/proc/<pid>/environ) of every
ancestor up to and including the daemon, and of the daemon's other children (the zygote, the
orphan guard)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
from pathlib import Path

SOCKETS = {
    "FTD_SOCKET": socket.SOCK_SEQPACKET,
    "FT_RANK_MONITOR_IPC_SOCKET": socket.SOCK_STREAM,
    "FT_LAUNCHER_IPC_SOCKET": socket.SOCK_STREAM,
}


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as file:
        return int(file.read().rsplit(b")", 1)[1].split()[1])


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return [word.decode(errors="replace") for word in file.read().split(b"\0")]


def environ(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as file:
        return file.read().decode(errors="replace")


def served(path: str, kind: socket.SocketKind) -> bool:
    with socket.socket(socket.AF_UNIX, kind) as sock:
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def socket_report() -> dict[str, object]:
    report: dict[str, object] = {}
    for name, kind in SOCKETS.items():
        path = os.environ.get(name)
        if path is None:
            continue
        directory = os.stat(os.path.dirname(path))
        report[name] = {
            "path": path,
            "served": served(path, kind),
            "dir_uid": directory.st_uid,
            "dir_mode": stat.S_IMODE(directory.st_mode),
        }
    return report


def ancestry() -> dict[str, dict[str, str]]:
    """pid -> {role, environ} for the ancestors up to the daemon and the daemon's children."""
    seen: dict[str, dict[str, str]] = {}
    pid = parent(os.getpid())
    while pid > 1:
        words = cmdline(pid)
        is_daemon = "ftd" in words and "serve" in words
        seen[str(pid)] = {"role": "daemon" if is_daemon else "ancestor", "environ": environ(pid)}
        if is_daemon:
            break
        pid = parent(pid)
    else:
        raise SystemExit("no ftd serve among this rank's ancestors")
    daemon = pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry in seen or int(entry) == os.getpid():
            continue
        try:
            if parent(int(entry)) == daemon:
                role = " ".join(cmdline(int(entry)))[:200]
                seen[entry] = {"role": role, "environ": environ(int(entry))}
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report = {"sockets": socket_report(), "processes": ancestry()}
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{os.environ['RANK']}.json"
    target.with_suffix(".tmp").write_text(json.dumps(report))
    target.with_suffix(".tmp").rename(target)


if __name__ == "__main__":
    main()
