"""Normalized sharpness of a small PyTorch MLP trained on scikit-learn's digits.

Trains a 64-32-10 ReLU network for a few seconds, analyzes it with the exact GGN
diagonal, shows the per-layer report, compares estimators, and checks that a
function-preserving rescaling of two layers leaves normalized sharpness unchanged
while the Hessian trace moves.

Run: ``python examples/torch_mlp.py``
"""

from __future__ import annotations

import copy

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import normflat


def main() -> None:
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=100, shuffle=True)
    for _ in range(15):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    print(f"test accuracy {acc:.3f}")

    # The Hessian (here: GGN) diagonal of the mean training loss over all training samples.
    train = DataLoader(TensorDataset(x_train, y_train), batch_size=256)
    report = normflat.analyze(model, train, estimator="ggn", progress=False)
    print(report)

    # A cheaper stochastic estimate, with standard errors.
    mc = normflat.analyze(model, train, estimator="ggn-mc", samples=20, seed=0, progress=False)
    se = mc.standard_error["normalized_sharpness"]
    print(f"ggn-mc (20 draws): normalized sharpness {mc.normalized_sharpness:.4f} ± {se:.4f} "
          f"(ggn: {report.normalized_sharpness:.4f})")

    # Dinh et al.'s rescaling: layer 0 × 10, layer 2 ÷ 10 computes the same function.
    rescaled = copy.deepcopy(model)
    with torch.no_grad():
        rescaled[0].weight.mul_(10.0)
        rescaled[0].bias.mul_(10.0)
        rescaled[2].weight.div_(10.0)
        same = torch.allclose(rescaled(x_test), model(x_test), atol=1e-4)
    after = normflat.analyze(rescaled, train, estimator="ggn", progress=False)
    print(f"rescaled model computes the same function: {same}")
    print(f"  hessian trace        {report.hessian_trace:10.4f} -> {after.hessian_trace:10.4f}")
    print(f"  normalized sharpness {report.normalized_sharpness:10.4f} -> {after.normalized_sharpness:10.4f}")


if __name__ == "__main__":
    main()
