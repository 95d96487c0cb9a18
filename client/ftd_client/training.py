"""Training-loop hooks: sections at the points every trainer already has.

The semantics are Megatron-Bridge's fault-tolerance integration:
- `setup()` opens the "setup" section; it closes before the first training or eval step;
- steps are wrapped in the "step" section after `num_warmup_iters` warmup iterations (warmup
  steps fall into out-of-section time, because early iterations are slow);
- checkpoint saving, async finalization included, is wrapped in "checkpointing";
- with `calc_timeouts`, timeouts are recomputed from the observed intervals after each
  checkpoint and at shutdown: "setup" only in a run that loaded a persistent checkpoint
  (a setup that loaded nothing says little about one that does), "step" only after at least
  MIN_STEPS_FOR_STEP_TIMEOUT observed steps, "checkpointing" and out-of-section time always;
- the daemon keeps what was learned in its state file and hands it to the next attempt.
Every hook is a no-op when ftd is not supervising (plain python, torchrun).

Use the module-level functions (one state per process, as Megatron does) or a `TrainingHooks`.
"""

from __future__ import annotations

import os

from ftd_client.rank import RankClient

SETUP, STEP, CHECKPOINTING = "setup", "step", "checkpointing"
NUM_WARMUP_ITERS = 1
MIN_STEPS_FOR_STEP_TIMEOUT = 16


class TrainingHooks:
    def __init__(
        self,
        client: RankClient | None = None,
        num_warmup_iters: int = NUM_WARMUP_ITERS,
        calc_timeouts: bool = False,
    ) -> None:
        self.client = client if client is not None else RankClient()
        self.num_warmup_iters = num_warmup_iters
        self.calc_timeouts = calc_timeouts
        self.iterations = 0
        self.steps_in_section = 0
        self.persistent_checkpoint_loaded = False
        self._in_setup = False
        self._in_step = False

    def setup(self) -> None:
        self.client.start_section(SETUP)
        self._in_setup = True

    def on_training_step_start(self) -> None:
        self._step_start()

    def on_training_step_end(self) -> None:
        self._step_end()

    def on_eval_step_start(self) -> None:
        self._step_start()

    def on_eval_step_end(self) -> None:
        self._step_end()

    def on_checkpointing_start(self) -> None:
        self.client.start_section(CHECKPOINTING)

    def on_checkpointing_end(self, is_async_finalization: bool = False) -> None:
        self.client.end_section(CHECKPOINTING)
        self._maybe_update_timeouts()

    def on_checkpoint_loaded(self, is_local_checkpoint: bool = False) -> None:
        if not is_local_checkpoint:
            self.persistent_checkpoint_loaded = True

    def shutdown(self) -> None:
        self._close_setup()
        if self._in_step:
            self._step_end()
        self._maybe_update_timeouts()
        self.client.close()

    def _step_start(self) -> None:
        self._close_setup()
        self.client.heartbeat()
        self.iterations += 1
        if self.iterations > self.num_warmup_iters:
            self.client.start_section(STEP)
            self._in_step = True

    def _step_end(self) -> None:
        if self._in_step:
            self.client.end_section(STEP)
            self._in_step = False
            self.steps_in_section += 1

    def _close_setup(self) -> None:
        if self._in_setup:
            self.client.end_section(SETUP)
            self._in_setup = False

    def _maybe_update_timeouts(self) -> None:
        # The daemon learns from every rank of its node: one request per node is enough.
        if not self.calc_timeouts or not self.client.is_supervised or _local_rank() != 0:
            return
        sections = [CHECKPOINTING]
        if self.persistent_checkpoint_loaded:
            sections.append(SETUP)
        if self.steps_in_section >= MIN_STEPS_FOR_STEP_TIMEOUT:
            sections.append(STEP)
        self.client.calculate_and_set_timeouts(sections=sections, out_of_section=True)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


_hooks: TrainingHooks | None = None


def setup(num_warmup_iters: int = NUM_WARMUP_ITERS, calc_timeouts: bool = False) -> TrainingHooks:
    """Start fault-tolerance monitoring for this process; opens the "setup" section."""
    global _hooks
    _hooks = TrainingHooks(num_warmup_iters=num_warmup_iters, calc_timeouts=calc_timeouts)
    _hooks.setup()
    return _hooks


def on_training_step_start() -> None:
    if _hooks is not None:
        _hooks.on_training_step_start()


def on_training_step_end() -> None:
    if _hooks is not None:
        _hooks.on_training_step_end()


def on_eval_step_start() -> None:
    if _hooks is not None:
        _hooks.on_eval_step_start()


def on_eval_step_end() -> None:
    if _hooks is not None:
        _hooks.on_eval_step_end()


def on_checkpointing_start() -> None:
    if _hooks is not None:
        _hooks.on_checkpointing_start()


def on_checkpointing_end(is_async_finalization: bool = False) -> None:
    if _hooks is not None:
        _hooks.on_checkpointing_end(is_async_finalization)


def on_checkpoint_loaded(is_local_checkpoint: bool = False) -> None:
    if _hooks is not None:
        _hooks.on_checkpoint_loaded(is_local_checkpoint)


def shutdown() -> None:
    global _hooks
    if _hooks is not None:
        _hooks.shutdown()
        _hooks = None
