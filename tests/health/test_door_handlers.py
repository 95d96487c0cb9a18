"""The door decides for every message (issue 39 item 7, issue 42): whatever
ftd_client.wire.decode accepts, the daemon's handlers (the health service, the progress watch,
the checkpoint holder, reached through the inbox as the daemon assembles it) can use; a refusal
there is a ProtocolError (a budget's too), never another exception. Each kind is drawn with what
the door requires of it: so drawn, a progress report with a null `fwd_us` was found passing the
door and raising TypeError in the progress watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from ftd_client import protocol, wire
from ftd_client.checkpoint_messages import CHECKPOINT_KINDS
from ftd_client.messages import ProgressReport
from ftd_client.protocol import ProtocolError
from hypothesis import example, given
from hypothesis import strategies as st

from ftd.checkpoint.holder import CheckpointHolder
from ftd.config.ft import FaultToleranceConfig
from ftd.health.inbox import by_global_rank
from ftd.health.links import Link
from ftd.health.service import HealthService
from ftd.status.events import EventLog
from tests.support.fuzzing import budget, fuzz_target

small = st.integers(0, 2**20)
name = st.sampled_from(["step", "ckpt", "auto:torch.save", "x" * 128, "\u202e", "s1"])
names = st.lists(name, max_size=4)
garbage = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=8), st.integers()),
)  # fmt: skip
TYPED: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "n": {"n": name},
    "a": {"a": st.sampled_from([a.name for a in protocol.WorkloadAction])},
    "d": {"d": st.text(max_size=40)},
    "calc": {
        "sections": st.none() | names,
        "oos": st.booleans(),
        "rule": st.sampled_from(["ftd", "nvrx"]),
        "kind": st.sampled_from(["all", "hb", "sections"]),
        "gen": st.none() | st.integers(1, 5),
    },
    "set": {
        "timeouts": st.dictionaries(
            st.sampled_from(["rank_heartbeat_timeout", "rank_section_timeouts", "bogus"]),
            st.one_of(st.floats(0, 100), st.dictionaries(name, st.floats(0.1, 10))),
        ),
        "learned": names,
    },
    "fault": {"kind": st.sampled_from(["hang", "crash", "x"]), "sections": names},
    "pg": {
        **{key: small for key in (*ProgressReport.REQUIRED, *ProgressReport.COUNTS)},
        "auto": st.dictionaries(name, small, max_size=3),
    },
    "ck": {
        "step": small,
        "bytes": small,
        "world": st.integers(1, 4),
        "slot": st.integers(0, 3),
        "every": st.integers(1, 8),
        "restored": st.just(1),
    },
    "sync": {"s": st.integers(1, 50), "o": names, "dropped": small, "m": st.integers(0, 2**62)},
}
FIELDS = {key: strategy for group in TYPED.values() for key, strategy in group.items()}
REQUIRED: dict[str, tuple[str, ...]] = {
    protocol.SECTION_START: ("n",),
    protocol.SECTION_END: ("n",),
    protocol.WORKLOAD_CONTROL: ("a",),
    protocol.SET_TIMEOUTS: ("timeouts",),
    protocol.FAULT: ("kind",),
    protocol.PROGRESS: ProgressReport.REQUIRED,
    protocol.CHECKPOINT_BEGIN: ("step", "bytes", "world"),
    protocol.CHECKPOINT_DONE: ("step", "slot"),
    protocol.CHECKPOINT_RESTORE: ("world",),
    protocol.CHECKPOINT_SEEN: ("step",),
}
"""What the door requires of each kind, always drawn well formed: every kind reaches its
handler (a kind drawn with garbage everywhere would rarely pass the door); any other field may
come on top, well formed or garbage."""
messages = st.one_of(
    st.fixed_dictionaries(
        {
            "v": st.just(1),
            "t": st.just(kind),
            "id": st.integers(0, 9),
            **{key: FIELDS[key] for key in REQUIRED.get(kind, ())},
        },
        optional={
            key: strategy | garbage
            for key, strategy in FIELDS.items()
            if key not in REQUIRED.get(kind, ())
        },
    )
    for kind in sorted(wire.TYPES)
)


def dispatched(directory: Path, batch: list[dict[str, Any]]) -> None:
    """Decode each message of `batch` and hand what is accepted to a health service (with a
    memory tier) that watches this process as its rank, on an event loop of its own."""

    async def run() -> None:
        events = EventLog(None)
        holder = CheckpointHolder(directory, 1 << 30, events, base=directory)
        holder.start()
        handlers = dict.fromkeys(CHECKPOINT_KINDS, by_global_rank(holder.answer))
        state = directory / "state.json"
        service = HealthService(
            FaultToleranceConfig(), directory / "ftd.sock", state, events, handlers=handlers
        )
        service.monitor.attach([(0, 0, os.getpid())])  # this process plays the rank
        link = Link(1, os.getpid())
        try:
            for raw in batch:
                try:
                    envelope = wire.decode(json.dumps(raw).encode())
                except ProtocolError:
                    continue
                with budget(), contextlib.suppress(ProtocolError):
                    reply = service.inbox(link, envelope, 1.0)
                    if envelope.message.KIND in wire.ANSWERED:
                        assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool)
        finally:
            service.monitor.detach()
            holder.close()

    asyncio.run(run())


@fuzz_target("rank_protocol", 150)
@given(st.lists(messages, min_size=1, max_size=12))
@example([{"v": 1, "t": "pg", "steps": 0, "called": 0, "returned": 0, "fwd_us": None}])
def test_every_accepted_message_is_one_its_handler_can_use(batch: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        dispatched(Path(directory), batch)


def test_the_decoder_refuses_the_requests_handlers_cannot_use() -> None:
    for message, cause in [
        ({"t": "pg"}, "bad_progress"),
        ({"t": "calc", "id": 1, "rule": "x"}, "bad_request"),
        ({"t": "calc", "id": 1, "gen": 0}, "bad_request"),
        ({"t": "calc", "id": 1, "sections": "step"}, "bad_request"),
        ({"t": "calc", "id": 1, "oos": "yes"}, "bad_request"),
        ({"t": "set", "id": 1, "timeouts": []}, "bad_request"),
        ({"t": "set", "id": 1, "timeouts": {}, "learned": [1]}, "bad_request"),
        ({"t": "wc", "id": 1, "a": "CONTINUE", "d": 5}, "bad_request"),
        ({"t": "wc", "id": 1, "a": "CONTINUE", "d": "x" * 1001}, "bad_request"),
        ({"t": "fault", "kind": None}, "bad_request"),
        ({"t": "fault", "kind": "hang", "sections": [""]}, "bad_request"),
        ({"t": "calc", "id": 1, "rule": "nvrx", "kind": "all"}, "bad_request"),
        ({"t": "set", "id": 1, "timeouts": {"x" * 129: 1}}, "bad_request"),
        ({"t": "set", "id": 1, "timeouts": {"rank_heartbeat_timeout": [1]}}, "bad_request"),
        ({"t": "set", "id": 1, "timeouts": {"rank_section_timeouts": {"": 1}}}, "bad_request"),
    ]:
        with pytest.raises(ProtocolError) as refused:
            wire.decode(json.dumps({"v": 1, **message}).encode())
        assert refused.value.cause == cause, message


def test_a_path_in_the_memory_directory_is_never_followed(tmp_path: Path) -> None:
    """The holder reads a slot's header through open_slot: a link or a FIFO is refused."""
    from ftd.checkpoint.memory_dir import open_slot

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "target").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("fifo", "link"):
        with pytest.raises(OSError):
            os.close(open_slot(tmp_path / name))
    os.close(open_slot(tmp_path / "target"))
