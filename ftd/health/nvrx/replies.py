"""ftd's replies to NVRx's client, written as pickles by reference to NVRx's own classes.

`ok`, `error` and `ack` name `nvidia_resiliency_ext.fault_tolerance.data.OkMsg`,
`...config.FaultToleranceConfig` and the like, so the client's ordinary unpickle builds its own
objects; the daemon never imports NVRx. Only plain values, `Ref`s and `EnumRef`s are written.
"""

from __future__ import annotations

import struct
from typing import Any

DATA_MODULE = "nvidia_resiliency_ext.fault_tolerance.data"
CONFIG_MODULE = "nvidia_resiliency_ext.fault_tolerance.config"
LENGTH = struct.Struct(">I")


class Ref:
    """An object of an NVRx class, written as NEWOBJ + BUILD(state)."""

    def __init__(self, module: str, name: str, state: dict[str, Any]) -> None:
        self.module, self.name, self.state = module, name, state


class EnumRef:
    """An enum member, written as REDUCE(cls, (value,)), as Enum pickles itself."""

    def __init__(self, module: str, name: str, value: int) -> None:
        self.module, self.name, self.value = module, name, value


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _write(value: object, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        if not -(2**31) <= value < 2**31:
            raise ValueError(f"integer {value} out of range")
        out += b"J" + struct.pack("<i", value)
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        raw = value.encode()
        out += b"X" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes):
        out += b"B" + struct.pack("<I", len(value)) + value
    elif isinstance(value, dict):
        out += b"}("
        for key, item in value.items():
            _write(key, out)
            _write(item, out)
        out += b"u"
    elif isinstance(value, Ref):
        out += _global(value.module, value.name) + b")\x81"
        _write(value.state, out)
        out += b"b"
    elif isinstance(value, EnumRef):
        out += _global(value.module, value.name)
        _write(value.value, out)
        out += b"\x85R"
    else:
        raise TypeError(f"cannot write {type(value).__name__}")


def dumps(value: object) -> bytes:
    """Pickle protocol 3 of plain values, Refs and EnumRefs."""
    out = bytearray(b"\x80\x03")
    _write(value, out)
    out += b"."
    return bytes(out)


def frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


def ok(**fields: object) -> bytes:
    return frame(dumps(Ref(DATA_MODULE, "OkMsg", dict(fields))))


def error(cause: str) -> bytes:
    return frame(dumps(Ref(DATA_MODULE, "ErrorMsg", {"cause": cause})))


def ack() -> bytes:
    """IpcConnector's acknowledgement: the bytes b'ok'."""
    return frame(dumps(b"ok"))
