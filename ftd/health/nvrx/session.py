"""One NVRx client's connection to the rank-monitor socket: what its release expects of its
monitor, decided from its init message and its sections. Pure: ftd/health/nvrx/host.py applies
the decisions to ftd's monitor.

- Replies. From 0.5 NVRx's client reads no reply to a heartbeat or a section where the config
  its monitor returned at init says `skip_section_response` (its class default: True). 0.4.x
  reads one to every message whatever that config says, and 0.4.x and 0.5.x send the same
  bytes: those clients are told False, and read each reply ftd writes. A client of 0.6 or later
  (its InitMsg carries `num_warmup_iters`) is told True, and ftd writes nothing back to its
  heartbeats and sections (an error is logged, as NVRx's monitor does). Every other message
  (authkey, init, timeouts) is answered, and read, in every release.
- Before the first step. NVRx 0.6's monitor does not time out-of-section time before the rank
  opened "step" in this connection, where sections are configured and none is named "warmup":
  ftd keeps an untimed internal section (BEFORE_STEP) open until then.
- Warm-up steps. With a "warmup" section timeout configured, NVRx 0.6's monitor times "step" by
  it while the iteration the client reports (only a client that reports iterations: Megatron-LM)
  is fewer than `num_warmup_iterations` past the first one it reported: ftd's monitor then sees
  that step opened as "warmup".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ftd.health.nvrx.wire import InitMsg

STEP = "step"
WARMUP = "warmup"
BEFORE_STEP = "_before_first_step"
"""Open from a 0.6 client's init to its first step: no out-of-section time is timed meanwhile.
Not in the timeouts table, so it is never timed itself."""
BEFORE_STEP_LINK = -1
"""The monitor's connection id for BEFORE_STEP (ftd's own socket numbers its links from 1): its
duration is never observed as a section's."""
DEFAULT_WARMUP_ITERATIONS = 5
"""NVRx's FaultToleranceConfig.num_warmup_iterations, where the client names none."""
MAX_ERRORS_SAID = 16


@dataclass(slots=True)
class ClientSession:
    """What ftd knows of one connection to the rank-monitor socket."""

    pid: int
    client_0_6_or_later: bool = False
    warmup_iterations: int = DEFAULT_WARMUP_ITERATIONS
    first_iteration: int | None = None
    iteration: int | None = None
    step_as: str | None = None
    """The name ftd's monitor has for the client's open "step" (STEP or WARMUP); None: closed."""
    before_step: bool = False
    """BEFORE_STEP is open in the monitor."""
    errors_said: set[str] = field(default_factory=set)

    @property
    def replies_to_beats(self) -> bool:
        """Whether the client reads a reply to its heartbeats and sections."""
        return not self.client_0_6_or_later

    def started(self, init: InitMsg, sections: Mapping[str, float | None]) -> None:
        """The client's InitMsg, under these section timeouts; `before_step` says whether
        BEFORE_STEP must open."""
        self.client_0_6_or_later = init.client_0_6_or_later
        if init.num_warmup_iters is not None:
            self.warmup_iterations = init.num_warmup_iters
        self.first_iteration = self.iteration = self.step_as = None
        self.before_step = self.client_0_6_or_later and bool(sections) and WARMUP not in sections

    def saw(self, section: str | None, iteration: int | None) -> None:
        """The iteration a section message carried: NVRx counts those of "step" only."""
        if section == STEP and iteration is not None:
            if self.first_iteration is None:
                self.first_iteration = iteration
            self.iteration = iteration

    def step_name(self, sections: Mapping[str, float | None]) -> str:
        """The name ftd's monitor times an opening "step" under."""
        first, now = self.first_iteration, self.iteration
        warming = first is not None and now is not None and now - first < self.warmup_iterations
        return WARMUP if warming and WARMUP in sections else STEP

    def say_once(self, error: str) -> bool:
        """Whether an error the client is not told of is to be logged (the first few kinds)."""
        if error in self.errors_said or len(self.errors_said) >= MAX_ERRORS_SAID:
            return False
        self.errors_said.add(error)
        return True
