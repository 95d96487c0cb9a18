"""The API's pure parts: the event ring (index arithmetic, held to a plain scan), its
subscriptions, the Host and Authorization parsers, and the registry's parsing of files it
did not write."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from ftd_client import discovery
from hypothesis import given, settings
from hypothesis import strategies as st

from ftd.api.security import HostPolicy, bearer_token, host_of
from ftd.status.events import EventLog, Lagged

# -- the ring ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 20),
    earlier=st.integers(0, 30),
    emitted=st.integers(0, 60),
    after=st.integers(-5, 100),
    limit=st.one_of(st.none(), st.integers(0, 30)),
)
def test_since_is_a_scan_of_what_the_ring_holds(
    tmp_path_factory: pytest.TempPathFactory,
    capacity: int,
    earlier: int,
    emitted: int,
    after: int,
    limit: int | None,
) -> None:
    path = tmp_path_factory.mktemp("ring") / "events.jsonl"
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(1, earlier + 1)))
    log = EventLog(path, capacity=capacity)
    for i in range(emitted):
        log.emit("e", i=i)
    log.close()
    held = list(range(earlier + 1, earlier + emitted + 1))[-capacity:]  # ids in memory
    expected = [i for i in held if i > after]
    expected = expected if limit is None else expected[:limit]
    assert [event.id for event in log.since(after, limit)] == expected
    assert log.last_id == earlier + emitted


class CountingSlots(list[object]):
    reads = 0

    def __getitem__(self, index: object) -> object:
        CountingSlots.reads += 1
        return super().__getitem__(index)  # type: ignore[index]


def test_reading_new_events_costs_what_it_returns_not_the_ring_size() -> None:
    log = EventLog(None, capacity=100_000)
    for i in range(100_000):
        log.emit("e", i=i)
    log._slots = CountingSlots(log._slots)  # type: ignore[assignment]
    CountingSlots.reads = 0
    assert [event.id for event in log.since(log.last_id - 3)] == [99_998, 99_999, 100_000]
    assert CountingSlots.reads == 3
    subscriptions = [log.subscribe(log.last_id, max_pending=10) for _ in range(300)]
    CountingSlots.reads = 0
    log.emit("e", i=-1)  # one event, 300 subscribers: no ring reads at all
    assert CountingSlots.reads == 0
    assert all(s.pending == 1 for s in subscriptions)


async def test_a_subscription_reads_the_backlog_then_what_comes() -> None:
    log = EventLog(None, capacity=100)
    for i in range(5):
        log.emit("old", i=i)
    sub = log.subscribe(2, max_pending=3)
    assert [e.id for e in await sub.next_batch(limit=2)] == [3, 4]  # from the ring, paged
    log.emit("new")
    assert [e.id for e in await sub.next_batch()] == [5]
    assert [e.id for e in await sub.next_batch()] == [6]
    waiting = asyncio.ensure_future(sub.next_batch())
    await asyncio.sleep(0)
    assert not waiting.done()  # waits, no polling
    log.emit("later")
    assert [e.id for e in await waiting] == [7]
    for _ in range(4):  # more than fits: it lagged, and says so
        log.emit("flood")
    with pytest.raises(Lagged, match="more than 3 events"):
        await sub.next_batch()
    assert log.subscribers == 1
    sub.close()
    assert log.subscribers == 0
    other = log.subscribe(log.last_id, max_pending=3)
    log.close()  # closing the log ends its readers
    assert await other.next_batch() == []


# -- Host and Authorization -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("localhost", "localhost"),
        ("LocalHost.:29610", "localhost"),
        ("127.0.0.1:1", "127.0.0.1"),
        ("[::1]:29610", "::1"),
        ("[::1]", "::1"),
        ("[::1]x", None),
        ("[::1", None),
        ("::1", None),
        ("a:b", None),
        ("host:", None),
        ("", None),
        ("localhost\udcff", None),
        ("l\u043ecalhost", None),  # a Cyrillic o
    ],
)
def test_host_of(header: str, host: str | None) -> None:
    assert host_of(header) == host


def test_host_policy() -> None:
    loopback = HostPolicy.for_bind("127.0.0.1", ["127.0.0.1"])
    assert loopback.loopback_only
    assert loopback.allows([]) and loopback.allows(["localhost:80", "127.1.2.3"])
    assert not loopback.allows(["evil.example"]) and not loopback.allows(["localhost", "x.io"])
    named = HostPolicy.for_bind("myhost.internal", ["127.0.1.1"])
    assert named.allows(["MyHost.Internal.:29610"]) and not named.allows(["otherhost"])
    anywhere = HostPolicy.for_bind("0.0.0.0", ["0.0.0.0"])
    assert not anywhere.loopback_only and anywhere.allows(["evil.example"])
    assert not HostPolicy.for_bind("both", ["127.0.0.1", "10.0.0.1"]).loopback_only


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer   abc  ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Bearer a b", None),
        ("Bearer tökén", None),
        ("Bearer \udcff\udcfe", None),  # bytes that were not UTF-8, as aiohttp hands them
        ("Bearer\tabc", None),
    ],
)
def test_bearer_token(header: str, token: str | None) -> None:
    assert bearer_token(header) == token


# -- the registry reads files it did not write ------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "{}",
        '{"version": 2, "pid": 1, "started": 1, "run_dir": "/x"}',
        '{"version": 1, "pid": "1", "started": 1, "run_dir": "/x"}',
        '{"version": 1, "pid": -1, "started": 1, "run_dir": "/x"}',
        '{"version": 1, "pid": 1, "started": 1, "run_dir": "relative"}',
        '{"version": 1, "pid": 1, "started": 1, "run_dir": "/x", "socket": 5}',
        '{"version": 1, "pid": 1, "started": 1, "run_dir": "/' + "x" * 5000 + '"}',
        "not json",
    ],
)
def test_registry_entries_are_parsed_with_bounds(text: str) -> None:
    with pytest.raises(ValueError):
        discovery.DaemonEntry.parse(text, Path("/x.json"))


def test_the_registry_lists_live_private_entries_only(tmp_path: Path) -> None:
    directory = tmp_path / "ftd"
    entry = discovery.register({"run_dir": "/runs/a", "node_id": "n", "run_id": "a"}, directory)
    assert discovery.running_daemons(directory)[0].run_dir == "/runs/a"
    assert discovery.running_daemons(directory)[0].pid == os.getpid()
    (directory / "junk.json").write_text("{")
    os.chmod(directory / "junk.json", 0o600)
    shared = directory / "shared.json"
    shared.write_text(entry.read_text())
    shared.chmod(0o644)  # readable by others: not trusted
    assert [e.path for e in discovery.running_daemons(directory)] == [entry]
    directory.chmod(0o755)
    with pytest.raises(discovery.UnsafeFile, match="must be 0700"):
        discovery.running_daemons(directory)
    assert discovery.running_daemons(tmp_path / "none") == []
