"""What the daemon's own process must be for its ranks: their subreaper (orphans come back to
it, to be swept), with descriptors to spare."""

from __future__ import annotations

import ctypes
import logging
import os
import resource

from ftd.ranks.spawn.zygote_server import NOFILE_ENV

log = logging.getLogger("ftd.daemon")

PR_SET_CHILD_SUBREAPER = 36


def raise_descriptor_limit() -> None:
    """A flood of connections must not leave the daemon without descriptors for its ranks:
    its own soft limit goes up to the hard one (its zygote puts the ranks' back)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    os.environ.setdefault(NOFILE_ENV, str(soft))
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            log.warning("could not raise the descriptor limit to %d: %s", hard, error)


def become_subreaper() -> None:
    """Orphaned descendants of ranks are re-parented to the daemon, so it can sweep them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_CHILD_SUBREAPER) failed: errno %d", ctypes.get_errno())
