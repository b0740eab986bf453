"""Track normalized sharpness with a PyTorch Lightning callback (digits, MLP, CPU).

The values go through ``pl_module.log_dict`` to every logger of the Trainer (a
CSVLogger here); the callback's history draws the figure.

Run: ``python examples/track_lightning.py [figure.png]`` (default ``tracking_lightning.png``).
"""

from __future__ import annotations

import sys
import tempfile

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from normflat.integrations.lightning import SharpnessCallback


def digits(train: int = 1200):
    """scikit-learn's bundled digits (no download): x_train, y_train, x_test, y_test."""
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = (d.data[order] / 16.0).astype("float32"), d.target[order].astype("int64")
    return x[:train], y[:train], x[train:], y[train:]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # logits: what normflat analyzes

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False, batch_size=len(y))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main(figure: str = "tracking_lightning.png") -> None:
    pl.seed_everything(0, verbose=False)
    x_train, y_train, x_test, y_test = (torch.as_tensor(a) for a in digits())
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=64, shuffle=True)
    val = DataLoader(TensorDataset(x_test, y_test), batch_size=128)
    cb = SharpnessCallback(val, every_n_epochs=1, per_layer=True)
    logs = tempfile.mkdtemp()
    trainer = pl.Trainer(max_epochs=12, accelerator="cpu", devices=1, logger=CSVLogger(logs),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb])
    trainer.fit(Classifier(), train)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if "/" not in k})
    print(f"logged to {trainer.logger.log_dir}/metrics.csv; {len(cb.history)} analyses")
    cb.history.plot(figure, x="epoch", title="PyTorch Lightning: digits MLP (analysis on the test split)")
    print(f"figure written to {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
