"""ftd_client: what runs inside a rank. Standard library only, cheap to import."""

from ftd_client.protocol import WorkloadAction
from ftd_client.rank import RankClient

__all__ = ["RankClient", "WorkloadAction"]
__version__ = "0.1.0"
