"""A small Lightning job with ftd's callback; resumes from its last checkpoint."""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from ftd_client.integrations.lightning import FaultToleranceCallback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], idx: int) -> torch.Tensor:
        time.sleep(0.05)
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    ckpt_dir = Path(sys.argv[1])
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    checkpointing = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5)
    trainer = pl.Trainer(
        max_steps=40,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[FaultToleranceCallback(calc_timeouts=True), checkpointing],
    )
    last = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    trainer.fit(Model(), DataLoader(data, batch_size=4), ckpt_path=last[-1] if last else None)
    print(f"finished at step {trainer.global_step}", flush=True)
