"""The job secret that signs the daemons' records: from a file or the environment, never from a
rank's environment (the daemon takes it out of its own before any rank or zygote starts)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, MutableMapping

from ftd.config import secrets as env_secrets

SECRET_ENV = "FTD_RDZV_SECRET"
SECRET_FILE_CONF = "secret_file"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096


class SecretError(ValueError):
    """The secret cannot be used: one line saying why and what to do."""


def load_secret(rdzv_conf: Mapping[str, str], environ: MutableMapping[str, str]) -> bytes | None:
    """`--rdzv-conf secret_file=PATH` (a regular file of this user's, mode 0600 or stricter),
    else FTD_RDZV_SECRET (kept by ftd.config.secrets since the daemon's re-exec, or in `environ`),
    else None (the store is open). FTD_RDZV_SECRET is removed from `environ` either way, so that
    no rank inherits it."""
    from_env = (env_secrets.get(SECRET_ENV) or environ.pop(SECRET_ENV, "")).strip()
    environ.pop(SECRET_ENV, None)
    path = rdzv_conf.get(SECRET_FILE_CONF, "").strip()
    if path:
        secret = read_private_file(path, f"rdzv_conf {SECRET_FILE_CONF}", MAX_SECRET_BYTES)
    elif from_env:
        secret = from_env.encode()
    else:
        return None
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise SecretError(
            f"the rendezvous secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes "
            f"(got {len(secret)}): e.g. `python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    return secret


def read_private_file(path: str, what: str, max_bytes: int) -> bytes:
    """The stripped content of `path`: a regular file of this user's that nobody else may read
    (mode 0600 or stricter), not a link; SecretError (saying `what`) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise SecretError(f"{what} {path!r}: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"{what} {path!r} is not a regular file")
        if info.st_uid != os.geteuid():
            raise SecretError(
                f"{what} {path!r} belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
            )
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"{what} {path!r} is readable by others "
                f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it"
            )
        return os.read(fd, max_bytes + 1).strip()
    finally:
        os.close(fd)
