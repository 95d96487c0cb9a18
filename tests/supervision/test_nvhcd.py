"""NVIDIA's node health check service (nvhcd) as a node check (issue 40 item 3): ftd's own
gRPC client asks a real gRPC server (grpcio, hand-encoded protobuf, no generated code) on a
unix socket, as NVRx's ft_launcher does with `--ft-node-health-check-endpoint`."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from ftd.cli.serve_args import parse_serve_argv
from ftd.config.resolve import serve_config_from_args
from ftd.supervision.nvhcd import DEFAULT_ARGS, Nvhcd
from tests.conftest import WORKER, ServeFactory


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int32 goes on the wire sign-extended to 64 bits
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes((value,))


def response(success: bool, exit_code: int = 0, output: object = "", error: str = "") -> bytes:
    """A HealthCheckResponse as protobuf bytes, `output` given as JSON where not text."""
    text = output if isinstance(output, str) else json.dumps(output)
    fields = b"".join(
        bytes((number << 3 | 2,)) + varint(len(data)) + data
        for number, data in ((3, text.encode()), (4, error.encode()))
    )
    return b"\x08" + varint(int(success)) + b"\x10" + varint(exit_code) + fields


def request_args(data: bytes) -> list[str]:
    """A HealthCheckRequest's args (field 1, strings; lengths under 128 here)."""
    args, at = [], 0
    while at < len(data):
        assert data[at] == 0x0A, data
        size = data[at + 1]
        args.append(data[at + 2 : at + 2 + size].decode())
        at += 2 + size
    return args


class StandIn:
    """nvhcd's stand-in: a grpc server whose answer the test sets (bytes, or a function of the
    call's context), recording each call's args."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.answer: bytes | Callable[[Any], bytes] = response(True, output={"fail_count": 0})
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        handler = grpc.unary_unary_rpc_method_handler(
            self._run, request_deserializer=bytes, response_serializer=bytes
        )
        self.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "nvhcd.HealthCheckService", {"RunHealthCheck": handler}
                ),
            )
        )
        self.server.add_insecure_port(f"unix:{path}")
        self.server.start()

    def _run(self, request: bytes, context: Any) -> bytes:
        self.calls.append(request_args(request))
        answer = self.answer
        return answer(context) if callable(answer) else answer

    def stop(self) -> None:
        self.release.set()
        self.server.stop(grace=None).wait(10)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for unix sockets (a socket's path is at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="nvhcd-") as directory:
        yield Path(directory)


@pytest.fixture
def stand_in(socket_dir: Path) -> Iterator[StandIn]:
    server = StandIn(str(socket_dir / "nvhcd.sock"))
    yield server
    server.stop()


async def test_fail_count_0_is_healthy_and_nvrx_s_arguments_reach_the_service(
    stand_in: StandIn,
) -> None:
    stand_in.answer = response(True, output={"fail_count": 0, "checks": ["gpu"]})
    assert await Nvhcd(stand_in.path, 10).check() is None
    assert await Nvhcd(f"unix://{stand_in.path}", 10).check() is None
    assert stand_in.calls == [list(DEFAULT_ARGS)] * 2
    assert DEFAULT_ARGS == ("--no-slurm", "--group", "prolog", "epilog", "logs", "gpu")


async def test_failed_checks_are_named(stand_in: StandIn) -> None:
    stand_in.answer = response(
        True, output={"fail_count": 2, "failed_checks": ["gpu_ecc", "nvlink"], "pass_count": 3}
    )
    reason = await Nvhcd(stand_in.path, 10).check()
    assert reason == f"nvhcd at {stand_in.path}: 2 check(s) failed: gpu_ecc, nvlink"


async def test_a_failed_script_names_its_exit_code_and_error(stand_in: StandIn) -> None:
    stand_in.answer = response(False, exit_code=-9, output="", error="killed by\x1b[2J signal")
    reason = await Nvhcd(stand_in.path, 10).check()
    said = "the health check failed (exit code -9): killed by\\x1b[2J signal"
    assert reason == f"nvhcd at {stand_in.path}: {said}"


@pytest.mark.parametrize(
    ("output", "said"),
    [
        ({"pass_count": 4}, "its output has no fail_count"),
        ("all good", "its output is not JSON (Expecting value"),
        ([0], "its output is a JSON list, not an object"),
        ({"fail_count": "0"}, '"0" check(s) failed: (none named)'),
    ],
)
async def test_an_answer_nvrx_would_not_call_healthy_is_a_reason(
    stand_in: StandIn, output: object, said: str
) -> None:
    stand_in.answer = response(True, output=output)
    reason = await Nvhcd(stand_in.path, 10).check()
    assert reason is not None and reason.startswith(f"nvhcd at {stand_in.path}: {said}"), reason


async def test_a_grpc_error_status_skips_the_check_saying_why(stand_in: StandIn) -> None:
    def abort(context: Any) -> bytes:
        context.abort(grpc.StatusCode.INTERNAL, "the script crashed")
        raise AssertionError("abort returns no answer")

    stand_in.answer = abort
    nvhcd = Nvhcd(stand_in.path, 10)
    assert await nvhcd.check() is None
    assert nvhcd.skipped == "gave no answer (no answer (grpc status unknown))"


async def test_a_service_that_never_answers_is_skipped_at_the_timeout(stand_in: StandIn) -> None:
    """NVRx's reading: a service that does not answer must not take the node out of the job."""
    stand_in.answer = lambda context: stand_in.release.wait(60) and b""
    started = time.monotonic()
    nvhcd = Nvhcd(stand_in.path, 0.5)
    assert await nvhcd.check() is None
    assert nvhcd.skipped == "gave no answer (no answer within 0.5s)"
    assert time.monotonic() - started < 10


async def test_a_missing_socket_skips_the_check_saying_so_once(
    socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for endpoint in (str(socket_dir / "absent.sock"), "localhost:50051"):
        nvhcd = Nvhcd(endpoint, 5)
        with caplog.at_level(logging.WARNING, "ftd.supervision"):
            assert await nvhcd.check() is None
            assert await nvhcd.check() is None
        [said] = [r.getMessage() for r in caplog.records if endpoint in r.getMessage()]
        assert "its check is skipped, as NVRx does" in said, said


async def test_a_socket_nobody_listens_on_is_skipped_saying_why(socket_dir: Path) -> None:
    path = str(socket_dir / "stale.sock")
    nvhcd = Nvhcd(path, 5)
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(path)  # bound, never listening: a service that died and left its socket
        assert await nvhcd.check() is None
    assert nvhcd.skipped == "gave no answer (cannot ask it: Connection refused)", nvhcd.skipped


def test_every_spelling_nvrx_accepts_sets_the_endpoint(tmp_path: Path) -> None:
    def endpoint(*flags: str) -> str | None:
        served = parse_serve_argv([*flags, str(WORKER)])
        assert served.unknown == []
        return serve_config_from_args(served.namespace).ft.node_health_check_endpoint

    assert endpoint() is None
    assert endpoint("--ft-node-health-check-endpoint", "/run/nvhcd.sock") == "/run/nvhcd.sock"
    assert endpoint("--ft-node_health_check_endpoint=unix:///a.sock") == "unix:///a.sock"
    assert endpoint("--ft-param-node_health_check_endpoint=/b.sock") == "/b.sock"
    config = tmp_path / "ft.yaml"
    config.write_text("fault_tolerance:\n  node_health_check_endpoint: ./c.sock\n")
    assert endpoint("--ft-cfg-path", str(config)) == "./c.sock"


async def test_a_node_nvhcd_finds_unhealthy_sits_out_until_it_is_healthy(
    serve: ServeFactory, stand_in: StandIn
) -> None:
    """`ftd serve --ft-node-health-check-endpoint`: the stand-in says a check failed, so the
    node sits out (an event naming the check); once it says healthy the job runs."""
    stand_in.answer = response(True, output={"fail_count": 1, "failed_checks": ["gpu_xid_79"]})
    run = await serve(
        *("--ft-node-health-check-endpoint", stand_in.path),
        *("--ft-node-health-check-interval", "0.2", "--ft-node-health-check-failures", "0"),
    )
    await run.stderr.expect(
        "node unhealthy, sitting out of the rendezvous: nvhcd at .*: 1 check.s. failed: gpu_xid_79"
    )
    stand_in.answer = response(True, output={"fail_count": 0})
    assert await run.wait() == 0, run.stderr.text[-3000:]
    [first, *_] = run.event_data("node_unhealthy")
    assert first["reason"] == f"nvhcd at {stand_in.path}: 1 check(s) failed: gpu_xid_79", first
    assert len(run.event_data("node_healthy")) == 1
    assert stand_in.calls[0] == list(DEFAULT_ARGS)
