"""Every refusal of outside input lands in one metric, `ftd_input_refused_total{source,cause}`.

Each decoder of outside input (the rank socket, NVRx's sockets, a rank's error file, the state
file, rendezvous and in-process records, etcd's answers, nvhcd's answers) keeps its refusals
in a `Refusals` counter of its source; whatever increments it also counts in the metric, so no
decoder can refuse without the operator seeing it. Causes are ftd's own short words, never the
input's.
"""

from __future__ import annotations

import collections
from typing import Final

from prometheus_client import Counter

INPUT_REFUSED: Final = Counter(
    "ftd_input_refused",
    "Outside input refused by its decoder or a budget, by source and cause",
    ["source", "cause"],
    registry=None,
)

SOURCES: Final = (
    "rank_socket",
    "nvrx_socket",
    "error_file",
    "state_file",
    "rendezvous_store",
    "inprocess_store",
    "etcd",
    "tcp_store",
    "replica",
    "nvhcd",
)
MAX_CAUSE_LENGTH: Final = 48


class Refusals(collections.Counter[str]):
    """A Counter of one source's refusals by cause that also counts into INPUT_REFUSED."""

    def __init__(self, source: str, prefixed: dict[str, str] | None = None) -> None:
        assert source in SOURCES, source
        super().__init__()
        self.source = source
        self._prefixed = prefixed or {}
        """Causes with one of these prefixes count for another source (NVRx's sockets share
        the rank socket's counter, with `nvrx_` causes, in /v1/status)."""

    def __setitem__(self, cause: str, count: int) -> None:
        grown = count - self.get(cause, 0)
        super().__setitem__(cause, count)
        if grown > 0:
            source = next(
                (other for prefix, other in self._prefixed.items() if cause.startswith(prefix)),
                self.source,
            )
            INPUT_REFUSED.labels(source, cause[:MAX_CAUSE_LENGTH]).inc(grown)

    def __reduce__(self) -> tuple[object, ...]:  # a copy is a plain Counter
        return (collections.Counter, (dict(self),))


def refused(source: str, cause: str) -> None:
    """Count one refusal of a source that keeps no counter of its own."""
    INPUT_REFUSED.labels(source, cause[:MAX_CAUSE_LENGTH]).inc()
