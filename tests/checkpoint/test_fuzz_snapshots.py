"""Fuzz targets of the memory tier's decoders: a snapshot file's header (what the daemon reads of
a file a rank wrote) and the checkpoint requests a rank sends, answered by the holder. Any
input gives a value or the decoder's own refusal, within the per-input budget."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

from ftd_client import protocol, wire
from ftd_client.checkpoint_messages import CHECKPOINT_KINDS
from ftd_client.protocol import ProtocolError
from ftd_client.snapshot_format import (
    HEADER,
    HEADER_BYTES,
    SnapshotFormatError,
    decode_header,
    layout,
)
from hypothesis import given
from hypothesis import strategies as st

from ftd.checkpoint.holder import CheckpointHolder
from ftd.status.events import EventLog
from tests.support.fuzzing import budget, fuzz_target

BUDGET_S = 0.05
big = st.integers(-(2**64), 2**65)
u32, u64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
headers = st.one_of(
    st.builds(
        lambda *fields: HEADER.pack(*fields),
        st.sampled_from([b"FTDSNAP1", b"FTDSNAP2", b"\0" * 8]),
        st.integers(0, 2),
        u32,
        u64,
        u32,
        u32,
        u64,
        u64,
        u64,
        u64,
        u64,
    ),
    st.builds(  # well-formed ones, of any size (the file may be shorter)
        lambda *fields: layout(*fields).pack(),
        st.integers(0, 2**54),
        st.integers(1, 2**21),
        st.integers(0, 2**21),
        st.integers(0, 2**40),
        st.integers(0, 2**50),
    ),
)


@fuzz_target("snapshot_header", 300)
@given(st.one_of(st.binary(max_size=200), headers), st.integers(0, 2**50))
def test_any_header_is_a_snapshot_or_refused(data: bytes, file_bytes: int) -> None:
    with budget(BUDGET_S):
        try:
            header = decode_header(data, file_bytes)
        except SnapshotFormatError:
            return
    assert header.skeleton_offset == HEADER_BYTES
    assert header.data_offset >= header.skeleton_offset + header.skeleton_bytes
    assert header.total_bytes == header.data_offset + header.data_bytes <= file_bytes


values = st.one_of(st.none(), st.booleans(), big, st.floats(), st.text(max_size=20))
requests = st.fixed_dictionaries(
    {
        "v": st.just(1),
        "t": st.sampled_from(sorted(kind.KIND for kind in CHECKPOINT_KINDS)),
        "id": st.integers(0, 9),
    },
    optional={
        key: st.one_of(values, st.integers(0, 4))
        for key in ("step", "bytes", "world", "slot", "every")
    },
)


@fuzz_target("rank_protocol", 150)
@given(st.lists(st.tuples(st.integers(0, 5), requests), max_size=40))
def test_checkpoint_requests_are_answered_or_refused(
    batch: list[tuple[int, dict[str, object]]],
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        run_dir = Path(directory)
        holder = CheckpointHolder(run_dir, 64 << 20, EventLog(None), base=run_dir)
        holder.start()
        try:
            for rank, raw in batch:
                with contextlib.suppress(ProtocolError):
                    message = wire.decode(json.dumps(raw).encode()).message
                    with budget(BUDGET_S):
                        reply = holder.answer(rank, message)
                    assert reply is None or isinstance(reply.get("ok"), bool)
            assert holder.ledger.reserved_bytes <= 64 << 20
            interval = holder.spacing.view()["interval_steps"]
            assert interval is None or 1 <= interval <= protocol.MAX_EVERY
        finally:
            holder.close()


@fuzz_target("checkpoint_agreement", 200)
@given(st.lists(st.one_of(st.binary(max_size=300), st.lists(big, max_size=12).map(
    lambda steps: json.dumps(steps).encode())), min_size=1, max_size=6))  # fmt: skip
def test_any_lists_in_the_store_agree_on_one_step_or_none(values: list[bytes]) -> None:
    """The ranks' lists of the steps they hold, as read from the attempt's store
    (ftd_client/checkpoint/_agree.py): any bytes give a set of plausible steps, and the
    agreement is a step every list holds, or None."""
    from ftd_client.checkpoint._agree import MAX_STEPS, newest_common, parse

    with budget(BUDGET_S):
        held = [parse(value) for value in values]
        step = newest_common(held)
    assert all(len(steps) <= MAX_STEPS and all(0 <= s <= 2**53 for s in steps) for steps in held)
    assert step is None or all(step in steps for steps in held)
