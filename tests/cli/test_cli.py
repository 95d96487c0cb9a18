"""`ftd serve`'s command line: the script's arguments reach it verbatim, and the help is honest
and readable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ftd.cli.serve_args import build_serve_parser, parse_serve_argv, split_script
from ftd.config.ft import IGNORED_PARAMETERS, FaultToleranceConfig
from tests.conftest import BIN, ServeFactory


def _serve_help() -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_serve_help_is_honest_and_readable() -> None:
    text = _serve_help()
    assert "default: None" not in text
    assert "(default: the host name) (default:" not in text
    long_lines = [line for line in text.splitlines() if len(line) > 100]
    assert long_lines == []
    flat = " ".join(text.split())
    for name in FaultToleranceConfig.model_fields:
        assert f"--ft-param-{name} " in flat, name
    for name in IGNORED_PARAMETERS:
        assert name in flat, name
    assert "--log-dir DIR" in flat and "a new /tmp/ftd_* directory" in flat
    assert "--print-config" in flat


def _option_prefixes() -> list[str]:
    """Every prefix (from `-`/`--` on) of every option string of `ftd serve`."""
    parser = build_serve_parser()
    prefixes: set[str] = set()
    for option in parser._option_string_actions:
        for end in range(1, len(option) + 1):
            prefixes.add(option[:end])
    return sorted(prefixes)


def test_everything_after_the_script_is_the_script_s() -> None:
    words = [*_option_prefixes(), "--", "-h", "--help", "--nproc-per-node", "8"]
    served = parse_serve_argv(["--nproc-per-node", "2", "-r3", "train.py", *words])
    assert served.namespace.training_script == "train.py"
    assert served.namespace.training_script_args == words
    assert served.namespace.nproc_per_node == "2" and served.namespace.redirects == "3"
    assert served.explicit == {"nproc_per_node", "redirects"}
    parser = build_serve_parser()
    assert split_script(parser, ["--standalone", "--", "-x.py", "a"]) == (["--standalone"], 2)
    assert split_script(parser, ["--log-dir=d", "-m", "pkg.mod", "--fault"]) == (
        ["--log-dir=d", "-m"],
        2,
    )
    assert split_script(parser, ["--nnodes", "2"]) == (["--nnodes", "2"], 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault", "x.py"], "unrecognized arguments: --fault"),
        (["--nproc", "2", "x.py"], "unrecognized arguments: --nproc"),
        (["--ft-param-rank_heartbeat_timout=3", "x.py"], "did you mean 'rank_heartbeat_timeout'"),
        ([], "the following arguments are required: training_script"),
    ],
)
def test_ftd_options_are_never_abbreviated(argv: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftd serve: error: "), lines
    assert message in lines[0]


async def test_a_rank_gets_every_argument_in_order(serve: ServeFactory, tmp_path: Path) -> None:
    out = tmp_path / "argv.json"
    words = [*_option_prefixes(), "--", "-h", "--help", "--nproc-per-node", "8", "", " x "]
    run = await serve(
        "--standalone",
        "--nproc-per-node",
        "1",
        script=BIN / "argv_dump.py",
        script_args=tuple(words),
        env={"ARGV_OUT": str(out)},
    )
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert json.loads(out.read_text()) == words
