"""Track normalized sharpness in a hand-written PyTorch loop (digits, MLP, a few seconds on CPU).

Run: ``python examples/track_torch.py [figure.png]`` (default ``tracking_torch.png``).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from normflat.integrations.torch import SharpnessTracker


def digits(train: int = 1200):
    """scikit-learn's bundled digits (no download): x_train, y_train, x_test, y_test."""
    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x, y = (d.data[order] / 16.0).astype("float32"), d.target[order].astype("int64")
    return x[:train], y[:train], x[train:], y[train:]


def main(figure: str = "tracking_torch.png") -> None:
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = (torch.as_tensor(a) for a in digits())
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=64, shuffle=True)
    # Analyze on a fixed subset of the training data: 4 batches of 128, drawn once.
    probe = DataLoader(TensorDataset(x_train, y_train), batch_size=128, shuffle=True)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    tracker = SharpnessTracker(probe, every_n_steps=25, max_batches=4,
                               logger=lambda m, step: print(f"step {step:4d}  NS {m['normalized_sharpness']:.4g}  "
                                                            f"trace {m['hessian_trace']:.4g}"))
    step = 0
    for epoch in range(12):
        for xb, yb in train:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            tracker.step(model, step, epoch=epoch)
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"test accuracy {acc:.3f}; {len(tracker.history)} analyses")
    tracker.history.plot(figure, title="PyTorch loop: digits MLP")
    print(f"figure written to {figure}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
