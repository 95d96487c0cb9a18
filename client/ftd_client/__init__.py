"""ftd_client: what runs inside a rank. Standard library only, cheap to import."""

from ftd_client.protocol import WorkloadAction
from ftd_client.rank import RankClient

__all__ = ["RankClient", "WorkloadAction"]
__version__ = "0.1.0"

_ADMIN_NAMES = ("AdminClient", "AdminError", "ApiError", "ApiUnreachable")


def __getattr__(name: str) -> object:
    """`ftd_client.AdminClient` without importing the admin module into every rank."""
    if name in _ADMIN_NAMES:
        from ftd_client import admin

        return getattr(admin, name)
    raise AttributeError(f"module 'ftd_client' has no attribute {name!r}")
