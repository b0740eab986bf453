"""PyTorch builder of :mod:`tests.netspec` networks (see ``tests/builders/__init__.py``)."""

from __future__ import annotations

import numpy as np

from tests import netspec

FRAMEWORKS = ("torch",)
ANALYZE_KWARGS: dict = {}


def _modules():
    import torch
    from torch import nn

    class Residual(nn.Module):
        """``x + body(x)``."""

        def __init__(self, body):
            super().__init__()
            self.body = nn.Sequential(*body)

        def forward(self, x):
            return x + self.body(x)

    class GlobalAvgPool2d(nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    return torch, nn, Residual, GlobalAvgPool2d


def build(spec: netspec.NetSpec, dtype: str = "float64"):
    """A ``torch.nn.Sequential`` with exactly the spec's weights, in eval mode."""
    torch, nn, Residual, GlobalAvgPool2d = _modules()
    tdtype = getattr(torch, dtype)

    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=tdtype)

    def convert(layers, rank):
        mods = []
        for layer in layers:
            if isinstance(layer, netspec.Dense):
                out_f, in_f = layer.weight.shape
                m = nn.Linear(in_f, out_f, bias=layer.bias is not None, dtype=tdtype)
                with torch.no_grad():
                    m.weight.copy_(t(layer.weight))
                    if layer.bias is not None:
                        m.bias.copy_(t(layer.bias))
            elif isinstance(layer, netspec.Conv2d):
                out_c, in_g, kh, kw = layer.weight.shape
                m = nn.Conv2d(in_g * layer.groups, out_c, (kh, kw), stride=layer.stride,
                              padding=layer.padding, groups=layer.groups, bias=layer.bias is not None, dtype=tdtype)
                with torch.no_grad():
                    m.weight.copy_(t(layer.weight))
                    if layer.bias is not None:
                        m.bias.copy_(t(layer.bias))
            elif isinstance(layer, netspec.ConvTranspose2d):
                out_c, in_c, kh, kw = layer.weight.shape
                m = nn.ConvTranspose2d(in_c, out_c, (kh, kw), stride=layer.stride, padding=layer.padding,
                                       bias=layer.bias is not None, dtype=tdtype)
                with torch.no_grad():
                    m.weight.copy_(t(layer.weight.transpose(1, 0, 2, 3)))  # torch stores (in, out, kh, kw)
                    if layer.bias is not None:
                        m.bias.copy_(t(layer.bias))
            elif isinstance(layer, netspec.Relu):
                m = nn.ReLU()
            elif isinstance(layer, netspec.Tanh):
                m = nn.Tanh()
            elif isinstance(layer, netspec.MaxPool2d):
                m = nn.MaxPool2d(layer.size)
            elif isinstance(layer, netspec.GlobalAvgPool2d):
                m, rank = GlobalAvgPool2d(), 1
            elif isinstance(layer, netspec.Flatten):
                m, rank = nn.Flatten(), 1
            elif isinstance(layer, netspec.BatchNorm):
                cls = nn.BatchNorm2d if rank == 3 else nn.BatchNorm1d
                m = cls(len(layer.gamma), eps=layer.eps, dtype=tdtype)
                with torch.no_grad():
                    m.weight.copy_(t(layer.gamma))
                    m.bias.copy_(t(layer.beta))
                    m.running_mean.copy_(t(layer.mean))
                    m.running_var.copy_(t(layer.var))
            elif isinstance(layer, netspec.LayerNorm):
                m = nn.LayerNorm(len(layer.gamma), eps=layer.eps, dtype=tdtype)
                with torch.no_grad():
                    m.weight.copy_(t(layer.gamma))
                    m.bias.copy_(t(layer.beta))
            elif isinstance(layer, netspec.Residual):
                body, _ = convert(layer.body, rank)
                m = Residual(body)
            else:
                raise TypeError(f"unknown layer {layer!r}")
            mods.append(m)
        return mods, rank

    mods, _ = convert(spec.layers, len(spec.input_shape))
    return nn.Sequential(*mods).to(tdtype).eval()


def predict(model, x: np.ndarray) -> np.ndarray:
    """Logits as float64 numpy for NCHW / feature inputs."""
    import torch

    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        return model(torch.as_tensor(x, dtype=dtype)).double().numpy()


def make_data(x: np.ndarray, y: np.ndarray, batch_size: int):
    """A DataLoader of float64 inputs and int64 labels."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.int64))
    return DataLoader(ds, batch_size=batch_size, shuffle=False)
