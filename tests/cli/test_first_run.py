"""A first run that tells the truth (issue 27, rows 11, 12 and 15): a mistyped flag names the
right one, an ftd flag after the script is the script's with a warning, a loopback endpoint with
several nodes is called out, `--print-config` says who hosts the store, whether the records are
signed and that nobody named the run, and the Makefile says which torch build it installs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftd.cli.serve_args import parse_serve_argv
from tests.conftest import BIN, ROOT, WORKER, ServeFactory, free_port

pytestmark = pytest.mark.timeout(90)

CLEAN_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
"""No scheduler's variables (PET_*, SLURM_*) and no secret: what each test sets, it sets."""


def ftd(
    *argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ftd", *argv],
        env={**CLEAN_ENV, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


# -- row 11: "did you mean" --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "suggested"),
    [
        (["serve", "--nproc-per-nod", "2", "x.py"], "(did you mean --nproc-per-node?)"),
        (["serve", "--max_restart=3", "x.py"], "(did you mean --max_restarts?)"),
        (
            ["serve", "--standalon", "--nproc-per-nod", "2", "x.py"],
            "(did you mean --standalone for --standalon, --nproc-per-node for --nproc-per-nod?)",
        ),
        (["events", "--folow"], "(did you mean --follow?)"),
        (["timeouts", "--jsn"], "(did you mean --json?)"),
        (["store", "--prot", "29400"], "(did you mean --port?)"),
    ],
)
def test_a_misspelled_flag_is_one_line_naming_the_right_one(
    argv: list[str], suggested: str
) -> None:
    proc = ftd(*argv)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "error: unrecognized arguments: " in lines[0] and lines[0].endswith(suggested), lines


def test_a_word_like_no_flag_gets_no_guess() -> None:
    proc = ftd("serve", "--zzzzzz", "x.py")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ftd serve: error: unrecognized arguments: --zzzzzz"


# -- row 11: ftd's flags after the script --------------------------------------------------------


async def test_an_ftd_flag_after_the_script_warns_and_still_goes_to_the_script(
    serve: ServeFactory, tmp_path: Path
) -> None:
    out = tmp_path / "argv.json"
    words = ("--nproc-per-node", "2", "--max-restarts=1", "-m", "--lr", "0.1")
    run = await serve(
        "--standalone",
        script=BIN / "argv_dump.py",
        script_args=words,
        env={"ARGV_OUT": str(out)},
    )
    assert await run.wait() == 0, run.stderr.text[-3000:]
    assert json.loads(out.read_text()) == list(words)  # as torchrun: the script's, verbatim
    warnings = [line for line in run.stderr.lines if "ftd serve: warning:" in line]
    assert len(warnings) == 1, warnings
    named = warnings[0].split("warning: ")[1].split(" after the script")[0]
    assert named == "--nproc-per-node, --max-restarts"  # not -m: short flags are scripts' too
    assert "put ftd's flags before the script" in warnings[0]
    assert len(await run.rank_pids()) == 1  # ftd ran 1 rank, not 2


def test_dash_dash_before_the_script_says_its_arguments_are_meant() -> None:
    marked = parse_serve_argv(["--standalone", "--", "train.py", "--nproc-per-node", "2"])
    assert marked.namespace.training_script_args == ["--nproc-per-node", "2"]
    assert marked.after_script == []
    plain = parse_serve_argv(["train.py", "--log-dir=x", "--help", "--seed", "1"])
    assert plain.after_script == ["--log-dir"]  # --help is every script's own


# -- row 11: a loopback endpoint with several nodes ---------------------------------------------


async def test_several_nodes_at_a_loopback_endpoint_are_warned_at_start(
    serve: ServeFactory,
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    run = await serve(
        *("--nnodes", "2", "--rdzv-endpoint", endpoint, "--node-keepalive-timeout", "2"),
        api_port="off",
    )
    line = await run.stderr.expect(r"\[ftd W .*ftd\.config\] (--rdzv-endpoint \S+ is a loopback.*)")
    assert f"--rdzv-endpoint {endpoint} is a loopback address: with --nnodes 2" in line[1]
    assert "--local-addr 127.0.0.1 when every node runs on this machine" in line[1]
    await run.stderr.expect("hosting the rendezvous store")
    run.signal(signal.SIGTERM)
    await run.wait()


async def test_nodes_that_all_run_here_say_so_and_get_no_warning(serve: ServeFactory) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    run = await serve(
        *("--nnodes", "2", "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1"),
        api_port="off",
    )
    await run.stderr.expect("hosting the rendezvous store")  # logged after the start's notes
    assert "loopback" not in run.stderr.text
    run.signal(signal.SIGTERM)
    await run.wait()


# -- row 15: --print-config -------------------------------------------------------------------


def notes(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """--print-config's `# name: text` header lines."""
    assert proc.returncode == 0, proc.stderr
    lines = [line[2:] for line in proc.stdout.splitlines() if line.startswith("# ")]
    return dict(line.split(": ", 1) for line in lines if ": " in line)


def test_print_config_says_this_node_hosts_the_store_and_records_are_open() -> None:
    port = free_port()
    said = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "job", str(WORKER))
    )  # fmt: skip
    assert said["rendezvous store hosted by"].startswith(f"this node, on 127.0.0.1:{port}")
    assert said["records signed"].startswith("no: no job secret (FTD_RDZV_SECRET or --rdzv-conf")
    assert said["warning"].startswith(f"--rdzv-endpoint 127.0.0.1:{port} is a loopback address")
    assert "note" not in said  # the run is named


@pytest.mark.parametrize(
    ("flags", "host"),
    [
        (("--rdzv-endpoint", "192.0.2.1:29400"), "another node or `ftd store` at 192.0.2.1:29400"),
        (("--rdzv-conf", "is_host=0"), "another node or `ftd store` at 127.0.0.1:29400"),
        (("--rdzv-conf", "is_host=1"), "this node, on 127.0.0.1:29400 (--rdzv-conf is_host=1)"),
        (("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379"), "no daemon: the etcd cluster"),
        (("--standalone",), "none: one node, no rendezvous"),
    ],
)
def test_print_config_says_who_hosts_the_store(flags: tuple[str, ...], host: str) -> None:
    said = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--rdzv-id", "j", *flags, str(WORKER))
    )
    assert said["rendezvous store hosted by"].startswith(host), said


def test_print_config_says_records_are_signed_and_with_what(tmp_path: Path) -> None:
    secret = "s" * 32
    from_env = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--local-addr", "127.0.0.1",
            "--rdzv-id", "j", str(WORKER), env={"FTD_RDZV_SECRET": secret})
    )  # fmt: skip
    assert from_env["records signed"] == "yes, with the secret in FTD_RDZV_SECRET"
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    from_file = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--rdzv-conf",
            f"secret_file={secret_file}", "--rdzv-id", "j", str(WORKER))
    )  # fmt: skip
    assert from_file["records signed"] == f"yes, with the secret in {secret_file}"
    too_short = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--rdzv-id", "j", str(WORKER),
            env={"FTD_RDZV_SECRET": "short"})
    )  # fmt: skip
    assert too_short["records signed"].startswith("no, and the daemon will not start: ")


def test_print_config_says_nobody_named_the_run() -> None:
    several = notes(
        ftd("serve", "--print-config", "--nnodes", "2", "--local-addr", "127.0.0.1", str(WORKER))
    )
    assert several["warning"].startswith("the run id is `none`: neither --rdzv-id nor the ")
    assert "give each job its own --rdzv-id" in several["warning"]
    one = notes(ftd("serve", "--print-config", str(WORKER)))
    assert one["note"].startswith("the run id is `none`")
    named = notes(ftd("serve", "--print-config", str(WORKER), env={"PET_RDZV_ID": "abc"}))
    assert "note" not in named and "warning" not in named
    assert notes(ftd("serve", "--print-config", "--standalone", str(WORKER))).get("note") is None


async def test_the_daemon_says_at_start_that_nobody_named_the_run(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    proc = ftd(
        "serve", "--api-port", "off", "--preload", "none", "--log-dir", str(tmp_path / "logs"),
        str(script),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ftd.config] the run id is `none`: neither --rdzv-id nor the scheduler" in proc.stderr
    assert (tmp_path / "logs" / "none").is_dir()


# -- row 12: the Makefile's torch --------------------------------------------------------------


def make_n(tmp_path: Path, *settings: str) -> str:
    """What `make -n demo test` would run on a fresh machine (a venv that does not exist)."""
    proc = subprocess.run(
        ["make", "-n", f"VENV={tmp_path / 'venv'}", *settings, "demo", "test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_installs_torch_s_cpu_build_and_numpy_without_a_gpu(tmp_path: Path) -> None:
    text = make_n(tmp_path, "GPU=")
    pip_lines = [line for line in text.splitlines() if " -m pip " in line and " install " in line]
    torch_lines = [line for line in pip_lines if " torch numpy" in line]
    assert any(
        "--index-url 'https://download.pytorch.org/whl/cpu' torch numpy" in line
        for line in torch_lines
    ), torch_lines
    assert "CPU build: no NVIDIA GPU here" in text
    assert "cannot be reached from here: torch and numpy from pip's configured indexes" in text
    assert all(" -q " not in line for line in pip_lines), pip_lines  # pip shows its progress
    # ftd and the test tools through uv, and through pip where uv cannot be had
    project_lines = [line for line in text.splitlines() if "-e '.[test,nvrx]'" in line]
    assert any("/bin/uv pip install " in line and " -m pip " in line for line in project_lines)
    venv = tmp_path / "venv"
    order = [text.index(f"touch {venv}/{stamp}") for stamp in (".created", ".torch", ".demo")]
    assert order == sorted(order) and f"touch {venv}/.installed" in text


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_takes_pypi_s_default_torch_where_a_gpu_is(tmp_path: Path) -> None:
    text = make_n(tmp_path, "GPU=GPU 0: NVIDIA H100")
    assert "download.pytorch.org" not in text
    assert "an NVIDIA GPU is here" in text
    assert any(line.endswith("torch numpy") for line in text.splitlines())
