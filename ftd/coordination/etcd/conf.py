"""What the etcd coordinator needs from `--rdzv-endpoint` and `--rdzv-conf`, parsed with bounds.

    --rdzv-backend etcd --rdzv-endpoint host1:2379,host2:2379,host3:2379
    --rdzv-conf cacert=ca.pem,cert=me.pem,key=me.key,username=ftd,password_file=pw,
                prefix=/team-a,lease_ttl=5,secret_file=job.secret

Names follow torchelastic's etcd rendezvous where it has one (`protocol`, `cacert`, `cert`,
`key`, `prefix`); `password_file` instead of a password (a 0600 file of this user's: a
password on the command line is visible to every user of the machine).
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError
from ftd.coordination.endpoint import parse_endpoint
from ftd.coordination.etcd.client import EtcdClient
from ftd.coordination.secret import SECRET_FILE_CONF, SecretError, read_private_file
from ftd.text import is_decimal

ETCD_PORT = 2379
MAX_ENDPOINTS = 64
MAX_PASSWORD_BYTES = 4096
MAX_LEASE_TTL_S = 3600
MIN_READ_TIMEOUT_S, MAX_READ_TIMEOUT_S = 0.5, 300.0
DEFAULT_READ_TIMEOUT_S = 5.0
ETCD_CONF = (
    "protocol",
    "cacert",
    "cert",
    "key",
    "username",
    "password_file",
    "prefix",
    "lease_ttl",
    "read_timeout",
    SECRET_FILE_CONF,
)
CLI_CONF = ("join_timeout", "last_call_timeout", "list_max")
"""Read by the CLI into --rdzv-join-timeout, --rdzv-last-call-timeout and the list's size."""
_PREFIX = re.compile(r"^(/[A-Za-z0-9._-]+)*$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:+-]{0,252}$")
_USERNAME = re.compile(r"^[^\s,=:]{1,128}$")


log = logging.getLogger("ftd.rendezvous")


@dataclass(frozen=True)
class EtcdConf:
    endpoints: tuple[str, ...]
    """Base URLs of the members, `http(s)://host:port`."""
    root: str
    """Every key of the job lives under it: `<prefix>/ftd/<rdzv id>/`."""
    lease_ttl_s: int
    timeout_s: float
    """The longest one etcd call takes (failover between members included)."""
    cacert: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    username: str | None = None
    password: str | None = None


def parse_etcd_conf(config: ServeConfig) -> EtcdConf:
    """The etcd settings of `config`; CoordinationError, one line, on anything out of bounds."""
    conf = config.rdzv_conf
    unknown = sorted(set(conf) - set(ETCD_CONF) - set(CLI_CONF))
    if unknown:
        raise CoordinationError(
            f"--rdzv-conf {unknown[0]}: not an option of the etcd backend "
            f"(it takes {', '.join(ETCD_CONF)})"
        )
    cacert, cert, key = (_file(conf, name) for name in ("cacert", "cert", "key"))
    if (cert is None) != (key is None):
        raise CoordinationError("--rdzv-conf cert and key: give both (a client certificate)")
    protocol = conf.get("protocol", "https" if cacert or cert else "http").lower()
    if protocol not in ("http", "https"):
        raise CoordinationError(f"--rdzv-conf protocol={protocol}: expected http or https")
    if protocol == "http" and (cacert or cert):
        raise CoordinationError("--rdzv-conf protocol=http: cacert, cert and key need https")
    username, password = _credentials(conf)
    if not _RUN_ID.match(config.run_id):
        raise CoordinationError(
            f"--rdzv-id {config.run_id!r}: the etcd backend needs letters, digits and ._@:+- "
            "(it is part of every key)"
        )
    prefix = conf.get("prefix", "").rstrip("/")
    if len(prefix) > 200 or not _PREFIX.match(prefix):
        raise CoordinationError(
            f"--rdzv-conf prefix={prefix!r}: expected /name[/name...] (letters, digits, ._-; "
            "at most 200 characters)"
        )
    return EtcdConf(
        endpoints=_endpoints(config.rdzv_endpoint, protocol),
        root=f"{prefix}/ftd/{config.run_id}/",
        lease_ttl_s=_lease_ttl(conf.get("lease_ttl"), config.node_keepalive_timeout_s),
        timeout_s=_read_timeout(conf.get("read_timeout")),
        cacert=cacert,
        cert=cert,
        key=key,
        username=username,
        password=password,
    )


def _endpoints(raw: str, protocol: str) -> tuple[str, ...]:
    items = [item.strip() for item in raw.split(",") if item.strip()]
    if not items:
        raise CoordinationError("--rdzv-endpoint: give the etcd members as host:port,host:port")
    if len(items) > MAX_ENDPOINTS:
        raise CoordinationError(f"--rdzv-endpoint: {len(items)} members, at most {MAX_ENDPOINTS}")
    urls: list[str] = []
    for item in items:
        if "://" in item:
            raise CoordinationError(
                f"--rdzv-endpoint {item!r}: expected host:port (the scheme comes from "
                "--rdzv-conf protocol, cacert, cert)"
            )
        host, port = parse_endpoint(item, ETCD_PORT)
        url = f"{protocol}://[{host}]:{port}" if ":" in host else f"{protocol}://{host}:{port}"
        if url in urls:
            raise CoordinationError(f"--rdzv-endpoint: {item} is given twice")
        urls.append(url)
    return tuple(urls)


def _file(conf: dict[str, str], name: str) -> Path | None:
    value = conf.get(name)
    if value is None:
        return None
    path = Path(value)
    if not value or not path.is_file() or not os.access(path, os.R_OK):
        raise CoordinationError(f"--rdzv-conf {name}={value}: not a readable file")
    return path


def _credentials(conf: dict[str, str]) -> tuple[str | None, str | None]:
    username, password_file = conf.get("username"), conf.get("password_file")
    if username is None and password_file is None:
        return None, None
    if username is None or password_file is None:
        raise CoordinationError(
            "--rdzv-conf username and password_file: give both (etcd's user and a 0600 file "
            "holding its password)"
        )
    if not _USERNAME.match(username):
        raise CoordinationError(
            f"--rdzv-conf username={username!r}: 1 to 128 characters, no spaces or ,=:"
        )
    try:
        raw = read_private_file(password_file, "rdzv_conf password_file", MAX_PASSWORD_BYTES)
    except SecretError as error:
        raise CoordinationError(str(error)) from None
    if not raw or len(raw) > MAX_PASSWORD_BYTES:
        raise CoordinationError(
            f"rdzv_conf password_file {password_file!r}: expected 1 to {MAX_PASSWORD_BYTES} bytes"
        )
    try:
        return username, raw.decode()
    except UnicodeDecodeError:
        raise CoordinationError(
            f"rdzv_conf password_file {password_file!r}: not UTF-8 text"
        ) from None


def _lease_ttl(raw: str | None, keepalive_timeout_s: float) -> int:
    if raw is None:
        return max(1, min(MAX_LEASE_TTL_S, math.ceil(keepalive_timeout_s)))
    if not is_decimal(raw) or not 1 <= int(raw) <= MAX_LEASE_TTL_S:
        raise CoordinationError(
            f"--rdzv-conf lease_ttl={raw}: a whole number of seconds in [1, {MAX_LEASE_TTL_S}]"
        )
    return int(raw)


def _read_timeout(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_READ_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not MIN_READ_TIMEOUT_S <= value <= MAX_READ_TIMEOUT_S:
        raise CoordinationError(
            f"--rdzv-conf read_timeout={raw}: seconds in [{MIN_READ_TIMEOUT_S:g}, "
            f"{MAX_READ_TIMEOUT_S:g}]"
        )
    return value


def open_client(
    conf: EtcdConf,
    max_response_bytes: int,
    on_endpoint_failed: Callable[[str, str], None] | None = None,
) -> EtcdClient:
    """The etcd client `conf` describes (not yet connected); CoordinationError naming the
    endpoint that cannot be used."""
    try:
        return EtcdClient(
            conf.endpoints,
            prefix=conf.root,
            username=conf.username,
            password=conf.password,
            cacert=conf.cacert,
            cert=conf.cert,
            key=conf.key,
            timeout_s=conf.timeout_s,
            max_response_bytes=max_response_bytes,
            on_endpoint_failed=on_endpoint_failed,
        )
    except ValueError as error:
        raise CoordinationError(f"--rdzv-endpoint: {error}") from None


def warn_unsigned(conf: EtcdConf) -> None:
    log.warning(
        "the job's keys in etcd (%s) are not signed: anyone who can write there can end or "
        "redirect this job. Give every node the same secret (FTD_RDZV_SECRET or --rdzv-conf "
        "secret_file=PATH), and etcd users (username, password_file)",
        conf.root,
    )
