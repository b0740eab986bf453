"""The torch :class:`~normflat.engine.data.DataAdapter` and the move of a batch onto the model.

The engine decides what data means (:mod:`normflat.engine.data`); this module
only says how to read torch tensors, numpy arrays and DataLoaders, and converts a
checked batch to tensors on the model's device (floating inputs in the model's
dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.utils.data

from normflat.backends.torch.layers import all_finite
from normflat.engine.data import input_leaves

__all__ = ["TorchAdapter", "ADAPTER", "to_model", "inputs_to_model", "ModelInputs", "deferred_inputs_finite",
           "host_to_device"]


class TorchAdapter:
    """Torch tensors and numpy arrays; DataLoaders and any iterable of batches."""

    framework = "torch"

    def is_array(self, a: Any) -> bool:
        return isinstance(a, (torch.Tensor, np.ndarray))

    def shape(self, a: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in a.shape)

    def kind(self, a: Any) -> str:
        if isinstance(a, np.ndarray):
            k = a.dtype.kind
            return {"f": "f", "i": "i", "u": "i", "b": "b", "c": "c"}.get(k, "?")
        if a.dtype == torch.bool:
            return "b"
        if a.is_floating_point():
            return "f"
        if a.is_complex():
            return "c"
        return "i"

    def to_numpy(self, a: Any) -> np.ndarray:
        if isinstance(a, np.ndarray):
            return a
        return a.detach().cpu().numpy()

    def all_finite(self, a: Any) -> bool:
        if isinstance(a, np.ndarray):
            return bool(np.isfinite(a).all())
        if a.device.type != "cpu":
            # On an accelerator the answer would wait for the device: the session checks these
            # tensors after the loop, in one synchronisation (deferred_inputs_finite); the meta
            # device has no values, and the session refuses it itself.
            return True
        if not a.is_floating_point():
            return True
        return all_finite(a)

    def cardinality(self, data: Any) -> Any:
        try:
            return int(len(data))
        except TypeError:  # generators, IterableDataset loaders without a length
            return None

    def reject(self, data: Any) -> str | None:
        if isinstance(data, torch.utils.data.Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
            return (f"data is a {type(data).__name__}, which yields single samples; wrap it in a DataLoader "
                    "(torch.utils.data.DataLoader(dataset, batch_size=...)).")
        return None

    def iterate(self, data: Any):
        return data


ADAPTER = TorchAdapter()


def to_model(t: Any, what: str, index: int, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as a tensor on ``device`` that can enter autograd; floating tensors cast to ``dtype``.

    Raises:
        ValueError: If a tensor is on another device than the model.
    """
    if isinstance(t, np.ndarray):
        t = torch.as_tensor(t, device=device)
    if t.device != device:
        raise ValueError(
            f"Batch {index}: the {what} are on device {t.device} but the model is on {device}; move the "
            f"data to the model's device (x.to({str(device)!r})) or the model to the data's."
        )
    if t.is_inference():
        t = t.clone()  # tensors made under torch.inference_mode() cannot enter autograd
    if dtype is not None and torch.is_floating_point(t) and t.dtype != dtype:
        t = t.to(dtype)  # the analysis runs in the model's dtype
    return t


@dataclass
class ModelInputs:
    """The inputs of ``model(*args, **kwargs)`` for ``n`` samples.

    Positional inputs are per-sample tensors (leading axis ``n``). Keyword inputs
    (Hugging Face style batches) are per-sample when they are tensors with leading
    axis ``n`` (``input_ids``, ``attention_mask``); anything else is passed as is to
    every chunk and every sample.
    """

    args: tuple
    kwargs: dict
    n: int

    def _per_sample(self, v: Any) -> bool:
        return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.n

    def batched_kwargs(self) -> dict:
        """The per-sample keyword inputs."""
        return {k: v for k, v in self.kwargs.items() if self._per_sample(v)}

    def constant_kwargs(self) -> dict:
        """The keyword inputs shared by all samples."""
        return {k: v for k, v in self.kwargs.items() if not self._per_sample(v)}

    def rows(self, sl: slice) -> "ModelInputs":
        """The inputs of samples ``sl``."""
        n = len(range(*sl.indices(self.n)))
        kwargs = {k: v[sl] if self._per_sample(v) else v for k, v in self.kwargs.items()}
        return ModelInputs(tuple(xi[sl] for xi in self.args), kwargs, n)

    def call(self, model: Any) -> Any:
        """``model(*args, **kwargs)``."""
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """The input tensors, positional then keyword."""
        return [v for v in (*self.args, *self.kwargs.values()) if isinstance(v, torch.Tensor)]

    def cloned(self) -> "ModelInputs":
        """A copy with tensors of its own: a forward that writes into its inputs writes into these."""
        def own(v: Any) -> Any:
            return v.clone() if isinstance(v, torch.Tensor) else v
        return ModelInputs(tuple(own(a) for a in self.args), {k: own(v) for k, v in self.kwargs.items()}, self.n)


def inputs_to_model(x: Any, index: int, device: torch.device, dtype: torch.dtype, n: int,
                    keywords: bool = False) -> ModelInputs:
    """The inputs of the model: keyword inputs (``keywords``), or positional ones.

    A tuple/list is spread, one array is one argument; a dict of inputs that is not a
    keyword batch is passed as positional values in key order (torch modules take
    positional inputs). Non-floating inputs (token ids, masks) keep their dtype.
    """
    if keywords and isinstance(x, Mapping):
        kwargs = {k: to_model(v, "inputs", index, device, dtype) if _is_tensor_like(v) else v
                  for k, v in x.items()}
        return ModelInputs((), kwargs, n)
    if isinstance(x, Mapping):
        items = tuple(x[k] for k in x)
    elif isinstance(x, (tuple, list)):
        items = tuple(x)
    else:
        items = (x,)
    return ModelInputs(tuple(to_model(xi, "inputs", index, device, dtype) for xi in items), {}, n)


def deferred_inputs_finite(x: Any) -> torch.Tensor | None:
    """Whether the floating input tensors of ``x`` that live on an accelerator are all finite,
    as a boolean tensor on their device (``None`` if there are none): the checks
    :meth:`TorchAdapter.all_finite` leaves to the session, read after the loop."""
    leaves = [a for a in input_leaves(x) if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta")
              and a.is_floating_point() and a.numel()]
    if not leaves:
        return None
    flags = [torch.isfinite(a).all() for a in leaves]
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).all()


def host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array of normflat's own (labels, uniform draws) on ``device``, without waiting for
    the device: a copy from pageable memory to a CUDA device waits for the stream, one from
    pinned memory is queued."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _is_tensor_like(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))
