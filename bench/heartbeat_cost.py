"""What a heartbeat and a section pair cost a rank, beside two floors measured in the same
run: a raw unix datagram `sendto` of the same bytes, and a raw `send` on a connected unix
packet (SOCK_SEQPACKET) socket, the transport ftd_client uses.

    python bench/heartbeat_cost.py [--blocks 200] [--calls 1000]

Without FTD_SOCKET in the environment the script launches `ftd serve` (one rank) with itself as
the training script, waits, and prints the table; as that rank it does the measuring.

Method. Each block makes `--calls` calls of one method; methods are interleaved block by block
in a shuffled order, and the per-call figure is the median over blocks (perf_counter_ns).
Calls go in chunks of CHUNK messages, and after each chunk (outside the timed region) the
receiver is emptied: a unix datagram queue holds only net.unix.max_dgram_qlen + 1 messages
(11 here), so timing 1000 back-to-back datagrams would time mostly the EAGAIN path. Receivers:

* `daemon`: the real daemon ($FTD_SOCKET, SOCK_SEQPACKET), which decodes and dispatches every
  message on another core, as in training; between chunks the rank waits until it has taken
  every message (SIOCOUTQ on the sending socket is 0). Beside the client, a raw packet
  connection of this rank's own to the daemon.
* `sink`: sockets this rank binds and drains itself between chunks, so nothing else runs while
  a chunk is timed: a SOCK_DGRAM socket (floor 1: `sendto(bytes, path)`, and a connected
  `send`), and a SOCK_SEQPACKET listener whose accepted connections it drains (floor 2: a raw
  `send` on a connected packet socket; and a RankClient pointed at it).

The maximum single call is taken from individually timed calls in three states: the daemon
serving, the daemon SIGSTOPped (each connection's queue fills up to SO_SNDBUF, then every send
fails with EAGAIN: a counted drop), and no listener at all (connect fails: ENOENT /
ECONNREFUSED; a reset connection: EPIPE; the client's reconnect attempt once a second).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import random
import resource
import signal
import socket
import statistics
import struct
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib

CHUNK = 8
"""Messages per timed chunk: below the unix datagram queue limit (11 on this machine), which
the datagram floors are held to (the packet sockets are not; the same chunk keeps them alike)."""
SECTION = "step"

HB_DAEMON = "daemon: heartbeat()"
RAW_DAEMON = "daemon: raw SEQPACKET send(hb), own connection"
PAIR_DAEMON = "daemon: start_section+end_section"
RAW_PAIR_DAEMON = "daemon: raw SEQPACKET send(ss)+send(se)"
SENDTO = "sink: DGRAM sendto(hb, path) [floor 1]"
DGRAM_SEND = "sink: DGRAM send(hb), connected"
SEQ_SEND = "sink: SEQPACKET send(hb) [floor 2]"
SEQ_PAIR = "sink: SEQPACKET send(ss)+send(se)"
HB_SINK = "sink: heartbeat() (client on the SEQPACKET sink)"
PAIR_SINK = "sink: start_section+end_section (SEQPACKET sink)"

RATIOS = [
    # (label, numerator, denominator, how many denominator sends the numerator makes)
    ("daemon: heartbeat() / DGRAM sendto [goal <= 1.5]", HB_DAEMON, SENDTO, 1),
    ("daemon: heartbeat() / SEQPACKET send, sink [floor 2]", HB_DAEMON, SEQ_SEND, 1),
    ("daemon: heartbeat() / raw SEQPACKET send, daemon", HB_DAEMON, RAW_DAEMON, 1),
    ("daemon: heartbeat() / DGRAM send, connected", HB_DAEMON, DGRAM_SEND, 1),
    ("daemon: section event / DGRAM sendto [goal <= 1.5]", PAIR_DAEMON, SENDTO, 2),
    ("daemon: section pair / raw SEQPACKET pair, daemon", PAIR_DAEMON, RAW_PAIR_DAEMON, 1),
    ("sink: heartbeat() / DGRAM sendto [goal <= 1.5]", HB_SINK, SENDTO, 1),
    ("sink: heartbeat() / SEQPACKET send [floor 2]", HB_SINK, SEQ_SEND, 1),
    ("sink: section pair / SEQPACKET send pair", PAIR_SINK, SEQ_PAIR, 1),
    ("SEQPACKET send / DGRAM sendto (the two floors, sink)", SEQ_SEND, SENDTO, 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1000, help="calls per block")
    parser.add_argument("--single-calls", type=int, default=20000)
    parser.add_argument("--stopped-s", type=float, default=2.0, help="daemon SIGSTOPped for")
    parser.add_argument("--work-dir", default="/tmp/ftd-bench/heartbeat_cost")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if benchlib.under_ftd():
        rank_main(args)
    else:
        launch(args)


# -- the launcher ------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> None:
    work = benchlib.fresh_dir(Path(args.work_dir))
    info = benchlib.machine()
    script_args = [
        "--blocks", str(args.blocks), "--calls", str(args.calls),
        "--single-calls", str(args.single_calls), "--stopped-s", str(args.stopped_s),
        "--work-dir", str(work),
    ]  # fmt: skip
    daemon = benchlib.serve(
        work, "hbcost", Path(__file__).resolve(), script_args,
        "--nproc-per-node", "1", "--max-restarts", "0",
        "--ft-param-rank_heartbeat_timeout=60",
    )  # fmt: skip
    benchlib.write_atomic(work / "daemon.pid", str(daemon.pid))
    code = daemon.wait(timeout=1800)
    if code != 0:
        sys.exit(f"ftd serve exited {code}; see {work}/hbcost.err and {work}/hbcost/")
    results = json.loads((work / "result.json").read_text())
    results["machine"] = info
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def report(results: dict[str, Any]) -> None:
    benchlib.print_machine(results["machine"])
    print(f"# {results['blocks']} blocks x {results['calls']} calls per method, chunks of {CHUNK}")
    print(f"# SOCK_SEQPACKET SO_SNDBUF: {results['seqpacket_sndbuf']} B")
    print()
    print(
        f"{'method (µs per call, over blocks)':<52} {'median':>8} {'p10':>8} {'p90':>8} "
        f"{'min':>8} {'max':>8} {'drops':>6} {'chunk med':>9}"
    )
    for name, row in results["per_call_us"].items():
        print(
            f"{name:<52} {row['median']:>8.3f} {row['p10']:>8.3f} {row['p90']:>8.3f} "
            f"{row['min']:>8.3f} {row['max']:>8.3f} {row['drops']:>6} {row['chunk_median']:>9.3f}"
        )
    print()
    print("ratios of the medians over blocks:")
    for name, value in results["ratios"].items():
        print(f"  {name:<60} {value:6.2f}x")
    print(f"ratios of the medians over chunks (of {CHUNK} messages; robust to preemption):")
    for name, value in results["chunk_ratios"].items():
        print(f"  {name:<60} {value:6.2f}x")
    print()
    print("single calls, each timed alone (µs); 'quiet max' = the longest call with no context")
    print("switch of this thread during it; 'blocked' = voluntary switches inside heartbeat()")
    print(f"{'state':<44} {'calls':>7} {'drops':>7} {'p99':>6} {'p99.9':>6} {'max':>8} "
          f"{'>1ms':>5} {'quiet max':>9} {'blocked':>7} {'floor max':>9} {'floor >1ms':>10} "
          f"{'floor quiet max':>15}")  # fmt: skip
    for name, row in results["single_call_us"].items():
        print(
            f"{name:<44} {row['calls']:>7} {row['drops']:>7} {row['p99']:>6.1f} "
            f"{row['p999']:>6.1f} {row['max']:>8.1f} {row['over_1ms']:>5} "
            f"{row['max_unswitched']:>9.1f} {row['blocked']:>7} {row['floor_max']:>9.1f} "
            f"{row['floor_over_1ms']:>10} {row['floor_max_unswitched']:>15.1f}"
        )
    for name, row in results["single_call_us"].items():
        if "queued_before_first_drop" in row:
            queued = row["queued_before_first_drop"]
            print(f"{name}: {queued} heartbeats queued before the first drop")


# -- the rank ----------------------------------------------------------------------------------


def outq(sock: socket.socket) -> int:
    """Bytes this socket sent that the receiver has not yet taken (SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])


def wait_taken(sock: socket.socket) -> None:
    spins = 0
    while outq(sock):
        spins += 1
        if spins > 20:
            time.sleep(0)
        if spins > 200_000:
            raise TimeoutError("the receiver stopped taking datagrams")


def drain(sink: socket.socket) -> None:
    while True:
        try:
            if not sink.recv(65536):
                return  # a packet connection whose peer closed
        except BlockingIOError:
            return


class Method:
    """One way of sending, timed in chunks with the receiver emptied between chunks."""

    def __init__(
        self,
        name: str,
        calls: Callable[[int], None],
        per_call: int,
        sock: socket.socket,
        drops: Callable[[], int],
        sink: socket.socket | None = None,
    ) -> None:
        self.name, self.calls, self.sock, self.drops, self.sink = name, calls, sock, drops, sink
        self.chunk = max(1, CHUNK // per_call)  # calls per chunk
        self.block_us: list[float] = []
        self.chunk_ns: list[int] = []
        """Each chunk's time (ns): their median shrugs off the chunks the scheduler preempted."""
        self.dropped = 0

    def block(self, n: int) -> None:
        calls, chunk, sock, sink = self.calls, self.chunk, self.sock, self.sink
        clock = time.perf_counter_ns
        before = self.drops()
        total = 0
        done = 0
        chunks = self.chunk_ns
        while done < n:
            k = min(chunk, n - done)
            t0 = clock()
            calls(k)
            elapsed = clock() - t0
            total += elapsed
            if k == chunk:
                chunks.append(elapsed)
            if sink is not None:
                drain(sink)
            else:
                wait_taken(sock)
            done += k
        self.dropped += self.drops() - before
        self.block_us.append(total / n / 1000)


def rank_main(args: argparse.Namespace) -> None:
    from ftd_client import RankClient, protocol, wire
    from ftd_client.messages import SectionEnd, SectionStart

    work = Path(args.work_dir)
    path = os.environ["FTD_SOCKET"]
    hb_bytes = protocol.HEARTBEAT_BYTES
    ss_bytes = wire.encode(SectionStart(SECTION))
    se_bytes = wire.encode(SectionEnd(SECTION))

    # The real daemon: the client, and a raw packet connection of this rank's own beside it
    # (the daemon knows the pid by SO_PEERCRED, so it dispatches what arrives on it too).
    client = RankClient()
    daemon_raw = seqpacket_connect(path)

    # Floor 1: unix datagrams to a socket this rank binds and drains itself.
    dgram_path = str(work / "dgram_sink.sock")
    dgram_sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram_sink.bind(dgram_path)
    dgram_sink.setblocking(False)
    dgram_unconnected = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram_unconnected.setblocking(False)
    dgram_connected = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram_connected.setblocking(False)
    dgram_connected.connect(dgram_path)

    # Floor 2: a packet socket this rank listens on; it accepts and drains each connection.
    seq_path = str(work / "seq_sink.sock")
    seq_listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    seq_listener.bind(seq_path)
    seq_listener.listen(16)
    seq_raw = seqpacket_connect(seq_path)
    seq_raw_peer = accept(seq_listener)
    sink_client = RankClient(socket_path=seq_path)
    sink_client_peer = accept(seq_listener)
    for sink in (dgram_sink, seq_raw_peer, sink_client_peer):
        drain(sink)
    assert client._sock is not None and sink_client._sock is not None

    def make_raw(send: Callable[..., int], *data: bytes) -> Callable[[int], None]:
        if len(data) == 1:
            (one,) = data

            def calls(n: int) -> None:
                for _ in range(n):
                    send(one)
        else:
            first, second = data

            def calls(n: int) -> None:
                for _ in range(n):
                    send(first)
                    send(second)

        return calls

    def make_sendto(data: bytes) -> Callable[[int], None]:
        sendto = dgram_unconnected.sendto

        def calls(n: int) -> None:
            for _ in range(n):
                sendto(data, dgram_path)

        return calls

    def heartbeats(c: RankClient) -> Callable[[int], None]:
        heartbeat = c.heartbeat

        def calls(n: int) -> None:
            for _ in range(n):
                heartbeat()

        return calls

    def section_pairs(c: RankClient) -> Callable[[int], None]:
        start, end = c.start_section, c.end_section

        def calls(n: int) -> None:
            for _ in range(n):
                start(SECTION)
                end(SECTION)

        return calls

    def with_sections(c: RankClient) -> Callable[[int], None]:
        section = c.section

        def calls(n: int) -> None:
            for _ in range(n):
                with section(SECTION):
                    pass

        return calls

    def client_drops(c: RankClient) -> Callable[[], int]:
        return lambda: c.dropped

    def no_drops() -> int:  # a raw send raises on a full queue; none is expected
        return 0

    hb_drops, sink_drops = client_drops(client), client_drops(sink_client)
    csock = client._sock
    methods = [
        Method(HB_DAEMON, heartbeats(client), 1, csock, hb_drops),
        Method(RAW_DAEMON, make_raw(daemon_raw.send, hb_bytes), 1, daemon_raw, no_drops),
        Method("daemon: client's own socket .send(hb)", make_raw(csock.send, hb_bytes), 1, csock,
               no_drops),
        Method(PAIR_DAEMON, section_pairs(client), 2, csock, hb_drops),
        Method(RAW_PAIR_DAEMON, make_raw(daemon_raw.send, ss_bytes, se_bytes), 2, daemon_raw,
               no_drops),
        Method("daemon: with section(): pass", with_sections(client), 2, csock, hb_drops),
        Method(SENDTO, make_sendto(hb_bytes), 1, dgram_unconnected, no_drops, dgram_sink),
        Method(DGRAM_SEND, make_raw(dgram_connected.send, hb_bytes), 1, dgram_connected,
               no_drops, dgram_sink),
        Method(SEQ_SEND, make_raw(seq_raw.send, hb_bytes), 1, seq_raw, no_drops, seq_raw_peer),
        Method(SEQ_PAIR, make_raw(seq_raw.send, ss_bytes, se_bytes), 2, seq_raw, no_drops,
               seq_raw_peer),
        Method(HB_SINK, heartbeats(sink_client), 1, sink_client._sock, sink_drops,
               sink_client_peer),
        Method(PAIR_SINK, section_pairs(sink_client), 2, sink_client._sock, sink_drops,
               sink_client_peer),
    ]  # fmt: skip

    for method in methods:  # warm up: caches, branch predictors, the daemon's code paths
        method.block(args.calls)
        method.block_us.clear()
        method.chunk_ns.clear()
        method.dropped = 0
    order = list(methods)
    shuffler = random.Random(0)
    for _ in range(args.blocks):
        shuffler.shuffle(order)
        for method in order:
            method.block(args.calls)

    per_call = {
        m.name: {
            **benchlib.summary(m.block_us),
            "p10": quantile(m.block_us, 0.1),
            "p90": quantile(m.block_us, 0.9),
            "chunk_median": statistics.median(m.chunk_ns) / m.chunk / 1000,
            "drops": m.dropped,
            "blocks_us": [round(v, 4) for v in m.block_us],
        }
        for m in methods
    }
    med = {m.name: statistics.median(m.block_us) for m in methods}
    chunk_med = {m.name: statistics.median(m.chunk_ns) / m.chunk for m in methods}
    ratios = {label: med[a] / (k * med[b]) for label, a, b, k in RATIOS}
    chunk_ratios = {label: chunk_med[a] / (k * chunk_med[b]) for label, a, b, k in RATIOS}
    single = {
        "daemon serving": single_serving(client, daemon_raw, hb_bytes, args.single_calls),
        "daemon SIGSTOPped": single_stopped(client, daemon_raw, hb_bytes, work, args.stopped_s),
    }
    single.update(single_no_listener(work, hb_bytes))
    client.close()
    sink_client.close()
    result = {
        "blocks": args.blocks,
        "calls": args.calls,
        "seqpacket_sndbuf": sndbuf(),
        "per_call_us": per_call,
        "ratios": ratios,
        "chunk_ratios": chunk_ratios,
        "single_call_us": single,
    }
    benchlib.write_atomic(work / "result.json", json.dumps(result, indent=2))


def sndbuf() -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        return int(probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))


def seqpacket_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    sock.connect(path)
    return sock


def accept(listener: socket.socket) -> socket.socket:
    conn, _ = listener.accept()
    conn.setblocking(False)
    return conn


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    n = len(ordered)
    return {
        "p99": ordered[min(n - 1, int(n * 0.99))] / 1000,
        "p999": ordered[min(n - 1, int(n * 0.999))] / 1000,
        "max": ordered[-1] / 1000,
    }


def time_calls(
    heartbeat: Callable[[], None],
    floor: Callable[[], None],
    keep_going: Callable[[int], bool],
    between: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Time each heartbeat and each floor send alone, with this thread's context switches
    (getrusage) around each: a call that blocked shows a voluntary switch, one that the
    scheduler preempted (the machine is shared) an involuntary one."""
    clock = time.perf_counter_ns
    usage, thread = resource.getrusage, resource.RUSAGE_THREAD
    hb_ns: list[int] = []
    hb_quiet_ns: list[int] = []
    floor_ns: list[int] = []
    floor_quiet_ns: list[int] = []
    blocked = preempted = 0
    i = 0
    while keep_going(i):
        r0 = usage(thread)
        t0 = clock()
        heartbeat()
        t1 = clock()
        r1 = usage(thread)
        t2 = clock()
        floor()
        t3 = clock()
        r2 = usage(thread)
        hb_ns.append(t1 - t0)
        floor_ns.append(t3 - t2)
        blocked += r1.ru_nvcsw - r0.ru_nvcsw
        if r1.ru_nivcsw == r0.ru_nivcsw and r1.ru_nvcsw == r0.ru_nvcsw:
            hb_quiet_ns.append(t1 - t0)
        else:
            preempted += r1.ru_nivcsw - r0.ru_nivcsw
        if r2.ru_nivcsw == r1.ru_nivcsw and r2.ru_nvcsw == r1.ru_nvcsw:
            floor_quiet_ns.append(t3 - t2)
        if between is not None:
            between(i)
        i += 1
    return {
        "calls": len(hb_ns),
        **percentiles(hb_ns),
        "over_1ms": sum(1 for t in hb_ns if t > 1_000_000),
        "max_unswitched": max(hb_quiet_ns) / 1000,
        "blocked": blocked,
        "preempted": preempted,
        "floor_max": max(floor_ns) / 1000,
        "floor_over_1ms": sum(1 for t in floor_ns if t > 1_000_000),
        "floor_max_unswitched": max(floor_quiet_ns) / 1000,
    }


def for_seconds(seconds: float) -> Callable[[int], bool]:
    end = time.monotonic() + seconds
    return lambda i: i % 100 or time.monotonic() < end


def quiet(send: Callable[[], Any]) -> Callable[[], None]:
    def floor() -> None:
        with contextlib.suppress(OSError):  # a full queue or no listener, as for the client
            send()

    return floor


def single_serving(client: Any, raw: socket.socket, data: bytes, n: int) -> dict[str, Any]:
    """The daemon serving; its queues emptied every CHUNK messages (outside the timing)."""

    def between(i: int) -> None:
        if i % (CHUNK // 2) == CHUNK // 2 - 1:
            wait_taken(client._sock)
            wait_taken(raw)

    before = client.dropped
    row = time_calls(client.heartbeat, quiet(lambda: raw.send(data)), lambda i: i < n, between)
    return {**row, "drops": client.dropped - before}


def single_stopped(
    client: Any, raw: socket.socket, data: bytes, work: Path, seconds: float
) -> dict[str, Any]:
    """The daemon SIGSTOPped: each connection's queue fills up to the sender's SO_SNDBUF, then
    every send fails with EAGAIN. The floor: a raw packet send on this rank's own connection
    to the same stopped daemon."""
    daemon = int(benchlib.wait_for(work / "daemon.pid", 30))
    before = client.dropped
    os.kill(daemon, signal.SIGSTOP)
    try:
        row = time_calls(client.heartbeat, quiet(lambda: raw.send(data)), for_seconds(seconds))
    finally:
        os.kill(daemon, signal.SIGCONT)
    wait_taken(client._sock)
    wait_taken(raw)
    drops = client.dropped - before
    return {**row, "drops": drops, "queued_before_first_drop": row["calls"] - drops}


def single_no_listener(work: Path, data: bytes) -> dict[str, dict[str, Any]]:
    """A client whose daemon is not there: its path never created (connect: ENOENT; sends on
    the unconnected socket: ENOTCONN), and a listener that the client connected to, then closed
    (send: EPIPE/ECONNRESET, then reconnects refused: ECONNREFUSED, the file left behind); each
    for 3 s so that the client's reconnect attempts (one a second) are among the calls timed.
    The floor: a raw unix datagram sendto to the same path, which fails the same way."""
    from ftd_client import RankClient

    results = {}
    gone = str(work / "gone.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(gone)
    listener.listen(16)
    cases = [("no socket file (ENOENT)", str(work / "absent.sock"), None),
             ("listener closed (EPIPE, then ECONNREFUSED)", gone, listener)]  # fmt: skip
    for name, path, to_close in cases:
        client = RankClient(socket_path=path)
        if to_close is not None:
            to_close.close()  # the file stays; the connection is reset, reconnects refused
        floor = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        floor.setblocking(False)
        before = client.dropped
        send_floor = functools.partial(floor.sendto, data, path)
        row = time_calls(client.heartbeat, quiet(send_floor), for_seconds(3.0))
        results[f"no listener: {name}"] = {**row, "drops": client.dropped - before}
        client.close()
        floor.close()
    return results


if __name__ == "__main__":
    main()
