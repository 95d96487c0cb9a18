"""The run directory: where the daemon writes, and what it refuses to write into.

A directory another local user can write to (or owns) lets that user plant links and files the
daemon would follow or trust (status.json, events.jsonl, api.token, ft_state.json). So the run
directory must belong to the daemon's user and be writable by nobody else; directories the
daemon creates are 0700. The checks are those of every directory in a shared place
(shared_paths.py); here a refusal ends the start.
"""

from __future__ import annotations

from pathlib import Path

from ftd.config.shared_paths import PathRefused, prepare_private_dir
from ftd.errors import StartupError


def prepare_run_dir(run_dir: Path) -> None:
    """Create `run_dir` (and missing parents, 0700) or check the existing one: owned by this
    user, not writable by group or others. StartupError saying why otherwise."""
    try:
        prepare_private_dir(run_dir, "run directory", "use a --log-dir of your own")
    except PathRefused as refused:
        raise StartupError(str(refused)) from None
