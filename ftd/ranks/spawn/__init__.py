"""Start methods for a node's ranks, behind one interface (see `base.Spawner`)."""

from ftd.ranks.spawn.base import LaunchSpec, RankHandle, Spawner, StartedGroup
from ftd.ranks.spawn.methods import get_spawner

__all__ = ["LaunchSpec", "RankHandle", "Spawner", "StartedGroup", "get_spawner"]
