"""One worker process of the scale harness (bench/scale.py): V/P virtual nodes on one event loop.

A virtual node is the real per-node coordination of an ftd daemon, its ranks left out: a
`Coordinator` of the chosen backend (its liveness included), its summary published every
PUBLISH_S (an upper bound: a daemon publishes on change), the straggler watch's look at the
job's times every TIMES_S (health/job_times.py) and the replicas' ring look every RING_S
(checkpoint/replication.py's `_watch`, with a holder whose ranks hold nothing). What the
daemon does when its coordinator says a node was lost is done too: the same function
(supervision/node_loss.py's `ask_after_node_lost`) requests the round's restart.

The parent drives the worker over its stdin and stdout, one JSON object a line each way: a
command `{"cmd": ...}`, then one answer `{"ok": true, ...}` or `{"ok": false, "error": ...}`.
Times in answers are wall clock (time.time(): one clock for every process of the machine).

    start    {backend, endpoint, nodes, first, count, keepalive_s, join_timeout_s, work,
              start_batch}: make and start this worker's coordinators (node ids n<first>...)
    join     {skip}: every node but `skip` joins the next round; answers once each has entered
              it (taken its place: the round cannot close without `skip`)
    join_one {node}: that node joins too (the last joiner): when it asked
    joined   {timeout_s}: when each node had the round (its `ended` future armed at once)
    steady   {}: start every node's looks (they run until `stop`)
    measure  {seconds}: the steady window: this process's CPU, its coordinators' operations,
              how late the looks fell
    quiet    {}: stop every node's looks (the summaries, the job's times, the ring): the
              liveness and the rounds' waits go on
    view     {}: node 0's bounded cluster page (GET /v1/cluster, from its kept view), its size,
              the reads of every summary behind them (how many, the longest), the median and
              the max time of VIEW_SAMPLES, one every VIEW_EVERY_S
    request  {node, hang}: that node requests its round's restart (`hang`: as a hang verdict
              does); when it asked. Where it is a hang, every node takes its part in naming the
              job's culprit as its round ends (supervision/job_culprit.py's, the daemon's code)
    culprit  {timeout_s}: when each node learned the job's culprit, and whom it names
    ended    {timeout_s}: when each node's round ended (its `ended` future resolved), and the
              node_lost calls heard
    stop     {}: close every coordinator (bounded) and exit
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftd.api.cluster_view import DEFAULT_LIMIT
from ftd.api.kept_cluster import KeptClusterView
from ftd.checkpoint.holder import CheckpointHolder
from ftd.checkpoint.replication import Replication
from ftd.config.serve import ServeConfig
from ftd.coordination.assignment import LIST_MAX
from ftd.coordination.base import Coordinator, Round, new_request
from ftd.coordination.job_share import JobShare
from ftd.coordination.records import Member, RequestRecord
from ftd.health.job_times import JobTimesShare
from ftd.status.events import EventLog
from ftd.supervision.job_culprit import JobCulpritShare
from ftd.supervision.node_loss import ask_after_node_lost
from ftd.tasks import Background

SECRET = b"the scale harness's job secret!!"
NPROC = 8
PUBLISH_S = 5.0
TIMES_S = 5.0
RING_S = 2.0
CLOSE_S = 30.0
"""How long `stop` waits for the coordinators to close."""
VIEW_SAMPLES = 5
VIEW_EVERY_S = 2.0
"""The dashboard's period (CLUSTER_EVERY_MS): what nodes published in between is decoded anew
(a node's first read decodes every summary: the max)."""
HUNG_LOCAL_RANK = 3
"""The culprit scenario's hung rank, on its node: it entered one collective fewer than every
other rank of the job, which wait on it."""
ENTERED = 100


def cpu_seconds(pid: int | str = "self") -> float:
    """User and system CPU of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_id(index: int) -> str:
    return f"n{index:05d}"


def coordinator(msg: dict[str, Any], index: int) -> tuple[ServeConfig, Coordinator]:
    """A daemon's configuration and coordinator, with the harness's keepalive and join
    timeouts."""
    nodes = int(msg["nodes"])
    settings = ServeConfig(
        entrypoint=__file__,
        nnodes_min=nodes,
        nnodes_max=nodes,
        rdzv_backend=msg["backend"],
        rdzv_endpoint=msg["endpoint"],
        run_id=f"scale{nodes}",
        node_id=node_id(index),
        local_addr="127.0.0.1",
        rdzv_join_timeout_s=float(msg["join_timeout_s"]),
        node_keepalive_timeout_s=float(msg["keepalive_s"]),
        rdzv_conf={"read_timeout": str(msg["etcd_read_timeout_s"])}
        if msg["backend"] == "etcd"
        else {},
        rdzv_list_max=LIST_MAX if msg.get("list_max") is None else int(msg["list_max"]),
    )
    if msg["backend"] == "c10d":
        from ftd.coordination.c10d.coordinator import StoreCoordinator

        return settings, StoreCoordinator(settings, secret=SECRET)
    from ftd.coordination.etcd.coordinator import EtcdCoordinator

    return settings, EtcdCoordinator(settings, SECRET, lambda kind, data: None)


def summary(node: str, rnd: Round, wall: float) -> dict[str, Any]:
    """What a daemon of 8 running ranks publishes (the forward times its straggler watch
    reads, the steps its replicas hold)."""
    first = rnd.group_rank * NPROC
    return {
        "node_id": node,
        "state": "running",
        "attempt": rnd.number,
        "restart_count": 0,
        "group_rank": rnd.group_rank,
        "round": rnd.number,
        "nproc_per_node": NPROC,
        "ranks_running": NPROC,
        "ranks_total": NPROC,
        "time": wall,
        "forward": tuple(
            {"global_rank": r, "forward_us": 40_000 + r % 97, "host_us": 3000}
            for r in range(first, first + NPROC)
        ),
        "replica_addr": "127.0.0.1:1",  # its replica server's (read once by its predecessor)
        "replicated_steps": (10, 11),
        "replicated_round": rnd.number,
    }


class VirtualNode:
    """One daemon's coordination, its ranks left out."""

    def __init__(self, index: int, msg: dict[str, Any], work: Path) -> None:
        self.index = index
        self.config, self.c = coordinator(msg, index)
        self.node_id = self.config.node_id
        self.share = JobShare(self.c, lambda: True)
        self.times = JobTimesShare(self.share)
        self.late_s = 0.0
        holder = CheckpointHolder(work / self.node_id, 1 << 20, EventLog(None), True, base=work)
        self.ring = Replication(
            SECRET, self.node_id, EventLog(None), self._view, self.share, lambda: None, holder
        )
        self.ended: asyncio.Future[RequestRecord] | None = None
        self.ended_at: float | None = None
        self.ended_by: RequestRecord | None = None
        self.entered = asyncio.Event()
        self.joining: asyncio.Task[Round] | None = None
        self.had_round_at: float | None = None
        self.closed_at: float | None = None
        """When this node's close of the round it joins went through (the closing node's)."""
        self.record_at: float | None = None
        """When this node had the closing record of the round it joins."""
        self.hung_node: int | None = None
        self.culprit_task: asyncio.Future[Any] | None = None
        self.named_at: float | None = None
        self.culprit_steps: dict[str, Any] = {}

    def watch_entry(self) -> None:
        """`entered` is set once this node has taken its place in the round it joins."""
        steps: Any = self.c._steps  # both backends' RoundSteps, made by start()
        enter = steps.enter

        async def entering(*args: Any) -> Any:
            entry = await enter(*args)
            self.entered.set()
            return entry

        steps.enter = entering
        close, closing = steps.close, steps.closing

        async def closed(number: int, abort: bool, deadline: float) -> None:
            await close(number, abort, deadline)
            self.closed_at = time.time()

        async def recorded(*args: Any) -> Any:
            record = await closing(*args)
            self.record_at = time.time()
            return record

        steps.close, steps.closing = closed, recorded

    def collectives(self, rnd: Round, since: float) -> SimpleNamespace:
        """What this node's ranks had entered when the attempt ended on the hang: the hung
        node's HUNG_LOCAL_RANK one collective fewer (and stopped first), every other rank
        one more, waiting on it."""
        hung = self.index == self.hung_node
        first = rnd.group_rank * NPROC
        return SimpleNamespace(
            lowest=ENTERED if hung else ENTERED + 1,
            rank=first + (HUNG_LOCAL_RANK if hung else 0),
            since=since - (1.0 if hung else 0.5),
            waiting=NPROC - 1 if hung else 0,
            ranks=NPROC,
            judged=hung,
        )

    def take_part(self, rnd: Round) -> None:
        """This node's part in naming the job's culprit: the daemon's (JobCulpritShare)."""
        since = time.time()
        health = SimpleNamespace(collectives=lambda: self.collectives(rnd, since))
        tools = SimpleNamespace(coordinator=self.timed(), config=self.config, health=health)
        share = JobCulpritShare(tools, None, None)  # type: ignore[arg-type]

        async def decided() -> Any:
            culprit = await share._decided(rnd)
            if culprit is not None:  # None: not decided in time (the daemon says so, no name)
                self.named_at = time.time()
            return culprit

        self.culprit_task = asyncio.ensure_future(decided())

    def timed(self) -> Any:
        """The coordinator, each culprit step's end noted in `culprit_steps` (shared,
        gathered with its count, decided). A node other than node rank 0 shares in its
        await_culprit call: with etcd in the transaction that reads the decision (noted as it
        answers), with c10d through share_collectives first."""
        steps, c = self.culprit_steps, self.c

        def noted(name: str, fn: Any, count: str | None = None) -> Any:
            async def call(*args: Any, **kwargs: Any) -> Any:
                answer = await fn(*args, **kwargs)
                steps[name] = time.time()
                if count is not None:
                    steps[count] = len(answer)
                return answer

            return call

        kv = getattr(c, "_kv", None)
        if kv is not None:  # etcd
            kv.read_decided_with = noted("shared", type(kv).read_decided_with.__get__(kv))
        c.share_collectives = noted("shared", type(c).share_collectives.__get__(c))
        return SimpleNamespace(
            share_collectives=c.share_collectives,
            gather_collectives=noted("gathered", c.gather_collectives, "gathered_count"),
            decide_culprit=noted("decided", c.decide_culprit),
            await_culprit=c.await_culprit,
        )

    def _view(self) -> tuple[int, list[str], range, int] | None:
        rnd = self.c.round
        if rnd is None:
            return None
        first = rnd.group_rank * NPROC
        members = list(rnd.node_ids or (self.node_id, *([rnd.successor] if rnd.successor else [])))
        return rnd.number, members, range(first, first + NPROC), NPROC * rnd.size

    def arm(self, rnd: Round) -> None:
        """Watch `rnd`'s end: the moment this node would stop its ranks."""
        self.ended_at, self.ended_by = None, None
        self.culprit_task, self.named_at, self.culprit_steps = None, None, {}
        self.ended = future = self.c.ended(rnd)

        def seen(done: asyncio.Future[RequestRecord]) -> None:
            self.ended_at = time.time()
            if not done.cancelled() and done.exception() is None:
                self.ended_by = done.result()
                if self.ended_by.hang:  # the hung node's verdict asked: `by` is that node
                    self.hung_node = int(self.ended_by.by.removeprefix("n"))
                    self.take_part(rnd)

        future.add_done_callback(seen)

    async def every(self, period: float, look: Any, stop: asyncio.Event, phase: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + phase * period
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, due - loop.time()))
            if stop.is_set():
                return
            self.late_s = max(self.late_s, loop.time() - due)
            with contextlib.suppress(Exception):
                await look()
            due += period

    async def steady(self, stop: asyncio.Event, phase: float) -> None:
        async def publish() -> None:
            rnd = self.c.round
            if rnd is not None:
                await self.c.publish_status(summary(self.node_id, rnd, time.time()))

        await asyncio.gather(
            self.every(PUBLISH_S, publish, stop, phase),
            self.every(TIMES_S, lambda: self.times.read(time.time()), stop, phase),
            self.every(RING_S, self.ring._watch, stop, phase),
        )


class Worker:
    def __init__(self) -> None:
        self.nodes: list[VirtualNode] = []
        self.total = 0
        self.lost_heard: list[dict[str, Any]] = []
        self.stop_looks = asyncio.Event()
        self.looks: list[asyncio.Task[None]] = []
        self.asks: set[asyncio.Task[None]] = set()
        self._cpu, self._ops = 0.0, 0
        self.background = Background()
        self.kept_view: KeptClusterView | None = None

    def _on_node_lost(self, v: VirtualNode) -> Any:
        """What the daemon's NodeLoss does: say it, and ask for the round's restart."""

        def heard(lost: str, reason: str) -> None:
            self.lost_heard.append({"by": v.node_id, "node": lost, "at": time.time()})
            rnd = v.c.round
            if rnd is not None:
                ask = ask_after_node_lost(v.c, v.config, rnd, lost, reason)
                task = asyncio.ensure_future(ask)
                self.asks.add(task)
                task.add_done_callback(self.asks.discard)

        return heard

    async def do_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        first, count, self.total = int(msg["first"]), int(msg["count"]), int(msg["nodes"])
        work = Path(msg["work"]) / f"worker-{first}"
        work.mkdir(parents=True, exist_ok=True)
        self.nodes = [VirtualNode(i, msg, work) for i in range(first, first + count)]
        gate = asyncio.Semaphore(int(msg["start_batch"]))

        async def start(v: VirtualNode) -> None:
            async with gate:  # connections opened a batch at a time, not all at once
                await v.c.start(self._on_node_lost(v))
            v.watch_entry()

        await asyncio.gather(*(start(v) for v in self.nodes))
        return {"started": len(self.nodes), "threads": threading.active_count()}

    def _join(self, v: VirtualNode) -> None:
        async def join() -> Round:
            member = Member(node_id=v.node_id, addr="127.0.0.1", nproc=NPROC, store_port=1)
            rnd = await v.c.join(member)
            v.had_round_at = time.time()
            v.arm(rnd)
            return rnd

        v.entered.clear()
        v.had_round_at = v.closed_at = v.record_at = None
        v.joining = asyncio.ensure_future(join())

    async def do_join(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._cpu, self._ops = cpu_seconds(), sum(v.c.ops for v in self.nodes)
        joining = [v for v in self.nodes if v.index != msg.get("skip")]
        for v in joining:
            self._join(v)

        async def entered(v: VirtualNode) -> None:
            assert v.joining is not None
            waiting = asyncio.ensure_future(v.entered.wait())
            await asyncio.wait([waiting, v.joining], return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()

        await asyncio.gather(*(entered(v) for v in joining))
        return {"entered": sum(v.entered.is_set() for v in joining)}

    async def do_join_one(self, msg: dict[str, Any]) -> dict[str, Any]:
        v = next(v for v in self.nodes if v.index == int(msg["node"]))
        asked = time.time()
        self._join(v)
        return {"asked_at": asked}

    async def do_joined(self, msg: dict[str, Any]) -> dict[str, Any]:
        tasks = [v.joining for v in self.nodes if v.joining is not None]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        had = [v.had_round_at for v in self.nodes if v.had_round_at is not None]
        answer: dict[str, Any] = {
            "joined": len(had),
            "had_round_at": max(had, default=None),
            "had_at": had,
            "record_at": [v.record_at for v in self.nodes if v.record_at is not None],
            "closed_at": [v.closed_at for v in self.nodes if v.closed_at is not None],
            "cpu_s": cpu_seconds() - self._cpu,
            "ops": sum(v.c.ops for v in self.nodes) - self._ops,
            "threads": threading.active_count(),
        }
        if errors:
            error = errors[0]
            reason = getattr(error, "reason", None) or f"{type(error).__name__}: {error}"
            return {**answer, "error": str(reason)[:500], "failed": len(errors)}
        answer["rounds"] = sorted({r.number for r in results if isinstance(r, Round)})
        return answer

    async def do_steady(self, msg: dict[str, Any]) -> dict[str, Any]:
        async def publish(v: VirtualNode) -> bool:
            rnd = v.c.round
            try:
                if rnd is not None:
                    await v.c.publish_status(summary(v.node_id, rnd, time.time()))
            except Exception:  # as a look's: said in `failed`, the looks go on
                return False
            return True

        published = await asyncio.gather(*(publish(v) for v in self.nodes))  # a daemon's first
        self.looks = [
            asyncio.ensure_future(v.steady(self.stop_looks, v.index / self.total))
            for v in self.nodes
        ]
        return {"failed": published.count(False)}

    async def do_measure(self, msg: dict[str, Any]) -> dict[str, Any]:
        for v in self.nodes:
            v.late_s = 0.0
        ops = sum(v.c.ops for v in self.nodes)
        cpu, started = cpu_seconds(), time.monotonic()
        await asyncio.sleep(float(msg["seconds"]))
        return {
            "window_s": time.monotonic() - started,
            "cpu_s": cpu_seconds() - cpu,
            "ops": sum(v.c.ops for v in self.nodes) - ops,
            "late_max_s": max(v.late_s for v in self.nodes),
            "lost_heard": self.lost_heard,
            "threads": threading.active_count(),
        }

    async def do_view(self, msg: dict[str, Any]) -> dict[str, Any]:
        """VIEW_SAMPLES pages of node 0's, as the dashboard reads them (one alone is one draw of
        a loaded loop), through the kept view a daemon serves them from (kept_cluster.py); and
        the reads of every summary behind them."""
        if self.kept_view is None:
            self.kept_view = KeptClusterView(self.nodes[0].c.cluster, self.background)
        kept, took, size = self.kept_view, [], 0
        reads = kept.reads
        for sample in range(VIEW_SAMPLES):
            if sample:
                await asyncio.sleep(VIEW_EVERY_S)
            started = time.monotonic()
            rnd = self.nodes[0].c.round
            page = await kept.page(rnd.number if rnd else None, 0, DEFAULT_LIMIT)
            size = len(json.dumps(page))
            took.append(time.monotonic() - started)
        read_s = list(kept.recent_reads_s)[-(kept.reads - reads) :] if kept.reads > reads else []
        return {
            "bytes": size,
            "s": statistics.median(took),
            "max_s": max(took),
            "reads": kept.reads - reads,
            "read_s": max(read_s, default=None),
        }

    async def do_request(self, msg: dict[str, Any]) -> dict[str, Any]:
        v = next(v for v in self.nodes if v.index == int(msg["node"]))
        rnd = v.c.round
        assert rnd is not None
        hang = bool(msg.get("hang"))
        why = "a rank hung" if hang else "a rank failed"
        request = new_request("restart", f"scale harness: {why}", by=v.node_id, hang=hang)
        asked = time.time()
        decided = await v.c.request(rnd, request)
        return {
            "asked_at": asked,
            "decided_at": time.time(),
            "round": rnd.number,
            "ours": decided == request,
        }

    async def do_ended(self, msg: dict[str, Any]) -> dict[str, Any]:
        armed = [v.ended for v in self.nodes if v.ended is not None]
        if armed:
            await asyncio.wait(armed, timeout=float(msg["timeout_s"]))
        return {
            "ended_at": [v.ended_at for v in self.nodes],
            "reasons": sorted({v.ended_by.reason for v in self.nodes if v.ended_by is not None}),
            "lost_heard": self.lost_heard,
        }

    async def do_culprit(self, msg: dict[str, Any]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(msg["timeout_s"])
        armed = [v.ended for v in self.nodes if v.ended is not None]
        if armed:  # each node takes its part as its round ends
            await asyncio.wait(armed, timeout=float(msg["timeout_s"]))
        await asyncio.sleep(0)  # the ends' callbacks have run
        tasks = [v.culprit_task for v in self.nodes if v.culprit_task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
        decided = [
            t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None
        ]
        named = sorted({(c.node_id, c.rank) for c in decided if c is not None})
        return {
            "took_part": len(tasks),
            "named_at": [v.named_at for v in self.nodes],
            "ended_at": [v.ended_at for v in self.nodes],
            "steps": [v.culprit_steps for v in self.nodes],
            "named": named,
            "unnamed": len(tasks) - sum(c is not None for c in decided),
        }

    async def do_quiet(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.stop_looks.set()
        await asyncio.gather(*self.looks, return_exceptions=True)
        return {}

    async def do_stop(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.stop_looks.set()
        culprits = [v.culprit_task for v in self.nodes if v.culprit_task is not None]
        for task in [*self.looks, *self.asks, *culprits]:
            task.cancel()
        await asyncio.gather(*self.looks, *self.asks, *culprits, return_exceptions=True)
        await self.background.close()
        closing = asyncio.gather(*(v.c.close() for v in self.nodes), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(closing, CLOSE_S)
        return {}


async def serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    worker = Worker()
    while line := await reader.readline():
        msg = json.loads(line)
        try:
            answer = {"ok": True, **await getattr(worker, f"do_{msg['cmd']}")(msg)}
        except Exception as error:
            logging.exception("%s failed", msg["cmd"])
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        if msg["cmd"] == "stop":
            break


def main() -> None:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop  # the daemon's loop (ftd/cli/main.py)

    uvloop.run(serve())
    sys.stdout.flush()
    os._exit(0)  # a store thread stuck in a dead store must not hold the exit


if __name__ == "__main__":
    main()
