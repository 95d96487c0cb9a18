"""etcd's gRPC-JSON gateway on the wire: request bodies out, answers parsed into bounded pydantic
models, then into the client's records. Nothing here trusts the endpoint: int64s arrive as
decimal strings, bytes as base64, zero values are left out; anything else fails validation and
the caller turns that into EtcdBadAnswer."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator

from ftd.coordination.etcd.client.errors import EtcdBadAnswer
from ftd.coordination.etcd.client.records import (
    MAX_INT64,
    Compare,
    Delete,
    DeleteResult,
    EventType,
    Get,
    KeyValue,
    OpResult,
    Put,
    PutResult,
    RangeResult,
    TxnOp,
    WatchEvent,
    as_key,
    prefix_end,
)

_DECIMAL = re.compile(r"-?[0-9]{1,20}")
MAX_TEXT = 65_536


def _integer(raw: object) -> object:
    if isinstance(raw, bool):
        raise ValueError("a boolean is not an integer")
    if isinstance(raw, str):
        if not _DECIMAL.fullmatch(raw):
            raise ValueError("not a decimal integer")
        return int(raw)
    return raw


def _base64(raw: object) -> bytes:
    if not isinstance(raw, str):
        raise ValueError("bytes arrive as a base64 string")
    # strict_mode: what b64decode(validate=True) refuses, without its copy and regex per value
    return binascii.a2b_base64(raw, strict_mode=True)


Int64 = Annotated[int, BeforeValidator(_integer), Strict(), Field(ge=0, le=MAX_INT64)]
SignedInt64 = Annotated[int, BeforeValidator(_integer), Strict(), Field(ge=-MAX_INT64 - 1)]
Uint64 = Annotated[int, BeforeValidator(_integer), Strict(), Field(ge=0, le=2**64 - 1)]
Flag = Annotated[bool, Strict()]
Bytes = Annotated[bytes, BeforeValidator(_base64)]
Text = Annotated[str, Strict(), Field(max_length=MAX_TEXT)]


class Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Header(Wire):
    revision: Int64 = 0
    member_id: Uint64 = 0
    raft_term: Uint64 = 0


class WireKeyValue(Wire):
    key: Bytes = b""
    value: Bytes = b""
    create_revision: Int64 = 0
    mod_revision: Int64 = 0
    version: Int64 = 0
    lease: Int64 = 0


class Reply(Wire):
    """A whole answer: etcd puts a header on every one, and revisions start at 1."""

    header: Header

    @model_validator(mode="after")
    def has_revision(self) -> Reply:
        if self.header.revision < 1:
            raise ValueError("an etcd answer's header has a revision")
        return self


class RangeBody(Wire):
    kvs: list[WireKeyValue] = []
    count: Int64 = 0


class DeleteRangeBody(Wire):
    deleted: Int64 = 0


class RangeResponse(RangeBody, Reply):
    pass


class PutResponse(Reply):
    pass


class DeleteRangeResponse(DeleteRangeBody, Reply):
    pass


class ResponseOp(Wire):
    """One result inside a transaction's answer (its header, if any, is not needed)."""

    response_range: RangeBody | None = None
    response_put: Wire | None = None
    response_delete_range: DeleteRangeBody | None = None

    @model_validator(mode="after")
    def one_kind(self) -> ResponseOp:
        kinds = (self.response_range, self.response_put, self.response_delete_range)
        if sum(kind is not None for kind in kinds) != 1:
            raise ValueError("a transaction response holds exactly one known response")
        return self


class TxnResponse(Reply):
    succeeded: Flag = False
    responses: list[ResponseOp] = []


class LeaseGrantResponse(Reply):
    ID: Int64 = Field(ge=1)
    TTL: SignedInt64 = 0
    error: Text = ""


class LeaseKeepAliveResult(Reply):
    ID: Int64 = 0
    TTL: SignedInt64 = 0


class LeaseRevokeResponse(Reply):
    pass


class AuthenticateResponse(Reply):
    token: Annotated[str, Strict(), Field(min_length=1, max_length=4096, pattern=r"^[!-~]+$")]


class ErrorBody(Wire):
    """A unary call's error (any HTTP status but 200)."""

    code: Annotated[int, Strict(), Field(ge=0, le=1000)]
    message: Text = ""
    error: Text = ""


class StreamError(Wire):
    """An error inside a streaming answer (watch, keepalive)."""

    grpc_code: Annotated[int, Strict(), Field(ge=0, le=1000)] = 0
    message: Text = ""


class StreamRefusal(Wire):
    """A streaming call refused before it started (an HTTP status but 200)."""

    error: StreamError


class WireEvent(Wire):
    type: Literal["PUT", "DELETE"] = "PUT"
    kv: WireKeyValue
    prev_kv: WireKeyValue | None = None


class WatchResult(Wire):
    header: Header  # without a revision in a cancellation
    created: Flag = False
    canceled: Flag = False
    compact_revision: Int64 = 0
    cancel_reason: Text = ""
    events: list[WireEvent] = []


class KeepAliveLine(Wire):
    result: LeaseKeepAliveResult | None = None
    error: StreamError | None = None


class WatchLine(Wire):
    result: WatchResult | None = None
    error: StreamError | None = None


Answer = TypeVar("Answer", bound=Wire)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


class Namespace:
    """Puts keys under the client's prefix on the way out and takes it off on the way in."""

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix

    def key(self, key: bytes | str) -> bytes:
        return self.prefix + as_key(key)

    def range(self, key: bytes | str, prefix: bool, limit: int = 0) -> dict[str, str]:
        """The request fields selecting one key, or every key starting with it (the first
        `limit` of them, where it is not 0)."""
        full = self.key(key)
        if not prefix:
            return {"key": b64(full)}
        # etcd refuses an empty key; "\0" to "\0" is its spelling of "every key".
        fields = {"key": b64(full or b"\0"), "range_end": b64(prefix_end(full))}
        if limit:
            fields["limit"] = str(limit)
        return fields

    def put(self, key: bytes | str, value: bytes, lease: int | None) -> dict[str, str]:
        fields = {"key": b64(self.key(key)), "value": b64(value)}
        if lease:
            fields["lease"] = str(lease)
        return fields

    def record(self, kv: WireKeyValue) -> KeyValue:
        if not kv.key.startswith(self.prefix):
            raise EtcdBadAnswer(f"etcd answered a key outside the prefix {self.prefix!r}")
        return KeyValue(
            key=kv.key[len(self.prefix) :],
            value=kv.value,
            create_revision=kv.create_revision,
            mod_revision=kv.mod_revision,
            version=kv.version,
            lease=kv.lease,
        )

    def range_result(self, answer: RangeBody, revision: int) -> RangeResult:
        kvs = tuple(self.record(kv) for kv in answer.kvs)
        return RangeResult(kvs, max(answer.count, len(kvs)), revision)

    def event(self, event: WireEvent) -> WatchEvent:
        prev = None if event.prev_kv is None else self.record(event.prev_kv)
        return WatchEvent(EventType(event.type), self.record(event.kv), prev)

    def compare(self, compare: Compare) -> dict[str, object]:
        results = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}
        fields = {
            "VALUE": "value",
            "VERSION": "version",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
        }
        operand = compare.operand
        return {
            "key": b64(self.prefix + compare.key),
            "target": compare.target.value,
            "result": results[compare.op],
            fields[compare.target.value]: (
                b64(operand) if isinstance(operand, bytes) else str(operand)
            ),
        }

    def op(self, op: TxnOp) -> dict[str, object]:
        match op:
            case Put(key, value, lease):
                return {"request_put": self.put(key, value, lease)}
            case Get(key, prefix, limit):
                return {"request_range": self.range(key, prefix, limit)}
            case Delete(key, prefix):
                return {"request_delete_range": self.range(key, prefix)}

    def op_result(self, op: TxnOp, answer: ResponseOp, revision: int) -> OpResult:
        """The result of `op`; the answer must be of the op's kind (a mismatch is a bad answer:
        an endpoint answering for another request)."""
        if isinstance(op, Get) and answer.response_range is not None:
            return self.range_result(answer.response_range, revision)
        if isinstance(op, Put) and answer.response_put is not None:
            return PutResult(revision)
        if isinstance(op, Delete) and answer.response_delete_range is not None:
            return DeleteResult(answer.response_delete_range.deleted, revision)
        raise EtcdBadAnswer(f"a transaction answered another kind of result for {op!r}")
