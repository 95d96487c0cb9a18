"""A snapshot's skeleton: the state dict with every tensor replaced by a reference to its bytes,
written in a format of ftd's own that holds data and nothing else. Reading it can build only the
types below, calls nothing named by the bytes and runs no code of theirs (it replaced pickle:
a skeleton planted in --checkpoint-persist DIR, or in a replica, is data, not a program).

What a skeleton holds: dict and OrderedDict (with Module.state_dict's `_metadata`), list,
tuple, str, bytes, int, float (NaN and infinities, bit for bit), bool, None, torch.Size,
torch.dtype, torch.device, and tensor references (`Stored`). Anything else is refused when
the snapshot is planned, naming where it is in the state and its type: nothing is written.

One decoder, `decode`: a single pass over the bytes (linear time), every length checked
against the bytes left before it is read, at most MAX_DEPTH nested containers and MAX_VALUES
values, a tree with no shared parts; it returns the tree or raises SkeletonError.
"""

from __future__ import annotations

import collections
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from ftd_client.checkpoint._errors import CheckpointError

MAGIC = b"FTDSKEL1"
MAX_BYTES = 1 << 30
MAX_DEPTH = 64
MAX_VALUES = 1 << 22
MAX_INT_BYTES = 1024
"""An int of at most 8191 bits (a random.getstate() holds 32-bit ones)."""
MAX_TEXT_BYTES = 1 << 24
MAX_DIMS = 64
MAX_ODD_KEYS = 256
"""Dict keys that are neither str nor a small int, in the whole skeleton: floats, tuples and
the like hash without randomization, so a few of them colliding cost each insert a scan."""
MAX_KEY_TUPLE = 16
SMALL_INT = 2**61 - 2
"""Int keys within ±SMALL_INT hash to themselves: no two collide (but -1 and -2)."""
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,5})?")
_DOUBLE = struct.Struct("<d")
_DTYPES = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}

NONE, TRUE, FALSE, INT, FLOAT, TEXT, BYTES = b"NTFifsb"
LIST, TUPLE, DICT, ORDERED, ORDERED_META, SIZE, DTYPE, DEVICE, TENSOR = b"ltdomSyvR"


class SkeletonError(CheckpointError):
    """Bytes that are not a skeleton ftd wrote (cut short, another format, over a bound)."""


@dataclass(frozen=True)
class Stored:
    """A tensor of the snapshot: where its bytes are (from the data region's start)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * int(self.dtype.itemsize)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- writing ------------------------------------------------------------------------------------


def encode(state: object, reference: Callable[[torch.Tensor], Stored]) -> bytes:
    """The skeleton of `state`; `reference` places each tensor. CheckpointError naming the
    first value that a skeleton cannot hold (where it is in `state`, its type)."""
    out = bytearray(MAGIC)
    _Writer(out, reference).value(state, "state", 0)
    if len(out) > MAX_BYTES:
        raise CheckpointError(f"the state cannot be snapshotted: a skeleton over {MAX_BYTES} bytes")
    return bytes(out)


def _varint(out: bytearray, number: int) -> None:
    while number >= 0x80:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)


def _text(out: bytearray, text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    _varint(out, len(data))
    out += data


class _Writer:
    def __init__(self, out: bytearray, reference: Callable[[torch.Tensor], Stored]) -> None:
        self.out = out
        self.reference = reference
        self.values = 0
        self.odd_keys = 0

    def value(self, value: object, path: str, depth: int) -> None:
        """`value` written, or CheckpointError: what the decoder would refuse is never written."""
        out, kind = self.out, type(value)
        if depth > MAX_DEPTH:
            raise CheckpointError(
                f"{path} cannot be snapshotted: nested deeper than {MAX_DEPTH} (or a cycle)"
            )
        self.values += 1
        if self.values > MAX_VALUES:
            raise CheckpointError(f"{path} cannot be snapshotted: over {MAX_VALUES} values")
        if isinstance(value, torch.Tensor):
            self.tensor(self.reference(value))
        elif kind is Stored:  # a reference already placed
            assert isinstance(value, Stored)
            self.tensor(value)
        elif value is None:
            out.append(NONE)
        elif kind is bool:
            out.append(TRUE if value else FALSE)
        elif kind is int:
            assert isinstance(value, int)
            size = value.bit_length() // 8 + 1
            if size > MAX_INT_BYTES:
                raise CheckpointError(
                    f"{path} cannot be snapshotted: an int of over {MAX_INT_BYTES * 8 - 1} bits"
                )
            out.append(INT)
            _varint(out, size)
            out += value.to_bytes(size, "little", signed=True)
        elif kind is float:
            assert isinstance(value, float)
            out.append(FLOAT)
            out += _DOUBLE.pack(value)
        elif kind is str:
            assert isinstance(value, str)
            data = value.encode("utf-8", "surrogatepass")
            if len(data) > MAX_TEXT_BYTES:
                raise CheckpointError(f"{path} cannot be snapshotted: a str over 16 MiB")
            out.append(TEXT)
            _varint(out, len(data))
            out += data
        elif kind is bytes:
            assert isinstance(value, bytes)
            out.append(BYTES)
            _varint(out, len(value))
            out += value
        elif kind is list or kind is tuple:
            assert isinstance(value, list | tuple)
            out.append(LIST if kind is list else TUPLE)
            _varint(out, len(value))
            for index, item in enumerate(value):
                self.value(item, f"{path}[{index}]", depth + 1)
        elif kind is torch.Size:
            assert isinstance(value, torch.Size)
            out.append(SIZE)
            self.dims(cast(tuple[int, ...], value))
        elif kind in (dict, collections.OrderedDict):
            assert isinstance(value, dict)
            self.mapping(value, path, depth)
        elif kind is torch.dtype:
            assert isinstance(value, torch.dtype)
            out.append(DTYPE)
            _text(out, dtype_name(value))
        elif kind is torch.device:
            out.append(DEVICE)
            _text(out, str(value))
        else:
            raise CheckpointError(
                f"{path} cannot be snapshotted: a {kind.__module__}.{kind.__qualname__}; a "
                "snapshot holds tensors, dict, OrderedDict, list, tuple, str, bytes, int, float, "
                "bool, None, torch.Size, torch.dtype and torch.device only, never a pickle "
                "(convert the value: docs/checkpoint.md)"
            )

    def mapping(self, value: dict[Any, Any], path: str, depth: int) -> None:
        metadata = getattr(value, "_metadata", None)
        if type(value) is dict:
            self.out.append(DICT)
        elif metadata is None:
            self.out.append(ORDERED)
        elif isinstance(metadata, dict):
            self.out.append(ORDERED_META)
            self.value(metadata, f"{path}._metadata", depth + 1)
        else:
            raise CheckpointError(f"{path}._metadata cannot be snapshotted: not a dict")
        _varint(self.out, len(value))
        for key, item in value.items():
            if not _is_key(key):
                raise CheckpointError(
                    f"{path} cannot be snapshotted: a key {key!r:.60} of type "
                    f"{type(key).__qualname__}; keys are str, int (|k| < 2**61), float, bool, "
                    f"None or tuples of at most {MAX_KEY_TUPLE} of those"
                )
            if type(key) is not str and type(key) is not int:
                self.odd_keys += 1
                if self.odd_keys > MAX_ODD_KEYS:
                    raise CheckpointError(
                        f"{path} cannot be snapshotted: over {MAX_ODD_KEYS} dict keys in the "
                        "state that are neither str nor int"
                    )
            self.value(key, f"{path} (a key)", depth + 1)
            self.value(item, f"{path}[{key!r:.60}]", depth + 1)

    def tensor(self, stored: Stored) -> None:
        out = self.out
        out.append(TENSOR)
        _varint(out, stored.offset)
        _text(out, dtype_name(stored.dtype))
        self.dims(stored.shape)
        _text(out, stored.device)

    def dims(self, shape: tuple[int, ...]) -> None:
        if len(shape) > MAX_DIMS:
            raise CheckpointError(f"a tensor or torch.Size of over {MAX_DIMS} dimensions")
        _varint(self.out, len(shape))
        for size in shape:
            _varint(self.out, size)


def _is_key(key: object, inner: bool = False) -> bool:
    """A dict key a skeleton holds (inner: an item of a tuple key)."""
    if type(key) is str:
        return not inner or len(key) <= 256
    if type(key) is float or type(key) is bool or key is None:
        return True
    if type(key) is int:
        return -SMALL_INT <= key <= SMALL_INT
    if type(key) is tuple and not inner:
        return len(key) <= MAX_KEY_TUPLE and all(_is_key(k, True) for k in key)
    return False


# -- reading ------------------------------------------------------------------------------------


def decode(data: bytes) -> Any:
    """The tree a skeleton holds, with a Stored for each tensor; SkeletonError for anything
    that is not exactly one skeleton."""
    if len(data) > MAX_BYTES:
        raise SkeletonError(f"a skeleton of {len(data)} bytes (at most {MAX_BYTES})")
    if bytes(data[: len(MAGIC)]) != MAGIC:
        raise SkeletonError("not a skeleton of this ftd (another format, or an older ftd's pickle)")
    reader = _Reader(bytes(data))
    tree = reader.value(0)
    if reader.pos != len(reader.data):
        raise SkeletonError(f"{len(reader.data) - reader.pos} bytes after the skeleton")
    return tree


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = len(MAGIC)
        self.values = 0
        self.odd_keys = 0

    def take(self, count: int) -> bytes:
        end = self.pos + count
        if end > len(self.data):
            raise SkeletonError(f"cut short: {count} bytes wanted at {self.pos}")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def varint(self) -> int:
        number = shift = 0
        while shift < 64:
            if self.pos >= len(self.data):
                raise SkeletonError(f"cut short in a number at {self.pos}")
            byte = self.data[self.pos]
            self.pos += 1
            number |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return number
            shift += 7
        raise SkeletonError(f"a number of over 64 bits at {self.pos}")

    def count(self) -> int:
        """A length or count: never more than the bytes left (each item takes one at least)."""
        number = self.varint()
        if number > len(self.data) - self.pos:
            raise SkeletonError(f"a length of {number} with {len(self.data) - self.pos} bytes left")
        return number

    def text(self, limit: int = MAX_TEXT_BYTES) -> str:
        size = self.count()
        if size > limit:
            raise SkeletonError(f"a string of {size} bytes (at most {limit})")
        try:
            return self.take(size).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise SkeletonError(f"a string that is not UTF-8 before {self.pos}") from None

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise SkeletonError(f"nested deeper than {MAX_DEPTH}")
        self.values += 1
        if self.values > MAX_VALUES:
            raise SkeletonError(f"more than {MAX_VALUES} values")
        tag = self.take(1)[0]
        simple = _SIMPLE.get(tag)
        if simple is not None:
            return simple(self)
        if tag in (LIST, TUPLE):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return items if tag == LIST else tuple(items)
        if tag == DICT:
            return self.pairs({}, depth)
        if tag == ORDERED:
            return self.pairs(collections.OrderedDict(), depth)
        if tag == ORDERED_META:
            metadata = self.value(depth + 1)
            if not isinstance(metadata, dict):
                raise SkeletonError("an OrderedDict's _metadata that is not a dict")
            ordered: Any = self.pairs(collections.OrderedDict(), depth)
            ordered._metadata = metadata
            return ordered
        raise SkeletonError(f"unknown tag {tag:#04x} at {self.pos - 1}")

    def pairs(self, into: dict[Any, Any], depth: int) -> dict[Any, Any]:
        for _ in range(self.count()):
            key = self.value(depth + 1)
            if not _is_key(key):
                raise SkeletonError(f"a dict key of type {type(key).__qualname__}")
            if type(key) is not str and type(key) is not int:
                self.odd_keys += 1
                if self.odd_keys > MAX_ODD_KEYS:
                    raise SkeletonError(f"more than {MAX_ODD_KEYS} keys not str nor int")
            if key in into:
                raise SkeletonError(f"a dict key twice: {key!r:.60}")
            into[key] = self.value(depth + 1)
        return into

    def integer(self) -> int:
        size = self.count()
        if not 1 <= size <= MAX_INT_BYTES:
            raise SkeletonError(f"an int of {size} bytes")
        return int.from_bytes(self.take(size), "little", signed=True)

    def size(self) -> torch.Size:
        dims = [self.varint() for _ in range(self.count())]
        if len(dims) > MAX_DIMS or any(d >= 2**63 for d in dims):
            raise SkeletonError("a torch.Size out of bounds")
        return torch.Size(dims)

    def dtype(self) -> torch.dtype:
        name = self.text(64)
        dtype = _DTYPES.get(name)
        if dtype is None:
            raise SkeletonError(f"no tensor type {name!r}")
        return dtype

    def device(self) -> torch.device:
        name = self.text(64)
        if not _DEVICE.fullmatch(name):
            raise SkeletonError(f"no device {name!r}")
        try:
            return torch.device(name)
        except (RuntimeError, ValueError):
            raise SkeletonError(f"no device {name!r}") from None

    def tensor(self) -> Stored:
        offset = self.varint()
        dtype = self.dtype()
        shape = self.size()
        return Stored(offset, dtype, tuple(shape), str(self.device()))


_SIMPLE: dict[int, Callable[[_Reader], Any]] = {
    NONE: lambda _: None,
    TRUE: lambda _: True,
    FALSE: lambda _: False,
    INT: _Reader.integer,
    FLOAT: lambda reader: _DOUBLE.unpack(reader.take(_DOUBLE.size))[0],
    TEXT: _Reader.text,
    BYTES: lambda reader: reader.take(reader.count()),
    SIZE: _Reader.size,
    DTYPE: _Reader.dtype,
    DEVICE: _Reader.device,
    TENSOR: _Reader.tensor,
}
