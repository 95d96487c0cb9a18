"""Prometheus exposition for `GET /metrics`: a private registry whose collector reads the
daemon's state at scrape time (nothing is copied on the daemon's hot paths).

Names are `ftd_*`, counters end in `_total`, units are base units, times are timestamps
rather than ages; no pid or global rank is ever a label (local ranks are bounded by
--nproc-per-node).

Other parts of the daemon record into module-level instruments that every registry built
here exposes: `STORE_OPERATION_SECONDS` (the rendezvous store's operations, timed by
`ftd.coordination.c10d.record_store.RecordStore`) and `RECOVERY_STAGE_SECONDS` (each restart's
stages).
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from ftd import containment
from ftd.api.control import NodeControl
from ftd.api.metrics_progress import checkpoint_families, progress_families
from ftd.refusals import INPUT_REFUSED
from ftd.status.event_kind import EventKind
from ftd.status.instruments import (
    OUTPUT_DROPPED_BYTES,
    OUTPUT_DROPPED_LINES,
    RECOVERY_STAGE_SECONDS,
    STORE_OPERATION_SECONDS,
)
from ftd.status.model import DaemonState, RankState

# The daemon's own process: `_created` series would only double the output.
disable_created_metrics()  # type: ignore[no-untyped-call]

KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@dataclass
class _EventTally:
    """What the event log says happened (failures by reason, hangs by rank, back-off waits,
    nodes lost, files not written), folded in from the log at scrape time."""

    cursor: int
    by_reason: Tally[str] = field(default_factory=Tally)
    hangs: int = 0
    hangs_by_rank: Tally[int] = field(default_factory=Tally)
    backoff_waited_s: float = 0.0
    nodes_lost: int = 0
    exclusions: int = 0
    round_nodes: int | None = None
    persist_failures: int = 0
    failing_files: set[str] = field(default_factory=set)

    def update(self, control: NodeControl) -> None:
        for event in control.events.since(self.cursor):
            self.cursor = event.id
            kind, data = event.kind, event.data
            if kind == EventKind.RANK_HUNG:
                self.hangs += 1
                local_rank = data.get("local_rank")
                if isinstance(local_rank, int):
                    self.hangs_by_rank[local_rank] += 1
            elif kind == EventKind.ATTEMPT_FAILED:
                failure = data.get("failure")
                reason = failure.get("kind") if isinstance(failure, dict) else None
                if isinstance(reason, str) and reason != "request":
                    self.by_reason[reason] += 1
            elif kind == EventKind.RESTART_BACKOFF:
                delay = data.get("delay_s")
                if isinstance(delay, int | float) and delay > 0:
                    self.backoff_waited_s += delay
            elif kind == EventKind.NODE_LOST:
                self.nodes_lost += 1
            elif kind == EventKind.NODE_EXCLUDED:
                self.exclusions += 1
            elif kind == EventKind.ROUND_CLOSED:
                members = data.get("members")
                self.round_nodes = len(members) if isinstance(members, list) else None
            elif kind == EventKind.PERSIST_FAILED:
                self.persist_failures += 1
                self.failing_files.add(str(data.get("path")))
            elif kind == EventKind.PERSIST_RECOVERED:
                self.failing_files.discard(str(data.get("path")))


class DaemonCollector(Collector):
    def __init__(self, control: NodeControl) -> None:
        self._control = control
        self._started = time.time()
        self._tally = _EventTally(cursor=control.events.last_id)

    def collect(self) -> Iterable[Metric]:
        """A scrape's boundary: an error of ours ends this scrape's families, nothing else."""
        try:
            containment.inject("metrics")
            yield from self._collect()
        except Exception as error:
            containment.record("metrics", error)
        internal = CounterMetricFamily(
            "ftd_internal_errors",
            "Errors of the daemon's own contained at a part's boundary (supervision went on)",
            labels=["component"],
        )
        for component in sorted(containment.COMPONENTS):
            internal.add_metric([component], containment.errors[component])
        yield internal

    def _collect(self) -> Iterable[Metric]:
        control, status = self._control, self._control.status
        info = GaugeMetricFamily("ftd_info", "The daemon's identity", labels=["node_id", "run_id"])
        info.add_metric([status.node_id, status.run_id], 1)
        yield info
        yield GaugeMetricFamily(
            "ftd_daemon_start_time_seconds", "When the daemon started", value=self._started
        )
        state = GaugeMetricFamily(
            "ftd_state", "The daemon's state (1 for the current one)", labels=["state"]
        )
        for value in DaemonState:
            state.add_metric([value.value], 1 if status.state is value else 0)
        yield state
        yield GaugeMetricFamily(
            "ftd_attempt", "The current attempt (0 first)", value=status.attempt
        )
        yield GaugeMetricFamily("ftd_round", "The current rendezvous round", value=status.attempt)
        yield GaugeMetricFamily(
            "ftd_node_standby",
            "1 while this node waits as a standby (a hot spare) for a full round's end, else 0",
            value=1 if status.standby is not None else 0,
        )
        restarts = CounterMetricFamily(
            "ftd_restarts", "Restarts of this node's workers", labels=["counted"]
        )
        restarts.add_metric(["true"], status.restart_count)
        restarts.add_metric(["false"], max(0, status.attempt - status.restart_count))
        yield restarts
        yield GaugeMetricFamily(
            "ftd_restart_limit", "--max-restarts", value=control.config.max_restarts
        )
        yield GaugeMetricFamily(
            "ftd_restart_backoff_seconds",
            "The wait before the next attempt after fast failures in a row (crash loop)",
            value=status.backoff_s,
        )
        ranks = GaugeMetricFamily("ftd_ranks", "Local ranks by state", labels=["state"])
        counts = Tally(rank.state for rank in status.ranks)
        for rank_state in RankState:
            ranks.add_metric([rank_state.value], counts[rank_state])
        yield ranks
        self._tally.update(control)
        failures = CounterMetricFamily(
            "ftd_rank_failures",
            "Failed attempts by the reason of the first failure",
            labels=["reason"],
        )
        reasons = {"exit", "signal", "hang", "fatal", "internal", *self._tally.by_reason}
        for reason in sorted(reasons):
            failures.add_metric([reason], self._tally.by_reason[reason])
        yield failures
        yield CounterMetricFamily("ftd_hangs", "Ranks found hung", value=self._tally.hangs)
        yield from self._tallied()
        yield GaugeMetricFamily(
            "ftd_last_failure_timestamp_seconds",
            "When the last failure happened (0 before any failure)",
            value=status.last_failure.timestamp if status.last_failure is not None else 0.0,
        )
        heartbeat = GaugeMetricFamily(
            "ftd_rank_last_heartbeat_timestamp_seconds",
            "When each local rank last sent a heartbeat",
            labels=["local_rank"],
        )
        now = time.time()
        snapshot = control.status_snapshot()
        views = snapshot["ranks"]
        for view in views if isinstance(views, list) else []:
            age = view.get("last_heartbeat_age_s")
            if isinstance(age, int | float):
                heartbeat.add_metric([str(view["local_rank"])], now - age)
        yield heartbeat
        yield from progress_families(snapshot, now)
        yield from checkpoint_families(snapshot)
        ipc = snapshot["ipc"]
        assert isinstance(ipc, dict)
        yield CounterMetricFamily(
            "ftd_rank_messages_lost",
            "Rank messages that never reached the daemon (gaps in their sequence numbers)",
            value=_count(ipc.get("lost")),
        )
        yield CounterMetricFamily(
            "ftd_rank_message_loss_episodes",
            "Episodes of lost rank messages (a burst, a paused daemon)",
            value=_count(ipc.get("loss_episodes")),
        )
        refusals = CounterMetricFamily(
            "ftd_budget_refusals",
            "Rank requests refused by a budget (open sections, section names)",
            labels=["budget"],
        )
        by_budget = ipc.get("budget_refusals")
        for budget in ("open_sections", "section_names"):
            refused = by_budget.get(budget) if isinstance(by_budget, dict) else None
            refusals.add_metric([budget], _count(refused))
        yield refusals

    def _tallied(self) -> Iterable[Metric]:
        tally = self._tally
        hangs = CounterMetricFamily(
            "ftd_rank_hangs", "Hang verdicts by local rank", labels=["local_rank"]
        )
        for local_rank in range(self._control.config.nproc_per_node):
            hangs.add_metric([str(local_rank)], tally.hangs_by_rank[local_rank])
        yield hangs
        yield CounterMetricFamily(
            "ftd_restart_backoff_waited_seconds",
            "Back-off waits before attempts, added up (restart_backoff: a crash loop)",
            value=tally.backoff_waited_s,
        )
        yield CounterMetricFamily(
            "ftd_nodes_lost", "Nodes this daemon saw lost (node_lost)", value=tally.nodes_lost
        )
        yield CounterMetricFamily(
            "ftd_node_exclusions",
            "Node exclusions requested through this daemon (node_excluded)",
            value=tally.exclusions,
        )
        if tally.round_nodes is not None:
            yield GaugeMetricFamily(
                "ftd_round_nodes",
                "Nodes in the last round this node joined",
                value=tally.round_nodes,
            )
        yield CounterMetricFamily(
            "ftd_persist_failures",
            "Files the daemon could not write (persist_failed: once per file and cause)",
            value=tally.persist_failures,
        )
        yield GaugeMetricFamily(
            "ftd_persist_failing_files",
            "Files whose last write failed (status.json, events.jsonl, ...)",
            value=len(tally.failing_files),
        )


def _count(value: object) -> float:
    return float(value) if isinstance(value, int) else 0.0


class ApiMetrics:
    """The API server's registry: the daemon collector, the store histogram and the API's
    own request counters."""

    def __init__(self, control: NodeControl) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(control))
        self.registry.register(STORE_OPERATION_SECONDS)
        self.registry.register(RECOVERY_STAGE_SECONDS)
        self.registry.register(OUTPUT_DROPPED_BYTES)
        self.registry.register(OUTPUT_DROPPED_LINES)
        self.registry.register(INPUT_REFUSED)
        self.requests = Counter(
            "ftd_api_requests",
            "API requests answered",
            ["method", "route", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ftd_api_request_duration_seconds",
            "Time to answer an API request (until the headers of a stream)",
            ["route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )

    def observe(self, method: str, route: str, code: int, seconds: float) -> None:
        method = method if method in KNOWN_METHODS else "other"
        self.requests.labels(method, route, str(code)).inc()
        self.latency.labels(route).observe(seconds)


def build_registry(control: NodeControl) -> ApiMetrics:
    return ApiMetrics(control)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    return generate_latest(registry), CONTENT_TYPE_LATEST
