"""NVRx's module name for the Wrapper's exceptions (`nvidia_resiliency_ext.inprocess.exception`),
so that `inprocess.exception.RestartError` keeps working after the import swap: the very classes
of exceptions.py, not copies (an `except` on either name catches both)."""

from ftd_client.inprocess.exceptions import (
    HealthCheckError,
    RestartAbort,
    RestartError,
    TimeoutError,
)

__all__ = ["HealthCheckError", "RestartAbort", "RestartError", "TimeoutError"]
