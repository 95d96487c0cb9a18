"""NVRx 0.5, 0.6 and 0.7 on the wire: their own frames (pickled by each release's classes and
pickler, tests/bin/nvrx_frames.py) decode to ftd's records, the fields they added are checked,
a later release's unknown fields are tolerated within bounds, and what ftd decides for each
connection (ftd/health/nvrx/session.py) follows each release's monitor. 0.6's frames (0.7's are
the same bytes) are fixtures here, so this runs without NVRx; the test that compares them with
each release's own pickles fetches the releases (tests/health/nvrx/releases.py).
"""

from __future__ import annotations

import contextlib
import json
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.health.nvrx import wire as wire
from ftd.health.nvrx.session import STEP, WARMUP, ClientSession
from tests.conftest import BIN, ROOT
from tests.health.nvrx import releases
from tests.health.nvrx.test_nvrx_wire import FRAMES as FRAMES_0_4
from tests.health.nvrx.test_nvrx_wire import USED, decode, refused
from tests.support.fuzzing import fuzz_target

FRAMES_HEX = {
    "authkey": (
        "80049571000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0a417574686b65794d73679493942981947d948c07617574686b6579944320"
        "6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b6b9473622e"
    ),
    "init": (
        "800495c3000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c07496e69744d73679493942981947d94288c0972616e6b5f696e666f946800"
        "8c0852616e6b496e666f9493942981947d94288c0b676c6f62616c5f72616e6b944b038c0a6c6f63616c5f72"
        "616e6b944b018c04686f7374948c066e6f64652d31948c03706964944a7011010075628c0969746572617469"
        "6f6e944db0048c106e756d5f7761726d75705f6974657273944b0375622e"
    ),
    "heartbeat": (
        "8004955a000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0c4865617274626561744d73679493942981947d94288c0472616e6b944b03"
        "8c057374617465947d9475622e"
    ),
    "section_open": (
        "80049591000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0a53656374696f6e4d73679493942981947d94288c0472616e6b944b008c07"
        "73656374696f6e948c0473746570948c06616374696f6e9468008c0d53656374696f6e416374696f6e949394"
        "4b01859452948c09697465726174696f6e944db10475622e"
    ),
    "section_close": (
        "80049591000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0a53656374696f6e4d73679493942981947d94288c0472616e6b944b028c07"
        "73656374696f6e948c0473746570948c06616374696f6e9468008c0d53656374696f6e416374696f6e949394"
        "4b02859452948c09697465726174696f6e944db10475622e"
    ),
    "close_all": (
        "8004958b000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0a53656374696f6e4d73679493942981947d94288c0472616e6b944b008c07"
        "73656374696f6e944e8c06616374696f6e9468008c0d53656374696f6e416374696f6e9493944b0385945294"
        "8c09697465726174696f6e944db10475622e"
    ),
    "update_config": (
        "80049572010000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0f557064617465436f6e6669674d73679493942981947d94288c0b68625f74"
        "696d656f7574739468008c1148656172746265617454696d656f7574739493942981947d94288c07696e6974"
        "69616c944740240000000000008c0a73756273657175656e74944740140000000000008c0f776572655f6361"
        "6c63756c61746564948875628c1073656374696f6e5f74696d656f7574739468008c0f53656374696f6e5469"
        "6d656f7574739493942981947d94288c0773656374696f6e947d94288c047374657094474008000000000000"
        "8c04696e6974944e758c0e6f75745f6f665f73656374696f6e944740000000000000008c1363616c63756c61"
        "7465645f73656374696f6e73948f94286814908c1c69735f6f75745f6f665f73656374696f6e5f63616c6375"
        "6c61746564948875628c0d63757272656e745f6379636c65944e75622e"
    ),
    "update_loaded": (
        "80049502010000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0f557064617465436f6e6669674d73679493942981947d94288c0b68625f74"
        "696d656f757473944e8c1073656374696f6e5f74696d656f7574739468008c0f53656374696f6e54696d656f"
        "7574739493942981947d94288c0773656374696f6e947d948c047374657094474008000000000000738c0e6f"
        "75745f6f665f73656374696f6e944e8c1363616c63756c617465645f73656374696f6e73948f948c1c69735f"
        "6f75745f6f665f73656374696f6e5f63616c63756c61746564948975628c0d63757272656e745f6379636c65"
        "944e75622e"
    ),
    "workload_request": (
        "80049591000000000000004b018c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f74"
        "6f6c6572616e63652e64617461948c16576f726b6c6f6164436f6e74726f6c52657175657374949394298194"
        "7d94288c06616374696f6e9468008c0e576f726b6c6f6164416374696f6e9493944b01859452948c0b646573"
        "6372697074696f6e948c07626164206e696394756286942e"
    ),
    "launcher_cycle": (
        "8004957f000000000000008c2a6e76696469615f726573696c69656e63795f6578742e6661756c745f746f6c"
        "6572616e63652e64617461948c0f557064617465436f6e6669674d73679493942981947d94288c0b68625f74"
        "696d656f757473944e8c1073656374696f6e5f74696d656f757473944e8c0d63757272656e745f6379636c65"
        "944b0475622e"
    ),
}
"""What NVRx 0.6.0's and 0.7.0's client sends (ForkingPickler, protocol 4), and ft_launcher's
own cycle update to its monitor (`launcher_cycle`)."""
FRAMES = {name: bytes.fromhex(text) for name, text in FRAMES_HEX.items()}
SECTION = "SectionMsg(rank={}, section={}, action=<SectionAction.{}>, iteration={})"
INFO = "RankInfo(global_rank=3, local_rank=1, host='node-1', pid=70000)"
UPDATE = (
    "UpdateConfigMsg(hb_timeouts=HeartbeatTimeouts(initial=10.0, subsequent=5.0, "
    "were_calculated=True), section_timeouts=SectionTimeouts(section={'step': 3.0, "
    "'init': None}, out_of_section=2.0, calculated_sections=frozenset({'step'}), "
    "is_out_of_section_calculated=True), current_cycle=None)"
)
LOADED = (
    "UpdateConfigMsg(hb_timeouts=None, section_timeouts=SectionTimeouts(section={'step': 3.0}, "
    "out_of_section=None, calculated_sections=frozenset(), is_out_of_section_calculated=False), "
    "current_cycle=None)"
)
REQUEST = (
    "(1, WorkloadControlRequest(action=<WorkloadAction.ExcludeThisNode: 1>, description='bad nic'))"
)


def expected(since_0_6: bool) -> dict[str, str]:
    """The records of tests/bin/nvrx_frames.py's messages (0.5's carry no iteration)."""
    iteration = 1201 if since_0_6 else None
    init = "1200, num_warmup_iters=3" if since_0_6 else "None, num_warmup_iters=None"
    records = {
        "authkey": "AuthkeyMsg(authkey=None)",
        "init": f"InitMsg(rank_info={INFO}, iteration={init})",
        "heartbeat": "HeartbeatMsg(rank=3, state=None)",
        "section_open": SECTION.format(0, "'step'", "OPEN: 1", iteration),
        "section_close": SECTION.format(2, "'step'", "CLOSE: 2", iteration),
        "close_all": SECTION.format(0, None, "CLOSE_ALL: 3", iteration),
        "update_config": UPDATE,
        "update_loaded": LOADED,
        "workload_request": REQUEST,
    }
    if since_0_6:
        records["launcher_cycle"] = (
            "UpdateConfigMsg(hb_timeouts=None, section_timeouts=None, current_cycle=4)"
        )
    return records


# -- 0.6's frames ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_the_frames_of_0_6_decode_to_their_records(name: str) -> None:
    assert repr(decode(FRAMES[name])) == expected(since_0_6=True)[name]
    assert {op.name for op, _, _ in pickletools.genops(FRAMES[name])} <= USED


def test_which_release_sent_the_init_and_what_it_asks() -> None:
    later = wire.decode_rank_message(FRAMES["init"])
    assert isinstance(later, wire.InitMsg) and later.client_0_6_or_later
    assert later.iteration == 1200 and later.num_warmup_iters == 3
    assert later.rank_info is not None and later.rank_info.global_rank == 3  # an int now
    earlier = wire.decode_rank_message(FRAMES_0_4["init"])  # 0.5 sends 0.4's bytes
    assert isinstance(earlier, wire.InitMsg) and not earlier.client_0_6_or_later
    assert earlier.unknown_fields == later.unknown_fields == frozenset()


def _init(**fields: object) -> bytes:
    info = wire.Ref(wire.DATA_MODULE, "RankInfo", {"global_rank": 0, "pid": 1})
    return wire.dumps(wire.Ref(wire.DATA_MODULE, "InitMsg", {"rank_info": info, **fields}))


def test_a_later_releases_fields_are_tolerated_within_bounds() -> None:
    fields = {f"later{n}": {"nested": n, "text": "x" * 1000} for n in range(8)}
    message = decode(_init(iteration=7, num_warmup_iters=None, **fields))
    assert isinstance(message, wire.InitMsg) and message.iteration == 7
    assert message.unknown_fields == set(fields) and not hasattr(message, "later0")
    nine = {f"later{n}": n for n in range(wire.MAX_UNKNOWN_FIELDS + 1)}
    for bad in (nine, {"__dict__": {}}, {"a-b": 1}, {"x" * (wire.MAX_FIELD_NAME + 1): 1}):
        assert refused(_init(**bad)) == "bad_state", bad
    # The values of unknown fields are decoded like any other: no class, no shared memo.
    assert refused(_init(later=wire.Ref("os", "system", {}))) == "refused_class"


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("InitMsg", {"iteration": -1}),
        ("InitMsg", {"iteration": "12"}),
        ("InitMsg", {"iteration": True}),
        ("InitMsg", {"num_warmup_iters": 2.0}),
        ("SectionMsg", {"section": "step", "iteration": -3}),
        ("UpdateConfigMsg", {"current_cycle": "4"}),
        ("UpdateConfigMsg", {"current_cycle": False}),
    ],
)
def test_the_new_fields_are_checked(name: str, fields: dict[str, object]) -> None:
    assert refused(wire.dumps(wire.Ref(wire.DATA_MODULE, name, fields))) == "bad_field"


def test_an_iteration_beyond_the_bound_is_refused() -> None:
    """2^53 needs LONG1, which ftd's own writer never writes: by hand."""
    head = FRAMES["section_open"][: -len(b"\x4d\xb1\x04ub.")]
    for value, cause in ((2**53 - 1, None), (2**53, "bad_field"), (2**70, "malformed")):
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        payload = head + b"\x8a" + bytes([len(raw)]) + raw + b"ub."
        if cause is None:
            message = decode(payload)
            assert isinstance(message, wire.SectionMsg) and message.iteration == value
        else:
            assert refused(payload) == cause


# -- each release's own pickles --------------------------------------------------------------


@pytest.fixture(scope="module")
def own_frames() -> dict[str, dict[str, dict[str, bytes]]]:
    """tests/bin/nvrx_frames.py's frames of every release: {version: {protocol: frames}}."""
    paths: list[Path] = []
    stubs: list[Path] = []
    for version in releases.RELEASES:
        try:
            release, *stubs = releases.release_paths(version)
        except releases.Unavailable as why:
            pytest.skip(f"nvidia-resiliency-ext {version} unavailable: {why}")
        paths.append(release)
    env = {"PYTHONPATH": releases.python_path(stubs), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(BIN / "nvrx_frames.py"), *map(str, paths)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = json.loads(done.stdout.splitlines()[-1])
    return {
        version: {
            protocol: {name: bytes.fromhex(text) for name, text in frames.items()}
            for protocol, frames in by_protocol.items()
        }
        for version, by_protocol in printed.items()
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("version", sorted(releases.RELEASES))
def test_each_releases_own_pickles_decode(
    own_frames: dict[str, dict[str, dict[str, bytes]]], version: str
) -> None:
    since_0_6 = version != "0.5.0"
    for protocol, frames in own_frames[version].items():
        for name, payload in frames.items():
            assert repr(decode(payload)) == expected(since_0_6)[name], (name, protocol)
    if since_0_6:  # the fixtures above are these releases' bytes
        assert own_frames[version]["4"] == FRAMES
    else:  # 0.5 pickles as 0.4 did
        for name in ("authkey", "section_close", "update_config", "workload_request"):
            assert own_frames[version]["4"][name] == FRAMES_0_4[name]


# -- what ftd decides for a connection -------------------------------------------------------


def _session(init: bytes, sections: dict[str, float | None]) -> ClientSession:
    message = wire.decode_rank_message(init)
    assert isinstance(message, wire.InitMsg)
    session = ClientSession(pid=1)
    session.started(message, sections)
    return session


def test_replies_and_the_time_before_the_first_step_follow_the_release() -> None:
    later = _session(FRAMES["init"], {"step": 2.0})
    assert not later.replies_to_beats and later.before_step and later.warmup_iterations == 3
    earlier = _session(FRAMES_0_4["init"], {"step": 2.0})
    assert earlier.replies_to_beats and not earlier.before_step
    assert earlier.warmup_iterations == 5
    # No sections configured, or a "warmup" one: NVRx 0.6 times out-of-section time at once.
    assert not _session(FRAMES["init"], {}).before_step
    assert not _session(FRAMES["init"], {"step": 2.0, WARMUP: 9.0}).before_step


@given(
    first=st.integers(0, 10**6),
    steps=st.lists(st.integers(0, 20), max_size=30),
    warmup=st.integers(0, 10),
    configured=st.booleans(),
)
def test_a_step_is_timed_as_warmup_exactly_within_the_warmup_iterations(
    first: int, steps: list[int], warmup: int, configured: bool
) -> None:
    """NVRx 0.6's `_is_section_timeout_elapsed`: iterations since the first one reported
    fewer than num_warmup_iterations, and a "warmup" timeout configured."""
    sections = {STEP: 2.0, WARMUP: 30.0} if configured else {STEP: 2.0}
    session = ClientSession(pid=1, warmup_iterations=warmup)
    assert session.step_name(sections) == STEP  # nothing reported: plain steps
    iteration = first
    for step in steps:
        session.saw(STEP, iteration)  # the first one reported is the baseline
        session.saw("other", iteration + 1000)  # only "step" counts
        warming = configured and iteration - first < warmup
        iteration += step
        assert session.step_name(sections) == (WARMUP if warming else STEP)


def test_errors_the_client_is_not_told_are_said_a_bounded_number_of_times() -> None:
    session = ClientSession(pid=1)
    said = [session.say_once(f"Section 's{n % 40}' is not open.") for n in range(200)]
    assert sum(said) == 16 and said[:16] == [True] * 16


# -- fuzzing, the new frames among the real ones ---------------------------------------------


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    frame = bytearray(FRAMES[draw(st.sampled_from(sorted(FRAMES)))])
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(frame)))
        match draw(st.sampled_from(["flip", "insert", "delete", "repeat"])):
            case "flip" if at < len(frame):
                frame[at] = draw(st.integers(0, 255))
            case "insert":
                frame[at:at] = draw(st.binary(min_size=1, max_size=8))
            case "delete":
                del frame[at : at + draw(st.integers(1, 8))]
            case "repeat":
                frame[at:at] = frame[at : at + 16] * draw(st.integers(1, 200))
    return bytes(frame)


@fuzz_target("nvrx_pickle", 300)
@given(_mutated())
def test_fuzz_mutated_frames_of_0_6(payload: bytes) -> None:
    with contextlib.suppress(wire.Refused):
        decode(payload)
