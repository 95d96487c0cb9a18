"""Schedulers fill `ftd serve`'s flags: Slurm host lists, the variables of Slurm, Kubernetes and
torchrun (PET_*), their precedence, hostile values, --print-config, and the shipped examples."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ftd.cli.serve_args import parse_serve_argv
from ftd.config.resolve import UsageError, apply_scheduler, format_config, serve_config_from_args
from ftd.config.scheduler import MAX_HOSTS, SchedulerError, detect, expand_hostlist, first_host
from ftd.config.serve import ServeConfig
from tests.conftest import ROOT, WORKER

# -- host lists, as `scontrol show hostnames` expands them -------------------------------------

HOSTLISTS = [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    (
        "node[01-04,07],gpu-[1-2]",
        ["node01", "node02", "node03", "node04", "node07", "gpu-1", "gpu-2"],
    ),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a,b,c", ["a", "b", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n[1-2]x", ["n1x", "n2x"]),
    ("[1-2]", ["1", "2"]),
    ("n[3,1]", ["n3", "n1"]),
    ("n[1,1]", ["n1", "n1"]),
    ("n[5]", ["n5"]),
    ("a.example.com,b[1-2].example.com", ["a.example.com", "b1.example.com", "b2.example.com"]),
    (" n1 , n2 ", ["n1", "n2"]),
    ("", []),
]


@pytest.mark.parametrize(("text", "hosts"), HOSTLISTS)
def test_hostlists_expand_as_scontrol_does(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    if hosts:
        assert first_host(text) == hosts[0]


@pytest.mark.parametrize(
    "text",
    [
        "n[1-",
        "n1-2]",
        "n[3-1]",
        "n[a-b]",
        "n[]",
        "n[[1]]",
        "n[1--2]",
        "a,,b",
        "n[1-2];rm -rf /",
        "bad host",
        "n[-1]",
        "n[1-99999999999999999999]",
        "n[\u00b9-2]",
        "n[\u0663]",
    ],
)
def test_malformed_hostlists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


@pytest.mark.parametrize(
    "digits", ["\u00b9", "\u0663", "1\u00b2"]
)  # ¹ (int() fails), ٣ (int() reads 3)
@pytest.mark.parametrize("name", ["SLURM_NNODES", "PET_NODE_RANK", "PET_MAX_RESTARTS"])
def test_digits_that_are_not_ascii_are_refused_in_one_line(name: str, digits: str) -> None:
    """Found by the fuzz target: str.isdigit() took "¹", and int() then raised ValueError."""
    env = {name: digits, "SLURM_JOB_ID": "1"} if name.startswith("SLURM") else {name: digits}
    with pytest.raises(SchedulerError, match=name):
        detect(env)


def test_a_huge_hostlist_is_refused_without_expanding_it() -> None:
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist("n[0-999999999]")
    with pytest.raises(ValueError, match="more than"):
        expand_hostlist(f"n[1-{MAX_HOSTS}],m")
    assert first_host("n[0-999999]") == "n0"  # the first host needs no expansion


# -- what each scheduler sets ------------------------------------------------------------------

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-10]",
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_NTASKS_PER_NODE": "1",
}


def _values(env: dict[str, str]) -> dict[str, tuple[object, str]]:
    return {dest: (s.value, s.source) for dest, s in detect(env).settings.items()}


def test_slurm_fills_the_rendezvous() -> None:
    detected = detect(SLURM)
    assert detected.scheduler == "slurm"
    assert _values(SLURM) == {
        "rdzv_id": ("4242", "SLURM_JOB_ID"),
        "nnodes": ("4", "SLURM_NNODES"),
        "nproc_per_node": ("8", "SLURM_GPUS_ON_NODE"),
        "rdzv_endpoint": ("gpu07:29400", "SLURM_JOB_NODELIST"),
        "node_rank": (2, "SLURM_NODEID"),
    }


def test_slurm_inside_a_step_uses_the_step_nodes_and_tasks_without_gpus() -> None:
    env = SLURM | {"SLURM_STEP_NODELIST": "gpu[09-10]", "SLURM_GPUS_ON_NODE": "0"}
    env["SLURM_NTASKS_PER_NODE"] = "4"
    values = _values(env)
    assert values["rdzv_endpoint"] == ("gpu09:29400", "SLURM_STEP_NODELIST")
    assert values["nproc_per_node"] == ("4", "SLURM_NTASKS_PER_NODE")


def test_pet_variables_win_over_the_scheduler() -> None:
    env = SLURM | {"PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "head:1234", "PET_RDZV_ID": "j1"}
    values = _values(env)
    assert values["nnodes"] == ("2:4", "PET_NNODES")
    assert values["rdzv_endpoint"] == ("head:1234", "PET_RDZV_ENDPOINT")
    assert values["rdzv_id"] == ("j1", "PET_RDZV_ID")
    assert values["node_rank"] == (2, "SLURM_NODEID")


def test_kubernetes_pods_of_a_pytorchjob_and_of_an_indexed_job() -> None:
    pod = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "WORLD_SIZE": "3",
        "RANK": "1",
    }
    assert detect(pod).scheduler == "kubernetes"
    assert _values(pod) == {
        "rdzv_endpoint": ("job-master-0:23456", "MASTER_ADDR+MASTER_PORT"),
        "nnodes": ("3", "WORLD_SIZE"),
        "node_rank": (1, "RANK"),
    }
    trainer = {
        "KUBERNETES_SERVICE_HOST": "10.0.0.1",
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "train-node-0-0.train",
        "PET_MASTER_PORT": "29400",
        "JOB_COMPLETION_INDEX": "1",
    }
    assert _values(trainer) == {
        "nnodes": ("2", "PET_NNODES"),
        "nproc_per_node": ("4", "PET_NPROC_PER_NODE"),
        "node_rank": (1, "PET_NODE_RANK"),
        "rdzv_endpoint": ("train-node-0-0.train:29400", "PET_MASTER_ADDR+PET_MASTER_PORT"),
    }
    indexed = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}
    assert _values(indexed) == {"node_rank": (3, "JOB_COMPLETION_INDEX")}


def test_no_scheduler_sets_nothing() -> None:
    assert detect({"HOME": "/root", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}).settings == {}
    assert detect({}).scheduler == "none"


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "x"}, "SLURM_NNODES"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "0"}, "SLURM_NNODES"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "-3"}, "SLURM_NNODES"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "99999999999999"}, "SLURM_NNODES"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "2"}, "SLURM_NODEID"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-"}, "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[0-99999999]"}, "SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_ID": "../../etc"}, "SLURM_JOB_ID"),
        ({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "1e3"}, "SLURM_GPUS_ON_NODE"),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS_PER_NODE": "2(x3)"}, "SLURM_NTASKS_PER_NODE"),
        ({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2\n3"}, "SLURM_NNODES"),
        ({"PET_NNODES": "3:2"}, "PET_NNODES"),
        ({"PET_NNODES": "1:" + "9" * 5000}, "PET_NNODES"),
        ({"PET_RDZV_ENDPOINT": "head:99999"}, "PET_RDZV_ENDPOINT"),
        ({"PET_RDZV_ENDPOINT": "he ad:1"}, "PET_RDZV_ENDPOINT"),
        ({"PET_STANDALONE": "maybe"}, "PET_STANDALONE"),
        ({"PET_MAX_RESTARTS": "-1"}, "PET_MAX_RESTARTS"),
        ({"PET_RDZV_CONF": "novalue"}, "PET_RDZV_CONF"),
        ({"PET_RDZV_BACKEND": "c10d; rm"}, "PET_RDZV_BACKEND"),
        ({"PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "0"}, "PET_MASTER_PORT"),
        ({"KUBERNETES_SERVICE_HOST": "x", "WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"KUBERNETES_SERVICE_HOST": "x", "WORLD_SIZE": "2", "RANK": "5"}, "RANK"),
    ],
)
def test_hostile_variables_are_refused_naming_them(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SchedulerError) as caught:
        detect(env)
    message = str(caught.value)
    assert message.startswith(f"{variable}: ") and "\n" not in message


def test_a_bad_variable_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_NNODES": "lots"}
    proc = subprocess.run(
        [sys.executable, "-m", "ftd", "serve", str(WORKER)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ftd serve: error: SLURM_NNODES: expected an integer, got 'lots'"
    ]
    assert list(tmp_path.iterdir()) == []


# -- flags win; --print-config -------------------------------------------------------------


def resolve(argv: list[str], env: dict[str, str]) -> tuple[ServeConfig, str]:
    served = parse_serve_argv(argv)
    assert served.unknown == []
    detected, sources = apply_scheduler(served.namespace, served.explicit, env)
    config = serve_config_from_args(served.namespace)
    return config, format_config(config, served.namespace, detected, sources)


def test_explicit_flags_win_and_print_config_names_each_source() -> None:
    config, text = resolve(
        ["--nnodes", "2", "--rdzv_id", "mine", "--max-restarts", "3", str(WORKER)], SLURM
    )
    assert (config.nnodes_min, config.nnodes_max, config.run_id) == (2, 2, "mine")
    assert config.rdzv_endpoint == "gpu07:29400" and config.nproc_per_node == 8
    lines = {line.split(" = ")[0].strip(): line for line in text.splitlines() if " = " in line}
    assert lines["nnodes_min"].endswith("# flag")
    assert lines["run_id"].endswith("# flag")
    assert lines["rdzv_endpoint"].endswith("# SLURM_JOB_NODELIST")
    assert lines["nproc_per_node"].endswith("# SLURM_GPUS_ON_NODE")
    assert lines["node_rank"].split("#")[1].startswith(" SLURM_NODEID")
    assert lines["shutdown_timeout_s"].endswith("# default")
    assert "# scheduler: slurm" in text
    assert f"# run directory: /tmp/ftd_*/{socket.gethostname()}/mine" in text


def test_print_config_starts_nothing(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ftd", "serve", "--print-config", "--log-dir", str(log_dir)),
            *("--ft-param-rank_heartbeat_timeout=30", str(WORKER), "--print-config"),
        ],
        env={"PATH": "/usr/bin:/bin", "PET_NNODES": "1:2"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert 'script_args                       = ["--print-config"]' in proc.stdout
    assert "nnodes_max                        = 2  # PET_NNODES" in proc.stdout
    assert "ft.rank_heartbeat_timeout         = 30.0  # flag" in proc.stdout
    assert not log_dir.exists()


def test_a_usage_error_from_the_environment_is_a_usage_error() -> None:
    served = parse_serve_argv([str(WORKER)])
    with pytest.raises(UsageError, match=r"^PET_NODE_RANK: "):
        apply_scheduler(served.namespace, served.explicit, {"PET_NODE_RANK": "x"})


# -- the shipped examples ----------------------------------------------------------------------


def _serve_argv(command: list[str]) -> list[str]:
    at = command.index("serve")
    assert command[at - 1].endswith("ftd")
    return command[at + 1 :]


def test_the_slurm_example_needs_no_rendezvous_flags() -> None:
    text = (ROOT / "examples" / "slurm.sbatch").read_text()
    srun = text[text.index("\nsrun ") :].replace("\\\n", " ")
    command = shlex.split(srun.splitlines()[1])
    assert command[:2] == ["srun", "--kill-on-bad-exit=0"]
    argv = _serve_argv(command)
    assert not any(word.startswith(("--rdzv", "--nnodes", "--nproc")) for word in argv)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_NTASKS_PER_NODE": "1",
    }
    config, _ = resolve(argv, env)
    expected = ServeConfig(
        entrypoint="examples/train_ddp.py",
        script_args=("--steps", "1000", "--ckpt-dir", "runs/slurm/ckpt"),
        nnodes_min=2,
        nnodes_max=2,
        nproc_per_node=8,
        max_restarts=10,
        rdzv_endpoint="gpu07:29400",
        run_id="4242",
        log_dir=Path("runs/slurm"),
        node_rank=1,  # SLURM_NODEID: the node keeps the scheduler's rank in every round
    )
    assert config == expected
    assert config.multi_node


def _operator_env(job: dict[str, Any]) -> dict[str, str]:
    """The variables Kubeflow's training operator gives a worker pod of an elastic
    PyTorchJob (pkg/controller.v1/pytorch/elastic.go)."""
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    return env | {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "PET_RDZV_ENDPOINT": f"{job['metadata']['name']}-worker-0:{port}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]),
        "PET_RDZV_ID": policy["rdzvId"],
    }


def test_the_kubernetes_example_needs_no_rendezvous_flags() -> None:
    job = yaml.safe_load((ROOT / "examples" / "k8s" / "pytorchjob.yaml").read_text())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    argv = _serve_argv(container["command"] + container["args"])
    assert not any(word.startswith(("--rdzv", "--nnodes", "--nproc")) for word in argv)
    config, text = resolve(argv, _operator_env(job))
    expected = ServeConfig(
        entrypoint="examples/train_ddp.py",
        script_args=("--steps=1000", "--ckpt-dir=/ckpt"),
        nnodes_min=2,
        nnodes_max=4,
        nproc_per_node=8,
        max_restarts=10,
        rdzv_endpoint="ftd-ddp-worker-0:29400",
        run_id="ftd-ddp",
        log_dir=Path("/tmp/ftd-logs"),
    )
    assert config == expected
    assert "# scheduler: kubernetes" in text
