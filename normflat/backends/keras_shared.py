"""What both Keras paths do to a user's Keras 3 model, importing Keras only (never TensorFlow).

normflat analyzes a Keras model on Keras' TensorFlow backend (:mod:`normflat.backends.keras`) and
on its JAX backend (:mod:`normflat.backends.jax`, ``layers._keras``). Both compute the same logits
of the same model, so both change the same few attributes of single layer *instances* for the
duration of an analysis (never of a class or a module), recorded and restored by
:class:`ModelState`, under a per-model lock (two analyses of the same model in two threads
would see each other's attributes, so they run one after the other; analyses of different
models run concurrently):

* the final softmax of a Sequential or functional model becomes the identity
  (:func:`final_softmax`), since the built-in losses take logits;
* a layer under a mixed precision policy computes in its variables' dtype
  (:func:`full_precision_policies`);

both set by :func:`logits_only`.

The TensorFlow backend sets more (its taps, the calls of grouped convolutions and of
normalization layers), also through :class:`ModelState`. The private Keras names this module
reads (``Functional``, ``KerasTensor._keras_history``, ``Layer._flatten_layers``) are re-exported
by :mod:`normflat.backends.keras.compat`, the home of every other private touch.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import keras

__all__ = ["HUB_EXPERTS", "HUB_OWN_WEIGHTS", "KERAS_IGNORED_LAYERS", "ModelState", "model_lock", "final_softmax",
           "full_precision_policies", "logits_only", "rank_equation", "functional_class", "output_layer",
           "flatten_layers", "holding_attribute", "instance_attr", "set_instance_attr", "del_instance_attr"]

_MISSING = object()

#: The ``keras.layers`` classes whose weights never enter the measures, on both Keras paths (method §4):
#: normalization layers (their scales, shifts and statistics) and ``PReLU`` (its slopes: one per input
#: entry unless ``shared_axes`` says otherwise, so a matrix's shape after a convolution), as
#: PyTorch's ``nn.PReLU``. Not ``SpectralNormalization``: it renormalizes its layer's kernel in place
#: during training only, and at inference applies the layer as it is, its kernel a weight matrix like
#: any (method §3, "Spectral normalization").
KERAS_IGNORED_LAYERS = ("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization",
                        "UnitNormalization", "Normalization", "PReLU")

#: keras-hub's experts layers (every expert on every token, weighted by the routing), read by both
#: Keras paths (method §3, "Mixture-of-experts layers"): per class, its stacked kernels
#: ``(attribute, map)``, each ``(experts, in, out)``; ``"gate_up"`` packs the gate then the up map
#: along its output axis, ``"gate_up_interleaved"`` alternates them.
HUB_EXPERTS = {
    ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralMoeExperts"): (
        ("_expert_feedforward_gate_dense", "gate"), ("_expert_feedforward_intermediate_dense", "up"),
        ("_expert_feedforward_output_dense", "down")),
    ("keras_hub.src.models.qwen_moe.qwen_moe_decoder", "QwenMoeExperts"): (
        ("_expert_feedforward_gate_dense", "gate_up"), ("_expert_feedforward_output_dense", "down")),
    ("keras_hub.src.models.qwen3_moe.qwen3_moe_decoder", "Qwen3MoeExperts"): (
        ("_expert_feedforward_gate_dense", "gate_up"), ("_expert_feedforward_output_dense", "down")),
    ("keras_hub.src.models.qwen3_5_moe.qwen3_5_moe_decoder", "Qwen3_5MoeExperts"): (
        ("_expert_feedforward_gate_dense", "gate_up"), ("_expert_feedforward_output_dense", "down")),
    ("keras_hub.src.models.gpt_oss.gpt_oss_decoder", "GptOssExperts"): (
        ("gate_up_proj", "gate_up_interleaved"), ("down_proj", "down")),
    ("keras_hub.src.models.gemma4.gemma4_moe", "Gemma4MoEBlock"): (
        ("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")),
}


#: keras-hub layers that multiply by weight matrices of their own (``ops.matmul`` or
#: ``ops.depthwise_conv`` inside their call, beside ``Dense`` sublayers, which are read as such): per
#: class and attribute, ``"dense"`` for a matrix ``(in, out)``, canonical ``(out, in)``;
#: ``"depthwise"`` for a depthwise 1-D kernel ``(channels, kernel)``, canonical ``(channels, 1, kernel)``
#: with ``groups = channels`` (as a ``DepthwiseConv1D``'s); or a reason, for a weight that is no
#: matrix although shaped as one. All take the generic path (no layer to tap). Read by both Keras paths.
#:
#: * RWKV-7's time mixing: its low-rank maps (the decay ``w1 → tanh → w2``, the in-context learning
#:   rate ``a1 → a2``, the value residual ``v1 → v2`` of the layers after the first, the gate
#:   ``g1 → sigmoid → g2``), and ``r_k``, which scales the current token's ``r ⊙ k`` entry by entry
#:   (the bonus ``Σ (r ⊙ k ⊙ r_k) v`` per head).
#: * Qwen3.5's gated delta net (its linear-attention layers): the short causal convolution over the
#:   tokens of its query, key and value channels, ``conv1d_weight`` (PyTorch's Qwen3-Next and Mamba
#:   hold the same as an ``nn.Conv1d`` with one group per channel).
HUB_OWN_WEIGHTS: dict[tuple[str, str], dict[str, str]] = {
    ("keras_hub.src.models.rwkv7.rwkv7_layer", "RWKV7TimeMix"): {
        **dict.fromkeys(("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"), "dense"),
        "r_k": "RWKV-7's per-head, per-channel bonus scale of the current token (applied entry by entry, a "
               "vector in a matrix's shape), not a weight matrix",
    },
    ("keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net", "Qwen3_5GatedDeltaNet"): {
        "conv1d_weight": "depthwise",
    },
}


def flatten_layers(model: Any) -> list[Any]:
    """All layers below ``model`` (``Layer._flatten_layers``: Keras has no public recursive listing)."""
    return list(model._flatten_layers(include_self=False))


def functional_class() -> type:
    """Keras' internal ``Functional`` model class (to find the layer of a functional model's output)."""
    try:
        from keras.src.models.functional import Functional
    except ImportError:  # pragma: no cover - other Keras layouts: only Sequential models are inspected
        return keras.Sequential
    return Functional


def output_layer(model: Any) -> Any | None:
    """The layer that produced a functional model's single output.

    ``KerasTensor._keras_history`` is the only link from a symbolic output to its layer.
    """
    history = getattr(model.outputs[0], "_keras_history", None)
    return None if history is None else history[0]


def holding_attribute(layer: Any, value: Any) -> str | None:
    """The one instance attribute of ``layer`` that holds ``value`` (a variable or a sub-layer; ``None``:
    none, or several)."""
    names = [k for k, v in vars(layer).items() if v is value]
    return names[0] if len(names) == 1 else None


def instance_attr(obj: Any, attr: str) -> Any:
    """The instance's own value of ``attr`` (``_MISSING`` when it falls back to the class)."""
    return obj.__dict__.get(attr, _MISSING)


def set_instance_attr(obj: Any, attr: str, value: Any) -> None:
    """Set an attribute on one layer instance, bypassing Keras' attribute tracking.

    ``Layer.__setattr__`` would track a function as a sub-object and change the
    layer's state; ``object.__setattr__`` only shadows the class attribute of
    this one instance (no module or class is changed).
    """
    object.__setattr__(obj, attr, value)


def del_instance_attr(obj: Any, attr: str, old: Any) -> None:
    """Restore ``attr`` of one instance to ``old`` (an earlier :func:`instance_attr` value)."""
    if old is _MISSING:
        obj.__dict__.pop(attr, None)
    else:
        object.__setattr__(obj, attr, old)


_LOCKS_GUARD = threading.Lock()
_LOCKS: "weakref.WeakKeyDictionary[Any, threading.RLock]" = weakref.WeakKeyDictionary()
_UNHASHABLE: dict[int, threading.RLock] = {}


def model_lock(model: Any) -> threading.RLock:
    """The lock serializing analyses of ``model`` (re-entrant: the same thread may nest)."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(model)
            if lock is None:
                lock = _LOCKS[model] = threading.RLock()
        except TypeError:  # not weak-referenceable: key on the id while it is alive
            lock = _UNHASHABLE.setdefault(id(model), threading.RLock())
        return lock


class ModelState:
    """The instance attributes an analysis set on a model, and the lock it holds.

    Args:
        model: The user's model; its lock is acquired here (blocking) and
            released by :meth:`restore`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lock = model_lock(model)
        self._lock.acquire()
        self._held = True
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        """Set ``obj.attr`` on the instance, remembering its previous instance value."""
        self._saved.append((obj, attr, instance_attr(obj, attr)))
        set_instance_attr(obj, attr, value)

    def restore(self) -> None:
        """Undo every :meth:`set` (last first) and release the model's lock; idempotent."""
        try:
            while self._saved:
                obj, attr, old = self._saved.pop()
                del_instance_attr(obj, attr, old)
        finally:
            if self._held:
                self._held = False
                self._lock.release()


def full_precision_policies(state: ModelState) -> None:
    """Give each layer of ``state.model`` (the model included) whose dtype policy computes in half
    precision over float32 or float64 variables (``mixed_float16``, ``mixed_bfloat16``, a keras-hub
    ``DTypePolicyMap``'s entry) the plain policy of its variables' dtype, as an instance attribute on
    ``state``.

    A mixed policy rounds a float32 model's function to float16 or bfloat16 for training speed; the
    analysis measures the function itself, as the PyTorch backend does under an enclosing
    ``torch.autocast`` (turned off) and the JAX backend for a half-precision model (analyzed in
    float32). Keras' ``Layer.__call__`` reads ``dtype_policy`` on every call to cast the inputs and
    to autocast the variables. A quantized policy is left as it is.
    """
    for layer in [state.model, *flatten_layers(state.model)]:
        policy = getattr(layer, "dtype_policy", None)
        if policy is None or getattr(policy, "quantization_mode", None) is not None:
            continue
        compute, variables = policy.compute_dtype, policy.variable_dtype
        if compute in ("float16", "bfloat16") and variables in ("float32", "float64"):
            state.set(layer, "_dtype_policy", keras.dtype_policies.get(variables))


def _is_softmax(fn: Any) -> bool:
    return fn is keras.activations.softmax or getattr(fn, "__name__", "") == "softmax"


def final_softmax(model: Any) -> tuple[Any, str] | None:
    """The ``(layer, attribute)`` applying a final softmax of a Sequential/functional model.

    The built-in losses take logits, so that softmax is made the identity while
    analyzing (the report says so in ``metadata["backend"]["stripped_softmax"]``).
    """
    functional = functional_class()
    layer = model
    for _ in range(16):
        if isinstance(layer, keras.Sequential):
            inner = list(layer.layers)
            if not inner:
                return None
            layer = inner[-1]
        elif isinstance(layer, functional) and layer.outputs:
            if len(layer.outputs) != 1:
                return None
            layer = output_layer(layer)
            if layer is None:
                return None
        else:
            break
    act = getattr(layer, "activation", None)
    if isinstance(layer, keras.layers.Softmax):
        return layer, "call"
    if isinstance(layer, keras.layers.Activation) and _is_softmax(act):
        return layer, "call"
    if _is_softmax(act) and isinstance(layer, keras.layers.Layer):
        return layer, "activation"
    return None


def logits_only(state: ModelState, strip: tuple[Any, str] | None) -> None:
    """Make ``state.model`` compute the logits the analysis differentiates, as instance attributes on
    ``state``: its layers of a mixed precision policy in their variables' dtype
    (:func:`full_precision_policies`), and the final softmax ``strip`` (:func:`final_softmax`; ``None``:
    none, or a custom loss that takes the model's own outputs) made the identity."""
    full_precision_policies(state)
    if strip is not None:
        layer, attr = strip
        if attr == "activation":
            state.set(layer, "activation", keras.activations.linear)
        else:
            state.set(layer, "call", lambda inputs, *a, **k: inputs)


def rank_equation(equation: str) -> tuple[str, bool]:
    """The ``EinsumDense`` equation of a LoRA ``A`` factor (the kernel's last axis replaced by the rank
    axis, in the same role) and whether that axis is contracted with the input."""
    text = equation.replace(" ", "")
    lhs, out = text.split("->")
    inp, ker = lhs.split(",")
    last = ker[-1]
    rank = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in text)
    return f"{inp.replace(last, rank)},{ker[:-1] + rank}->{out.replace(last, rank)}", last in inp
