"""Placeholder until the REST API lands: the daemon's hooks for it."""

from __future__ import annotations

from ftd.control import DaemonControl


class ApiServer:
    async def close(self) -> None:
        pass


async def start_api_server(control: DaemonControl) -> ApiServer:
    return ApiServer()
