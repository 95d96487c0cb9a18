"""HTTP to etcd's gRPC-JSON gateway: endpoints, failover, auth tokens, bounded reads.

A call tries the member that answered last, then the others, in rounds until its deadline. A
read may be tried anywhere; a change is tried on another member only when it surely was not
applied (the connection was refused, or etcd said it has no leader), as etcd's own client does:
otherwise the caller learns that it may have been applied."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import pydantic
import yarl

from ftd.coordination.etcd.client.errors import (
    AttemptFailed,
    EtcdAuthError,
    EtcdBadAnswer,
    EtcdError,
    EtcdUnavailable,
    TokenExpired,
    clip,
    describe,
    refusal,
)
from ftd.coordination.etcd.client.wire import (
    Answer,
    AuthenticateResponse,
    ErrorBody,
    StreamError,
    StreamRefusal,
)
from ftd.refusals import refused

log = logging.getLogger("ftd.etcd")
T = TypeVar("T")

MIN_ATTEMPT_S = 0.25
RETRY_PAUSE_S = (0.05, 0.5)


def parse_endpoints(raw: Sequence[str], *, tls: bool) -> tuple[str, ...]:
    """`host:port` or `http(s)://host:port` → normalized base URLs; a bare `host:port` takes
    https when TLS files are given. Anything else (a path, credentials, a query) is refused."""
    if isinstance(raw, str) or not raw:
        raise ValueError("etcd endpoints: give a non-empty list of host:port or URLs")
    parsed = []
    for text in raw:
        url = yarl.URL(text if "://" in text else f"{'https' if tls else 'http'}://{text}")
        if (
            url.scheme not in ("http", "https")
            or not url.host
            or url.explicit_port is None
            or url.path not in ("", "/")
            or url.user
            or url.query_string
            or url.fragment
        ):
            raise ValueError(f"etcd endpoint {text!r}: expected host:port or http(s)://host:port")
        parsed.append(f"{url.scheme}://{url.host_port_subcomponent}")
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"etcd endpoints: {list(raw)} names one member twice")
    return tuple(parsed)


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str


class Stream:
    """A streaming answer (watch, keepalive) read one JSON line at a time, each bounded."""

    def __init__(self, endpoint: str, response: aiohttp.ClientResponse, max_line: int) -> None:
        self.endpoint = endpoint
        self._response = response
        self._max_line = max_line
        self._buffer = bytearray()

    async def line(self) -> bytes:
        """The next line; AttemptFailed at the end of the stream or when the connection breaks."""
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > self._max_line:
                raise AttemptFailed("a line over the size limit", sent=True, bad_answer=True)
            try:
                chunk = await self._response.content.readany()
            except aiohttp.ClientError as error:
                raise AttemptFailed(f"stream broken: {describe(error)}", sent=True) from None
            if not chunk:
                raise AttemptFailed("the member closed the stream", sent=True)
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line

    def close(self) -> None:
        self._response.close()


class Transport:
    """The endpoints, the one HTTP session and the auth token: every call goes through here."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        session: aiohttp.ClientSession,
        *,
        timeout_s: float,
        credentials: Credentials | None,
        max_response_bytes: int,
        on_endpoint_failed: Callable[[str, str], None] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self._session = session
        self._credentials = credentials
        self._token: str | None = None
        self._auth_lock = asyncio.Lock()
        self._pinned = 0
        self.on_endpoint_failed = on_endpoint_failed
        """Told (endpoint, reason) when a member did not answer; see `probe`."""

    async def call(
        self, path: str, body: Mapping[str, object], answer: type[Answer], *, mutation: bool
    ) -> Answer:
        """POST one request and parse its answer, failing over as the module says."""
        payload = json.dumps(body).encode()

        async def attempt(endpoint: str, budget_s: float) -> Answer:
            raw = await self._unary(endpoint, path, payload, budget_s)
            return parse(answer, raw)

        return await self.failover(attempt, mutation=mutation)

    async def open_stream(
        self, endpoint: str, path: str, body: Mapping[str, object], budget_s: float
    ) -> Stream:
        """Start a streaming call; the caller reads its lines and closes it."""
        payload = json.dumps(body).encode()
        response, raw = await self._exchange(endpoint, path, payload, budget_s, stream=True)
        if raw is None:
            return Stream(endpoint, response, self.max_response_bytes)
        raise self._refusal_of(endpoint, response.status, raw)

    def stream_error(self, endpoint: str, error: StreamError) -> Exception:
        return refusal(endpoint, error.grpc_code, error.message)

    def demote(self, endpoint: str, reason: str) -> None:
        """`endpoint` failed outside a call (a broken stream): start the next call elsewhere."""
        if self.endpoints[self._pinned] == endpoint:
            self._pinned = (self._pinned + 1) % len(self.endpoints)
        self._failed(endpoint, reason)

    def _failed(self, endpoint: str, reason: str) -> None:
        if self.on_endpoint_failed is not None:
            self.on_endpoint_failed(endpoint, reason)

    async def probe(self, endpoint: str, budget_s: float) -> str | None:
        """Ask this one member a local (serializable) read: None when it answered (a refusal,
        of permission say, is an answer too), else why not. For health checks of a member
        that failed; it needs no leader."""
        body = {"key": "AA==", "serializable": True, "count_only": True}
        payload = json.dumps(body).encode()

        async def attempt(member: str, budget: float) -> bytes:
            return await self._unary(member, "/v3/kv/range", payload, budget)

        try:
            await self._authorized(attempt, endpoint, budget_s)
        except AttemptFailed as failure:
            return failure.reason
        except (EtcdError, TokenExpired):
            pass
        return None

    async def failover(
        self,
        attempt: Callable[[str, float], Awaitable[T]],
        *,
        mutation: bool,
        timeout_s: float | None = None,
    ) -> T:
        """Run `attempt(endpoint, budget_s)` on members until one answers or the call's
        timeout (the client's, or a shorter `timeout_s`) passes; EtcdUnavailable (or
        EtcdBadAnswer) says what each member did."""
        limit_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        deadline = time.monotonic() + limit_s
        reasons: dict[str, str] = {}  # the last failure of each endpoint tried
        bad: set[str] = set()  # the endpoints whose last answer was not etcd's
        pause_s = RETRY_PAUSE_S[0]
        count = len(self.endpoints)
        while True:
            first = self._pinned
            for step in range(count):
                index = (first + step) % count
                endpoint = self.endpoints[index]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                untried = count - step
                budget = remaining if untried == 1 else max(remaining / untried, MIN_ATTEMPT_S)
                try:
                    result = await self._authorized(attempt, endpoint, min(budget, remaining))
                except AttemptFailed as failure:
                    reasons[endpoint] = failure.reason
                    self._failed(endpoint, failure.reason)
                    if failure.bad_answer:
                        bad.add(endpoint)
                    else:
                        bad.discard(endpoint)
                    if mutation and (failure.sent or failure.bad_answer):
                        raise self._gave_up(reasons, bad, limit_s, maybe_applied=True) from None
                    continue
                if index != self._pinned:
                    log.info("etcd: now talking to %s", endpoint)
                    self._pinned = index
                return result
            # Garbage from every member will not turn into an answer by asking again.
            if len(bad) == count or time.monotonic() + pause_s >= deadline:
                raise self._gave_up(reasons, bad, limit_s, maybe_applied=False)
            await asyncio.sleep(pause_s)
            pause_s = min(pause_s * 2, RETRY_PAUSE_S[1])

    def _gave_up(
        self, reasons: dict[str, str], bad: set[str], limit_s: float, *, maybe_applied: bool
    ) -> EtcdError:
        if bad:
            listed = "; ".join(f"{ep}: {why}" for ep, why in reasons.items())
            return EtcdBadAnswer(f"no etcd member gave a valid answer ({listed})")
        what = "the change may have been applied" if maybe_applied else "nothing was applied"
        return EtcdUnavailable(
            f"no etcd member answered within {limit_s:.3g} s; {what}",
            endpoints=list(reasons),
            reasons=list(reasons.values()),
            maybe_applied=maybe_applied,
        )

    async def _authorized(
        self, attempt: Callable[[str, float], Awaitable[T]], endpoint: str, budget_s: float
    ) -> T:
        """`attempt` with a token when credentials are set; an expired token is renewed once."""
        deadline = time.monotonic() + budget_s
        renewed = False
        while True:
            if self._credentials is not None and self._token is None:
                await self._authenticate(endpoint, deadline - time.monotonic())
            token = self._token
            try:
                return await attempt(endpoint, deadline - time.monotonic())
            except TokenExpired as expired:
                if renewed or self._credentials is None:
                    raise EtcdAuthError(f"etcd: {expired}", endpoint=endpoint) from None
                renewed = True
                async with self._auth_lock:
                    if self._token == token:
                        self._token = None

    async def _authenticate(self, endpoint: str, budget_s: float) -> None:
        assert self._credentials is not None
        async with self._auth_lock:
            if self._token is not None:
                return
            body = {"name": self._credentials.username, "password": self._credentials.password}
            payload = json.dumps(body).encode()
            try:
                raw = await self._unary(endpoint, "/v3/auth/authenticate", payload, budget_s, False)
            except EtcdError as error:
                if "authentication is not enabled" not in error.message:
                    raise
                self._token = ""  # as etcd's own client does: go on without a token
                return
            self._token = parse(AuthenticateResponse, raw).token

    async def _unary(
        self, endpoint: str, path: str, payload: bytes, budget_s: float, auth: bool = True
    ) -> bytes:
        """The body of a 200 answer; any other status raises what etcd's error means."""
        response, raw = await self._exchange(endpoint, path, payload, budget_s, auth=auth)
        assert raw is not None
        if response.status != 200:
            raise self._refusal_of(endpoint, response.status, raw)
        return raw

    async def _exchange(
        self,
        endpoint: str,
        path: str,
        payload: bytes,
        budget_s: float,
        *,
        stream: bool = False,
        auth: bool = True,
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """POST and the answer's body, read and closed (None: a stream's 200, left open for
        its caller), under one deadline: the POST and the read have none of their own (a timer
        each was 6 % of a loaded client's CPU at 1,024 nodes)."""
        try:
            async with asyncio.timeout(budget_s):
                response = await self._post(endpoint, path, payload, budget_s, stream, auth)
                if stream and response.status == 200:
                    return response, None
                try:
                    return response, await self._read(response)
                finally:
                    response.close()
        except TimeoutError:
            raise AttemptFailed(f"no answer within {budget_s:.2f} s", sent=True) from None

    async def _post(
        self, endpoint: str, path: str, payload: bytes, budget_s: float, stream: bool, auth: bool
    ) -> aiohttp.ClientResponse:
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if stream:
            # A watch on a member that lost its leader is cancelled instead of going quiet.
            headers["Grpc-Metadata-hasleader"] = "true"
        if auth and self._token:
            headers["Authorization"] = self._token
        connect_s = max(budget_s / 2, 0.001)
        try:
            response = await self._session.post(
                endpoint + path,
                data=payload,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_s),
                allow_redirects=False,  # a redirect would re-send the body (a password)
            )
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as error:
            raise AttemptFailed(describe(error), sent=False) from None
        except TimeoutError:  # aiohttp's own: the caller's deadline is its asyncio.timeout
            raise AttemptFailed(f"no answer within {budget_s:.2f} s", sent=True) from None
        except aiohttp.ClientError as error:
            raise AttemptFailed(describe(error), sent=True) from None
        if 300 <= response.status < 400:
            response.close()
            reason = f"a redirect (HTTP {response.status}), not followed"
            raise AttemptFailed(reason, sent=True, bad_answer=True)
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", ""):
            response.close()
            raise AttemptFailed(f"a {clip(encoding)} answer", sent=True, bad_answer=True)
        return response

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The answer's body, bounded; within the caller's deadline."""
        limit = self.max_response_bytes
        if response.content_length is not None and response.content_length > limit:
            raise AttemptFailed(f"an answer over {limit} bytes", sent=True, bad_answer=True)
        chunks = bytearray()
        try:
            while chunk := await response.content.readany():
                chunks += chunk
                if len(chunks) > limit:
                    raise AttemptFailed(f"an answer over {limit} bytes", sent=True, bad_answer=True)
        except aiohttp.ClientError as error:
            raise AttemptFailed(f"answer cut: {describe(error)}", sent=True) from None
        return bytes(chunks)

    def _refusal_of(self, endpoint: str, status: int, raw: bytes) -> Exception:
        """What an answer other than 200 means: etcd's error, in the shape of a unary call's
        or of a stream's."""
        try:
            error = ErrorBody.model_validate_json(raw)
            return refusal(endpoint, error.code, error.message or error.error)
        except pydantic.ValidationError:
            pass
        try:
            streamed = StreamRefusal.model_validate_json(raw).error
            return refusal(endpoint, streamed.grpc_code, streamed.message)
        except pydantic.ValidationError:
            pass
        if raw.startswith(b"CommonName of client sending a request against gateway"):
            return EtcdAuthError(
                "etcd's gateway refuses client certificates with a CommonName while auth is on "
                "(its fix for CVE-2018-16886): use a client certificate without a CN, or "
                "username and password alone",
                endpoint=endpoint,
            )
        text = clip(raw[:200].decode(errors="replace"))
        reason = f"HTTP {status}, not etcd's error: {text!r}"
        return AttemptFailed(reason, sent=True, bad_answer=True)


def parse(answer: type[Answer], raw: bytes | str) -> Answer:
    try:
        return answer.model_validate_json(raw)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the answer"
        reason = f"not etcd's {answer.__name__}: {where}: {clip(first['msg'], 120)}"
        refused("etcd", f"not_{answer.__name__}")
        raise AttemptFailed(reason, sent=True, bad_answer=True) from None
