"""Random function-preserving rescalings of trained torch models (method §1, §8).

Two exact symmetries are used, in the study's ``nn.Sequential`` models and in any
other torch module that :func:`torch.fx.symbolic_trace` can trace (a residual
network from a ``--model`` factory, for instance):

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

In a traced module a symmetry is used only where the graph makes it exact: the
weight module's output has a single consumer (the BatchNorm, or a chain of
ReLU / max- or average-pooling / flatten / dropout steps ending in the next weight
module), every module involved is called once and owns its parameters, and the
BatchNorm keeps running statistics and an affine weight. Anything else (a
residual sum, a shared layer, a grouped convolution downstream) is left alone, so
a residual network is rescaled where it can be (for example the first convolution
of each pre-activation block, which feeds only a BatchNorm).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Rescaling", "random_rescaling", "apply_rescaling", "check_same_function", "FunctionChangedError"]

_PASS_THROUGH = ("ReLU", "MaxPool2d", "Flatten")
#: Weight modules whose output channels (``weight.shape[0]``) can be rescaled.
_WEIGHT_MODULES = ("Linear", "Conv1d", "Conv2d", "Conv3d")
_BATCHNORMS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d")
#: Graph steps a positive per-channel factor passes through unchanged (after a ReLU
#: made the chain positively homogeneous, or before it: these are all linear or
#: positively homogeneous per channel and keep the channel axis).
_GRAPH_PASS_MODULES = ("MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
                       "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
                       "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "Flatten", "Identity", "Dropout", "Dropout1d",
                       "Dropout2d", "Dropout3d")
_GRAPH_PASS_FUNCTIONS = ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                         "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "flatten", "dropout")
_GRAPH_PASS_METHODS = ("flatten", "view", "reshape", "contiguous")
_RELU_NAMES = ("relu", "relu_")


class FunctionChangedError(AssertionError):
    """A rescaling that should preserve the function changed the model's outputs."""


@dataclass(frozen=True)
class Rescaling:
    """Factors applied to one model.

    Attributes:
        factors: ``{weight module: per-unit factors}``, the module named by its index
            in an ``nn.Sequential`` or by its qualified name (``"block1.conv1"``) in
            a traced module.
        kinds: ``{module: "relu-unit" | "before-batchnorm"}``.
        orders: ``r`` of the log-uniform draw (factors in ``[10^-r, 10^r]``).
    """

    factors: dict[int | str, np.ndarray]
    kinds: dict[int | str, str]
    orders: float

    @property
    def spread(self) -> float:
        """log10 of the largest over the smallest factor drawn."""
        allf = np.concatenate(list(self.factors.values())) if self.factors else np.ones(1)
        return float(np.log10(allf.max() / allf.min()))


def _is_weight(module: Any) -> bool:
    return type(module).__name__ in ("Linear", "Conv2d")


def _is_sequential(model: Any) -> bool:
    return type(model).__name__ == "Sequential"


def _plan(model: Any) -> dict[int | str, tuple[str, int | str]]:
    """For each rescalable weight module: its kind and the module it couples to.

    ``nn.Sequential`` models are read layer by layer (modules keyed by index);
    any other module is traced (:func:`_graph_plan`, keyed by qualified name).
    """
    if not _is_sequential(model):
        return _graph_plan(model)
    mods = list(model)
    weights = [i for i, m in enumerate(mods) if _is_weight(m)]
    plan: dict[int | str, tuple[str, int | str]] = {}
    for i, j in zip(weights[:-1], weights[1:]):
        between = [type(m).__name__ for m in mods[i + 1:j]]
        if between and between[0] in ("BatchNorm2d", "BatchNorm1d"):
            plan[i] = ("before-batchnorm", i + 1)
        elif "ReLU" in between and all(name in _PASS_THROUGH for name in between):
            plan[i] = ("relu-unit", j)
    return plan


def _module(model: Any, key: int | str) -> Any:
    """The module ``key`` of :func:`_plan` names."""
    return list(model)[key] if isinstance(key, int) else model.get_submodule(key)


def _graph_plan(model: Any) -> dict[int | str, tuple[str, int | str]]:
    """The symmetries of a traced torch module (see the module docstring).

    Raises:
        TypeError: If ``model`` is not a torch module, or torch.fx cannot trace it.
    """
    import torch
    from torch import fx

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"The rescaler needs a torch.nn.Module, got {type(model).__name__}.")
    try:
        graph = fx.symbolic_trace(model).graph
    except Exception as err:  # fx raises many types (TraceError, TypeError, ...) on dynamic code
        reason = " ".join(str(err).split())[:200]
        raise TypeError(
            f"Cannot trace {type(model).__name__} with torch.fx to find its rescaling symmetries ({reason}); "
            "the rescaler handles modules without data-dependent control flow."
        ) from err
    modules = dict(model.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
        elif node.op == "get_attr":  # a parameter used outside its module: leave that module alone
            calls[node.target.rpartition(".")[0]] = 2
    owners: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1

    def single(name: str) -> bool:
        # Called once and owning its parameters: scaling it changes exactly one place.
        return calls.get(name) == 1 and all(owners[id(p)] == 1 for p in modules[name].parameters())

    def kind(node: Any) -> str:
        return type(modules[node.target]).__name__ if node.op == "call_module" else ""

    def is_relu(node: Any) -> bool:
        name = getattr(node.target, "__name__", node.target)
        return (kind(node) == "ReLU" or (node.op in ("call_function", "call_method") and name in _RELU_NAMES))

    def passes(node: Any) -> bool:
        name = getattr(node.target, "__name__", node.target)
        return (kind(node) in _GRAPH_PASS_MODULES
                or (node.op == "call_function" and name in _GRAPH_PASS_FUNCTIONS)
                or (node.op == "call_method" and name in _GRAPH_PASS_METHODS))

    def only_consumer(node: Any) -> Any:
        users = list(node.users)
        if len(users) != 1 or not users[0].args or users[0].args[0] is not node:
            return None
        return users[0]

    plan: dict[int | str, tuple[str, int | str]] = {}
    for node in graph.nodes:
        if kind(node) not in _WEIGHT_MODULES or not single(node.target):
            continue
        out_channels = modules[node.target].weight.shape[0]
        nxt = only_consumer(node)
        if nxt is not None and kind(nxt) in _BATCHNORMS and single(nxt.target):
            bn = modules[nxt.target]
            if bn.running_var is not None and bn.weight is not None and bn.num_features == out_channels:
                plan[node.target] = ("before-batchnorm", nxt.target)
            continue
        cur, seen_relu = node, False
        while (nxt := only_consumer(cur)) is not None:
            if is_relu(nxt) or passes(nxt):
                seen_relu = seen_relu or is_relu(nxt)
                cur = nxt
                continue
            if kind(nxt) in _WEIGHT_MODULES and seen_relu and single(nxt.target):
                target = modules[nxt.target]
                fan = target.weight.shape[1]
                if getattr(target, "groups", 1) == 1 and fan % out_channels == 0:
                    plan[node.target] = ("relu-unit", nxt.target)
            break
    return plan


def random_rescaling(model: Any, *, orders: float = 2.0, seed: int = 0) -> Rescaling:
    """Draw log-uniform factors in ``[10^-orders, 10^orders]`` for every rescalable unit.

    Args:
        model: A study ``nn.Sequential`` model, or a torch module that torch.fx can trace.
        orders: Half-width of the draw in decades.
        seed: Seed of the draw.

    Raises:
        ValueError: If no weight layer can be rescaled without changing the function.
        TypeError: If the model cannot be traced.
    """
    if orders < 0:
        raise ValueError(f"orders must be >= 0, got {orders}.")
    rng = np.random.default_rng(seed)
    factors, kinds = {}, {}
    for key, (kind, _) in _plan(model).items():
        out = _module(model, key).weight.shape[0]
        factors[key] = 10.0 ** rng.uniform(-orders, orders, size=out)
        kinds[key] = kind
    if not factors:
        raise ValueError(
            f"This {type(model).__name__} has no weight layer that can be rescaled without changing its function "
            "(a Linear or Conv layer whose output feeds only a BatchNorm, or only ReLU / pooling / flatten steps "
            "into the next Linear or Conv layer)."
        )
    return Rescaling(factors, kinds, float(orders))


def apply_rescaling(model: Any, rescaling: Rescaling) -> Any:
    """A rescaled deep copy of ``model`` (the argument is not modified)."""
    import torch

    new = copy.deepcopy(model)
    plan = _plan(new)
    with torch.no_grad():
        for i, c_np in rescaling.factors.items():
            kind, j = plan[i]
            layer = _module(new, i)
            c = torch.as_tensor(c_np, dtype=layer.weight.dtype, device=layer.weight.device)
            shape = (-1,) + (1,) * (layer.weight.dim() - 1)
            layer.weight.mul_(c.view(shape))
            if layer.bias is not None:
                layer.bias.mul_(c)
            if kind == "before-batchnorm":
                bn = _module(new, j)
                var = bn.running_var.clone()
                eps = bn.eps
                bn.running_mean.mul_(c)
                bn.running_var.mul_(c * c)
                if bn.weight is not None:
                    # (c x - c m) / sqrt(c² v + eps) · γ'  ==  (x - m) / sqrt(v + eps) · γ
                    bn.weight.mul_(torch.sqrt(c * c * var + eps) / (c * torch.sqrt(var + eps)))
            else:
                nxt = _module(new, j)
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
