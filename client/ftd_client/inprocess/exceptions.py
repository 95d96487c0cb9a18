"""Exceptions of the in-process Wrapper."""

from __future__ import annotations


class RestartInterrupt(BaseException):
    """Raised in the training function's thread when a fault elsewhere ends the round.

    A BaseException, so `except Exception:` in training code does not swallow it.
    """


class RestartError(Exception):
    """The Wrapper cannot go on in-process (iterations used up, excluded from a round, an
    abort that did not finish); the process should exit and let its launcher act."""


class HealthCheckError(RestartError):
    """The health check failed: this rank should not take part in the next round."""


class RestartAbort(BaseException):
    """Ends the Wrapper at once, without another round (NVRx's name): raised by an
    `initialize` such as RetryController when the job cannot usefully go on."""


class TimeoutError(RestartError):
    """A Wrapper step (a CUDA synchronisation, a threaded finalize) did not finish in time."""


class FaultCounterExceeded(RestartError):
    """This rank caused more faults than FaultCounter allows."""
