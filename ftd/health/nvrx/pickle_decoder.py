"""A decoder of the few pickle opcodes NVRx's messages use, and nothing else.

`pickle.Unpickler`, even with `find_class` narrowed to an allow-list, is no safe decoder: it
shares memoized containers (a 333-byte frame of nested tuples that each appear twice costs
2^depth to hash or print), and BUILD sets attributes on whatever is on its stack (a class
included: `SectionAction._value2member_map_` rewritten). This decoder walks the bytes with one
loop and holds the input to NVRx 0.4.x's own shapes:

- Opcodes: those of NVRx's protocol-4 pickles (`multiprocessing`'s ForkingPickler) and of the
  protocol-3 writer in ftd/health/nvrx/wire.py (GLOBAL, BINUNICODE, BININT, BINBYTES, for values too
  long for the short forms). Any other opcode is refused (lists, DUP, POP, PERSID, EXT,
  INST/OBJ, NEWOBJ_EX, BINPUT, protocol 5's buffers...).
- Memo references to atoms only (None, bools, numbers, strings, bytes, class references): a
  container or an object is never reachable twice, so what is built is a tree no larger than
  the input.
- Globals resolve through two explicit tables given by the caller: record builders (NEWOBJ with
  no arguments, then at most one BUILD, on the object just made) and enums (REDUCE of an int,
  looked up in a dict of members). No class is ever looked up, called or changed.
- Budgets: the input's length (the caller's), the number of opcodes, nesting depth, number of
  containers, number of items, dict keys and set items short strings; every declared length
  is checked against the bytes that are left before anything is sliced. Time is linear in the
  input and bounded by the opcode count.

Everything else is `Refused(cause, detail)`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

MAX_DEPTH = 8
"""Nesting of containers and objects (NVRx's deepest message, UpdateConfigMsg, uses 5)."""
MAX_CONTAINERS = 64
MAX_ITEMS = 4096
"""Items in every container together (sections are bounded far lower by the records)."""
MAX_KEY = 256
"""Length of a dict key or set item (field names and section names)."""
MAX_GLOBAL_LINE = 256
MAX_OPCODES = 4096
"""Opcodes in a message: NVRx's largest (timeouts of 256 sections) has about 1100. This, not
the 64 KiB, bounds a message's time: a few milliseconds."""

Builder = Callable[[dict[str, Any]], object]


class Refused(ValueError):
    """A message that is not one NVRx's client sends; `cause` labels it for counting."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


class ClassRef:
    """A global that resolved to one of the caller's tables; only ever a name."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name


class _Fresh:
    """An object made by NEWOBJ and not yet built: becomes a record at BUILD (or, left
    without state, with its defaults)."""

    __slots__ = ("ref",)

    def __init__(self, ref: ClassRef) -> None:
        self.ref = ref


class _Shared:
    """In the memo in place of a container or an object: a reference to it is refused."""

    __slots__ = ()


_SHARED = _Shared()
_ATOMS = (type(None), bool, int, float, str, bytes, ClassRef)
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")


class _Decoder:
    def __init__(
        self,
        data: bytes,
        records: Mapping[tuple[str, str], Builder],
        enums: Mapping[tuple[str, str], Mapping[int, object]],
    ) -> None:
        self.data = data
        self.pos = 0
        self.records = records
        self.enums = enums
        self.stack: list[object] = []
        self.depths: list[int] = []  # beside each stack entry: how deep its value nests
        self.marks: list[int] = []
        self.memo: list[object] = []
        self.containers = 0
        self.items = 0

    # -- reading bytes -------------------------------------------------------------------

    def take(self, size: int) -> bytes:
        end = self.pos + size
        if size < 0 or end > len(self.data):
            raise Refused("malformed", f"{size} bytes declared at {self.pos}, fewer left")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, layout: struct.Struct) -> Any:
        return layout.unpack(self.take(layout.size))[0]

    def text(self, size: int) -> str:
        try:
            return self.take(size).decode("utf-8")
        except UnicodeDecodeError:
            raise Refused("malformed", "a string that is not UTF-8") from None

    def line(self) -> str:
        end = self.data.find(b"\n", self.pos, self.pos + MAX_GLOBAL_LINE)
        if end < 0:
            raise Refused("malformed", "a GLOBAL name without its end")
        raw = self.data[self.pos : end]
        self.pos = end + 1
        if not raw.isascii():
            raise Refused("refused_class", "a global name that is not ASCII")
        return raw.decode("ascii")

    # -- the stack -----------------------------------------------------------------------

    def push(self, value: object, depth: int = 0) -> None:
        self.stack.append(value)
        self.depths.append(depth)

    def container(self, value: object, depth: int) -> None:
        self.containers += 1
        if self.containers > MAX_CONTAINERS:
            raise Refused("too_many", f"more than {MAX_CONTAINERS} containers")
        if depth > MAX_DEPTH:
            raise Refused("too_deep", f"nested deeper than {MAX_DEPTH}")
        self.push(value, depth)

    def pop(self) -> tuple[object, int]:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor:
            raise Refused("malformed", "an opcode without its operand")
        return self.settle(self.stack.pop()), self.depths.pop()

    def since_mark(self) -> tuple[list[object], int]:
        """The values pushed since the last MARK, popped with it; their deepest depth."""
        if not self.marks:
            raise Refused("malformed", "an opcode that needs a MARK without one")
        start = self.marks.pop()
        values = [self.settle(value) for value in self.stack[start:]]
        depth = max(self.depths[start:], default=0)
        del self.stack[start:], self.depths[start:]
        self.count(len(values))
        return values, depth

    def count(self, items: int) -> None:
        self.items += items
        if self.items > MAX_ITEMS:
            raise Refused("too_many", f"more than {MAX_ITEMS} items")

    def top(self, kind: type) -> Any:
        floor = self.marks[-1] if self.marks else 0
        if len(self.stack) <= floor or not isinstance(self.stack[-1], kind):
            raise Refused("malformed", f"a {kind.__name__} expected on the stack")
        return self.stack[-1]

    def settle(self, value: object) -> object:
        if isinstance(value, _Fresh):
            return self.records[(value.ref.module, value.ref.name)]({})
        return value

    def key(self, value: object, what: str) -> str:
        if not isinstance(value, str) or len(value) > MAX_KEY:
            raise Refused("malformed", f"{what} must be a short string")
        return value

    def deepen(self, depth: int) -> None:
        """The value on top now holds one of `depth`."""
        self.depths[-1] = max(self.depths[-1], depth + 1)
        if self.depths[-1] > MAX_DEPTH:
            raise Refused("too_deep", f"nested deeper than {MAX_DEPTH}")

    def setitems(self, pairs: list[object], depth: int) -> None:
        if len(pairs) % 2:
            raise Refused("malformed", "SETITEMS with an odd number of values")
        target = self.top(dict)
        for index in range(0, len(pairs), 2):
            target[self.key(pairs[index], "a dict key")] = pairs[index + 1]
        self.deepen(depth)

    def global_(self, module: object, name: object) -> None:
        if not isinstance(module, str) or not isinstance(name, str):
            raise Refused("malformed", "a global's names must be strings")
        if (module, name) not in self.records and (module, name) not in self.enums:
            # repr: a name is the sender's text, printed escaped.
            raise Refused("refused_class", f"{module!r:.80}.{name!r:.80} is not an NVRx class")
        self.push(ClassRef(module, name))

    def get(self, index: int) -> None:
        if index >= len(self.memo):
            raise Refused("malformed", f"memo {index} was never stored")
        if (value := self.memo[index]) is _SHARED:
            raise Refused("shared", "a memo reference to a container or an object")
        self.push(value)

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise Refused("malformed", "the message ends inside an opcode")
        self.pos += 1
        return self.data[self.pos - 1]

    def run(self) -> object:
        data = self.data
        for _ in range(MAX_OPCODES):
            if self.pos >= len(data):
                raise Refused("malformed", "no STOP: the message is truncated")
            code = data[self.pos]
            self.pos += 1
            if code == 0x2E:  # STOP
                if self.marks or len(self.stack) != 1:
                    raise Refused("malformed", "STOP with other than one value on the stack")
                if self.pos != len(data):
                    raise Refused("malformed", "bytes after STOP")
                return self.settle(self.stack[0])
            self.step(code)
        raise Refused("too_many", f"more than {MAX_OPCODES} opcodes")

    def step(self, code: int) -> None:
        match code:
            case 0x94:  # MEMOIZE: atoms only can be fetched again
                value = self.top(object)
                self.memo.append(value if isinstance(value, _ATOMS) else _SHARED)
            case 0x8C:  # SHORT_BINUNICODE
                self.push(self.text(self.byte()))
            case 0x68:  # BINGET
                self.get(self.byte())
            case 0x80:  # PROTO
                if not 2 <= self.byte() <= 5:
                    raise Refused("malformed", "a pickle protocol NVRx does not use")
            case 0x95:  # FRAME: advisory, only checked
                if self.unpack(_U64) > len(self.data) - self.pos:
                    raise Refused("malformed", "a FRAME longer than the message")
            case 0x28:  # MARK
                if len(self.marks) >= MAX_DEPTH:
                    raise Refused("too_deep", f"more than {MAX_DEPTH} open MARKs")
                self.marks.append(len(self.stack))
            case 0x4E:  # NONE
                self.push(None)
            case 0x88 | 0x89:  # NEWTRUE, NEWFALSE
                self.push(code == 0x88)
            case 0x4B:  # BININT1
                self.push(self.byte())
            case 0x4D:  # BININT2
                self.push(self.unpack(_U16))
            case 0x4A:  # BININT
                self.push(self.unpack(_I32))
            case 0x8A:  # LONG1
                if (size := self.byte()) > 8:
                    raise Refused("malformed", "an integer longer than 8 bytes")
                self.push(int.from_bytes(self.take(size), "little", signed=True))
            case 0x47:  # BINFLOAT
                self.push(self.unpack(_F64))
            case 0x58:  # BINUNICODE
                self.push(self.text(self.unpack(_U32)))
            case 0x43:  # SHORT_BINBYTES
                self.push(self.take(self.byte()))
            case 0x42:  # BINBYTES
                self.push(self.take(self.unpack(_U32)))
            case 0x6A:  # LONG_BINGET
                self.get(self.unpack(_U32))
            case 0x7D:  # EMPTY_DICT
                self.container({}, 1)
            case 0x8F:  # EMPTY_SET
                self.container(set(), 1)
            case 0x29:  # EMPTY_TUPLE
                self.container((), 1)
            case 0x85 | 0x86 | 0x87:  # TUPLE1, TUPLE2, TUPLE3
                popped = [self.pop() for _ in range(code - 0x84)][::-1]
                self.count(len(popped))
                depth = max(depth for _, depth in popped)
                self.container(tuple(value for value, _ in popped), depth + 1)
            case 0x74:  # TUPLE
                values, depth = self.since_mark()
                self.container(tuple(values), depth + 1)
            case 0x73:  # SETITEM
                value, depth = self.pop()
                key, _ = self.pop()
                self.count(2)
                self.setitems([key, value], depth)
            case 0x75:  # SETITEMS
                self.setitems(*self.since_mark())
            case 0x90:  # ADDITEMS
                values, _ = self.since_mark()
                target = self.top(set)
                for value in values:
                    target.add(self.key(value, "a set item"))
            case 0x63:  # GLOBAL
                module = self.line()
                self.global_(module, self.line())
            case 0x93:  # STACK_GLOBAL
                name, _ = self.pop()
                self.global_(self.pop()[0], name)
            case 0x81:  # NEWOBJ: an NVRx message class, no arguments
                args, _ = self.pop()
                ref, _ = self.pop()
                if not isinstance(ref, ClassRef) or (ref.module, ref.name) not in self.records:
                    raise Refused("refused_class", "NEWOBJ of other than an NVRx message class")
                if args != ():
                    raise Refused("malformed", "NEWOBJ with arguments")
                self.container(_Fresh(ref), 1)
            case 0x62:  # BUILD: only the object just made, once
                self.build_top()
            case 0x52:  # REDUCE: an NVRx enum of an int, by the table
                self.reduce()
            case _:
                raise Refused("malformed", f"opcode {bytes([code])!r} is not one NVRx sends")

    def build_top(self) -> None:
        state, depth = self.pop()
        fresh = self.top(object)
        if not isinstance(fresh, _Fresh):
            raise Refused("build_refused", "BUILD on something other than an object just made")
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
            state = state[0]  # (dict, no slots), as some protocols write it
        if not isinstance(state, dict):
            raise Refused("bad_state", f"{fresh.ref.name}: state is not a mapping")
        builder = self.records[(fresh.ref.module, fresh.ref.name)]
        self.stack[-1] = builder(state)
        self.deepen(depth)

    def reduce(self) -> None:
        args, _ = self.pop()
        ref, _ = self.pop()
        if not isinstance(ref, ClassRef) or (ref.module, ref.name) not in self.enums:
            raise Refused("refused_class", "REDUCE of something other than an NVRx enum")
        if not isinstance(args, tuple) or len(args) != 1 or type(args[0]) is not int:
            raise Refused("bad_field", f"{ref.name}: an enum value must be one int")
        member = self.enums[(ref.module, ref.name)].get(args[0])
        if member is None:
            raise Refused("bad_field", f"{ref.name}: no member {args[0]}")
        self.push(member)


def load(
    data: bytes,
    records: Mapping[tuple[str, str], Builder],
    enums: Mapping[tuple[str, str], Mapping[int, object]],
) -> object:
    """One message: atoms, tuples, dicts, sets, the records the builders made and the enum
    members of the tables. `Refused` for anything else."""
    return _Decoder(data, records, enums).run()
