"""EtcdClient: the calls ftd makes to etcd v3, over its gRPC-JSON gateway with aiohttp."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import aiohttp

from ftd.coordination.etcd.client.errors import EtcdBadAnswer, EtcdError, GrpcCode
from ftd.coordination.etcd.client.lease import Lease, revoke_lease
from ftd.coordination.etcd.client.records import (
    Compare,
    Delete,
    Get,
    KeyValue,
    Put,
    RangeResult,
    TxnOp,
    TxnResult,
    as_key,
)
from ftd.coordination.etcd.client.transport import Credentials, Transport, parse_endpoints
from ftd.coordination.etcd.client.watch import Watch
from ftd.coordination.etcd.client.wire import (
    DeleteRangeResponse,
    LeaseGrantResponse,
    Namespace,
    PutResponse,
    RangeResponse,
    TxnResponse,
)

DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
READ_RETRIES = 5
"""Tries of a several-key read whose revision etcd compacted between its ranges."""
MAX_TTL_S = 9_000_000_000


class EtcdClient:
    """An asyncio etcd v3 client (`async with EtcdClient([...]) as etcd:`).

    `endpoints`: the members, `host:port` or `http(s)://host:port`; every call fails over
    between them. `prefix`: every key lives under it (callers never see it). `username` and
    `password`: etcd's auth (a token is fetched and renewed as needed). `cacert`, `cert`,
    `key`: TLS (server verification, client certificate). `timeout_s`: the longest any call
    (all its tries together) takes before EtcdUnavailable. `max_response_bytes`: the largest
    answer (and watch line) read; more is an EtcdBadAnswer."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        prefix: bytes | str = b"",
        username: str | None = None,
        password: str | None = None,
        cacert: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        timeout_s: float = 5.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        on_endpoint_failed: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_endpoint_failed`: told (endpoint, reason) when a member did not answer."""
        self._on_endpoint_failed = on_endpoint_failed
        tls = cacert is not None or cert is not None
        self.endpoints = parse_endpoints(endpoints, tls=tls)
        if (username is None) != (password is None):
            raise ValueError("etcd auth needs both a username and a password")
        if (cert is None) != (key is None):
            raise ValueError("a TLS client certificate needs both cert and key")
        if not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s must be in (0, 3600], not {timeout_s}")
        if max_response_bytes < 1024:
            raise ValueError(f"max_response_bytes must be at least 1024, not {max_response_bytes}")
        self._namespace = Namespace(as_key(prefix))
        self._credentials = (
            None if username is None or password is None else Credentials(username, password)
        )
        self._tls_files = (cacert, cert, key)
        self._timeout_s = timeout_s
        self._max_response_bytes = max_response_bytes
        self._session: aiohttp.ClientSession | None = None
        self._transport: Transport | None = None
        self._leases: set[Lease] = set()

    async def __aenter__(self) -> EtcdClient:
        context = await asyncio.to_thread(self._ssl_context)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context if context is not None else True),
            auto_decompress=False,
            trust_env=False,
        )
        self._transport = Transport(
            self.endpoints,
            self._session,
            timeout_s=self._timeout_s,
            credentials=self._credentials,
            max_response_bytes=self._max_response_bytes,
            on_endpoint_failed=self._on_endpoint_failed,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stops every keepalive (leases are left to expire: revoke them first to end them
        now) and closes the connections."""
        for lease in list(self._leases):
            await lease.stop_keepalive()
        self._leases.clear()
        if self._session is not None:
            await self._session.close()

    def _ssl_context(self) -> ssl.SSLContext | None:
        cacert, cert, key = self._tls_files
        if cacert is None and cert is None:
            return None
        context = ssl.create_default_context(cafile=str(cacert) if cacert else None)
        if cert is not None and key is not None:
            context.load_cert_chain(str(cert), str(key))
        return context

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            raise RuntimeError("use EtcdClient as `async with EtcdClient(...) as etcd`")
        return self._transport

    async def get(self, key: bytes | str) -> KeyValue | None:
        """The key's current value (a linearizable read), None when it does not exist."""
        answer = await self.transport.call(
            "/v3/kv/range", self._namespace.range(key, False), RangeResponse, mutation=False
        )
        if len(answer.kvs) > 1:
            raise EtcdBadAnswer(f"etcd answered {len(answer.kvs)} keys for one key")
        return self._namespace.record(answer.kvs[0]) if answer.kvs else None

    async def get_prefix(self, prefix: bytes | str) -> RangeResult:
        """Every key that starts with `prefix`, in key order, and the revision they were read
        at."""
        answer = await self.transport.call(
            "/v3/kv/range", self._namespace.range(prefix, True), RangeResponse, mutation=False
        )
        return self._namespace.range_result(answer, answer.header.revision)

    async def read(self, gets: Sequence[Get]) -> tuple[int, tuple[RangeResult, ...]]:
        """Several keys or prefixes as they were at one revision: the revision, the results in
        order. Ranges side by side; any read at another revision than the largest range's (the
        newest of the largest) is read again pinned to it: a prefix of every node's record is
        read once, never again for a key written meanwhile (the cluster view's 1.2 MB range at
        1,024 nodes was read again whenever a small range beside it came at a newer revision,
        as it does while nodes write). Not a transaction of gets: etcd before 3.5.5
        panics when the client of a read-only transaction goes away before the answer
        (etcd-io/etcd#14110), and a call that times out or a daemon that stops does exactly
        that; a range just ends."""
        if not gets:
            raise ValueError("read needs at least one key")
        for _ in range(READ_RETRIES):
            results = list(await asyncio.gather(*(self._range(g, None) for g in gets)))
            revision = max(results, key=lambda r: (len(r.kvs), r.revision)).revision
            stale = [i for i, r in enumerate(results) if r.revision != revision]
            try:
                again = await asyncio.gather(*(self._range(gets[i], revision) for i in stale))
            except EtcdError as error:
                if error.code != GrpcCode.OUT_OF_RANGE:
                    raise
                continue  # compacted meanwhile: read again at the present
            for i, result in zip(stale, again, strict=True):
                results[i] = result
            return revision, tuple(results)
        raise EtcdBadAnswer(f"etcd compacted every revision read {READ_RETRIES} times in a row")

    async def _range(self, get: Get, revision: int | None) -> RangeResult:
        body = self._namespace.range(get.key, get.prefix, get.limit)
        if revision is not None:
            body["revision"] = str(revision)
        answer = await self.transport.call("/v3/kv/range", body, RangeResponse, mutation=False)
        if not get.prefix and len(answer.kvs) > 1:
            raise EtcdBadAnswer(f"etcd answered {len(answer.kvs)} keys for one key")
        at = answer.header.revision if revision is None else revision
        return self._namespace.range_result(answer, at)

    async def put(self, key: bytes | str, value: bytes, lease: Lease | int | None = None) -> int:
        """Write the key (with the lease, when given: it vanishes with the lease); the new
        revision."""
        body = self._namespace.put(key, value, _lease_id(lease))
        answer = await self.transport.call("/v3/kv/put", body, PutResponse, mutation=True)
        return answer.header.revision

    async def delete(self, key: bytes | str, *, prefix: bool = False) -> int:
        """Delete the key (or every key under it); how many were deleted."""
        answer = await self.transport.call(
            "/v3/kv/deleterange",
            self._namespace.range(key, prefix),
            DeleteRangeResponse,
            mutation=True,
        )
        return answer.deleted

    async def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[TxnOp] = (),
        failure: Sequence[TxnOp] = (),
    ) -> TxnResult:
        """If every compare holds, run `success`, else `failure`, atomically. A transaction
        without a put or a delete is refused: use `read` (see there why)."""
        if not any(isinstance(op, Put | Delete) for op in (*success, *failure)):
            raise ValueError("a read-only transaction: use EtcdClient.read")
        body: dict[str, object] = {
            "compare": [self._namespace.compare(item) for item in compare],
            "success": [self._namespace.op(op) for op in success],
            "failure": [self._namespace.op(op) for op in failure],
        }
        answer = await self.transport.call("/v3/kv/txn", body, TxnResponse, mutation=True)
        ops = success if answer.succeeded else failure
        if len(answer.responses) != len(ops):
            raise EtcdBadAnswer(
                f"a transaction answered {len(answer.responses)} results for {len(ops)} ops"
            )
        revision = answer.header.revision
        results = tuple(
            self._namespace.op_result(op, response, revision)
            for op, response in zip(ops, answer.responses, strict=True)
        )
        return TxnResult(answer.succeeded, revision, results)

    async def grant_lease(self, ttl_s: int, *, outlast_silence: bool = False) -> Lease:
        """A new lease, renewed in the background until it is revoked, its keepalive is
        stopped, or the client closes. Watch `Lease.lost` to learn that it ended;
        `outlast_silence`: see Lease."""
        if isinstance(ttl_s, bool) or not 1 <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"a lease TTL is a whole number of seconds >= 1, not {ttl_s!r}")
        granted_at = time.monotonic()
        # Tried anywhere: a lease granted twice (an answer lost) only expires unused.
        answer = await self.transport.call(
            "/v3/lease/grant", {"TTL": str(ttl_s)}, LeaseGrantResponse, mutation=False
        )
        if answer.error or answer.TTL < 1:
            raise EtcdBadAnswer(f"etcd granted no lease: {answer.error or answer.TTL}")
        lease = Lease(
            self.transport, answer.ID, answer.TTL, granted_at, outlast_silence=outlast_silence
        )
        self._leases.add(lease)
        task = lease.start_keepalive()
        task.add_done_callback(lambda _: self._leases.discard(lease))
        return lease

    async def revoke(self, lease: Lease | int) -> None:
        """End the lease (this client's, or any by id) now: its keys vanish at once."""
        if isinstance(lease, Lease):
            await lease.revoke()
        else:
            await revoke_lease(self.transport, lease)

    def watch(
        self,
        key: bytes | str,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        prev_kv: bool = False,
        idle_timeout_s: float | None = None,
    ) -> Watch:
        """Changes to the key (or every key under it) from `start_revision` (default: from
        now), as `async with etcd.watch(k) as events: async for event in events`.
        `idle_timeout_s`: reconnect when a stream says nothing for that long (the member may
        be frozen); set it above the server's --experimental-watch-progress-notify-interval
        (10 min by default), since a quiet key is otherwise silent."""
        return Watch(
            self.transport,
            self._namespace,
            key,
            prefix=prefix,
            start_revision=start_revision,
            prev_kv=prev_kv,
            idle_timeout_s=idle_timeout_s,
        )


def _lease_id(lease: Lease | int | None) -> int | None:
    return lease.id if isinstance(lease, Lease) else lease
