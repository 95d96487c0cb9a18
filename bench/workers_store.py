"""The workers' store under a whole job's `init_process_group`: ftd's server, as the daemon hosts
it, against torch's libuv server, in the same run (issue 43 item 4).

For each world size R, each server in turn, R simulated ranks (threads of a few client
processes, each thread with torch's own C++ `TCPStore` client) do the store operations of an
NCCL `init_process_group` under TORCHELASTIC_USE_AGENT_STORE=True:

1. `TCPStore(host, port, R, is_master=False)`: connect, VALIDATE, PING, ADD "init/" 1;
2. the PrefixStores default_pg -> "0/" -> "cuda/";
3. the NCCL unique ids: above TORCH_NCCL_RANKS_PER_ROOT (128) ranks torch's scalable init (each
   of the R/128 roots SETs "UniqueNCCLID:<i>", every rank WAITs on all of them, then
   MULTI_GETs them); at or below it rank 0 SETs "0" and the others WAIT and GET it.

TORCH_DIST_INIT_BARRIER defaults to "0" in torch 2.13: no store barrier.

The servers (`--server`):

- `torch`: torch 2.13's libuv master `TCPStore`, in a process of its own;
- `ftd`: as the daemon hosts it: a process of the bench plays the daemon, owns an
  `AttemptStores` built as ftd.daemon builds it (`own_process` of a config of R ranks:
  `--workers-store-process auto`), takes a fresh store and waits for the next one to be ready;
- `ftd-loop`, `ftd-process`: the same, with `--workers-store-process off` / `on`.

The daemon's process runs a 10 ms asyncio ticker on its loop: the lateness of its ticks during
the init (`lag`) is what a hang verdict of node 0's ranks, a timer on that loop, would be late.

Per run: `init_s` (the start signal to the last rank past init), the ranks' latency p50/max, the
store's CPU seconds and peak RSS (the server's process: the daemon's own with `ftd-loop`), the
store processes' PSS before the init (what hosting apart costs), the daemon's CPU, the machine's
ListenOverflows, and the CPU the rest of the machine used meanwhile (`others`: a run where
other work took over QUIET_CORES is marked contended and run again, --tries). The store's
process and the daemon's are pinned to CPU 0, the clients to the others (--no-pin: not).

    nice -n 19 .venv/bin/python bench/workers_store.py --ranks 1024,4096,8192,16384 \\
        --server torch,ftd,ftd-loop --reps 3 --json bench/results/workers_store.json

As root, it runs in a mount namespace of its own whose resolv.conf names no DNS server (see
`without_dns`). A limit of the machine that rules an R out (pid_max, RLIMIT_NOFILE) is said and
that R skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import benchlib

ROOT = benchlib.ROOT
TICK_S = 0.010
RANKS_PER_ROOT = 128  # torch's TORCH_NCCL_RANKS_PER_ROOT default
NCCL_UNIQUE_ID_BYTES = 128
THREAD_STACK_BYTES = 512 * 1024
PORTS_PER_ADDRESS = 20000  # under the ~28k ephemeral ports of one (source, destination) pair
FD_MARGIN = 64  # a server's descriptors besides its connections: listener, pipes, epoll
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
QUIET_CORES = 0.25
SERVERS = ("torch", "ftd", "ftd-loop", "ftd-process")
NONE = "\u2013"  # what a table shows for a value that is not there


# -- /proc and the machine's limits -------------------------------------------------------------


@dataclass
class ProcStats:
    cpu_s: float
    hwm_mib: float
    pss_mib: float


def cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def kib_field(path: str, name: str) -> float:
    for line in Path(path).read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def proc_stats(pid: int) -> ProcStats:
    return ProcStats(
        cpu_s(pid),
        kib_field(f"/proc/{pid}/status", "VmHWM"),
        kib_field(f"/proc/{pid}/smaps_rollup", "Pss"),
    )


def raise_nofile(need: int) -> str | None:
    """The soft RLIMIT_NOFILE up to `need` (the hard one too, where allowed): None, or why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    except (ValueError, OSError) as error:
        return f"RLIMIT_NOFILE {soft}/{hard} cannot reach {need}: {error}"
    return None


def machine_busy_s() -> float:
    """user + nice + system time of all CPUs (interrupts left out: loopback traffic's)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return sum(int(value) for value in fields[:3]) / TICKS_PER_S


def pids_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_s(pid)
    return total


def listen_overflows() -> int:
    """TcpExt ListenOverflows: connections dropped because an accept queue was full."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    names, values = (line.split() for line in lines if line.startswith("TcpExt:"))
    return int(dict(zip(names, values, strict=True))["ListenOverflows"])


def wait_quiet(max_wait_s: float) -> float:
    """Wait (at most `max_wait_s`) until the machine is idle but for us: seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        before = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - before < QUIET_CORES:
            break
        time.sleep(4.0)
    return round(time.monotonic() - start, 1)


def read_int(path: str) -> int | None:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def system_threads() -> int:
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            total += int(stat[stat.rindex(")") + 2 :].split()[17])  # num_threads
    return total


def ephemeral_ports() -> int:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(high) - int(low) + 1


def limits_for(world: int) -> list[str]:
    """What on this machine forbids `world` simulated ranks (empty: nothing)."""
    problems = []
    need = world + system_threads() + 256  # a pid per client thread, besides those running
    pid_max = read_int("/proc/sys/kernel/pid_max") or 0
    if need > pid_max:
        problems.append(f"kernel.pid_max={pid_max} < {need} threads (R + running + margin)")
    if problem := raise_nofile(world + FD_MARGIN):  # the server's is raised the same way
        problems.append(f"the server's {problem} (a higher hard limit takes CAP_SYS_RESOURCE)")
    return problems


# -- the servers' processes ----------------------------------------------------------------------


def emit(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def serve_torch(world: int) -> None:
    """torch's libuv master TCPStore: prints {"port", "store_pid"}, then ends at 'stop'."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        use_libuv=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=600),
    )
    emit(sys.stdout, {"port": store.port, "store_pid": os.getpid(), "apart": True})
    for line in sys.stdin:
        if line.startswith("lag"):
            emit(sys.stdout, {"lag": None})
        elif line.startswith("stop"):
            break
    os._exit(0)  # a master TCPStore's destructor can wait on its clients


async def serve_ftd(kind: str, world: int, bind: str) -> None:
    """The daemon's side: an AttemptStores as ftd.daemon builds it, a 10 ms ticker on the same
    loop; prints {"port", "store_pid", "apart", "pss"}, answers 'lag T0 T1', ends at 'stop'."""
    from ftd.config.serve import ServeConfig
    from ftd.ranks.workers_store import AttemptStores, own_process

    setting = {"ftd": "auto", "ftd-loop": "off", "ftd-process": "on"}[kind]
    config = ServeConfig(
        entrypoint=__file__,
        nproc_per_node=world,
        workers_store_process=setting,
    )
    stores = AttemptStores(bind, 0, *own_process(config))
    samples: list[Sample] = []
    ticking = asyncio.create_task(tick(samples))
    _, port = await stores.fresh()
    await stores.prepared()  # the next store's start-up is no part of the init measured
    pids = stores.pids
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    emit(
        sys.stdout,
        {
            "port": port,
            "store_pid": pids[0] if pids else os.getpid(),
            "apart": bool(pids),
            "pss": round(sum(proc_stats(pid).pss_mib for pid in pids), 1),
        },
    )
    while line := (await reader.readline()).decode():
        if line.startswith("lag"):
            start, end = (float(word) for word in line.split()[1:3])
            emit(sys.stdout, {"lag": lag_summary(samples, start, end)})
        elif line.startswith("stop"):
            break
    ticking.cancel()
    await stores.close()


def serve(kind: str, world: int, bind: str) -> None:
    if os.environ.get("WS_PIN") == "1":
        os.sched_setaffinity(0, {0})  # the store's process, started below, inherits it
    raise_nofile(world + FD_MARGIN)
    if kind == "torch":
        serve_torch(world)
        return
    import uvloop

    uvloop.run(serve_ftd(kind, world, bind))


Sample = tuple[float, float, float]
"""A tick's (when, how late, how long the loop's thread waited for a CPU since the last)."""


def run_delay_s() -> float:
    """How long this thread has waited on a run queue (schedstat): the part of a lag that is
    the machine's, not the loop's own work."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9


async def tick(samples: list[Sample]) -> None:
    """Every tick of a TICK_S timer: a hang verdict is such a timer."""
    waited = run_delay_s()
    while True:
        due = time.monotonic() + TICK_S
        await asyncio.sleep(TICK_S)
        now, before, waited = time.monotonic(), waited, run_delay_s()
        samples.append((now, now - due, waited - before))


def lag_summary(samples: list[Sample], start: float, end: float) -> dict[str, Any]:
    during = sorted((lag, cpu_wait) for at, lag, cpu_wait in samples if start <= at <= end)
    idle = [lag for at, lag, _ in samples if at < start]
    if not during:
        return {"ticks": 0}
    worst, worst_cpu_wait = during[-1]
    return {
        "ticks": len(during),
        "expected_ticks": int((end - start) / TICK_S),
        "p99_ms": round(during[min(len(during) - 1, int(len(during) * 0.99))][0] * 1e3, 2),
        "max_ms": round(worst * 1e3, 2),
        "max_cpu_wait_ms": round(worst_cpu_wait * 1e3, 2),
        "idle_max_ms": round(max(idle, default=0.0) * 1e3, 2),
    }


# -- the client processes ------------------------------------------------------------------------


@dataclass
class RankResult:
    start: float = 0.0
    end: float = 0.0
    error: str | None = None
    store: Any = None  # held until 'release': ranks keep their store connection


def root_index(rank: int, world: int, roots: int) -> int:
    """torch's getRootIndex: the balanced spread of NCCL roots; -1 for a non-root."""
    remainder, per_root = world % roots, world // roots
    limit = remainder * (per_root + 1)
    if rank < limit:
        return -1 if rank % (per_root + 1) else rank // (per_root + 1)
    return -1 if (rank - limit) % per_root else (rank - limit) // per_root + remainder


def simulate_rank(rank: int, config: dict[str, Any], go: threading.Event, out: RankResult) -> None:
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    world, addresses = config["world"], config["addresses"]
    go.wait()
    out.start = time.monotonic()
    try:
        timeout = timedelta(seconds=config["timeout_s"])
        store = TCPStore(addresses[rank % len(addresses)], config["port"], world, False, timeout)
        out.store = store
        pg_store = PrefixStore("cuda/", PrefixStore("0/", PrefixStore("default_pg", store)))
        exchange_unique_ids(pg_store, rank, world)
    except Exception as error:  # the run reports it; the other ranks go on
        out.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    out.end = time.monotonic()


def exchange_unique_ids(store: Any, rank: int, world: int) -> None:
    unique_id = os.urandom(NCCL_UNIQUE_ID_BYTES)
    if world <= RANKS_PER_ROOT:  # broadcastUniqueNCCLID
        if rank == 0:
            store.set("0", unique_id)
        else:
            store.get("0")
        return
    roots = math.ceil(world / RANKS_PER_ROOT)  # allgatherUniqueNCCLIDs
    index = root_index(rank, world, roots)
    if index >= 0:
        store.set(f"UniqueNCCLID:{index}", unique_id)
    store.multi_get([f"UniqueNCCLID:{i}" for i in range(roots)])


def work() -> None:
    """A client process: 'prepare' (threads wait), 'go', a 'done' summary, 'release'."""
    cpus = os.environ.get("WS_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    import gc

    import torch.distributed  # noqa: F401  (imported before 'ready', not during a run)

    threading.stack_size(THREAD_STACK_BYTES)
    # Thousands of threads come back from C++ at once when the store wakes them; with the 5 ms
    # switch interval every thread waiting for the GIL wakes each 5 ms, which cost the clients
    # 3-7x the ranks' own work (and made it vary with the server's bursts).
    sys.setswitchinterval(0.5)
    gc.disable()  # collections over thousands of threads' objects: the harness's cost too
    emit(sys.stdout, {"ready": True})
    results: list[RankResult] = []
    threads: list[threading.Thread] = []
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "prepare":
            problem = raise_nofile(command["last"] - command["first"] + FD_MARGIN)
            results = [RankResult() for _ in range(command["first"], command["last"])]
            go = threading.Event()
            threads = [
                threading.Thread(target=simulate_rank, args=(rank, command, go, out), daemon=True)
                for rank, out in zip(range(command["first"], command["last"]), results, strict=True)
            ]
            for thread in threads:
                thread.start()
            emit(sys.stdout, {"prepared": True, "nofile_problem": problem})
        elif command["cmd"] == "go":
            go.set()
            report_when_done(threads, results)
        elif command["cmd"] == "release":
            for out in results:
                out.store = None
            results, threads = [], []
            emit(sys.stdout, {"released": True})


def report_when_done(threads: list[threading.Thread], results: list[RankResult]) -> None:
    failing_said = False
    for thread in threads:
        while thread.is_alive():
            thread.join(0.5)
            first_error = next((r.error for r in results if r.error), None)
            if first_error and not failing_said:  # the run is lost: say so at once
                emit(sys.stdout, {"failing": first_error})
                failing_said = True
    errors = [r.error for r in results if r.error]
    emit(
        sys.stdout,
        {
            "done": True,
            "start": min(r.start for r in results),
            "end": max(r.end for r in results),
            "latencies": [round(r.end - r.start, 5) for r in results if not r.error],
            "failed": len(errors),
            "first_error": errors[0] if errors else None,
        },
    )


# -- the orchestrator ----------------------------------------------------------------------------


class Child:
    """A process of this script in another role, its JSON lines read by a thread of ours."""

    def __init__(
        self, args: list[str], env: dict[str, str], inbox: queue.Queue[Any], session: bool = False
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # torch's clients log a line per failed rank
            text=True,
            env={**benchlib.child_env(), **env},
            start_new_session=session,
        )
        self.pid = self.process.pid
        self.inbox = inbox
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                self.inbox.put((self, json.loads(line)))
        self.inbox.put((self, None))

    def send(self, message: dict[str, Any] | str) -> None:
        assert self.process.stdin is not None
        text = message if isinstance(message, str) else json.dumps(message)
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


def next_message(inbox: queue.Queue[Any], deadline: float) -> tuple[Child, dict[str, Any]]:
    try:
        sender, message = inbox.get(timeout=max(deadline - time.monotonic(), 0.001))
    except queue.Empty:
        raise TimeoutError("no answer in time") from None
    if message is None:
        raise RuntimeError(f"pid {sender.pid} ended (exit {sender.process.wait()})")
    return sender, message


def answers(inbox: queue.Queue[Any], count: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    return [next_message(inbox, deadline)[1] for _ in range(count)]


class Pool:
    """The client processes of one R, kept across servers and repetitions."""

    def __init__(self, count: int, cpus: str) -> None:
        self.count, self.cpus = count, cpus
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.children: list[Child] = []

    def start(self) -> None:
        self.inbox = queue.Queue()  # nothing of a killed pool's children is read
        self.children = [
            Child(["--role", "worker"], {"WS_CPUS": self.cpus}, self.inbox)
            for _ in range(self.count)
        ]
        answers(self.inbox, self.count, 300)

    def pids(self) -> list[int]:
        return [worker.pid for worker in self.children]

    def stop(self) -> None:
        for worker in self.children:
            worker.kill()
        self.children = []


@dataclass
class Row:
    server: str
    ranks: int
    rep: int
    ok: bool
    apart: bool | None = None
    """The store in a process of its own (torch's always is)."""
    init_s: float | None = None
    rank_p50_s: float | None = None
    rank_max_s: float | None = None
    store_cpu_s: float | None = None
    store_peak_rss_mib: float | None = None
    store_pss_idle_mib: float | None = None
    """ftd's store processes (this attempt's and the next) before the init; 0 on the loop."""
    daemon_cpu_s: float | None = None
    lag: dict[str, Any] | None = None
    failed_ranks: int = 0
    first_error: str | None = None
    client_cpu_s: float | None = None
    others_cores: float | None = None
    """CPU the rest of the machine used during the init, in cores."""
    listen_overflows: int | None = None
    quiet_wait_s: float = 0.0
    contended: bool = False


def addresses_for(world: int) -> list[str]:
    per_address = min(PORTS_PER_ADDRESS, ephemeral_ports() * 3 // 4)
    return [f"127.0.0.{1 + i}" for i in range(math.ceil(world / per_address))]


def start_server(kind: str, world: int, bind: str, pin: bool) -> tuple[Child, dict[str, Any]]:
    args = ["--role", "server", "--kind", kind, "--world", str(world), "--bind", bind]
    inbox: queue.Queue[Any] = queue.Queue()
    # A session of its own, as a daemon's is (its ranks start sessions of their own): with
    # autogroups (kernel.sched_autogroup_enabled) the scheduler shares a CPU between sessions
    # first, and the clients' thousands of threads would weigh on the daemon's share.
    server = Child(args, {"WS_PIN": "1" if pin else "0"}, inbox, session=True)
    return server, answers(inbox, 1, 180)[0]


def run_once(kind: str, world: int, rep: int, pool: Pool, config: argparse.Namespace) -> Row:
    addresses = addresses_for(world)
    # one destination address has too few ephemeral ports for R clients: ftd's store then
    # listens on every interface (torch's master always does)
    bind = "127.0.0.1" if len(addresses) == 1 else "0.0.0.0"
    row = Row(kind, world, rep, ok=False)
    server, hello = start_server(kind, world, bind, config.pin)
    try:
        row.apart = hello["apart"]
        row.store_pss_idle_mib = hello.get("pss")
        store_pid = int(hello["store_pid"])
        prepare(pool, world, int(hello["port"]), addresses, config)
        row.quiet_wait_s = wait_quiet(config.quiet_wait)
        before, daemon_before = proc_stats(store_pid), cpu_s(server.pid)
        busy_before, clients_before = machine_busy_s(), pids_cpu_s(pool.pids())
        mine_before = cpu_s(os.getpid())
        overflows_before = listen_overflows()
        go = time.monotonic()
        for worker in pool.children:
            worker.send({"cmd": "go"})
        summaries = collect(pool, config)
        end = time.monotonic()
        after = proc_stats(store_pid)
        fill_row(row, summaries, before, after, go)
        row.daemon_cpu_s = round(cpu_s(server.pid) - daemon_before, 2)
        row.client_cpu_s = round(pids_cpu_s(pool.pids()) - clients_before, 2)
        row.listen_overflows = listen_overflows() - overflows_before
        ours = row.client_cpu_s + (after.cpu_s - before.cpu_s) + cpu_s(os.getpid()) - mine_before
        ours += row.daemon_cpu_s if row.apart and kind != "torch" else 0.0
        others = machine_busy_s() - busy_before - ours
        row.others_cores = round(max(others, 0.0) / (end - go), 2)
        row.contended = row.others_cores > QUIET_CORES
        server.send(f"lag {go} {end}")
        row.lag = answers(server.inbox, 1, 60)[0]["lag"]
        if row.ok:
            release(pool)
        else:  # its clients may still block in a wait: the next run gets a fresh pool
            pool.stop()
    finally:
        stop_server(server)
    return row


def prepare(
    pool: Pool, world: int, port: int, addresses: list[str], config: argparse.Namespace
) -> None:
    count = len(pool.children)
    bounds = [world * i // count for i in range(count + 1)]
    common = {
        "cmd": "prepare",
        "world": world,
        "port": port,
        "addresses": addresses,
        "timeout_s": config.timeout,
    }
    for i, worker in enumerate(pool.children):
        worker.send({**common, "first": bounds[i], "last": bounds[i + 1]})
    for answer in answers(pool.inbox, count, 300):
        if answer.get("nofile_problem"):
            raise RuntimeError(f"client: {answer['nofile_problem']}")


def collect(pool: Pool, config: argparse.Namespace) -> list[dict[str, Any]]:
    """Every client process's 'done'; once one says it is failing, the others get a grace
    period (the ranks left wait for keys that will not come until their timeout)."""
    deadline = time.monotonic() + config.timeout + 60
    summaries: list[dict[str, Any]] = []
    failing: list[str] = []
    while len(summaries) < len(pool.children):
        try:
            _, message = next_message(pool.inbox, deadline)
        except TimeoutError:
            why = f"unfinished after: {failing[0]}" if failing else "unfinished: timeout"
            return [*summaries, {"failed": -1, "first_error": why}]
        if "failing" in message:
            failing.append(message["failing"])
            deadline = min(deadline, time.monotonic() + config.grace)
            continue
        summaries.append(message)
    return summaries


def fill_row(
    row: Row, summaries: list[dict[str, Any]], before: ProcStats, after: ProcStats, go: float
) -> None:
    row.store_cpu_s = round(after.cpu_s - before.cpu_s, 2)
    row.store_peak_rss_mib = round(after.hwm_mib, 1)
    row.failed_ranks = sum(max(s["failed"], 0) for s in summaries)
    errors = [s["first_error"] for s in summaries if s.get("first_error")]
    row.first_error = errors[0] if errors else None
    if row.failed_ranks or any(s["failed"] < 0 for s in summaries) or not summaries:
        return
    latencies = sorted(lat for s in summaries for lat in s["latencies"])
    row.ok = True
    row.init_s = round(max(s["end"] for s in summaries) - go, 3)
    row.rank_p50_s = round(latencies[len(latencies) // 2], 3)
    row.rank_max_s = round(latencies[-1], 3)


def release(pool: Pool) -> None:
    for worker in pool.children:
        worker.send({"cmd": "release"})
    answers(pool.inbox, len(pool.children), 120)


def stop_server(server: Child) -> None:
    with contextlib.suppress(Exception):
        server.send("stop")
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()


def client_cpus(pin: bool) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(cpu) for cpu in (cpus[1:] if pin and len(cpus) > 1 else cpus))


def run_world(world: int, config: argparse.Namespace, out: dict[str, Any]) -> None:
    problems = limits_for(world)
    if problems:
        out["skipped"].append({"ranks": world, "why": problems})
        print(f"R={world}: skipped: {'; '.join(problems)}", file=sys.stderr, flush=True)
        return
    pool = Pool(max(2, min(16, math.ceil(world / 2048))), client_cpus(config.pin))
    try:
        for rep in range(config.reps):
            kinds = config.server if rep % 2 == 0 else list(reversed(config.server))
            for kind in kinds:
                for _ in range(config.tries):
                    row = run_guarded(kind, world, rep, pool, config)
                    out["rows"].append(asdict(row))
                    print_row(row)
                    write_json(config.json, out)
                    if not row.contended:
                        break
    finally:
        pool.stop()


def run_guarded(kind: str, world: int, rep: int, pool: Pool, config: argparse.Namespace) -> Row:
    if not pool.children:
        pool.start()
    try:
        return run_once(kind, world, rep, pool, config)
    except (RuntimeError, TimeoutError) as error:  # this run only: said, not fatal
        pool.stop()
        return Row(kind, world, rep, ok=False, first_error=f"bench: {error}")


def print_row(row: Row) -> None:
    lag = row.lag or {}
    state = "ok" if row.ok else f"FAILED {row.failed_ranks} ranks: {row.first_error}"
    print(
        f"R={row.ranks:>6} {row.server:>11} rep {row.rep}: init {row.init_s} s (rank p50 "
        f"{row.rank_p50_s} max {row.rank_max_s}), store cpu {row.store_cpu_s} s, rss peak "
        f"{row.store_peak_rss_mib} MiB, pss idle {row.store_pss_idle_mib} MiB, daemon cpu "
        f"{row.daemon_cpu_s} s, lag max {lag.get('max_ms')} ms (waiting for a CPU "
        f"{lag.get('max_cpu_wait_ms')} ms) p99 {lag.get('p99_ms')} ms, "
        f"clients cpu {row.client_cpu_s} s, others {row.others_cores} cores, overflows "
        f"{row.listen_overflows}{' CONTENDED' if row.contended else ''}  [{state}]",
        flush=True,
    )


def median_max(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return round(statistics.median(values), 3), round(max(values), 3)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and max over the repetitions of each (server, R), uncontended ones first, and
    ftd's ratios to torch's."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["server"], row["ranks"]), []).append(row)
    summary = []
    for (server, ranks), group in groups.items():
        good = [row for row in group if row["ok"] and not row["contended"]]
        entry: dict[str, Any] = {"server": server, "ranks": ranks, "runs": len(group)}
        entry["contended"] = not good
        good = good or [row for row in group if row["ok"]]
        entry["ok"] = len(good)
        entry["apart"] = next((row["apart"] for row in group if row["apart"] is not None), None)
        for metric in ("init_s", "rank_p50_s", "rank_max_s", "store_cpu_s", "daemon_cpu_s"):
            values = [row[metric] for row in good if row[metric] is not None]
            entry[f"{metric}_median"], entry[f"{metric}_max"] = median_max(values)
        for metric in ("store_peak_rss_mib", "store_pss_idle_mib", "others_cores"):
            values = [row[metric] for row in good if row[metric] is not None]
            entry[f"{metric}_max"] = max(values) if values else None
        lags = [row["lag"] for row in good if row["lag"] and row["lag"].get("ticks")]
        entry["lag_max_ms_median"], entry["lag_max_ms_max"] = median_max(
            [lag["max_ms"] for lag in lags]
        )
        entry["lag_p99_ms_max"] = max((lag["p99_ms"] for lag in lags), default=None)
        worst = max(lags, key=lambda lag: float(lag["max_ms"]), default=None)
        entry["lag_max_cpu_wait_ms"] = worst["max_cpu_wait_ms"] if worst else None
        entry["first_error"] = next(
            (row["first_error"] for row in group if row["first_error"]), None
        )
        summary.append(entry)
    torch = {e["ranks"]: e for e in summary if e["server"] == "torch"}
    for entry in summary:
        base = torch.get(entry["ranks"], {})
        for metric in ("init_s", "store_cpu_s"):
            mine, theirs = entry[f"{metric}_median"], base.get(f"{metric}_median")
            ratio = round(mine / theirs, 2) if mine and theirs else None
            entry[f"{metric}_vs_torch"] = ratio
    return summary


def pair(first: Any, second: Any) -> str:
    return f"{first} / {second}" if first is not None else NONE


COLUMNS: list[tuple[str, Any]] = [
    ("R", lambda e: e["ranks"]),
    ("server", lambda e: e["server"] + ("" if e["server"] == "torch" else
                                        " (process)" if e["apart"] else " (loop)")),
    ("ok", lambda e: f"{e['ok']}/{e['runs']}{'*' if e['contended'] else ''}"),
    ("init s med / max", lambda e: pair(e["init_s_median"], e["init_s_max"])),
    ("init ÷ torch", lambda e: e["init_s_vs_torch"] or NONE),
    ("rank p50 / max s", lambda e: pair(e["rank_p50_s_median"], e["rank_max_s_median"])),
    ("store CPU s med / max", lambda e: pair(e["store_cpu_s_median"], e["store_cpu_s_max"])),
    ("CPU ÷ torch", lambda e: e["store_cpu_s_vs_torch"] or NONE),
    ("store RSS MiB", lambda e: e["store_peak_rss_mib_max"]),
    ("PSS apart MiB", lambda e: e["store_pss_idle_mib_max"] if e["server"] != "torch" else NONE),
    ("daemon lag ms med / max", lambda e: pair(e["lag_max_ms_median"], e["lag_max_ms_max"])),
    ("of which CPU wait ms", lambda e: e["lag_max_cpu_wait_ms"] if e["lag_max_ms_max"] else NONE),
    ("others cores", lambda e: e["others_cores_max"]),
]  # fmt: skip


def table(summary: list[dict[str, Any]]) -> str:
    """The summary as a markdown table (bench/WORKERS_STORE.md's)."""
    order = {name: i for i, name in enumerate(SERVERS)}
    entries = sorted(summary, key=lambda e: (e["ranks"], order.get(e["server"], 9)))
    lines = [
        "| " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for entry in entries:
        lines.append("| " + " | ".join(str(cell(entry)) for _, cell in COLUMNS) + " |")
        if not entry["ok"]:
            lines.append(f"<!-- {entry['server']} at {entry['ranks']}: {entry['first_error']} -->")
    return "\n".join(lines)


def write_json(path: str | None, out: dict[str, Any]) -> None:
    if path:
        out["summary"] = summarize(out["rows"])
        benchlib.write_atomic(Path(path), json.dumps(out, indent=1) + "\n")


DNS_STUB = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


def without_dns() -> None:
    """Run this script again in a mount namespace of its own whose resolv.conf names no server.

    torch's client socket looks names up as it connects (a reverse lookup for its log line);
    this sandbox's DNS server drops bursts of them, and each dropped one stalls a rank for the
    resolver's 5 s timeout (1,024 ranks took 10-100 s against either server): a cost of the
    clients' machine, not of the store."""
    if os.environ.get("WS_NO_DNS") or os.geteuid() != 0 or not shutil.which("unshare"):
        return
    stub = Path(tempfile.mkstemp(prefix="ws-resolv-")[1])
    stub.write_text(DNS_STUB)
    script = 'mount --bind "$0" /etc/resolv.conf && rm "$0" && exec "$@"'
    os.environ["WS_NO_DNS"] = str(stub)
    argv = ["unshare", "-m", "sh", "-c", script, str(stub), sys.executable, *sys.argv]
    os.execvp("unshare", argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", default="1024,4096,8192,16384")
    parser.add_argument("--server", default="torch,ftd,ftd-loop", help=", ".join(SERVERS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180.0, help="the ranks' store timeout")
    parser.add_argument("--grace", type=float, default=15.0, help="after a rank fails")
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--tries", type=int, default=3, help="runs of a contended repetition")
    parser.add_argument(
        "--quiet-wait", type=float, default=180.0, help="most seconds to wait for an idle machine"
    )
    parser.add_argument(
        "--role", choices=("orchestrate", "server", "worker"), default="orchestrate"
    )
    parser.add_argument("--kind", default="ftd", choices=SERVERS)
    parser.add_argument("--world", type=int, default=0)
    parser.add_argument("--bind", default="127.0.0.1")
    args = parser.parse_args()
    if args.role == "server":
        serve(args.kind, args.world, args.bind)
        return
    if args.role == "worker":
        work()
        return
    without_dns()
    args.server = args.server.split(",")
    unknown = set(args.server) - set(SERVERS)
    if unknown:
        parser.error(f"unknown --server {sorted(unknown)}: {', '.join(SERVERS)}")
    info = benchlib.machine()
    info.update(
        pid_max=str(read_int("/proc/sys/kernel/pid_max")),
        nofile=str(resource.getrlimit(resource.RLIMIT_NOFILE)),
        ephemeral_ports=str(ephemeral_ports()),
        somaxconn=str(read_int("/proc/sys/net/core/somaxconn")),
    )
    benchlib.print_machine(info)
    out: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": info,
        "pinned": args.pin,
        "rows": [],
        "skipped": [],
    }
    for world in (int(r) for r in args.ranks.split(",")):
        run_world(world, args, out)
    write_json(args.json, out)
    print()
    print(table(summarize(out["rows"])))
    for skipped in out["skipped"]:
        print(f"R={skipped['ranks']}: not run: {'; '.join(skipped['why'])}")


if __name__ == "__main__":
    main()
