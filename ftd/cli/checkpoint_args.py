"""`ftd serve`'s arguments of the memory tier for training state (ftd_client.checkpoint) and of
its copies on disk. Standard library only (the CLI's `--help` must not import pydantic)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ftd.cli.formatting import memory_size

MAX_EVERY = 2**20  # ServeConfig.checkpoint_every's largest (ftd_client/checkpoint/_spacing.py)
DEFAULT_PERSIST_EVERY = 100  # ServeConfig.checkpoint_persist_every's default


def add_checkpoint(add: Callable[..., Any], flag: Callable[..., list[str]]) -> None:
    """The flags, added with `add` (an argument group's add_argument), spelled by `flag`."""
    add(
        *flag("--checkpoint-memory"),
        type=memory_size,
        default="auto",
        metavar="SIZE",
        help="memory the node holds for ftd_client.checkpoint's snapshots (and for the replicas "
        "of its peers' in a job of several nodes), e.g. 8G, 512M; "
        "auto: half of /dev/shm's free space at start; 0: none (default: auto)",
    )
    add(
        *flag("--checkpoint-every"),
        type=_every,
        default=1,
        metavar="N|auto",
        help="which saves take a snapshot: those of the steps divisible by N; auto: as many as "
        "pay off, every k steps with k from what a snapshot costs the training and how often the "
        "job fails (Young/Daly's interval, a power of two; docs/checkpoint.md) (default: 1, "
        "every step's)",
    )
    add(
        *flag("--checkpoint-persist"),
        default=None,
        metavar="DIR",
        help="every --checkpoint-persist-every-th snapshot is also written to DIR by its rank, "
        "in the background, as torch.distributed.checkpoint files (DIR/w<world>/step_<N>/"
        "rank_<r>, the newest 3 steps kept); a job that finds no snapshot in memory nor on a "
        "peer resumes from there (default: none)",
    )
    add(
        *flag("--checkpoint-persist-every"),
        type=_positive,
        default=None,
        metavar="N",
        help=f"the steps written to --checkpoint-persist: those divisible by N "
        f"(default: {DEFAULT_PERSIST_EVERY})",
    )


def _every(text: str) -> int | str:
    if text == "auto":
        return text
    value = _positive(text)
    if value > MAX_EVERY:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is more than {MAX_EVERY} steps")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 2**53:
        raise argparse.ArgumentTypeError(f"{text!r:.40} is not a whole number of steps >= 1")
    return value
