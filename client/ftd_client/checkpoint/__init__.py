"""Training state held by the node: snapshots in memory that outlives the rank.

    from ftd_client import checkpoint

    step = checkpoint.load(state) or 0      # fills `state` in place; None: nothing to resume
    for step in range(step + 1, steps + 1):
        train_one_step()
        checkpoint.save(state, step)        # returns once the copy is scheduled

`state` is a dict of tensors and plain values (model, optimizer and scheduler state dicts,
counters, RNG states; the types a snapshot holds: docs/checkpoint.md, _skeleton.py). `load`
returns the newest step whose snapshot is complete on every rank of the job, so every rank
resumes at the same step; tensors of the same shape and type are copied into in place (call
`model.load_state_dict`/`optimizer.load_state_dict` after it for the parts that had none, as
with torch.distributed.checkpoint). Sharded states go through DCP into the same
memory: `dcp.save(state, storage_writer=checkpoint.MemoryWriter(step))` (checkpoint/dcp.py).
Outside ftd (no FTD_SOCKET) `save` does nothing and `load` returns None. How it works and what
it costs: docs/checkpoint.md.
"""

from __future__ import annotations

from typing import Any

from ftd_client.checkpoint._instance import checkpointer as _get
from ftd_client.checkpoint._plan import CheckpointError
from ftd_client.checkpoint._stats import Stats

_DCP = frozenset({"MemoryReader", "MemoryWriter", "newest_dcp"})


def __getattr__(name: str) -> Any:
    """DCP's pair on first use: importing torch.distributed.checkpoint costs a rank ~1 s."""
    if name in _DCP:
        from ftd_client.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "MemoryReader",
    "MemoryWriter",
    "Stats",
    "load",
    "newest_dcp",
    "save",
    "stats",
    "wait",
]


def save(state_dict: dict[str, Any], step: int) -> bool:
    """Snapshot `state_dict` as of `step` into the node's memory; True once the copy is
    scheduled, False when the save is skipped (no slot free before the optimizer's next step,
    or no daemon). CheckpointError for a state that cannot be snapshotted (a value of a type
    a snapshot does not hold, named with where it is; a snapshot larger than
    --checkpoint-memory): the older snapshot stays usable."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 2**53:
        raise CheckpointError(f"step must be an integer 0 .. 2**53, not {step!r:.40}")
    return _get().save(state_dict, step)


def load(state_dict: dict[str, Any]) -> int | None:
    """Fill `state_dict` in place from the newest snapshot complete on every rank; its step,
    or None when there is none."""
    return _get().load(state_dict)


def wait(timeout_s: float = 60.0, persisted: bool = False) -> None:
    """Wait for the last save to be complete: call it before changing a saved tensor outside
    `optimizer.step` (the pre-step hook waits for the optimizer's own tensors), and at the end.
    A save waiting for its peers' copies (both its slots still needed) waits up to `timeout_s`
    for them, then is skipped. `persisted`: then also up to `timeout_s` for the write to
    --checkpoint-persist under way (the rank's exit waits for it too)."""
    _get().settle(patience_s=timeout_s, persisted=persisted)


def stats() -> Stats:
    return _get().stats
