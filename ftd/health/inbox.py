"""Where the ranks' messages go once the door (ftd_client.wire) has read them.

The inbox resolves the connection's process to its rank (a rank, or a process it started),
counts the message for the loss watch and hands it to the handler of its record type. The table
is filled once, at construction, by the parts that handle messages (the health service, the
progress watch, the checkpoint holder: ftd/daemon.py assembles it); a kind no part handles is
refused with a countable cause, never an error inside the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ftd_client.protocol import ProtocolError
from ftd_client.wire import KINDS, Envelope, Message

from ftd import containment
from ftd.health.accounting import LossWatch
from ftd.health.links import Link, RankHealth
from ftd.health.messages import rank_of_process
from ftd.health.monitor import Monitor
from ftd.health.socket import Reply

Handler = Callable[[RankHealth, Link, Envelope, float], Reply | None]
"""One kind's handler: the rank, its connection, the message, when it was read (or sent)."""
RankAnswer = Callable[[int, Message], Reply | None]
"""A handler that needs only the rank's global rank (a part below the health layer)."""


def by_global_rank(answer: RankAnswer) -> Handler:
    return lambda rank, link, envelope, now: answer(rank.global_rank, envelope.message)


class Inbox:
    def __init__(
        self, monitor: Monitor, losses: LossWatch, handlers: Mapping[type[Message], Handler]
    ) -> None:
        self._monitor = monitor
        self._losses = losses
        self._handlers = {
            record: handlers.get(record) or _unhandled(record) for record in KINDS.values()
        }

    def __call__(self, link: Link, envelope: Envelope, now: float) -> Reply | None:
        rank = rank_of_process(self._monitor, link.pid)
        containment.inject("rank_messages")
        self._losses.received(rank, now)
        return self._handlers[type(envelope.message)](rank, link, envelope, now)


def _unhandled(record: type[Message]) -> Handler:
    kind = record.KIND

    def refuse(rank: RankHealth, link: Link, envelope: Envelope, now: float) -> Reply | None:
        if record.ANSWERED:
            return {"ok": False, "error": f"this daemon does not serve {kind!r} requests"}
        raise ProtocolError("unhandled", f"this daemon does not serve {kind!r} messages")

    return refuse
