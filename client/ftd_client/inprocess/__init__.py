"""In-process restart: a training function restarted in the same processes after a fault.

    from ftd_client import inprocess

    @inprocess.Wrapper(abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed()))
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None: ...

Works under `ftd serve --restart-mode inprocess` (the daemon coordinates, sees dead ranks at
once and respawns them) and, with less help, under torchrun. docs/inprocess.md explains the
design; keys.py is the contract with the daemon. torch is imported only once the Wrapper runs.
"""

from ftd_client.inprocess import (
    abort,
    exception,
    finalize,
    health_check,
    initialize,
    rank_assignment,
)
from ftd_client.inprocess.abort import Abort, AbortTorchDistributed, AbortTransformerEngine
from ftd_client.inprocess.call_wrapper import CallWrapper
from ftd_client.inprocess.compose import Compose
from ftd_client.inprocess.exceptions import (
    FaultCounterExceeded,
    HealthCheckError,
    RestartAbort,
    RestartError,
    RestartInterrupt,
)
from ftd_client.inprocess.finalize import Finalize, ThreadedFinalize
from ftd_client.inprocess.health_check import CudaHealthCheck, FaultCounter, HealthCheck
from ftd_client.inprocess.initialize import Initialize, RetryController
from ftd_client.inprocess.keys import Fault
from ftd_client.inprocess.manager import RoundManager
from ftd_client.inprocess.state import FrozenState, Mode
from ftd_client.inprocess.wrap import Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "AbortTransformerEngine",
    "CallWrapper",
    "Compose",
    "CudaHealthCheck",
    "Fault",
    "FaultCounter",
    "FaultCounterExceeded",
    "Finalize",
    "FrozenState",
    "HealthCheck",
    "HealthCheckError",
    "Initialize",
    "Mode",
    "RestartAbort",
    "RestartError",
    "RestartInterrupt",
    "RetryController",
    "RoundManager",
    "ThreadedFinalize",
    "Wrapper",
    "abort",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "rank_assignment",
]
