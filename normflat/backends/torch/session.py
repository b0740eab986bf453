"""The torch :class:`~normflat.engine.driver.Session`: one model under analysis.

It holds the layers found by :func:`~normflat.backends.torch.layers.collect_layers`,
runs one batch's estimator kernels (:mod:`~normflat.backends.torch.ggn`,
:mod:`~normflat.backends.torch.hvp`) and adds their per-layer ``(K, *shape)``
sums to the engine's state; the engine does the loop, the data contract, the
distributed protocol and the problems. Everything runs on the model's device in
the model's dtype, with autograd on also under ``torch.no_grad()`` or
``torch.inference_mode()``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import array_api_compat
import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from normflat.backends.torch import compat, hf, hvp
from normflat.backends.torch import ggn as ggn_kernels
from normflat.backends.torch.data import (ADAPTER, ModelInputs, deferred_inputs_finite, host_to_device,
                                          inputs_to_model, to_model)
from normflat.backends.torch.distributed import TorchComm
from normflat.backends.torch.layers import (TiedUse, TorchLayer, all_finite, collect_layers, computing_copy,
                                           unwrap)
from normflat.backends.torch.state import ModelState, claim, release
from normflat.core.memory import equal_step
from normflat.engine import estimators, losses
from normflat.engine import random as nrandom
from normflat.engine.data import (PENDING_CHECKS, Batch, labels_for, model_fails_on_inputs, non_finite_inputs,
                                  raised_by_normflat)
from normflat.engine.estimators import SumState
from normflat.engine.problems import UNUSED_NOTE
from normflat.engine.options import GGN_ESTIMATORS, AnalysisOptions, check_flags, resolve_estimator
from normflat.engine.outputs import select_output

__all__ = ["Settings", "parse_settings", "TorchSession", "BACKEND_OPTIONS", "DEFAULT_MAX_EXACT_PARAMS",
           "DEFAULT_SIGNAL_ROWS"]

#: ``estimator="exact"`` refuses models with more recognised weight entries unless ``force=True``.
DEFAULT_MAX_EXACT_PARAMS = 20_000
#: Default bound on ``signals × samples`` rows back-propagated at once by the GGN paths.
DEFAULT_SIGNAL_ROWS = 8192
#: ``ggn`` squares a dense head from the logit-Hessian diagonal and starts the other layers'
#: signals at its input (structured, method §6.1) above this many classes; below, pushing the
#: ``C − 1`` dense signals through the head costs less than forming the structured ones.
STRUCTURED_HEAD_CLASSES = 32
#: Bound on the entries of one block of placed token signals ``(K, M·tokens, n, T, C)``.
TOKEN_SIGNAL_ENTRIES = 1 << 24
#: Bound on the entries of one block of per-sequence token signals ``(K, M', n, T, C)`` (a few
#: members of every group; 4 MiB in float32), formed one block at a time (method §6.3).
SEQUENCE_SIGNAL_ENTRIES = 1 << 20
#: Rows of the forward that learns the classes and sizes before the first batch is chunked: two,
#: so that a model which squeezes its batch axis still returns a batch.
PROBE_ROWS = 2
#: The torch backend's own options (``distributed`` is taken by the package entry points).
BACKEND_OPTIONS = ("force", "max_exact_params", "chunk_size", "memory_budget", "exact_chunk", "probe_chunk",
                   "fast", "distributed")

_XP = array_api_compat.array_namespace(torch.empty(0))


@dataclass
class Settings:
    """The checked backend options."""

    force: bool = False
    max_exact_params: int = DEFAULT_MAX_EXACT_PARAMS
    chunk_size: int | None = None
    memory_budget: Any = None
    exact_chunk: int = 64
    probe_chunk: int = 16
    fast: bool = True


def parse_settings(backend_options: dict[str, Any]) -> Settings:
    """Check the backend options (without ``distributed``).

    Raises:
        TypeError: For an unknown option.
        ValueError: For a bad value.
    """
    unknown = sorted(set(backend_options) - set(BACKEND_OPTIONS))
    if unknown:
        raise TypeError(
            f"Unknown option(s) for the torch backend: {unknown}; it accepts {list(BACKEND_OPTIONS)}."
        )
    check_flags(backend_options)
    s = Settings(**backend_options)
    for name in ("max_exact_params", "exact_chunk", "probe_chunk"):
        v = getattr(s, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    if s.chunk_size is not None and (isinstance(s.chunk_size, bool) or not isinstance(s.chunk_size, int)
                                     or s.chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {s.chunk_size!r}.")
    if s.memory_budget is not None:
        from normflat.core.memory import parse_memory_budget

        if s.chunk_size is not None:
            raise ValueError(
                "Pass either chunk_size (samples per step) or memory_budget (the chunk size is then "
                "chosen from it), not both."
            )
        s.memory_budget = parse_memory_budget(s.memory_budget)
    return s




class TorchSession:
    """One ``nn.Module`` under analysis (the engine's session contract).

    Construction discovers the layers, checks the backend options, records the
    model's state (:class:`~normflat.backends.torch.state.ModelState`), switches
    to ``eval()`` and installs the capture hooks; :meth:`close` undoes all of it.
    """

    framework = "torch"
    adapter = ADAPTER

    def __init__(self, model: Any, options: AnalysisOptions, backend_options: dict[str, Any],
                 comm: TorchComm | None) -> None:
        self.framework_version = torch.__version__
        self.options = options
        self.comm = comm
        self.rank = comm.rank if comm is not None else 0
        self.settings = parse_settings(backend_options)
        # A float16 or bfloat16 model is analyzed in float32, through a private copy.
        model = computing_copy(unwrap(model))
        # The skipped-layer warning once per analysis: on rank 0 of a distributed run.
        on_unsupported = options.on_unsupported
        if self.rank != 0 and on_unsupported == "warn":
            on_unsupported = "skip"
        # Claimed before the walk, which reads parametrized weights with their parametrizations in eval
        # mode for a moment: an analysis of the same module in another thread must not see that.
        claim(model)  # raises, with nothing to undo, if another thread analyzes this module
        try:
            self._layers, self.unsupported, self.parameters = collect_layers(model, options, self.settings.fast,
                                                                             on_unsupported)
            est = options.estimator
            if est == "exact" and not self.settings.force:
                total = sum(layer.param.numel() for layer in self._layers)
                if total > self.settings.max_exact_params:
                    raise ValueError(
                        f"estimator='exact' needs one Hessian-vector product per weight entry per batch; this "
                        f"model has {total} weight entries, above the limit max_exact_params="
                        f"{self.settings.max_exact_params}. Use estimator='ggn' or 'hutchinson', or pass "
                        "force=True (or a larger max_exact_params) to run it anyway."
                    )
        except BaseException:
            release(model)
            raise
        self.layers = [layer.spec for layer in self._layers]
        self._index = {id(layer): i for i, layer in enumerate(self._layers)}
        first = self._layers[0].param
        self.device, self.dtype = first.device, first.dtype
        self.ggn = est in GGN_ESTIMATORS
        self.chunk: int | None = self.settings.chunk_size
        # Signals of one sample back-propagated at once when all of them exceed the memory (the
        # exact ``ggn`` with many classes); None: all of them (_choose_chunk, _member_steps).
        self.signal_step: int | None = None
        self.checked = False
        self._broadcast: list[TorchLayer] = []  # the layers the capture may expand (_forward)
        # The layers whose substitution (_forward) passed its first checks (_substitution_checks).
        self._seen: set[int] = set()
        # Dense layers whose output holds a block of rows per sample (a batch folded into the
        # leading axis, e.g. attention windows): id -> the rows per sample, checked once on a
        # chunk of two samples or more (_rows_per_sample); and this chunk's rows per sample.
        self._folds: dict[int, int] = {}
        self._chunk_folds: dict[int, int] = {}
        # Dense layers and embeddings with the samples on their second axis (sequence-first:
        # ``(T, n, d)``, nn.TransformerEncoderLayer without batch_first), checked once as the folds.
        self._second_axis: set[int] = set()
        self._chunk_second: set[int] = set()  # this chunk's: those, and any such layer of a one-sample chunk
        # One-row layers whose expansion broke the forward and that may be sequence first with one
        # position (Longformer's global projections, (1, n, d)): never expanded again.
        self._unexpanded: set[int] = set()
        # Layers on no batch axis (method §6.1, "Layers on no batch axis"): id -> why they failed
        # the rows check before they were followed to where they meet the batch (their reason if
        # that fails too), and the meetings of the first forward that followed them (checked once).
        self._batchless_tried: dict[int, str] = {}
        self._meetings_checked: int | None = None  # the meetings of one forward
        self._meetings_apart = False  # each sample's signal reaches its own rows only (2 samples or more)
        self._meetings_whole = False  # every path from the layers to the logits goes through them
        # The layers whose weights were checked to be swappable by functional_call (_check_swappable).
        self._swappable: set[int] = set()
        self.batched = False
        self.batches_seen = 0
        # A model that runs on the first batch but fails on one row alone: its error, raised where the
        # generic path would run a sample alone (_check_one_sample).
        self._one_sample_failure: Exception | None = None
        # Value checks of the batches whose answer would wait for the device (the logits' and the
        # loss's statistics, the inputs on an accelerator), read in one go after the loop
        # (_run_checks): ``(batch index, kind, device tensor, what the message needs)`` in order.
        self._pending: list[tuple[int, str, torch.Tensor, Any]] = []
        self.saturation = math.inf  # the least softmax saturation of the checked batches (driver)
        self.token_logits = False  # whether the model returned (n, T, C) token logits (metadata)
        # The logits' shape of the first forward (the probe's or the first chunk's): every later one
        # must have as many classes (_check_logits).
        self._first_logits: tuple[int, ...] | None = None
        self.probes: hvp.Probes | None = None  # set with the state below
        self.capture: ggn_kernels.Capture | None = None
        self._closed = False
        self.model = model
        # Causal language models: the logits at t predict the label at t + 1 (method §6.3).
        self._recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
        self.shift = False  # set with the state below
        self.state: ModelState | None = None
        try:  # the module is claimed: a failure from here on closes the session, which releases it
            self.probes = hvp.Probes(self._layers, options.seed) if est == "hutchinson" else None
            self.shift = (bool(options.shift_labels) if options.shift_labels is not None
                          else bool(hf.is_causal_lm(model)))
            self.state = ModelState(model)
            model.eval()  # BatchNorm uses its running statistics, dropout is off
            if self.ggn:
                fast = [layer for layer in self._layers if layer.fast]
                # A position table has no module of its own: :meth:`_forward` records it. A layer
                # on one row broadcast over the batch is expanded where its rule takes any input.
                self._broadcast = [layer for layer in fast if not layer.table and not layer.tied
                                   and ggn_kernels.wants_deltas(layer.ext.ggn_squares)
                                   and not ggn_kernels.wants_call(layer.ext.ggn_squares)]
                self.capture = ggn_kernels.Capture([use for layer in fast if not layer.table for use in layer.uses],
                                                   [id(layer) for layer in self._broadcast],
                                                   [id(layer) for layer in fast
                                                    if ggn_kernels.first_of_tuple(layer.ext.ggn_squares)])
                for layer in fast:
                    layer.param.requires_grad_(True)  # so the layer outputs carry gradients for the signals
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ engine contract

    def signature(self) -> list[Any]:
        """``(name, kind, shape, dtype)`` per layer, for the distributed setup agreement."""
        return [(layer.name, layer.spec.kind, tuple(layer.param.shape), str(layer.param.dtype))
                for layer in self._layers]

    def update(self, batch: Batch, state: SumState) -> int | None:
        """Add one checked batch's per-layer ``(K, *shape)`` sums to ``state``.

        Returns:
            The counted tokens for token logits with a built-in loss (the mean loss is
            over them, method §6.3), ``None`` for one term per sample.
        """
        # Autograd on, also when called under torch.no_grad() or torch.inference_mode()
        # (both are thread-local switches).
        with torch.inference_mode(False), torch.enable_grad(), self._analysis_mode():
            xs = inputs_to_model(batch.x, batch.index, self.device, self.dtype, batch.n, batch.keywords)
            if batch.keywords:
                xs.kwargs = hf.keyword_inputs(self.model, xs.kwargs, batch.y, self.device)
            inputs_ok = deferred_inputs_finite(batch.x)
            if inputs_ok is not None:
                self._pending.append((batch.index, "inputs", inputs_ok, None))
            if self.batches_seen == 0:
                self._check_samples_apart(xs, batch)
            if self.ggn:
                terms = self._ggn_update(batch, xs, state)
            else:
                terms = self._hvp_update(batch, xs, state)
        self.batches_seen += 1
        if self.comm is not None or len(self._pending) >= PENDING_CHECKS:
            self._run_checks()  # distributed: every rank must learn of a bad batch in this step
        return terms

    @contextlib.contextmanager
    def _analysis_mode(self) -> Iterator[None]:
        """What every forward of the analysis runs in: thread-local switches, and the workarounds set on
        the model's modules until the block ends (:func:`~normflat.backends.torch.compat.model_workarounds`)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(hf.analysis_mode(self.model, self.options))
            stack.enter_context(compat.model_workarounds(self.model))
            if self._recurrent:
                # The fused recurrent kernels run as plain recurrences: vmap can batch those, and
                # their backward is much faster on CPU (compat.FunctionalKernels). Only for models
                # with recurrent layers: a function mode costs a little on every torch call.
                stack.enter_context(compat.FunctionalKernels(attention=False))
            yield

    def _pick(self, out: Any) -> Any:
        """The logits inside the model's output (the ``output`` option)."""
        return select_output(out, self.options.output, _is_tensor)

    def zeros(self, layer: int) -> torch.Tensor:
        """``(K, *shape)`` zeros of a layer the loss never reached."""
        p = self._layers[layer].param
        return torch.zeros((self.options.sum_groups, *p.shape), dtype=p.dtype, device=p.device)

    def all_finite(self, array: Any) -> bool:
        """Whether a tensor is finite. The engine's first call after the data runs the deferred
        checks first, so that bad logits or inputs get their own message rather than "the
        diagonal is not finite"."""
        self._run_checks()
        return all_finite(array)

    def canonical(self, layer: int, array: Any) -> Any:
        """A tensor of the parameter's shape in the canonical ``(out, in/groups, *k)`` layout."""
        return self._layers[layer].canonical(array)

    def kernel_axes(self, layer: int) -> tuple[int, ...]:
        """A convolution's kernel axes: its group sums are then kept as kernel sums."""
        return self._layers[layer].kernel_axes()

    def weight(self, layer: int) -> Any:
        """The canonical weight (a detached view of the parameter)."""
        return self._layers[layer].canonical(self._layers[layer].param.detach())

    def metadata(self) -> dict[str, Any]:
        """``dtype``, ``device``, ``chunk_size``, ``memory_budget``, ``token_logits``; merges the
        ranks' layer paths."""
        devices = [str(self.device)]
        chunk, token_logits = self.chunk, self.token_logits
        if self.comm is not None:
            # Called on every rank after the reduction. A rank that saw no batch never
            # learned which layers need the generic path: merge, so every rank reports alike.
            infos = self.comm.gather((self.batches_seen > 0, str(self.device),
                                      [(layer.fast, layer.spec.path, layer.spec.reason) for layer in self._layers],
                                      self.chunk, self.token_logits))
            ran = [info for info in infos if info[0]] or infos
            for i, layer in enumerate(self._layers):
                slow = next((info[2][i] for info in ran if not info[2][i][0]), None)
                if slow is not None and layer.fast:
                    layer.fast = False
                    layer.spec.path, layer.spec.reason = slow[1], slow[2]
            devices = list(dict.fromkeys(info[1] for info in infos))
            chunks = [info[3] for info in infos if info[3] is not None]
            chunk = max(chunks) if chunks else None
            token_logits = any(info[4] for info in infos)  # a rank without batches never saw the logits
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": ", ".join(devices),
            "chunk_size": chunk if self.ggn else None,
            "memory_budget": self.settings.memory_budget,
            "backend": {},
            "token_logits": token_logits,
        }

    def close(self) -> None:
        """Remove the hooks and restore the model (idempotent; the driver always calls it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.capture is not None:
                self.capture.remove()
            if self.state is not None:
                self.state.restore()
        finally:
            release(self.model)

    # ------------------------------------------------------------------ checks

    def _check_logits(self, logits: Any, batch: Batch, rows: int, inputs: ModelInputs, defer: bool = True) -> int:
        """Check the logits' type and shape now and their values
        (:func:`~normflat.engine.losses.logit_stats`) after the loop, or now if not ``defer`` (the
        first batch, whose logits decide the fast rules and the chunk); return the number of
        classes. The shape is compared with the first call's (the probe's, or the first chunk's):
        logits whose classes follow the rows mix the samples
        (:func:`~normflat.engine.losses.check_same_classes`); ``inputs``, those of the call, give
        the one-row forward asked before refusing few classes."""
        if not isinstance(logits, torch.Tensor):
            raise TypeError(
                f"The model returned a {type(logits).__name__}; normflat needs a forward that maps inputs "
                "to a (batch, classes) logits tensor."
            )
        c = losses.check_output_shape(tuple(logits.shape), self.options, batch.index, rows,
                                      seen=self._first_logits, other_rows=self._one_row(inputs))
        if self._first_logits is None:
            self._first_logits = tuple(logits.shape)
        self.token_logits = self.token_logits or logits.dim() == 3
        stats = losses.logit_stats(_XP, logits.detach())
        self._pending.append((batch.index, "logits", stats, (c, float(torch.finfo(logits.dtype).eps))))
        if not defer:
            self._run_checks()
        return c

    def _one_row(self, inputs: ModelInputs) -> Callable[[], tuple[int, ...]]:
        """The shape of the logits of the model called on the first row of ``inputs`` alone, as a function
        (:func:`~normflat.engine.losses.classes_first`: asked before refusing the first logits' classes)."""
        def shape() -> tuple[int, ...]:
            with torch.no_grad():
                return tuple(self._pick(inputs.rows(slice(0, 1)).call(self.model)).shape)
        return shape

    @contextlib.contextmanager
    def _unrecorded(self) -> Iterator[None]:
        """Forwards that the capture does not record (the checks' own forwards)."""
        cap = self.capture
        active = cap.active if cap is not None else False
        if cap is not None:
            cap.active = False
        try:
            yield
        finally:
            if cap is not None:
                cap.active = active

    def _check_samples_apart(self, xs: ModelInputs, batch: Batch) -> None:
        """:func:`check_samples_apart_of` on the first batch, nothing recorded by the capture: the first
        forward, which refuses inputs the model fails on; the error of a model that fails on one row
        alone is kept for the generic path (:meth:`_check_one_sample`)."""
        with self._unrecorded():
            self._one_sample_failure = check_samples_apart_of(self.model, xs, self._pick, batch)

    def forward_error(self, batch: Batch) -> BaseException | None:
        """:func:`forward_error_of` in the analysis' mode, unrecorded by the capture (engine protocol)."""
        with torch.inference_mode(False), self._analysis_mode(), self._unrecorded():
            return forward_error_of(self.model, batch, self.device, self.dtype, self._pick)

    def _check_one_sample(self, generic: list[TorchLayer]) -> None:
        """Refuse a model that fails on one sample alone before the generic path runs it on one
        (:func:`~normflat.engine.losses.one_sample_error`): the first batch's check found the error."""
        err = self._one_sample_failure
        if err is not None:
            raise losses.one_sample_error("torch", err, [layer.name for layer in generic],
                                          self.settings.fast) from err

    def _run_checks(self) -> None:
        """Read the deferred checks (:attr:`_pending`) with one transfer per dtype, in batch order,
        and raise the first failure with the message an eager check gives."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, kind, value, _ in pending:
            if kind != "labels":
                by_dtype.setdefault(value.dtype, []).append(value.reshape(-1))
        # Blocking reads on the stream that queued the labels' copies: those are complete after them.
        host = {dtype: iter(torch.cat(values).cpu().numpy()) for dtype, values in by_dtype.items()}
        if not by_dtype and any(kind == "labels" for _, kind, _, _ in pending):
            torch.cuda.synchronize(self.device)
        for index, kind, value, extra in pending:
            if kind == "labels":
                batch, c = extra
                labels_for(replace(batch, y=value), c, ADAPTER, self.options)
                continue
            got = [next(host[value.dtype]) for _ in range(value.numel())]
            if kind == "inputs" and not bool(got[0]):
                raise non_finite_inputs(index)
            if kind == "logits":
                c, eps = extra
                self.saturation = min(self.saturation,
                                      losses.check_logit_stats(np.asarray(got), self.options, index, c, eps))
            if kind == "loss":
                losses.check_loss_value(extra, bool(got[0]), index, self.options)

    @staticmethod
    def _deferred_labels(y: Any) -> bool:
        """Whether labels are copied without waiting and checked after the loop (the GGN of
        ``(n, C)`` logits does not need them; the Hessian-vector products' loss takes any class
        indices ``(n,)`` safely): a tensor on a CUDA device, whose read would wait for it."""
        return isinstance(y, torch.Tensor) and y.device.type == "cuda"

    def _labels(self, batch: Batch, c: int, logits: torch.Tensor, on_device: bool = True
                ) -> tuple[torch.Tensor | None, int | None]:
        """The checked labels on the device (``None`` unless ``on_device``: the GGN of ``(n, C)``
        logits does not depend on them), and the counted tokens (token logits, built-in loss) or
        ``None``."""
        tokens = int(logits.shape[1]) if logits.dim() == 3 else None
        y = batch.y
        deferred = (tokens is None and self.batches_seen > 0 and not callable(self.options.loss)
                    and self._deferred_labels(y))
        # Class indices (n,) that the loss uses on the device (exact, hutchinson) are deferred too:
        # the built-in loss compares them with the classes (engine.losses.one_hot, no gather), so
        # an index out of range selects nothing there, never a device assert, and fails the checks
        # after the loop with the eager message (those numbers are never returned). One-hot and
        # other forms are converted by the data contract on the host.
        indices = (tuple(y.shape) == (logits.shape[0],) and not y.is_floating_point() and not y.is_complex()
                   and y.dtype != torch.bool) if deferred else False
        if deferred and (not on_device or indices):
            # Copied to pinned host memory without waiting, checked by _run_checks after the
            # blocking read that follows.
            host = torch.empty(y.shape, dtype=y.dtype, pin_memory=y.is_cuda)
            host.copy_(y.detach(), non_blocking=y.is_cuda)
            # The batch kept without its inputs: they need not live until the checks.
            self._pending.append((batch.index, "labels", host, (replace(batch, x=None, y=None), c)))
            if not on_device:
                return None, None
            return y.detach().to(self.device, torch.long), None
        ids = labels_for(batch, c, ADAPTER, self.options, tokens=tokens, shift=self.shift)
        if ids is None:  # a custom loss gets the labels as given
            return to_model(batch.y, "labels", batch.index, self.device, None), None
        y = host_to_device(ids, self.device) if on_device else None
        if tokens is None or callable(self.options.loss):
            return y, None
        return y, int(np.count_nonzero(ids >= 0))  # on the host: no wait for the device

    def _loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if callable(self.options.loss):
            return self.options.loss(logits, y).reshape(()) * logits.shape[0]
        return losses.loss_sum(_XP, logits, y, self.options)

    def _check_loss(self, logits: torch.Tensor, y: torch.Tensor, index: int) -> None:
        if callable(self.options.loss):
            value = self.options.loss(logits, y)
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"Batch {index}: the loss callable returned a {type(value).__name__}; it must return "
                    "the mean loss of the batch as a scalar torch tensor (differentiable in the logits)."
                )
        else:
            value = losses.loss_sum(_XP, logits, y, self.options)
        shape = tuple(value.shape)
        losses.check_loss_value(shape, True, index, self.options)  # the shape now, the value after the loop
        self._pending.append((index, "loss", torch.isfinite(value.detach()).all(), shape))

    # ------------------------------------------------------------------ exact, hutchinson

    def _hvp_update(self, batch: Batch, xs: ModelInputs, state: SumState) -> int | None:
        with torch.no_grad():
            logits = self._pick(xs.call(self.model))
        c = self._check_logits(logits, batch, batch.n, xs, defer=self.batches_seen > 0)
        with losses.classes_first(self._first_logits, self._one_row(xs)):
            y, terms = self._labels(batch, c, logits)
        self._check_loss(logits, y, batch.index)
        del logits
        self._check_swappable(xs, self._layers)
        loss_of = hvp.functional_loss(self.model, xs, lambda z: self._loss_sum(z, y), self._pick)
        # Hessian-vector products need attention's double backward (the math kernel).
        with compat.FunctionalKernels(attention=True):
            if self.options.estimator == "exact":
                hvp.exact_update(loss_of, self._layers, self.settings.exact_chunk, state)
            else:
                assert self.probes is not None and self.options.samples is not None
                hvp.hutchinson_update(loss_of, self._layers, self.probes, self.options.samples,
                                      self.options.groups, self.settings.probe_chunk, state)
        return terms

    # ------------------------------------------------------------------ ggn, ggn-topk, ggn-mc

    def _signals_per_sample(self, c: int, tokens: int | None) -> int:
        """Back-propagated signals per sample: ``K' · M`` for ``(n, C)`` logits; for token
        logits of ``tokens`` tokens ``K' · M'`` (``M'`` of
        :meth:`~normflat.engine.options.AnalysisOptions.token_signals_per_group`: ``M · T``
        per token, a few per sequence, method §6.3); less the ones known to be zero, never
        back-propagated (:func:`~normflat.engine.losses.padding_signals`: the padding of the
        groups shorter than ``M``, the empty shared group of per-sequence ``ggn-topk``)."""
        o = self.options
        if tokens is None:
            return o.state_groups * o.signals_per_group(c) - len(losses.padding_signals(o, c))
        m = o.token_signals_per_group(c, tokens)
        if o.sequence_layout(tokens):
            return o.state_groups * m - len(losses.padding_signals(o, c, sequence=True))
        return o.state_groups * m - len(losses.padding_signals(o, c)) * int(tokens)

    def _probe(self, batch: Batch, xs: ModelInputs) -> None:
        """The first batch's checks and chunk size from a forward of its first :data:`PROBE_ROWS`
        rows: a forward of the whole batch, redone in chunks when it is too big, would double the
        forward's time and hold the whole batch's graph (the peak) only to learn the classes."""
        assert self.capture is not None
        rows = slice(0, PROBE_ROWS)
        self.capture.reset()
        xp = xs.rows(rows)
        logits = self._pick(self._forward(xp))
        c = self._check_logits(logits, batch, PROBE_ROWS, xp, defer=False)
        while True:
            while self._settle(logits, c, xp):  # a substitution refused, or calls to record one by one: again
                self.capture.reset()
                logits = self._pick(self._forward(xp))
            if not self._rows_per_sample([layer for layer in self._layers if layer.fast], logits, PROBE_ROWS):
                break
            self.capture.reset()  # layers on no batch axis to follow: again
            logits = self._pick(self._forward(xp))
        self.chunk = self._choose_chunk(logits, PROBE_ROWS, c, batch_rows=batch.n)
        self.capture.reset()

    def _forward(self, xc: ModelInputs) -> Any:
        """The model's forward on a chunk for the GGN paths, with the batch made explicit where
        the model broadcasts one row over it (method §6.1, "Position tables"):

        * each fast position table is replaced by its view expanded over the chunk's samples
          (recorded in the capture as the table's output), whose gradient is each sample's
          gradient of the table (:func:`~normflat.backends.torch.ggn.position_table_squares`);
          ``functional_call`` swaps the view in and back, the user's parameter is not touched;
        * a fast layer whose input and output have one row for the whole batch (an embedding
          of position ids ``(1, T)``) has both expanded to the samples by the capture hook, so
          its own fast rule applies.

        Nothing is copied. A substitution is checked by :meth:`_substitution_checks`; if the
        forward fails with a new one, that one is dropped (its layer takes the generic path) and
        the forward runs again.
        """
        assert self.capture is not None
        cap = self.capture
        cap.rows = xc.n
        cap.broadcast = {id(layer) for layer in self._broadcast if layer.fast and not layer.tied
                         and not layer.batchless and id(layer) not in self._unexpanded}
        cap.batchless = {id(use) for layer in self._layers if layer.fast for use in layer.uses if use.batchless}
        tables = [layer for layer in self._layers if layer.fast and layer.table and not layer.batchless]
        # Followed weights read as tensors (position tables, a weight its module never applies):
        # each its own output.
        followed_tables = [layer for layer in self._layers
                           if layer.fast and (layer.table or layer.direct) and layer.batchless]
        views = {}
        for layer in tables:
            p = layer.param.detach().requires_grad_(True)
            shape = p.shape[1:] if p.shape[0] == 1 else p.shape
            views[layer.param_name] = (layer, p.expand(xc.n, *shape))
        try:
            # Recorded where no hook sees them: the recurrent weights' maps inside the plain
            # recurrence, the lookups of embeddings with their own forward.
            with cap.recording(), cap.following([*xc.args, *xc.batched_kwargs().values()],
                                                {id(layer): layer.param for layer in followed_tables}):
                if views:
                    out = functional_call(self.model, {name: v for name, (_, v) in views.items()}, xc.args,
                                          xc.kwargs, strict=False)
                else:
                    out = xc.call(self.model)
        except Exception as why:  # noqa: BLE001 - a failure with a new substitution: drop it, run again
            fresh = [layer for layer in self._substituted() if id(layer) not in self._seen]
            if any(not _follows(layer) for layer in fresh):
                # The new expansions first: a followed layer stays followed unless the forward also
                # fails without them (a later layer's one-row output breaks it just as well).
                fresh = [layer for layer in fresh if not _follows(layer)]
            if not fresh:
                # A later chunk's shapes may break a substitution that passed before (a table
                # reshaped as one row, checked on a first chunk of one sample): drop them all.
                fresh = self._substituted()
                if not fresh:
                    raise
            for layer in fresh:
                reason = (f"the forward fails with {_expanded_what(layer)} expanded over the batch "
                          f"({type(why).__name__}: {why})")
                if _follows(layer):
                    self._refuse_batchless([layer], f"the forward fails ({type(why).__name__}: {why})")
                elif (id(layer) in cap.expanded and id(layer) not in self._unexpanded
                      and self._sequence_first(layer, xc.n)):
                    # (n, n, ...) once expanded: perhaps sequence first with one position, its one
                    # row not the batch's; the rows check decides on the next forward.
                    self._unexpanded.add(id(layer))
                    self._seen.discard(id(layer))
                elif (id(layer) in cap.expanded or layer.table) and self._followable(layer):
                    # A one-row output the model reshapes as one row (XCiT's positions): perhaps a
                    # layer on no batch axis, followed in the forward run again.
                    self._follow(layer, reason)
                else:
                    layer.disable_fast(reason)
            cap.reset()
            return self._forward(xc)
        # A followed table is its own output: each sample's gradient is pulled back to it.
        for layer, view in [*views.values(), *((layer, layer.param) for layer in followed_tables)]:
            key = id(layer)
            cap.calls[key] = 1
            cap.inputs[key] = layer.param.detach()
            cap.versions[key] = compat.tensor_version(cap.inputs[key])
            cap.outputs[key] = view
            cap.extras[key] = ((), {})
        return out

    def _substitution_checks(self, logits: torch.Tensor, xc: ModelInputs) -> bool:
        """The substitutions of :meth:`_forward` need the row added to each sample's own
        activations; a layer failing a check takes the generic path.

        The first time a layer is substituted: no use of a table left outside its view (the
        graph reaches the parameter itself), and the model's logits unchanged (one plain
        forward without gradients). That a signal at the last sample's logits reaches only that
        sample's row of the view (a model indexing the leading axis, ``P[0]``, would mix the
        samples) is :meth:`_rows_per_sample`'s check of every fast layer.

        Returns:
            Whether the logits changed: the caller runs the forward again without the refused
            substitutions.
        """
        unseen = [layer for layer in self._substituted() if id(layer) not in self._seen]
        if not unseen:
            return False
        self._seen.update(id(layer) for layer in unseen)
        tables = [layer for layer in unseen if layer.table and not layer.batchless]
        if tables:
            uses, _ = ggn_kernels.inspect_graph(logits.grad_fn, {id(layer.param): layer for layer in tables}, [])
            for layer in tables:
                if uses[id(layer.param)]:
                    layer.disable_fast("the position table is also used outside its module attribute")
        unseen = [layer for layer in unseen if layer.fast]
        if unseen and not self._same_logits(logits, xc):
            for layer in unseen:
                layer.disable_fast(f"the model computes other logits with {_expanded_what(layer)} expanded "
                                   "over the batch")
            return True
        return False

    def _substituted(self) -> list[TorchLayer]:
        """The fast layers :meth:`_forward` substituted in the last forward: the position tables,
        and the layers whose one-row output the capture expanded."""
        assert self.capture is not None
        return [layer for layer in self._layers if layer.fast and (
            layer.table or id(layer) in self.capture.expanded
            or any(id(use) in self.capture.batchless_ran for use in layer.uses))]

    def _same_logits(self, logits: torch.Tensor, xc: ModelInputs) -> bool:
        """Whether a plain forward (no substitution, no gradients) gives these logits."""
        assert self.capture is not None
        self.capture.active = False
        try:
            with torch.no_grad():
                plain = self._pick(xc.call(self.model))
        finally:
            self.capture.active = True
        z = logits.detach()
        tol = 64 * float(torch.finfo(z.dtype).eps) * (float(z.abs().max()) + 1.0) if z.numel() else 0.0
        return (isinstance(plain, torch.Tensor) and plain.shape == z.shape
                and bool(((plain - z).abs() <= tol).all()))

    def _settle(self, logits: torch.Tensor, c: int, xc: ModelInputs) -> bool:
        """On a first forward: resolve ``estimator="auto"`` from the classes (token logits count
        the signals per sequence, method §6.3) and check the fast rules (:meth:`_first_check`:
        before the chunk is chosen, since a batched backward holds every signal's intermediates
        at once, a looped one a signal's at a time); on every forward, the new substitutions
        (:meth:`_substitution_checks`).

        Returns:
            Whether the forward must run again (a substitution changed the logits, or a module's
            calls are now recorded one by one). Each happens once per layer, so the caller's loop
            of forwards ends.
        """
        if self.options.estimator == "auto":
            self.options = resolve_estimator(self.options, c,
                                             tokens=int(logits.shape[1]) if logits.dim() == 3 else None)
        fast = [layer for layer in self._layers if layer.fast]
        again = bool(not self.checked and fast and self._first_check(logits, fast))
        return self._substitution_checks(logits, xc) or again

    def _choose_chunk(self, logits: torch.Tensor, rows: int, c: int, batch_rows: int | None = None) -> int:
        """Samples per GGN step: bound the signal rows back-propagated at once.

        ``logits`` and the captured layer outputs are those of ``rows`` samples; ``batch_rows``
        (default ``rows``) is the batch a training step would take.
        """
        tokens = int(logits.shape[1]) if logits.dim() == 3 else None
        per_sample = self._signals_per_sample(c, tokens)
        tokens = tokens or 1  # the entries of one signal are c · tokens
        from normflat.core.memory import chunk_size_for, default_budget, training_step_bytes

        # Per sample: the signals at every fast layer output, a second copy of them for a batched
        # backward's intermediates or a rule that takes them stacked (a looped backward into the
        # built-in rules holds one signal's intermediates at a time), and the generic path's
        # per-signal weight gradients.
        assert self.capture is not None
        item = logits.element_size()
        outs = sum(self.capture.outputs[id(use)].numel() // rows for layer in self._layers
                   for use in layer.uses if id(use) in self.capture.outputs and not use.batchless)
        # A layer on no batch axis gets each sample's signals at its whole output, pulled back from
        # the views where it meets the batch, which get them first.
        outs += sum(self.capture.outputs[id(use)].numel() for layer in self._layers
                    for use in layer.uses if use.batchless and id(use) in self.capture.outputs)
        outs += sum(view.numel() // rows for _, view in self.capture.meetings)
        generic = [layer for layer in self._layers if not layer.fast]
        weights = sum(layer.param.numel() for layer in generic)
        stacked = any(layer.fast and not ggn_kernels.wants_deltas(layer.ext.ggn_squares) for layer in self._layers)
        copies = 2 if self.batched or stacked else 1
        # The generic path's vectorized backward holds, for every signal of every sample, the
        # gradients of every intermediate of the forward (attention scores, normalizations, the
        # nonlinearities' inputs): about four times the layer outputs, measured on ViT-Tiny, whose
        # position table alone on this path peaked at 7× a training step without this term.
        backward = 4 * outs if generic else 0
        # Per sample, beside its signals: the chunk's forward graph, kept for the backward of every
        # signal (about twice the layer outputs, as in a training step), and the gradients of the
        # intermediates one signal's backward holds while it runs (about as much again; measured on
        # ViT-Tiny, whose retained signals alone under-counted its peak by a fifth).
        graph = 4 * (outs + c * tokens)
        # The signals at the logits and their gradients at every layer output; where they start
        # at a dense head's input instead (structured, method §6.2), none at the logits or at the
        # head's output (the logits again), one at its input.
        signal = outs + c * tokens
        fast = [layer for layer in self._layers if layer.fast]
        heads = self._heads(logits, fast)
        start = self._head_input(logits, heads, [layer for layer in fast if layer not in heads])
        if start is not None:
            signal = outs - c * tokens + start.numel() // rows
        per_signal = copies * signal + weights + backward
        need = item * (per_sample * per_signal + graph)
        self.signal_step = None
        if self.settings.memory_budget is not None:
            budget = self.settings.memory_budget
            if need <= budget:
                return chunk_size_for(budget, need, "the back-propagated GGN signals")
            # One sample at a time, its signals in steps: an error only if one member of every
            # group does not fit (as the other backends, which step through the signals too).
            groups = self.options.state_groups
            chunk_size_for(budget, item * (groups * per_signal + graph), "one back-propagated GGN signal" + (
                f" of each of the {groups} groups" if groups > 1 else ""))
            self._step_signals((budget - item * graph) // (item * per_signal), per_sample)
            return 1
        # No budget given: about twice a training step of this model on this batch (method §9),
        # and never more signal rows at once than DEFAULT_SIGNAL_ROWS.
        params = sum(p.numel() for p in self.model.parameters())
        step = training_step_bytes(params, (outs + c * tokens) * (batch_rows or rows), item)
        state = item * estimators.state_entries(self.options, [
            (layer.param.numel(), math.prod(layer.param.shape[a] for a in layer.kernel_axes()))
            for layer in self._layers])
        budget = default_budget(step, state)
        if need <= budget and per_sample <= DEFAULT_SIGNAL_ROWS:
            return max(1, min(budget // need, DEFAULT_SIGNAL_ROWS // per_sample))
        # One sample's signals alone exceed the budget (the exact ggn of a large model with many
        # classes: C − 1 gradients of every layer output): one sample at a time, its signals in
        # steps, so that the peak stays bounded whatever the number of classes.
        self._step_signals(min(DEFAULT_SIGNAL_ROWS, max(budget - item * graph, 0) // (item * per_signal)),
                           per_sample)
        return 1

    def _step_signals(self, signals: int, per_sample: int) -> None:
        """Back-propagate about ``signals`` of one sample's ``per_sample`` signals at a time
        (:meth:`_member_steps`; at least one member of every group)."""
        self.signal_step = max(int(signals), self.options.state_groups)
        if self.signal_step >= per_sample:
            self.signal_step = None

    def _member_ranges(self, k: int, m: int) -> list[tuple[int, int]]:
        """Member ranges ``[start, stop)`` of a ``(K', M)`` signal layout in equal steps of at
        most :attr:`signal_step` signals (at least one member of every group); one range when
        the signals are not stepped."""
        if self.signal_step is None or k * m <= self.signal_step:
            return [(0, m)]
        step = equal_step(m, max(1, self.signal_step // k))
        return [(a, min(m, a + step)) for a in range(0, m, step)]

    def _member_steps(self, block: tuple[torch.Tensor, list[int]]) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """A block of :meth:`_skipped` signals ``(K', M, ...)`` in the steps of
        :meth:`_member_ranges`, each step with its own zero indices: the groups' sums add up over
        the steps (each signal is squared on its own)."""
        sig, zero = block
        k, m = int(sig.shape[0]), int(sig.shape[1])
        ranges = self._member_ranges(k, m)
        if len(ranges) == 1:
            yield block
            return
        skipped = set(zero)
        for a, b in ranges:
            yield sig[:, a:b], [g * (b - a) + j - a for g in range(k) for j in range(a, b) if g * m + j in skipped]

    def _factor_steps(self, factor: losses.Factor, num_classes: int
                      ) -> Iterator[tuple[losses.Factor, list[int]]]:
        """The members of a :class:`~normflat.engine.losses.Factor` of ``num_classes`` logits in the
        steps of :meth:`_member_ranges`, each with the flat indices of its padding
        (:func:`~normflat.engine.losses.padding_signals`): the dense or pulled-back signals of one
        step are formed only when they are wanted, so that the ``C − 1`` signals of the exact
        ``ggn`` (``C²`` numbers a sample) never exist whole."""
        m = int(factor.index.shape[1])
        ranges = self._member_ranges(int(factor.index.shape[0]), m)
        if len(ranges) == 1:
            yield factor, losses.padding_signals(self.options, num_classes, (0, m))
            return
        for a, b in ranges:
            yield factor.members(a, b), losses.padding_signals(self.options, num_classes, (a, b))

    def _sequence_head_blocks(self, z: torch.Tensor, counted: torch.Tensor, uniforms: torch.Tensor | None,
                              weight: torch.Tensor) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """Per-sequence signals of token logits ``(n, T, C)`` at the input of a dense head of ``(C, d)``
        ``weight``, ``(K', M', n, T, d)`` a few members of every group at a time
        (:func:`~normflat.engine.losses.sequence_factor`: each token's signed class signal pulled
        through the head, ``O(d)`` per signal and token), each block with its padding
        (:func:`~normflat.engine.losses.padding_signals`)."""
        n, t, _ = z.shape
        factor = losses.sequence_factor(_XP, z, self.options, counted, uniforms)
        projected = factor.projected(_XP, weight)  # the shared vectors through the head, once per chunk
        k, m = int(factor.index.shape[0]), int(factor.index.shape[1])
        step = _sequence_step(m, k, n, t * int(weight.shape[-1]))
        for start in range(0, m, step):
            members = (start, min(m, start + step))
            rows = factor.members(*members).through(_XP, weight, projected)  # (K', M', n·T, d)
            yield (rows.reshape(k, rows.shape[1], n, t, -1),
                   losses.padding_signals(self.options, int(z.shape[-1]), members, sequence=True))

    def _first_check(self, logits: torch.Tensor, fast: list[TorchLayer]) -> bool:
        """On the first forward: the fast rules need each weight used once, by its own module,
        called once per forward (a substituted one: :meth:`_substitution_checks`); and the graph decides
        batched vs looped backward.

        A dense layer or embedding whose module is called ``k`` times per forward (ALBERT's shared
        layers, a siamese network), its weight used once per call, is a weight with ``k`` uses: each
        call is recorded on its own (:meth:`~normflat.backends.torch.ggn.Capture.repeat`) and the
        per-sample gradients of the calls are summed before they are squared (method §6.1, "Tied
        weights"). The calls are told apart from the next forward on, which is checked anew. So is a
        dense layer whose module is never called but whose weight the graph uses once (timm's BEiT
        attention: ``F.linear(x, weight=self.qkv.weight, bias=...)``): it is recorded at that
        ``F.linear`` call (:class:`~normflat.backends.torch.ggn.FunctionalTaps`).

        Returns:
            Whether the forward must run again (calls to record one by one, or functional calls).
        """
        assert self.capture is not None
        cap = self.capture
        for layer in fast:
            if any(id(use) in cap.outputs and not cap.outputs[id(use)].requires_grad for use in layer.uses):
                # A module returning a detached tensor where its rule takes the signals: none reach it.
                layer.disable_fast("no signal reaches the first output it returns, where its rule takes the signals"
                                   if ggn_kernels.first_of_tuple(layer.ext.ggn_squares) else
                                   "its output is outside the autograd graph (a detached tensor): no signal reaches it")
        fast = [layer for layer in fast if layer.fast]
        outs = [cap.outputs[id(use)] for layer in fast for use in layer.uses if id(use) in cap.outputs]
        uses, self.batched = ggn_kernels.inspect_graph(logits.grad_fn, {id(layer.param): layer for layer in fast},
                                                       outs)
        for layer in fast:
            if ggn_kernels.normalizes_weight(layer.ext.ggn_squares):
                # A weight-normalized direction (or a spectrally normalized V) enters the graph through
                # each evaluation of the weight, by one or two edges: count the weight's applications.
                edges = ggn_kernels.normalization_edges(layer.module)
                if uses[id(layer.param)] % edges == 0:
                    uses[id(layer.param)] //= edges
        again = False
        for layer in fast:
            if layer.table:
                continue
            calls = [cap.calls.get(id(use), 0) for use in layer.uses]
            if layer.tied and 0 in calls and any(calls):
                # A tied weight whose own module (or another user) never runs: the uses that run are
                # all there is (BART's model.shared, used by its embeddings and its head only). Every
                # chunk checks that the idle ones stay so.
                layer.idle = [*layer.idle, *(use for use, count in zip(layer.uses, calls) if not count)]
                calls = [cap.calls.get(id(use), 0) for use in layer.uses]
            if not any(calls) and uses[id(layer.param)] == 0 and not cap.watches(layer):
                # A weight no module runs and the graph does not reach (mBART's cross-attention in
                # a forward without an encoder, Inception's auxiliary head in eval mode): its
                # curvature is zero, and it takes no path at all. Every chunk checks that it stays
                # idle (a later one that runs it takes the generic path, the earlier zeros exact).
                layer.idle = [layer, *layer.tied]
                layer.spec.extra["unused"] = UNUSED_NOTE
                continue
            if (calls == [0] and not layer.tied and layer.ext.ggn_squares in ggn_kernels.APPLIED_FUNCTIONALLY
                    and isinstance(layer.module, ggn_kernels.APPLIED_FUNCTIONALLY[layer.ext.ggn_squares])
                    and uses[id(layer.param)] == 1 and not cap.watches(layer)):
                # A dense or convolution weight the model applies itself, its module never called (timm's
                # BEiT: F.linear(x, weight=self.qkv.weight, bias=...); transformers' Mamba: F.conv1d on a
                # view of conv1d.weight, dt_proj.weight @ x; x @ W.T): recorded at that call from the next forward
                # on, which is checked again.
                cap.watch_functional(layer)
                again = True
            elif calls == [0] and cap.watches(layer):
                why = ("module called 0 times per forward, and its weight is not used through one F.linear call "
                       "or product W @ x or x @ W.T" if isinstance(layer.module, nn.Linear) else
                       "module called 0 times per forward, and its weight is not used through one functional "
                       "convolution with the module's stride, padding, dilation and groups")
                again = self._follow_weight(layer, uses, why) or again
            elif calls == [0] and layer.ext.ggn_squares is ggn_kernels.recorded_lookup_squares:
                layer.disable_fast(f"{type(layer.module).__name__} overrides the forward of Embedding and does not "
                                   "look its weight up once with F.embedding as nn.Embedding does")
            elif calls == [0] and layer.ext.ggn_squares is ggn_kernels.attention_squares:
                layer.disable_fast("nn.MultiheadAttention ran without its projections recorded (an unbatched, "
                                   "2-D input, or torch's native inference path)")
            elif calls == [0] and ggn_kernels.recorded_inside(layer.ext.ggn_squares):
                layer.disable_fast("its recurrence ran on torch's fused kernel (a packed sequence), whose "
                                   "steps cannot be observed")
            elif (len(calls) == 1 and calls[0] > 1 and uses[id(layer.param)] == calls[0]
                  and id(layer) in cap.outputs and not layer.tied and layer.sums_uses and not cap.watches(layer)):
                calls_after = [TiedUse(layer.module, layer.ext) for _ in range(calls[0] - 1)]
                layer.tied.extend(calls_after)
                cap.repeat(id(layer), [id(use) for use in calls_after])
                again = True
            elif any(count != 1 for count in calls):
                extra = (f" and its weight used {uses[id(layer.param)]} times in the graph"
                         if len(calls) == 1 and calls[0] > 1 and uses[id(layer.param)] != calls[0] else "")
                why = f"module called {next(c for c in calls if c != 1)} times per forward{extra}"
                if calls != [0] or not self._follow_weight(layer, uses, why):
                    layer.disable_fast(why)
                else:
                    again = True
            elif (uses[id(layer.param)] == 0 and not layer.tied and calls == [1] and id(layer) in cap.outputs
                  and not ggn_kernels.recorded_inside(layer.ext.ggn_squares)):
                # Run, but the logits do not depend on its output (a pooler beside the sequence
                # output a head reads, BigBird's): no signal reaches it and its rule adds nothing,
                # which is exact; a later forward whose logits do depend on it gets its rule.
                pass
            elif not layer.direct and uses[id(layer.param)] != self._uses_inside(layer):
                layer.disable_fast(f"weight used {uses[id(layer.param)]} times in the graph" if not layer.tied else
                                   f"tied weight used {uses[id(layer.param)]} times in the graph, not once per "
                                   f"module ({len(layer.uses)})")
            elif any(id(use) not in cap.outputs for use in layer.uses):
                layer.disable_fast("module input or output is not a single tensor")
        # With calls newly told apart or recorded, the next forward is checked again: its graph
        # decides the backward with every call's output among the targets.
        self.checked = not again
        return again

    def _uses_inside(self, layer: TorchLayer) -> int:
        """The graph edges to a fast layer's weight its rule accounts for: one per module using it,
        or, for a module that reads it once per expert (:func:`~normflat.backends.torch.ggn.inner_uses`),
        those between its output and its input; any other use leaves the fast path."""
        assert self.capture is not None
        if ggn_kernels.recorded_inside(layer.ext.ggn_squares):
            return self.capture.weight_uses.get(id(layer), 1)  # one per step for a weight applied in the loop
        if layer.tied or not ggn_kernels.inner_uses(layer.ext.ggn_squares):
            return len(layer.uses)
        out, given = self.capture.outputs[id(layer)], self.capture.live_inputs[id(layer)]
        inside, _ = ggn_kernels.inspect_graph(out.grad_fn, {id(layer.param): layer}, [],
                                              stop=[given.grad_fn] if given.grad_fn is not None else [])
        return max(inside[id(layer.param)], 1)

    def _signal_blocks(self, logits: torch.Tensor, counted: torch.Tensor | None,
                       uniforms: torch.Tensor | None, diagonal: bool = False
                       ) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """The GGN signals of a chunk, in blocks ``(K, M', rows, *logits.shape[1:])``, each with the
        flat indices of its padding (:func:`~normflat.engine.losses.padding_signals`: the zero
        signals that fill the groups shorter than ``M``, never back-propagated).

        ``diagonal``: the one-signal :func:`~normflat.engine.losses.diagonal_signals` of a
        dense head whose output is the logits, instead of the estimator's signals.

        ``(n, C)`` logits: one block from :func:`~normflat.engine.losses.output_signals`.
        Token logits ``(n, T, C)``: the signals of :func:`~normflat.engine.losses.token_signals`
        (method §6.3; ignored tokens zero). Per token (the exact ``ggn``, ``diagonal``, or
        ``sequence_signals=False``: each token's factor placed at its own position) they are
        formed a few tokens at a time, so that the placed ``(K, M·T, n, T, C)`` tensor, which
        grows with ``T²``, never exists whole. Per sequence every signal spans all tokens; they
        are formed a few members of every group at a time (the same draws and signs), which
        bounds the signals formed and back-propagated together.
        """
        z = logits
        c = int(z.shape[-1])
        if z.dim() == 2:
            if diagonal:
                yield losses.diagonal_signals(_XP, z, self.options), []  # (K', 1, rows, C)
            elif self.signal_step is None:
                yield (losses.output_signals(_XP, z, self.options, uniforms),  # (K', M, rows, C)
                       losses.padding_signals(self.options, c))
            else:  # one sample's signals in steps: formed a step at a time, never (K', C − 1, 1, C) at once
                factor = losses.output_factor(_XP, z, self.options, uniforms)
                for members, padding in self._factor_steps(factor, c):
                    yield members.dense(_XP), padding  # (K', M', rows, C)
            return
        assert counted is not None
        n, t, c = z.shape
        k = self.options.state_groups
        if not diagonal and self.options.sequence_layout(t):
            m = self.options.token_signals_per_group(c, t)
            # A few members of every group at a time, formed as they are needed: each group's sums
            # add up over the blocks, and the dense signals, the largest arrays of a language model's
            # analysis, never exist whole.
            step = _sequence_step(m, k, n, t * c)
            # Each token's classes, scales and probabilities once per chunk (a top-k and a draw over
            # the vocabulary per token); each block's dense signals from them.
            classes = losses.sequence_classes(_XP, z, self.options, counted, uniforms)
            for start in range(0, m, step):
                span = (start, min(m, start + step))
                yield (losses.sequence_members(_XP, classes, self.options, t, span),
                       losses.padding_signals(self.options, c, span, sequence=True))
            return
        m = 1 if diagonal else self.options.signals_per_group(c)  # signals per token and group
        per_token = k * m * n * t * c
        step = max(1, min(t, TOKEN_SIGNAL_ENTRIES // max(per_token, 1),
                          DEFAULT_SIGNAL_ROWS // max(m * n, 1)))
        for start in range(0, t, step):
            window = min(t, start + step) - start
            yield (losses.token_signals(_XP, z, self.options, counted, uniforms,
                                        tokens=(start, start + window), diagonal=diagonal),
                   [] if diagonal else losses.padding_signals(self.options, c, tokens=window))

    def _ggn_update(self, batch: Batch, xs: ModelInputs, state: SumState) -> int | None:
        n = batch.n
        assert self.capture is not None
        cap = self.capture
        if self.chunk is None and n > PROBE_ROWS:
            self._probe(batch, xs)
        step = self.chunk or n
        if step < n:  # equal chunks (64 + 64, not 126 + 2): the same peak, fewer passes wasted on a remainder
            step = equal_step(n, step)
        ids: torch.Tensor | None = None
        terms: int | None = None
        labelled = False
        for start in range(0, n, step):
            sl = slice(start, min(n, start + step))
            rows = sl.stop - sl.start
            xc = xs.rows(sl)
            cap.reset()
            logits = self._pick(self._forward(xc))
            c = self._check_logits(logits, batch, rows, xc, defer=self.batches_seen > 0)
            while self._settle(logits, c, xc):  # a substitution refused, or calls to record one by one: again
                cap.reset()
                logits = self._pick(self._forward(xc))
            if not labelled:
                # The data contract: labels in range. The GGN uses the labels of token logits only,
                # for the counted tokens.
                with losses.classes_first(self._first_logits, self._one_row(xc)):
                    ids, terms = self._labels(batch, c, logits, on_device=logits.dim() == 3)
                labelled = True
            fast = [layer for layer in self._layers if layer.fast]
            if self.chunk is None:
                # The class count is known after the first forward, which is redone in chunks if
                # the whole batch is too big.
                self.chunk = self._choose_chunk(logits, rows, c)
                if self.chunk < rows:
                    cap.reset()
                    del logits
                    return self._ggn_update(batch, xs, state)
            tokens = int(logits.shape[1]) if logits.dim() == 3 else None
            counted = None
            if tokens is not None:
                if callable(self.options.loss) or ids.dim() != 2:
                    raise ValueError(
                        f"Batch {batch.index}: the GGN estimators of token logits need the built-in losses "
                        "('ce' or 'nsce') and integer token labels; use estimator='exact' or 'hutchinson' "
                        "with a custom loss."
                    )
                counted = (ids[sl] >= 0).to(logits.dtype)
            uniforms = None
            if self.options.draws:
                # Per sample (token logits: per token, the class draws then the signs of §6.3).
                columns = self.options.uniform_columns(tokens)
                u = nrandom.sample_uniforms(self.options.seed, self.rank, batch.offset + start, rows, columns)
                uniforms = host_to_device(u, logits.device).to(logits.dtype)
            for layer in fast:
                if "unused" in layer.spec.extra and any(cap.calls.get(id(use), 0) for use in layer.idle):
                    layer.disable_fast("unused by the first forward, run by a later one (the earlier zeros are "
                                       "exact)")
                elif (any(cap.calls.get(id(use), 0) != 1 or cap.modified(id(use)) for use in layer.uses)
                        or any(cap.calls.get(id(use), 0) for use in layer.idle)):
                    # Dynamic models: re-checked on every chunk; earlier chunks' sums stay valid.
                    layer.disable_fast("layer not called exactly once, or its input modified in place")
            while self._rows_per_sample([layer for layer in self._layers if layer.fast], logits, rows):
                cap.reset()  # layers on no batch axis to follow: again
                logits = self._pick(self._forward(xc))
                while self._settle(logits, c, xc):
                    cap.reset()
                    logits = self._pick(self._forward(xc))
            fast = [layer for layer in self._layers if layer.fast]
            z = logits.detach()
            sequence = self.options.sequence_layout(int(z.shape[1]) if z.dim() == 3 else None)
            heads = self._heads(logits, fast)
            if heads:
                # A dense head's squares need only the diagonal of the logit Hessian: exact at the
                # cost of one signal (method §6.2), with nothing to back-propagate.
                if z.dim() == 3:
                    self._token_head_squares(z, counted, heads, state)
                else:
                    for sig, _ in self._signal_blocks(z, counted, None, diagonal=True):
                        self._head_squares(sig, heads, state)
                fast = [layer for layer in fast if layer not in heads]
                start = self._head_input(z, heads, fast)
                if start is not None:
                    # The other layers' signals start at the head's input, pulled back through the
                    # head in structured form: O(C·d) per sample, not O(C²·d) (losses.Factor); per
                    # sequence, O(d) per signal and token, no (K', M', n, T, C) signals formed.
                    head = heads[0]
                    weight = head.module.weight.detach()
                    if head.ext.ggn_squares is ggn_kernels.transposed_linear_squares:
                        weight = weight.t()
                    if z.dim() == 2:
                        factor = losses.output_factor(_XP, z, self.options, uniforms)
                        projected = factor.projected(_XP, weight)  # once, not per step
                        for members, padding in self._factor_steps(factor, int(z.shape[-1])):
                            sig = members.through(_XP, weight, projected)
                            for block in self._member_steps(self._skipped(sig, False, padding)):
                                self._fast_squares(start, block, fast, state)
                    else:
                        for sig, padding in self._sequence_head_blocks(z, counted, uniforms, weight):
                            for block in self._member_steps(self._skipped(sig, True, padding)):
                                self._fast_squares(start, block, fast, state)
                    fast = []
            # Each path forms the signals anew, one block at a time (the same draws, so the same
            # signals), so that no more than one block exists (memory).
            if fast:
                for block in self._prepared_blocks(z, counted, uniforms, sequence):
                    self._fast_squares(logits, block, fast, state)
                    fast = [layer for layer in fast if layer.fast]
            del logits
            cap.reset()
            generic = [layer for layer in self._layers if not layer.fast]
            if generic:
                self._check_one_sample(generic)
                cap.active = False
                try:
                    self._check_swappable(xc, generic)
                    for block in self._prepared_blocks(z, counted, uniforms, sequence):
                        self._generic_squares(xc, block, generic, state)
                finally:
                    cap.active = True
        return terms

    def _rows_per_sample(self, fast: list[TorchLayer], logits: torch.Tensor, rows: int) -> None:
        """Which rows of each fast layer's output belong to which of the chunk's ``rows`` samples.

        The fast rules take the output's leading axis for the samples. That is checked once per
        layer, on the first forward of two samples or more (the probe's, cheap), by a signal at
        the last sample's logits, which must reach only that sample's rows: an output of the same
        length as the batch by chance (a layer on a batch-independent table of as many rows)
        fails it. A dense layer may see the batch folded into the leading axis (``(n·f, ...)``:
        Swin's or MaxViT's attention windows, each sample's ``f`` windows one after the other):
        its per-sample gradient sums the sample's block of rows (:meth:`_fast_squares`), and so may a
        convolution (MViTv2's pooling of each head's map). A chunk of one sample owns every row.
        Anything else (an output broadcast over the batch, a factor that changes) takes the
        generic path, which is exact. A
        substituted layer (:meth:`_forward`: a position table's view, a one-row output expanded)
        has one row per sample by construction; the check finds a forward that mixes them.
        """
        assert self.capture is not None
        cap = self.capture
        self._chunk_folds = {}
        self._chunk_second = set(self._second_axis)
        unchecked: list[tuple[TorchLayer, int]] = []
        refused: list[tuple[TorchLayer, str]] = []
        second: list[tuple[TorchLayer, str]] = []  # perhaps sequence-first: checked on the second axis
        again = False
        for layer in fast:
            if not layer.uses:  # unused (_first_check): no output
                continue
            if layer.batchless and not layer.tied:
                continue  # checked where it meets the batch (_check_meetings)
            if id(layer) in self._second_axis:
                out = cap.outputs[id(layer)]
                if out.dim() < 2 or out.shape[1] != rows:
                    layer.disable_fast(f"its output has the samples on its second axis in one chunk but not in "
                                       f"another ({tuple(out.shape)}, {rows} samples)")
                continue
            live = [use for use in layer.uses if not use.batchless]
            sizes = {_leading(cap.outputs[id(use)]) for use in live}
            if len(sizes) > 1 and layer.tied and rows > 1:
                # A weight applied to the batch and to a batch-less tensor (DeBERTa-v3's projections,
                # on the tokens and on the relative embeddings): the batch-less calls are followed.
                odd = [use for use in live if _leading(cap.outputs[id(use)]) != rows]
                if len(odd) < len(live) and all(self._followable(layer, use) for use in odd):
                    for use in odd:
                        self._follow(layer, "its calls' outputs have different leading axes "
                                     f"({sorted(sizes)}), not one row per sample ({rows}) each", use)
                    again = True
                    continue
            size = sizes.pop() if len(sizes) == 1 else -1
            dense = (not layer.tied and ggn_kernels.foldable(layer.ext.ggn_squares) and size > 0
                     and cap.inputs[id(layer)].dim() > 0 and int(cap.inputs[id(layer)].shape[0]) == size)
            if size == rows and rows == 1:
                continue
            if rows == 1 and dense:
                self._chunk_folds[id(layer)] = size
                continue
            if rows == 1 and self._sequence_first(layer, rows):
                self._chunk_second.add(id(layer))  # (T, 1, ...): the one sample owns every row
                continue
            if size < 1 or size % rows or (size != rows and not dense):
                # An output broadcast over the batch (position ids of shape (1, T)): the signals
                # of all samples would be summed before squaring.
                (second if self._sequence_first(layer, rows) else refused).append((layer, (
                    "output broadcast over the batch" if size == 1 else
                    f"its output's leading axis ({size}) is not one row (or, for a dense layer or a "
                    f"convolution, one block of rows) per sample ({rows})")))
                continue
            fold = size // rows
            known = self._folds.get(id(layer))
            if known is None:
                unchecked.append((layer, fold))
            elif known != fold:
                layer.disable_fast(f"its output has {known} rows per sample in one chunk and {fold} in another")
            elif fold > 1:
                self._chunk_folds[id(layer)] = fold
        if unchecked or second:
            # One backward pass for both checks: the rows of the unchecked layers, and the columns of
            # the sequence-first candidates (those seen so far, and those the rows check refuses).
            outputs = [cap.outputs[id(use)] for layer, _ in unchecked for use in layer.uses if not use.batchless]
            outputs += [cap.outputs[id(layer)] for layer, _ in second]
            grads = iter(torch.autograd.grad(logits, outputs, grad_outputs=_last_sample_probe(logits),
                                             retain_graph=True, allow_unused=True))
            columns: list[tuple[TorchLayer, str, torch.Tensor | None]] = []
            for layer, fold in unchecked:
                mine = [next(grads) for use in layer.uses if not use.batchless]
                mixed = [g is not None and bool(g[:-fold].abs().amax() > 0) for g in mine]
                if any(mixed):
                    if layer.table or id(layer) in cap.expanded:
                        why = f"{_expanded_what(layer)} is not added to each sample's own activations"
                    elif fold == 1:
                        why = "its output's leading axis is not the batch"
                    else:
                        why = (f"its output's leading axis has {fold} rows per sample, but not one block of rows "
                               "per sample")
                    why = f"{why} (one sample's signal reaches the other samples' rows)"
                    if self._sequence_first(layer, rows):  # untied: its one use's gradient is its output's
                        columns.append((layer, why, mine[0]))
                    else:
                        refused.append((layer, why))
                    continue
                self._folds[id(layer)] = fold
                if fold > 1:
                    self._chunk_folds[id(layer)] = fold
            for layer, why, g in [(layer, why, next(grads)) for layer, why in second] + columns:
                # Sequence-first: a signal at the last sample's logits reaches only the last column.
                if g is not None and bool(g[:, :-1].abs().amax() > 0):
                    refused.append((layer, why))
                else:
                    self._second_axis.add(id(layer))
                    self._chunk_second.add(id(layer))
        for layer, why in refused:
            if self._followable(layer):
                # Perhaps a layer on no batch axis: followed to where its output meets the batch, in
                # a forward run again (once per layer; its reason stands if that fails).
                self._follow(layer, why)
                again = True
            else:
                layer.disable_fast(why)
        followed = [layer for layer in fast if _follows(layer) and layer.fast]
        if followed and not again:
            # Checked once no layer waits to be followed: a one-row output still expanded downstream
            # of a followed layer copies it over the batch where the model does not (Swin V2's first
            # MLP layer followed, the second still expanded).
            again = self._check_meetings(followed, logits, rows)
        return again

    def _sequence_first(self, layer: TorchLayer, rows: int) -> bool:
        """Whether a layer may have the samples on its second axis (``(T, n, ...)``): a dense layer or
        an embedding with one use whose input and output have ``rows`` entries there."""
        assert self.capture is not None
        a, out = self.capture.inputs.get(id(layer)), self.capture.outputs.get(id(layer))
        return (not layer.tied and layer.ext.ggn_squares in _SECOND_AXIS_RULES and a is not None
                and out is not None and a.dim() >= 2 and out.dim() >= 2 and a.shape[1] == rows
                and out.shape[1] == rows and a.shape[0] == out.shape[0])

    def _follow(self, layer: TorchLayer, why: str, use: "TorchLayer | TiedUse | None" = None) -> None:
        """Follow a layer (or one of its calls, ``use``) that failed the rows check for ``why`` from
        the next forward on, whose substitutions are checked anew (:meth:`_substitution_checks`)."""
        use = layer if use is None else use
        self._batchless_tried[id(use)] = why
        self._batchless_tried.setdefault(id(layer), why)
        self._seen.discard(id(layer))
        use.batchless = True
        self._meetings_changed()

    def _meetings_changed(self) -> None:
        """The followed layers changed: their meetings are checked anew."""
        self._meetings_checked, self._meetings_apart, self._meetings_whole = None, False, False

    def _follow_weight(self, layer: TorchLayer, uses: dict[int, int], why: str) -> bool:
        """Follow a weight its module never applies but the graph reads as a tensor (DeBERTa-v3's
        ``rel_embeddings.weight``, normalized and projected without a batch axis; DeBERTa-v2's, sliced
        by every layer) from the next forward on, as its own output (method §6.1, "Layers on no batch
        axis"): whether it is (else the layer takes the generic path for ``why``). Every read goes
        through the function mode, and the meetings' check sees every path."""
        if layer.tied or layer.table or uses[id(layer.param)] < 1 or id(layer) in self._batchless_tried:
            layer.disable_fast(why)
            return False
        layer.direct = True
        self._follow(layer, why)
        return True

    def _followable(self, layer: TorchLayer, use: "TorchLayer | TiedUse | None" = None) -> bool:
        """Whether a layer (or one of its calls, ``use``) that failed the rows check may be one on no
        batch axis, tried once: a plain rule (its module applies its weight to its one input) with
        per-sample gradients, and one use, or calls of one module whose per-sample gradients are
        summed (:meth:`_tied_squares`)."""
        rule = layer.ext.ggn_squares
        if layer.table:  # a table added to a batch folded into the leading axis (TNT's pixel positions)
            return id(layer) not in self._batchless_tried
        key = id(layer if use is None else use)
        one = len(layer.uses) == 1 if use is None else layer.sums_uses
        return (key not in self._batchless_tried and (use is not None or not layer.tied)
                and one and rule is not None and ggn_kernels.wants_deltas(rule)
                and rule in ggn_kernels.PER_SAMPLE_GRADIENTS and not ggn_kernels.wants_call(rule)
                and not ggn_kernels.recorded_inside(rule) and not ggn_kernels.first_of_tuple(rule)
                and not ggn_kernels.inner_uses(rule) and not self.capture.watches(layer))

    def _refuse_batchless(self, layers: list[TorchLayer], why: str | None) -> None:
        """The followed layers take the generic path: the reason they failed the rows check, and
        why following them failed (``None``: theirs alone, e.g. their input carries the batch)."""
        for layer in layers:
            first = self._batchless_tried.get(id(layer), "")
            for use in layer.uses:
                use.batchless = False
            layer.batchless = layer.direct = False
            layer.disable_fast(first if why is None else f"{first}; followed to where it meets the batch: {why}")
        self._meetings_changed()

    def _check_meetings(self, followed: list[TorchLayer], logits: torch.Tensor, rows: int) -> bool:
        """The meetings of the layers on no batch axis (:class:`~normflat.backends.torch.ggn.BatchlessTaps`):
        each a batch-less operand whose view is expanded over the batch's leading axis (a block of
        rows per sample). The first time, two probes of the logits: one at the last sample's,
        which must reach only that sample's rows of each view, and one at every sample's, whose
        gradient at each layer's output must be the same through the meetings as through the
        whole graph (no other path from the layer to the logits). Later forwards must meet the
        batch as many times, as blocks of rows.

        Returns:
            Whether the forward must run again: some layers' outputs met the batch where they cannot
            be followed, and those layers (only) were refused; the others are checked on a forward
            without them.
        """
        assert self.capture is not None
        cap = self.capture
        if cap.batchless_refused:
            for layer in _from_sources(followed, cap.batchless_refused):
                key = next((id(use) for use in _followed(layer) if id(use) in cap.batchless_refused), None)
                self._refuse_batchless([layer], cap.batchless_refused.get(key, next(iter(
                    cap.batchless_refused.values()))))
            return any(layer.fast for layer in followed)
        quiet = [layer for layer in followed if any(id(use) not in cap.batchless_ran for use in _followed(layer))]
        if quiet:  # its input carries the batch: not a layer on no batch axis
            self._refuse_batchless(quiet, None)
            followed = [layer for layer in followed if layer.fast]
            if not followed:
                return False
        # A check that fails at some meetings (or layers) refuses the layers they come from; the
        # others are checked again on a forward without them.
        bad = [i for i, (operand, view) in enumerate(cap.meetings)
               if view.dim() == 0 or view.shape[0] % (rows * _copied_rows(operand, view))]
        if bad:
            view = cap.meetings[bad[0]][1]
            return self._refuse_met(followed, bad, f"it meets a tensor whose leading axis "
                                    f"({view.shape[0] if view.dim() else 0}) is not a block of rows per sample "
                                    f"({rows}), each a copy of its own")
        if self._meetings_checked is None:
            self._meetings_checked = len(cap.meetings)
        elif len(cap.meetings) != self._meetings_checked:
            self._refuse_batchless(followed, f"it meets the batch {len(cap.meetings)} times in one forward and "
                                   f"{self._meetings_checked} in another")
            return False
        uses = [(layer, use) for layer in followed for use in _followed(layer)]
        outs = [cap.outputs[id(use)] for _, use in uses]
        if cap.meetings and rows > 1 and not self._meetings_apart:
            # Once, on the first forward of two samples or more (a chunk of one owns every row).
            probe = _last_sample_probe(logits)
            grads = torch.autograd.grad(logits, [view for _, view in cap.meetings], grad_outputs=probe,
                                        retain_graph=True, allow_unused=True)
            bad = [i for i, ((_, view), g) in enumerate(zip(cap.meetings, grads))
                   if g is not None and bool(g[:-(view.shape[0] // rows)].abs().amax() > 0)]
            if bad:
                return self._refuse_met(followed, bad, "one sample's signal reaches the other samples' rows where it "
                                        "meets the batch")
            self._meetings_apart = True
        if self._meetings_whole:
            return False
        every = torch.linspace(1.0, 2.0, logits.numel(), dtype=logits.dtype, device=logits.device
                               ).reshape(logits.shape)
        direct = torch.autograd.grad(logits, outs, grad_outputs=every, retain_graph=True, allow_unused=True)
        through = self._pulled_back([[g] for g in torch.autograd.grad(
            logits, [view for _, view in cap.meetings], grad_outputs=every, retain_graph=True, allow_unused=True)]
            if cap.meetings else [], outs, 1)
        missed = []
        for (layer, use), want, got in zip(uses, direct, through):
            want = torch.zeros_like(cap.outputs[id(use)]) if want is None else want
            got = torch.zeros_like(want) if got is None else got.reshape(want.shape)
            tol = 1e3 * float(torch.finfo(want.dtype).eps) * (float(want.abs().max()) + 1e-30)
            if not bool(((want - got).abs() <= tol).all()) and layer not in missed:
                missed.append(layer)
        if missed:
            # Only these layers' outputs reach the logits elsewhere; the others' paths are whole.
            self._refuse_batchless(missed, "its output reaches the logits other than where it meets the batch")
            return any(layer.fast for layer in followed)
        self._meetings_whole = True
        return False

    def _refuse_met(self, followed: list[TorchLayer], meetings: list[int], why: str) -> bool:
        """Refuse, for ``why``, the followed layers the failing ``meetings`` (indices into the
        capture's) are computed from (all of them where a meeting has no source). Returns whether
        the forward must run again: some followed layers are left, checked on a forward without
        the refused ones."""
        assert self.capture is not None
        sources = [self.capture.meeting_sources[i] for i in meetings]
        hit = _from_sources(followed, frozenset().union(*sources)) if all(sources) else followed
        self._refuse_batchless(hit, why)
        return any(layer.fast for layer in followed)

    def _pulled_back(self, meeting_grads: list[list[torch.Tensor | None]], outs: list[torch.Tensor],
                     rows: int) -> list[torch.Tensor | None]:
        """Per signal and sample, the gradients at the followed layers' ``outs`` from those at the
        meetings' views (``meeting_grads[i][j]``: signal ``j`` at view ``i``, or ``None``): each view's
        rows summed per sample, the broadcast axes summed to the batch-less operand's shape, and
        pulled back through the batch-less operations to the layers' outputs. ``(S·rows, *out.shape)``
        per output (``None`` where none reaches it); ``rows=1`` sums over the samples."""
        assert self.capture is not None
        operands, cotangents = [], []
        signals = len(meeting_grads[0]) if meeting_grads else 0
        for (operand, view), grads in zip(self.capture.meetings, meeting_grads):
            if all(g is None for g in grads):
                continue
            stacked = torch.stack([torch.zeros_like(view) if g is None else g for g in grads])  # (S, B', ...)
            # Sample i's block of rows: copies of the operand's h rows (h = 1 for a broadcast), summed.
            h = _copied_rows(operand, view)
            per = stacked.unflatten(1, (rows, -1, h)).sum(2)  # (S, rows, h, *view.shape[1:])
            target = (1,) * (view.dim() - operand.dim()) + tuple(operand.shape)
            axes = [d + 1 for d in range(1, view.dim()) if target[d] == 1 and view.shape[d] != 1]
            if axes:
                per = per.sum(axes, keepdim=True)
            operands.append(operand)
            cotangents.append(per.reshape(signals * rows, *operand.shape))
        if not operands:
            return [None] * len(outs)
        try:
            return list(torch.autograd.grad(operands, outs, grad_outputs=cotangents, is_grads_batched=True,
                                            retain_graph=True, allow_unused=True))
        except ggn_kernels._VMAP_ERRORS:  # an operation without a batching rule: one at a time
            rows_out = [torch.autograd.grad(operands, outs, grad_outputs=[c[i] for c in cotangents],
                                            retain_graph=True, allow_unused=True)
                        for i in range(signals * rows)]
            return [None if rows_out[0][i] is None else torch.stack([r[i] for r in rows_out])
                    for i in range(len(outs))]

    def _check_swappable(self, xs: ModelInputs, layers: list[TorchLayer]) -> None:
        """Refuse, once per layer, a weight the model reaches without its module attribute: the
        generic path and the Hessian-vector products swap weights with ``functional_call``, and
        would read its curvature as zero (:func:`~normflat.backends.torch.ggn.unswapped`)."""
        new = [layer for layer in layers if id(layer) not in self._swappable]
        if not new:
            return
        names = ggn_kernels.unswapped(self.model, xs.rows(slice(0, min(PROBE_ROWS, xs.n))),
                                      {layer.param_name: layer.param for layer in new}, self._pick)
        if names:
            raise ggn_kernels.unswapped_error(names)
        self._swappable.update(id(layer) for layer in new)

    def _heads(self, logits: torch.Tensor, fast: list[TorchLayer]) -> list[TorchLayer]:
        """``ggn``/``ggn-topk``: the fast dense layers whose output tensor is the logits themselves.

        ``ggn`` takes the structured head only above :data:`STRUCTURED_HEAD_CLASSES` classes,
        where it pays; ``ggn-topk`` always (its head must be exact, as in every framework).
        """
        if self.options.estimator == "ggn" and logits.shape[-1] <= STRUCTURED_HEAD_CLASSES:
            return []
        if self.options.estimator not in ("ggn", "ggn-topk"):
            return []
        assert self.capture is not None
        dense = (ggn_kernels.linear_squares, ggn_kernels.transposed_linear_squares)
        return [layer for layer in fast if not layer.tied
                and layer.ext.ggn_squares in dense and _is_logits(self.capture.outputs.get(id(layer)), logits)]

    def _head_input(self, z: torch.Tensor, heads: list[TorchLayer], others: list[TorchLayer]
                    ) -> torch.Tensor | None:
        """The input of the one dense head of :meth:`_heads` where the ``others`` layers' signals
        start (pulled back through the head in structured form, method §6.2): ``(n, C)`` logits,
        or per-sequence token logits whose head is applied token by token; ``None`` where they
        start at the logits."""
        assert self.capture is not None
        sequence = self.options.sequence_layout(int(z.shape[1]) if z.dim() == 3 else None)
        if not others or len(heads) != 1 or not (z.dim() == 2 or sequence):
            return None
        start = self.capture.live_inputs[id(heads[0])]
        if start.requires_grad and (z.dim() == 2 or tuple(start.shape[:-1]) == tuple(z.shape[:-1])):
            return start
        return None

    def _head_squares(self, sig: torch.Tensor, heads: list[TorchLayer], state: SumState,
                      token_rows: bool = False) -> None:
        """Squares of the head layers from signals at the logits (their output gradients).

        ``token_rows``: ``sig`` holds one signal per token row ``(·, 1, n·T, C)`` and each head's
        input is taken as its ``n·T`` token rows (:meth:`_token_head_squares`).
        """
        assert self.capture is not None
        m = sig.shape[1]
        # Only the shared group 0 is non-zero: square it alone, the sampled groups get zeros.
        parts = list(sig[0].unbind(0))
        for layer in heads:
            rule = layer.ext.ggn_squares
            assert rule is not None
            a = self.capture.inputs[id(layer)]
            if token_rows:
                a = a.reshape(-1, a.shape[-1])
            value = rule(layer.module, a, ggn_kernels.Deltas(list(parts), 1, m))
            if self.options.state_groups > 1:  # ggn-topk: exact, only the shared sum is kept (no K zero sums)
                state.add_exact(self._index[id(layer)], value.detach(), owned=True)
            else:
                state.add(self._index[id(layer)], value.detach(), owned=True)

    def _token_head_squares(self, z: torch.Tensor, counted: torch.Tensor, heads: list[TorchLayer],
                            state: SumState) -> None:
        """A dense head's exact squares on token logits ``(n, T, C)`` (method §6.3).

        Its output at token ``t`` depends on its input at ``t`` only, so the squares of the
        per-token diagonal signals, each placed at its token, are those of the ``n·T`` token
        rows taken as samples: ``Σ_rows diag(H)_row ⊗ x_row²``, one ``(C, n·T) × (n·T, d)``
        product, where one per-sample gradient per placed signal costs ``O(T²·C·d)`` per
        sequence. Uncounted tokens add nothing.
        """
        c = int(z.shape[-1])
        # In place: one array of the token logits' size, not three.
        root = losses.logit_hessian_diagonal(_XP, z.reshape(-1, c), self.options).sqrt_()
        root.mul_(counted.reshape(-1, 1))  # (n·T, C)
        self._head_squares(root[None, None], heads, state, token_rows=True)

    def _prepared_blocks(self, z: torch.Tensor, counted: torch.Tensor | None, uniforms: torch.Tensor | None,
                         sequence: bool) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """:meth:`_signal_blocks` as :meth:`_skipped` hands them to the kernels."""
        for sig, padding in self._signal_blocks(z, counted, uniforms):
            yield from self._member_steps(self._skipped(sig, sequence, padding))

    def _skipped(self, sig: torch.Tensor, sequence: bool, padding: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The signals to square, pooled if only the mean is wanted, and the flat indices
        ``g·M + j`` of those known to be zero (``padding``: the groups' padding and the empty
        shared group 0 of per-sequence ``ggn-topk``, method §6.3), which need no
        back-propagation."""
        if self.options.pooled:  # only the mean is wanted: one sum for every group
            return losses.pool_signals(_XP, sig, self.options, sequence=sequence, padding=padding)
        return sig, padding

    def _generic_squares(self, xc: ModelInputs, block: tuple[torch.Tensor, list[int]], generic: list[TorchLayer],
                         state: SumState) -> None:
        """The generic path's sums of one block of :meth:`_skipped` signals: the known zeros (the
        groups' padding, an empty group) are not back-propagated."""
        sig, zero = block
        k, m = int(sig.shape[0]), int(sig.shape[1])
        skipped = set(zero)
        real = [j for j in range(k * m) if j not in skipped]  # in group order
        counts = [sum(1 for j in range(g * m, (g + 1) * m) if j not in skipped) for g in range(k)]
        live = [g for g in range(k) if counts[g]]
        # The math attention kernel has vmap batching rules; the fused one does not.
        with compat.FunctionalKernels(attention=True):
            if len(real) < k * m:
                res = ggn_kernels.generic_ggn(self.model, xc, sig.reshape(k * m, *sig.shape[2:])[real], generic,
                                              self._pick, counts=[counts[g] for g in live])
            else:
                res = ggn_kernels.generic_ggn(self.model, xc, sig, generic, self._pick)
        for layer in generic:
            value = res[layer.param_name].detach()
            if len(live) < k:
                full = value.new_zeros((k, *value.shape[1:]))
                full[live] = value
                value = full
            state.add(self._index[id(layer)], value, owned=True)
            del value

    def _fast_squares(self, logits: torch.Tensor, block: tuple[torch.Tensor, list[int]], fast: list[TorchLayer],
                      state: SumState) -> None:
        """Back-propagate one block of :meth:`_skipped` signals ``(signals, zero indices)`` to the
        fast layers' outputs and add their squares. The calls on no batch axis get theirs from the
        views where they meet the batch (:meth:`_pulled_back`)."""
        assert self.capture is not None
        cap = self.capture
        sig, padding = block
        k, m, nc = sig.shape[:3]
        total = k * m
        # Each layer's calls' outputs (its own, then those of the other modules of its tied weight),
        # but the followed ones; then the views where those meet the batch.
        plain = [use for layer in fast for use in layer.uses if not use.batchless]
        followed = [use for layer in fast for use in layer.uses if use.batchless]
        outs = [cap.outputs[id(use)] for use in plain]
        if followed:
            outs += [view for _, view in cap.meetings]
        flat = sig.reshape(total, nc, *sig.shape[3:])
        skipped = set(padding)
        real = [j for j in range(total) if j not in skipped]
        if padding:
            flat = flat[real]  # the zero padding is not back-propagated; the rules skip it (None)
        grads = list(ggn_kernels.backprop_signals(logits, outs, flat, self.batched))
        if padding:
            for i, parts in enumerate(grads):
                if parts is not None:
                    full: list[torch.Tensor | None] = [None] * total
                    for j, part in zip(real, parts):
                        full[j] = part
                    grads[i] = full
        signals: dict[int, list[torch.Tensor | None] | None] = {id(use): g for use, g in zip(plain, grads)}
        inputs: dict[int, torch.Tensor] = {}
        if followed:
            meeting_grads = grads[len(plain):]
            del grads
            signals.update(self._followed_signals(followed, meeting_grads, nc, total, inputs))
            del meeting_grads
        else:
            del grads
        for layer in fast:
            if not layer.uses:  # unused (_first_check): zero curvature, nothing to add
                continue
            mine = [signals.pop(id(use), None) for use in layer.uses]  # the rule may free the parts
            if layer.tied:
                self._tied_squares(layer, mine, k, m, state, inputs)
                continue
            parts = mine[0]
            del mine
            if parts is None:  # the layer does not influence the logits
                if ggn_kernels.first_of_tuple(layer.ext.ggn_squares):
                    # A module returning (its map's output, ...) whose first output gets no signal: the
                    # model may go on with another tensor (a router's scores computed from a copy), so
                    # the generic path decides, this chunk included.
                    layer.disable_fast("no signal reaches the first output it returns, where its rule takes the "
                                       "signals")
                continue
            if id(layer) in inputs:  # followed: its input taken per sample
                rule = ggn_kernels.position_table_squares if layer.direct else None
                self._add_squares(layer, inputs.pop(id(layer)), parts, k, m, state, rule)
                continue
            a = cap.inputs[id(layer)]
            if id(layer) in self._chunk_second:  # sequence-first: the samples to the front (views)
                a = a.transpose(0, 1)
                parts = [None if p is None else p.transpose(0, 1) for p in parts]
            fold = self._chunk_folds.get(id(layer))
            if fold is not None:
                # A block of rows per sample (_rows_per_sample): the sample's rows become positions.
                a = a.unflatten(0, (-1, fold))
                parts = [None if p is None else p.unflatten(0, (-1, fold)) for p in parts]
            self._add_squares(layer, a, parts, k, m, state)

    def _followed_signals(self, followed: list["TorchLayer | TiedUse"],
                          meeting_grads: list[list[torch.Tensor | None] | None], rows: int, total: int,
                          inputs: dict[int, torch.Tensor]) -> dict[int, list[torch.Tensor | None] | None]:
        """Each sample's signals at the followed calls' outputs, pulled back from where they meet the
        batch (:meth:`_pulled_back`), by call: ``total`` parts ``(rows, ...)`` each (``None`` for
        padding), and in ``inputs`` each call's input taken per sample (the same for each; a leading
        axis of one is the sample's). A followed weight (a table, or one read as a tensor) is its
        own output and input: each sample's gradient of it, which its squares read whole."""
        assert self.capture is not None
        cap = self.capture
        grads = [[None] * total if g is None else g for g in meeting_grads]
        real = [j for j in range(total) if any(g[j] is not None for g in grads)]
        if not real:
            return {}
        outs = [cap.outputs[id(use)] for use in followed]
        pulled = self._pulled_back([[g[j] for j in real] for g in grads], outs, rows)
        del grads, meeting_grads
        signals: dict[int, list[torch.Tensor | None] | None] = {}
        for use, out, got in zip(followed, outs, pulled):
            if got is None:
                continue
            got = got.reshape(len(real), rows, *out.shape)
            a = cap.inputs[id(use)]
            if getattr(use, "table", False) or getattr(use, "direct", False):
                inputs[id(use)] = a
            else:
                if a.dim() > 0 and out.dim() > 0 and a.shape[0] == 1 and out.shape[0] == 1:
                    a, got = a[0], got[:, :, 0]
                inputs[id(use)] = a.expand(rows, *a.shape)
            parts: list[torch.Tensor | None] = [None] * total
            for i, j in enumerate(real):
                parts[j] = got[i]
            signals[id(use)] = parts
        return signals

    def _add_squares(self, layer: TorchLayer, inputs: torch.Tensor, parts: list[torch.Tensor | None], k: int,
                     m: int, state: SumState, rule: Any = None) -> None:
        """One fast layer's rule (or ``rule``) on its input and the signals at its output (``k·m``
        parts, ``None`` for padding), added into its sums; a rule that refuses sends the layer to
        the generic path, this chunk included."""
        assert self.capture is not None
        cap = self.capture
        deltas = ggn_kernels.Deltas(parts, k, m)
        del parts
        rule = layer.ext.ggn_squares if rule is None else rule
        assert rule is not None
        index = self._index[id(layer)]
        builtin = ggn_kernels.wants_deltas(rule)
        # The built-in rules add into the running sums (no new sums per chunk or batch) and
        # return fresh ones the first time, which the state keeps and adds into later.
        running = state.accumulator(index) if builtin else None
        extra = {} if running is None else {"out": running}
        sink = None
        if ggn_kernels.takes_kernel_sums(rule) and state.axes(index) and index not in state.exact:
            # Kernel-summed groups: the rule adds each group's squares into the numerator and
            # the kernel sums (the state's own after the first contribution).
            kept = state.kernel_accumulator(index)
            mean, sums = kept if kept is not None else (None, None)
            sink = ggn_kernels.KernelSums(state.weights(), state.axes(index), tuple(layer.param.shape),
                                          like=layer.param.detach(), mean=mean, sums=sums)
            running, extra = kept, {"out": sink}
        try:
            arg = deltas if builtin else deltas.stacked()
            if ggn_kernels.wants_call(rule):
                value = rule(layer.module, inputs, arg, *cap.extras[id(layer)], **extra)
            else:
                value = rule(layer.module, inputs, arg, **extra)
        except ggn_kernels.NoFastPath as why:  # handled by the generic path, this chunk included
            layer.disable_fast(str(why))
            return
        if running is None:
            state.add(index, value if sink is not None else value.detach(), owned=builtin)
        # A kernel-summed layer's full (K', ...) squares are garbage once added: free them
        # before the next layer's.
        del value, sink

    def _tied_squares(self, layer: TorchLayer, parts: list[list[torch.Tensor | None] | None], k: int, m: int,
                      state: SumState, inputs: dict[int, torch.Tensor] | None = None) -> None:
        """The squares of a tied weight from the signals at each of its modules' outputs (a use the
        logits do not depend on adds nothing); ``inputs``: the followed calls' inputs taken per
        sample (:meth:`_followed_signals`)."""
        assert self.capture is not None
        cap = self.capture
        inputs = inputs or {}
        uses = [(use.module, use.ext.ggn_squares, inputs.get(id(use), cap.inputs[id(use)]))
                for use, p in zip(layer.uses, parts) if p is not None]
        deltas = [ggn_kernels.Deltas(p, k, m) for p in parts if p is not None]
        if not uses:
            return
        index = self._index[id(layer)]
        running = state.accumulator(index)
        value = ggn_kernels.tied_squares(uses, deltas, out=running)
        if running is None:
            state.add(index, value.detach(), owned=True)


def _sequence_step(members: int, groups: int, rows: int, width: int) -> int:
    """Members of every group formed and back-propagated together per sequence: at most
    :data:`SEQUENCE_SIGNAL_ENTRIES` entries of ``width`` per signal and row, and at most
    :data:`DEFAULT_SIGNAL_ROWS` signal rows, at least one member."""
    return max(1, min(members, SEQUENCE_SIGNAL_ENTRIES // max(groups * rows * width, 1),
                      DEFAULT_SIGNAL_ROWS // max(groups * rows, 1)))


#: The rules that read a layer with the samples on the second axis as well (sequence-first).
_SECOND_AXIS_RULES = (ggn_kernels.linear_squares, ggn_kernels.embedding_squares,
                      ggn_kernels.scaled_embedding_squares)


def _follows(layer: TorchLayer) -> bool:
    """Whether any of a layer's calls (or the weight itself) is followed to the batch."""
    return any(use.batchless for use in layer.uses)


def _followed(layer: TorchLayer) -> list["TorchLayer | TiedUse"]:
    """A layer's calls followed to the batch (the layer itself for its first call, or its weight)."""
    return [use for use in layer.uses if use.batchless]


def _from_sources(followed: list[TorchLayer], keys: Any) -> list[TorchLayer]:
    """The followed layers with a call among ``keys`` (where a failing meeting or operation comes
    from), or all of them where none is."""
    return [layer for layer in followed if any(id(use) in keys for use in _followed(layer))] or followed


def _leading(t: torch.Tensor) -> int:
    return int(t.shape[0]) if t.dim() else -1


def _copied_rows(operand: torch.Tensor, view: torch.Tensor) -> int:
    """The rows of ``operand`` each block of ``view``'s leading axis copies: one where ``view`` is it
    broadcast (a new leading axis, or a leading axis of one), all of them where it is it tiled."""
    return int(operand.shape[0]) if view.dim() == operand.dim() and operand.dim() > 0 else 1


def _last_sample_probe(logits: torch.Tensor) -> torch.Tensor:
    """A signal at the last sample's logits only (distinct entries), zeros elsewhere."""
    probe = torch.zeros_like(logits)
    last = probe[-1]
    last.copy_(torch.linspace(1.0, 2.0, last.numel(), dtype=probe.dtype, device=probe.device).reshape(last.shape))
    return probe


def _expanded_what(layer: TorchLayer) -> str:
    """How the reasons of :meth:`TorchSession._forward`'s substitutions name a layer's."""
    if layer.batchless:
        return "the layer's batch-less output"
    return "the position table" if layer.table else "the layer's one-row output"


def _is_logits(output: torch.Tensor | None, logits: torch.Tensor) -> bool:
    """Whether a captured layer output is the logits (the capture hook hands on a clone)."""
    if output is None:
        return False
    if output is logits:
        return True
    fn = logits.grad_fn
    return (fn is not None and output.grad_fn is not None and compat.graph_node_name(fn) == "CloneBackward0"
            and fn.next_functions[0][0] is output.grad_fn)


def forward_error_of(model: nn.Module, batch: Batch, device: torch.device, dtype: torch.dtype,
                     pick: Callable[[Any], Any]) -> BaseException | None:
    """The model's error on the first rows of ``batch`` (inputs it does not take: a later batch of
    another shape or dtype), from its forward without gradients, or ``None`` where it runs or where
    normflat's own input handling refused the batch
    (:func:`~normflat.engine.data.model_failures`)."""
    try:
        with torch.no_grad():
            xs = inputs_to_model(batch.x, batch.index, device, dtype, batch.n, batch.keywords)
            if batch.keywords:
                xs.kwargs = hf.keyword_inputs(model, xs.kwargs, batch.y, device)
            pick(xs.rows(slice(0, min(losses.SAMPLES_APART_ROWS, batch.n))).call(model))
    except Exception as err:  # noqa: BLE001 - returned
        return None if raised_by_normflat(err) else err
    return None


def _check_inputs_kept(called: ModelInputs, original: ModelInputs, versions: list[int]) -> None:
    """Refuse a forward that changed its inputs in place (``x.mul_(2)``, ``x /= 255`` on an input):
    ``called`` held copies of ``original``'s tensors at the ``versions`` given. Writes that leave the
    values as they were (a clamp inside the range, a fill of what is already there) pass."""
    for t, before, ref in zip(called.tensors(), versions, original.tensors()):
        if compat.tensor_version(t) != before and not torch.equal(t, ref):
            raise ValueError(
                "The torch model changes its inputs in place in its forward (an in-place operation on an "
                "input tensor, such as x.mul_(...), x /= 255 or x[:, 0] = 0): normflat runs the forward "
                "several times on each batch (this check, chunks of samples, samples alone), so each forward "
                "would see inputs that the one before changed, and the data you pass would be changed too. "
                "Write those operations out of place (x = x / 255)."
            )


def check_samples_apart_of(model: nn.Module, xs: ModelInputs, pick: Callable[[Any], Any],
                           batch: Batch | None = None) -> Exception | None:
    """:func:`~normflat.engine.losses.check_samples_apart` on a first batch ``xs``: its first rows in
    one forward and each alone, with the model's own weights and no gradients (the analysis and the
    perturbation models of ``normflat.measures`` alike, outside any ``torch.func`` transform).

    Args:
        model: The module, in the analysis' mode.
        xs: The first batch's inputs (one row or more: one row is the first forward only).
        pick: The logits inside the model's output (the ``output`` option).
        batch: The batch, where a model that fails on its first rows is refused with
            :func:`~normflat.engine.data.model_fails_on_inputs` (the analysis); ``None``: such a
            model is not compared, and the caller's own forwards report what is wrong with it.

    Returns:
        The error of a model that runs on the first rows together but fails on one row alone
        (the generic path's per-sample forwards would fail the same way:
        :func:`~normflat.engine.losses.one_sample_error`), else ``None``.

    Raises:
        ValueError: :func:`~normflat.engine.data.model_fails_on_inputs`, for ``batch``.
    """
    rows = min(losses.SAMPLES_APART_ROWS, xs.n)
    first = xs.rows(slice(0, rows))
    # On a copy of the rows: a forward that writes into its inputs would change the user's data.
    own = first.cloned()
    versions = [compat.tensor_version(t) for t in own.tensors()]
    try:
        with torch.no_grad():
            together = pick(own.call(model))
    except Exception as err:  # noqa: BLE001 - see batch
        if batch is not None and not raised_by_normflat(err):
            raise model_fails_on_inputs("torch", err, batch) from err
        return None
    _check_inputs_kept(own, first, versions)
    if rows < 2:
        return None
    try:
        with torch.no_grad():
            alone = [pick(xs.rows(slice(i, i + 1)).call(model)) for i in range(rows)]
    except Exception as err:  # noqa: BLE001 - kept for the generic path (see Returns)
        return err
    if not all(_is_tensor(z) and z.is_floating_point() for z in (together, *alone)):
        return None  # not logits: the output checks' error
    if together.dim() < 1 or int(together.shape[0]) != rows:
        return None
    host = [z.detach().to(torch.float64).cpu().numpy() for z in (together, *alone)]
    losses.check_samples_apart(host[0], host[1:], dtype=str(together.dtype).removeprefix("torch."))
    return None


def _is_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor)
