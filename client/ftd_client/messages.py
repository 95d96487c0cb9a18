"""ftd's rank messages as records: one frozen record per kind of protocol.py's table (the
memory tier's are in checkpoint_messages.py), built by the rank that sends it and handed to the
daemon's handlers as the door (wire.py) read it. Each record's `read` owns its fields' bounds,
so a record that exists is one its handler can use; `wire` is what the rank sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, Literal, Self

from ftd_client import protocol
from ftd_client.protocol import (
    MAX_DESCRIPTION,
    MAX_FAULT_KIND,
    MAX_OPEN_SECTIONS,
    MAX_SECTIONS,
    MAX_SEQUENCE,
    ProtocolError,
    WorkloadAction,
)
from ftd_client.wire_fields import (
    Fields,
    Names,
    integer,
    is_int,
    names,
    optional_integer,
    section_name,
    timeout_value,
)

TimeoutValue = float | str | None | Mapping[str, float | str | None]
SECTION_TIMEOUTS = "rank_section_timeouts"
"""The one timeout of a `set` that is an object (section name -> seconds)."""
RULES: tuple[Literal["ftd", "nvrx"], ...] = ("ftd", "nvrx")
"""How a `calc` learns: ftd's rule, or NVRx's."""
LEARNED: tuple[Literal["all", "hb", "sections"], ...] = ("all", "hb", "sections")
"""What a `calc` learns (NVRx's rule: `hb` or `sections`)."""


@dataclass(frozen=True, slots=True)
class Hello:
    KIND: ClassVar[str] = protocol.HELLO
    ANSWERED: ClassVar[bool] = True
    stack_signal: int | None = None
    """The signal the daemon sends for this rank's stack dump: a real, catchable one, or None."""

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND, "stack_signal": self.stack_signal}

    @classmethod
    def read(cls, fields: Fields) -> Hello:
        return cls(protocol.valid_stack_signal(fields.get("stack_signal")))


@dataclass(frozen=True, slots=True)
class Bare:
    """A kind that is its type alone."""

    KIND: ClassVar[str] = ""
    ANSWERED: ClassVar[bool] = False

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND}

    @classmethod
    def read(cls, fields: Fields) -> Self:
        return cls()


@dataclass(frozen=True, slots=True)
class Heartbeat(Bare):
    KIND: ClassVar[str] = protocol.HEARTBEAT


@dataclass(frozen=True, slots=True)
class Goodbye(Bare):
    KIND: ClassVar[str] = protocol.GOODBYE


@dataclass(frozen=True, slots=True)
class Resumed(Bare):
    KIND: ClassVar[str] = protocol.RESUMED


@dataclass(frozen=True, slots=True)
class State(Bare):
    """The rank's section state alone (in the envelope), retried after a drop: no sign of life."""

    KIND: ClassVar[str] = protocol.STATE


@dataclass(frozen=True, slots=True)
class Section:
    """A section event: its name (the sections open after it ride in the envelope)."""

    KIND: ClassVar[str] = ""
    ANSWERED: ClassVar[bool] = False
    name: str

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND, "n": self.name}

    @classmethod
    def read(cls, fields: Fields) -> Self:
        return cls(section_name(fields.get("n"), "section name"))


@dataclass(frozen=True, slots=True)
class SectionStart(Section):
    KIND: ClassVar[str] = protocol.SECTION_START


@dataclass(frozen=True, slots=True)
class SectionEnd(Section):
    KIND: ClassVar[str] = protocol.SECTION_END


@dataclass(frozen=True, slots=True)
class WorkloadControl:
    KIND: ClassVar[str] = protocol.WORKLOAD_CONTROL
    ANSWERED: ClassVar[bool] = True
    action: WorkloadAction
    description: str = ""

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND, "a": self.action.name, "d": self.description}

    @classmethod
    def read(cls, fields: Fields) -> WorkloadControl:
        try:
            action = WorkloadAction[str(fields.get("a"))]
        except KeyError:
            raise ProtocolError("bad_action", f"action {fields.get('a')!r:.40}") from None
        description = fields.get("d", "")
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION:
            raise ProtocolError("bad_request", f"description must be text of <= {MAX_DESCRIPTION}")
        return cls(action, description)


@dataclass(frozen=True, slots=True)
class CalculateTimeouts:
    KIND: ClassVar[str] = protocol.CALCULATE_TIMEOUTS
    ANSWERED: ClassVar[bool] = True
    sections: Names | None = None
    """The sections to learn (None: every one observed)."""
    out_of_section: bool = True
    rule: Literal["ftd", "nvrx"] = "ftd"
    """`ftd` or `nvrx` (NVRx's rule)."""
    kind: Literal["all", "hb", "sections"] = "all"
    """`all`, `hb` or `sections` (NVRx's rule: `hb` or `sections`)."""
    generation: int | None = None
    """The rank's n-th request of this rule and kind (1 .. 2**31 - 1)."""

    def wire(self) -> dict[str, object]:
        sections = None if self.sections is None else list(self.sections)
        return {
            "t": self.KIND,
            "sections": sections,
            "oos": self.out_of_section,
            "rule": self.rule,
            "kind": self.kind,
            "gen": self.generation,
        }

    @classmethod
    def read(cls, fields: Fields) -> CalculateTimeouts:
        raw = fields.get("sections")
        sections = None if raw is None else names(raw, "sections", MAX_SECTIONS, "bad_request")
        out_of_section = fields.get("oos", True)
        if not isinstance(out_of_section, bool):
            raise ProtocolError("bad_request", "oos must be true or false")
        raw_rule, raw_kind = fields.get("rule", "ftd"), fields.get("kind", "all")
        rule = next((known for known in RULES if known == raw_rule), None)
        kind = next((known for known in LEARNED if known == raw_kind), None)
        if rule is None or kind is None:
            raise ProtocolError("bad_request", f"rule {raw_rule!r:.20} / kind {raw_kind!r:.20}")
        if rule == "nvrx" and kind == "all":
            raise ProtocolError("bad_request", "NVRx's rule learns hb or sections")
        generation = optional_integer(fields, "gen", 1, 2**31 - 1, "bad_request")
        return cls(sections, out_of_section, rule, kind, generation)


@dataclass(frozen=True, slots=True)
class SetTimeouts:
    KIND: ClassVar[str] = protocol.SET_TIMEOUTS
    ANSWERED: ClassVar[bool] = True
    timeouts: Mapping[str, TimeoutValue]
    """Timeouts by name (a number of seconds, null, or their text form; which names exist and
    what values they take is the daemon's model's: ftd.config.ft.RankTimeouts)."""
    learned: Names = ()
    """Which of them were calculated (names as in a reply's `learned`)."""

    def wire(self) -> dict[str, object]:
        timeouts = {k: dict(v) if isinstance(v, Mapping) else v for k, v in self.timeouts.items()}
        return {"t": self.KIND, "timeouts": timeouts, "learned": list(self.learned)}

    @classmethod
    def read(cls, fields: Fields) -> SetTimeouts:
        raw = fields.get("timeouts")
        if not isinstance(raw, dict):
            raise ProtocolError("bad_request", "timeouts must be an object")
        timeouts: dict[str, TimeoutValue] = {}
        for key, value in raw.items():
            section_name(key, "timeout name", "bad_request")
            if key == SECTION_TIMEOUTS and isinstance(value, dict):
                if len(value) > MAX_SECTIONS:
                    raise ProtocolError("bad_request", f"more than {MAX_SECTIONS} sections")
                for name, seconds in value.items():
                    section_name(name, "section name", "bad_request")
                    timeout_value(seconds)
                timeouts[key] = MappingProxyType(value)
            else:
                timeouts[key] = timeout_value(value)
        learned = names(fields.get("learned", []), "learned", 2 * MAX_SECTIONS, "bad_request")
        return cls(MappingProxyType(timeouts), learned)


@dataclass(frozen=True, slots=True)
class Fault:
    KIND: ClassVar[str] = protocol.FAULT
    ANSWERED: ClassVar[bool] = False
    kind: str
    """What the rank simulates (`hang`, `crash`, ...: ftd_client.faults), 1..16 characters."""
    sections: Names = ()
    """The sections open as it begins."""

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND, "kind": self.kind, "sections": list(self.sections)}

    @classmethod
    def read(cls, fields: Fields) -> Fault:
        kind = fields.get("kind")
        if not isinstance(kind, str) or not 0 < len(kind) <= MAX_FAULT_KIND:
            raise ProtocolError("bad_request", f"fault kind {kind!r:.40}")
        sections = names(fields.get("sections", []), "sections", MAX_OPEN_SECTIONS, "bad_request")
        return cls(kind, sections)


@dataclass(frozen=True, slots=True)
class ProgressReport:
    """What a rank observed of its own progress (ftd_client.progress has each field's meaning);
    every count 0 .. MAX_SEQUENCE, None where the rank has none yet."""

    KIND: ClassVar[str] = protocol.PROGRESS
    ANSWERED: ClassVar[bool] = False
    REQUIRED: ClassVar[tuple[str, ...]] = ("steps", "called", "returned")
    COUNTS: ClassVar[tuple[str, ...]] = ("age_ms", "entered", "fwd_us", "host_us")
    """The counts sent only once the rank has them."""
    steps: int
    called: int
    returned: int
    age_ms: int | None = None
    entered: int | None = None
    fwd_us: int | None = None
    host_us: int | None = None
    auto: tuple[tuple[str, int], ...] = ()
    """The automatic sections open: (name, ms open), at most MAX_OPEN_SECTIONS."""
    stack_signal: int | None = None

    def wire(self) -> dict[str, object]:
        fields: dict[str, object] = {
            "t": self.KIND,
            "steps": self.steps,
            "called": self.called,
            "returned": self.returned,
        }
        for key in self.COUNTS:
            if (value := getattr(self, key)) is not None:
                fields[key] = value
        if self.auto:
            fields["auto"] = dict(self.auto)
        if self.stack_signal is not None:
            fields["stack_signal"] = self.stack_signal
        return fields

    @classmethod
    def read(cls, fields: Fields) -> ProgressReport:
        required = (integer(fields, key, 0, MAX_SEQUENCE, "bad_progress") for key in cls.REQUIRED)
        steps, called, returned = required
        counts = (
            optional_integer(fields, key, 0, MAX_SEQUENCE, "bad_progress") for key in cls.COUNTS
        )
        age_ms, entered, fwd_us, host_us = counts
        auto = fields.get("auto")
        if auto is not None and (not isinstance(auto, dict) or len(auto) > MAX_OPEN_SECTIONS):
            raise ProtocolError("bad_progress", "auto must be an object of open sections")
        ages: list[tuple[str, int]] = []
        for name, age in (auto or {}).items():
            section_name(name, "automatic section")
            if not (is_int(age) and 0 <= age <= MAX_SEQUENCE):
                raise ProtocolError("bad_progress", f"automatic section age {age!r:.40}")
            ages.append((name, age))
        signal = protocol.valid_stack_signal(fields.get("stack_signal"))
        return cls(steps, called, returned, age_ms, entered, fwd_us, host_us, tuple(ages), signal)


HealthMessage = (
    Hello
    | Heartbeat
    | SectionStart
    | SectionEnd
    | WorkloadControl
    | CalculateTimeouts
    | SetTimeouts
    | Goodbye
    | Fault
    | Resumed
    | State
    | ProgressReport
)
"""The kinds of ftd_client.RankClient's connection and of the progress observer's."""
