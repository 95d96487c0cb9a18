"""The newest exclusion a daemon has seen (ExcludedRecord and the closed rounds' records,
records.py): one owner, so that a replayed record never rolls an exclusion back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ftd.coordination.records import ExcludedRecord, RecordCodec


class Excluding(Protocol):
    """What a round's closing record (or a member's assignment of it) says of exclusions."""

    @property
    def excluded(self) -> Mapping[str, str]: ...

    @property
    def excluded_epoch(self) -> int: ...


class ExclusionLedger:
    """The newest exclusion a daemon has seen: from the `excluded` record, and from every closed
    round's record (signed for its round's key, so it cannot be replayed elsewhere). An
    `excluded` record older than that (a signed one replayed from before an exclusion, to
    readmit a node) is refused: exclusion and readmission never roll back past what this
    daemon has seen, and a node the round's closer knows to be excluded is not a member."""

    def __init__(self) -> None:
        self.newest = ExcludedRecord()

    @property
    def nodes(self) -> dict[str, str]:
        return dict(self.newest.nodes)

    def merge(self, found: ExcludedRecord | None, codec: RecordCodec) -> dict[str, str]:
        """The excluded nodes, given the `excluded` record `found` in the store now."""
        if found is not None:
            if found.epoch < self.newest.epoch:
                codec.refuse(
                    "excluded",
                    "rolled_back",
                    f"epoch {found.epoch}, older than the {self.newest.epoch} already seen "
                    "(a replayed record): kept the newer one",
                )
            else:
                self.newest = found
        return self.nodes

    def learn(self, record: Excluding) -> None:
        """What a closed round's record (or an assignment of it) says about the excluded
        nodes."""
        if record.excluded_epoch > self.newest.epoch:
            self.newest = ExcludedRecord(nodes=dict(record.excluded), epoch=record.excluded_epoch)

    def updated(
        self, current: ExcludedRecord | None, node_id: str, reason: str | None
    ) -> ExcludedRecord:
        """The record that excludes (`reason`) or readmits (None) `node_id`, one epoch past
        both `current` (the store's) and what this daemon has seen."""
        base = (
            current if current is not None and current.epoch >= self.newest.epoch else self.newest
        )
        nodes = dict(base.nodes)
        if reason is None:
            nodes.pop(node_id, None)
        else:
            nodes[node_id] = reason[:4000]
        return ExcludedRecord(nodes=nodes, epoch=base.epoch + 1)
