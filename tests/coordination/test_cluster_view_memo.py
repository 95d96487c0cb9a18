"""The cluster view decodes a summary once (issue 43, item 6): node rank 0's page reads every
member's summary, and a dashboard's read every 2 s finds most of them unchanged; the same bytes
under a key are not decoded again (ftd/coordination/memo.py), different bytes always are.
Real c10d coordinators on a real TCPStore; etcd's is tests/coordination/etcd/
test_etcd_coordinator.py. Beside it, the memo's rule as a property."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from ftd.coordination.memo import BytesMemo
from tests.conftest import free_port
from tests.coordination.test_job_times import c10d_coordinators, joined


async def test_c10d_decodes_a_summary_once_and_never_keeps_one_replaced() -> None:
    from ftd_client.store import tcp_store_server

    port = free_port()
    server = tcp_store_server("127.0.0.1", port)
    coordinators = c10d_coordinators(port, 2)
    try:
        first, second = await joined(coordinators)
        decoded: list[str] = []
        decode = first.codec.decode

        def counted(key: str, raw: bytes, *args: Any) -> Any:
            decoded.append(key)
            return decode(key, raw, *args)

        first.codec.decode = counted

        def states() -> dict[str, str]:
            return {n["node_id"]: n["state"] for n in view["nodes"]}

        view = await first.cluster()
        assert states() == {"n00": "running", "n01": "running"}
        assert decoded.count("status/n01") == 1
        view = await first.cluster()
        assert decoded.count("status/n01") == 1, "the same bytes were decoded again"
        store = second._connections.operations.store
        good = store.get("status/n01")
        for planted in (b"garbage", good[:-1] + b"x"):  # junk, then a forgery
            store.set("status/n01", planted)
            for _ in range(2):
                view = await first.cluster()
                assert states()["n01"] == "unknown", view
            store.set("status/n01", good)  # the first bytes, back: shown again
            view = await first.cluster()
            assert states()["n01"] == "running", view
        assert decoded.count("status/n01") == 7  # every read of new bytes, none of the same
        assert sum(first.codec.refused.values()) >= 4, first.codec.refused
    finally:
        for coordinator in coordinators:
            await coordinator.close()
        del server


@given(st.lists(st.dictionaries(st.sampled_from("abcd"), st.binary(max_size=3)), max_size=8))
def test_the_memo_decodes_new_bytes_only_and_holds_one_read(reads: list[dict[str, bytes]]) -> None:
    """Each read gives what decoding it whole would give; a key's bytes are decoded only
    where they differ from the previous read's under that key (b"" is invalid: left out)."""
    memo: BytesMemo[bytes] = BytesMemo()
    before: dict[str, bytes] = {}
    for read in reads:
        calls: list[str] = []

        def decode(item: tuple[str, bytes], calls: list[str] = calls) -> bytes | None:
            calls.append(item[0])
            return item[1][::-1] if item[1] else None

        shown = memo.take(((k, raw, (k, raw)) for k, raw in read.items()), decode)
        assert shown == {k: raw[::-1] for k, raw in read.items() if raw}
        kept = {k for k, raw in read.items() if raw and before.get(k) == raw}
        assert sorted(calls) == sorted(set(read) - kept)
        before = {k: raw for k, raw in read.items() if raw}
