"""The inbox (issue 42 item 2): every kind the door reads reaches the handler of its record type,
from a table filled at construction; a kind no part handles is refused (a request answered
`ok: false`, a one-way message dropped and counted as `unhandled`), never an internal error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ftd_client.protocol import ProtocolError
from ftd_client.wire import KINDS, Envelope

from ftd.config.ft import FaultToleranceConfig
from ftd.health.accounting import LossWatch
from ftd.health.inbox import Inbox
from ftd.health.links import Link, RankHealth
from ftd.health.service import HealthService
from ftd.status.events import EventLog
from tests.support.wire import read


async def test_each_record_type_goes_to_its_handler(tmp_path: Path) -> None:
    service = HealthService(FaultToleranceConfig(), tmp_path / "s", tmp_path / "st", EventLog(None))
    service.monitor.attach([(0, 0, os.getpid())])
    seen: list[str] = []

    def handler(rank: RankHealth, link: Link, envelope: Envelope, now: float) -> None:
        seen.append(envelope.message.KIND)

    inbox = Inbox(
        service.monitor, LossWatch(EventLog(None)), dict.fromkeys(KINDS.values(), handler)
    )
    for kind in ("hb", "ckp", "st"):
        inbox(Link(1, os.getpid()), read({"t": kind}), 1.0)
    assert seen == ["hb", "ckp", "st"]
    with pytest.raises(ProtocolError) as refused:  # no rank of this daemon: refused, counted
        inbox(Link(2, 1), read({"t": "hb"}), 1.0)
    assert refused.value.cause == "not_a_rank"
    service.monitor.detach()


async def test_a_kind_no_part_handles_is_refused_not_raised(tmp_path: Path) -> None:
    """A daemon assembled without the memory tier's handlers (as a test or a future daemon
    might be): its ranks' `ck*` requests are answered no; a `cks` is dropped, counted."""
    service = HealthService(FaultToleranceConfig(), tmp_path / "s", tmp_path / "st", EventLog(None))
    service.monitor.attach([(0, 0, os.getpid())])
    link = Link(1, os.getpid())
    reply = service.inbox(link, read({"t": "ckr", "world": 1}), 1.0)
    assert reply == {"ok": False, "error": "this daemon does not serve 'ckr' requests"}
    with pytest.raises(ProtocolError) as refused:
        service.inbox(link, read({"t": "cks", "step": 1}), 1.0)
    assert refused.value.cause == "unhandled"
    service.monitor.detach()
