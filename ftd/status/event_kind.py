"""Every kind of event the daemon records (events.jsonl, GET /v1/events, the SSE stream).

One enumeration, so that readers (metrics, the dashboard, tests) match names that exist.
"""

from __future__ import annotations

import enum


class EventKind(enum.StrEnum):
    # the daemon
    DAEMON_STARTED = "daemon_started"
    DAEMON_STOPPED = "daemon_stopped"
    STATE_CHANGED = "state_changed"
    PERSIST_FAILED = "persist_failed"
    """A file could not be written (disk full, permissions); supervision goes on."""
    PERSIST_RECOVERED = "persist_recovered"
    LOOP_STALLED = "loop_stalled"
    """The daemon did not run for a while; no rank was judged for it."""
    GUARD_RESTARTED = "guard_restarted"
    # attempts and rounds
    ROUND_CLOSED = "round_closed"
    ATTEMPT_STARTED = "attempt_started"
    ATTEMPT_FAILED = "attempt_failed"
    CLUSTER_REQUEST = "cluster_request"
    JOB_CULPRIT = "job_culprit"
    """The job's culprit of a hang, decided across nodes (ftd/coordination/job_culprit.py)."""
    WORKERS_STOPPED = "workers_stopped"
    RESTART_BACKOFF = "restart_backoff"
    GPU_MEMORY_RECLAIMED = "gpu_memory_reclaimed"
    """Between attempts, the wait for the GPUs' memory to be released ended (gpu_memory.py)."""
    NO_PROGRESS = "no_progress"
    """Attempts in a row made no progress: the job is not restarted again (no_progress.py)."""
    RECOVERY = "recovery"
    """A restart's stages (detect ... init, restore, redo) once it resumed and redid its loss."""
    # ranks
    RANK_EXITED = "rank_exited"
    RANK_HUNG = "rank_hung"
    TIMEOUTS_CHANGED = "timeouts_changed"
    WORKLOAD_CONTROL = "workload_control"
    MESSAGES_LOST = "messages_lost"
    """A rank's messages did not reach the daemon (a burst, a paused daemon): once per
    episode; its sections were re-synced from its state, never judged on a lost one."""
    BUDGET_EXCEEDED = "budget_exceeded"
    """A rank asked the daemon to hold more than a budget allows (open sections, section
    names): the message was dropped and counted; once per rank and budget."""
    STRAGGLER = "straggler"
    """A rank's forward pass stays slower than the job's other ranks' (ftd/health/stragglers.py)."""
    STRAGGLER_CLEARED = "straggler_cleared"
    CHECKPOINT_REFUSED = "checkpoint_refused"
    """A rank's snapshot does not fit --checkpoint-memory: once per rank and attempt."""
    CHECKPOINT_RESTORED = "checkpoint_restored"
    """The ranks of an attempt asked for their snapshots: which step they resume from."""
    REPLICA_REFUSED = "replica_refused"
    """A peer's replica frame refused (source address, reason): forged, corrupt, too large."""
    REPLICA_PULLED = "replica_pulled"
    """A replacement node fetched a lost rank's snapshots from a peer's replicas (or failed)."""
    # operators and faults
    RESTART_REQUESTED = "restart_requested"
    FAULT_ARMED = "fault_armed"
    FAULT_REQUESTED = "fault_requested"
    FAULT_INJECTED = "fault_injected"
    # nodes
    NODE_LOST = "node_lost"
    NODE_EXCLUDED = "node_excluded"
    NODE_READMITTED = "node_readmitted"
    NODE_UNHEALTHY = "node_unhealthy"
    """A health check before the rendezvous failed: the node sits out (node_health.py)."""
    NODE_HEALTHY = "node_healthy"
    STANDBY = "standby"
    """The node found a round full: it waits for its end as a standby (a hot spare)."""
    STANDBY_ENDED = "standby_ended"
    """It stopped waiting as a standby: it joined a round as an active node, or the job ended."""
    # the coordination backend (etcd)
    COORDINATION_UNAVAILABLE = "coordination_unavailable"
    """No etcd member answered in time (quorum lost?): the running attempt goes on, a new
    round waits for etcd (up to --rdzv-join-timeout)."""
    COORDINATION_RESTORED = "coordination_restored"
    COORDINATION_ENDPOINT_DOWN = "coordination_endpoint_down"
    """One etcd member stopped answering this daemon (the others may)."""
    COORDINATION_ENDPOINT_UP = "coordination_endpoint_up"
    COORDINATION_LEASE_REPLACED = "coordination_lease_replaced"
    """etcd dropped this daemon's lease (the others saw it leave); it holds a new one."""
    # in-process restart
    INPROCESS_FAULT = "inprocess_fault"
    INPROCESS_ROUND = "inprocess_round"
    INPROCESS_RANK_FAILED = "inprocess_rank_failed"
    INPROCESS_GAVE_UP = "inprocess_gave_up"
    RANK_RESPAWNED = "rank_respawned"
    OUTPUT_DROPPED = "output_dropped"
