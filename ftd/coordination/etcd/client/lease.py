"""A granted lease and its keepalive: a task of its own that renews the lease every third of
its TTL, retries sooner after a failure, and stops (saying why) once the lease is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ftd.coordination.etcd.client.errors import AttemptFailed, EtcdError, GrpcCode
from ftd.coordination.etcd.client.transport import Transport, parse
from ftd.coordination.etcd.client.wire import (
    KeepAliveLine,
    LeaseKeepAliveResult,
    LeaseRevokeResponse,
)

log = logging.getLogger("ftd.etcd")

MIN_RETRY_S = 0.02


def next_renewal(now: float, *, renewed_at: float, ttl_s: float, failed: bool) -> float | None:
    """When to send the next keepalive, or None once the lease has expired. `renewed_at` is
    when the last keepalive that etcd answered was sent (the lease runs `ttl_s` from then);
    `failed`: the last attempt got no answer. Pure, so property tests hold it to this."""
    expires_at = renewed_at + ttl_s
    if now >= expires_at:
        return None
    if not failed:
        return max(now, renewed_at + ttl_s / 3)
    return now + max(min(ttl_s / 6, (expires_at - now) / 2), MIN_RETRY_S)


async def revoke_lease(transport: Transport, lease_id: int) -> None:
    """Revoke a lease by id (tried on any member: revoking twice is harmless); a lease etcd
    no longer has is fine."""
    try:
        await transport.call(
            "/v3/lease/revoke", {"ID": str(lease_id)}, LeaseRevokeResponse, mutation=False
        )
    except EtcdError as error:
        if error.code != GrpcCode.NOT_FOUND:
            raise


class Lease:
    """A lease etcd granted: `id`, `ttl_s` (etcd may raise a TTL to its minimum). Keys put with
    it vanish `ttl_s` after the last renewal. `lost` is set, with `lost_reason`, when the lease
    expired or was revoked; the keepalive then stops. `gone`: etcd itself said so (not only
    silence past the TTL).

    `outlast_silence`: when no member answers for longer than the TTL, go on trying instead of
    declaring the lease lost; etcd expires no lease while it has no leader, and a new leader
    gives every lease a fresh TTL, so after a quorum loss the lease is usually still there.
    Only etcd's own answer (expired, revoked) then ends it."""

    def __init__(
        self,
        transport: Transport,
        lease_id: int,
        ttl_s: int,
        granted_at: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        outlast_silence: bool = False,
    ) -> None:
        self.id = lease_id
        self.ttl_s = ttl_s
        self.renewed_at = granted_at
        self.renewals = 0
        self.lost_reason: str | None = None
        self.gone = False
        self.outlast_silence = outlast_silence
        self._transport = transport
        self._clock = clock
        self._lost = asyncio.Event()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"Lease(id={self.id:#x}, ttl_s={self.ttl_s})"

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    @property
    def expires_at(self) -> float:
        """The monotonic time the lease ends unless renewed (as this client can know it)."""
        return self.renewed_at + self.ttl_s

    async def wait_lost(self) -> str:
        """Wait until the lease is lost; the reason."""
        await self._lost.wait()
        assert self.lost_reason is not None
        return self.lost_reason

    def start_keepalive(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._keepalive(), name=f"etcd-lease-{self.id:x}")
        return self._task

    async def stop_keepalive(self) -> None:
        """Stop renewing (a renewal under way is abandoned): the lease, and its keys, expire
        `ttl_s` after the last renewal."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    async def revoke(self) -> None:
        """End the lease now: its keys vanish at once. A lease etcd no longer has is fine."""
        await self.stop_keepalive()
        await revoke_lease(self._transport, self.id)
        self.gone = True
        self._mark_lost("revoked")

    def ended(self, reason: str) -> None:
        """etcd said, answering another request, that it has this lease no more: stop
        renewing it, and it is lost."""
        self.gone = True
        self._stop.set()
        self._mark_lost(reason)

    def _mark_lost(self, reason: str) -> None:
        if not self.lost:
            self.lost_reason = reason
            self._lost.set()

    async def _keepalive(self) -> None:
        try:
            await self._renew_until_stopped_or_lost()
        except Exception as error:  # a bug here must not pass for a healthy lease
            log.exception("etcd lease %#x: the keepalive failed", self.id)
            self._lose(f"its keepalive failed: {error!r}")

    async def _renew_until_stopped_or_lost(self) -> None:
        failed = False
        while not self._stop.is_set():
            now = self._clock()
            due = next_renewal(now, renewed_at=self.renewed_at, ttl_s=self.ttl_s, failed=failed)
            if due is None and self.outlast_silence:
                due = now + max(self.ttl_s / 6, MIN_RETRY_S)
            elif due is None:
                self._lose(f"no keepalive answered within its TTL of {self.ttl_s} s")
                return
            try:
                async with asyncio.timeout(due - now):
                    await self._stop.wait()
                return
            except TimeoutError:
                pass
            sent_at = self._clock()
            try:
                ttl_s = await self._renew()
            except EtcdError as error:
                if not failed:
                    log.warning("etcd lease %#x: keepalive failed (%s); retrying", self.id, error)
                failed = True
                continue
            if ttl_s <= 0:
                self.gone = True
                self._lose("etcd says it expired or was revoked")
                return
            if failed:
                log.info("etcd lease %#x: renewed again", self.id)
            failed = False
            self.renewed_at, self.ttl_s = sent_at, ttl_s
            self.renewals += 1

    def _lose(self, reason: str) -> None:
        log.warning("etcd lease %#x lost: %s", self.id, reason)
        self._mark_lost(reason)

    async def _renew(self) -> int:
        """One keepalive (any member may answer); the TTL etcd gave, <= 0 when it is gone."""
        expires_at = self.expires_at

        async def attempt(endpoint: str, budget_s: float) -> LeaseKeepAliveResult:
            body: dict[str, object] = {"ID": str(self.id)}
            stream = await self._transport.open_stream(
                endpoint, "/v3/lease/keepalive", body, budget_s
            )
            try:
                async with asyncio.timeout(budget_s):
                    line = parse(KeepAliveLine, await stream.line())
            except TimeoutError:
                raise AttemptFailed(f"no answer within {budget_s:.2f} s", sent=True) from None
            finally:
                stream.close()
            if line.error is not None:
                raise self._transport.stream_error(endpoint, line.error)
            if line.result is None or line.result.ID not in (0, self.id):
                reason = "a keepalive answer for another lease"
                raise AttemptFailed(reason, sent=True, bad_answer=True)
            return line.result

        budget_s = expires_at - self._clock()
        if self.outlast_silence:
            budget_s = max(budget_s, self.ttl_s / 3)
        answer = await self._transport.failover(attempt, mutation=False, timeout_s=budget_s)
        return answer.TTL
