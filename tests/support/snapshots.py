"""What the memory tier's tests compare: a training's final state, tensor by tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{path}/{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{path}/{i}").items()}
    return {path: value}


def assert_identical(expected: Path, got: Path) -> None:
    import torch  # here, not at collection: each test worker would import it (~3 CPU-s)

    a = flat(torch.load(expected, weights_only=False))
    b = flat(torch.load(got, weights_only=False))
    assert a.keys() == b.keys()
    differ = [
        key
        for key in a
        if not (
            torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        )
    ]
    assert not differ, f"{got} differs from {expected} in {differ}"
