"""The step every rank of a job of several nodes restores: each rank's daemon knows only its own
ranks' snapshots, so the ranks tell each other what they hold through the attempt's store (the
TCPStore at MASTER_ADDR:MASTER_PORT that the daemon hosts and init_process_group uses) and each
takes the newest step all of them hold. Every rank computes it from the same values, so every
rank resumes at the same step; a value that is not a short list of steps counts as holding
nothing (that rank, and so the job, then starts without a snapshot). The store is as trusted as
it is for init_process_group; a rank whose own list was overwritten refuses to restore.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence

from ftd_client.checkpoint._plan import CheckpointError

MAX_STEPS = 8
WAIT_S = 600.0
"""How long a rank waits for the others' lists: they restore at the start of the script, a
rank that never does is stopped by its hang deadline before."""


def agreed_step(
    held: Sequence[int], rank: int, world: int, round_number: int, kind: str = "memory"
) -> int | None:
    """The newest step all `world` ranks hold; `kind` keeps rounds over memory and disk apart."""
    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=WAIT_S),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"ftd/checkpoint/{attempt}/{round_number}/"
    if kind != "memory":
        prefix = f"ftd/checkpoint/{attempt}/{kind}/{round_number}/"
    mine = json.dumps(sorted(held)[-MAX_STEPS:]).encode()
    store.set(prefix + str(rank), mine)
    keys = [prefix + str(r) for r in range(world)]
    store.wait(keys)
    values = store.multi_get(keys)
    if values[rank] != mine:  # another wrote this rank's list: the ranks may not agree
        raise CheckpointError(
            f"the attempt's store holds another list of rank {rank}'s snapshots than it wrote"
        )
    return newest_common([parse(value) for value in values])


def parse(value: bytes) -> set[int]:
    if len(value) > 32 * MAX_STEPS:
        return set()
    try:
        steps = json.loads(value)
    except ValueError:
        return set()
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        return set()
    return {s for s in steps if isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 2**53}


def newest_common(held: Sequence[set[int]]) -> int | None:
    common = set.intersection(*held) if held else set()
    return max(common) if common else None
