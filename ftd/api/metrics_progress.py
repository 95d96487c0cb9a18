"""`/metrics`' families of training progress, read from the status snapshot at scrape time:
each local rank's steps, step time, last step, collectives entered, forward and host times and
whether it is a straggler (what the ranks report without the script's help), and the node's
steps/s and time lost to failures (docs/api.md, "Progress"). A rank's counts restart with its
process, so they are gauges."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def progress_families(snapshot: dict[str, Any], wall: float) -> Iterable[Metric]:
    """The families, from GET /v1/status' document read at `wall` (time.time())."""
    steps = GaugeMetricFamily(
        "ftd_rank_steps",
        "Optimizer steps of each local rank in this attempt",
        labels=["local_rank"],
    )
    step_time = GaugeMetricFamily(
        "ftd_rank_step_seconds",
        "Median seconds per optimizer step of each local rank (its last 32 steps)",
        labels=["local_rank"],
    )
    last_step = GaugeMetricFamily(
        "ftd_rank_last_step_timestamp_seconds",
        "When each local rank last made an optimizer step",
        labels=["local_rank"],
    )
    entered = GaugeMetricFamily(
        "ftd_rank_collectives_entered",
        "Collectives each local rank issued on the default process group in this attempt",
        labels=["local_rank"],
    )
    forward = GaugeMetricFamily(
        "ftd_rank_forward_seconds",
        "Median seconds per step in each local rank's outermost training forward (last 16)",
        labels=["local_rank"],
    )
    host = GaugeMetricFamily(
        "ftd_rank_host_seconds",
        "Median seconds per step from each local rank's optimizer step to its next forward, "
        "less torch.distributed calls: data loading and host work (last 16)",
        labels=["local_rank"],
    )
    straggler = GaugeMetricFamily(
        "ftd_rank_straggler",
        "1 while the local rank is a straggler (its forward or host time stays above the "
        "job's other ranks'), else 0",
        labels=["local_rank"],
    )
    ranks = snapshot.get("ranks")
    for rank in ranks if isinstance(ranks, list) else []:
        progress = rank.get("progress") if isinstance(rank, dict) else None
        if not isinstance(progress, dict):
            continue
        label = [str(rank.get("local_rank"))]
        steps.add_metric(label, progress["steps"])
        if isinstance(progress.get("step_time_s"), int | float):
            step_time.add_metric(label, progress["step_time_s"])
        if isinstance(progress.get("last_step_age_s"), int | float):
            last_step.add_metric(label, wall - progress["last_step_age_s"])
        if isinstance(progress.get("collectives_entered"), int):
            entered.add_metric(label, progress["collectives_entered"])
        for family, key in ((forward, "forward_s"), (host, "host_s")):
            if isinstance(progress.get(key), int | float):
                family.add_metric(label, progress[key])
        straggler.add_metric(label, 1.0 if progress.get("straggler") else 0.0)
    yield from (steps, step_time, last_step, entered, forward, host, straggler)
    node = snapshot.get("progress")
    if not isinstance(node, dict):
        return
    yield GaugeMetricFamily(
        "ftd_node_steps_per_second",
        "The pace of the node's slowest rank (0 when no rank makes steps)",
        value=node["steps_per_s"],
    )
    yield GaugeMetricFamily(
        "ftd_making_steps_seconds",
        "Seconds the node's ranks spent making steps since the job began on this node",
        value=node["making_steps_s"],
    )
    # exported from the start, 0 until the first attempt's ranks start (docs/api.md), so a
    # query or an alert on them never meets a series that does not exist yet
    began = node.get("time_lost_s") is not None
    yield GaugeMetricFamily(
        "ftd_time_lost_seconds",
        "Wall time since the job began on this node minus the time spent making steps "
        "(0 before it began)",
        value=node["time_lost_s"] if began else 0.0,
    )
    yield GaugeMetricFamily(
        "ftd_job_start_timestamp_seconds",
        "When the job began on this node (its first attempt's ranks started; 0 before)",
        value=node["since"] if began else 0.0,
    )


def checkpoint_families(snapshot: dict[str, Any]) -> Iterable[Metric]:
    """The memory tier's (ftd_client.checkpoint): memory held, its budget, the newest step a
    restart would resume from, and snapshots by outcome."""
    view = snapshot.get("checkpoint")
    if not isinstance(view, dict):
        return
    yield GaugeMetricFamily(
        "ftd_checkpoint_memory_bytes",
        "Bytes of memory held for the ranks' snapshots",
        value=view["memory_bytes"],
    )
    yield GaugeMetricFamily(
        "ftd_checkpoint_budget_bytes",
        "--checkpoint-memory: the most the snapshots may hold",
        value=view["budget_bytes"],
    )
    if view.get("newest_step") is not None:
        yield GaugeMetricFamily(
            "ftd_checkpoint_newest_step",
            "The newest step whose snapshot is complete on every rank (a restart resumes there)",
            value=view["newest_step"],
        )
    if view.get("interval_steps") is not None:
        yield GaugeMetricFamily(
            "ftd_checkpoint_interval_steps",
            "The steps between snapshots the ranks use (--checkpoint-every: N, or auto's choice)",
            value=view["interval_steps"],
        )
    yield CounterMetricFamily(
        "ftd_checkpoint_steps_lost",
        "Steps the ranks finished but no restore kept (redone after a failure), over every restore",
        value=view["steps_lost"],
    )
    outcomes = CounterMetricFamily(
        "ftd_checkpoint_snapshots",
        "Snapshots by outcome: begun, completed, busy (asked again), refused (too large), "
        "restored, bad (a file that was not the snapshot said)",
        labels=["outcome"],
    )
    for outcome, key in (
        ("begun", "begun"),
        ("completed", "completed"),
        ("busy", "busy"),
        ("refused", "refused"),
        ("restored", "restored"),
        ("bad", "bad_snapshots"),
    ):
        outcomes.add_metric([outcome], view[key])
    yield outcomes
    replica = view.get("replica")
    if view.get("replica_lag_steps") is not None:
        yield GaugeMetricFamily(
            "ftd_checkpoint_replica_lag_steps",
            "Steps between this node's newest complete snapshot and its replica on the next node",
            value=view["replica_lag_steps"],
        )
    if isinstance(replica, dict):
        yield GaugeMetricFamily(
            "ftd_checkpoint_replica_bytes",
            "Bytes of other nodes' replicas held in this node's memory",
            value=replica["held_bytes"],
        )
