"""Every rank message the door accepts is handled or refused by the daemon part it reaches, never
an internal error (issue 42): what `protocol.decode` lets through is fed to the health service's
dispatch, the whole way (the monitor, the progress watch, the snapshot holder, the learning of
timeouts, workload requests). A handler may refuse (ProtocolError: the socket counts it as a
dropped message; a budget's refusal), nothing else. Found by it: a progress report with a null
`fwd_us` passed the door and raised TypeError in the progress watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

from ftd_client import protocol
from ftd_client.protocol import ProtocolError
from hypothesis import example, given
from hypothesis import strategies as st

from ftd.checkpoint.holder import CheckpointHolder
from ftd.config.ft import FaultToleranceConfig
from ftd.health.links import Link
from ftd.health.progress import ProgressWatch
from ftd.health.service import HealthService
from ftd.health.sync import BudgetExceeded
from ftd.status.events import EventLog
from tests.support.fuzzing import fuzz_target

PID = 4242
names = st.sampled_from(["step", "setup", "auto:torch.save", "x" * 129, "", "ckpt"])
counts = st.one_of(st.integers(-2, 2**54), st.sampled_from([0, 1, 2, 3, 64, 2**53]))
values = st.one_of(
    st.none(), st.booleans(), counts, st.floats(allow_nan=True), names,
    st.lists(names, max_size=4), st.dictionaries(names, st.one_of(counts, names), max_size=4),
    st.sampled_from(["ftd", "nvrx", "all", "hb", "sections", "EXCLUDE_THIS_NODE",
                     "SHUTDOWN_WORKLOAD", "kill", "hang"]),
)  # fmt: skip
FIELDS = (
    "n", "s", "o", "m", "id", "a", "d", "stack_signal", "sections", "oos", "rule", "kind",
    "gen", "timeouts", "learned", "step", "bytes", "world", "slot", "every", "restored",
    *protocol.PROGRESS_COUNTS, "auto",
)  # fmt: skip
ids = st.integers(0, 2**31)
good_names = st.lists(names.filter(lambda n: 0 < len(n) <= protocol.MAX_SECTION_NAME), max_size=3)
small = st.integers(0, 64)
SHAPES: dict[str, dict[str, st.SearchStrategy[object]]] = {
    protocol.HELLO: {"id": ids},
    protocol.HEARTBEAT: {},
    protocol.SECTION_START: {"n": names},
    protocol.SECTION_END: {"n": names},
    protocol.WORKLOAD_CONTROL: {
        "id": ids,
        "a": st.sampled_from([a.name for a in protocol.WorkloadAction]),
    },
    protocol.CALCULATE_TIMEOUTS: {
        "id": ids,
        "rule": st.sampled_from(["ftd", "nvrx"]),
        "kind": st.sampled_from(["all", "hb", "sections"]),
    },
    protocol.SET_TIMEOUTS: {
        "id": ids,
        "timeouts": st.dictionaries(
            st.sampled_from(["rank_heartbeat_timeout", "rank_section_timeouts", "x"]),
            st.one_of(counts, st.floats(0.1, 1e6), st.dictionaries(names, st.floats(0, 1e6))),
            max_size=2,
        ),
    },
    protocol.GOODBYE: {},
    protocol.FAULT: {"kind": st.sampled_from(["kill", "hang", "x" * 16])},
    protocol.RESUMED: {},
    protocol.STATE: {"o": good_names},
    protocol.PROGRESS: {"steps": small, "called": small, "returned": small},
    protocol.CHECKPOINT_BEGIN: {
        "id": ids, "step": small, "bytes": st.integers(0, 1 << 30), "world": st.integers(1, 4)
    },
    protocol.CHECKPOINT_DONE: {"id": ids, "step": small, "slot": st.integers(0, 63)},
    protocol.CHECKPOINT_RESTORE: {"id": ids, "world": st.integers(1, 4)},
    protocol.CHECKPOINT_PLACE: {"id": ids},
    protocol.CHECKPOINT_SEEN: {"step": small},
}  # fmt: skip
"""Each kind with what the door requires of it; every other field may come on top, any value."""
assert set(SHAPES) == protocol.TYPES
messages = st.one_of(
    st.fixed_dictionaries(
        {"v": st.just(1), "t": st.just(kind), **required},
        optional={key: values for key in FIELDS if key not in required},
    )
    for kind, required in sorted(SHAPES.items())
)


async def dispatch_all(batch: list[dict[str, object]], root: Path) -> None:
    events = EventLog(None)
    holder = CheckpointHolder(root, 64 << 20, events, base=root)
    holder.start()
    service = HealthService(
        FaultToleranceConfig(),
        root / "ftd.sock",
        root / "ft_state.json",
        events,
        progress=ProgressWatch(5.0),
        checkpoints=holder,
    )
    service.monitor.attach([(0, 0, PID)])
    link = Link(1, PID)
    try:
        for raw in batch:
            try:
                message = protocol.decode(json.dumps(raw).encode())
            except ProtocolError:
                continue
            # Refused: counted by the socket as a dropped message.
            with contextlib.suppress(ProtocolError, BudgetExceeded):
                service._dispatch(link, message, time.monotonic())
    finally:
        service.monitor.detach()
        service.hangs.close()
        holder.close()


@fuzz_target("rank_protocol", 100)
@given(st.lists(messages, min_size=1, max_size=12))
@example([{"v": 1, "t": "pg", "steps": 0, "called": 0, "returned": 0, "fwd_us": None}])
def test_every_message_the_door_accepts_is_handled_or_refused(
    batch: list[dict[str, object]],
) -> None:
    with tempfile.TemporaryDirectory() as root:
        asyncio.run(dispatch_all(batch, Path(root)))
