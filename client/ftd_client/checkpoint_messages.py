"""ftd_client.checkpoint's messages as records (messages.py has the others): on a connection
of their own, never a sign of life (protocol.py's table says what each asks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ftd_client import protocol
from ftd_client.messages import Bare
from ftd_client.protocol import MAX_SLOTS
from ftd_client.wire_fields import Fields, integer, optional_integer

STEP_MAX = 2**53


@dataclass(frozen=True, slots=True)
class CheckpointBegin:
    KIND: ClassVar[str] = protocol.CHECKPOINT_BEGIN
    ANSWERED: ClassVar[bool] = True
    step: int
    bytes: int
    world: int
    every: int | None = None
    """The steps between the rank's snapshots (1 .. MAX_EVERY), as it reports them."""

    def wire(self) -> dict[str, object]:
        fields = {"t": self.KIND, "step": self.step, "bytes": self.bytes, "world": self.world}
        return fields if self.every is None else {**fields, "every": self.every}

    @classmethod
    def read(cls, fields: Fields) -> CheckpointBegin:
        return cls(
            integer(fields, "step", 0, STEP_MAX, "bad_checkpoint"),
            integer(fields, "bytes", 0, 2**48, "bad_checkpoint"),
            integer(fields, "world", 1, 2**20, "bad_checkpoint"),
            optional_integer(fields, "every", 1, protocol.MAX_EVERY, "bad_checkpoint"),
        )


@dataclass(frozen=True, slots=True)
class CheckpointDone:
    KIND: ClassVar[str] = protocol.CHECKPOINT_DONE
    ANSWERED: ClassVar[bool] = True
    step: int
    slot: int

    def wire(self) -> dict[str, object]:
        return {"t": self.KIND, "step": self.step, "slot": self.slot}

    @classmethod
    def read(cls, fields: Fields) -> CheckpointDone:
        step = integer(fields, "step", 0, STEP_MAX, "bad_checkpoint")
        return cls(step, integer(fields, "slot", 0, MAX_SLOTS - 1, "bad_checkpoint"))


@dataclass(frozen=True, slots=True)
class CheckpointRestore:
    KIND: ClassVar[str] = protocol.CHECKPOINT_RESTORE
    ANSWERED: ClassVar[bool] = True
    world: int
    step: int | None = None
    """The step to restore (None: which ones the node can restore)."""

    def wire(self) -> dict[str, object]:
        fields: dict[str, object] = {"t": self.KIND, "world": self.world}
        return fields if self.step is None else {**fields, "step": self.step}

    @classmethod
    def read(cls, fields: Fields) -> CheckpointRestore:
        world = integer(fields, "world", 1, 2**20, "bad_checkpoint")
        return cls(world, optional_integer(fields, "step", 0, STEP_MAX, "bad_checkpoint"))


@dataclass(frozen=True, slots=True)
class CheckpointPlace(Bare):
    KIND: ClassVar[str] = protocol.CHECKPOINT_PLACE
    ANSWERED: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class CheckpointSeen:
    KIND: ClassVar[str] = protocol.CHECKPOINT_SEEN
    ANSWERED: ClassVar[bool] = False
    step: int
    restored: bool = False
    """`step` was restored from --checkpoint-persist, not done without a snapshot."""

    def wire(self) -> dict[str, object]:
        fields: dict[str, object] = {"t": self.KIND, "step": self.step}
        return {**fields, "restored": 1} if self.restored else fields

    @classmethod
    def read(cls, fields: Fields) -> CheckpointSeen:
        step = integer(fields, "step", 0, STEP_MAX, "bad_checkpoint")
        return cls(step, optional_integer(fields, "restored", 1, 1, "bad_checkpoint") == 1)


CheckpointMessage = (
    CheckpointBegin | CheckpointDone | CheckpointRestore | CheckpointPlace | CheckpointSeen
)
CHECKPOINT_KINDS: tuple[type[CheckpointMessage], ...] = CheckpointMessage.__args__
