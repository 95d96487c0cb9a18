"""Instruments that parts below the API record into (the store's latency, recovery stages, rank
output dropped): module-level, exposed by every registry ftd.api.metrics builds."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

STORE_OPERATION_SECONDS = Histogram(
    "ftd_store_operation_seconds",
    "Latency of c10d TCPStore operations made by the daemon",
    ["operation"],
    registry=None,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

RECOVERY_STAGE_SECONDS = Histogram(
    "ftd_recovery_stage_seconds",
    "Each restart's stages: detect, stop, backoff, rendezvous, spawn, init, restore, redo",
    ["stage"],
    registry=None,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)

# Rank output that ftd.ranks.output could not write (incremented from its writer threads).
OUTPUT_DROPPED_BYTES = Counter(
    "ftd_output_dropped_bytes",
    "Rank output (-r/-t) dropped instead of written: a full or failing disk, a slow console",
    ["destination"],
    registry=None,
)
OUTPUT_DROPPED_LINES = Counter(
    "ftd_output_dropped_lines",
    "Lines of rank output (-r/-t) dropped instead of written",
    ["destination"],
    registry=None,
)
