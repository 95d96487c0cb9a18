"""What a rank's checkpointing did: `checkpoint.stats()`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stats:
    saved: int = 0
    """Snapshots complete in the node's memory."""
    spaced: int = 0
    """Saves that took no snapshot: not a step --checkpoint-every takes (docs/checkpoint.md)."""
    interval_steps: int = 1
    """The steps between snapshots in force (--checkpoint-every: N, or auto's choice)."""
    skipped: int = 0
    """Saves given up: no slot was free before the optimizer's next step, or no daemon answered."""
    failed: int = 0
    waited_s: float = 0.0
    """Time the training waited for a copy (in the optimizer's pre-step hook, save or load)."""
    copy_s: float = 0.0
    """Time the thread spent copying the last snapshot."""
    copy_cpu_s: float = 0.0
    """The CPU time that copy took (what it cost the training where no core was idle)."""
    restore_s: float = 0.0
    persisted: int = 0
    """Snapshots written to --checkpoint-persist (docs/checkpoint.md, Persistence)."""
    persist_skipped: int = 0
    """Persist steps whose snapshot was not written: the one before was still being written."""
    persist_failed: int = 0
    persist_s: float = 0.0
    """Time the persist thread spent writing the last one."""
