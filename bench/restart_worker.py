"""A rank for bench/restart_latency.py: timestamps its start-up phases, attempt 0 crashes once.

Writes `<out>/a<attempt>_r<rank>.json` with wall-clock (`time.time()`) timestamps:

- `forked`: when the kernel created this process (from /proc/self/stat, 10 ms resolution);
- `t0`: the first statement of this script (the interpreter has started);
- `torch_imported`, `pg_up` (`init_process_group("gloo")` returned), `allreduce` (the first
  allreduce returned).

On attempt 0, rank `--fail-rank` waits until every rank is past its first allreduce (a
barrier), writes `<out>/death.json` and exits 1 at once (`os._exit`); the other ranks sleep
until their launcher stops them. On a later attempt every rank exits 0 after its allreduce.
"""

import time

T0 = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

BOOT_CLOCK_NOW = time.clock_gettime(time.CLOCK_BOOTTIME)
WALL_NOW = time.time()


def forked_at() -> float:
    """Wall-clock time the kernel started this process (start_boottime, clock ticks)."""
    with open("/proc/self/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    start_ticks = int(fields[19])  # field 22 of proc(5), counted after "pid (comm)"
    age_s = BOOT_CLOCK_NOW - start_ticks / os.sysconf("SC_CLK_TCK")
    return WALL_NOW - age_s


def write_json(path: str, payload: dict[str, object]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def main() -> None:
    out = sys.argv[sys.argv.index("--out") + 1]
    fail_rank = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    marks: dict[str, object] = {"pid": os.getpid(), "forked": forked_at(), "t0": T0}
    if attempt == 0 and rank == fail_rank:  # seconds before it dies: the bench watches its pidfd
        write_json(os.path.join(out, "doomed.json"), {"pid": os.getpid()})

    import torch
    import torch.distributed as dist

    marks["torch_imported"] = time.time()
    client = None
    if os.environ.get("FTD_SOCKET"):  # connected before the clock matters, as a trainer's is
        from ftd_client import RankClient

        client = RankClient()
    dist.init_process_group("gloo")
    marks["pg_up"] = time.time()
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    marks["allreduce"] = time.time()
    assert int(tensor.item()) == dist.get_world_size()
    if client is not None:  # under ftd: the restart's init stage ends here
        client.resumed()
        marks["resumed"] = time.time()
    write_json(os.path.join(out, f"a{attempt}_r{rank}.json"), marks)

    dist.barrier()  # every rank is past its first allreduce
    if attempt == 0:
        if rank == fail_rank:
            write_json(os.path.join(out, "death.json"), {"pid": os.getpid(), "time": time.time()})
            os._exit(1)
        time.sleep(600)  # busy "training" until the launcher stops this attempt
        os._exit(2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
