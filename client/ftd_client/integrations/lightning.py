"""PyTorch Lightning: fault tolerance through Lightning's hook points.

    from ftd_client.integrations.lightning import FaultToleranceCallback
    trainer = Trainer(callbacks=[FaultToleranceCallback(calc_timeouts=True)])

The same sections as ftd_client.training: "setup" until the first batch, "step" around each
training or validation batch after the warmup iterations, "checkpointing" from Lightning's
on_save_checkpoint until the next hook (the checkpoint is written in between). The learned
timeouts also travel in Lightning's checkpoints. No-ops when ftd is not supervising.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from ftd_client.training import NUM_WARMUP_ITERS, TrainingHooks

STATE_KEY = "ftd_fault_tolerance"


class FaultToleranceCallback(pl.Callback):
    def __init__(self, num_warmup_iters: int = NUM_WARMUP_ITERS, calc_timeouts: bool = False):
        super().__init__()
        self.num_warmup_iters = num_warmup_iters
        self.calc_timeouts = calc_timeouts
        self.hooks: TrainingHooks | None = None
        self._checkpointing = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.hooks is None:
            self.hooks = TrainingHooks(
                num_warmup_iters=self.num_warmup_iters, calc_timeouts=self.calc_timeouts
            )
            self.hooks.setup()

    def _finish_checkpointing(self) -> None:
        if self._checkpointing and self.hooks is not None:
            self._checkpointing = False
            self.hooks.on_checkpointing_end()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self._finish_checkpointing()
        if self.hooks is not None:
            self.hooks.on_training_step_start()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self.hooks is not None:
            self.hooks.on_training_step_end()

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, idx: int, dataloader_idx: int = 0
    ) -> None:
        self._finish_checkpointing()
        if self.hooks is not None:
            self.hooks.on_eval_step_start()

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int, dl_idx: int = 0
    ) -> None:
        if self.hooks is not None:
            self.hooks.on_eval_step_end()

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.hooks is None:
            return
        checkpoint[STATE_KEY] = self.hooks.client.state_dict()
        if not self._checkpointing:
            self._checkpointing = True
            self.hooks.on_checkpointing_start()

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        if self.hooks is None:
            return
        self.hooks.on_checkpoint_loaded(is_local_checkpoint=False)
        if STATE_KEY in checkpoint:
            self.hooks.client.load_state_dict(checkpoint[STATE_KEY])

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish_checkpointing()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._finish_checkpointing()
        if self.hooks is not None:
            self.hooks.shutdown()
            self.hooks = None
