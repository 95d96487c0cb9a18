"""Pure decisions with a fake clock: deadlines, learning, restart policy, wire format, config."""

from __future__ import annotations

import asyncio
import json

import pytest
from ftd_client import protocol
from ftd_client.protocol import ProtocolError

from ftd.config.ft import (
    FaultToleranceConfig,
    RankTimeouts,
    UnknownParameter,
    check_parameter_name,
    merge_parameters,
    parse_section_timeouts,
)
from ftd.config.serve import parse_nnodes, parse_rdzv_conf, parse_std
from ftd.health.learning import Observations, learn_timeouts
from ftd.health.links import RankHealth, next_deadline
from ftd.status.model import Failure, describe_exit
from ftd.supervision.policy import Action, after_attempt
from ftd.tasks import within


def rank(**fields: object) -> RankHealth:
    health = RankHealth(local_rank=0, global_rank=3, pid=42)
    for name, value in fields.items():
        setattr(health, name, value)
    return health


TIMEOUTS = RankTimeouts(
    initial_rank_heartbeat_timeout=60,
    rank_heartbeat_timeout=10,
    rank_section_timeouts={"step": 2, "checkpointing": None},
    rank_out_of_section_timeout=5,
)


def test_no_deadline_before_the_handshake() -> None:
    assert next_deadline(rank(), TIMEOUTS) is None


def test_initial_heartbeat_then_heartbeat_deadline() -> None:
    connected = rank(connected_at=100.0)
    deadline = next_deadline(connected, TIMEOUTS)
    assert deadline is not None
    assert (deadline.kind, deadline.at) == ("initial_heartbeat", 160.0)
    beating = rank(connected_at=100.0, last_heartbeat=150.0, out_of_section_since=None)
    deadline = next_deadline(beating, TIMEOUTS)
    assert deadline is not None and (deadline.kind, deadline.at) == ("heartbeat", 160.0)


def test_open_section_sets_the_nearest_deadline() -> None:
    in_step = rank(connected_at=0.0, last_heartbeat=9.0, open_sections={"step": 10.0})
    deadline = next_deadline(in_step, TIMEOUTS)
    assert deadline is not None
    assert (deadline.kind, deadline.section, deadline.at) == ("section", "step", 12.0)
    assert "section 'step'" in deadline.reason(in_step, now=12.5)
    assert "overdue by 500.0 ms" in deadline.reason(in_step, now=12.5)


def test_section_without_timeout_and_out_of_section() -> None:
    checkpointing = rank(connected_at=0.0, last_heartbeat=0.0, open_sections={"checkpointing": 1.0})
    deadline = next_deadline(checkpointing, TIMEOUTS)
    assert deadline is not None and deadline.kind == "heartbeat"
    between = rank(connected_at=0.0, last_heartbeat=20.0, out_of_section_since=18.0)
    deadline = next_deadline(between, TIMEOUTS)
    assert deadline is not None and (deadline.kind, deadline.at) == ("out_of_section", 23.0)


def test_none_disables_every_check() -> None:
    assert next_deadline(rank(connected_at=0.0, out_of_section_since=0.0), RankTimeouts()) is None


def test_learning_multiplies_then_blends_with_learned_values() -> None:
    seen = Observations()
    for name, seconds in [("heartbeats", 1.0), ("heartbeats", 2.0), ("step", 0.5), ("eval", 3)]:
        seen.see(name, seconds)
    first, learned = learn_timeouts(RankTimeouts(), frozenset(), seen, 5.0, sections=["step"])
    assert first.rank_heartbeat_timeout == 10.0
    assert first.rank_section_timeouts == {"step": 2.5}
    assert learned == {"rank_heartbeat_timeout", "section:step"}
    seen.see("heartbeats", 4.0)
    second, _ = learn_timeouts(first, learned, seen, 5.0)
    assert second.rank_heartbeat_timeout == (10.0 + 20.0) / 2  # blended with the learned value
    assert second.rank_section_timeouts["eval"] == 15.0  # first time: not blended
    configured = RankTimeouts(rank_heartbeat_timeout=100)
    third, _ = learn_timeouts(configured, frozenset(), seen, 5.0)
    assert third.rank_heartbeat_timeout == 20.0  # a configured value is replaced, not blended


def test_learning_never_goes_below_the_floor() -> None:
    seen = Observations()
    seen.see("first_heartbeat", 0.0005)  # handshake, then a heartbeat at once
    seen.see("heartbeats", 0.02)
    learned, _ = learn_timeouts(RankTimeouts(), frozenset(), seen, 5.0, floor=1.0)
    assert learned.initial_rank_heartbeat_timeout == 1.0
    assert learned.rank_heartbeat_timeout == 1.0


@pytest.mark.parametrize(
    ("outcome", "used", "expected"),
    [
        (None, 0, Action.SUCCEED),
        (Failure(kind="exit", reason="x"), 0, Action.RESTART),
        (Failure(kind="exit", reason="x"), 3, Action.FAIL),
        (Failure(kind="fatal", reason="x"), 0, Action.FAIL),
        (Failure(kind="request", reason="x", counted=False), 3, Action.RESTART),
    ],
)
def test_restart_policy(outcome: Failure | None, used: int, expected: Action) -> None:
    decision = after_attempt(outcome, used, 3)
    assert decision.action is expected and decision.reason


def test_workload_shutdown_stops_restarting() -> None:
    decision = after_attempt(Failure(kind="exit", reason="boom"), 0, 3, "rank 1 asked")
    assert decision.action is Action.FAIL and "not restarted: rank 1 asked" in decision.reason


def test_protocol_round_trip_and_rejections() -> None:
    assert protocol.decode(protocol.HEARTBEAT_BYTES) == {"v": 1, "t": "hb"}
    assert protocol.decode(protocol.section_bytes("ss", "step"))["n"] == "step"
    cases = {
        b"\xff": "malformed",
        b"[]": "malformed",
        b'{"v":2,"t":"hb"}': "unknown_version",
        b'{"v":1,"t":"??"}': "unknown_type",
        b'{"v":1,"t":"ss","n":""}': "bad_section_name",
        b'{"v":1,"t":"wc","a":"CONTINUE"}': "missing_id",
        b'{"v":1,"t":"wc","a":"NOPE","id":1}': "bad_action",
        b"x" * (protocol.MAX_MESSAGE_BYTES + 1): "oversized",
    }
    for data, cause in cases.items():
        with pytest.raises(ProtocolError) as raised:
            protocol.decode(data)
        assert raised.value.cause == cause
    with pytest.raises(ProtocolError):
        protocol.encode({"t": "ss", "n": "x" * protocol.MAX_MESSAGE_BYTES})
    assert json.loads(protocol.encode({"t": "hb"})) == {"v": 1, "t": "hb"}


def test_ft_parameters() -> None:
    assert parse_section_timeouts("setup:600, step:180,checkpointing:None") == {
        "setup": 600.0,
        "step": 180.0,
        "checkpointing": None,
    }
    assert check_parameter_name("rank-heartbeat-timeout") == "rank_heartbeat_timeout"
    with pytest.raises(UnknownParameter, match="did you mean 'safety_factor'"):
        check_parameter_name("safety_facter")
    fields, delegated, ignored = merge_parameters(
        {"rank_heartbeat_timeout": 5, "enable_nic_monitor": True, "restart_policy": "min-healthy"},
        {"rank_heartbeat_timeout": "None"},
    )
    config = FaultToleranceConfig.model_validate(fields)
    assert config.rank_heartbeat_timeout is None  # CLI overrides the file
    assert delegated == {"restart_policy": "min-healthy"} and ignored == ["enable_nic_monitor"]
    assert FaultToleranceConfig(rank_termination_signal="term").rank_termination_signal == "SIGTERM"


def test_torchrun_value_parsers() -> None:
    assert parse_nnodes("2:4") == (2, 4) and parse_nnodes("3") == (3, 3)
    with pytest.raises(ValueError):
        parse_nnodes("a:b")
    assert parse_rdzv_conf("is_host=1,timeout=5") == {"is_host": "1", "timeout": "5"}
    assert parse_std("3") == 3 and parse_std("0:1,1:2") == {0: 1, 1: 2}
    assert describe_exit(-9) == "signal SIGKILL (9)" and describe_exit(2) == "exit code 2"


async def test_a_cancel_that_lands_as_a_bounded_call_completes_is_kept() -> None:
    """Python 3.11's wait_for returned the result instead (a round's closer, cancelled as the
    round closed, then slept out the join timeout)."""
    loop = asyncio.get_running_loop()
    call: asyncio.Future[int] = loop.create_future()
    went_on = asyncio.Event()

    async def closer() -> None:
        await within(call, 30)
        went_on.set()

    task = asyncio.create_task(closer())
    await asyncio.sleep(0)  # the task awaits the call
    call.set_result(1)
    task.cancel()  # in the same loop turn as the call's completion
    await asyncio.wait({task}, timeout=30)
    assert task.cancelled() and not went_on.is_set()
    with pytest.raises(TimeoutError):
        await within(loop.create_future(), 0.01)
    assert await within(asyncio.sleep(0, "done"), None) == "done"
