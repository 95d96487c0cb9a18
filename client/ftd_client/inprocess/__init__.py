"""In-process restart: a training function restarted in the same processes after a fault.

    from ftd_client import inprocess

    @inprocess.Wrapper(abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed()))
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None: ...

Works under `ftd serve --restart-mode inprocess` (the daemon coordinates, sees dead ranks at
once and respawns them) and, with less help, under torchrun. docs/inprocess.md explains the
design; keys.py is the contract with the daemon. torch is imported only once the Wrapper runs.
"""

from ftd_client.inprocess import abort
from ftd_client.inprocess.abort import Abort, AbortTorchDistributed, AbortTransformerEngine
from ftd_client.inprocess.compose import Compose
from ftd_client.inprocess.exceptions import HealthCheckError, RestartError, RestartInterrupt
from ftd_client.inprocess.keys import Fault
from ftd_client.inprocess.manager import RoundManager
from ftd_client.inprocess.state import FrozenState
from ftd_client.inprocess.wrap import CallWrapper, Wrapper

__all__ = [
    "Abort",
    "AbortTorchDistributed",
    "AbortTransformerEngine",
    "CallWrapper",
    "Compose",
    "Fault",
    "FrozenState",
    "HealthCheckError",
    "RestartError",
    "RestartInterrupt",
    "RoundManager",
    "Wrapper",
    "abort",
]
