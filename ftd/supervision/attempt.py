"""One attempt of this node's ranks: start them for a round, watch for the first outcome, stop.

The supervisor (supervisor.py) runs attempts one after another; everything an attempt needs
that outlives it (the spawner, the health service, the orphan guard, the workers' stores) is
built once by the daemon and handed over in `AttemptTools`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ftd_client import faults
from ftd_client.inprocess.keys import ENV_KEY_FILE, Seal, prefix_for

from ftd.checkpoint.holder import CheckpointHolder
from ftd.config.ft import parse_simulated_fault
from ftd.config.restart import RestartMode
from ftd.config.serve import ServeConfig
from ftd.coordination import Coordinator, Round
from ftd.coordination.base import Placement
from ftd.health.first_steps import FirstSteps
from ftd.health.progress import ProgressWatch
from ftd.health.service import HealthService
from ftd.ranks.guard import GuardKeeper
from ftd.ranks.inprocess import InprocessRounds, rank_env
from ftd.ranks.launch import worker_envs
from ftd.ranks.output import OutputDrain
from ftd.ranks.spawn import LaunchSpec, Spawner
from ftd.ranks.workers import WorkerGroup
from ftd.ranks.workers_store import AttemptStores
from ftd.status.board import StatusBoard
from ftd.status.event_kind import EventKind
from ftd.status.events import Event, EventLog
from ftd.status.model import Failure, NodeStatus, RankState, RankStatus
from ftd.supervision.summary import failure_summary

log = logging.getLogger("ftd.attempt")


@dataclass
class AttemptTools:
    """What every attempt uses, built once by the daemon."""

    config: ServeConfig
    run_dir: Path
    log_dir: str
    daemon_id: str
    cmd: tuple[str, ...]
    spawner: Spawner
    health: HealthService
    progress: ProgressWatch
    """The ranks' progress (the health service's)."""
    first_steps: FirstSteps
    """When the ranks of a restart stepped again (the health service's)."""
    checkpoints: CheckpointHolder
    guard: GuardKeeper
    events: EventLog
    status: NodeStatus
    """Read only: its writer is `board`."""
    board: StatusBoard
    coordinator: Coordinator
    stores: AttemptStores


class Attempt:
    """This node's ranks for one round."""

    def __init__(
        self, tools: AttemptTools, rnd: Round, group: WorkerGroup, rounds: InprocessRounds | None
    ) -> None:
        self.tools = tools
        self.round = rnd
        self.number = rnd.number
        self.group = group
        self._rounds = rounds
        self._stopped = False

    @classmethod
    async def start(cls, tools: AttemptTools, rnd: Round) -> Attempt:
        config, status, health = tools.config, tools.status, tools.health
        placement = rnd.placement()
        number = rnd.number
        rank_socket, nvrx_sockets = health.rank_sockets()
        envs = worker_envs(
            config,
            placement,
            number,
            str(tools.run_dir),
            tools.daemon_id,
            socket_path=str(rank_socket),
            attempt_log_dir=str(tools.run_dir / f"attempt_{number}"),
            send_buffer=health.send_buffer(config.nproc_per_node),
            nvrx_sockets=_serves(*nvrx_sockets),
        )
        inprocess = (
            await tools.coordinator.inprocess_store()
            if config.restart_mode is RestartMode.INPROCESS
            else None
        )
        prefix = prefix_for(config.run_id, number)
        seal = Seal()
        if inprocess is not None:
            seal, key_file = _inprocess_seal(tools, prefix, number)
            for env in envs.values():
                env.update(rank_env(inprocess, prefix))
                if key_file is not None:
                    env[ENV_KEY_FILE] = str(key_file)
        _arm_simulated_fault(config, tools.events, envs, number)
        tools.board.attempt_starting(
            number,
            [RankStatus(local_rank=lr, global_rank=placement.base_global_rank + lr) for lr in envs],
        )
        spec = LaunchSpec(
            name=config.role,
            cmd=tools.cmd,
            envs=envs,
            log_dir=tools.log_dir,
            redirects=config.redirects,
            tee=config.tee,
            local_ranks_filter=config.local_ranks_filter,
            log_line_prefixes=_log_line_prefixes(config.role, placement, len(envs)),
            python=not config.no_python,
        )
        rounds = None
        if inprocess is not None:
            rounds = InprocessRounds(
                store_addr=inprocess,
                prefix=prefix,
                world_size=placement.world_size,
                local_slots={s.local_rank: s.global_rank for s in status.ranks},
                leader=placement.group_rank == 0,
                first_round_store=(placement.master_addr, placement.master_port),
                fresh_round_store=tools.stores.fresh,
                respawn=config.inprocess_respawn,
                respawn_budget=lambda failure: _respawn_budget(tools, rnd, failure),
                events=tools.events,
                node_id=config.node_id,
                on_respawned=lambda lr, old: _respawned(tools, lr, old),
                explain_stragglers=health.explain_ranks,
                seal=seal,
            )
        with health.messages_held():  # the ranks' first messages wait for their pids
            try:
                if rounds is not None:
                    await rounds.connect()
                group = await WorkerGroup.start(
                    tools.spawner,
                    spec,
                    {s.local_rank: s for s in status.ranks},
                    on_register=tools.guard.register,
                    on_unregister=tools.guard.unregister,
                    daemon_id=tools.daemon_id,
                    output=OutputDrain(
                        number,
                        lambda data: tools.events.emit(
                            EventKind.OUTPUT_DROPPED, attempt=number, **data
                        ),
                    ),
                    failure_handler=rounds.rank_failed if rounds is not None else None,
                    on_exit=lambda rank: tools.events.emit(
                        EventKind.RANK_EXITED, attempt=number, **rank.to_dict()
                    ),
                )
                if rounds is not None:
                    rounds.lead(group)
                health.attach(group, status.ranks)
            except BaseException:
                if rounds is not None:
                    await rounds.close()
                raise
        tools.events.emit(
            EventKind.ATTEMPT_STARTED,
            attempt=number,
            pids=group.pids,
            master_port=placement.master_port,
        )
        log.info(
            "attempt %d: started local ranks %s (logs in %s)",
            number,
            group.pids,
            group.attempt_log_dir,
        )
        return cls(tools, rnd, group, rounds)

    async def stop(self, force: asyncio.Event | None = None) -> None:
        """Stop the ranks (bounded escalation) and stop watching them; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        tools = self.tools
        tools.health.detach(self.group)
        rounds, self._rounds = self._rounds, None
        if rounds is not None:
            await rounds.close()
        sig = signal.Signals[tools.config.termination_signal]
        await self.group.stop(sig, tools.config.shutdown_timeout_s, force=force)
        _remove_empty_stacks(Path(self.group.attempt_log_dir))
        tools.events.emit(EventKind.WORKERS_STOPPED, attempt=self.number)

    def fail(self, failure: Failure) -> None:
        self.group.fail(failure)

    def inject_fault(self, local_rank: int, pid: int, kind: str, delay_s: float) -> None:
        signal_number = faults.KILL_SIGNAL if kind == "kill" else faults.HANG_SIGNAL
        assert signal_number is not None
        asyncio.get_running_loop().call_later(
            delay_s, self.group.signal_process, local_rank, pid, signal_number
        )

    def failure_summary(self, root: Failure) -> str:
        config, status = self.tools.config, self.tools.status
        others = [s for s in status.ranks if s.state is RankState.FAILED]
        name = " ".join(self.tools.cmd[-1 - len(config.script_args) :][:1])
        return failure_summary(name, root, others, self.group.error_files)


def _arm_simulated_fault(
    config: ServeConfig, events: EventLog, envs: dict[int, dict[str, str]], attempt: int
) -> Event | None:
    """`--ft-param-simulated_fault`: one rank of the first attempt carries the fault out."""
    spec = config.ft.simulated_fault
    if spec is None or attempt != 0:
        return None
    kind, target, low_s, high_s = parse_simulated_fault(spec)
    by_global = {int(env["RANK"]): local for local, env in envs.items()}
    world = int(envs[0]["WORLD_SIZE"])
    chooser = random.Random()
    global_rank = target if target is not None else chooser.randrange(world)
    if global_rank not in by_global:
        return None  # the target rank lives on another node
    delay_s = round(chooser.uniform(low_s, high_s), 3)
    envs[by_global[global_rank]]["FTD_SIMULATED_FAULT"] = f"{kind}:{delay_s}"
    log.warning("simulated %s fault armed on rank %d in %.3fs", kind, global_rank, delay_s)
    return events.emit(EventKind.FAULT_ARMED, kind=kind, global_rank=global_rank, delay_s=delay_s)


async def _respawn_budget(tools: AttemptTools, rnd: Round, failure: Failure) -> bool:
    """In-process mode: whether a failed rank may be respawned (a restart counted against
    --max-restarts, in the coordinator like every other)."""
    used = await tools.coordinator.restarts_used(rnd)
    if used >= tools.config.max_restarts:
        return False
    tools.board.restarts_counted(await tools.coordinator.count_restart(rnd, failure.reason))
    return True


def _respawned(tools: AttemptTools, local_rank: int, old_pid: int | None) -> None:
    status = next(s for s in tools.status.ranks if s.local_rank == local_rank)
    tools.health.respawned(status, old_pid)


def _log_line_prefixes(role: str, placement: Placement, nprocs: int) -> dict[int, str] | None:
    template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if not template:
        return None
    return {
        lr: Template(template).safe_substitute(
            role_name=role, rank=placement.base_global_rank + lr, local_rank=lr
        )
        for lr in range(nprocs)
    }


def _remove_empty_stacks(attempt_dir: Path) -> None:
    """Every rank's ftd_client opens its stacks file up front; only dumps are worth keeping."""
    with contextlib.suppress(OSError):
        for path in attempt_dir.glob("*/stacks.txt"):
            with contextlib.suppress(OSError):
                if path.stat().st_size == 0:
                    path.unlink()


def _serves(*paths: Path) -> bool:
    """Whether the daemon listens at every one of `paths`: a socket of this user's there (their
    directory is private, so nobody else could have put one). A path the daemon could not bind
    is not given to the ranks."""
    for path in paths:
        try:
            info = path.lstat()
        except OSError:
            return False
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
            return False
    return True


def _inprocess_seal(tools: AttemptTools, prefix: str, number: int) -> tuple[Seal, Path | None]:
    """The seal of this attempt's in-process rounds, and the private file (0600, in the private
    run directory) that gives its key to the ranks: none when the job has no secret."""
    codec = tools.coordinator.codec
    key = codec.inprocess_key(prefix) if codec is not None else None
    if key is None:
        return Seal(), None
    path = tools.run_dir / f"inprocess_{number}.key"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key.hex() + "\n")
    return Seal(key), path


@dataclass
class Running:
    """What runs now, for the front ends to read: written by the supervisor only."""

    attempt: Attempt | None = None
    """The running attempt (None between attempts)."""
    round: Round | None = None
    stop_signal: signal.Signals | None = None
    """The signal that asked the daemon to stop (said by its handler: `stop_asked`)."""

    def stop_asked(self, sig: signal.Signals) -> None:
        self.stop_signal = sig

    def now_running(self, attempt: Attempt | None) -> None:
        self.attempt = attempt

    def now_in(self, rnd: Round) -> None:
        self.round = rnd
