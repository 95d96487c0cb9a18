"""The memory tier's one error type (its own module: every other module of the tier uses it)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A snapshot that cannot be taken or restored; what the training holds is unchanged."""
