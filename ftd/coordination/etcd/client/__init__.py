"""An asyncio etcd v3 client for ftd, over etcd's gRPC-JSON gateway with aiohttp (why: see
docs/architecture.md, "The etcd client"). Everything an endpoint answers is parsed into bounded,
typed records: a broken or hostile endpoint gives EtcdBadAnswer, a dead one EtcdUnavailable,
never a crash or a hang past `timeout_s`."""

from ftd.coordination.etcd.client.client import EtcdClient
from ftd.coordination.etcd.client.errors import (
    EtcdAuthError,
    EtcdBadAnswer,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    GrpcCode,
    lease_gone,
)
from ftd.coordination.etcd.client.lease import Lease, next_renewal
from ftd.coordination.etcd.client.records import (
    Compare,
    CompareTarget,
    Delete,
    DeleteResult,
    EventType,
    Get,
    KeyValue,
    Put,
    PutResult,
    RangeResult,
    TxnResult,
    WatchEvent,
    prefix_end,
)
from ftd.coordination.etcd.client.watch import Watch

__all__ = [
    "Compare",
    "CompareTarget",
    "Delete",
    "DeleteResult",
    "EtcdAuthError",
    "EtcdBadAnswer",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdUnavailable",
    "EventType",
    "Get",
    "GrpcCode",
    "KeyValue",
    "Lease",
    "Put",
    "PutResult",
    "RangeResult",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "lease_gone",
    "next_renewal",
    "prefix_end",
]
