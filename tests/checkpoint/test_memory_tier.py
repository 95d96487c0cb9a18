"""The memory tier on a live daemon (ftd_client.checkpoint, ftd/checkpoint/): a DDP job killed
in step 50 resumes at step 50 and ends bit-identical to a run that never failed, under both
start methods; what a careless or hostile rank sends is refused, counted, and the older
snapshot stays usable; the memory is private and freed when the job ends."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

from tests.conftest import BIN, MEMORY_TRAIN, MEMORY_TRAIN_STEPS, Serve, ServeFactory, events_in
from tests.support.cluster import Cluster
from tests.support.snapshots import assert_identical

TRAIN = MEMORY_TRAIN
PRELOAD = ("--preload", "torch._dynamo")
"""DistributedDataParallel imports torch._dynamo in every rank (1.5-2 CPU-s): the zygote's once."""
STEPS = MEMORY_TRAIN_STEPS  # the reference run's (memory_train_reference)


def resumed(out: Path, rank: int) -> list[str]:
    """The steps `rank` resumed after, attempt by attempt (an attempt before any snapshot: none)."""
    files = sorted(out.glob(f"resumed-*-{rank}"), key=lambda f: int(f.name.split("-")[1]))
    return [text for f in files if (text := f.read_text()) != "none"]


def node_dir(run: Serve, name: str) -> Path:
    """The run directory: a node of several has its own under the log directory."""
    return run.log_dir / name[-1] / run.run_id if name.startswith("node") else run.run_dir


async def ftd_status(run_dir: Path) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ftd", "status", "--run-dir", str(run_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, err
    return out.decode()


async def test_a_ddp_job_killed_in_step_50_resumes_there_bit_identical(
    serve: ServeFactory, tmp_path: Path, memory_train_reference: Path
) -> None:
    """Each run against one that never failed: one daemon with two ranks forked by its zygote
    (killed in two attempts in a row, with a back-off of a minute for fast failures: an attempt
    that made steps is no crash loop, so it restarts at once), and two daemons of one rank
    each, the killed rank's under --start-method spawn (the ranks agree on the step through the
    attempt's store). One thread per rank everywhere, so every layout computes bit for bit
    alike."""
    single = ("--nproc-per-node", "2", "--max-restarts", "2", "--api-port", "off", *PRELOAD)
    nodes = Cluster(  # a node descheduled for 2 s (its zygote's imports) is not lost here
        serve, "2", "--nproc-per-node", "1", "--max-restarts", "3", "--node-keepalive-timeout", "10"
    )
    kill = ("--kill-at-step", "50")
    runs: dict[str, Serve] = {}
    for name, flags, args in (
        ("zygote", (*single, "--restart-backoff", "60:60"), (*kill, "--kill-attempts", "2")),
        ("node-a", ("--node-id", "a", *nodes.flags, *PRELOAD), kill),
        ("node-b", ("--node-id", "b", *nodes.flags, "--start-method", "spawn"), kill),
    ):
        out = tmp_path / ("nodes" if name.startswith("node") else name)
        runs[name] = await serve(
            *flags,
            script=TRAIN,
            script_args=("--out", str(out), "--steps", str(STEPS), *args),
            run_id=nodes.job if name.startswith("node") else name,
            api_port=None,
            env={"OMP_NUM_THREADS": "1", **(nodes.env or {})},
        )
    codes = await asyncio.gather(*(run.wait(240) for run in runs.values()))
    assert codes == [0] * 3, {n: r.stderr.text[-3000:] for n, r in runs.items()}
    for name, expected in (("zygote", ["49", "54"]), ("nodes", ["49"])):
        out = tmp_path / name
        for rank in (0, 1):  # the zygote's second kill: in step 55, its second failure in a row
            assert resumed(out, rank) == expected
            assert_identical(memory_train_reference / f"final-{rank}.pt", out / f"final-{rank}.pt")
    for name, ranks in (("zygote", 2), ("node-b", 1)):
        restored = [
            e["data"]["step"] for e in events_in(node_dir(runs[name], name), "checkpoint_restored")
        ]
        assert [step for step in restored if step is not None][:ranks] == [49] * ranks
        assert not events_in(node_dir(runs[name], name), "restart_backoff")
        recoveries = [e["data"] for e in events_in(node_dir(runs[name], name), "recovery")]
        stages = recoveries[-1]["stages"]  # the attempt that finished: restored, then redid
        assert all(stages[name] is not None for name in ("init", "restore", "redo")), stages
        assert all(value is None or value >= 0 for value in stages.values()), stages
    last = runs["zygote"].status()["checkpoint"]["last_restore"]  # type: ignore[index]
    assert (last["step"], last["steps_lost"]) == (54, 0)
    shown = await ftd_status(runs["zygote"].run_dir)
    assert (
        "snapshots: step 60 in memory" in shown and "last restore after step 54 (0 lost)" in shown
    )
    for name, run in runs.items():
        assert not (node_dir(run, name) / "checkpoint.json").exists()  # the memory was freed
        status = json.loads((node_dir(run, name) / "status.json").read_text())
        assert status["checkpoint"]["newest_step"] == STEPS


async def test_what_a_rank_cannot_save_is_refused_and_the_older_snapshot_stays(
    serve: ServeFactory, tmp_path: Path
) -> None:
    run = await serve(
        "--nproc-per-node", "1", "--checkpoint-memory", "8M",
        script=BIN / "checkpoint_probe.py",
        script_args=("--out", str(tmp_path)),
    )  # fmt: skip
    assert await run.wait(120) == 0, run.stderr.text[-3000:]
    probe = json.loads((tmp_path / "probe.json").read_text())
    kept = [1, 1.0]
    assert probe["first"] == kept
    assert "cannot be snapshotted" in probe["unpicklable"] and "pickle" in probe["unpicklable"]
    assert probe["after_unpicklable"] == kept
    assert "does not fit --checkpoint-memory 8388608" in probe["too_large"]
    assert probe["after_too_large"] == kept
    assert probe["forged_done"]["ok"] is False
    assert "not whole" in probe["headerless_done"]["error"]
    assert probe["negative"]["ok"] is False
    assert probe["no_interval"]["ok"] is False and "every 0" in probe["no_interval"]["error"]
    assert probe["after_forged"] == kept
    assert probe["directory_mode"] == "0o700" and probe["file_modes"] == ["0o600"]
    dcp = probe["dcp"]  # DCP's files in the same memory, the newest two kept
    assert (dcp["newest"], dcp["loaded"], dcp["kept"]) == ("3", 3.0, ["2", "3"])
    assert "is not a plain name" in dcp["refused"]
    view = run.status()["checkpoint"]
    assert isinstance(view, dict)
    assert (view["refused"], view["bad_snapshots"], view["completed"]) == (1, 1, 1)
    (refused,) = run.event_data("checkpoint_refused")
    assert refused["global_rank"] == 0 and refused["bytes"] > 8 << 20
    assert "bad_checkpoint: bytes -1" in run.stderr.text  # the packet was dropped, said once
    held = re.search(r"snapshots are held in (\S+)", run.stderr.text)
    assert held and not Path(held[1]).exists()  # freed when the job ended
