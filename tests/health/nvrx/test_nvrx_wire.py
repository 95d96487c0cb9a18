"""ftd/health/nvrx/pickle_decoder.py, NVRx's pickles read by opcodes: real messages, the attacks of
issue 23
(rows 4 and 5: a memo-shared tuple bomb, BUILD on an allowed class), every opcode NVRx does not
use, and hypothesis fuzzing over random bytes and mutated real frames (each input within a
time budget). Fixtures are NVRx 0.4.1's own bytes, committed, so this runs without NVRx."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import pickle
import pickletools
import struct
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.health.nvrx import pickle_decoder as nvrx_pickle
from ftd.health.nvrx import wire as wire
from tests.support.fuzzing import fuzz_target

HAVE_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None
needs_nvrx = pytest.mark.skipif(not HAVE_NVRX, reason="nvidia-resiliency-ext is not installed")
BUDGET_S = 0.2
"""Per input, in CPU time of this thread (a shared machine's preemption is not the decoder's
cost): far above what a 64 KiB message costs (a few milliseconds), far below a freeze."""

# What nvidia-resiliency-ext 0.4.1's client sends (multiprocessing's ForkingPickler, protocol
# 4), made by _nvrx_objects() below.
FRAMES: dict[str, bytes] = {
    "authkey": (
        b"\x80\x04\x95q\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\nAuthkeyMsg\x94\x93\x94)"
        b"\x81\x94}\x94\x8c\x07authkey\x94C kkkkkkkk"
        b"kkkkkkkkkkkkkkkkkkkkkkkk"
        b"\x94sb."
    ),
    "init": (
        b"\x80\x04\x95\xa0\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\x07InitMsg\x94\x93\x94)\x81\x94}"
        b"\x94\x8c\trank_info\x94h\x00\x8c\x08RankInf"
        b"o\x94\x93\x94)\x81\x94}\x94(\x8c\x0bglobal_rank\x94"
        b"\x8c\x013\x94\x8c\nlocal_rank\x94K\x01\x8c\x04hos"
        b"t\x94\x8c\x06node-1\x94\x8c\x03pid\x94Jp\x11\x01\x00ub"
        b"sb."
    ),
    "heartbeat": (
        b"\x80\x04\x95[\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\x0cHeartbeatMsg\x94\x93"
        b"\x94)\x81\x94}\x94(\x8c\x04rank\x94\x8c\x013\x94\x8c\x05stat"
        b"e\x94Nub."
    ),
    "section_open": (
        b"\x80\x04\x95\x84\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\nSectionMsg\x94\x93\x94)"
        b"\x81\x94}\x94(\x8c\x04rank\x94\x8c\x010\x94\x8c\x07sectio"
        b"n\x94\x8c\x04step\x94\x8c\x06action\x94h\x00\x8c\rSe"
        b"ctionAction\x94\x93\x94K\x01\x85\x94R\x94ub."
    ),
    "section_close": (
        b"\x80\x04\x95\x82\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\nSectionMsg\x94\x93\x94)"
        b"\x81\x94}\x94(\x8c\x04rank\x94K\x02\x8c\x07section\x94"
        b"\x8c\x04step\x94\x8c\x06action\x94h\x00\x8c\rSect"
        b"ionAction\x94\x93\x94K\x02\x85\x94R\x94ub."
    ),
    "close_all": (
        b"\x80\x04\x95~\x00\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\nSectionMsg\x94\x93\x94)"
        b"\x81\x94}\x94(\x8c\x04rank\x94\x8c\x010\x94\x8c\x07sectio"
        b"n\x94N\x8c\x06action\x94h\x00\x8c\rSectionA"
        b"ction\x94\x93\x94K\x03\x85\x94R\x94ub."
    ),
    "update_config": (
        b"\x80\x04\x95a\x01\x00\x00\x00\x00\x00\x00\x8c*nvidia_resi"
        b"liency_ext.fault_toleran"
        b"ce.data\x94\x8c\x0fUpdateConfigMs"
        b"g\x94\x93\x94)\x81\x94}\x94(\x8c\x0bhb_timeouts\x94"
        b"h\x00\x8c\x11HeartbeatTimeouts\x94\x93\x94"
        b")\x81\x94}\x94(\x8c\x07initial\x94G@$\x00\x00\x00\x00\x00"
        b"\x00\x8c\nsubsequent\x94G@\x14\x00\x00\x00\x00\x00\x00\x8c"
        b"\x0fwere_calculated\x94\x88ub\x8c\x10se"
        b"ction_timeouts\x94h\x00\x8c\x0fSecti"
        b"onTimeouts\x94\x93\x94)\x81\x94}\x94(\x8c\x07sec"
        b"tion\x94}\x94(\x8c\x04step\x94G@\x08\x00\x00\x00\x00\x00\x00"
        b"\x8c\x04init\x94Nu\x8c\x0eout_of_sectio"
        b"n\x94G@\x00\x00\x00\x00\x00\x00\x00\x8c\x13calculated_"
        b"sections\x94\x8f\x94(h\x14\x90\x8c\x1cis_out_"
        b"of_section_calculated\x94\x88u"
        b"bub."
    ),
    "workload_request": (
        b"\x80\x04\x95\x91\x00\x00\x00\x00\x00\x00\x00K\x01\x8c*nvidia_re"
        b"siliency_ext.fault_toler"
        b"ance.data\x94\x8c\x16WorkloadCont"
        b"rolRequest\x94\x93\x94)\x81\x94}\x94(\x8c\x06act"
        b"ion\x94h\x00\x8c\x0eWorkloadAction\x94\x93"
        b"\x94K\x01\x85\x94R\x94\x8c\x0bdescription\x94\x8c\x07b"
        b"ad nic\x94ub\x86\x94."
    ),
}
EXPECTED: dict[str, str] = {
    "authkey": "AuthkeyMsg(authkey=None)",
    "init": (
        "InitMsg(rank_info=RankInfo(global_rank=3, local_rank=1, host='node-1', pid=70000), "
        "iteration=None, num_warmup_iters=None)"
    ),
    "heartbeat": "HeartbeatMsg(rank=3, state=None)",
    "section_open": (
        "SectionMsg(rank=0, section='step', action=<SectionAction.OPEN: 1>, iteration=None)"
    ),
    "section_close": (
        "SectionMsg(rank=2, section='step', action=<SectionAction.CLOSE: 2>, iteration=None)"
    ),
    "close_all": (
        "SectionMsg(rank=0, section=None, action=<SectionAction.CLOSE_ALL: 3>, iteration=None)"
    ),
    "update_config": (
        "UpdateConfigMsg(hb_timeouts=HeartbeatTimeouts(initial=10.0, subsequent=5.0, "
        "were_calculated=True), section_timeouts=SectionTimeouts(section={'step': 3.0, "
        "'init': None}, out_of_section=2.0, calculated_sections=frozenset({'step'}), "
        "is_out_of_section_calculated=True), current_cycle=None)"
    ),
    "workload_request": (
        "(1, WorkloadControlRequest(action=<WorkloadAction.ExcludeThisNode: 1>, "
        "description='bad nic'))"
    ),
}
USED = {
    "PROTO", "FRAME", "STOP", "MARK", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1",
    "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE", "SHORT_BINBYTES",
    "BINBYTES", "MEMOIZE", "BINGET", "LONG_BINGET", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3", "TUPLE", "SETITEM", "SETITEMS", "ADDITEMS", "GLOBAL",
    "STACK_GLOBAL", "NEWOBJ", "BUILD", "REDUCE",
}  # fmt: skip
"""The opcodes the decoder reads: NVRx's protocol-4 pickles and ftd's own protocol-3 writer."""


def decode(data: bytes) -> object:
    """wire.decode within the time budget (the collector held off: a collection of
    hypothesis's heap is not the decoder's cost)."""
    gc.disable()
    start = time.thread_time()
    try:
        return wire.decode(data)
    finally:
        elapsed = time.thread_time() - start
        gc.enable()
        assert elapsed < BUDGET_S, f"{elapsed:.3f} s for {len(data)} bytes"


def refused(data: bytes) -> str:
    with pytest.raises(wire.Refused) as caught:
        decode(data)
    return caught.value.cause


def _nvrx_objects() -> dict[str, object]:
    from nvidia_resiliency_ext.fault_tolerance import data

    init = data.InitMsg()
    init.rank_info = data.RankInfo(global_rank="3", local_rank=1, host="node-1", pid=70000)
    timeouts = data.SectionTimeouts({"step": 3.0, "init": None}, 2.0, {"step"}, True)
    request = data.WorkloadControlRequest(data.WorkloadAction.ExcludeThisNode, "bad nic")
    return {
        "authkey": data.AuthkeyMsg(b"k" * 32),
        "init": init,
        "heartbeat": data.HeartbeatMsg("3", None),
        "section_open": data.SectionMsg(rank="0", section="step", action=data.SectionAction.OPEN),
        "section_close": data.SectionMsg(rank=2, section="step", action=data.SectionAction.CLOSE),
        "close_all": data.SectionMsg(rank="0", section=None, action=data.SectionAction.CLOSE_ALL),
        "update_config": data.UpdateConfigMsg(data.HeartbeatTimeouts(10.0, 5.0, True), timeouts),
        "workload_request": (1, request),
    }


# -- real messages ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_nvrx_frames_decode_to_their_records(name: str) -> None:
    assert repr(decode(FRAMES[name])) == EXPECTED[name]
    opcodes = {op.name for op, _, _ in pickletools.genops(FRAMES[name])}
    assert opcodes <= USED


@needs_nvrx
@pytest.mark.parametrize("name", sorted(FRAMES))
def test_the_installed_nvrx_client_pickles_decode_to_the_same_records(name: str) -> None:
    from nvidia_resiliency_ext.fault_tolerance.utils import _IPC_PICKLER

    message = _nvrx_objects()[name]
    for payload in (bytes(_IPC_PICKLER.dumps(message)), pickle.dumps(message, protocol=5)):
        assert repr(decode(payload)) == EXPECTED[name]


def test_records_are_frozen_and_rank_messages_typed() -> None:
    message = wire.decode_rank_message(FRAMES["section_open"])
    assert isinstance(message, wire.SectionMsg)
    with pytest.raises(AttributeError):
        message.action = wire.SectionAction.CLOSE_ALL
    rank, request = wire.decode_launcher_message(FRAMES["workload_request"])
    assert rank == 1 and request.action is wire.WorkloadAction.ExcludeThisNode
    with pytest.raises(wire.Refused, match="unexpected"):
        wire.decode_rank_message(FRAMES["workload_request"])


def test_ftd_own_writer_round_trips() -> None:
    """tests/bin/nvrx_attack.py builds its good messages with wire.dumps (protocol 3)."""
    info = {"global_rank": "4", "local_rank": 0, "host": "h" * 300, "pid": 2**30}
    message = wire.Ref(wire.DATA_MODULE, "InitMsg", {"rank_info": wire.Ref(
        wire.DATA_MODULE, "RankInfo", info)})  # fmt: skip
    decoded = decode(wire.dumps(message))
    assert isinstance(decoded, wire.InitMsg) and decoded.rank_info is not None
    assert decoded.rank_info.global_rank == 4 and decoded.rank_info.pid == 2**30


# -- row 4: shared structure -----------------------------------------------------------------


def _bomb(depth: int = 60) -> tuple[Any, ...]:
    nested: tuple[Any, ...] = ()
    for _ in range(depth):
        nested = (nested, nested)
    return nested


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_the_memo_shared_tuple_bomb_is_refused_at_once(protocol: int) -> None:
    payload = pickle.dumps(_bomb(), protocol=protocol)
    assert len(payload) < 400
    start = time.thread_time()
    cause = refused(payload)
    assert time.thread_time() - start < 0.05
    # Protocols 2 and 3 memoize with BINPUT, which NVRx never sends.
    assert cause == ("shared" if protocol >= 4 else "malformed")


def test_a_bomb_inside_a_real_message_is_refused() -> None:
    """Row 4's frame: a HeartbeatMsg whose rank is the bomb (pickle.Unpickler built it, and
    the rank check's message printed it: 2^60)."""
    body = pickle.dumps(_bomb(), protocol=4)[2:-1]  # no PROTO, no STOP
    body = body[9:] if body[0] == 0x95 else body  # nor FRAME
    head = b"\x80\x04" + _text(wire.DATA_MODULE) + _text("HeartbeatMsg") + b"\x93)\x81}"
    payload = head + _text("rank") + body + b"sb."
    assert len(payload) < 400
    assert refused(payload) == "shared"


def test_memo_references_to_strings_and_classes_are_fine() -> None:
    # NVRx refers back to the module name (BINGET 0) and to section names (in ADDITEMS).
    assert isinstance(decode(FRAMES["update_config"]), wire.UpdateConfigMsg)


# -- row 5: BUILD, classes, enums ------------------------------------------------------------


def _global(name: str) -> bytes:
    return b"c" + wire.DATA_MODULE.encode() + b"\n" + name.encode() + b"\n"


def _text(value: str) -> bytes:
    return b"\x8c" + bytes([len(value)]) + value.encode()


def _rewrite_enum(name: str, state: bytes) -> list[bytes]:
    """BUILD on the enum class itself: (dict) and (None, slotstate) forms."""
    return [
        b"\x80\x04" + _global(name) + state + b"b.",
        b"\x80\x04" + _global(name) + b"N" + state + b"\x86b.",
    ]


@pytest.mark.parametrize("enum_name", ["SectionAction", "WorkloadAction"])
def test_build_on_an_allowed_class_is_refused_and_the_enums_are_untouched(
    enum_name: str,
) -> None:
    before = (
        dict(wire.SectionAction._value2member_map_),
        dict(wire.WorkloadAction._value2member_map_),
    )
    # Row 5's frame: every value now means member 3 (CLOSE_ALL, ShutdownWorkload). Its int
    # keys are refused already; with a name for a key, BUILD itself is.
    remap = b"}" + _text("_value2member_map_") + b"}K\x01K\x03ss"
    for payload in _rewrite_enum(enum_name, remap):
        assert refused(payload) in ("malformed", "build_refused")
    named = b"}" + _text("_value2member_map_") + b"}" + _text("x") + b"K\x03ss"
    for payload in _rewrite_enum(enum_name, named):
        assert refused(payload) == "build_refused"
    after = (
        dict(wire.SectionAction._value2member_map_),
        dict(wire.WorkloadAction._value2member_map_),
    )
    assert before == after
    opened = decode(FRAMES["section_open"])
    assert isinstance(opened, wire.SectionMsg) and opened.action is wire.SectionAction.OPEN
    _, request = wire.decode_launcher_message(FRAMES["workload_request"])
    assert request.action is wire.WorkloadAction.ExcludeThisNode


def test_build_twice_newobj_of_an_enum_and_reduce_of_a_record_are_refused() -> None:
    section = _global("SectionMsg") + b")\x81"
    twice = b"\x80\x04" + section + b"}b}" + _text("rank") + b"K\x01sb."
    assert refused(twice) == "build_refused"
    assert refused(b"\x80\x04" + _global("SectionAction") + b")\x81.") == "refused_class"
    assert refused(b"\x80\x04" + _global("SectionMsg") + b"K\x01\x85R.") == "refused_class"
    assert refused(b"\x80\x04" + _global("SectionAction") + b"K\x07\x85R.") == "bad_field"
    assert refused(b"\x80\x04" + _global("SectionAction") + b"\x88\x85R.") == "bad_field"
    # A record's state goes through its fields: no attribute of the sender's choosing.
    odd = b"\x80\x04" + section + b"}" + _text("__class__") + b"Nsb."
    assert refused(odd) == "bad_state"


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04cbuiltins\neval\n.",
        b"\x80\x04\x8c\x05posix\x8c\x06system\x93.",
        b"\x80\x04cnvidia_resiliency_ext.fault_tolerance.data\nOkMsg\n.",
        b"\x80\x04cnvidia_resiliency_ext.fault_tolerance.data\n__builtins__\n.",
        b"\x80\x04K\x01K\x02\x93.",
        b"\x80\x04c" + b"x" * 300 + b"\n",
    ],
    ids=["eval", "os.system", "reply class", "module attribute", "ints", "long line"],
)
def test_globals_outside_the_tables_are_refused(payload: bytes) -> None:
    assert refused(payload) in ("refused_class", "malformed")


# -- budgets ---------------------------------------------------------------------------------


def test_deep_nesting_is_refused() -> None:
    nested: Any = 1
    for _ in range(nvrx_pickle.MAX_DEPTH + 1):
        nested = (nested,)
    assert refused(pickle.dumps(nested, protocol=4)) == "too_deep"
    assert refused(b"\x80\x04" + b"(" * 1000 + b"t" * 1000 + b".") == "too_deep"
    assert refused(b"\x80\x04" + b"}" * 2000 + b".") == "too_many"


def test_many_items_and_long_keys_are_refused() -> None:
    many = b"\x80\x04}(" + b"\x8c\x01kN" * 3000 + b"u."
    assert refused(many) == "too_many"
    long_key = b"\x80\x04}X" + struct.pack("<I", 300) + b"k" * 300 + b"Ns."
    assert refused(long_key) == "malformed"
    assert refused(b"\x80\x04\x8f(K\x01\x90.") == "malformed"  # set items are names


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04X\xff\xff\xff\xff" + b"x" * 16 + b".",  # BINUNICODE of 4 GiB
        b"\x80\x04B\xff\xff\xff\xff" + b"x" * 16 + b".",  # BINBYTES of 4 GiB
        b"\x80\x04\x8c\xffabc.",
        b"\x80\x04\x95" + struct.pack("<Q", 2**63) + b"N.",  # FRAME
        b"\x80\x04N\x94j\xff\xff\xff\xff.",  # LONG_BINGET far off
        b"\x80\x04\x8a\xff" + b"\x01" * 255 + b".",  # LONG1 of 255 bytes
        b"\x80\x04\x8c\x02\xff\xfe.",  # not UTF-8
        b"\x80\x09N.",  # protocol 9
    ],
    ids=["binunicode", "binbytes", "short", "frame", "binget", "long1", "utf8", "proto"],
)
def test_declared_lengths_are_checked_before_anything_is_read(payload: bytes) -> None:
    assert refused(payload) == "malformed"


def test_truncated_frames_and_trailing_bytes_are_refused() -> None:
    for payload in FRAMES.values():
        for end in range(len(payload)):
            refused(payload[:end])
        assert refused(payload + b"N") == "malformed"
    assert refused(b"\x80\x04NN.") == "malformed"
    assert refused(b"\x80\x04(N.") == "malformed"


_UNUSED = sorted((op for op in pickletools.opcodes if op.name not in USED), key=lambda op: op.code)


@pytest.mark.parametrize("opcode", _UNUSED, ids=[op.name for op in _UNUSED])
def test_every_opcode_nvrx_does_not_use_is_refused(opcode: pickletools.OpcodeInfo) -> None:
    code = opcode.code.encode("latin-1")
    for before in (b"", b"N", b"}", b"(N"):
        payload = b"\x80\x04" + before + code + b"\x00" * 9 + b"."
        with pytest.raises(wire.Refused, match="is not one NVRx sends"):
            decode(payload)


# -- fuzzing ---------------------------------------------------------------------------------


def _check(payload: bytes) -> None:
    with contextlib.suppress(wire.Refused):
        decode(payload)


FUZZ = fuzz_target("nvrx_pickle", 300)
"""A short pass with the tests; the long one: `make fuzz-long` (docs/security.md)."""


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(payload: bytes) -> None:
    _check(payload)
    _check(b"\x80\x04" + payload)


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


@FUZZ
@given(_mutated())
def test_fuzz_mutated_real_frames(payload: bytes) -> None:
    _check(payload)


_PIECES = [
    b"(", b"N", b"\x88", b"K\x01", b"\x8c\x04step", b"\x94", b"h\x00", b"h\x01", b"}", b")",
    b"\x8f", b"\x85", b"\x86", b"\x87", b"t", b"s", b"u", b"\x90", b"\x93", b"\x81", b"b",
    b"R", _text(wire.DATA_MODULE), _text("SectionMsg"), _text("SectionAction"),
    _text("section"), _text("rank"), _global("HeartbeatMsg"), b"G" + b"\x00" * 8,
    _global("InitMsg"), _text("iteration"), _text("num_warmup_iters"), _text("later"),
    b"\x8a\x08" + b"\xff" * 8, b"M\xb1\x04",
]  # fmt: skip


@FUZZ
@given(st.lists(st.sampled_from(_PIECES), max_size=120))
def test_fuzz_sequences_of_the_opcodes_nvrx_uses(pieces: list[bytes]) -> None:
    _check(b"\x80\x04" + b"".join(pieces) + b".")


def test_a_full_size_message_costs_milliseconds_and_a_few_times_its_size() -> None:
    """The worst the budgets allow at 64 KiB: at most MAX_OPCODES opcodes are read, and the
    memory held at the peak is a small multiple of the message."""
    size = wire.MAX_MESSAGE_BYTES
    cheap = b"\x8c\x01x\x94" + b"h\x00" * 32000
    for payload in (
        b"\x80\x04" + cheap + b".",
        b"\x80\x04}(" + b"\x8c\x01k\x94N" + b"h\x00N" * 4000 + b"u.",
        b"\x80\x04" + b"N" * (size - 3) + b".",
    ):
        assert refused(payload) == "too_many"
    many = b"\x80\x04" + b"N" * (nvrx_pickle.MAX_OPCODES - 2) + b"."  # with PROTO and STOP
    assert refused(many) == "malformed"  # read to its STOP: more than one value
    text = b"\x80\x04X" + struct.pack("<I", size - 12) + b"a" * (size - 12) + b"."
    section = b"\x80\x04" + _global("SectionMsg") + b")\x81}" + _text("section")
    named = section + b"X" + struct.pack("<I", size - 80) + b"s" * (size - 80) + b"sb."
    for payload in (cheap[: size - 3], many, text, named):
        tracemalloc.start()
        with contextlib.suppress(wire.Refused):
            decode(payload)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 4 * size, f"{peak} bytes held for {len(payload)}"
