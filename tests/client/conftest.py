"""Fixtures shared by the rank client's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ftd_client import progress
from ftd_client.progress import Observer


@pytest.fixture
def observer() -> Iterator[Observer]:
    """The progress observer, installed without its sampler thread (the test ticks it)."""
    observed = progress.install(lambda record: None, start=False)
    try:
        yield observed
    finally:
        progress.uninstall()
