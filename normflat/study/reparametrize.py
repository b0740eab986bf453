"""Random function-preserving rescalings of trained torch models (method §1, §8).

Two exact symmetries of the study's ``nn.Sequential`` models are used:

* **unit-wise ReLU rescaling**: a hidden unit (or conv channel) ``k`` whose
  pre-activation feeds only ``ReLU`` / ``MaxPool2d`` / ``Flatten`` before the next
  weight layer gets its incoming weights and bias multiplied by ``c_k > 0`` and
  its outgoing weights divided by ``c_k``; ``relu(c z) = c relu(z)`` and max-pooling
  commutes with a positive per-channel factor.
* **scaling before BatchNorm**: output channel ``k`` of a weight layer followed by
  ``BatchNorm`` (eval mode) is multiplied by ``c_k``, the running mean by ``c_k``
  and the running variance by ``c_k²``; the BatchNorm weight absorbs the change
  of ``sqrt(var + eps)`` so the function is preserved exactly even with ``eps > 0``.
  The next layer is untouched.

Factors are drawn log-uniformly from ``[10^-r, 10^r]``. The output layer is never
rescaled, so the logits, hence every prediction and loss value, stay the same;
:func:`check_same_function` verifies it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Rescaling", "random_rescaling", "apply_rescaling", "check_same_function", "FunctionChangedError"]

_PASS_THROUGH = ("ReLU", "MaxPool2d", "Flatten")


class FunctionChangedError(AssertionError):
    """A rescaling that should preserve the function changed the model's outputs."""


@dataclass(frozen=True)
class Rescaling:
    """Factors applied to one model.

    Attributes:
        factors: ``{index of the weight module in the Sequential: per-unit factors}``.
        kinds: ``{index: "relu-unit" | "before-batchnorm"}``.
        orders: ``r`` of the log-uniform draw (factors in ``[10^-r, 10^r]``).
    """

    factors: dict[int, np.ndarray]
    kinds: dict[int, str]
    orders: float

    @property
    def spread(self) -> float:
        """log10 of the largest over the smallest factor drawn."""
        allf = np.concatenate(list(self.factors.values())) if self.factors else np.ones(1)
        return float(np.log10(allf.max() / allf.min()))


def _is_weight(module: Any) -> bool:
    return type(module).__name__ in ("Linear", "Conv2d")


def _plan(model: Any) -> dict[int, tuple[str, int]]:
    """For each rescalable weight module: its kind and the index of the module it couples to."""
    mods = list(model)
    weights = [i for i, m in enumerate(mods) if _is_weight(m)]
    plan = {}
    for i, j in zip(weights[:-1], weights[1:]):
        between = [type(m).__name__ for m in mods[i + 1:j]]
        if between and between[0] in ("BatchNorm2d", "BatchNorm1d"):
            plan[i] = ("before-batchnorm", i + 1)
        elif "ReLU" in between and all(name in _PASS_THROUGH for name in between):
            plan[i] = ("relu-unit", j)
    return plan


def random_rescaling(model: Any, *, orders: float = 2.0, seed: int = 0) -> Rescaling:
    """Draw log-uniform factors in ``[10^-orders, 10^orders]`` for every rescalable unit.

    Args:
        model: A study ``nn.Sequential`` model.
        orders: Half-width of the draw in decades.
        seed: Seed of the draw.
    """
    if orders < 0:
        raise ValueError(f"orders must be >= 0, got {orders}.")
    rng = np.random.default_rng(seed)
    mods = list(model)
    factors, kinds = {}, {}
    for i, (kind, _) in _plan(model).items():
        out = mods[i].weight.shape[0]
        factors[i] = 10.0 ** rng.uniform(-orders, orders, size=out)
        kinds[i] = kind
    if not factors:
        raise ValueError("This model has no weight layer that can be rescaled without changing its function.")
    return Rescaling(factors, kinds, float(orders))


def apply_rescaling(model: Any, rescaling: Rescaling) -> Any:
    """A rescaled deep copy of ``model`` (the argument is not modified)."""
    import torch

    new = copy.deepcopy(model)
    mods = list(new)
    plan = _plan(new)
    with torch.no_grad():
        for i, c_np in rescaling.factors.items():
            kind, j = plan[i]
            layer = mods[i]
            c = torch.as_tensor(c_np, dtype=layer.weight.dtype)
            shape = (-1,) + (1,) * (layer.weight.dim() - 1)
            layer.weight.mul_(c.view(shape))
            if layer.bias is not None:
                layer.bias.mul_(c)
            if kind == "before-batchnorm":
                bn = mods[j]
                var = bn.running_var.clone()
                eps = bn.eps
                bn.running_mean.mul_(c)
                bn.running_var.mul_(c * c)
                if bn.weight is not None:
                    # (c x - c m) / sqrt(c² v + eps) · γ'  ==  (x - m) / sqrt(v + eps) · γ
                    bn.weight.mul_(torch.sqrt(c * c * var + eps) / (c * torch.sqrt(var + eps)))
            else:
                nxt = mods[j]
                fan = nxt.weight.shape[1]
                repeat = fan // len(c)  # a Flatten between conv and linear: channel-major blocks
                if repeat * len(c) != fan:
                    raise ValueError(f"Cannot couple {len(c)} units to a layer with {fan} inputs.")
                inv = (1.0 / c).repeat_interleave(repeat)
                nxt.weight.mul_(inv.view((1, -1) + (1,) * (nxt.weight.dim() - 2)))
    return new


def check_same_function(model_a: Any, model_b: Any, x: Any, *, rtol: float = 1e-6) -> float:
    """Assert two models (eval mode) give the same logits on ``x``; return the relative error.

    The error is ``max |Δlogits| / max |logits|``.

    Raises:
        FunctionChangedError: If it exceeds ``rtol``.
    """
    import torch

    with torch.no_grad():
        a, b = model_a(x), model_b(x)
    scale = float(a.abs().max().clamp_min(1e-30))
    err = float((a - b).abs().max()) / scale
    if not err <= rtol:
        raise FunctionChangedError(
            f"The rescaled model's logits differ from the original's by {err:.3g} (relative, "
            f"tolerance {rtol:g}). The rescaling is not function-preserving for this model."
        )
    return err
