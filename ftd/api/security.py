"""Who may use the API: the bearer token (from FTD_API_TOKEN or a private file, checked at
start), the parsing of `Authorization`, and the Host check that keeps web pages (DNS
rebinding) off an API that listens on loopback only."""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from ftd_client.discovery import NO_ACCESS_BY_OTHERS, UnsafeFile, read_checked

from ftd.config import secrets as env_secrets
from ftd.errors import ApiStartupError
from ftd.text import is_decimal

log = logging.getLogger("ftd.api")

TOKEN_ENV = "FTD_API_TOKEN"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 1024
LOOPBACK_NAMES = frozenset({"localhost"})


def token_problem(token: str) -> str | None:
    """Why `token` cannot be an API token (None when it can): it travels in a header, so it
    is visible ASCII without spaces, and it is long enough not to be guessed."""
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        return f"a token has {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters, not {len(token)}"
    if not all("!" <= char <= "~" for char in token):
        return "a token is visible ASCII characters without spaces"
    return None


def load_token(path: Path) -> tuple[str, bool]:
    """(token, whether it came from FTD_API_TOKEN). Else the token in `path`, which must be
    a private file of this user (created with a random token, mode 0600, when absent).
    ApiStartupError naming the problem otherwise."""
    env = env_secrets.get(TOKEN_ENV).strip()
    if env:
        if problem := token_problem(env):
            raise ApiStartupError(f"${TOKEN_ENV}: {problem}")
        return env, True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as error:
        raise ApiStartupError(f"cannot create the API token file {path}: {error}") from None
    else:
        token = secrets.token_urlsafe(32)
        try:
            with os.fdopen(fd, "w") as file:
                file.write(token + "\n")
        except OSError as error:  # a full disk: no empty token file is left for the next start
            path.unlink(missing_ok=True)
            raise ApiStartupError(
                f"cannot write the API token file {path}: {error.strerror or error}"
            ) from None
        log.info("created the API token file %s", path)
        return token, False
    try:
        token = read_checked(path, NO_ACCESS_BY_OTHERS, max_bytes=MAX_TOKEN_CHARS + 64).strip()
    except UnsafeFile as error:
        raise ApiStartupError(f"the API token file: {error}") from None
    except OSError as error:
        raise ApiStartupError(f"cannot read the API token file {path}: {error}") from None
    if not token:
        raise ApiStartupError(f"the API token file {path} is empty: delete it or put a token in it")
    if problem := token_problem(token):
        raise ApiStartupError(f"the API token file {path}: {problem}")
    return token, False


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None when the header is not
    that (another scheme, no token, bytes that are not visible ASCII)."""
    scheme, _, token = header.strip(" ").partition(" ")
    token = token.strip(" ")
    if scheme.lower() != "bearer" or not token or not all("!" <= c <= "~" for c in token):
        return None
    return token


def is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str | None:
    """The host of a Host header (lowercase; no port, brackets or final dot); None when the
    value is not a host with an optional port."""
    value = header.strip().lower()
    if not value.isascii() or not value:
        return None
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and is_decimal(rest[1:]))):
            return None
        return host
    name, colon, port = value.rpartition(":")
    if colon:
        if not is_decimal(port):
            return None
        value = name
    if ":" in value or not value:
        return None
    return value.rstrip(".")


@dataclass(frozen=True)
class HostPolicy:
    """The Host headers a TCP request may carry. An API that listens on loopback only
    answers requests addressed to loopback (or to the name --api-host gave it): a web page
    whose name was rebound to 127.0.0.1 sends its own name and is refused. An API that
    listens beyond loopback requires the token for reads, so any Host will do."""

    names: frozenset[str] | None
    """Allowed host names besides loopback addresses; None: any Host."""

    @classmethod
    def for_bind(cls, api_host: str, bound: list[str]) -> HostPolicy:
        if not bound or not all(is_loopback(address) for address in bound):
            return cls(None)
        names = set(LOOPBACK_NAMES)
        try:
            ipaddress.ip_address(api_host)
        except ValueError:
            names.add(api_host.lower().rstrip("."))
        return cls(frozenset(names))

    @property
    def loopback_only(self) -> bool:
        return self.names is not None

    def allows(self, headers: list[str]) -> bool:
        if self.names is None:
            return True
        for header in headers:  # none at all: an HTTP/1.0 client, which no browser is
            host = host_of(header)
            if host is None:
                return False
            if host not in self.names and not _is_loopback_address(host):
                return False
        return True


def _is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
