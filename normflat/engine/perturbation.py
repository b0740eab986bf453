"""What a backend supplies for the measures that perturb the weights (method §10).

The rival generalization measures of :mod:`normflat.engine.rivals` (adaptive
sharpness, magnitude-aware PAC-Bayes sharpness, the Fisher–Rao norm, the path
norm, the PAC-Bayes bound) evaluate the training loss of the model with its
weight matrices moved by a perturbation ``delta``. The algorithms are written
once, here in the engine, against numpy; a backend supplies only a
:class:`PerturbationModel`: the model's recognised weight matrices and the loss,
its gradient and the per-prediction quantities at ``w + delta``.

Conventions, the same in every framework (so the same seed gives the same
numbers for the same network in torch, Keras and JAX):

* the perturbed weights are exactly the weight matrices that ``analyze``
  measures (same names, same order); biases and normalization parameters are
  never perturbed;
* every array crossing this interface is a float64 numpy array in the canonical
  ``(out, in, *kernel)`` layout of method §3;
* a *prediction* is one counted loss term: one sample of ``(n, C)`` logits, or
  one counted token of ``(n, T, C)`` token logits (method §6.3). Its loss is the
  analysis loss (``"nsce"`` or ``"ce"``, method §7) of
  :func:`prediction_losses`;
* the data are passed over once per call, in the data contract of
  :mod:`normflat.engine.data` (``max_batches`` applies); the model the user
  passed is never changed.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from normflat.engine.losses import log_softmax, normalize_logits, one_hot
from normflat.engine.options import AnalysisOptions

__all__ = ["PerturbationModel", "UnsupportedMeasureError", "PATH_NORM_SCOPE", "path_norm_refusal",
           "prediction_losses", "check_rival_options", "require_reiterable"]

#: The sentence every framework's path-norm refusal carries (method §10.4).
PATH_NORM_SCOPE = ("path_norm is defined for feed-forward ReLU networks of dense and convolution layers "
                   "(inference-mode BatchNorm is folded); leave 'path_norm' out of measures=... for this model")


class UnsupportedMeasureError(ValueError):
    """A measure is not defined for this model (e.g. the path norm of a transformer)."""


def path_norm_refusal(layer: str, kind: str) -> UnsupportedMeasureError:
    """The error for a layer the path norm cannot pass, the same text in every framework."""
    return UnsupportedMeasureError(f"Layer {layer!r} ({kind}): {PATH_NORM_SCOPE}.")


class PerturbationModel(Protocol):
    """A model whose recognised weight matrices can be perturbed (supplied by a backend).

    Attributes:
        names: The recognised weight layers, as in ``analyze``'s report, model order.
        kinds: Their kinds (``"linear"``, ``"conv2d"``, ...), as in the report.
    """

    names: list[str]
    kinds: list[str]

    def weights(self) -> list[np.ndarray]:
        """Each layer's weight: float64 copies, canonical ``(out, in, *kernel)`` layout."""

    def evaluate(self, deltas: list[np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
        """Per-prediction losses and correctness at ``w + delta`` over all the data.

        Args:
            deltas: One canonical-layout array per layer (``None``: no perturbation).

        Returns:
            ``(losses, correct)``: float64 ``(m,)`` losses of :func:`prediction_losses`
            and bool ``(m,)`` whether each prediction's largest logit is its label, in
            data order (``m`` predictions).
        """

    def gradient(self, deltas: list[np.ndarray] | None) -> tuple[float, list[np.ndarray]]:
        """Mean loss over all predictions at ``w + delta`` and its gradient.

        Returns:
            ``(mean loss, [d mean loss / d W_l])``, the gradients in canonical layout.
        """

    def weight_derivatives(self) -> np.ndarray:
        """``<w, grad_w loss_i>`` for every prediction ``i`` at the unperturbed weights.

        ``w`` is the recognised weight matrices only: this is the derivative of the
        prediction's loss when every weight matrix is scaled by ``1 + t``, at ``t = 0``.

        Returns:
            float64 ``(m,)``, in data order.
        """

    def squared_output(self) -> float:
        """``sum_k f(1)_k`` of the network with every parameter squared (method §10.4).

        The input is one example of ones (the shape of the data's inputs);
        inference-mode batch normalization is first folded into the per-channel
        affine map it computes, whose scale and shift are then squared.

        Raises:
            UnsupportedMeasureError: If the model has a layer for which this is not a
                path norm (anything but dense and convolution layers, inference-mode
                batch normalization, ReLU, pooling, flattening, dropout, identity),
                naming it.
        """

    def close(self) -> None:
        """Release what the backend holds (the user's model is never changed)."""


def prediction_losses(xp: Any, logits: Any, labels: Any, options: AnalysisOptions) -> tuple[Any, Any, Any]:
    """Per-prediction analysis losses and correctness (method §7, §10).

    Args:
        xp: Array namespace of ``logits``.
        logits: ``(n, C)`` logits or ``(n, T, C)`` token logits.
        labels: ``(n,)`` or ``(n, T)`` integer labels in the same namespace; negative
            entries (``ignore_index``) are not predictions.
        options: The analysis options (``loss`` ``"nsce"`` or ``"ce"``, temperature).

    Returns:
        ``(losses, correct, counted)`` flattened to one axis over the predictions:
        float losses, bool correctness, and the bool mask of counted entries
        (``losses[counted]`` are the predictions' losses, in data order).
    """
    c = int(logits.shape[-1])
    u = normalize_logits(xp, logits, options.temperature)[0] if options.loss == "nsce" else logits
    flat_u = xp.reshape(u, (-1, c))
    flat_z = xp.reshape(logits, (-1, c))
    flat_y = xp.reshape(labels, (-1,))
    counted = flat_y >= 0
    safe = xp.where(counted, flat_y, xp.zeros_like(flat_y))
    target = one_hot(xp, safe, c, logits.dtype)
    losses = -xp.sum(target * log_softmax(xp, flat_u), axis=-1)
    # The largest logit is the label's: ties count as wrong unless the label is first.
    correct = xp.astype(xp.argmax(flat_z, axis=-1), safe.dtype) == safe
    return losses, correct, counted


def check_rival_options(options: AnalysisOptions) -> None:
    """The measures need per-prediction losses: a built-in loss.

    Raises:
        ValueError: For a custom loss callable, naming the fix.
    """
    if not isinstance(options.loss, str):
        raise ValueError(
            "normflat.measures needs the loss of every single prediction, which a custom loss "
            f"callable ({options.loss_name}) does not give: use loss='nsce' or loss='ce'."
        )


def require_reiterable(data: Any) -> None:
    """The measures pass over the data many times: a one-shot iterator cannot be used.

    Raises:
        TypeError: For an iterator or generator, naming the fix.
    """
    if hasattr(data, "__next__") and iter(data) is data:
        raise TypeError(
            "normflat.measures passes over the data many times (one pass per noise draw and "
            f"ascent step), but the data is a one-shot iterator ({type(data).__name__}). Pass a "
            "list of batches, a DataLoader, a tf.data.Dataset or an (x, y) pair instead."
        )
