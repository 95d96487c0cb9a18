"""Node liveness over etcd: a lease per daemon, and a watch on the alive keys it reports.

Each daemon holds one lease (TTL `lease_ttl`, by default --node-keepalive-timeout) and writes
its `alive/<node>`, join and status keys with it. When a daemon stops renewing (killed, frozen,
cut off), etcd deletes its keys once the TTL runs out, and every watcher sees the deletion at
once: no keepalive counters, no reading in a loop. As under the TCPStore backend, node rank 0
reports every other member of the round, the others report node rank 0. A node that finished
says so (`done`) before its keys go, and is not reported.

Each node watches only what it reports, from its round's closing revision: node rank 0 the
`alive/` prefix, the others node rank 0's key alone, and nobody before its first round. Every
node watching the whole prefix from its start was N² (each node's alive key sent to every
node as the job started: a million events at 1,024 nodes, and round 0 never formed within
etcd's read timeout, bench/SCALE.md).

While etcd has no leader it expires no lease, and a new leader gives every lease a fresh TTL,
so a quorum loss kills nobody: the keepalive goes on trying (`outlast_silence`). Only when etcd
itself says this daemon's lease is gone (the others saw it leave) is a new one granted; when
that fails within the TTL the daemon has lost the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ftd.coordination.base import CoordinationError, Report
from ftd.coordination.etcd.client import (
    EtcdBadAnswer,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    EventType,
    Get,
    KeyValue,
    Lease,
    Watch,
)
from ftd.coordination.etcd.kv import RecordKv
from ftd.coordination.records import AliveRecord
from ftd.status.event_kind import EventKind
from ftd.tasks import Background, within

log = logging.getLogger("ftd.coordination.liveness")

ALIVE = "alive/"
WATCH_IDLE_S = 11 * 60.0
"""Above etcd's default progress-notify interval (10 min): a quieter stream is a frozen member."""


def alive_key(node_id: str) -> str:
    return f"{ALIVE}{node_id}"


class EtcdLiveness:
    """This daemon's lease and the watch over the other members' alive keys."""

    def __init__(
        self,
        node_id: str,
        kv: RecordKv,
        ttl_s: int,
        on_dead: Callable[[str, str], None],
        on_lost: Callable[[str], None],
        report: Report,
    ) -> None:
        self.node_id = node_id
        self.kv = kv
        self.ttl_s = ttl_s
        self._on_dead = on_dead
        self._on_lost = on_lost
        self._report = report
        self._lease: Lease | None = None
        self._seq = time.time_ns() // 1000
        self._done: set[str] = set()
        self._watched: set[str] = set()
        self._since = 0
        self._scope: str | None = None
        """What the watch follows: ALIVE (a prefix: node rank 0), one node's alive key (the
        others), or None (no round yet)."""
        self._follower: asyncio.Task[None] | None = None
        self._granted = asyncio.Event()
        """Set as a lease is granted (`replaced` waits for it)."""
        self._declared: set[str] = set()
        self._tasks = Background()
        self._stopping = False

    @property
    def lease_id(self) -> int:
        assert self._lease is not None
        return self._lease.id

    async def start(self) -> None:
        """Grant the lease and write this node's alive key (the caller bounds and retries)."""
        await self._grant()
        self._tasks.spawn(self._keep(), "ftd-etcd-lease")

    async def _grant(self) -> None:
        lease = await self.kv.etcd.grant_lease(self.ttl_s, outlast_silence=True)
        try:
            await self._beat(lease.id, done=False)
        except BaseException:
            await lease.stop_keepalive()
            raise
        self._lease = lease
        self._granted.set()
        if lease.ttl_s != self.ttl_s:
            log.info("etcd gave this node's lease a TTL of %d s", lease.ttl_s)

    async def replaced(self, refused: int) -> int:
        """etcd refused a write under lease `refused`: it has it no more (it expired while
        this node's keepalives went unanswered; the others saw the node leave). The lease is
        replaced (`_keep`); the new one's id, within the TTL, or the store is lost."""
        lease = self._lease
        if lease is not None and lease.id == refused:
            lease.ended("etcd refused a write under it: it has no such lease")
        try:
            async with asyncio.timeout(self.ttl_s):
                while (lease := self._lease) is None or lease.id == refused:
                    self._granted.clear()
                    await self._granted.wait()
        except TimeoutError:
            raise CoordinationError(
                f"store lost: etcd ended this node's lease and no new one came within its TTL "
                f"of {self.ttl_s} s",
                "store_lost",
            ) from None
        return lease.id

    async def _beat(self, lease_id: int, done: bool) -> None:
        self._seq += 1
        await self.kv.put(alive_key(self.node_id), AliveRecord(seq=self._seq, done=done), lease_id)

    async def finish(self) -> None:
        """This node is done: the others will not report it when its keys go."""
        if self._lease is not None and not self._lease.lost:
            await self._beat(self._lease.id, done=True)

    async def close(self, revoke: bool) -> None:
        self._stopping = True
        await self._tasks.close()
        lease, self._lease = self._lease, None
        if lease is None:
            return
        if revoke:
            with contextlib.suppress(EtcdError):
                await lease.revoke()
        else:
            await lease.stop_keepalive()

    # -- this node's lease -------------------------------------------------------------------

    async def _keep(self) -> None:
        while True:
            lease = self._lease
            assert lease is not None
            reason = await lease.wait_lost()
            if self._stopping:
                return
            log.error(
                "etcd ended this node's lease (%s): the others saw this node leave; "
                "asking for a new one",
                reason,
            )
            try:
                await within(self._grant(), self.ttl_s)
            except (EtcdError, TimeoutError) as error:
                self._on_lost(
                    f"store lost: etcd ended this node's lease ({reason}) and no new one could "
                    f"be had within its TTL of {self.ttl_s} s ({error or 'no answer'})"
                )
                return
            self._report(
                EventKind.COORDINATION_LEASE_REPLACED, {"reason": reason, "lease": self.lease_id}
            )

    # -- the others' alive keys --------------------------------------------------------------

    def watch(self, nodes: list[str], since_revision: int) -> None:
        """Report these nodes from now on (a new round, closed at `since_revision`)."""
        self._watched = {node for node in nodes if node != self.node_id}
        self._declared = set()
        self._since = since_revision
        others = sorted(self._watched)
        scope = None if not others else alive_key(others[0]) if len(others) == 1 else ALIVE
        if scope is not None:
            self._tasks.spawn(self._confirm(scope), "ftd-etcd-confirm")
        if scope != self._scope:
            self._scope = scope
            if self._follower is not None:
                self._follower.cancel()
            self._follower = (
                None
                if scope is None
                else self._tasks.spawn(self._watch_alive(scope), "ftd-etcd-alive")
            )

    async def _confirm(self, scope: str) -> None:
        """A member without an alive key when its round closed is gone: read to make sure
        (the watch may not have delivered its key yet). One read of what this node watches:
        node rank 0's is one range over the prefix (a request per member was 1,023 requests
        at once, which starved its own lease's keepalive at 1,024 nodes)."""
        with contextlib.suppress(CoordinationError):  # stopping, or etcd refuses
            await self.kv.call(
                "read the members' alive keys", lambda: self._read_alive(scope), None
            )

    async def _watch_alive(self, scope: str) -> None:
        try:
            await self._follow_alive(scope)
        except CoordinationError as error:  # etcd refuses (permissions), or stopping
            if not self._stopping:
                self._on_lost(f"store lost: cannot watch the other nodes: {error.reason}")

    async def _follow_alive(self, scope: str) -> None:
        """From the round's closing revision (what went before it: `_confirm`), or, where etcd
        compacted that away, from a read of `scope` now."""
        start = self._since + 1
        while not self._stopping:
            watch = self.kv.etcd.watch(
                scope, prefix=scope == ALIVE, start_revision=start, idle_timeout_s=WATCH_IDLE_S
            )
            try:
                await self._follow(watch)
            except EtcdCompacted:
                revision, _ = await self.kv.call(
                    "read the alive keys", lambda: self._read_alive(scope), None
                )
                start = revision + 1
            finally:
                await watch.aclose()

    async def _read_alive(self, scope: str) -> tuple[int, None]:
        """Read `scope` now; a watched node whose key is gone, and that had not finished, is
        reported."""
        revision, (found,) = await self.kv.reads(Get(scope, prefix=scope == ALIVE))
        present = set()
        for kv in found.kvs:
            self._seen_put(kv)
            present.add(self._node_of(kv))
        for node in sorted(self._watched - present - self._done):
            self._declare(node)
        return revision, None

    async def _follow(self, watch: Watch) -> None:
        """Apply the watch's events, waiting out an absent etcd (the watch resumes where it
        stood when iterated again)."""
        while not self._stopping:
            try:
                async for event in watch:
                    self.kv.availability.answered()
                    if event.type is EventType.PUT:
                        self._seen_put(event.kv)
                    else:
                        self._seen_delete(event.kv)
            except (EtcdUnavailable, EtcdBadAnswer) as error:
                self.kv.availability.failed("watch the alive keys", error)
                await asyncio.sleep(1.0)  # back-off: etcd is away; the watch resumes

    def _node_of(self, kv: KeyValue) -> str:
        return kv.key.decode(errors="replace").removeprefix(ALIVE)

    def _seen_put(self, kv: KeyValue) -> None:
        record = self.kv.decode(kv, AliveRecord)
        if record is None:
            return  # logged by the codec; neither alive nor dead
        node = self._node_of(kv)
        if record.done:
            self._done.add(node)
        else:
            self._done.discard(node)

    def _seen_delete(self, kv: KeyValue) -> None:
        node = self._node_of(kv)
        if node in self._watched and node not in self._done and kv.mod_revision >= self._since:
            self._declare(node)

    def _declare(self, node: str) -> None:
        if node in self._declared:
            return
        self._declared.add(node)
        reason = f"node {node} lost: no keepalive for {self.ttl_s}s (its etcd lease expired)"
        log.error("%s", reason)
        self._on_dead(node, reason)
