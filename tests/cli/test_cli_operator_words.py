"""Issue 44 item 8: the command line speaks the operator's words — no abbreviated flags, errors
naming flags rather than config fields, a mistyped timeout name answered with the closest, and no
negative durations in a verdict."""

from __future__ import annotations

import argparse
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftd.cli.field_flags import in_flags
from ftd.cli.serve_args import build_serve_parser
from ftd.health.links import Deadline, RankHealth
from tests.cli.test_cli_truth import ftd
from tests.conftest import ServeFactory

ABBREVIATED = [
    ("status", "--ur", "http://127.0.0.1:1"),
    ("status", "--run-di", "/nonexistent"),
    ("events", "--run-di", "/nonexistent"),
    ("events", "--sinc", "3"),
    ("top", "--onc"),
    ("top", "--run-di", "/nonexistent"),
    ("restart", "--reaso", "x"),
    ("exclude", "node-a", "--reaso", "x"),
    ("readmit", "node-a", "--ur", "http://127.0.0.1:1"),
    ("timeouts", "--jso"),
    ("store", "--hos", "127.0.0.1"),
]


@pytest.mark.parametrize(
    "argv", ABBREVIATED, ids=lambda argv: " ".join(argv[:-1] if len(argv) > 2 else argv)
)
async def test_no_subcommand_takes_an_abbreviated_flag(argv: tuple[str, ...]) -> None:
    code, out, err = await ftd(*argv)
    assert code == 2 and out == "", err
    assert "unrecognized arguments" in err and "did you mean" in err, err


@pytest.mark.parametrize(
    ("flags", "named", "internal"),
    [
        (("--api-port", "99999"), "--api-port:", "api_port:"),
        (("--progress-timeout-floor", "-1"), "--progress-timeout-floor:", "_floor_s:"),
        (("--shutdown-timeout", "-1"), "--shutdown-timeout:", "shutdown_timeout_s:"),
        (("--nproc-per-node", "0"), "--nproc-per-node:", "nproc_per_node:"),
        (("--rdzv-join-timeout", "-2"), "--rdzv-join-timeout:", "rdzv_join_timeout_s:"),
    ],
)
async def test_a_bad_value_is_named_by_its_flag(
    flags: tuple[str, ...], named: str, internal: str
) -> None:
    code, _, err = await ftd("serve", "--nnodes", "1", *flags, "--print-config", "train.py")
    assert code == 2 and err.count("\n") == 1, err
    assert named in err and internal not in err, err


def test_the_field_table_comes_from_the_parser() -> None:
    parser = build_serve_parser()
    args = argparse.Namespace(restart_policy="any-faild", nnodes="3:2")
    message = (
        "nnodes_min: MIN 3 is above MAX 2; "
        "restart_policy: Input should be 'any-failed' or 'min-healthy'; derived: kept"
    )
    shown = in_flags(message, parser, args)
    assert shown.startswith("--nnodes: MIN 3 is above MAX 2; --restart-policy: Input should be")
    assert "(did you mean 'any-failed'?)" in shown and shown.endswith("; derived: kept")


async def test_a_mistyped_timeout_name_gets_the_closest(serve: ServeFactory) -> None:
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        script_args=("--hang",),
    )
    await run.stderr.expect(r"state rendezvous -> running")
    where = ("--run-dir", str(run.run_dir))
    code, out, err = await ftd("timeouts", "set", "rank_heartbeat_timeot=30", *where)
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert "rank_heartbeat_timeot" in err and "(did you mean rank_heartbeat_timeout?)" in err, err
    code, _, err = await ftd("timeouts", "set", "rank_heartbeat_timeout=30", *where)
    assert code == 0, err
    run.signal(signal.SIGTERM)
    await run.wait()


@pytest.mark.parametrize("early_s", [0.0006, 0.0, 1e-9])
def test_a_verdict_is_never_overdue_by_a_negative_time(early_s: float) -> None:
    deadline = Deadline(100.0, "heartbeat", 10.0)
    reason = deadline.reason(RankHealth(local_rank=0, global_rank=3, pid=42), 100.0 - early_s)
    assert "overdue by 0.0 ms" in reason and "-" not in reason.split("overdue by")[1]


@given(
    at=st.floats(0, 1e9, allow_nan=False),
    late=st.floats(-1.0, 1e4, allow_nan=False),
    kind=st.sampled_from(["heartbeat", "initial_heartbeat", "out_of_section", "never_connected"]),
)
def test_overdue_is_never_negative_for_any_clock(at: float, late: float, kind: str) -> None:
    reason = Deadline(at, kind, 10.0).reason(RankHealth(0, 0, 1), at + late)
    shown = float(reason.rsplit("overdue by ", 1)[1].removesuffix(" ms)"))
    assert shown >= 0.0
