"""ftd's TCPStore server (ftd/tcpstore) against torch's: the same replies, torch's clients, and
what an attacker's bytes do to it.

The differential test sends the same random queries to torch 2.13's own server and to ftd's,
over raw sockets, and wants the same bytes back; torch's C++ client then drives ftd's server
through every operation it has. The attacks each send what a hostile or broken client could
and check that one connection closes, counted, while the store and its other clients go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.tcpstore import server as server_module
from ftd.tcpstore.server import TcpStoreServer
from ftd.tcpstore.state import KEY_OVERHEAD_BYTES, StoreRefused, StoreState
from ftd.tcpstore.wire import (
    MAX_KEY_BYTES,
    MAX_KEYS,
    VALIDATION_MAGIC,
    Command,
    Query,
    QueryDecoder,
    WaitReply,
    encode_query,
)
from tests.conftest import WORKER, ServeFactory
from tests.support.fuzzing import budget, fuzz_target

VALIDATE = encode_query(Query(Command.VALIDATE, number=VALIDATION_MAGIC))


class LoopThread:
    """An event loop in a thread, for a server the test's blocking clients talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout_s: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return self.run(call())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture
def ftd_store(loop_thread: LoopThread) -> Iterator[TcpStoreServer]:
    store: TcpStoreServer = loop_thread.run(TcpStoreServer.start("127.0.0.1"))
    yield store
    loop_thread.run(store.close())


def connect(port: int, validate: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if validate:
        sock.sendall(VALIDATE)
    return sock


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return data


def read_string(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("<Q", read_exactly(sock, 8))
    return read_exactly(sock, size)


def read_reply(sock: socket.socket, query: Query) -> bytes | None:
    """The reply `query` gets, as raw bytes (None: a query without one)."""
    match query.command:
        case Command.SET | Command.APPEND | Command.MULTI_SET | Command.QUEUE_PUSH:
            return None
        case Command.PING:
            return read_exactly(sock, 4)
        case Command.CHECK | Command.CANCEL_WAIT:
            return read_exactly(sock, 1)
        case Command.ADD | Command.GETNUMKEYS | Command.DELETE_KEY | Command.QUEUE_LEN:
            return read_exactly(sock, 8)
        case Command.GET | Command.COMPARE_SET:
            return read_string(sock)
        case Command.MULTI_GET:
            return b"|".join(read_string(sock) for _ in query.keys)
        case Command.QUEUE_POP:
            size = read_exactly(sock, 8)
            return size + (read_string(sock) if size != bytes(8) else b"")
    raise AssertionError(query)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed this connection (waits for it, up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


# -- the same replies as torch's own server -------------------------------------------------

KEYS = st.sampled_from([b"a", b"b", b"n", b"q", b"", b"/k\x00\xff"])
VALUES = st.sampled_from([b"", b"1", b"-7", b" 12x", b"v", b"\x00" * 3, b"9" * 30])
QUERIES = st.one_of(
    st.builds(lambda k, v: Query(Command.SET, (k,), (v,)), KEYS, VALUES),
    st.builds(lambda k, e, v: Query(Command.COMPARE_SET, (k,), (e, v)), KEYS, VALUES, VALUES),
    st.builds(lambda k: Query(Command.GET, (k,)), KEYS),
    st.builds(lambda k, n: Query(Command.ADD, (k,), number=n), st.just(b"n"), st.integers(-9, 9)),
    st.builds(lambda ks: Query(Command.CHECK, tuple(ks)), st.lists(KEYS, min_size=1, max_size=3)),
    st.just(Query(Command.GETNUMKEYS)),
    st.builds(lambda k: Query(Command.DELETE_KEY, (k,)), KEYS),
    st.builds(lambda k, v: Query(Command.APPEND, (k,), (v,)), KEYS, VALUES),
    st.builds(lambda ks: Query(Command.MULTI_GET, tuple(ks)), st.lists(KEYS, max_size=3)),
    st.builds(
        lambda kv: Query(Command.MULTI_SET, tuple(k for k, _ in kv), tuple(v for _, v in kv)),
        st.lists(st.tuples(KEYS, VALUES), max_size=3),
    ),
    st.builds(lambda k, v: Query(Command.QUEUE_PUSH, (k,), (v,)), KEYS, VALUES),
    st.builds(lambda k: Query(Command.QUEUE_POP, (k,)), KEYS),
    st.builds(lambda k: Query(Command.QUEUE_LEN, (k,)), KEYS),
    st.builds(lambda n: Query(Command.PING, number=n), st.integers(0, 2**32 - 1)),
)


@pytest.fixture(scope="module")
def both_servers() -> Iterator[tuple[Any, TcpStoreServer]]:
    from ftd_client.store import tcp_store_server

    thread = LoopThread()
    ours: TcpStoreServer = thread.run(TcpStoreServer.start("127.0.0.1"))
    theirs = tcp_store_server("127.0.0.1")
    yield theirs, ours
    thread.run(ours.close())
    thread.stop()


@settings(max_examples=60, deadline=None)
@given(st.lists(QUERIES, min_size=1, max_size=25))
def test_every_reply_is_torchs(
    both_servers: tuple[Any, TcpStoreServer], queries: list[Query]
) -> None:
    """The same queries, on fresh keys, to torch's server and to ftd's: the same replies, byte
    for byte, and the same connections closed (an ADD to a value that is no number)."""
    theirs, ours = both_servers
    prefix = f"{time.monotonic_ns()}/".encode()
    fresh = [_prefixed(query, prefix) for query in queries]
    replies = []
    for port in (theirs.port, ours.port):
        with connect(port) as sock:
            seen: list[bytes | str | None] = []
            for query in fresh:
                sock.sendall(encode_query(query))
                try:
                    seen.append(read_reply(sock, query))
                except (ConnectionError, TimeoutError):
                    seen.append("closed")
                    break
            replies.append(seen)
    assert replies[0] == replies[1]


def _prefixed(query: Query, prefix: bytes) -> Query:
    return Query(query.command, tuple(prefix + k for k in query.keys), query.values, query.number)


# -- torch's client ----------------------------------------------------------------------------


def test_torchs_client_does_everything_it_can(ftd_store: TcpStoreServer) -> None:
    import torch.distributed as dist
    from ftd_client.store import tcp_store_client

    client = tcp_store_client("127.0.0.1", ftd_store.port, 10)
    other = tcp_store_client("127.0.0.1", ftd_store.port, 10)
    client.set("a", b"1")
    assert client.get("a") == b"1"
    assert (client.add("n", 3), other.add("n", 4)) == (3, 7)
    assert client.compare_set("a", b"1", b"2") == b"2"
    assert client.compare_set("a", b"1", b"3") == b"2"
    assert client.check(["a", "n"]) and not client.check(["a", "never"])
    assert client.num_keys() == 2
    assert client.delete_key("a") and not client.delete_key("a")
    client.append("log", b"x")
    other.append("log", b"y")
    assert client.get("log") == b"xy"
    client.multi_set(["k1", "k2"], [b"v1", b"v2"])
    assert client.multi_get(["k1", "k2", "log"]) == [b"v1", b"v2", b"xy"]
    prefixed = dist.PrefixStore("job", other)
    prefixed.set("k", b"v")
    assert client.get("job/k") == b"v"

    later = threading.Timer(0.05, lambda: other.set("late", b"L"))
    later.start()
    assert client.get("late") == b"L"  # a get of a missing key waits for it
    with pytest.raises(dist.DistStoreError):
        client.wait(["never"], timedelta(seconds=0.2))
    client.set("after", b"cancelled wait")  # the connection is usable after a timed-out wait
    assert client.get("after") == b"cancelled wait"
    assert not ftd_store.refusals


def test_many_clients_meet_at_a_barrier(ftd_store: TcpStoreServer) -> None:
    """Thirty-two clients each add to a counter and wait for the last: every one wakes."""
    from ftd_client.store import tcp_store_client

    clients = [tcp_store_client("127.0.0.1", ftd_store.port, 30) for _ in range(32)]
    woken: list[int] = []

    def arrive(index: int) -> None:
        if clients[index].add("arrived", 1) == len(clients):
            clients[index].set("all_here", b"1")
        clients[index].wait(["all_here"])
        woken.append(index)

    threads = [threading.Thread(target=arrive, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(woken) == list(range(32))


# -- attacks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first_bytes", "cause"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "unknown_command"),
        (encode_query(Query(Command.GET, (b"k",))), "not_validated"),
        (bytes([0]) + struct.pack("<I", 12345), "bad_magic"),
        (VALIDATE + bytes([3]) + struct.pack("<Q", 2**63), "key_too_long"),
        (VALIDATE + bytes([6]) + struct.pack("<Q", MAX_KEYS + 1), "too_many_keys"),
        (VALIDATE + bytes([1, 1]) + bytes(7) + b"k" + struct.pack("<Q", 2**40), "value_too_long"),
        (VALIDATE + VALIDATE, "validated_twice"),
        (VALIDATE + bytes([200]), "unknown_command"),
    ],
)
def test_a_bad_stream_closes_its_connection_alone(
    ftd_store: TcpStoreServer, first_bytes: bytes, cause: str
) -> None:
    with connect(ftd_store.port) as keeper:
        keeper.sendall(encode_query(Query(Command.SET, (b"kept",), (b"yes",))))
        with connect(ftd_store.port, validate=False) as attacker:
            attacker.sendall(first_bytes)
            assert closed(attacker)
        assert ftd_store.refusals[cause] == 1
        query = Query(Command.GET, (b"kept",))
        keeper.sendall(encode_query(query))
        assert read_reply(keeper, query) == b"yes"


def test_a_wait_that_names_too_much_is_refused_before_it_is_held(
    ftd_store: TcpStoreServer,
) -> None:
    """A WAIT whose keys add up past 16 MiB is refused as it arrives, not once it is whole."""
    with connect(ftd_store.port) as attacker:
        attacker.sendall(bytes([Command.WAIT]) + struct.pack("<Q", MAX_KEYS))
        key = struct.pack("<Q", MAX_KEY_BYTES) + b"k" * MAX_KEY_BYTES
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(MAX_KEYS):
                attacker.sendall(key)
    assert ftd_store.refusals["query_too_large"] == 1


def test_a_full_store_refuses_the_writer_and_keeps_what_it_holds(
    loop_thread: LoopThread,
) -> None:
    store: TcpStoreServer = loop_thread.run(TcpStoreServer.start("127.0.0.1", max_bytes=4096))
    try:
        with connect(store.port) as writer:
            writer.sendall(encode_query(Query(Command.SET, (b"first",), (b"x" * 1000,))))
            writer.sendall(encode_query(Query(Command.SET, (b"second",), (b"y" * 4000,))))
            assert closed(writer)
        assert store.refusals["store_full"] == 1
        with connect(store.port) as reader:
            query = Query(Command.MULTI_GET, (b"first", b"second"))
            reader.sendall(encode_query(query))
            assert read_reply(reader, query) == b"x" * 1000 + b"|"
        assert store.state.bytes_held == KEY_OVERHEAD_BYTES + len(b"first") + 1000
    finally:
        loop_thread.run(store.close())


def test_a_client_that_never_reads_is_not_read_from(
    ftd_store: TcpStoreServer, loop_thread: LoopThread
) -> None:
    """Thousands of GETs of a 1 MiB value, never read: the replies held for that connection
    stay near the high-water mark (it is not read from meanwhile), and others are served."""
    value = b"v" * (1 << 20)
    with connect(ftd_store.port) as hog:
        hog.sendall(encode_query(Query(Command.SET, (b"big",), (value,))))
        hog.setblocking(False)
        get = encode_query(Query(Command.GET, (b"big",)))
        sent = 0
        try:
            for _ in range(20000):
                sent += hog.send(get)
        except BlockingIOError:
            pass
        with connect(ftd_store.port) as other:
            other.sendall(encode_query(Query(Command.PING, number=7)))
            assert read_exactly(other, 4) == struct.pack("<I", 7)
        held = loop_thread.call(
            lambda: sum(
                c._transport.get_write_buffer_size()
                for c in ftd_store._connections
                if c._transport is not None
            )
        )
        assert sent > 0
        assert held <= server_module.WRITE_HIGH_WATER_BYTES + 2 * len(value) + 64


def test_connections_past_the_limit_are_closed_and_counted(
    ftd_store: TcpStoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ftd_store, "max_connections", 4)
    kept = [connect(ftd_store.port) for _ in range(4)]
    for sock in kept:  # each is admitted before the next connects
        sock.sendall(encode_query(Query(Command.PING, number=1)))
        read_exactly(sock, 4)
    with connect(ftd_store.port) as extra:
        assert closed(extra)
    assert ftd_store.refusals["too_many_connections"] == 1
    kept[0].sendall(encode_query(Query(Command.PING, number=2)))
    assert read_exactly(kept[0], 4) == struct.pack("<I", 2)
    for sock in kept:
        sock.close()


def test_a_waiter_that_leaves_is_forgotten(
    ftd_store: TcpStoreServer, loop_thread: LoopThread
) -> None:
    with connect(ftd_store.port) as waiter:
        waiter.sendall(encode_query(Query(Command.WAIT, (b"never", b"either"))))
        waiter.sendall(encode_query(Query(Command.PING, number=3)))
        read_exactly(waiter, 4)  # the wait is registered before the ping is answered
        assert loop_thread.call(lambda: len(ftd_store.state._awaited)) == 1
    deadline = time.monotonic() + 10
    while loop_thread.call(lambda: len(ftd_store.state._waiting)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert loop_thread.call(lambda: len(ftd_store.state._awaited)) == 0


def test_add_to_text_that_is_no_number_closes_like_torchs() -> None:
    sent: list[bytes] = []
    state = StoreState(lambda client, reply: sent.append(reply))
    state.apply("c", Query(Command.SET, (b"k",), (b"abc",)))
    with pytest.raises(StoreRefused, match="add_to_non_number"):
        state.apply("c", Query(Command.ADD, (b"k",), number=1))
    state.apply("c", Query(Command.SET, (b"big",), (str(2**63 - 1).encode(),)))
    with pytest.raises(StoreRefused, match="add_overflow"):
        state.apply("c", Query(Command.ADD, (b"big",), number=1))


# -- fuzz targets ------------------------------------------------------------------------------


@fuzz_target("tcp_store", 300)
@given(st.binary(max_size=4096), st.lists(st.integers(1, 64), max_size=50))
def test_fuzz_any_bytes_in_any_chunks(data: bytes, cuts: list[int]) -> None:
    """Any bytes, cut anywhere: queries or one refusal, never another error, in budget."""
    with budget():
        decoder = QueryDecoder()
        decoder.feed(VALIDATE)
        start = 0
        for cut in [*cuts, len(data)]:
            decoder.feed(data[start : start + cut])
            start += cut
            while decoder.next() is not None:
                pass
        assert decoder.buffered <= len(data)


@fuzz_target("tcp_store", 200)
@given(st.lists(QUERIES, max_size=30), st.integers(1, 97))
def test_fuzz_queries_survive_any_chunking(queries: list[Query], chunk: int) -> None:
    """Queries encoded and fed in chunks of any size decode to themselves."""
    stream = VALIDATE + b"".join(map(encode_query, queries))
    decoder = QueryDecoder()
    decoded: list[Query] = []
    with budget():
        for start in range(0, len(stream), chunk):
            decoder.feed(stream[start : start + chunk])
            while (query := decoder.next()) is not None:
                decoded.append(query)
    assert decoder.refusal is None
    assert decoded == [Query(q.command, q.keys, q.values, q.number) for q in queries]


@fuzz_target("tcp_store", 200)
@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", "c3"]), QUERIES), max_size=60))
def test_fuzz_the_store_keeps_its_books(steps: list[tuple[str, Query]]) -> None:
    """Any queries from three clients, waits included: only StoreRefused escapes, and the
    bytes held are always what the keys and values add up to."""
    woken: list[tuple[object, bytes]] = []
    state = StoreState(lambda client, reply: woken.append((client, reply)), max_bytes=2048)
    with budget():
        for client, query in steps:
            if query.command is Command.PING and query.number % 3 == 0:
                query = Query(Command.WAIT, (b"a", b"q"))
            with contextlib.suppress(StoreRefused):
                state.apply(client, query)
            values = state._values
            queues = state._queues
            held = sum(KEY_OVERHEAD_BYTES + len(k) + len(v) for k, v in values.items())
            held += sum(KEY_OVERHEAD_BYTES + len(k) + sum(map(len, q)) for k, q in queues.items())
            assert state.bytes_held == held <= 2048


def test_a_query_one_byte_at_a_time_costs_what_it_costs_whole() -> None:
    """Linear time: a WAIT of 20 000 keys fed a byte at a time."""
    stream = VALIDATE + encode_query(Query(Command.WAIT, tuple(b"k%d" % i for i in range(20000))))
    decoder = QueryDecoder()
    with budget(5.0):
        for index in range(len(stream)):
            decoder.feed(stream[index : index + 1])
            query = decoder.next()
    assert query is not None and len(query.keys) == 20000


# -- in the daemon -----------------------------------------------------------------------------


async def test_a_daemon_runs_gloo_ranks_without_importing_torch(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Two gloo ranks meet and all-reduce through the workers' store (fresh for the restart
    too); the daemon itself never maps libtorch (the zygote imports it for the ranks)."""
    release, out = tmp_path / "release", tmp_path / "out"
    out.mkdir()
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "1",
        script=WORKER,
        script_args=(
            "--allreduce", "--fail-attempts", "1", "--out", str(out), "--hang-until", str(release)
        ),
    )  # fmt: skip
    await run.stdout.expect(r"ready a1 r0")
    await run.stdout.expect(r"ready a1 r1")
    maps = Path(f"/proc/{run.proc.pid}/maps").read_text()
    release.touch()
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert "libtorch" not in maps
    assert json.loads((out / "allreduce_a1_r1").read_text()) == [3.0] * 4


# -- ftd's client (the daemon's: no torch) ------------------------------------------------------


@pytest.mark.parametrize("server", ["torch", "ftd"])
def test_ftds_client_and_torchs_see_the_same_store(
    both_servers: tuple[Any, TcpStoreServer], server: str
) -> None:
    """Every operation the daemon makes, through ftd's client, against torch's client on the
    same server (torch's or ftd's): the same keys (torch's "/" prefix), values, counters,
    queues and wake-ups; a timed-out wait leaves the connection usable."""
    from ftd_client.store import tcp_store_client

    from ftd.tcpstore.client import StoreClient, StoreTimeout

    theirs, ours = both_servers
    port = theirs.port if server == "torch" else ours.port
    ns = f"{server}/{time.monotonic_ns()}"
    torch_client = tcp_store_client("127.0.0.1", port, 10)
    mine = StoreClient("127.0.0.1", port, 10)
    try:
        mine.set(f"{ns}/a", "1")
        assert torch_client.get(f"{ns}/a") == b"1"
        torch_client.set(f"{ns}/b", b"2")
        assert mine.get(f"{ns}/b") == b"2"
        assert (mine.add(f"{ns}/n", 3), torch_client.add(f"{ns}/n", 4), mine.add(f"{ns}/n", 0)) == (
            3,
            7,
            7,
        )
        assert mine.check([f"{ns}/a", f"{ns}/b"]) and not mine.check([f"{ns}/a", f"{ns}/x"])
        assert mine.compare_set(f"{ns}/a", "1", "9") == b"9"
        assert mine.compare_set(f"{ns}/a", "1", "8") == b"9"
        assert torch_client.get(f"{ns}/a") == b"9"
        mine.multi_set([f"{ns}/m1", f"{ns}/m2"], ["x", b"y"])
        assert torch_client.multi_get([f"{ns}/m1", f"{ns}/m2"]) == [b"x", b"y"]
        assert mine.multi_get([f"{ns}/m2", f"{ns}/b"]) == [b"y", b"2"]
        assert mine.delete_key(f"{ns}/m1") and not torch_client.check([f"{ns}/m1"])
        assert not mine.delete_key(f"{ns}/m1")
        mine.queue_push(f"{ns}/q", "first")
        torch_client.queue_push(f"{ns}/q", b"second")
        assert mine.queue_pop(f"{ns}/q") == b"first"
        assert torch_client.queue_pop(f"{ns}/q") == b"second"
        # Wake-ups across the two clients, both ways, and a queue that fills while waited on.
        threading.Timer(0.05, lambda: mine.set(f"{ns}/late", "L")).start()
        assert torch_client.get(f"{ns}/late") == b"L"
        other = tcp_store_client("127.0.0.1", port, 10)
        threading.Timer(0.05, lambda: other.set(f"{ns}/later", b"M")).start()
        assert mine.get(f"{ns}/later") == b"M"
        threading.Timer(0.05, lambda: other.queue_push(f"{ns}/q2", b"item")).start()
        assert mine.queue_pop(f"{ns}/q2", True) == b"item"
        with pytest.raises(StoreTimeout):
            mine.wait([f"{ns}/never"], 0.2)
        mine.set_timeout(0.2)
        with pytest.raises(StoreTimeout):
            mine.queue_pop(f"{ns}/empty", True)
        with pytest.raises(StoreTimeout):
            mine.get(f"{ns}/never")
        mine.set_timeout(10)
        mine.set(f"{ns}/after", "usable")  # the stream is in step after the timeouts
        assert mine.get(f"{ns}/after") == b"usable"
    finally:
        mine.close()


def test_ftds_client_says_when_the_store_is_gone(ftd_store: TcpStoreServer) -> None:
    """Refused, closed mid-wait, or an answer that is no reply: StoreGone, never a hang."""
    from ftd.tcpstore.client import StoreClient, StoreGone

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(StoreGone):
        StoreClient("127.0.0.1", port, 1)
    client = StoreClient("127.0.0.1", ftd_store.port, 10)
    threading.Timer(0.05, client.close).start()
    with pytest.raises(StoreGone):
        client.wait(["never"], 5)
    with socket.socket() as liar:  # a "store" that answers a wait with garbage
        liar.bind(("127.0.0.1", 0))
        liar.listen()
        client = StoreClient("127.0.0.1", liar.getsockname()[1], 2)
        conn, _ = liar.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"\x07")
            with pytest.raises(StoreGone):
                client.wait(["k"], 2)
        client.close()
    with socket.socket() as mute:  # a "store" that takes queries and never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        client = StoreClient("127.0.0.1", mute.getsockname()[1], 0.2)
        conn, _ = mute.accept()
        with conn, pytest.raises(StoreGone, match=r"did not answer ADD within 0\.2 s"):
            client.add("count", 1)  # the query it waited on, named: what an operator reads
        client.close()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.binary(max_size=300), min_size=1, max_size=4),
    st.lists(st.integers(1, 50), max_size=30),
)
def test_ftds_client_reads_replies_cut_anywhere_or_run_together(
    values: list[bytes], cuts: list[int]
) -> None:
    """The client reads through a buffer: a reply cut at any byte is read whole, and bytes
    of the next reply that came with it are kept for it (the stream stays in step)."""
    from ftd.tcpstore.client import StoreClient

    sizes = b"".join(struct.pack("<Q", len(v)) + v for v in values)
    stream = bytes([WaitReply.STOP_WAITING]) + sizes + struct.pack("<q", 42)
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        client = StoreClient("127.0.0.1", fake.getsockname()[1], 10)
        conn, _ = fake.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def send() -> None:
                start = 0
                for cut in [*cuts, len(stream)]:
                    conn.sendall(stream[start : start + cut])
                    start += cut

            sender = threading.Thread(target=send)
            sender.start()
            try:
                assert client.multi_get([f"k{i}" for i in range(len(values))]) == values
                assert client.add("n", 1) == 42
            finally:
                sender.join()
                client.close()
