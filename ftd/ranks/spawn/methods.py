"""The start methods by name (`ftd serve --start-method`)."""

from __future__ import annotations

from collections.abc import Sequence

from ftd.ranks.spawn.base import Spawner


def get_spawner(name: str, preload: Sequence[str] = ()) -> Spawner:
    """The start method called `name`; `preload` names modules the zygote imports besides
    torch (other start methods ignore it)."""
    from ftd.ranks.spawn.pcontext import PContextSpawner
    from ftd.ranks.spawn.zygote import ZygoteSpawner

    if name == "zygote":
        return ZygoteSpawner(preload)

    spawners: dict[str, type[Spawner]] = {"subprocess": PContextSpawner}
    # torchrun's --start-method names choose how *functions* start; a script is always a
    # subprocess under torchrun, so they all map to the subprocess start method.
    for alias in ("spawn", "fork", "forkserver"):
        spawners[alias] = PContextSpawner
    try:
        return spawners[name]()
    except KeyError:
        raise ValueError(
            f"start_method: unknown {name!r}; choose from {sorted([*spawners, 'zygote'])}"
        ) from None
