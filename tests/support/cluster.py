"""Several `ftd serve` daemons of one job on 127.0.0.1 (a Cluster), what the multi-node tests
read of each node, and an attacker on the job's TCPStore."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp

from tests.conftest import C10D, Backend, Serve, ServeFactory

# Every node of a Cluster signs its records with this secret unless a test says otherwise: the
# ordinary multi-node behaviours are tested as they are deployed.
JOB_SECRET = "the-cluster-secret-" + "fedcba9876543210" * 2


class Cluster:
    """Daemons of one job: node ids, one endpoint, fast timeouts, one job secret (`env` replaces
    the secret's variable; `secret=None` runs the store open)."""

    def __init__(
        self,
        serve: ServeFactory,
        nnodes: str,
        *flags: str,
        job: str = "job",
        last_call: float = 3,
        backend: Backend = C10D,
        env: dict[str, str] | None = None,
        secret: str | None = JOB_SECRET,
        script: Path | None = None,
    ) -> None:
        self.serve, self.job, self.backend = serve, job, backend
        self.script = {"script": script} if script is not None else {}
        self.env = env if env is not None else {"FTD_RDZV_SECRET": secret} if secret else None
        self.endpoint = backend.endpoint()
        self.flags = (
            *("--nnodes", nnodes, "--rdzv-backend", backend.name),
            *("--rdzv-endpoint", self.endpoint, "--local-addr", "127.0.0.1"),
            *("--node-keepalive-timeout", "2", "--rdzv-last-call-timeout", str(last_call)),
            *("--shutdown-timeout", "2"),
            *flags,
        )

    async def node(self, node_id: str, *args: str, flags: tuple[str, ...] = ()) -> Serve:
        return await self.serve(
            "--node-id", node_id, *self.flags, *flags, run_id=self.job, script_args=args,
            env=self.env, **self.script,
        )  # fmt: skip

    async def first(self, node_id: str, *args: str) -> Serve:
        """The first node, once it is in the rendezvous (so that it is node rank 0)."""
        run = await self.node(node_id, *args)
        await run.stderr.expect(self.backend.in_rendezvous)
        return run


def run_dir(run: Serve, node: str) -> Path:
    return run.log_dir / node / run.run_id


def ranks_of(run: Serve, node: str) -> list[int]:
    status = json.loads((run_dir(run, node) / "status.json").read_text())
    return [rank["pid"] for rank in status["ranks"]]


async def api(run: Serve, node: str, method: str, path: str) -> tuple[int, dict[str, object]]:
    info = json.loads((run_dir(run, node) / "api.json").read_text())
    token = Path(info["token_file"]).read_text().strip()
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            method, info["url"] + path, headers={"Authorization": f"Bearer {token}"}
        ) as response,
    ):
        body: dict[str, object] = await response.json(content_type=None)
        return response.status, body


async def ready_together(a: Serve, b: Serve) -> int:
    """The round in which a's rank 0 and b's rank 1 are both up: round 0, unless a machine so
    busy that b's daemon started after a's round 0 closed alone made it round 1 (b's scale-up)."""
    try:
        match = await b.stdout.expect(r"ready a(\d+) r1")
        await a.stdout.expect(rf"ready a{match.group(1)} r0")
    except TimeoutError:
        tails = f"a:\n{a.stderr.text[-3000:]}\nb:\n{b.stderr.text[-3000:]}"
        raise AssertionError(f"a's and b's ranks were not up together:\n{tails}") from None
    return int(match.group(1))


async def two_nodes_in_a_round(serve: ServeFactory, backend: Backend) -> tuple[Serve, Serve, int]:
    """Nodes a (node rank 0; the store's host under c10d) and b of a 1:2 job, their ranks up
    and hanging together in round n (returned); a left alone later finishes."""
    cluster = Cluster(serve, "1:2", backend=backend)
    a = await cluster.first("a", "--hang-while-paired")
    b = await cluster.node("b", "--hang-while-paired")
    return a, b, await ready_together(a, b)


class Attacker:
    """A raw TCPStore client under the job's key prefix: what anyone on the network has."""

    def __init__(self, endpoint: str, job: str) -> None:
        from ftd_client.store import tcp_store_client
        from torch.distributed import PrefixStore

        host, _, port = endpoint.rpartition(":")
        self.raw = tcp_store_client(host, int(port), 10)
        self.store = PrefixStore(f"ftd/{job}/", self.raw)

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(key))
