"""Framework backends and their lazy registry.

A backend is a module that turns a model and data into per-layer problems. It
must provide::

    layer_problems(model, data, options: AnalysisOptions, **backend_options)
        -> tuple[list[LayerProblem], dict]        # problems + report metadata
    hessian_diagonal(model, data, options: AnalysisOptions, **backend_options)
        -> dict[str, array]                       # canonical (out, in, *kernel)

Backends are imported only when a model of their framework is analyzed. The
framework of a model is detected from ``sys.modules`` without importing any
framework: a model of framework X can only exist if X was imported already.
Keras is checked before torch, because under Keras' torch backend every Keras
layer is also a ``torch.nn.Module``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

__all__ = ["BackendEntry", "register_backend", "backend_for", "registered_backends"]


@dataclass(frozen=True)
class BackendEntry:
    """A backend: its name, the module implementing it and a model detector."""

    name: str
    module: str
    detect: Callable[[Any], bool]

    def load(self) -> ModuleType:
        """Import and return the backend module."""
        return importlib.import_module(self.module)


def _is_keras_model(model: Any) -> bool:
    for mod_name in ("keras", "tf_keras"):
        keras = sys.modules.get(mod_name)
        layer_cls = getattr(keras, "Layer", None) or getattr(getattr(keras, "layers", None), "Layer", None)
        if layer_cls is not None and isinstance(model, layer_cls):
            return not _is_keras_on_jax(model)
    return False


def keras_runs_on_jax() -> bool:
    """Whether Keras 3 is loaded, on its JAX backend (``KERAS_BACKEND=jax``); imports nothing."""
    keras = sys.modules.get("keras")
    try:
        return keras is not None and keras.backend.backend() == "jax"
    except AttributeError:
        return False


def _is_keras_on_jax(model: Any) -> bool:
    """A Keras 3 model on Keras' JAX backend: analyzed by the JAX backend (called inside ``keras.StatelessScope``)."""
    layer_cls = getattr(getattr(sys.modules.get("keras"), "layers", None), "Layer", None)
    return layer_cls is not None and isinstance(model, layer_cls) and keras_runs_on_jax()


def _is_torch_model(model: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def _is_jax_model(model: Any) -> bool:
    if _is_keras_on_jax(model):
        return True
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(model, eqx.Module):
        return True
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return True
    if isinstance(model, tuple) and len(model) == 2 and "jax" in sys.modules:
        linen = sys.modules.get("flax.linen")
        if linen is not None and isinstance(model[0], linen.Module):
            return True
        # Mapping, not only dict: flax FrozenDict params are Mappings.
        return callable(model[0]) and isinstance(model[1], Mapping)
    return False


_REGISTRY: list[BackendEntry] = [
    BackendEntry("keras", "normflat.backends.keras", _is_keras_model),
    BackendEntry("torch", "normflat.backends.torch", _is_torch_model),
    BackendEntry("jax", "normflat.backends.jax", _is_jax_model),
]


def register_backend(name: str, module: str, detect: Callable[[Any], bool], *, first: bool = False) -> None:
    """Register a third-party backend.

    Args:
        name: Backend name, recorded in reports.
        module: Import path of a module with ``layer_problems`` and
            ``hessian_diagonal`` (see this package's docstring).
        detect: Predicate telling whether a model belongs to this backend. It must
            not import any framework (look in ``sys.modules``).
        first: Check this backend before the built-in ones.
    """
    entry = BackendEntry(name, module, detect)
    _REGISTRY[:] = [e for e in _REGISTRY if e.name != name]
    if first:
        _REGISTRY.insert(0, entry)
    else:
        _REGISTRY.append(entry)


def registered_backends() -> list[BackendEntry]:
    """The registered backends in detection order."""
    return list(_REGISTRY)


def backend_for(model: Any) -> tuple[str, ModuleType]:
    """Return ``(name, module)`` of the backend handling ``model``.

    Raises:
        TypeError: If no backend recognises the model.
    """
    for entry in _REGISTRY:
        if entry.detect(model):
            return entry.name, entry.load()
    raise TypeError(
        f"normflat cannot analyze an object of type {type(model).__module__}.{type(model).__qualname__}. "
        "Pass a torch.nn.Module, a Keras model, an equinox or flax.nnx module, a "
        "(flax linen module, variables) or (apply_fn, params) pair, or a list of "
        "normflat.LayerProblem."
    )
