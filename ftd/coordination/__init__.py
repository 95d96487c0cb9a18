"""How daemons of one job meet: a `Coordinator` chosen by `--rdzv-backend` (see base.py)."""

from __future__ import annotations

import os

from ftd.config.serve import ServeConfig
from ftd.coordination.base import CoordinationError, Coordinator, Report, Round
from ftd.coordination.local import LocalCoordinator
from ftd.coordination.secret import SecretError, load_secret

__all__ = ["CoordinationError", "Coordinator", "Round", "create_coordinator"]

STORE_BACKENDS = ("c10d", "static")
"""c10d: the TCPStore coordinator; `static` is torchrun's name for the same store-based
rendezvous and is accepted as an alias."""
ETCD_BACKENDS = ("etcd", "etcd-v3")
"""The etcd coordinator (etcd's v3 API, 3.5 or later)."""
BACKENDS = (*STORE_BACKENDS, *ETCD_BACKENDS)


def create_coordinator(config: ServeConfig, report: Report | None = None) -> Coordinator:
    """The coordinator for `config`: in memory for one node, else by --rdzv-backend. Takes
    FTD_RDZV_SECRET out of this process's environment (no rank inherits it). `report(kind,
    data)` records what the backend wants in the event log (etcd unavailable, restored)."""
    try:
        secret = load_secret(config.rdzv_conf, os.environ)
    except SecretError as error:
        raise CoordinationError(str(error)) from None
    if not config.multi_node:
        return LocalCoordinator(config.node_id, config.master_addr or "127.0.0.1")
    if config.rdzv_backend in STORE_BACKENDS:
        from ftd.coordination.c10d.coordinator import StoreCoordinator

        return StoreCoordinator(config, secret)
    if config.rdzv_backend in ETCD_BACKENDS:
        from ftd.coordination.etcd.coordinator import create_etcd_coordinator

        return create_etcd_coordinator(config, secret, report)
    raise CoordinationError(
        f"--rdzv-backend {config.rdzv_backend!r}: not one of {', '.join(BACKENDS)}"
    )
