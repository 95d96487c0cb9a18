"""NVIDIA's rank-monitor wire format, read without running anyone's pickle.

nvidia-resiliency-ext's RankMonitorClient sends pickled objects of its own classes, each framed
by a 4-byte big-endian length, over a unix stream socket, and unpickles the replies. Here:

- `decode` reads one message with ftd/health/nvrx/pickle_decoder.py, a decoder of the few
  opcodes NVRx's messages use (never `pickle.Unpickler`): NVRx's message classes become frozen
  records of ours, built from a state whose every field is checked (type, bounds), and its two
  enums members of ours, looked up in explicit tables. No callable of the sender's choosing runs,
  no class is looked up or changed, and a message costs time linear in its bytes
  (MAX_MESSAGE_BYTES at most).
- `ok`, `error` and `ack` (ftd/health/nvrx/replies.py, named here too) write the replies by
  reference to NVRx's own classes, so the client's ordinary unpickle builds its own objects;
  the daemon never imports NVRx.

Message layouts are those of nvidia-resiliency-ext 0.4.x to 0.7.x (`fault_tolerance/data.py`):
0.6 added `InitMsg.iteration` and `.num_warmup_iters`, `SectionMsg.iteration` and
`UpdateConfigMsg.current_cycle`, and sends `RankInfo.global_rank` as an int. A field a later
release adds to a known message is tolerated, not kept (MAX_UNKNOWN_FIELDS).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, ClassVar

from ftd_client.protocol import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from ftd_client.protocol import MAX_SECTION_NAME, MAX_SECTIONS

from ftd.config.ft import MAX_TIMEOUT_S
from ftd.health.nvrx.pickle_decoder import Refused as Refused
from ftd.health.nvrx.pickle_decoder import load
from ftd.health.nvrx.replies import CONFIG_MODULE as CONFIG_MODULE
from ftd.health.nvrx.replies import DATA_MODULE as DATA_MODULE
from ftd.health.nvrx.replies import LENGTH as LENGTH
from ftd.health.nvrx.replies import EnumRef as EnumRef
from ftd.health.nvrx.replies import Ref as Ref
from ftd.health.nvrx.replies import ack as ack
from ftd.health.nvrx.replies import dumps as dumps
from ftd.health.nvrx.replies import error as error
from ftd.health.nvrx.replies import frame as frame
from ftd.health.nvrx.replies import ok as ok

MAX_NAME = MAX_SECTION_NAME
MAX_UNKNOWN_FIELDS = 8
"""Fields of a known message that ftd does not know (a newer NVRx's): at most this many, each
named by an identifier (not a dunder) of at most MAX_FIELD_NAME characters; their values,
bounded by the decoder like every other, are dropped. More, or another name, is `bad_state`."""
MAX_FIELD_NAME = 64
MAX_ITERATION = 2**53
"""A training iteration (Megatron-LM's, which NVRx 0.6 reports) or a cycle: a count."""


# -- field checks ----------------------------------------------------------------------------


def _timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Refused("bad_field", f"a timeout must be a number or None, got {type(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_TIMEOUT_S:
        raise Refused("bad_field", f"timeout {seconds!r} out of range")
    return seconds


def _name(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME:
        raise Refused("bad_field", f"a section name must be a short string, got {value!r:.40}")
    return value


def _rank(value: object) -> int:
    """NVRx sends RANK as read from the environment: an int or a decimal string."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 9:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9:
        return value
    raise Refused("bad_field", f"rank {value!r:.40}")


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31:
        return value
    raise Refused("bad_field", f"integer expected, got {value!r:.40}")


def _count(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_ITERATION:
        return value
    raise Refused("bad_field", f"a count expected, got {value!r:.40}")


def _bool(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise Refused("bad_field", f"bool expected, got {value!r:.40}")


def _text(limit: int) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str):
            raise Refused("bad_field", f"string expected, got {type(value)}")
        return value[:limit]

    return check


def _optional(check: Callable[[object], Any]) -> Callable[[object], Any]:
    return lambda value: None if value is None else check(value)


def _instance(cls: type) -> Callable[[object], Any]:
    def check(value: object) -> Any:
        if not isinstance(value, cls):
            raise Refused("bad_field", f"{cls.__name__} expected, got {type(value).__name__}")
        return value

    return check


def _empty_state(value: object) -> None:
    if value:  # NVRx's own monitor refuses a heartbeat carrying state
        raise Refused("bad_field", "state in a heartbeat is not supported")


def _authkey(value: object) -> None:
    if value is not None and not (isinstance(value, bytes) and len(value) <= 1024):
        raise Refused("bad_field", "authkey must be bytes")
    # multiprocessing's authkey is the rank's secret and of no use to the daemon: not kept.


def _section_map(value: object) -> dict[str, float | None]:
    if not isinstance(value, dict) or len(value) > MAX_SECTIONS:
        raise Refused("bad_field", "section timeouts must be a small mapping")
    return {_name(key): _timeout(timeout) for key, timeout in value.items()}


def _names(value: object) -> frozenset[str]:
    if not isinstance(value, set | frozenset | list | tuple) or len(value) > MAX_SECTIONS:
        raise Refused("bad_field", "calculated_sections must be a small collection")
    return frozenset(_name(item) for item in value)


# -- the stand-ins ---------------------------------------------------------------------------


class Record:
    """An NVRx object's stand-in, frozen: built once from its pickled state through `FIELDS`
    (absent fields take their default; unknown ones, a few, are named in `unknown_fields` and
    their values dropped)."""

    FIELDS: ClassVar[dict[str, tuple[Callable[[object], Any], Any]]] = {}
    unknown_fields: frozenset[str]

    @classmethod
    def build(cls, state: dict[str, Any]) -> Record:
        unknown = frozenset(state.keys() - cls.FIELDS.keys())
        if len(unknown) > MAX_UNKNOWN_FIELDS:
            raise Refused("bad_state", f"{cls.__name__}: {len(unknown)} unknown fields")
        for name in unknown:
            plain = name.isascii() and name.isidentifier() and not name.startswith("__")
            if not plain or len(name) > MAX_FIELD_NAME:
                raise Refused("bad_state", f"{cls.__name__}: a field named {name!r:.40}")
        record = cls.__new__(cls)
        for name, (check, default) in cls.FIELDS.items():
            object.__setattr__(record, name, check(state[name]) if name in state else default)
        object.__setattr__(record, "unknown_fields", unknown)
        cls.complete(record, state)
        return record

    @classmethod
    def complete(cls, record: Record, state: dict[str, Any]) -> None:
        """What a record derives from its whole state (InitMsg: which release sent it)."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name, None)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({fields})"


class SectionAction(enum.IntEnum):
    OPEN = 1
    CLOSE = 2
    CLOSE_ALL = 3


class WorkloadAction(enum.IntEnum):
    Continue = 0
    ExcludeThisNode = 1
    ShutdownWorkload = 2


class RankInfo(Record):
    global_rank: int
    local_rank: int
    host: str
    pid: int
    FIELDS = {
        "global_rank": (_rank, 0),
        "local_rank": (_int, -1),
        "host": (_text(255), ""),
        "pid": (_int, 0),
    }


class HeartbeatTimeouts(Record):
    initial: float | None
    subsequent: float | None
    were_calculated: bool | None
    FIELDS = {
        "initial": (_timeout, None),
        "subsequent": (_timeout, None),
        "were_calculated": (_bool, None),
    }


class SectionTimeouts(Record):
    section: dict[str, float | None]
    out_of_section: float | None
    calculated_sections: frozenset[str]
    is_out_of_section_calculated: bool | None
    FIELDS = {
        "section": (_section_map, {}),
        "out_of_section": (_timeout, None),
        "calculated_sections": (_names, frozenset()),
        "is_out_of_section_calculated": (_bool, False),
    }


class AuthkeyMsg(Record):
    FIELDS = {"authkey": (_authkey, None)}


class InitMsg(Record):
    rank_info: RankInfo | None
    iteration: int | None
    num_warmup_iters: int | None
    client_0_6_or_later: bool
    """NVRx 0.6 and later always send `iteration` and `num_warmup_iters` (None included);
    0.4.x and 0.5.x send the same bytes as each other, with neither."""
    FIELDS = {
        "rank_info": (_optional(_instance(RankInfo)), None),
        "iteration": (_optional(_count), None),
        "num_warmup_iters": (_optional(_count), None),
    }

    @classmethod
    def complete(cls, record: Record, state: dict[str, Any]) -> None:
        object.__setattr__(record, "client_0_6_or_later", "num_warmup_iters" in state)


class HeartbeatMsg(Record):
    FIELDS = {"rank": (_optional(_rank), None), "state": (_empty_state, None)}


class SectionMsg(Record):
    section: str | None
    action: SectionAction
    iteration: int | None
    FIELDS = {
        "rank": (_optional(_rank), None),
        "section": (_optional(_name), None),
        "action": (_instance(SectionAction), SectionAction.CLOSE_ALL),
        "iteration": (_optional(_count), None),
    }


class UpdateConfigMsg(Record):
    hb_timeouts: HeartbeatTimeouts | None
    section_timeouts: SectionTimeouts | None
    current_cycle: int | None
    """Set only by ft_launcher itself (its cycle, for the monitor's log lines); a rank's client
    sends None. ftd's cycle is its own attempt number."""
    FIELDS = {
        "hb_timeouts": (_optional(_instance(HeartbeatTimeouts)), None),
        "section_timeouts": (_optional(_instance(SectionTimeouts)), None),
        "current_cycle": (_optional(_count), None),
    }


class WorkloadControlRequest(Record):
    action: WorkloadAction
    description: str
    FIELDS = {
        "action": (_instance(WorkloadAction), WorkloadAction.Continue),
        "description": (_text(1000), ""),
    }


RECORDS: dict[tuple[str, str], Callable[[dict[str, Any]], object]] = {
    (DATA_MODULE, cls.__name__): cls.build
    for cls in (
        AuthkeyMsg,
        InitMsg,
        HeartbeatMsg,
        SectionMsg,
        UpdateConfigMsg,
        RankInfo,
        HeartbeatTimeouts,
        SectionTimeouts,
        WorkloadControlRequest,
    )
}
# Members by value, written out: nothing a message does can change what an int means.
ENUMS: dict[tuple[str, str], dict[int, object]] = {
    (DATA_MODULE, "SectionAction"): {
        1: SectionAction.OPEN,
        2: SectionAction.CLOSE,
        3: SectionAction.CLOSE_ALL,
    },
    (DATA_MODULE, "WorkloadAction"): {
        0: WorkloadAction.Continue,
        1: WorkloadAction.ExcludeThisNode,
        2: WorkloadAction.ShutdownWorkload,
    },
}
RANK_MESSAGES = (AuthkeyMsg, InitMsg, HeartbeatMsg, SectionMsg, UpdateConfigMsg)


def decode(data: bytes) -> object:
    """One decoded message, of RECORDS' and ENUMS' types and plain values only; Refused
    otherwise."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise Refused("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return load(data, RECORDS, ENUMS)


def decode_rank_message(data: bytes) -> Record:
    message = decode(data)
    if not isinstance(message, RANK_MESSAGES):
        raise Refused("unexpected", f"{type(message).__name__} on the rank monitor socket")
    return message


def decode_launcher_message(data: bytes) -> tuple[int, WorkloadControlRequest]:
    """IpcConnector's message: (global rank, WorkloadControlRequest)."""
    message = decode(data)
    if (
        not isinstance(message, tuple)
        or len(message) != 2
        or not isinstance(message[1], WorkloadControlRequest)
    ):
        raise Refused("unexpected", "the launcher socket takes (rank, WorkloadControlRequest)")
    return _rank(message[0]), message[1]
