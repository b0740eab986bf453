"""Normalized sharpness beside the measures the field compares it with (method §10).

Trains a 64-32-10 ReLU network on scikit-learn's digits, computes every rival
measure and the PAC-Bayes bound with ``normflat.measures``, then rescales the
hidden units (each unit's incoming weights and bias times c_k, its outgoing
weights divided by c_k: the same function) and shows which measures move.

Run: ``python examples/rival_measures.py``
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import normflat


def train() -> tuple[nn.Module, DataLoader]:
    generator = torch.Generator().manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float64)
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, y_train = x[:1400], y[:1400]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=100, shuffle=True, generator=generator)
    for _ in range(15):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model.eval(), DataLoader(TensorDataset(x_train, y_train), batch_size=500)


def rescale_hidden_units(model: nn.Module, orders: float = 2.0, seed: int = 1) -> nn.Module:
    """Unit k of the hidden layer: incoming row and bias times c_k, outgoing column / c_k."""
    c = torch.tensor(10.0 ** np.random.default_rng(seed).uniform(-orders, orders, 32), dtype=torch.float64)
    out = copy.deepcopy(model)
    with torch.no_grad():
        out[0].weight.mul_(c[:, None])
        out[0].bias.mul_(c)
        out[2].weight.div_(c[None, :])
    return out


def main() -> None:
    model, data = train()
    report = normflat.analyze(model, data, estimator="ggn", progress=False)
    rivals = normflat.measures(model, data, report=report, progress=False)
    print(rivals)
    bound = rivals.details["pac_bayes_bound"]
    print(f"\n0-1 bound: lambda={bound['lambda']:g}, posterior training error <= "
          f"{bound['posterior_loss_upper']:.3f}, complexity {bound['complexity']:.3f}, "
          f"Hoeffding term {bound['hoeffding']:.3f}{' (vacuous)' if bound['vacuous'] else ''}")

    rescaled = rescale_hidden_units(model)
    x = next(iter(data))[0]
    with torch.no_grad():
        assert torch.allclose(model(x), rescaled(x), rtol=1e-10, atol=1e-10)
    report_r = normflat.analyze(rescaled, data, estimator="ggn", progress=False)
    rivals_r = normflat.measures(rescaled, data, report=report_r, progress=False)
    print(f"\n{'after rescaling the hidden units':<40}{'before':>12}{'after':>12}")
    rows = [("normalized sharpness", report.normalized_sharpness, report_r.normalized_sharpness),
            ("Hessian trace", report.hessian_trace, report_r.hessian_trace)]
    rows += [(normflat.engine.rivals.RIVAL_LABELS[n], rivals.values[n], rivals_r.values[n]) for n in rivals.values]
    for label, before, after in rows:
        print(f"{label:<40}{before:>12.5g}{after:>12.5g}")


if __name__ == "__main__":
    main()
