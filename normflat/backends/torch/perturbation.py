"""The torch :class:`~normflat.engine.perturbation.PerturbationModel` (method §10).

The rival measures of :mod:`normflat.engine.rivals` need the loss of the model
with its recognised weight matrices moved by a perturbation ``delta``, its
gradient, per-prediction weight derivatives and the path norm. This module
supplies them for an ``nn.Module`` without ever changing it:

* the layers are those of ``analyze`` (:func:`~normflat.backends.torch.layers.collect_layers`),
  a packed weight split into its row blocks (method §3), so the names, order and
  kinds are the report's;
* every forward is a :func:`torch.func.functional_call` with the weights
  replaced by ``W + delta`` (the canonical ``delta`` laid onto the parameter's
  own layout), in ``eval()`` mode as ``analyze`` runs the model, in the model's
  dtype; the model's modes, flags and buffers are recorded before and restored
  after every call (:class:`~normflat.backends.torch.state.ModelState`);
* the data are read through the engine's data contract
  (:func:`normflat.engine.data.batches`, :func:`~normflat.engine.data.labels_for`)
  exactly as the session reads them, so ``output=``, token logits,
  ``ignore_index`` and ``shift_labels`` mean what they mean in ``analyze``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping

import array_api_compat
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vjp

from normflat.backends.torch import compat, hf
from normflat.backends.torch.data import ADAPTER, ModelInputs, deferred_inputs_finite, inputs_to_model, to_model
from normflat.backends.torch.ggn import unswapped, unswapped_error
from normflat.backends.torch.layers import collect_layers, unwrap
from normflat.backends.torch.session import check_samples_apart_of, forward_error_of, parse_settings
from normflat.backends.torch.state import ModelState, claim, release
from normflat.engine.data import Batch, batches, labels_for, model_failures, non_finite_inputs
from normflat.engine.losses import check_output_shape, classes_first
from normflat.engine.options import AnalysisOptions
from normflat.engine.outputs import select_output
from normflat.engine.perturbation import PATH_NORM_SCOPE, UnsupportedMeasureError, prediction_losses

__all__ = ["TorchPerturbationModel", "perturbation_model"]

_XP = array_api_compat.array_namespace(torch.empty(0))



def perturbation_model(model: Any, data: Any, options: AnalysisOptions,
                       **backend_options: Any) -> "TorchPerturbationModel":
    """The :class:`~normflat.engine.perturbation.PerturbationModel` of a torch model.

    Args:
        model: An ``nn.Module`` (DistributedDataParallel / DataParallel wrappers are
            unwrapped, as in ``analyze``).
        data: The training data, in the engine's data contract (re-iterable: the
            engine checks it).
        options: The analysis options (``loss``, ``output``, ``ignore_index``,
            ``shift_labels``, ``max_batches``, ``on_unsupported``, ...).
        **backend_options: The torch options of ``analyze`` (``force``, ``chunk_size``,
            ...), checked as there; they configure the Hessian estimators, so the
            measures, which need none of them, ignore them. ``distributed`` must be
            ``None`` or ``False``: the measures use this process's data.

    Raises:
        TypeError: For an unknown backend option, or a model that is not an ``nn.Module``.
        ValueError: For a bad backend option value.
        ValueError: For a model without a recognised weight layer (as ``analyze``).
    """
    return TorchPerturbationModel(model, data, options, backend_options)


class TorchPerturbationModel:
    """An ``nn.Module`` whose recognised weight matrices can be perturbed (method §10).

    Attributes:
        names: The report's layer names (``analyze``), packed weights split per block.
        kinds: Their kinds.
        unsupported: The skipped layers' messages, as ``analyze`` reports them.
        model: The (unwrapped) user's module, never changed.
    """

    def __init__(self, model: Any, data: Any, options: AnalysisOptions,
                 backend_options: Mapping[str, Any] | None = None) -> None:
        _check_backend_options(dict(backend_options or {}))
        self.model = unwrap(model)
        self.data = data
        self.options = options
        # Claimed for the walk, which reads parametrized weights with their parametrizations in eval mode
        # for a moment (as the session claims its module for its own walk).
        claim(self.model)  # raises, with nothing to undo, if another thread analyzes this module
        try:
            self._layers, self.unsupported, _ = collect_layers(self.model, options, use_fast=False,
                                                               on_unsupported=options.on_unsupported)
        finally:
            release(self.model)
        # One slot per report name: (layer index, canonical row range or None for the whole weight).
        self._slots: list[tuple[int, tuple[int, int] | None]] = []
        self.names: list[str] = []
        self.kinds: list[str] = []
        for index, layer in enumerate(self._layers):
            spec = layer.spec
            rows = [(int(a), int(b)) for _, a, b in spec.blocks] if spec.blocks else [None]
            for name, row in zip(spec.problem_names(), rows):
                self._slots.append((index, row))
                self.names.append(name)
                self.kinds.append(spec.kind)
        self._shapes = [self._slot_shape(slot) for slot in self._slots]
        first = self._layers[0].param
        self.device, self.dtype = first.device, first.dtype
        # Causal language models: the logits at t predict the label at t + 1 (method §6.3), as in analyze.
        self.shift = (bool(options.shift_labels) if options.shift_labels is not None
                      else bool(hf.is_causal_lm(self.model)))
        self._recurrent = any(isinstance(m, nn.RNNBase) for m in self.model.modules())
        self._closed = False
        self._swappable = False  # the weights checked to be swappable by functional_call (_batches)
        self._apart_checked = False  # the samples checked apart (check_samples_apart_of), on the first batch
        self._inputs_checked = False  # the device inputs, on the first complete pass (_batches)
        self._first_logits: tuple[int, ...] | None = None  # the first batch's logits' shape (_prediction_losses)

    # ------------------------------------------------------------------ the protocol

    def weights(self) -> list[np.ndarray]:
        """Each layer's weight: float64 copies, canonical ``(out, in, *kernel)`` layout."""
        self._check_open()
        out = []
        for index, row in self._slots:
            layer = self._layers[index]
            canonical = _rows(layer.canonical(layer.param.detach()), row)
            out.append(_to_numpy(canonical))
        return out

    def evaluate(self, deltas: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-prediction losses and correctness at ``w + delta`` over all the data.

        Args:
            deltas: One canonical-layout array per layer (``None``: no perturbation).

        Returns:
            ``(losses, correct)``: float64 ``(m,)`` and bool ``(m,)``, in data order.
        """
        with self._running():
            params = self._perturbed(deltas)
            losses, correct = [], []
            for batch, xs in self._batches():
                with model_failures("torch", batch, self._forward_error):
                    batch_losses, batch_correct = self._prediction_losses(params, batch, xs)
                losses.append(batch_losses)
                correct.append(batch_correct)
            # One transfer to the host for the whole pass, not one per batch.
            return _to_numpy(torch.cat(losses)), torch.cat(correct).cpu().numpy().astype(bool)

    def gradient(self, deltas: list[np.ndarray] | None) -> tuple[float, list[np.ndarray]]:
        """Mean loss over all predictions at ``w + delta`` and its gradient (canonical layout).

        The mean is over all predictions of all batches: the sum of the batch loss
        sums divided by the number of predictions.

        Raises:
            ValueError: If the data hold no counted prediction (every token ignored).
        """
        with self._running():
            params = self._perturbed(deltas)
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            # Summed over batches in float64 (a float32 model's batch gradients are float32).
            grads = {name: torch.zeros_like(w, dtype=torch.float64) for name, w in params.items()}
            count = 0

            for batch, xs in self._batches():
                def loss_sum(ws: dict[str, torch.Tensor], _batch: Batch = batch,
                             _xs: ModelInputs = xs) -> tuple[torch.Tensor, torch.Tensor]:
                    losses, _ = self._prediction_losses(ws, _batch, _xs)
                    return losses.sum(), losses.detach()  # the auxiliary output must be a tensor

                with model_failures("torch", batch, self._forward_error):
                    g, (value, losses) = grad_and_value(loss_sum, has_aux=True)(params)
                for name in grads:
                    grads[name] += g[name].to(torch.float64)
                total += value.to(torch.float64)
                count += int(losses.shape[0])
            if count == 0:
                raise ValueError(_NO_PREDICTION)
            return float(total) / count, [_to_numpy(g) / count for g in self._canonical_slots(grads)]

    def weight_derivatives(self) -> np.ndarray:
        """``<w, grad_w loss_i>`` for every prediction ``i`` at the unperturbed weights.

        ``w`` is the recognised weight matrices only (biases excluded): this is
        ``d/dt loss_i(W (1 + t))`` at ``t = 0``, a Jacobian-vector product in the
        direction of the weights. It is computed exactly as the transpose of a
        transpose (the vector-Jacobian product of the linear map ``u -> J^T u``),
        not with torch's forward mode, whose ``tanh`` rule calls the deprecated
        ``torch.jit.script`` (a warning on every call, which normflat does not
        filter; the same reason as in :mod:`~normflat.backends.torch.hvp`).

        Returns:
            float64 ``(m,)``, in data order.
        """
        with self._running(double_backward=True):
            params = self._perturbed(None)
            out = []
            for batch, xs in self._batches():
                def losses_of(ws: dict[str, torch.Tensor], _batch: Batch = batch,
                              _xs: ModelInputs = xs) -> torch.Tensor:
                    return self._prediction_losses(ws, _batch, _xs)[0]

                with model_failures("torch", batch, self._forward_error):
                    losses, pull = vjp(losses_of, params)  # pull(u) = J^T u, linear in u
                    _, push = vjp(pull, torch.zeros_like(losses))  # push(v) = (J^T)^T v = J v
                    out.append(push((params,))[0].detach())
            return _to_numpy(torch.cat(out))

    def squared_output(self) -> float:
        """``sum_k f(1)_k`` of the network with every parameter squared (method §10).

        The input is one example of ones, of the shape of one example of the data's
        inputs. Inference-mode batch normalization is first folded into its
        per-channel affine map ``y = a x + b`` (``a = gamma / sqrt(var + eps)``,
        ``b = beta - a mean``), whose ``a`` and ``b`` are then squared.

        Raises:
            UnsupportedMeasureError: For a module other than dense and convolution
                layers, inference-mode BatchNorm, ReLU, pooling, flattening, dropout,
                identity and containers, or a forward that computes anything else
                (a ``tanh``, a residual sum), naming it; for a model with several or
                keyword inputs.
        """
        self._check_open()
        _check_path_modules(self.model)
        x = self._ones_input()
        with self._running():
            folds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            folded_params: set[int] = set()
            for module in self.model.modules():
                if isinstance(module, _BATCH_NORMS):
                    folds[id(module.running_mean)] = _folded_squares(module)
                    folded_params.update(id(p) for p in module.parameters(recurse=False))
            # named_parameters lists a tied parameter once; functional_call ties its other names.
            squared = {name: p.detach() ** 2 for name, p in self.model.named_parameters()
                       if id(p) not in folded_params}
            guard = _PathNormGuard({id(t) for t in squared.values()}, folds, type(self.model).__name__)
            with guard:
                out = functional_call(self.model, squared, (x,), strict=False)
            # After the guard, which refuses what the path norm is not defined for (a forward of
            # one example of ones may not even run otherwise, batch statistics say).
            self._check_swappable(SimpleNamespace(args=(x,), kwargs={}),
                                  {name: p for name, p in self.model.named_parameters() if id(p) not in folded_params})
            logits = self._pick(out)
            if not isinstance(logits, torch.Tensor):
                raise TypeError(_not_tensor(logits))
            return float(logits.detach().to(torch.float64).sum())

    def close(self) -> None:
        """Release what this object holds (idempotent; the user's model is never changed)."""
        if self._closed:
            return
        self._closed = True
        self._layers = []
        self.data = None

    def __enter__(self) -> "TorchPerturbationModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This perturbation model is closed; create a new one (perturbation_model(...)).")

    @contextlib.contextmanager
    def _running(self, double_backward: bool = False) -> Iterator[None]:
        """The mode every call runs in: ``eval()``, as ``analyze``; the model restored after.

        ``torch.func`` transforms ignore an outer ``no_grad``: it only keeps autograd
        from recording the model's own parameters (biases) outside them.
        """
        self._check_open()
        claim(self.model)  # raises, with nothing to undo, if another thread analyzes this module
        try:
            state = ModelState(self.model)
            try:
                self.model.eval()  # BatchNorm uses its running statistics, dropout is off
                with contextlib.ExitStack() as stack:
                    stack.enter_context(torch.inference_mode(False))
                    stack.enter_context(torch.no_grad())
                    stack.enter_context(hf.analysis_mode(self.model, self.options))
                    stack.enter_context(compat.model_workarounds(self.model))
                    if double_backward or self._recurrent:
                        # Double backward needs attention's math kernel; recurrent layers run as plain
                        # recurrences, as in the session (compat.FunctionalKernels).
                        stack.enter_context(compat.FunctionalKernels(attention=double_backward))
                    yield
            finally:
                state.restore()
        finally:
            release(self.model)

    def _pick(self, out: Any) -> Any:
        """The logits inside the model's output (the ``output`` option)."""
        return select_output(out, self.options.output, _is_tensor)

    def _forward_error(self, batch: Batch) -> BaseException | None:
        """The model's error on a batch's first rows (:func:`~normflat.engine.data.model_failures`)."""
        return forward_error_of(self.model, batch, self.device, self.dtype, self._pick)

    def _batches(self) -> Iterator[tuple[Batch, ModelInputs]]:
        source, _ = batches(self.data, ADAPTER, self.options)
        for batch in source:
            xs = inputs_to_model(batch.x, batch.index, self.device, self.dtype, batch.n, batch.keywords)
            if batch.keywords:
                xs.kwargs = hf.keyword_inputs(self.model, xs.kwargs, batch.y, self.device)
            if not self._inputs_checked:
                # Inputs on an accelerator: the adapter leaves their check to the caller. Once, on
                # the first pass over the data (the measures make several).
                inputs_ok = deferred_inputs_finite(batch.x)
                if inputs_ok is not None and not bool(inputs_ok):
                    raise non_finite_inputs(batch.index)
            if not self._apart_checked:
                # Once, on the first batch, outside gradient()'s transforms: the first forward (inputs
                # the model fails on refused) and, from two rows, the samples apart.
                check_samples_apart_of(self.model, xs, self._pick, batch)
                self._apart_checked = True
            if not self._swappable:
                # Every forward swaps the weights in with functional_call: a weight also reached
                # another way would stay unperturbed (ggn.unswapped).
                self._check_swappable(xs.rows(slice(0, min(2, xs.n))),
                                     {layer.param_name: layer.param for layer in self._layers})
                self._swappable = True
            # Labels on the host before the torch.func transforms: inside them a tensor cannot be
            # read into numpy (labels_for does), and the data contract reads numpy labels alike.
            yield dataclasses.replace(batch, y=ADAPTER.to_numpy(batch.y)), xs
        self._inputs_checked = True

    def _check_swappable(self, inputs: Any, params: dict[str, torch.Tensor]) -> None:
        """Refuse parameters the model reaches without their module attribute (they would not be
        swapped: :func:`~normflat.backends.torch.ggn.unswapped`)."""
        names = unswapped(self.model, inputs, params, self._pick)
        if names:
            raise unswapped_error(names)

    def _prediction_losses(self, params: dict[str, torch.Tensor], batch: Batch,
                           xs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The counted predictions' losses and correctness of one batch at ``params``."""
        out = functional_call(self.model, params, xs.args, xs.kwargs, strict=False)
        logits = self._pick(out)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(_not_tensor(logits))

        def one_row() -> tuple[int, ...]:
            first = xs.rows(slice(0, 1))
            return tuple(self._pick(functional_call(self.model, params, first.args, first.kwargs, strict=False)).shape)

        # As many classes as the first batch's: logits whose classes follow the rows mix the samples.
        c = check_output_shape(tuple(logits.shape), self.options, batch.index, batch.n,
                               seen=self._first_logits, other_rows=one_row)
        if self._first_logits is None:
            self._first_logits = tuple(logits.shape)
        tokens = int(logits.shape[1]) if logits.dim() == 3 else None
        with classes_first(self._first_logits, one_row):
            ids = labels_for(batch, c, ADAPTER, self.options, tokens=tokens, shift=self.shift)
        y = torch.as_tensor(ids, device=logits.device)
        losses, correct, counted = prediction_losses(_XP, logits, y, self.options)
        return losses[counted], correct[counted]

    def _slot_shape(self, slot: tuple[int, tuple[int, int] | None]) -> tuple[int, ...]:
        index, row = slot
        shape = self._layers[index].canonical_shape()
        return shape if row is None else (row[1] - row[0], *shape[1:])

    def _perturbed(self, deltas: list[np.ndarray] | None) -> dict[str, torch.Tensor]:
        """``{parameter name: W + delta}`` in the parameter's layout, uploaded once per call."""
        params = {layer.param_name: layer.param.detach() for layer in self._layers}
        if deltas is None:
            return params
        self._check_deltas(deltas)
        canonical: dict[int, torch.Tensor] = {}
        for (index, row), delta in zip(self._slots, deltas):
            layer = self._layers[index]
            if index not in canonical:
                canonical[index] = torch.zeros(layer.canonical_shape(), dtype=layer.param.dtype,
                                               device=layer.param.device)
            d = torch.as_tensor(np.asarray(delta, dtype=np.float64)).to(device=layer.param.device,
                                                                         dtype=layer.param.dtype)
            # Blocks of one packed weight fill their own rows; one weight listed twice adds up.
            _rows(canonical[index], row).add_(d)
        native: dict[str, torch.Tensor] = {}
        for index, d in canonical.items():
            layer = self._layers[index]
            moved = layer.from_canonical(d[None])[0]
            native[layer.param_name] = native.get(layer.param_name, 0) + moved
        return {name: w + native[name] if name in native else w for name, w in params.items()}

    def _canonical_slots(self, native: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """A ``{parameter name: tensor}`` of parameter layouts, as one canonical array per slot."""
        out = []
        for index, row in self._slots:
            layer = self._layers[index]
            out.append(_rows(layer.canonical(native[layer.param_name]), row))
        return out

    def _check_deltas(self, deltas: Any) -> None:
        if not isinstance(deltas, (list, tuple)) or len(deltas) != len(self.names):
            got = len(deltas) if isinstance(deltas, (list, tuple)) else type(deltas).__name__
            raise ValueError(
                f"deltas must be a list of {len(self.names)} arrays, one per layer {self.names}, or None; "
                f"got {got}."
            )
        for name, shape, delta in zip(self.names, self._shapes, deltas):
            arr = np.asarray(delta)
            if tuple(arr.shape) != shape:
                raise ValueError(
                    f"The delta of layer {name!r} has shape {tuple(arr.shape)}, but its weight has the "
                    f"canonical shape {shape} (out, in, *kernel); pass deltas in the layout of weights()."
                )
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"The delta of layer {name!r} contains NaN or infinite values.")

    def _ones_input(self) -> torch.Tensor:
        """One example of ones shaped like one example of the data's (single) input."""
        source, _ = batches(self.data, ADAPTER, self.options)
        try:
            batch = next(iter(source))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
        if batch.keywords:
            raise UnsupportedMeasureError(
                f"The model takes keyword inputs ({sorted(batch.x)}), but the path norm runs the network on "
                f"one example of ones, which needs a single input tensor: {PATH_NORM_SCOPE}."
            )
        x = batch.x
        items = list(x.values()) if isinstance(x, Mapping) else list(x) if isinstance(x, (tuple, list)) else [x]
        if len(items) != 1:
            raise UnsupportedMeasureError(
                f"The model takes {len(items)} inputs, but the path norm runs the network on one example of "
                f"ones, which needs a single input tensor: {PATH_NORM_SCOPE}."
            )
        t = to_model(items[0], "inputs", batch.index, self.device, None)
        if not torch.is_floating_point(t):
            raise UnsupportedMeasureError(
                f"The inputs have dtype {t.dtype} (ids, not features), but the path norm runs the network on "
                f"one example of ones: {PATH_NORM_SCOPE}."
            )
        return torch.ones((1, *t.shape[1:]), dtype=self.dtype, device=self.device)


def _check_backend_options(backend_options: dict[str, Any]) -> None:
    """Accept the options of ``analyze`` (``normflat.measures`` passes the same ones), checked alike."""
    distributed = backend_options.pop("distributed", None)
    if distributed is not None and distributed is not False:
        raise ValueError(
            f"distributed={distributed!r}: the torch backend computes the measures on this process's data "
            "only; pass distributed=False (or leave it out) and run the measures on one process."
        )
    parse_settings(backend_options)  # raises for unknown options and bad values, as analyze does


# ============================================================================ the path norm's layers

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)

#: Modules the path norm runs through, by class: their forward must be the class's own.
_PATH_MODULES: tuple[type, ...] = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    *_BATCH_NORMS, nn.ReLU,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Flatten, nn.Unflatten, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.Sequential, nn.ModuleList, nn.ModuleDict,
)
_PATH_FORWARDS = frozenset(cls.forward for cls in _PATH_MODULES)


def _refusal(label: str, module: nn.Module, why: str = "") -> UnsupportedMeasureError:
    """The error every framework gives for a layer the path norm is not defined for."""
    detail = f" ({why})" if why else ""
    return UnsupportedMeasureError(
        f"Layer {label!r} ({type(module).__name__}){detail}: {PATH_NORM_SCOPE}."
    )


def _check_path_modules(model: nn.Module) -> None:
    """Refuse every module the path norm does not run through, naming the first.

    A module of an allowed class must keep the class's forward. A module of
    another class without parameters or buffers of its own (the user's
    ``nn.Module`` subclass holding the layers) is a container: its forward is
    checked operation by operation while it runs (:class:`_PathNormGuard`).
    """
    for name, module in model.named_modules():
        label = compat.plain_name(name) or type(module).__name__
        if compat.compiled_original(module) is not None:
            continue  # torch.compile's wrapper of a submodule: runs its eager module (compat.no_compilation)
        if isinstance(module, _PATH_MODULES):
            if type(module).forward not in _PATH_FORWARDS:
                raise _refusal(label, module, f"it overrides the forward of {_path_base(module).__name__}")
            if isinstance(module, _BATCH_NORMS) and not (module.track_running_stats
                                                          and module.running_mean is not None):
                raise _refusal(label, module, "without running statistics it normalizes with the "
                                              "batch's, also in inference mode")
            continue
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if own or type(module).__module__.startswith("torch."):
            raise _refusal(label, module)


def _path_base(module: nn.Module) -> type:
    return next(cls for cls in type(module).__mro__ if cls in _PATH_MODULES)


def _folded_squares(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a², b²)`` of an inference-mode BatchNorm ``y = a x + b``, in the model's dtype."""
    mean, var = module.running_mean.detach(), module.running_var.detach()
    a = torch.rsqrt(var + module.eps)
    if module.weight is not None:
        a = module.weight.detach() * a
    b = -a * mean
    if module.bias is not None:
        b = module.bias.detach() + b
    return a * a, b * b


def _candidates(owner: Any, names: str) -> list[Any]:
    return [getattr(owner, n) for n in names.split() if hasattr(owner, n)]


#: Linear maps whose weight (and bias) must be the squared parameters.
_LINEAR_MAPS = frozenset(_candidates(
    F, "linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d"))
#: Operations that are in the path norm's scope as they are (ReLU, pooling, reshaping, dropout).
_PATH_OPS = frozenset(
    _candidates(F, "relu relu_ max_pool1d max_pool2d max_pool3d max_pool1d_with_indices "
                   "max_pool2d_with_indices max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d "
                   "adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d "
                   "adaptive_max_pool2d adaptive_max_pool3d adaptive_max_pool1d_with_indices "
                   "adaptive_max_pool2d_with_indices adaptive_max_pool3d_with_indices dropout dropout1d "
                   "dropout2d dropout3d alpha_dropout feature_alpha_dropout")
    # ``mean``: global average pooling written in a forward (``x.mean((2, 3))``).
    + _candidates(torch, "relu relu_ max_pool1d max_pool2d max_pool3d avg_pool1d dropout flatten unflatten "
                         "reshape squeeze unsqueeze mean")
    + _candidates(torch.Tensor, "relu relu_ flatten unflatten view reshape squeeze unsqueeze contiguous mean "
                                "dim size numel ndimension is_contiguous is_floating_point __len__")
)


#: Sums of two activations (residual connections): in scope when both operands are tensors.
_SUMS = frozenset(_candidates(torch, "add") + _candidates(torch.Tensor, "add add_ __add__ __radd__ __iadd__"))


class _PathNormGuard(torch.overrides.TorchFunctionMode):
    """Runs the squared network and refuses every operation outside the path norm's scope.

    A torch function mode sees every torch operation the model's forward calls (in
    this thread only, for the ``with`` block): modules hide nothing, so a ``tanh``
    written in a forward is refused as surely as an ``nn.Tanh``; a residual sum of two
    activations adds the paths of its branches and is in scope.
    Dense and convolution maps must use the squared parameters; an inference-mode
    BatchNorm (recognised by its running-mean buffer) computes its folded, squared
    affine map ``a² x + b²`` instead.

    Args:
        squared: ``id`` of every squared parameter tensor passed to the forward.
        folds: ``{id(running_mean): (a², b²)}`` of each BatchNorm.
        model_name: The model's class name, for messages.
    """

    def __init__(self, squared: set[int], folds: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 model_name: str) -> None:
        super().__init__()
        self.squared, self.folds, self.model_name = squared, folds, model_name

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LINEAR_MAPS:
            weight = _argument(args, kwargs, 1, "weight")
            bias = _argument(args, kwargs, 2, "bias")
            if id(weight) not in self.squared or (bias is not None and id(bias) not in self.squared):
                raise self._refuse(func, "with a weight that is not a parameter of the model")
        elif func is F.batch_norm:
            return self._batch_norm(func, args, kwargs)
        elif func is F.pad:
            mode = _argument(args, kwargs, 2, "mode") or "constant"
            value = _argument(args, kwargs, 3, "value")
            if mode == "constant" and value not in (None, 0, 0.0):
                raise self._refuse(func, f"padding with the constant {value}")
        elif func in _SUMS:
            # A residual sum of two activations adds the paths of both branches (method §10.4);
            # a constant or a weighted sum would add paths that are not the network's.
            other = _argument(args, kwargs, 1, "other")
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            if not (isinstance(_argument(args, kwargs, 0, "input"), torch.Tensor) and isinstance(other, torch.Tensor)
                    and alpha == 1):
                raise self._refuse(func, "with a constant or a weighted operand (only sums of two activations)")
        elif func not in _PATH_OPS and getattr(func, "__name__", None) != "__get__":
            # ``__get__``: reading a tensor attribute (shape, dtype) computes nothing.
            raise self._refuse(func)
        return func(*args, **kwargs)

    def _batch_norm(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        x = _argument(args, kwargs, 0, "input")
        fold = self.folds.get(id(_argument(args, kwargs, 1, "running_mean")))
        if fold is None or _argument(args, kwargs, 5, "training"):
            raise self._refuse(func, "outside an inference-mode BatchNorm layer")
        a2, b2 = fold
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return x * a2.reshape(shape) + b2.reshape(shape)

    def _refuse(self, func: Callable, why: str = "") -> UnsupportedMeasureError:
        name = f"{getattr(func, '__module__', None) or 'torch.Tensor'}.{getattr(func, '__name__', func)}"
        detail = f" {why}" if why else ""
        return UnsupportedMeasureError(
            f"The forward of {self.model_name} calls {name}{detail}: {PATH_NORM_SCOPE}."
        )


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


# ============================================================================ small helpers

_NO_PREDICTION = ("The data hold no counted prediction (every token label is ignore_index), so the mean "
                  "loss is undefined; pass data with labels.")


def _rows(t: torch.Tensor, row: tuple[int, int] | None) -> torch.Tensor:
    return t if row is None else t[row[0]:row[1]]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A float64 host copy (never a view of the model's memory)."""
    return np.array(t.detach().to(device="cpu", dtype=torch.float64).numpy(), dtype=np.float64, copy=True)


def _is_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor)


def _not_tensor(value: Any) -> str:
    return (f"The model returned a {type(value).__name__}; normflat needs a forward that maps inputs to a "
            "(batch, classes) logits tensor (or choose it with output=).")
