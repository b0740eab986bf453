"""PyTorch backend: Hessian and GGN diagonals of ``torch.nn.Module`` models, over the engine.

Entry points (called through :func:`normflat.analyze` / :func:`normflat.hessian_diagonal`):
:func:`layer_problems` and :func:`hessian_diagonal`, which hand a
:class:`~normflat.backends.torch.session.TorchSession` to
:mod:`normflat.engine.driver` (the data contract, the loop, the distributed
protocol, the problems: the same in every framework, see ``docs/semantics.md``);
:func:`perturbation_model` for the rival measures of ``normflat.measures`` (method §10).
Public extension point: :func:`register_layer` (with :class:`LayerExtractor`).

Modules:

``layers``
    the registry, its built-in entries and the model walk;
``state``
    record/restore of the user's model (modes, ``requires_grad``, grads, buffers, hooks);
``data``
    the engine's data adapter for tensors, numpy arrays and DataLoaders;
``session``
    the session: one batch's kernels, canonical layout, metadata;
``hvp``
    ``exact`` and ``hutchinson`` (reverse-over-reverse Hessian-vector products);
``ggn``
    ``ggn`` / ``ggn-mc``: fast per-layer rules and the generic ``vmap`` path;
``distributed``
    the ``torch.distributed`` collectives of the engine's ``Comm``;
``compat``
    every touch of a private torch API;
``perturbation``
    the :class:`~normflat.engine.perturbation.PerturbationModel` of the rival measures
    (method §10): losses, gradients and the path norm at perturbed weights.

How the estimators are computed (method §6), all on the model's device and dtype:
``exact`` and ``hutchinson`` use Hessian-vector products of the batch loss sum
(``hutchinson`` with the framework-free probes of :mod:`normflat.engine.random`);
``ggn`` / ``ggn-mc`` back-propagate the loss-Hessian factor of
:func:`normflat.engine.losses.output_signals` to the weight layers and sum squared
per-sample gradients (fast rules for dense, convolution, transposed
convolution and embedding layers; a generic ``vmap`` path for the others:
attention, recurrent layers, position tables, shared weights). Token logits
``(n, T, C)`` use the per-token signals of method §6.3; Hugging Face style
mapping batches are passed as keyword inputs, and :mod:`~normflat.backends.torch.hf`
holds what the backend knows about model libraries.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from normflat.backends.torch.distributed import create as _create_comm
from normflat.backends.torch.layers import LayerExtractor, ModuleWeight, register_layer, registered_layers
from normflat.backends.torch.perturbation import perturbation_model
from normflat.backends.torch.session import DEFAULT_MAX_EXACT_PARAMS, TorchSession
from normflat.engine import driver
from normflat.engine.options import AnalysisOptions

__all__ = [
    "ModuleWeight",
    "LayerExtractor",
    "register_layer",
    "registered_layers",
    "layer_problems",
    "hessian_diagonal",
    "perturbation_model",
    "DEFAULT_MAX_EXACT_PARAMS",
]


def _session_factory(model: Any, options: AnalysisOptions, backend_options: dict[str, Any]):
    backend_options = dict(backend_options)
    comm = _create_comm(backend_options.pop("distributed", None))

    def make_session() -> TorchSession:
        return TorchSession(model, options, backend_options, comm)

    return make_session, comm


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a torch model (backend contract, see ``normflat.backends``).

    Backend options: ``force`` (run ``exact`` above the size limit),
    ``max_exact_params`` (that limit, default 20 000), ``chunk_size`` (samples per
    GGN chunk; default bounds signals × samples by 8192) or ``memory_budget``
    (``"512MB"``; the GGN chunk size is chosen from it), ``exact_chunk`` /
    ``probe_chunk`` (HVPs vectorized at once), ``fast`` (``False`` forces the generic
    GGN path, for checking), ``distributed`` (``None``: shard over the default
    ``torch.distributed`` group when one is initialized; ``True``: require it;
    ``False``: analyze this process's data alone; or a ``ProcessGroup``).
    DistributedDataParallel / DataParallel wrappers are unwrapped; FSDP-sharded
    and TorchScript models are refused.
    """
    make_session, comm = _session_factory(model, options, backend_options)
    return driver.layer_problems(make_session, data, options, comm)


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """``{layer name: diagonal}`` in canonical ``(out, in/groups, *kernel)`` layout, model order.

    Only the mean of the group estimates is wanted: ``ggn-mc`` and ``ggn-topk`` keep one sum
    per weight for all their groups (``AnalysisOptions.pooled``), the same draws and the same
    mean with a fraction of the memory.
    """
    options = replace(options, group_estimates=False)
    make_session, comm = _session_factory(model, options, backend_options)
    return driver.hessian_diagonal(make_session, data, options, comm)
