"""NVIDIA's own fault-tolerance client under `ftd serve`: the wire format, the sockets, the
attacks on them, and an unmodified NVRx-instrumented script (nvidia-resiliency-ext from the
package index, the `nvrx` test extra; those tests are skipped where it does not import)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pickle
import socket
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.config.ft import RankTimeouts
from ftd.health.learning import Base, Generations, NotReady, Observations, apply_values, learn_nvrx
from ftd.health.nvrx import wire as wire
from ftd.ranks.launch import socket_paths
from tests.conftest import BIN, ServeFactory

HAVE_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None
needs_nvrx = pytest.mark.skipif(
    not HAVE_NVRX, reason="nvidia-resiliency-ext is not installed (pip install -e '.[nvrx]')"
)


# -- the wire format -------------------------------------------------------------------------


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(_Evil()),
        b"\x80\x04cbuiltins\neval\n\x8c\x011\x85R.",
        b"\x80\x04cbuiltins\ngetattr\n.",
        pickle.dumps(os.getcwd),  # a builtin function, by reference
        pickle.dumps(Path("/")),  # an ordinary class outside the allowed list
        b"\x80\x04\x82\x01.",  # EXT1: the copyreg extension registry
        b"\x80\x04\x8c\x01xQ.",  # BINPERSID
    ],
    ids=["os.system", "builtins.eval", "getattr", "function", "unknown class", "ext", "persid"],
)
def test_the_unpickler_refuses_every_global_but_nvrx_messages(payload: bytes) -> None:
    with pytest.raises(wire.Refused) as refused:
        wire.decode(payload)
    assert refused.value.cause in ("refused_class", "malformed")


@pytest.mark.parametrize(
    ("state", "cause"),
    [
        ({"rank": 0, "section": 7, "action": None}, "bad_field"),
        ({"rank": 0, "section": "x" * 1000, "action": None}, "bad_field"),
        ({"rank": "0; rm -rf /", "section": "s"}, "bad_field"),
        (
            {"rank": 0, **{f"surprise{n}": 1 for n in range(wire.MAX_UNKNOWN_FIELDS + 1)}},
            "bad_state",
        ),
        ({"rank": 0, "not a name": 1}, "bad_state"),
        ({"rank": 0, "x" * (wire.MAX_FIELD_NAME + 1): 1}, "bad_state"),
    ],
)
def test_nvrx_messages_are_checked_field_by_field(state: dict[str, Any], cause: str) -> None:
    payload = wire.dumps(wire.Ref(wire.DATA_MODULE, "SectionMsg", state))
    with pytest.raises(wire.Refused) as refused:
        wire.decode(payload)
    assert refused.value.cause == cause


def test_oversized_and_truncated_messages_are_refused() -> None:
    with pytest.raises(wire.Refused, match="oversized"):
        wire.decode(b"x" * (wire.MAX_MESSAGE_BYTES + 1))
    good = wire.dumps(wire.Ref(wire.DATA_MODULE, "HeartbeatMsg", {"rank": "3", "state": {}}))
    with pytest.raises(wire.Refused, match="malformed"):
        wire.decode(good[:-5])
    message = wire.decode_rank_message(good)
    assert isinstance(message, wire.HeartbeatMsg)


def test_a_timeout_must_be_a_positive_finite_number() -> None:
    for bad in (float("nan"), float("inf"), -1.0, 0, True, "5"):
        state = {"initial": bad, "subsequent": 1.0, "were_calculated": True}
        with pytest.raises(wire.Refused):
            wire.decode(wire.dumps(wire.Ref(wire.DATA_MODULE, "HeartbeatTimeouts", state)))


@needs_nvrx
def test_real_nvrx_client_messages_decode_and_our_replies_unpickle_as_nvrx_objects() -> None:
    import signal

    from nvidia_resiliency_ext.fault_tolerance import config, data
    from nvidia_resiliency_ext.fault_tolerance.utils import _IPC_PICKLER

    update = data.UpdateConfigMsg(
        data.HeartbeatTimeouts(10.0, 5.0, True),
        data.SectionTimeouts({"step": 3.0, "init": None}, 2.0, {"step"}, True),
    )
    decoded = wire.decode_rank_message(bytes(_IPC_PICKLER.dumps(update)))
    assert isinstance(decoded, wire.UpdateConfigMsg)
    assert decoded.hb_timeouts is not None and decoded.hb_timeouts.subsequent == 5.0
    assert decoded.section_timeouts is not None
    assert decoded.section_timeouts.calculated_sections == {"step"}
    request = (1, data.WorkloadControlRequest(data.WorkloadAction.ExcludeThisNode, "bad nic"))
    rank, parsed = wire.decode_launcher_message(bytes(_IPC_PICKLER.dumps(request)))
    assert rank == 1 and parsed.action is wire.WorkloadAction.ExcludeThisNode
    section = data.SectionMsg(rank="0", section="step", action=data.SectionAction.CLOSE)
    closed = wire.decode_rank_message(bytes(_IPC_PICKLER.dumps(section)))
    assert isinstance(closed, wire.SectionMsg) and closed.action is wire.SectionAction.CLOSE

    cfg = wire.Ref(
        wire.CONFIG_MODULE,
        "FaultToleranceConfig",
        {"rank_section_timeouts": {"step": 3.0}, "safety_factor": 4.0,
         "rank_termination_signal": wire.EnumRef("signal", "Signals", 15)},
    )  # fmt: skip
    reply = pickle.loads(wire.ok(cfg=cfg)[4:])
    assert isinstance(reply, data.OkMsg)
    assert isinstance(reply.cfg, config.FaultToleranceConfig)
    assert reply.cfg.rank_termination_signal is signal.SIGTERM
    assert reply.cfg.rank_section_timeouts == {"step": 3.0}
    refused = pickle.loads(wire.error("Section 'x' is not open.")[4:])
    assert isinstance(refused, data.ErrorMsg) and "not open" in str(refused)
    assert pickle.loads(wire.ack()[4:]) == b"ok"


# -- the sockets under a real daemon ---------------------------------------------------------


@pytest.mark.timeout(60)
async def test_attacks_are_refused_and_counted_and_the_daemon_goes_on(
    serve: ServeFactory, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    run = await serve(
        "--nproc-per-node", "1", "--ft-param-rank_heartbeat_timeout=30",
        script=BIN / "nvrx_attack.py", script_args=("--go", str(go)),
    )  # fmt: skip
    match = await run.stdout.expect(r"rank socket (\S+)")
    await run.stdout.expect(r"good exchange: True")

    # A stranger (this test process) is refused before anything it sends is read.
    def knock() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
            stranger.connect(match.group(1))
            try:
                stranger.sendall(wire.frame(pickle.dumps(_Evil())))
                return stranger.recv(100)
            except (BrokenPipeError, ConnectionResetError):  # closed, its bytes unread
                return b""

    assert await asyncio.get_running_loop().run_in_executor(None, knock) == b""
    await run.stderr.expect(r"NVRx socket: dropped a message from pid \d+ \[not_a_rank\]")
    go.touch()
    assert await run.wait(timeout=30) == 0, run.stderr.text[-3000:]
    assert run.stdout.text.count("good exchange: True") == 3
    for attack in ("os.system", "builtins.eval", "unknown class", "oversized", "truncated"):
        assert f"attack {attack}: reply 0" in run.stdout.text
    for cause in ("refused_class", "bad_field", "malformed", "oversized", "truncated"):
        assert f"[{cause}]" in run.stderr.text, cause
    assert not Path("/tmp/ftd-nvrx-pwned").exists()
    dropped = run.status()["ipc"]["dropped"]  # type: ignore[index]
    for cause in ("refused_class", "bad_field", "malformed", "oversized", "truncated"):
        assert dropped.get(f"nvrx_{cause}", 0) >= 1, dropped  # type: ignore[union-attr]
    assert dropped["nvrx_refused_class"] >= 3  # type: ignore[index]


def test_socket_paths_are_beside_ftds_socket() -> None:
    short = socket_paths(Path("/tmp/r/ftd.sock"))
    assert short == (Path("/tmp/r/ftd-nvrx-rmon.sock"), Path("/tmp/r/ftd-nvrx-launcher.sock"))
    # A long run dir: tests/system/test_local_secrets.py (a private directory, never a shared name).


@needs_nvrx
@pytest.mark.timeout(120)
async def test_unmodified_nvrx_script_runs_under_ftd_serve(
    serve: ServeFactory, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run = await serve(
        "--nproc-per-node", "2", "--max-restarts", "3",
        "--ft-param-rank_section_timeouts=setup:60,step:2",
        "--ft-param-initial_rank_heartbeat_timeout=60", "--ft-param-rank_heartbeat_timeout=30",
        script=BIN / "nvrx_native.py", script_args=("--out", str(out)),
    )  # fmt: skip
    assert await run.wait(timeout=110) == 1, run.stderr.text[-3000:]
    # Attempt 0: the hang inside the NVRx client's "step" section is caught like any other.
    [hang] = run.event_data("rank_hung")
    assert hang["global_rank"] == 1 and hang["section"] == "step"
    # Attempt 1: timeouts the NVRx client calculated are in force, as learned ones (never
    # below min_learned_timeout, 1 s by default).
    learned = [e for e in run.event_data("timeouts_changed") if "NVRx client" in e["by"]]
    assert learned and all(e["learned"] for e in learned)
    final = learned[-1]["timeouts"]
    assert final["rank_heartbeat_timeout"] >= 1.0 and final["rank_section_timeouts"]["setup"] == 60
    assert 1.0 <= final["rank_section_timeouts"]["step"] < 2.0
    # The shutdown request was honoured: no third attempt.
    [request] = run.event_data("workload_control")
    assert request["action"] == "SHUTDOWN_WORKLOAD" and request["rank"] == 0
    assert "not restarted: rank 0 asked to shut the workload down" in run.stderr.text
    assert not run.attempt_dir(2).exists()
    state = json.loads((out / "state_r1.json").read_text())["current_timeouts"]
    assert state["heartbeat"]["were_calculated"] is True
    assert state["section"]["calculated_sections"] == ["step"]


# -- NVRx's rule for learned timeouts (ftd/health/learning.py), on fake observations ---------------


def _seen(**sections: float) -> Observations:
    return Observations(
        first_heartbeat=2.0, heartbeat_interval=0.5, sections=dict(sections), out_of_section=0.2
    )


def _base(learned: frozenset[str] = frozenset(), **timeouts: Any) -> Base:
    values = {"rank_section_timeouts": {"init": 20.0, "step": 10.0}, **timeouts}
    return Base(RankTimeouts.model_validate(values), learned)


def test_an_empty_section_list_relearns_out_of_section_only() -> None:
    """NVRx leaves `init` alone with selected_sections=[] (it used to go 20 -> 1.64 s)."""
    values = learn_nvrx(_base(), _seen(init=0.3, step=0.1), 5.0, "sections", [], True)
    assert values == {"rank_out_of_section_timeout": 1.0}


def test_sections_none_relearns_every_configured_section() -> None:
    values = learn_nvrx(_base(), _seen(init=0.3, step=0.4, other=9.0), 5.0, "sections", None, False)
    assert values == {"section:init": 1.5, "section:step": 2.0}


def test_a_calculated_value_is_merged_half_and_half_a_configured_one_replaced() -> None:
    base = _base(frozenset({"section:step"}))
    values = learn_nvrx(base, _seen(init=1.0, step=1.0), 5.0, "sections", None, False)
    assert values == {"section:init": 5.0, "section:step": 7.5}  # (10 + 5) / 2


def test_heartbeat_rule_and_floor() -> None:
    both = frozenset(["initial_rank_heartbeat_timeout", "rank_heartbeat_timeout"])
    timeouts = {"initial_rank_heartbeat_timeout": 60.0, "rank_heartbeat_timeout": 4.0}
    values = learn_nvrx(_base(both, **timeouts), _seen(), 5.0, "hb", floor=3.0)
    # Both were calculated: merged 50/50 (60 with 2 * 5; 4 with 0.5 * 5), then the floor.
    assert values == {"initial_rank_heartbeat_timeout": 35.0, "rank_heartbeat_timeout": 3.25}
    # NVRx keeps one were_calculated flag for both: one of them configured, both replaced.
    one = frozenset(["rank_heartbeat_timeout"])
    values = learn_nvrx(_base(one, **timeouts), _seen(), 5.0, "hb", floor=3.0)
    assert values == {"initial_rank_heartbeat_timeout": 10.0, "rank_heartbeat_timeout": 3.0}


@pytest.mark.parametrize(
    ("seen", "kind", "sections", "oos"),
    [
        (Observations(first_heartbeat=1.0), "hb", None, False),
        (_seen(step=0.1), "sections", None, False),  # init never observed
        (_seen(step=0.1), "sections", [], False),  # NVRx checks every section even then
        (_seen(init=0.1, step=0.1), "sections", ["nope"], False),
        (Observations(sections={"init": 1.0, "step": 1.0}), "sections", None, True),
    ],
)
def test_not_ready(seen: Observations, kind: Any, sections: list[str] | None, oos: bool) -> None:
    with pytest.raises(NotReady):
        learn_nvrx(_base(), seen, 5.0, kind, sections, oos)


@given(
    intervals=st.lists(st.floats(0.01, 100.0), min_size=2, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_ranks_of_one_generation_give_the_maximum_whoever_calls_last(
    intervals: list[float], order: Any
) -> None:
    """Each rank's step observation arrives, then its call: the last call's result is NVRx's
    rule on the maximum over every rank, merged once into the value before the generation."""
    base = _base(frozenset({"section:step"}))
    generations = Generations()
    seen = Observations(first_heartbeat=1.0, heartbeat_interval=1.0, sections={"init": 1.0})
    timeouts, learned = base.timeouts, base.learned
    calls = list(intervals)
    order.shuffle(calls)
    for interval in calls:
        seen.see("step", interval)
        start = generations.base(("nvrx", "sections", 1), Base(timeouts, learned))
        values = learn_nvrx(start, seen, 2.0, "sections", ["step"], False)
        timeouts, learned = apply_values(timeouts, values), learned | set(values)
    expected = round(0.5 * 10.0 + 0.5 * 2.0 * max(intervals), 6)
    assert timeouts.rank_section_timeouts["step"] == expected


# -- checkpoints: NVRx's state layout, both ways ---------------------------------------------


@needs_nvrx
@pytest.mark.timeout(60)
async def test_nvrx_checkpoint_state_round_trips_through_ftd(
    serve: ServeFactory, tmp_path: Path
) -> None:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient as NvrxClient
    from nvidia_resiliency_ext.fault_tolerance.data import HeartbeatTimeouts, SectionTimeouts

    nvrx = NvrxClient()
    nvrx.hb_timeouts = HeartbeatTimeouts(initial=30.0, subsequent=7.5, were_calculated=True)
    nvrx.section_timeouts = SectionTimeouts({"init": 20.0, "step": 4.0}, 6.0, {"step"}, True)
    written = json.loads(json.dumps(nvrx.state_dict()))
    load, save = tmp_path / "nvrx_state.json", tmp_path / "ftd_state.json"
    load.write_text(json.dumps(written))
    run = await serve(
        "--nproc-per-node", "1", "--ft-param-rank_section_timeouts=init:20,step:10",
        script=BIN / "nvrx_state.py",
        script_args=("--load", str(load), "--save", str(save), "--learn", "empty-list"),
    )  # fmt: skip
    assert await run.wait(timeout=50) == 0, run.stderr.text[-3000:]
    # NVRx's state loads into ftd's client with the same values, were_calculated kept.
    loaded = json.loads(run.stdout.text.split("loaded ", 1)[1].splitlines()[0])
    assert loaded == written
    # selected_sections=[] relearned the out-of-section timeout only: init stays 20.
    sections = json.loads(run.stdout.text.split("sections ", 1)[1].splitlines()[0])
    assert sections == {"init": 20.0, "step": 4.0}
    # And ftd's state loads into NVRx's own client.
    back = NvrxClient()
    back.load_state_dict(json.loads(save.read_text()))
    assert back.loaded_hb_timeouts == nvrx.hb_timeouts
    assert back.loaded_section_timeouts.section == {"init": 20.0, "step": 4.0}
    assert back.loaded_section_timeouts.calculated_sections == {"step"}
    assert back.loaded_section_timeouts.is_out_of_section_calculated
    kept = json.loads((run.run_dir / "ft_state.json").read_text())["learned"]
    assert {"rank_heartbeat_timeout", "section:step", "rank_out_of_section_timeout"} <= set(kept)
    assert "section:init" not in kept
