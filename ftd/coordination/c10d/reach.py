"""Reaching the c10d rendezvous store at start: host it where the endpoint is this machine's,
else probe it until a store answers, every wait bounded by --rdzv-join-timeout and each failed
try told to the board (`Reaching`)."""

from __future__ import annotations

import asyncio
import logging

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError
from ftd.coordination.endpoint import is_local, probe_store
from ftd.coordination.progress import Reaching
from ftd.tasks import within
from ftd.tcpstore.server import TcpStoreServer

log = logging.getLogger("ftd.rendezvous")


async def reach_store(
    config: ServeConfig, endpoint: tuple[str, int], describe: str, reaching: Reaching
) -> tuple[TcpStoreServer | None, float]:
    """The store this node hosts (None: another node's answered a probe), and the deadline
    (the loop's clock) left for c10d's own client to connect."""
    host, port = endpoint
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.rdzv_join_timeout_s
    is_host = config.rdzv_conf.get("is_host", "").lower()
    want_host = is_host in ("1", "true", "yes")
    if is_host == "" and not want_host:  # a name lookup: off the loop, within the deadline
        try:
            want_host = await within(
                asyncio.to_thread(is_local, host, config.local_addr or ""),
                max(0.0, deadline - loop.time()),
            )
        except TimeoutError:
            raise CoordinationError(
                f"--rdzv-endpoint {host}:{port}: the name did not resolve within "
                "--rdzv-join-timeout",
                "store_lost",
            ) from None
    server = None
    if want_host:
        bind = config.rdzv_conf.get("host", host)
        try:
            server = await TcpStoreServer.start(bind, port)
            log.info("hosting the rendezvous store on %s:%d", bind, port)
        except Exception as error:  # someone listens there already: be a client
            if is_host in ("1", "true", "yes"):
                raise CoordinationError(
                    f"cannot host the store on {bind}:{port}: {error}"
                ) from None
            log.debug("not hosting the store (%s); connecting", error)
    # The wait for the store has the whole join timeout; the local work before it (the
    # hosting attempt) does not eat into it.
    deadline = loop.time() + config.rdzv_join_timeout_s
    if server is None:
        log.info(
            "connecting to the rendezvous store at %s (up to --rdzv-join-timeout, %.0f s)",
            describe.removeprefix("store "),
            config.rdzv_join_timeout_s,
        )
        await probe_store(host, port, deadline, reaching.failed)
    return server, deadline
