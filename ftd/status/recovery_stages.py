"""The stages of a restart, in order, as a `recovery` event names them: defined here once for
the daemon (supervision/recovery.py), `ftd events` (cli/event_lines.py) and the dashboard
(core.js and events.js hold a copy that tests/test_house.py keeps equal)."""

STAGES = ("detect", "stop", "backoff", "rendezvous", "spawn", "init", "restore", "redo")
AFTER_RESTORE = frozenset({"restore", "redo"})
"""Stages measured only where a snapshot was restored (null otherwise: not shown)."""
