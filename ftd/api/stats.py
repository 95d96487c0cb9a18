"""The API's own bounds as Prometheus metrics, read at scrape time from their owners (the
connection guards and the stream hub)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ftd.api.connections import ConnectionGuard
from ftd.api.sse import StreamHub


class ApiCollector(Collector):
    def __init__(self, guards: list[ConnectionGuard], hub: StreamHub) -> None:
        self._guards = guards
        self._hub = hub

    def collect(self) -> Iterable[Metric]:
        open_ = GaugeMetricFamily(
            "ftd_api_connections", "Open API connections, by site (tcp, unix)", labels=["site"]
        )
        closed = CounterMetricFamily(
            "ftd_api_connections_closed",
            "Connections the API closed to protect itself: cap (refused at accept), peer "
            "(admin socket caller of another user), header_timeout, idle_timeout",
            labels=["site", "reason"],
        )
        for guard in self._guards:
            open_.add_metric([guard.site], guard.open)
            for reason in ("cap", "peer", "header_timeout", "idle_timeout"):
                closed.add_metric([guard.site, reason], guard.closed[reason])
        yield open_
        yield closed
        yield GaugeMetricFamily(
            "ftd_api_event_streams", "Open event streams (GET /v1/events)", value=self._hub.open
        )
        yield CounterMetricFamily(
            "ftd_api_event_streams_refused",
            "Event streams refused with 429 (too many open)",
            value=self._hub.refused,
        )
        dropped = CounterMetricFamily(
            "ftd_api_event_streams_dropped",
            "Event streams ended because the reader fell behind (lagged) or stopped reading "
            "(stalled)",
            labels=["reason"],
        )
        for reason in ("lagged", "stalled"):
            dropped.add_metric([reason], self._hub.dropped[reason])
        yield dropped
