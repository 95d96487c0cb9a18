"""In-process restart: ftd_client.inprocess under a real `ftd serve --restart-mode inprocess`.

Four gloo ranks on CPU (tests/bin/inprocess_train.py) train with an allreduce per step; one
fault is injected in rank 2 at step 5. The worker's marker files say what happened: pids per
round, when each rank's abort had unblocked it (the Wrapper's finalize), the final parameters.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from ftd_client.inprocess import (
    Abort,
    AbortTorchDistributed,
    AbortTransformerEngine,
    Compose,
    FrozenState,
)

from tests.conftest import BIN, Backend, Serve, ServeFactory
from tests.support.inprocess import ENV, PRELOAD, TRAIN, WORLD

HAVE_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None
NVRX = ("--nvrx-import",)
FAULTY = 2
SURVIVORS = [s for s in range(WORLD) if s != FAULTY]
UNBLOCKED_WITHIN_S = 2.0


async def train(
    serve: ServeFactory,
    tmp_path: Path,
    inject: str,
    *flags: str,
    script_flags: tuple[str, ...] = (),
    **worker: str,
) -> Serve:
    options = {"steps": "20", "step-time": "0.05", "soft-timeout": "20", "hard-timeout": "30"}
    options.update({key.replace("_", "-"): value for key, value in worker.items()})
    args = [f"--{key}={value}" for key, value in options.items()]
    return await serve(
        "--nproc-per-node", str(WORLD), "--restart-mode", "inprocess", *PRELOAD, *flags,
        script=TRAIN,
        script_args=("--out", str(tmp_path / "out"), "--inject", inject, *args, *script_flags),
        env=ENV,
    )  # fmt: skip


def marker(run: Serve, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((run.out / name).read_text())
    return data


def assert_same_model(run: Serve, slots: list[int], world: int) -> list[dict[str, Any]]:
    finals = [marker(run, f"final_s{slot}") for slot in slots]
    assert all(f["step"] == 20 and f["world"] == world for f in finals), finals
    assert all(f["params"] == finals[0]["params"] for f in finals)
    assert any(p != 0.0 for p in finals[0]["params"])
    return finals


def assert_unblocked_in_process(run: Serve, survivors: list[int]) -> None:
    """The survivors left their pending allreduce within UNBLOCKED_WITHIN_S of the fault and
    went on in-process: same pids in round 0, round 1 and at the end."""
    faulted = marker(run, f"fault_s{FAULTY}")["time"]
    for slot in survivors:
        unblocked = marker(run, f"aborted_i0_s{slot}")["time"] - faulted
        assert 0 <= unblocked < UNBLOCKED_WITHIN_S, (slot, unblocked)
        pids = {marker(run, f"{name}_s{slot}")["pid"] for name in ("round_i0", "round_i1", "final")}
        assert len(pids) == 1, (slot, pids)


@pytest.mark.timeout(90)
async def test_a_raising_rank_restarts_every_rank_in_process(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await train(serve, tmp_path, "raise")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert_unblocked_in_process(run, SURVIVORS)
    assert_unblocked_in_process(run, [FAULTY])  # the raising rank too keeps its process
    finals = assert_same_model(run, list(range(WORLD)), WORLD)
    assert {f["iteration"] for f in finals} == {1} and {f["attempt"] for f in finals} == {0}
    [fault] = run.event_data("inprocess_fault")
    assert fault["kind"] == "exception" and fault["global_rank"] == FAULTY
    assert "injected failure" in fault["reason"]
    assert not run.event_data("attempt_failed")


@pytest.mark.skipif(not HAVE_NVRX, reason="needs nvidia-resiliency-ext")
@pytest.mark.timeout(90)
async def test_an_unmodified_nvrx_script_gets_ftds_in_process_restart(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """`from nvidia_resiliency_ext import inprocess` (NVRx's Wrapper, unmodified): under
    --restart-mode inprocess the rank's start makes it ftd's (client/ftd_client/inprocess/
    nvrx_alias.py), so a fault restarts every rank in process within ftd's bound, not NVRx's
    own store and gloo timeout."""
    run = await train(serve, tmp_path, "raise", script_flags=NVRX)
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert_unblocked_in_process(run, SURVIVORS)
    assert_same_model(run, list(range(WORLD)), WORLD)
    [fault] = run.event_data("inprocess_fault")
    assert fault["global_rank"] == FAULTY
    said = "ftd: nvidia_resiliency_ext.inprocess is ftd's in-process restart (ftd_client.inprocess)"
    assert run.stderr.text.count(said) == WORLD


@pytest.mark.timeout(90)
async def test_ranks_that_returned_restart_with_a_peer_that_faults_after(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """A round ends well only when every member returned: the three ranks whose function
    already returned come back for the next round when the fourth then raises."""
    run = await train(serve, tmp_path, "late")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert_unblocked_in_process(run, SURVIVORS)
    finals = assert_same_model(run, list(range(WORLD)), WORLD)
    assert {f["iteration"] for f in finals} == {1} and {f["attempt"] for f in finals} == {0}
    [fault] = run.event_data("inprocess_fault")
    assert fault["kind"] == "exception" and "after the others returned" in fault["reason"]
    assert not run.event_data("attempt_failed")
    assert "in-process round 1: every member's function returned" in run.stderr.text


@pytest.mark.timeout(90)
async def test_a_dead_rank_is_respawned_and_rejoins(serve: ServeFactory, tmp_path: Path) -> None:
    run = await train(serve, tmp_path, "exit", "--max-restarts", "1")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert_unblocked_in_process(run, SURVIVORS)
    finals = assert_same_model(run, list(range(WORLD)), WORLD)
    replaced = finals[FAULTY]
    assert replaced["respawned"] and replaced["iteration"] == 1
    assert replaced["pid"] != marker(run, f"round_i0_s{FAULTY}")["pid"]
    [respawned] = run.event_data("rank_respawned")
    assert respawned["global_rank"] == FAULTY and respawned["pid"] == replaced["pid"]
    # The round's fault is the daemon's announcement of the exit, unless a survivor's collective
    # failed first (gloo sees the peer's sockets close): on a busy machine either comes first.
    [fault] = run.event_data("inprocess_fault")
    assert (fault["kind"], fault["global_rank"]) == ("rank_exit", FAULTY) or (
        fault["kind"] == "exception" and fault["global_rank"] != FAULTY
    ), fault
    [failed] = run.event_data("inprocess_rank_failed")
    assert failed["global_rank"] == FAULTY and failed["respawn"] is True
    assert run.status()["restart_count"] == 1  # the respawn is counted
    assert not run.event_data("attempt_failed")


@pytest.mark.timeout(90)
async def test_without_respawn_the_survivors_go_on_at_world_3(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await train(serve, tmp_path, "exit", "--no-inprocess-respawn")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert_unblocked_in_process(run, SURVIVORS)
    assert_same_model(run, SURVIVORS, WORLD - 1)
    assert not (run.out / f"final_s{FAULTY}").exists()
    assert [r["world"] for r in map(lambda s: marker(run, f"round_i1_s{s}"), SURVIVORS)] == [3] * 3
    assert not run.event_data("rank_respawned")


@pytest.mark.timeout(90)
async def test_a_sleeping_rank_is_caught_by_the_soft_timeout(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await train(serve, tmp_path, "sleep", soft_timeout="3")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    # Every rank stalls (the others wait for rank 2): whichever notices first ends the round.
    [fault] = run.event_data("inprocess_fault")
    assert fault["kind"] == "soft_timeout"
    faulted = marker(run, f"fault_s{FAULTY}")["time"]
    for slot in range(WORLD):
        pids = {marker(run, f"{name}_s{slot}")["pid"] for name in ("round_i0", "round_i1", "final")}
        assert len(pids) == 1, (slot, pids)
        unblocked = marker(run, f"aborted_i0_s{slot}")["time"] - faulted
        assert 3.0 <= unblocked < 3.0 + UNBLOCKED_WITHIN_S, (slot, unblocked)
    assert_same_model(run, list(range(WORLD)), WORLD)


@pytest.mark.timeout(90)
async def test_a_block_without_hang_protection_stalls_twice_the_soft_timeout_unharmed(
    serve: ServeFactory, tmp_path: Path
) -> None:
    """Every rank sleeps 2 x soft_timeout inside `call_wrapper.disable_hang_protection()`
    (NVRx's context manager): no soft timeout, no fault, the job ends as if never paused."""
    run = await train(serve, tmp_path, "protected", soft_timeout="2")
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    assert not run.event_data("inprocess_fault")
    for slot in range(WORLD):
        assert not (run.out / f"round_i1_s{slot}").exists()
    assert_same_model(run, list(range(WORLD)), WORLD)


@pytest.mark.timeout(90)
async def test_a_rank_stuck_in_c_code_falls_back_to_a_process_restart(
    serve: ServeFactory, tmp_path: Path
) -> None:
    # Rank 2 sleeps in C holding the GIL: neither its Wrapper nor its peers can unblock it.
    run = await train(
        serve, tmp_path, "gil", "--max-restarts", "1", soft_timeout="3", hard_timeout="6"
    )
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    [gave_up] = run.event_data("inprocess_gave_up")
    assert FAULTY in gave_up["stragglers"] and "hard timeout (6s)" in gave_up["reason"]
    [failed] = run.event_data("attempt_failed")
    assert failed["failure"]["kind"] == "hang"
    finals = assert_same_model(run, list(range(WORLD)), WORLD)
    assert {f["attempt"] for f in finals} == {1}  # the processes were started again


@pytest.mark.timeout(90)
async def test_a_fault_on_one_node_restarts_the_ranks_of_every_node(
    serve: ServeFactory, tmp_path: Path, backend: Backend
) -> None:
    # Two daemons of two ranks each; rank 2 (node b's local rank 0) dies. Node a's daemon leads
    # the rounds; node b's announces the death and respawns it. Under etcd, the ranks' rounds
    # meet in a store of node a's daemon whose address it published in etcd.
    endpoint = backend.endpoint()
    nodes = [
        await serve(
            "--nnodes", "2", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
            "--rdzv-backend", backend.name,
            "--rdzv-last-call-timeout", "1", "--node-id", node, "--nproc-per-node", "2",
            "--max-restarts", "1", "--restart-mode", "inprocess", *PRELOAD,
            script=TRAIN,
            script_args=("--out", str(tmp_path / "out"), "--inject", "exit"),
            env=ENV,
        )
        for node in ("a", "b")
    ]  # fmt: skip
    maps = []
    for node in nodes:  # the rounds are run with ftd's store client: no torch in a daemon
        await node.stderr.expect(r"attempt 0: started local ranks")
        maps.append(Path(f"/proc/{node.proc.pid}/maps").read_text())
    for node in nodes:
        assert await node.wait(timeout=80) == 0, node.stderr.text[-3000:]
    assert not any("libtorch" in m for m in maps)
    a, b = nodes
    assert_unblocked_in_process(a, SURVIVORS)
    finals = assert_same_model(a, list(range(WORLD)), WORLD)
    assert finals[FAULTY]["respawned"]
    node_events = {
        name: [json.loads(line) for line in path.read_text().splitlines()]
        for name, path in (
            (n, run.log_dir / n / run.run_id / "events.jsonl") for n, run in (("a", a), ("b", b))
        )
    }
    assert [e["kind"] for e in node_events["a"]].count("inprocess_round") == 2  # a leads
    assert "inprocess_round" not in [e["kind"] for e in node_events["b"]]
    [respawned] = [e["data"] for e in node_events["b"] if e["kind"] == "rank_respawned"]
    assert respawned["global_rank"] == FAULTY and respawned["local_rank"] == 0


MANAGED = BIN / "managed_train.py"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("inject", "flags", "world"),
    [("sleep", (), 3), ("exit", ("--no-inprocess-respawn",), 2)],
    ids=["swallowed-error-ends-the-round", "size-follows-the-round"],
)
async def test_a_managed_group_follows_the_rounds(
    serve: ServeFactory, tmp_path: Path, inject: str, flags: tuple[str, ...], world: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = await serve(
        "--nproc-per-node", "3", "--restart-mode", "inprocess", *PRELOAD, *flags,
        script=MANAGED, script_args=("--out", str(out), "--inject", inject), env=ENV,
    )  # fmt: skip
    assert await run.wait(timeout=80) == 0, run.stderr.text[-3000:]
    survivors = range(world) if inject == "exit" else range(3)
    finals = [json.loads((out / f"final_s{slot}.json").read_text()) for slot in survivors]
    expected_sum = float(sum(range(1, world + 1)))
    assert [(f["iteration"], f["attempt"], f["size"], f["sum"]) for f in finals] == [
        (1, "0", world, expected_sum)
    ] * len(finals)
    [fault] = run.event_data("inprocess_fault")
    if inject == "sleep":
        # Rank 2 is asleep, not dead: only a peer's manager, given the swallowed gloo timeout,
        # can have ended the round.
        assert fault["kind"] == "exception" and fault["global_rank"] in (0, 1), fault


def test_serve_help_documents_the_restart_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from ftd.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--restart-mode {process,inprocess}" in text
    assert "--inprocess-respawn, --no-inprocess-respawn" in text


def test_restart_mode_is_validated(tmp_path: Path) -> None:
    from ftd.cli.main import build_parser
    from ftd.config.resolve import serve_config_from_args
    from ftd.config.serve import ServeConfig

    script = tmp_path / "train.py"
    script.write_text("")
    parser = build_parser()
    argv = ["serve", "--restart-mode", "inprocess", "--no-inprocess-respawn", str(script)]
    config = serve_config_from_args(parser.parse_args(argv))
    assert isinstance(config, ServeConfig)
    assert config.restart_mode == "inprocess" and not config.inprocess_respawn
    assert ServeConfig(entrypoint=str(script)).restart_mode == "process"
    with pytest.raises(ValueError, match="restart_mode"):
        ServeConfig(entrypoint=str(script), restart_mode="sometimes")  # type: ignore[arg-type]


# -- the parts, without processes ------------------------------------------------------------


@dataclasses.dataclass
class Record(Abort):
    name: str
    calls: list[str]

    def __call__(self, state: FrozenState) -> FrozenState:
        self.calls.append(self.name)
        return state.replace(iteration=state.iteration + 1)


def test_compose_applies_right_to_left_and_forwards_the_state() -> None:
    calls: list[str] = []
    composed = Compose(Record("a", calls), Record("b", calls), Record("c", calls))
    state = composed(FrozenState(2, 4, 2, 4, 0))
    assert calls == ["c", "b", "a"]
    assert state.iteration == 3  # each got the state the one before returned


def test_compose_rejects_a_step_that_returns_something_else() -> None:
    with pytest.raises(TypeError, match="must return the FrozenState"):
        Compose(lambda state: None)(FrozenState(0, 1, 0, 1, 0))  # type: ignore[arg-type]


def test_frozen_state_is_read_only() -> None:
    state = FrozenState(1, 4, 1, 3, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.rank = 0  # type: ignore[misc]
    assert state.replace(rank=0).rank == 0 and state.rank == 1


def _one_rank_group() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))


@pytest.mark.timeout(60)
def test_abort_destroys_groups_and_writes_flight_recorder_traces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    _one_rank_group()
    dist.new_group([0])
    path = tmp_path / "does" / "not" / "exist"
    state = FrozenState(0, 1, 0, 1, 3)
    assert AbortTorchDistributed(torch_fr_trace_path=path)(state) is state
    assert not dist.is_initialized()
    trace = path / "rank_0_iteration_3.pkl"
    data = pickle.loads(trace.read_bytes())
    # The recorder is the process's: a group an earlier test of this worker made may be in it.
    assert "gloo:all_reduce" in [entry["profiling_name"] for entry in data["entries"]]


@pytest.mark.timeout(60)
def test_abort_writes_no_traces_without_a_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    _one_rank_group()
    AbortTorchDistributed(torch_fr_trace_path=tmp_path / "fr")(FrozenState(0, 1, 0, 1, 0))
    assert not dist.is_initialized()
    assert not (tmp_path / "fr").exists()


def test_transformer_engine_abort_says_what_is_missing() -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        pass
    else:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(ImportError, match="AbortTransformerEngine needs Transformer Engine"):
        AbortTransformerEngine()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() == 0, reason="needs CUDA (NCCL process groups)")
@pytest.mark.timeout(120)
async def test_nccl_ranks_restart_in_process(serve: ServeFactory, tmp_path: Path) -> None:
    # One rank per GPU (at most 2); NCCL communicators are aborted, then made again.
    world = min(2, _cuda_devices())
    fr = tmp_path / "fr"
    run = await serve(
        "--nproc-per-node", str(world), "--restart-mode", "inprocess",
        script=TRAIN,
        script_args=(
            "--out", str(tmp_path / "out"), "--inject", "raise", "--inject-rank", "0",
            "--backend", "nccl", "--fr-path", str(fr), "--steps", "20",
        ),
        env={**ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE": "100"},
    )  # fmt: skip
    assert await run.wait(timeout=110) == 0, run.stderr.text[-3000:]
    finals = [marker(run, f"final_s{slot}") for slot in range(world)]
    assert {f["iteration"] for f in finals} == {1}
    assert all(f["params"] == finals[0]["params"] for f in finals)
    assert (fr / "rank_0_iteration_0.pkl").exists()
