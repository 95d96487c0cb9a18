"""Multi-node membership over c10d's TCPStore: rounds, liveness, restart requests, exclusion.

Every key lives under `ftd/<rdzv id>/` (a PrefixStore), so jobs sharing a store never meet.
Only the store's atomic operations are used (add, compare_set, wait, multi_get); there is no
consensus of our own. Keys, `r<N>/...` belonging to round N:

  round                 the newest round (a counter moved on by compare_set)
  restarts              cluster-wide restarts counted against --max-restarts (add)
  r<N>/joined           join counter: the n-th joiner writes r<N>/node/<n>
  r<N>/closed           the round's members in node-rank order (compare_set: one closer wins)
  r<N>/master           host:port of the workers' store, hosted by node rank 0's daemon
  r<N>/request          the one request that ends the round: restart, fail or succeed
  r<N>/succeeded, r<N>/unhealthy   counters for the end of a job and --restart-policy min-healthy
  alive/<node>          keepalive counter; DONE_MARK added once a node has finished
  status/<node>         a small summary for GET /v1/cluster
  excluded, excluded/<node>   the excluded nodes (a JSON object) and one key per node

A round costs O(N) store operations: each node adds, sets, waits and reads once; the closer
reads the N join records with one multi_get. Liveness is checked by node rank 0 (every member)
and by the others (node rank 0 only): O(N) reads per keepalive interval for the whole cluster.
A restart request wakes every daemon through a blocking `wait` in a thread of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftd.config import ServeConfig
from ftd.launch import Placement

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

log = logging.getLogger("ftd.rendezvous")

DONE_MARK = 1 << 40
"""Added to a node's keepalive counter when it has finished: not dead, just done."""
STORE_TIMEOUT_S = 30.0
WAIT_CHUNK_S = 1.0
WATCH_CHUNK_S = 3600.0
KEEPALIVE_OP_MIN_TIMEOUT_S = 5.0
"""A keepalive that takes longer means the store is unreachable (a closed connection is
noticed at once: the watcher's wait fails)."""


class RendezvousError(Exception):
    """The node cannot take part in the job any more; `reason` says why (shown as is)."""

    def __init__(self, reason: str, code: str = "failed") -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code  # failed | excluded | store_lost | stopped


@dataclass(frozen=True)
class Member:
    node_id: str
    addr: str
    nproc: int


@dataclass(frozen=True)
class Round:
    number: int
    members: tuple[Member, ...]
    restarts: int
    group_rank: int

    @property
    def node_ids(self) -> list[str]:
        return [m.node_id for m in self.members]

    def placement(self, master_addr: str, master_port: int) -> Placement:
        return Placement(
            group_rank=self.group_rank,
            group_world_size=len(self.members),
            base_global_rank=sum(m.nproc for m in self.members[: self.group_rank]),
            world_size=sum(m.nproc for m in self.members),
            master_addr=master_addr,
            master_port=master_port,
        )


@dataclass(frozen=True)
class ClusterRequest:
    """What ends a round for every node: `restart`, `fail` or `succeed`, and why."""

    action: str
    reason: str
    by: str
    counted: bool = False
    nonce: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes) -> ClusterRequest:
        return cls(**json.loads(raw))


def order_members(joined: list[Member], previous: list[str]) -> list[Member]:
    """Node ranks: nodes of the previous round keep their order, newcomers follow by id."""
    rank = {node: i for i, node in enumerate(previous)}
    return sorted(joined, key=lambda m: (rank.get(m.node_id, len(rank)), m.node_id))


def _endpoint(config: ServeConfig) -> tuple[str, int]:
    host, _, port = (config.rdzv_endpoint or "127.0.0.1:29400").rpartition(":")
    if not host:
        host, port = port, "29400"
    return host.strip("[]"), int(port)


def _is_local(host: str, local_addr: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", local_addr, socket.gethostname()):
        return True
    try:
        return socket.gethostbyname(host) in ("127.0.0.1", local_addr)
    except OSError:
        return False


def host_store(host: str, port: int, timeout_s: float = STORE_TIMEOUT_S) -> TCPStore:
    from torch.distributed import TCPStore

    return TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=True,
    )


def connect_store(host: str, port: int, timeout_s: float = STORE_TIMEOUT_S) -> TCPStore:
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True
    )


class CountingStore:
    """A PrefixStore that counts the operations it sends (the benchmark's O(N) check)."""

    def __init__(self, store: TCPStore, prefix: str, counter: list[int]) -> None:
        from torch.distributed import PrefixStore

        self.raw = store
        self._store: Store = PrefixStore(prefix, store)
        self._counter = counter

    def _count(self) -> None:
        self._counter[0] += 1

    def add(self, key: str, amount: int) -> int:
        self._count()
        return int(self._store.add(key, amount))

    def set(self, key: str, value: str) -> None:
        self._count()
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        self._count()
        return bytes(self._store.get(key))

    def check(self, keys: list[str]) -> bool:
        self._count()
        return bool(self._store.check(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._count()
        return bytes(self._store.compare_set(key, expected, desired))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._count()
        return [bytes(v) for v in self._store.multi_get(keys)]

    def delete_key(self, key: str) -> bool:
        self._count()
        return bool(self._store.delete_key(key))

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        """Whether the keys exist within the timeout; DistNetworkError when the store is gone."""
        from torch.distributed import DistNetworkError, DistStoreError

        self._count()
        try:
            self._store.wait(keys, timedelta(seconds=timeout_s))
        except DistNetworkError:
            raise
        except DistStoreError:
            return False
        return True


class Rendezvous:
    """One daemon's view of the job's membership; the daemon drives it round by round."""

    def __init__(self, config: ServeConfig, on_dead: Callable[[str, str], None]) -> None:
        self.config = config
        self.node_id = config.node_id
        self.addr = config.local_addr or config.master_addr or socket.gethostname()
        self.endpoint = _endpoint(config)
        self.ops = [0]
        """Store operations sent by this daemon (all connections)."""
        self.hosting = False
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.round: Round | None = None
        self.excluded: dict[str, str] = {}
        self._on_dead = on_dead
        self._master: TCPStore | None = None
        self._store: CountingStore | None = None
        self._keepalive_store: CountingStore | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ftd-rdzv")
        self._ka_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ftd-ka")
        self._closing = threading.Event()
        self._keepalive_task: asyncio.Task[None] | None = None
        self._keepalive_stopped = False
        self._watched: dict[str, tuple[int, float]] = {}
        self._declared: set[str] = set()
        self._done = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- plumbing ----------------------------------------------------------------------------

    @property
    def prefix(self) -> str:
        return f"ftd/{self.config.run_id}/"

    def _connect(self) -> CountingStore:
        host, port = self.endpoint
        return CountingStore(connect_store(host, port), self.prefix, self.ops)

    async def _call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> Any:
        """A blocking store call on the rendezvous thread; store loss becomes RendezvousError."""
        from torch.distributed import DistError

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(self._pool, fn, *args), timeout_s or STORE_TIMEOUT_S * 2
            )
        except (DistError, TimeoutError) as error:
            self._mark_lost(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            raise RendezvousError(self.lost_reason, "store_lost") from None

    def finishing(self) -> None:
        """The job is over for this node: a store that goes away now is no loss."""
        self._closing.set()

    def _mark_lost(self, why: str) -> None:
        if not self.lost.is_set() and not self._closing.is_set():
            host, port = self.endpoint
            self.lost_reason = f"store lost: the rendezvous store at {host}:{port} is gone ({why})"
            log.error("%s", self.lost_reason)
            self.lost.set()

    @property
    def store(self) -> CountingStore:
        assert self._store is not None
        return self._store

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Host the store when this node should (or connect to it), then start the keepalive."""
        self._loop = asyncio.get_running_loop()
        host, port = self.endpoint
        is_host = self.config.rdzv_conf.get("is_host", "").lower()
        want_host = is_host in ("1", "true", "yes") or (
            is_host == "" and _is_local(host, self.addr)
        )
        if want_host:
            try:
                self._master = await asyncio.to_thread(host_store, host, port)
                self.hosting = True
                log.info("hosting the rendezvous store on %s:%d", host, port)
            except Exception as error:  # someone listens there already: be a client
                if is_host in ("1", "true", "yes"):
                    raise RendezvousError(
                        f"cannot host the store on {host}:{port}: {error}"
                    ) from None
                log.debug("not hosting the store (%s); connecting", error)
        try:
            self._store = await asyncio.to_thread(self._connect)
            self._keepalive_store = await asyncio.to_thread(self._connect)
        except Exception as error:
            raise RendezvousError(
                f"cannot reach the rendezvous store at {host}:{port}: {error}", "store_lost"
            ) from None
        await self._call(self.store.add, f"alive/{self.node_id}", 1)
        self.excluded = await self._call(self._read_excluded)
        self._keepalive_task = asyncio.create_task(self._keepalive(), name="ftd-keepalive")

    async def close(self) -> None:
        self._closing.set()
        if self._keepalive_task is not None:
            # The flag, not only the cancel: Python 3.11's wait_for drops a cancellation that
            # lands as the store call completes, and the loop would go on for ever.
            self._keepalive_stopped = True
            self._keepalive_task.cancel()
            await asyncio.gather(self._keepalive_task, return_exceptions=True)
        if not self.lost.is_set() and self._store is not None and not self._done:
            try:  # leaving: not dead, so nobody waits a keepalive timeout for this node
                await asyncio.wait_for(
                    asyncio.to_thread(self.store.add, f"alive/{self.node_id}", DONE_MARK), 2
                )
            except Exception:
                log.debug("could not mark this node done", exc_info=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ka_pool.shutdown(wait=False, cancel_futures=True)
        master, self._master = [self._master], None
        await asyncio.to_thread(master.clear)

    # -- rounds ------------------------------------------------------------------------------

    async def next_round(self) -> Round:
        """Join the next round and return it once closed; RendezvousError when this node cannot
        (excluded, too few nodes within the join timeout, the job is over, the store is lost)."""
        deadline = time.monotonic() + self.config.rdzv_join_timeout_s
        rnd: Round = await self._call(self._join, deadline, timeout_s=1e9)
        self.round = rnd
        self._watched = {}
        self._declared = set()
        watched = rnd.node_ids[1:] if rnd.group_rank == 0 else rnd.node_ids[:1]
        now = time.monotonic()
        self._watched = {n: (-1, now) for n in watched if n != self.node_id}
        return rnd

    def _k(self, number: int, key: str) -> str:
        return f"r{number}/{key}"

    def _join(self, deadline: float) -> Round:
        s = self.store
        number = s.add("round", 0)
        me = Member(self.node_id, self.addr, self.config.nproc_per_node)
        cfg = self.config
        while True:
            if self._closing.is_set():
                raise RendezvousError("the daemon is stopping", "stopped")
            if s.check([f"excluded/{self.node_id}"]):
                reason = s.get(f"excluded/{self.node_id}").decode()
                raise RendezvousError(
                    f"node {self.node_id} is excluded from job {cfg.run_id} ({reason}); "
                    f"readmit it with `ftd readmit {self.node_id}` before it may join",
                    "excluded",
                )
            if s.check([self._k(number, "request")]):
                request = ClusterRequest.from_json(s.get(self._k(number, "request")))
                if request.action != "restart":
                    raise RendezvousError(f"the job is over: {request.reason}", request.action)
                s.compare_set("round", str(number), str(number + 1))
                number += 1
                continue
            if s.check([self._k(number, "closed")]):
                self._wait_as_late(number)
                continue
            n = s.add(self._k(number, "joined"), 1)
            s.set(self._k(number, f"node/{n}"), json.dumps(asdict(me)))
            log.info("joined round %d as joiner %d", number, n)
            if n == cfg.nnodes_max:
                self._close(number, n)
            members = self._await_close(number, deadline)
            if members is None:
                continue  # the round closed without us: wait for the next one
            ids = [m.node_id for m in members[0]]
            return Round(number, tuple(members[0]), members[1], ids.index(self.node_id))

    def _await_close(self, number: int, deadline: float) -> tuple[list[Member], int] | None:
        s, cfg = self.store, self.config
        min_since: float | None = None
        key = self._k(number, "closed")
        while not s.wait([key], WAIT_CHUNK_S):
            if self._closing.is_set():
                raise RendezvousError("the daemon is stopping", "stopped")
            count = s.add(self._k(number, "joined"), 0)
            now = time.monotonic()
            if count >= cfg.nnodes_min:
                min_since = now if min_since is None else min_since
                if now - min_since >= cfg.rdzv_last_call_timeout_s or count >= cfg.nnodes_max:
                    self._close(number, count)
            elif now > deadline:
                raise RendezvousError(
                    f"round {number}: only {count} of at least {cfg.nnodes_min} nodes joined "
                    f"within --rdzv-join-timeout ({cfg.rdzv_join_timeout_s:g}s)"
                )
        payload = json.loads(s.get(key))
        self.excluded = payload.get("excluded", {})
        members = [Member(**m) for m in payload["members"]]
        if self.node_id not in [m.node_id for m in members]:
            return None
        return members, int(payload["restarts"])

    def _close(self, number: int, count: int) -> None:
        s = self.store
        joined = [
            Member(**json.loads(raw))
            for raw in s.multi_get([self._k(number, f"node/{i}") for i in range(1, count + 1)])
        ]
        previous: list[str] = []
        if number > 0 and s.check([self._k(number - 1, "closed")]):
            prev = json.loads(s.get(self._k(number - 1, "closed")))
            previous = [m["node_id"] for m in prev["members"]]
        unique = {m.node_id: m for m in joined}  # a node id joins once per round
        members = order_members(list(unique.values()), previous)
        restarts = s.add("restarts", 0)
        excluded = self._read_excluded()
        payload = json.dumps(
            {"members": [asdict(m) for m in members], "restarts": restarts, "excluded": excluded}
        )
        if s.compare_set(self._k(number, "closed"), "", payload) == payload.encode():
            log.info("closed round %d with %d nodes", number, len(members))

    def _wait_as_late(self, number: int) -> None:
        """Round `number` runs without us: ask to scale up if there is room, then await its end."""
        s, cfg = self.store, self.config
        payload = json.loads(s.get(self._k(number, "closed")))
        if len(payload["members"]) < cfg.nnodes_max:
            request = ClusterRequest(
                "restart",
                f"node {self.node_id} joined: scaling up from {len(payload['members'])} nodes",
                self.node_id,
                nonce=uuid.uuid4().hex,
            )
            s.compare_set(self._k(number, "request"), "", request.to_json())
        else:
            log.info("round %d is full (%d nodes): waiting for its end", number, cfg.nnodes_max)
        while not s.wait([self._k(number, "request")], WAIT_CHUNK_S):
            if self._closing.is_set():
                raise RendezvousError("the daemon is stopping", "stopped")

    # -- the workers' store ------------------------------------------------------------------

    async def publish_master(self, rnd: Round, host: str, port: int) -> None:
        await self._call(self.store.set, self._k(rnd.number, "master"), f"{host}:{port}")

    async def master(self, rnd: Round) -> tuple[str, int]:
        raw: bytes = await self._call(self.store.get, self._k(rnd.number, "master"))
        host, _, port = raw.decode().rpartition(":")
        return host, int(port)

    # -- requests ----------------------------------------------------------------------------

    def watch(self, number: int) -> asyncio.Future[ClusterRequest]:
        """Resolves with the request that ends round `number`, the moment it is made: a blocking
        store wait in a thread of its own (its own connection), no polling."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ClusterRequest] = loop.create_future()
        # A lost store is also reported through `lost`, which the daemon may see first: the
        # exception here needs no reader.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())

        def resolve(value: ClusterRequest | BaseException) -> None:
            if future.done():
                return
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

        def wait() -> None:
            from torch.distributed import DistError

            key = self._k(number, "request")
            try:
                store = self._connect()
                while not store.wait([key], WATCH_CHUNK_S):
                    if self._closing.is_set():
                        return
                value: ClusterRequest | BaseException = ClusterRequest.from_json(store.get(key))
            except DistError as error:
                if self._closing.is_set():
                    return
                why = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                loop.call_soon_threadsafe(self._mark_lost, why)
                value = RendezvousError(f"store lost ({why})", "store_lost")
            loop.call_soon_threadsafe(resolve, value)

        threading.Thread(target=wait, name=f"ftd-watch-r{number}", daemon=True).start()
        return future

    async def restarts_used(self) -> int:
        return int(await self._call(self.store.add, "restarts", 0))

    async def count_restart(self) -> int:
        """Count one restart (an in-process respawn); the restarts used, this one included."""
        return int(await self._call(self.store.add, "restarts", 1))

    async def request(self, number: int, request: ClusterRequest) -> ClusterRequest:
        """Make `request` end round `number`, unless another came first: the one in force."""
        return await self._call(self._request, number, request)  # type: ignore[no-any-return]

    def _request(self, number: int, request: ClusterRequest) -> ClusterRequest:
        s = self.store
        raw = request.to_json()
        current = s.compare_set(self._k(number, "request"), "", raw)
        if current != raw.encode():
            return ClusterRequest.from_json(current)
        log.info("round %d: requested %s: %s", number, request.action, request.reason)
        if request.action == "restart" and request.counted:
            s.add("restarts", 1)
        return request

    async def succeeded(self, rnd: Round) -> None:
        """This node's ranks all exited 0; the last node to finish ends the job for everyone."""
        await self._call(self._succeeded, rnd)

    def _succeeded(self, rnd: Round) -> None:
        s = self.store
        done = s.add(self._k(rnd.number, "succeeded"), 1)
        unhealthy = s.add(self._k(rnd.number, "unhealthy"), 0)
        if done + unhealthy >= len(rnd.members):
            self._request(
                rnd.number,
                ClusterRequest("succeed", "every node's ranks exited 0", self.node_id),
            )

    async def leave(self, rnd: Round) -> None:
        """The job is over: acknowledge it; the store's host waits (bounded) for every member's
        acknowledgement before it takes the store away."""
        try:
            await self._call(self._leave, rnd, timeout_s=self.config.node_keepalive_timeout_s * 3)
        except RendezvousError:
            log.debug("could not acknowledge the end of the job", exc_info=True)
        self.finishing()

    def _leave(self, rnd: Round) -> None:
        s = self.store
        if s.add(self._k(rnd.number, "acked"), 1) >= len(rnd.members):
            s.set(self._k(rnd.number, "all_acked"), "1")
        if self.hosting:
            s.wait([self._k(rnd.number, "all_acked")], self.config.node_keepalive_timeout_s * 2)

    async def unhealthy(self, rnd: Round) -> int:
        """--restart-policy min-healthy: count one more unhealthy node; the healthy ones left."""
        return len(rnd.members) - int(
            await self._call(self.store.add, self._k(rnd.number, "unhealthy"), 1)
        )

    # -- exclusion ---------------------------------------------------------------------------

    def _read_excluded(self) -> dict[str, str]:
        s = self.store
        if not s.check(["excluded"]):
            return {}
        data: dict[str, str] = json.loads(s.get("excluded"))
        return data

    def _update_excluded(self, node_id: str, reason: str | None) -> dict[str, str]:
        s = self.store
        current = s.compare_set("excluded", "", "{}").decode() if not s.check(["excluded"]) else ""
        current = current or s.get("excluded").decode()
        while True:
            data = json.loads(current)
            if reason is None:
                data.pop(node_id, None)
            else:
                data[node_id] = reason
            desired = json.dumps(data, sort_keys=True)
            seen = s.compare_set("excluded", current, desired).decode()
            if seen == desired:
                break
            current = seen
        if reason is None:
            s.delete_key(f"excluded/{node_id}")
        else:
            s.set(f"excluded/{node_id}", reason)
        return data  # type: ignore[no-any-return]

    async def exclude(self, node_id: str, reason: str) -> dict[str, str]:
        self.excluded = await self._call(self._update_excluded, node_id, reason)
        return self.excluded

    async def readmit(self, node_id: str) -> dict[str, str]:
        self.excluded = await self._call(self._update_excluded, node_id, None)
        return self.excluded

    # -- status ------------------------------------------------------------------------------

    async def publish_status(self, summary: dict[str, Any]) -> None:
        await self._call(self.store.set, f"status/{self.node_id}", json.dumps(summary))

    async def cluster(self) -> dict[str, Any]:
        return await self._call(self._cluster)  # type: ignore[no-any-return]

    def _cluster(self) -> dict[str, Any]:
        s = self.store
        rnd = self.round
        members = rnd.node_ids if rnd else []
        names = sorted({*members, self.node_id})
        keys = [f"status/{n}" for n in names]
        present = [k for k in keys if s.check([k])]
        nodes = [json.loads(raw) for raw in s.multi_get(present)] if present else []
        self.excluded = self._read_excluded()
        return {
            "nodes": nodes,
            "round": {"round": rnd.number if rnd else 0, "members": members},
            "excluded": [{"node_id": n, "reason": r} for n, r in sorted(self.excluded.items())],
            "store_ops": self.ops[0],
        }

    # -- liveness ----------------------------------------------------------------------------

    async def _keepalive(self) -> None:
        from torch.distributed import DistError

        timeout = self.config.node_keepalive_timeout_s
        interval = max(timeout / 4, 0.05)
        loop = asyncio.get_running_loop()
        store = self._keepalive_store
        assert store is not None
        while not self.lost.is_set() and not self._keepalive_stopped:
            watched = list(self._watched)
            try:
                values: list[bytes] = await asyncio.wait_for(
                    loop.run_in_executor(self._ka_pool, self._beat, store, watched),
                    max(2 * timeout, KEEPALIVE_OP_MIN_TIMEOUT_S),
                )
            except (DistError, TimeoutError) as error:
                self._mark_lost(f"keepalive failed: {type(error).__name__}: {error}"[:300])
                return
            now = time.monotonic()
            for node, raw in zip(watched, values, strict=True):
                value = int(raw)
                if node not in self._watched or value >= DONE_MARK:
                    continue
                seen, since = self._watched[node]
                if value != seen:
                    self._watched[node] = (value, now)
                elif now - since > timeout and node not in self._declared:
                    self._declared.add(node)
                    reason = (
                        f"node {node} lost: no keepalive for {now - since:.1f}s "
                        f"(--node-keepalive-timeout {timeout:g}s)"
                    )
                    log.error("%s", reason)
                    self._on_dead(node, reason)
            await asyncio.sleep(interval)  # a keepalive is periodic by nature

    def _beat(self, store: CountingStore, watched: list[str]) -> list[bytes]:
        if not self._done:
            store.add(f"alive/{self.node_id}", 1)
        return store.multi_get([f"alive/{n}" for n in watched]) if watched else []
