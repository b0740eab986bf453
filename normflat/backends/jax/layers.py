"""The JAX layer registry and the model views of equinox, flax nnx, flax linen and ``(apply_fn, params)``.

**Registry.** One :class:`~normflat.engine.registry.LayerRegistry` ``{module class:
entry}`` with MRO lookup, as in every backend: an entry is a :class:`LayerRule`
(which leaves of the module are its weights, in which layout — ``(out, in, *k)``,
``(*k, in, out)`` or the :class:`Axes` of a multi-axis kernel, method §3 —, with
how many groups, and the gate blocks of packed recurrent weights),
:data:`~normflat.engine.registry.IGNORE` (normalization layers: their scales are
held fixed, method §9) or :class:`~normflat.engine.registry.Unsupported` (a known
type normflat refuses, with the reason). Keys are equinox, flax nnx or flax linen
module classes. A floating leaf with at least 2 dimensions that no rule claims is
reported through :class:`~normflat.engine.registry.Skipped` (``on_unsupported``)
unless it is excluded by definition or a learned position table
(:func:`~normflat.engine.registry.excluded_reason`,
:func:`~normflat.engine.registry.position_table`); ``layouts={leaf path: layout}``
declares or overrides single leaves, and :func:`check_layouts` checks every layout
that no rule gave against the traced program. Every leaf gets a
:class:`~normflat.engine.problems.ParameterStatus` (:attr:`ModelView.parameters`).

**Views.** Every model kind becomes a :class:`ModelView`: its floating-point
leaves (cast to the compute dtype), the weight leaves found by the registry, and
pure functions ``(leaves, x) -> logits`` for a batch and for one example (keyword
inputs ``model(**x)`` for mapping batches; the logits picked from the model's
output by :func:`~normflat.engine.outputs.select_output`). The
user's objects are only read: equinox and linen models are immutable, and an nnx
module is split into a private copy switched to evaluation mode.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends import keras_runs_on_jax
from normflat.backends.jax.cache import LRU
from normflat.backends.jax.compat import is_frozen_collection_error
from normflat.engine.outputs import select_output
from normflat.engine.problems import ParameterStatus
from normflat.engine.registry import (IGNORE, IGNORED_REASON, LayerRegistry, Skipped, Unsupported, excluded_reason,
                                      position_table, relative_bias_table)

__all__ = ["LayerRule", "Axes", "REGISTRY", "register_layer", "registered_layers", "ModelView", "WeightInfo",
           "make_view", "LAYOUT_ALIASES", "path_str", "pick_dtype", "to_canonical", "to_native",
           "canonical_shape", "parse_layout", "Flipped", "Permuted"]

#: Accepted names of weight layouts in ``layouts=``: canonical (torch/equinox) or flax/Keras.
LAYOUT_ALIASES = {
    "out,in,*k": "canonical", "out,in": "canonical", "(out, in, *k)": "canonical", "torch": "canonical",
    "canonical": "canonical",
    "*k,in,out": "flax", "in,out": "flax", "(*k, in, out)": "flax", "flax": "flax",
}


@dataclass(frozen=True)
class Axes:
    """A multi-axis weight layout: which native axes are output and which are input features.

    The canonical matrix (method §3) is the native array transposed to
    ``out + inp`` and reshaped to ``(∏ output axes, ∏ input axes)``, each group of
    axes flattened in row-major order (an attention query kernel ``(d, H, hd)`` with
    ``out=(1, 2)``, ``inp=(0,)`` becomes ``(H·hd, d)``, rows head-major).

    Attributes:
        out: Native axes of the output features, in flattening order.
        inp: Native axes of the contracted input features, in flattening order.
        shape: The native shape.
    """

    out: tuple[int, ...]
    inp: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if sorted(self.out + self.inp) != list(range(len(self.shape))) or not self.out or not self.inp:
            raise ValueError(f"Axes(out={self.out}, inp={self.inp}) must name every axis of a weight of shape "
                             f"{self.shape} once, with at least one output and one input axis.")

    @property
    def canonical(self) -> tuple[int, int]:
        """The canonical ``(rows, columns)`` shape."""
        return (int(np.prod([self.shape[i] for i in self.out], dtype=np.int64)),
                int(np.prod([self.shape[i] for i in self.inp], dtype=np.int64)))


@dataclass(frozen=True)
class Flipped:
    """A transposed convolution's kernel as flax and equinox store it: in the ``base`` layout
    (``"canonical"`` or ``"flax"``) and flipped on its kernel axes relative to torch's and Keras'
    kernels of the same function, since they correlate the stride-dilated input with it. The
    canonical layout flips it back, so that a canonical entry means the same in every framework
    (method §3).

    Attributes:
        base: The layout of the channel axes.
    """

    base: str


@dataclass(frozen=True)
class Permuted:
    """A kernel whose canonical form is its native axes permuted, then reshaped.

    Keras' transposed convolutions ``(*k, out, in)`` (permuted to ``(out, in, *k)``) and its
    depthwise kernels ``(*k, in, multiplier)``: permuted to ``(in, multiplier, *k)`` and reshaped to
    ``(in·multiplier, 1, *k)``, the convolution with one group per input channel whose output
    channel ``i·multiplier + j`` reads input channel ``i`` (method §3).

    A keras-hub experts kernel ``(experts, in, out)`` is permuted to ``(experts, out, in)`` and
    reshaped to ``(experts·out, in)``; one that alternates two maps along its output axis is first
    split to ``(experts, in, out/2, 2)``, so that each expert's first map comes before its second.

    Attributes:
        perm: The native axes (of :attr:`split`, when given) in canonical order.
        shape: The native shape.
        canonical: The canonical shape (the permuted shape, or a reshape of it).
        split: A reshape of the native array before the permutation, or ``None``.
    """

    perm: tuple[int, ...]
    shape: tuple[int, ...]
    canonical: tuple[int, ...]
    split: tuple[int, ...] | None = None

    @property
    def permuted(self) -> tuple[int, ...]:
        """The shape after the permutation (of :attr:`split`, when given, else of :attr:`shape`)."""
        return tuple((self.split or self.shape)[i] for i in self.perm)

    def __post_init__(self) -> None:
        axes = self.split or self.shape
        if (sorted(self.perm) != list(range(len(axes))) or math.prod(self.permuted) != math.prod(self.canonical)
                or math.prod(axes) != math.prod(self.shape)):
            raise ValueError(f"Permuted(perm={self.perm}, canonical={self.canonical}, split={self.split}) does not "
                             f"fit a weight of shape {self.shape}.")


def _flip_kernel(a: Any, batch_dims: int) -> Any:
    """``a`` (canonical ``(..., out, in, *k)``) reversed along its kernel axes."""
    return a[(slice(None),) * (batch_dims + 2) + (slice(None, None, -1),) * (a.ndim - batch_dims - 2)]


def canonical_shape(native_shape: tuple, layout: Any) -> tuple:
    """The canonical ``(out, in/groups, *k)`` shape of a weight of ``native_shape`` in ``layout``."""
    native_shape = tuple(native_shape)
    if isinstance(layout, Flipped):
        return canonical_shape(native_shape, layout.base)
    if isinstance(layout, (Axes, Permuted)):
        return tuple(layout.canonical)
    if layout == "flax":
        return (native_shape[-1], native_shape[-2]) + native_shape[:-2]
    return native_shape


def to_canonical(a: Any, layout: Any, batch_dims: int = 0) -> Any:
    """An array in the native ``layout`` (after ``batch_dims`` leading axes) in the canonical layout.

    Works on numpy and JAX arrays (inside or outside ``jit``).
    """
    if isinstance(layout, Flipped):
        return _flip_kernel(to_canonical(a, layout.base, batch_dims), batch_dims)
    if layout == "canonical":
        return a
    lead = tuple(range(batch_dims))
    if isinstance(layout, Axes):
        perm = lead + tuple(batch_dims + i for i in layout.out + layout.inp)
        return a.transpose(perm).reshape(tuple(a.shape[:batch_dims]) + layout.canonical)
    if isinstance(layout, Permuted):
        batch = tuple(a.shape[:batch_dims])
        if layout.split is not None:
            a = a.reshape(batch + layout.split)
        perm = lead + tuple(batch_dims + i for i in layout.perm)
        return a.transpose(perm).reshape(batch + layout.canonical)
    nd = a.ndim - batch_dims
    # flax (*k, in, out) -> canonical (out, in, *k)
    perm = lead + (batch_dims + nd - 1, batch_dims + nd - 2) + tuple(batch_dims + i for i in range(nd - 2))
    return a.transpose(perm)


def to_native(a: Any, layout: Any, batch_dims: int = 0) -> Any:
    """The inverse of :func:`to_canonical`."""
    if isinstance(layout, Flipped):
        return to_native(_flip_kernel(a, batch_dims), layout.base, batch_dims)
    if layout == "canonical":
        return a
    lead = tuple(range(batch_dims))
    if isinstance(layout, Axes):
        order = layout.out + layout.inp
        a = a.reshape(tuple(a.shape[:batch_dims]) + tuple(layout.shape[i] for i in order))
        inv = tuple(int(j) for j in np.argsort(order))
        return a.transpose(lead + tuple(batch_dims + j for j in inv))
    if isinstance(layout, Permuted):
        batch = tuple(a.shape[:batch_dims])
        a = a.reshape(batch + layout.permuted)
        inv = tuple(int(j) for j in np.argsort(layout.perm))
        return a.transpose(lead + tuple(batch_dims + j for j in inv)).reshape(batch + layout.shape)
    nd = a.ndim - batch_dims
    perm = lead + tuple(batch_dims + 2 + i for i in range(nd - 2)) + (batch_dims + 1, batch_dims)
    return a.transpose(perm)


def parse_layout(spec: Any, shape: tuple) -> Any:
    """A ``layouts=`` value for a leaf of ``shape``: ``"canonical"``, ``"flax"`` or :class:`Axes`.

    Accepted: the aliases of :data:`LAYOUT_ALIASES`; a string naming the role of every
    axis, ``"in"`` or ``"out"`` (e.g. ``"in,out,out"`` for an attention query kernel
    ``(d, heads, head_dim)``); or a mapping ``{"out": axes, "in": axes}``.

    Raises:
        ValueError: For anything else, with the accepted forms.
    """
    nd = len(shape)
    if isinstance(spec, Mapping):
        if set(spec) != {"out", "in"}:
            raise ValueError(f"A layout mapping has the keys 'out' and 'in' (native axes), got {sorted(spec)}.")
        def axes(v):
            v = (v,) if isinstance(v, int) else tuple(v)
            return tuple(int(i) % nd if -nd <= int(i) < nd else int(i) for i in v)
        try:
            return Axes(axes(spec["out"]), axes(spec["in"]), tuple(shape))
        except (TypeError, ValueError) as err:
            raise ValueError(f"Bad layout {dict(spec)!r} for a leaf of shape {tuple(shape)}: {err}") from err
    if isinstance(spec, str):
        roles = [t.strip() for t in spec.split(",")]
        if all(r in ("in", "out") for r in roles) and len(roles) == nd and "in" in roles and "out" in roles:
            if nd == 2:
                return "flax" if roles == ["in", "out"] else "canonical"
            return Axes(tuple(i for i, r in enumerate(roles) if r == "out"),
                        tuple(i for i, r in enumerate(roles) if r == "in"), tuple(shape))
        if spec in LAYOUT_ALIASES:
            return LAYOUT_ALIASES[spec]
    raise ValueError(
        f"Layout {spec!r} does not describe a leaf of shape {tuple(shape)}; choose one of {sorted(LAYOUT_ALIASES)} "
        "(dense layers and convolutions), the role of every axis ('in,out,out' for a kernel (d, heads, head_dim) "
        "whose first axis is contracted), {'out': axes, 'in': axes}, or None to exclude the leaf.")


@dataclass(frozen=True)
class LayerRule:
    """How normflat reads the weight of one module class.

    Attributes:
        leaf: Name of the module's weight leaf (``"weight"`` in equinox, ``"kernel"``
            in flax), or a tuple of names (a recurrent cell's input and recurrent
            weights, each its own layer named by its leaf path), or a function
            ``module ->`` names; the module's other leaves (biases) are held fixed.
        layout: ``"canonical"`` (``(out, in/groups, *k)``, torch/equinox order),
            ``"flax"`` (``(*k, in/groups, out)``), or a function ``(module, shape) ->``
            :class:`Axes` for multi-axis kernels, :class:`Flipped` or :class:`Permuted` (it
            returns a string, the reason, to refuse a kernel it cannot describe).
        groups: Attribute of the module holding its number of groups (grouped
            convolutions), a function ``module -> int``, or ``None`` (1).
        kind: Short type label; ``None``: ``"dense"`` for 2-D weights, ``"conv{N}d"``
            otherwise; ``"conv_transpose"``: ``"conv_transpose{N}d"``; ``"depthwise"``:
            ``"depthwise_conv{N}d"``.
        gates: Names of the maps packed along the canonical rows in equal blocks
            (recurrent gates, method §3 "Packed maps are split"), a function
            ``(module, shape) ->`` names (the experts of a keras-hub block), or ``None``.
    """

    leaf: str | tuple[str, ...] | Callable[[Any], tuple[str, ...]] = "kernel"
    layout: str | Callable[[Any, tuple], Any] = "flax"
    groups: str | Callable[[Any], int] | None = None
    kind: str | None = None
    gates: tuple[str, ...] | Callable[[Any, tuple], tuple[str, ...] | None] | None = None

    def leaves(self, module: Any = None) -> tuple[str, ...]:
        """The weight leaves' names (of ``module``, for a rule whose ``leaf`` is a function)."""
        if callable(self.leaf):
            return tuple(self.leaf(module)) if module is not None else ()
        return (self.leaf,) if isinstance(self.leaf, str) else tuple(self.leaf)

    def gates_of(self, module: Any, shape: tuple) -> tuple[str, ...] | None:
        """The names of the maps packed along the rows of ``module``'s weight of ``shape``."""
        return self.gates(module, tuple(shape)) if callable(self.gates) else self.gates

    def layout_of(self, module: Any, shape: tuple) -> Any:
        """The layout of this rule's weight of ``shape`` (a string reason: refused)."""
        return self.layout(module, tuple(shape)) if callable(self.layout) else self.layout

    def groups_of(self, module: Any) -> int:
        """The number of groups of ``module`` (1 when the rule has none)."""
        if self.groups is None or module is None:
            return 1
        g = self.groups(module) if callable(self.groups) else getattr(module, self.groups, 1)
        return int(g or 1)

    def kind_of(self, ndim: int) -> str:
        """The layer kind for a weight with ``ndim`` dimensions."""
        if self.kind == "conv_transpose":
            return f"conv_transpose{ndim - 2}d"
        if self.kind == "depthwise":
            return f"depthwise_conv{ndim - 2}d"
        return self.kind or _conv_kind(ndim)


def _check_entry(entry: Any) -> None:
    if entry is IGNORE or isinstance(entry, Unsupported):
        return
    if not isinstance(entry, LayerRule):
        raise TypeError(f"A JAX layer entry is a LayerRule, IGNORE or Unsupported(reason), got {entry!r}.")
    if not callable(entry.layout) and entry.layout not in ("canonical", "flax"):
        raise ValueError(f"LayerRule.layout must be 'canonical', 'flax' or a function (module, shape) -> Axes, "
                         f"got {entry.layout!r}.")


REGISTRY: LayerRegistry[LayerRule] = LayerRegistry(
    "JAX", None, "normflat.backends.jax.register_layer(Type, LayerRule(leaf=..., layout=...)), or declare "
    "the leaf with layouts={path: 'out,in,*k' or '*k,in,out'}")
_BUILTINS_LOADED: set[str] = set()


def _module_bases() -> tuple[type, ...]:
    bases = []
    for mod, attr in (("equinox", "Module"), ("flax.nnx", "Module"), ("flax.linen", "Module")):
        m = sys.modules.get(mod)
        if m is not None:
            bases.append(getattr(m, attr))
    if keras_runs_on_jax():
        bases.append(sys.modules["keras"].layers.Layer)
    return tuple(bases)


def register_layer(module_type: type, entry: LayerRule | Unsupported | Any = None, *,
                   unsupported: str | None = None, **rule: Any) -> None:
    """Register (or replace) how normflat reads a JAX module class, in one call.

    Examples::

        register_layer(MyDense, LayerRule(leaf="w", layout="canonical"))  # w: (out, in)
        register_layer(MyConv, leaf="kernel", layout="flax", groups="feature_group_count")
        register_layer(MyNorm, IGNORE)                                   # scales held fixed
        register_layer(MyOp, unsupported="its kernel is not a weight matrix")

    Args:
        module_type: An ``equinox.Module``, ``flax.nnx.Module`` or ``flax.linen.Module``
            subclass; its subclasses match too unless registered themselves.
        entry: A :class:`LayerRule`, :data:`~normflat.engine.registry.IGNORE` or
            :class:`~normflat.engine.registry.Unsupported`; or pass the rule's fields
            as keywords.
        unsupported: Shorthand for ``Unsupported(reason)``.

    Raises:
        TypeError: If ``module_type`` is not a JAX module class or the entry is invalid.
    """
    _load_builtins()
    bases = _module_bases()
    if not isinstance(module_type, type) or not bases or not issubclass(module_type, bases):
        raise TypeError(
            f"register_layer needs an equinox, flax nnx or flax linen module class, got {module_type!r}.")
    if unsupported is not None:
        entry = Unsupported(unsupported)
    elif entry is None:
        entry = LayerRule(**rule)
    elif rule:
        raise TypeError("Pass either an entry or LayerRule fields as keywords, not both.")
    _check_entry(entry)
    REGISTRY.register(module_type, entry)


def registered_layers() -> dict[type, Any]:
    """A copy of the registry ``{module class: LayerRule | IGNORE | Unsupported}``."""
    _load_builtins()
    return REGISTRY.entries()


_TRANSPOSE_KERNEL = ("transpose_kernel=True: the kernel is stored (*k, out, in) and flipped where it is applied, "
                     "a layout normflat does not read; build the layer with transpose_kernel=False (the default) and "
                     "its kernel flipped on the kernel axes and with the last two axes swapped: the same function")


def _conv_transpose_layout(module: Any, shape: tuple) -> Flipped | str:
    """A flax ``ConvTranspose`` kernel: ``(*k, in, out)`` like its convolution's, flipped (method §3);
    with ``transpose_kernel=True`` (``(*k, out, in)``, flipped inside ``lax.conv_transpose``) refused."""
    return _TRANSPOSE_KERNEL if getattr(module, "transpose_kernel", False) else Flipped("flax")


#: Packed recurrent weights of flax nnx cells: {cell class name: (child Linear attributes, gate order)}.
#: Filled for the classes of flax.nnx when it is imported (the gate order of each framework, method §3).
PACKED_CHILDREN: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _tuple(v: Any) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def _general_axes(n_batch: int, n_out: int, what: str) -> Callable[[Any, tuple], Any]:
    """The layout of a kernel ``(*batch, *in_features, *out_features)`` (LinearGeneral, DenseGeneral)."""
    def layout(module, shape):
        if n_batch(module):
            return (f"its kernel has batch axes ({what}): one matrix per batch entry is not a single weight "
                    "matrix; normflat refuses it")
        k = n_out(module)
        nd = len(shape)
        return Axes(tuple(range(nd - k, nd)), tuple(range(nd - k)), tuple(shape))
    return layout


def _einsum_axes(attribute: str = "einsum_str") -> Callable[[Any, tuple], Any]:
    """The layout of an ``Einsum`` kernel from its equation ``"lhs,kernel->out"`` (the module's
    ``attribute``: flax's ``einsum_str``, Keras' ``EinsumDense.equation``)."""
    def layout(module, shape):
        eq = getattr(module, attribute, None)
        if not isinstance(eq, str) or "->" not in eq or eq.count(",") != 1:
            return "its einsum equation is not of the form 'inputs,kernel->outputs'; declare its layout with layouts="
        eq = eq.replace(" ", "").replace("...", "")
        ins, out = eq.split("->")
        lhs, rhs = ins.split(",")
        if len(rhs) != len(shape) or len(set(rhs)) != len(rhs):
            return f"its kernel subscripts {rhs!r} do not match the kernel shape {tuple(shape)}"
        roles = []
        for c in rhs:
            if c in lhs and c not in out:
                roles.append("in")
            elif c in out and c not in lhs:
                roles.append("out")
            else:
                return (f"kernel axis {c!r} of {eq!r} is a batch axis (in both inputs and outputs) or summed "
                        "alone: the kernel is not one weight matrix; normflat refuses it")
        if "in" not in roles or "out" not in roles:
            return f"the kernel of {eq!r} has no input or no output axis"
        return Axes(tuple(i for i, r in enumerate(roles) if r == "out"),
                    tuple(i for i, r in enumerate(roles) if r == "in"), tuple(shape))
    return layout


def _load_builtins() -> None:
    """Register the built-in types of every JAX library imported so far (once per library)."""
    eqx = sys.modules.get("equinox")
    if eqx is not None and "equinox" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("equinox")
        nn = eqx.nn
        REGISTRY.register(nn.Linear, LayerRule(leaf="weight", layout="canonical", kind="dense"))
        REGISTRY.register(nn.Conv, LayerRule(leaf="weight", layout="canonical", groups="groups"))
        REGISTRY.register(nn.ConvTranspose, LayerRule(leaf="weight", layout=lambda m, shape: Flipped("canonical"),
                                                      groups="groups", kind="conv_transpose"))
        # The table is (vocabulary, features): the map from one-hot entries to features, transposed (method §3).
        REGISTRY.register(nn.Embedding, LayerRule(leaf="weight", layout="flax", kind="embedding"))
        # Packed gates along the rows of (gates·hidden, in) and (gates·hidden, hidden), equinox's own order.
        REGISTRY.register(nn.LSTMCell, LayerRule(leaf=("weight_ih", "weight_hh"), layout="canonical",
                                                 kind="recurrent", gates=("i", "f", "g", "o")))
        REGISTRY.register(nn.GRUCell, LayerRule(leaf=("weight_ih", "weight_hh"), layout="canonical",
                                                kind="recurrent", gates=("r", "z", "n")))
        _ignore_norms(nn)
        REGISTRY.register(nn.State, IGNORE)  # the running statistics of stateful layers
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and "flax.nnx" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("flax.nnx")
        _register_flax(nnx, nnx.Linear, nnx.Embed)
        REGISTRY.register(nnx.LinearGeneral, LayerRule(
            layout=_general_axes(lambda m: len(getattr(m, "batch_axis", None) or ()),
                                 lambda m: len(_tuple(m.out_features)), "batch_axis"), kind="dense"))
        REGISTRY.register(nnx.Einsum, LayerRule(layout=_einsum_axes(), kind="dense"))
        # nnx.LoRA (alone, or as nnx.LoRALinear's `lora`): x @ lora_a @ lora_b, two linear maps stored
        # like flax kernels, (in, r) and (r, out): canonical (r, in) and (out, r) (method §3, "LoRA adapters").
        REGISTRY.register(nnx.LoRA, LayerRule(leaf=("lora_a", "lora_b"), kind="dense"))
        # nnx cells that pack their gates into one Linear per input (method §3: split per gate).
        PACKED_CHILDREN[nnx.OptimizedLSTMCell] = (("dense_i", "dense_h"), ("i", "f", "g", "o"))
        PACKED_CHILDREN[nnx.GRUCell] = (("dense_i", "dense_h"), ("r", "z", "n"))
    on_jax = keras_runs_on_jax()
    if on_jax and "keras" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("keras")
        _register_keras(sys.modules["keras"])
    hub = sys.modules.get("keras_hub")
    if on_jax and hub is not None and "keras_hub" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("keras_hub")
        position = getattr(getattr(hub, "layers", None), "PositionEmbedding", None)
        if isinstance(position, type):
            # The table (positions, features) is the embedding of the positions: canonical (features, positions).
            REGISTRY.register(position, LayerRule(leaf="embeddings", layout="flax",
                                                  kind="position_embedding"))
        # DeBERTa-v3's table of relative positions (2·buckets, features): the embedding of the buckets.
        relative = getattr(sys.modules.get("keras_hub.src.models.deberta_v3.relative_embedding"),
                           "RelativeEmbedding", None)
        if isinstance(relative, type):
            REGISTRY.register(relative, LayerRule(leaf="rel_embedding", layout="flax", kind="position_embedding"))
    linen = sys.modules.get("flax.linen")
    if linen is not None and "flax.linen" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("flax.linen")
        _register_flax(linen, linen.Dense, linen.Embed)
        REGISTRY.register(linen.DenseGeneral, LayerRule(
            layout=_general_axes(lambda m: len(_tuple(getattr(m, "batch_dims", ()) or ())),
                                 lambda m: len(_tuple(m.features)), "batch_dims"), kind="dense"))
        REGISTRY.register(linen.Einsum, LayerRule(layout=_einsum_axes(), kind="dense"))
        # OptimizedLSTMCell's per-gate parameters (concatenated at call time): each gate its own matrix.
        from flax.linen.recurrent import DenseParams
        REGISTRY.register(DenseParams, LayerRule(kind="dense"))


def _register_keras(keras: Any) -> None:
    """Keras 3 layers on the JAX backend: their kernels are stored like flax's (method §3).

    ``Dense`` ``(in, out)``, convolutions ``(*k, in/groups, out)``, ``Embedding`` ``(vocabulary,
    features)``, ``EinsumDense`` by its equation (so ``MultiHeadAttention``'s projections); the
    normalization layers' scales and shifts and PReLU's slopes are held fixed. A LoRA-enabled layer gives
    its frozen kernel and its two factors (as on the TensorFlow backend); a quantized layer is refused.
    """
    from normflat.backends.keras_shared import KERAS_IGNORED_LAYERS  # imports Keras: loaded only with it

    L = keras.layers

    REGISTRY.register(L.Dense, LayerRule(kind="dense"))
    REGISTRY.register(L.EinsumDense, LayerRule(layout=_einsum_axes("equation"), kind="einsum_dense"))
    REGISTRY.register(L.Embedding, LayerRule(leaf="embeddings", layout="flax", kind="embedding"))
    for conv in (L.Conv1D, L.Conv2D, L.Conv3D):
        REGISTRY.register(conv, LayerRule(groups="groups"))
    # Keras' JAX backend applies these kernels as is (a depthwise kernel reshaped to one with one group
    # per input channel, a transposed one flipped and swapped inside lax.conv_transpose): the canonical
    # layouts are the TensorFlow backend's (method §3).
    for transposed in (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose):
        REGISTRY.register(transposed, LayerRule(layout=_keras_transpose_layout, kind="conv_transpose"))
    for depthwise in (L.DepthwiseConv1D, L.DepthwiseConv2D):
        REGISTRY.register(depthwise, LayerRule(layout=_depthwise_layout, groups=lambda m: m.kernel.shape[-2],
                                               kind="depthwise"))
    # keras-hub's stacked experts kernels, one (out, in) matrix per expert and map (:func:`_keras_owner`).
    REGISTRY.register(_ExpertsKernel, LayerRule(leaf=lambda m: (m.leaf,), layout=_experts_layout,
                                                gates=_experts_blocks, kind="expert"))
    # keras-hub layers' own matrices (RWKV-7's low-rank maps, Qwen3.5's causal convolution), read as the
    # TensorFlow backend reads them; a weight that is no matrix is held fixed with the reason.
    REGISTRY.register(_HubOwnDense, LayerRule(leaf=lambda m: (m.leaf,), kind="dense"))
    REGISTRY.register(_HubOwnDepthwise, LayerRule(
        leaf=lambda m: (m.leaf,), layout=lambda m, shape: Permuted((0, 1), tuple(shape), (shape[0], 1, shape[1])),
        groups=lambda m: m.channels, kind="depthwise_conv1d"))
    REGISTRY.register(_HubOwnExcluded, LayerRule(leaf=lambda m: ()))
    # A SeparableConv's two kernels, each its own layer (:func:`_keras_owner`).
    REGISTRY.register(_SeparableDepthwise, LayerRule(
        leaf="depthwise_kernel", layout=_depthwise_layout, groups=lambda m: m.layer.depthwise_kernel.shape[-2],
        kind="depthwise"))
    REGISTRY.register(_SeparablePointwise, LayerRule(leaf="pointwise_kernel"))
    # The cells' kernel (in, G·H) and recurrent kernel (H, G·H), each one matrix per gate in Keras' gate
    # order (method §3, "Packed maps are split"), as the TensorFlow backend reads them.
    for cell, gates in ((L.LSTMCell, ("i", "f", "c", "o")), (L.GRUCell, ("z", "r", "h")), (L.SimpleRNNCell, None)):
        REGISTRY.register(cell, LayerRule(leaf=("kernel", "recurrent_kernel"), layout="flax", kind="recurrent",
                                          gates=gates))
    for name in KERAS_IGNORED_LAYERS:
        if hasattr(L, name):
            REGISTRY.register(getattr(L, name), IGNORE)
    REGISTRY.register(_Quantized, Unsupported(
        "a quantized Keras layer's kernel is not a floating-point variable (its call computes it from integer "
        "values and scales); analyze the float model"))
    REGISTRY.register(_LoraRefused, Unsupported(
        "a LoRA-enabled grouped convolution (its B factor mixes the groups) or LoRA on a layer kind without "
        "LoRA factors in normflat (Dense, EinsumDense, Embedding and Conv1D/2D/3D have them) is not supported"))
    # The factors of a LoRA-enabled layer (enable_lora), each the linear map it is (method §3, "LoRA
    # adapters"), as the TensorFlow backend reads them; the frozen kernel takes the layer's own rule.
    lora_leaf = lambda m: (m.leaf,)  # noqa: E731
    REGISTRY.register(_LoraDense, LayerRule(
        leaf=lora_leaf, layout=lambda m, shape: "canonical" if m.b_into_rank else "flax", kind="dense"))
    REGISTRY.register(_LoraEmbedding, LayerRule(leaf=lora_leaf, kind="embedding"))
    REGISTRY.register(_LoraConv, LayerRule(leaf=lora_leaf))
    REGISTRY.register(_LoraEinsum, LayerRule(leaf=lora_leaf, layout=_einsum_axes("rank_equation"),
                                             kind="einsum_dense"))
    # An untied ReversibleEmbedding's reverse projection (features, vocabulary): a dense kernel,
    # `name/reverse` (the table takes the Embedding rule), as the TensorFlow backend reads it.
    REGISTRY.register(_ReverseProjection, LayerRule(leaf="reverse_embeddings", kind="dense"))


def _keras_transpose_layout(module: Any, shape: tuple) -> Permuted:
    """A Keras ``ConvNDTranspose`` kernel ``(*k, out, in)``: the kernel of the convolution whose input
    gradient the layer computes, whose input channels are the layer's outputs; canonical
    ``(out, in, *k)`` (method §3)."""
    r = len(shape) - 2
    perm = (r, r + 1) + tuple(range(r))
    return Permuted(perm, tuple(shape), tuple(shape[i] for i in perm))


def _experts_layout(module: Any, shape: tuple) -> Permuted | str:
    """A keras-hub experts kernel ``(experts, in, out)``: canonical ``(experts·out, in)``, expert after
    expert, each expert's gate rows before its up rows (de-interleaved where they alternate), as the
    TensorFlow backend reads it (method §3, "Mixture-of-experts layers")."""
    if len(shape) != 3 or (module.maps.startswith("gate_up") and shape[2] % 2):
        return f"{type(module.layer).__name__}.{module.attribute} is not an (experts, in, out) kernel"
    experts, cols, rows = shape
    if module.maps == "gate_up_interleaved":
        return Permuted((0, 3, 2, 1), tuple(shape), (experts * rows, cols), split=(experts, cols, rows // 2, 2))
    return Permuted((0, 2, 1), tuple(shape), (experts * rows, cols))


def _experts_blocks(module: Any, shape: tuple) -> tuple[str, ...]:
    """The blocks of an experts kernel's canonical rows: ``<e>``, or ``<e>.gate`` and ``<e>.up``."""
    experts = int(shape[0])
    if module.maps.startswith("gate_up"):
        return tuple(f"{e}.{part}" for e in range(experts) for part in ("gate", "up"))
    return tuple(str(e) for e in range(experts))


def _depthwise_layout(module: Any, shape: tuple) -> Permuted:
    """A Keras depthwise kernel ``(*k, in, multiplier)``: canonical ``(in·multiplier, 1, *k)``, one group
    per input channel, output channel ``i·multiplier + j`` reading input channel ``i`` (method §3)."""
    r = len(shape) - 2
    return Permuted((r, r + 1) + tuple(range(r)), tuple(shape),
                    (shape[r] * shape[r + 1], 1) + tuple(shape[:r]))


def _register_flax(api: Any, dense: type, embed: type) -> None:
    """The built-in entries of one flax API (nnx or linen): the same rules, other class names."""
    REGISTRY.register(dense, LayerRule(kind="dense"))
    REGISTRY.register(api.Conv, LayerRule(groups="feature_group_count"))
    REGISTRY.register(api.ConvTranspose, LayerRule(layout=_conv_transpose_layout, kind="conv_transpose"))
    # The table (vocabulary, features) is stored like a flax kernel (in, out): canonical (features, vocabulary).
    REGISTRY.register(embed, LayerRule(leaf="embedding", layout="flax", kind="embedding"))
    _ignore_norms(api)


def _ignore_norms(api: Any) -> None:
    """Normalization layers and PReLU: their scales, shifts and slopes never enter the measures (method §4)."""
    for name in ("LayerNorm", "BatchNorm", "GroupNorm", "RMSNorm", "PReLU"):
        if hasattr(api, name):
            REGISTRY.register(getattr(api, name), IGNORE)


@dataclass
class WeightInfo:
    """A recognised weight tensor.

    Attributes:
        name: Layer name (the pytree path of the layer, e.g. ``layers/0``).
        path: Full path of the leaf (``layers/0/weight``).
        leaf: Index in :attr:`ModelView.leaves`.
        kind: ``"dense"``, ``"conv2d"``, ``"embedding"``, ...
        layout: ``"canonical"`` (out, in/groups, *k), ``"flax"`` (*k, in/groups, out),
            :class:`Axes` (a multi-axis kernel), :class:`Flipped` (a flax or equinox transposed
            convolution's kernel) or :class:`Permuted` (Keras' transposed and depthwise kernels).
        groups: Groups of a grouped convolution.
        blocks: Packed maps along the canonical rows, ``[(suffix, start, stop), ...]``
            (:attr:`~normflat.engine.problems.LayerSpec.blocks`), or ``None``.
        inferred: Where the layout came from when it was not a registry rule: ``"layouts"``
            (the user's ``layouts=``) or ``"convention"`` (an ``(apply_fn, params)`` leaf
            named ``kernel``); checked against the traced program (see
            :func:`check_layouts`).
    """

    name: str
    path: str
    leaf: int
    kind: str
    layout: Any
    groups: int = 1
    blocks: list | None = None
    inferred: str | None = None

    def to_canonical(self, a: Any, batch_dims: int = 0) -> Any:
        """Transpose an array in this weight's native layout (after ``batch_dims`` axes)."""
        return to_canonical(a, self.layout, batch_dims)

    def to_native(self, a: Any, batch_dims: int = 0) -> Any:
        """The inverse of :meth:`to_canonical` (numpy or JAX arrays)."""
        return to_native(a, self.layout, batch_dims)


def _gate_blocks(gates: tuple[str, ...] | None, rows: int) -> list | None:
    """Equal row blocks ``(gate, start, stop)`` of a packed weight with ``rows`` canonical rows."""
    if not gates:
        return None
    if rows % len(gates):
        raise ValueError(f"A packed weight with {rows} rows cannot hold {len(gates)} equal gate blocks {gates}.")
    h = rows // len(gates)
    return [(g, j * h, (j + 1) * h) for j, g in enumerate(gates)]


@dataclass
class ModelView:
    """A model as pure functions of its floating-point leaves."""

    framework: str
    leaves: list
    paths: list[str]
    weights: list[WeightInfo]
    extra: list
    apply_batch: Callable[[list, list, Any], Any]
    apply_example: Callable[[list, list, Any], Any]
    vmap: bool | None = None
    dtype: Any = None
    #: Hashable description of everything the traced program depends on besides the
    #: leaf values (None: not hashable, the program is traced every time).
    struct: Any = None
    #: Objects whose ids appear in ``struct``, kept alive with cache entries.
    struct_refs: list = field(default_factory=list)
    #: Messages of the leaves the registry could not analyze (``on_unsupported``).
    unsupported: list[str] = field(default_factory=list)
    #: What became of every parameter leaf (the report's ``excluded`` and ``coverage``).
    parameters: list = field(default_factory=list)

    def split(self) -> tuple[list, list]:
        """``(weights, others)``: weight leaves in :attr:`weights` order, then every other input leaf."""
        wid = {w.leaf for w in self.weights}
        ws = [self.leaves[w.leaf] for w in self.weights]
        return ws, [a for i, a in enumerate(self.leaves) if i not in wid] + list(self.extra)

    def example_fn(self) -> Callable[[list, list, Any], Any]:
        """``(weights, others, x) -> logits`` of one example (see :meth:`split`)."""
        wid = [w.leaf for w in self.weights]
        rest = [i for i in range(len(self.leaves)) if i not in set(wid)]
        n_rest = len(rest)

        def f(ws, others, x):
            leaves = [None] * len(self.leaves)
            for i, w in zip(wid, ws):
                leaves[i] = w
            for i, a in zip(rest, others[:n_rest]):
                leaves[i] = a
            return self.apply_example(leaves, list(others[n_rest:]), x)

        return f


def path_str(path) -> str:
    """``(GetAttrKey('layers'), SequenceKey(0), GetAttrKey('weight'))`` -> ``layers/0/weight``."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _as(a, dtype):
    """``a`` as a JAX array of ``dtype`` (no copy or dispatch when it already is one)."""
    if isinstance(a, jax.Array) and a.dtype == dtype:
        return a
    return jnp.asarray(a, dtype=dtype)


def pick_dtype(leaves) -> Any:
    """Compute dtype from the parameters: their common floating dtype, at least float32."""
    dts = [a.dtype for a in leaves if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)]
    dt = jnp.result_type(*dts) if dts else jnp.float32
    # Hessians in half precision are meaningless: compute in at least float32.
    return jnp.dtype(jnp.promote_types(dt, jnp.float32))


def _is_floating(a) -> bool:
    try:
        return jnp.issubdtype(a.dtype, jnp.floating)
    except TypeError:  # extended dtypes (PRNG keys of nnx Rngs) are no numpy dtypes
        return False


def _cast(tree, dtype):
    def f(a):
        if isinstance(a, (jax.Array, np.ndarray)) and _is_floating(a):
            return _as(a, dtype)
        return a
    return jax.tree_util.tree_map(f, tree)


def _walk(obj, path):
    """Follow pytree keys through a module object; None if it cannot be followed."""
    for k in path:
        try:
            if hasattr(k, "name"):
                obj = getattr(obj, k.name)
            elif hasattr(k, "idx"):
                obj = obj[k.idx]
            elif hasattr(k, "key"):
                key = k.key
                obj = getattr(obj, key) if isinstance(key, str) and not isinstance(obj, Mapping) else obj[key]
            else:
                return None
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
    return obj


def _avals(leaves) -> tuple:
    return tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a).__name__))) for a in leaves)


def _struct(*parts, refs: list) -> Any:
    """A hashable structural key, or None. Unhashable static leaves are keyed by id (kept in ``refs``)."""
    def key(obj):
        try:
            hash(obj)
            return obj
        except TypeError:
            refs.append(obj)
            return ("id", id(obj))
    try:
        k = tuple(tuple(key(o) for o in p) if isinstance(p, list) else key(p) for p in parts)
        hash(k)
        return k
    except Exception:  # noqa: BLE001 - e.g. a treedef whose static data cannot be hashed or compared
        return None


def _conv_kind(ndim: int) -> str:
    return "dense" if ndim == 2 else f"conv{ndim - 2}d"


# ----------------------------------------------------------------------------- dispatch


def make_view(model: Any, x0: Any, *, dtype: Any, vmap: bool | None, state: Any, apply_kwargs: dict,
              layouts: dict, keywords: bool = False, output: Any = None, strip_softmax: bool = True) -> ModelView:
    """Build the :class:`ModelView` of any supported model (``x0``: the first input batch).

    Args:
        keywords: ``x0`` is a mapping of keyword inputs (a Hugging Face style batch):
            the model is called as ``model(**x)`` (linen ``apply(variables, **x)``).
        output: The ``output`` option: what to take from a model that returns a
            mapping, tuple or object (:func:`normflat.engine.outputs.select_output`).
        strip_softmax: A Keras model's final softmax is made the identity (the built-in losses
            take logits; ``False`` for a custom loss callable, which takes the model's outputs).

    The unsupported leaves are listed in :attr:`ModelView.unsupported`; the caller
    reports them according to ``on_unsupported``.
    """
    _load_builtins()
    eqx = sys.modules.get("equinox")
    nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    invoke = _invoker(keywords, output)
    if eqx is not None and isinstance(model, eqx.Module):
        view, owners, parents = _equinox(model, x0, dtype, vmap, state, invoke)
    else:
        if vmap is not None or state is not None:
            raise TypeError("vmap= and state= are options of equinox models only.")
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(model, keras.layers.Layer):
            # A Keras model takes a mapping of named inputs as its one input (keras-hub backbones).
            view, owners, parents = _keras(model, dtype, _invoker(False, output), strip_softmax)
        elif nnx is not None and isinstance(model, nnx.Module):
            view, owners, parents = _nnx(model, dtype, invoke)
        elif linen is not None and isinstance(model, tuple) and isinstance(model[0], linen.Module):
            view, owners, parents = _linen(model[0], model[1], x0, dtype, apply_kwargs, invoke)
        else:
            view, owners, parents = _pair(model[0], model[1], dtype, apply_kwargs, invoke)
    if apply_kwargs and view.framework in ("equinox", "flax.nnx", "keras"):
        raise TypeError("apply_kwargs= is an option of (flax linen module, variables) and (apply_fn, params) "
                        "models; call options of equinox / nnx modules belong in the module.")
    view.struct = None if view.struct is None else view.struct + (bool(keywords), _output_key(output))
    _select_weights(view, owners, layouts, parents)
    return view


def _is_array(a: Any) -> bool:
    return isinstance(a, jax.Array) or (hasattr(a, "shape") and hasattr(a, "dtype") and hasattr(a, "ndim"))


def _invoker(keywords: bool, output: Any) -> Callable:
    """``invoke(f, x, *args, **kw)``: the model call on inputs ``x``, reduced to its logits."""
    def invoke(f, x, *args, **kw):
        out = f(*args, **x, **kw) if keywords else f(*args, x, **kw)
        return select_output(out, output, _is_array)
    return invoke


def _output_key(output: Any) -> Any:
    try:
        hash(output)
        return output
    except TypeError:
        return ("id", id(output))


_PAIR_REASON = ("a parameter leaf of an (apply_fn, params) model not named 'kernel'; declare its layout with "
                "layouts={path: 'out,in,*k' or '*k,in,out'}")
_RULE_REASON = "a parameter of a recognised layer that is not its weight (held fixed)"


def _select_weights(view: ModelView, owners: dict, layouts: dict, parents: dict | None = None) -> None:
    """Decide which leaves are weight tensors, from ``layouts=`` and the registry.

    Fills :attr:`ModelView.weights`, :attr:`ModelView.parameters` (the status of every
    leaf) and the skipped leaves.

    Args:
        view: The model view (its ``weights`` list is filled).
        owners: ``{leaf path: owning module}`` (``None``: unknown owner, the
            ``(apply_fn, params)`` convention of leaves named ``kernel`` applies).
        layouts: The user's ``layouts=``.
        parents: ``{leaf path: (module owning the owner, owner's attribute name)}``, for
            cells that pack their gates into child layers (:data:`PACKED_CHILDREN`).
    """
    parents = parents or {}
    unknown = set(layouts) - set(view.paths)
    if unknown:
        raise ValueError(
            f"layouts= names {sorted(unknown)}, which are not parameter leaves of this model. "
            f"Parameter leaves with at least 2 dimensions: "
            f"{[p for p, l in zip(view.paths, view.leaves) if np.ndim(l) >= 2]}."
        )
    skipped = Skipped(REGISTRY)
    status: list = []

    def mark(path, leaf, st, reason=None):
        status.append(ParameterStatus(path, tuple(int(d) for d in np.shape(leaf)), st, reason))

    def add(name, path, i, kind, layout, groups=1, gates=None, inferred=None):
        rows = canonical_shape(np.shape(view.leaves[i]), layout)[0]
        view.weights.append(WeightInfo(name, path, i, kind, layout, groups, _gate_blocks(gates, rows), inferred))
        mark(path, view.leaves[i], "analyzed")

    def skip(path, leaf, obj, reason=None):
        label = f"{path} {tuple(np.shape(leaf))}"
        skipped.add(label, obj, reason)
        mark(path, leaf, "skipped", skipped.items[-1].reason)

    layer_names = getattr(view, "layer_names", {})  # Keras: the TensorFlow backend's names
    for i, (path, leaf) in enumerate(zip(view.paths, view.leaves)):
        name, _, last = path.rpartition("/")
        name = layer_names.get(path) or name or last
        shape = tuple(np.shape(leaf))
        if path in layouts:
            lay = layouts[path]
            if lay is None or lay == "skip":
                mark(path, leaf, "excluded" if _matrix(shape) == 0 else "skipped", "layouts= set it to None")
                continue
            if np.ndim(leaf) < 2:
                raise ValueError(f"layouts[{path!r}]: the leaf has shape {shape}; a weight needs >= 2 dims.")
            layout = parse_layout(lay, shape)
            owner = owners.get(path)
            rule = REGISTRY.lookup(owner) if owner is not None else None
            groups = rule.groups_of(owner) if isinstance(rule, LayerRule) else 1
            kind = "dense" if isinstance(layout, Axes) else _conv_kind(np.ndim(leaf))
            add(name, path, i, kind, layout, groups, inferred="layouts")
            continue
        if path not in owners:
            # (apply_fn, params): flax's convention, leaves named "kernel" are (*k, in, out) kernels
            # (a multi-axis kernel is told apart by how the traced program uses it: check_layouts).
            if last == "kernel" and 2 <= np.ndim(leaf) <= 5:
                add(name, path, i, _conv_kind(np.ndim(leaf)), "flax", inferred="convention")
            else:
                _loose(view, path, leaf, i, mark, add, lambda: skip(path, leaf, leaf, _PAIR_REASON))
            continue
        owner = owners[path]
        entry = REGISTRY.lookup(owner) if owner is not None else None
        if entry is IGNORE:
            mark(path, leaf, "excluded", IGNORED_REASON)
            continue  # normalization layers: their parameters are held fixed (method §4)
        if isinstance(entry, LayerRule):
            relative = relative_bias_table(name) if entry.kind_of(np.ndim(leaf)) == "embedding" else None
            if relative is not None:  # T5's relative_attention_bias: added to the scores (method §3)
                mark(path, leaf, "excluded", relative)
                continue
            if last in entry.leaves(owner) and np.ndim(leaf) >= 2:
                layout = entry.layout_of(owner, shape)
                if isinstance(layout, str) and layout not in ("canonical", "flax"):
                    skip(path, leaf, owner, layout)
                    continue
                gates = entry.gates_of(owner, shape)
                parent = parents.get(path)
                if gates is None and parent is not None and type(parent[0]) in PACKED_CHILDREN:
                    children, packed = PACKED_CHILDREN[type(parent[0])]
                    gates = packed if parent[1] in children else None
                kind = entry.kind_of(np.ndim(leaf))
                stacked = _stacked_axes(entry, owner, shape)
                if stacked:
                    stack = _stack_layout(entry, owner, gates, shape, stacked)
                    if isinstance(stack, str):
                        skip(path, leaf, owner, stack)
                        continue
                    layout, gates, kind = stack[0], stack[1], entry.kind or "dense"
                lname = path if len(entry.leaves(owner)) > 1 else name
                add(lname, path, i, kind, layout, entry.groups_of(owner), gates)
            else:
                reason = getattr(owner, "excluded_because", None) if isinstance(owner, _HubOwn) else None
                mark(path, leaf, "excluded", reason or excluded_reason(path, shape) or _RULE_REASON)
            continue  # the rule's other leaves (biases) are held fixed
        if isinstance(entry, Unsupported):
            if np.ndim(leaf) < 2 or excluded_reason(path, shape):
                mark(path, leaf, "excluded", excluded_reason(path, shape) or _RULE_REASON)
            else:
                skip(path, leaf, owner, entry.reason)
            continue
        _loose(view, path, leaf, i, mark, add, lambda: skip(path, leaf, owner if owner is not None else leaf))
    view.unsupported = skipped.messages()
    view.skipped = skipped  # type: ignore[attr-defined]
    view.parameters = status


def _stacked_axes(entry: LayerRule, owner: Any, shape: tuple) -> int:
    """The leading axes a stack of identical layers adds to a weight (0: none).

    ``nn.scan`` / ``nn.vmap`` over a linen module, ``nnx.vmap`` / ``nnx.scan`` over the creation of
    nnx layers and ``eqx.filter_vmap`` over equinox ones keep one weight per layer stacked along new
    leading axes; the module that owns it is the single layer, whose weight has fewer axes: 2 for a
    dense layer or an embedding, the kernel size's axes and 2 for a convolution, its input, output
    (and batch) feature axes for a multi-axis kernel (nnx ``LinearGeneral``, linen ``DenseGeneral``,
    so attention's projections).
    """
    expected = len(shape)
    if entry.kind in ("dense", "embedding"):
        if not callable(entry.layout):
            expected = 2
        elif hasattr(owner, "in_features") and hasattr(owner, "out_features"):  # nnx.LinearGeneral
            expected = (len(_tuple(owner.in_features)) + len(_tuple(owner.out_features))
                        + len(getattr(owner, "batch_axis", None) or ()))
        elif hasattr(owner, "features") and hasattr(owner, "axis"):  # linen DenseGeneral
            expected = (len(_tuple(owner.axis)) + len(_tuple(owner.features))
                        + len(_tuple(getattr(owner, "batch_dims", ()) or ())))
    elif entry.kind in (None, "conv_transpose") and isinstance(getattr(owner, "kernel_size", None), (tuple, list)):
        # An int kernel size fits any number of spatial axes: no stack is read from it.
        expected = len(owner.kernel_size) + 2
    return max(len(shape) - expected, 0)


def _stack_layout(entry: LayerRule, owner: Any, gates: tuple[str, ...] | None, shape: tuple,
                  stacked: int) -> tuple[Axes, tuple[str, ...]] | str:
    """``(layout, blocks)`` of a weight with ``stacked`` leading layer axes (method §3, "Stacked
    layers"), or why it is refused.

    Each layer of the stack is its own matrix: the canonical rows are the layers' rows one layer after
    the other (:class:`Axes` with the stack's axes first among the outputs, then one layer's output
    axes; its input axes as one layer's), split into one block per layer, named by its index
    (flattened over several stack axes).
    """
    if entry.kind not in ("dense", "embedding") and not callable(entry.layout):
        return ("a stack of convolution layers (nn.scan / nnx.vmap / eqx.filter_vmap over it) is not supported: "
                "each layer's kernel would need its own convolution problem")
    if gates is not None:
        return "a stack of layers with packed gates is not supported"
    inner_shape = tuple(shape[stacked:])
    inner = entry.layout_of(owner, inner_shape)
    if isinstance(inner, str) and inner in ("flax", "canonical"):
        last, before = len(inner_shape) - 1, len(inner_shape) - 2
        inner = Axes((last,), (before,), inner_shape) if inner == "flax" else Axes((before,), (last,), inner_shape)
    if not isinstance(inner, Axes):
        return inner if isinstance(inner, str) else "a stack of layers of this kind is not supported"
    lead = tuple(range(stacked))
    layout = Axes(lead + tuple(stacked + a for a in inner.out), tuple(stacked + a for a in inner.inp), tuple(shape))
    layers = int(np.prod(shape[:stacked], dtype=np.int64))
    return layout, tuple(str(j) for j in range(layers))


def _matrix(shape: tuple) -> int:
    return int(np.prod(shape, dtype=np.int64)) if sum(1 for d in shape if d > 1) >= 2 else 0


def _loose(view, path, leaf, i, mark, add, skip) -> None:
    """A leaf outside every recognised layer: excluded by definition, a position table, or skipped (method §3)."""
    shape = tuple(int(d) for d in np.shape(leaf))
    reason = excluded_reason(path, shape)
    if reason is not None:
        mark(path, leaf, "excluded", reason)
        return
    if position_table(path, shape) is not None:
        # (..., positions..., features): the embedding of the positions, canonical (features, positions).
        nd = len(shape)
        add(path, path, i, "embedding", Axes((nd - 1,), tuple(range(nd - 1)), shape))
        return
    skip()


def check_layouts(view: ModelView, prog) -> None:
    """Check the layouts not given by a registry rule against the traced program (never misread a kernel).

    A leaf read as a convolution kernel (``"flax"`` / ``"canonical"`` with 3 or more
    axes) must enter the program through a convolution. A 3+-axis ``kernel`` leaf of an
    ``(apply_fn, params)`` model that a ``dot_general`` contracts instead is a
    multi-axis kernel (``DenseGeneral``, attention): its input axes are the contracted
    ones and it is read as such (method §3). A declared :class:`Axes` layout must name
    the axes the ``dot_general`` contracts as its input axes.

    Raises:
        ValueError: For a declared layout that contradicts the program.
    """
    for k, w in enumerate(view.weights):
        if w.inferred is None:
            continue
        shape = tuple(np.shape(view.leaves[w.leaf]))
        uses = prog.uses[k] if k < len(prog.uses) else []
        dots = [(op, pos) for op, pos, chain in uses if op.prim.name == "dot_general" and not chain]
        convs = [op for op, _, _ in uses if op.prim.name == "conv_general_dilated"]
        if isinstance(w.layout, Axes):
            for op, pos in dots:
                (lc, rc), (lb, rb) = op.params["dimension_numbers"]
                contracted = set(lc if pos == 0 else rc)
                batch = lb if pos == 0 else rb
                if batch or contracted != set(w.layout.inp):
                    raise ValueError(
                        f"layouts[{w.path!r}] declares input axes {list(w.layout.inp)} of the kernel {shape}, but "
                        f"the model contracts its axes {sorted(contracted)}"
                        f"{' with batch axes ' + str(list(batch)) if batch else ''}; declare the contracted "
                        "axes as 'in' and the others as 'out' (batch axes cannot be a weight matrix).")
            continue
        if len(shape) < 3 or convs:
            continue
        if w.inferred == "convention" and len(dots) == 1 and len(uses) == 1:
            op, pos = dots[0]
            (lc, rc), (lb, rb) = op.params["dimension_numbers"]
            if not (lb if pos == 0 else rb):
                inp = tuple(sorted(lc if pos == 0 else rc))
                w.layout = Axes(tuple(i for i in range(len(shape)) if i not in inp), inp, shape)
                w.kind = "dense"
                continue
        what = "layouts=" if w.inferred == "layouts" else "the (apply_fn, params) convention for leaves named 'kernel'"
        raise ValueError(
            f"{w.path} {shape}: {what} reads it as a convolution kernel, but the model does not convolve it (it "
            f"enters {sorted({op.prim.name for op, _, _ in uses}) or 'no'} operation). A multi-axis kernel needs its "
            "axes declared: layouts={path: 'in,out,out'} (the role of every axis, 'in' for the contracted ones) "
            "or {'out': axes, 'in': axes}; or layouts={path: None} to exclude it.")


def check_has_weights(view: ModelView) -> None:
    """Raise if the registry found no weight to analyze (after the skipped layers were reported)."""
    if not view.weights:
        raise ValueError(
            f"The {view.framework} model has no weight tensor of a recognised dense or convolution layer, so "
            "there is nothing to analyze. Declare weight layouts with layouts={path: ...}, or register the "
            "module class with normflat.backends.jax.register_layer."
        )


# ----------------------------------------------------------------------------- equinox


_VMAP_CACHE = LRU(32)


def _equinox(model, x0, dtype, vmap, state, invoke):
    import equinox as eqx

    model = eqx.nn.inference_mode(model)  # a new pytree: BatchNorm running stats, Dropout off
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    dtype = dtype or pick_dtype([a for _, a in flat])
    leaves = [_as(a, dtype) for _, a in flat]
    st_leaves, st_def = jax.tree_util.tree_flatten(_cast(state, dtype)) if state is not None else ([], None)
    owners = {path: _equinox_owner(model, p) for (p, _), path in zip(flat, paths)}
    parents = {path: (_walk(model, p[:-2]), path_str(p[-2:-1])) for (p, _), path in zip(flat, paths) if len(p) >= 2}

    def call(leaves, extra, x):
        m = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
        st = jax.tree_util.tree_unflatten(st_def, extra) if st_def is not None else None
        if st is None:
            return invoke(m, x)

        def stateful(*args, **kw):
            out = m(*args, st, **kw) if args else m(**kw, state=st)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("With state=..., the equinox model must return (logits, state).")
            return out[0]
        return invoke(stateful, x)

    refs: list = []
    static_leaves, static_def = jax.tree_util.tree_flatten(static)
    struct = _struct("equinox", treedef, static_def, static_leaves, st_def, _avals(leaves), _avals(st_leaves),
                     refs=refs)
    if vmap is None:
        dkey = None if struct is None else (struct, _avals(jax.tree_util.tree_leaves(x0)))
        vmap = _VMAP_CACHE.get(dkey) if dkey is not None else None
        if vmap is None:
            vmap = _detect_vmap(lambda l, x: call(l, st_leaves, x), leaves, x0)
            if dkey is not None:
                _VMAP_CACHE.put(dkey, vmap)
    if vmap:
        def apply_batch(leaves, extra, x):
            return jax.vmap(call, in_axes=(None, None, 0))(leaves, extra, x)
        apply_example = call
    else:
        apply_batch = call

        def apply_example(leaves, extra, x):
            return call(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]
    view = ModelView("equinox", leaves, paths, [], st_leaves, apply_batch, apply_example, vmap, dtype=dtype)
    view.struct = None if struct is None else struct + (vmap,)
    view.struct_refs = refs + [static]
    return view, owners, parents


def _equinox_owner(model: Any, keys: tuple) -> Any:
    """The module an equinox leaf belongs to: the object holding it, except for the running statistics
    of a stateful layer (BatchNorm's mean and variance), which belong to that layer where its
    ``eqx.nn.StateIndex`` holds their initial values, or to the ``eqx.nn.State`` holding them (both
    registered as ignored: excluded with the normalization layers' reason)."""
    import equinox as eqx

    for depth in range(len(keys) - 1, 0, -1):
        node = _walk(model, keys[:depth])
        if isinstance(node, eqx.nn.StateIndex):
            return _walk(model, keys[:depth - 1])
        if isinstance(node, eqx.nn.State):
            return node
    return _walk(model, keys[:-1])


def _call_signature_error(err: Exception) -> bool:
    """Whether ``err`` is Python's error for a call with missing or unexpected arguments (a model that
    needs ``state=``), which the options fix, rather than the model's error on its inputs."""
    return isinstance(err, TypeError) and ("positional argument" in str(err) or "keyword argument" in str(err))


def _detect_vmap(call, leaves, x0) -> bool:
    """Per-example model (equinox's own layers) if it maps one example to a 1-D logit vector."""
    n = jax.tree_util.tree_leaves(x0)[0].shape[0]
    errors = []
    one = None
    batch_error: Exception | None = None
    try:
        out = jax.eval_shape(call, leaves, jax.tree_util.tree_map(lambda a: a[0], x0))
        one = getattr(out, "ndim", None)
        if one == 1:
            return True
        errors.append(f"called on one example it returned shape {getattr(out, 'shape', type(out))}")
    except Exception as err:  # noqa: BLE001 - any failure means "not per example"
        errors.append(f"called on one example it raised {type(err).__name__}: {str(err)[:200].rstrip('.')}")
    try:
        out = jax.eval_shape(call, leaves, x0)
        if getattr(out, "ndim", None) in (2, 3) and out.shape[0] == n:
            return False
        errors.append(f"called on a batch it returned shape {getattr(out, 'shape', type(out))}")
    except Exception as err:  # noqa: BLE001
        errors.append(f"called on a batch it raised {type(err).__name__}: {str(err)[:200].rstrip('.')}")
        batch_error = err
    if one == 2:
        return True  # token logits (tokens, classes) of one example
    if batch_error is not None and one is None and not _call_signature_error(batch_error):
        raise batch_error  # it runs neither way: the inputs do not fit it (session.view_for's error)
    raise ValueError(
        "Cannot tell whether the equinox model takes one example (logits of shape (classes,) or token logits "
        "(tokens, classes)) or a batch (logits of shape (batch, classes) or (batch, tokens, classes)): "
        f"{'; '.join(errors)}. Pass vmap=True (per example) or "
        "vmap=False (batch); models with BatchNorm need state=... (they return (logits, state))."
    )


# ----------------------------------------------------------------------------- flax nnx


_NNX_EVAL = LRU(32)


def _nnx(model, dtype, invoke):
    from flax import nnx

    user_gdef, params, rest = nnx.split(model, nnx.Param, ...)  # reads only: the user's module is unchanged
    leaves, treedef = jax.tree_util.tree_flatten(params)
    dtype = dtype or pick_dtype(leaves)
    key = (user_gdef, str(dtype))
    cached = _NNX_EVAL.get(key)
    if cached is None:
        # A private copy switched to evaluation mode (BatchNorm running averages, no dropout);
        # the mode lives in the graph definition, so it is cached per user graph definition.
        clone = nnx.merge(user_gdef, params, rest)
        clone.eval()
        _promote_compute_dtypes(nnx, clone, dtype)
        gdef, params_e, _ = nnx.split(clone, nnx.Param, ...)
        flat = jax.tree_util.tree_flatten_with_path(params_e)[0]
        clean = [p[:-1] if p and getattr(p[-1], "name", None) == "value" else p for p, _ in flat]
        paths = [path_str(p) for p in clean]
        owner_list = [_walk(clone, p[:-1]) for p in clean]
        parent_list = [(_walk(clone, p[:-2]), path_str(p[-2:-1])) if len(p) >= 2 else None for p in clean]
        cached = (gdef, paths, owner_list, parent_list)
        _NNX_EVAL.put(key, cached)
    gdef, paths, owner_list, parent_list = cached
    # Every floating module attribute in the compute dtype: nnx layers with param_dtype
    # float16 but dtype=None compute in the promoted dtype of inputs and parameters, and a
    # float16 statistic or constant left in the graph would meet float32 values in lax.add.
    leaves = [_as(a, dtype) for a in leaves]
    rest_leaves, rest_def = jax.tree_util.tree_flatten(_cast(rest, dtype))

    def apply_batch(leaves, extra, x):
        return invoke(nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, leaves),
                                jax.tree_util.tree_unflatten(rest_def, extra)), x)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("flax.nnx", leaves, paths, [], rest_leaves, apply_batch, apply_example)
    view.user_states = (params, rest)  # type: ignore[attr-defined]  (for state.ModelState)
    view.struct = _struct("nnx", gdef, treedef, rest_def, _avals(leaves), _avals(rest_leaves), refs=view.struct_refs)
    view.dtype = dtype
    return view, dict(zip(paths, owner_list)), {p: q for p, q in zip(paths, parent_list) if q is not None}


def _promote_compute_dtypes(nnx, clone, dtype) -> None:
    """Raise half-precision ``dtype=`` attributes of the private copy's layers to ``dtype``.

    An nnx layer with ``dtype=jnp.float16`` casts its inputs and parameters to
    float16 in the forward pass; Hessians in half precision are meaningless (and the
    traced program would mix float16 activations with float32 signals), so the copy
    computes in the analysis dtype. The user's module is not touched.
    """
    target = jnp.dtype(dtype)
    modules = [node for _, node in nnx.iter_graph(clone) if isinstance(node, nnx.Module)]
    for m in modules:
        dt = getattr(m, "dtype", None)
        try:
            low = dt is not None and jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < target.itemsize
        except TypeError:
            low = False
        if low:
            object.__setattr__(m, "dtype", target)


# ----------------------------------------------------------------------------- Keras 3 on JAX


def _keras(model, dtype, invoke, strip_softmax=True):
    """A Keras 3 model on Keras' JAX backend, as a pure function of its variables' values.

    The model is called as the TensorFlow backend calls it, ``model(x, training=False)``, inside
    Keras' public ``keras.StatelessScope``, which maps every variable to a given value: it runs on
    those values without touching its variables (inference mode: no dropout, BatchNormalization on
    its moving statistics) and traces to a jaxpr like any JAX function, so the same program analysis
    and kernels apply. (``model.stateless_call`` would call ``model.call`` directly, passing
    ``training`` to a ``call`` that does not take it.) The leaves are the floating variables'
    values, trainable or not, listed by ``variable.path``; the layers are named as the TensorFlow backend names them
    (:func:`_keras_layers`). Integer state (seed generators) rides along unchanged. As on the
    TensorFlow backend, each call makes the model compute logits
    (:func:`normflat.backends.keras_shared.logits_only`: the final softmax made the identity, unless
    ``strip_softmax`` is false; a mixed precision policy computing in its variables' dtype), as
    instance attributes set for the call under the model's lock and restored after it: the
    variables are only read.
    """
    from normflat.backends.keras_shared import ModelState, final_softmax, logits_only

    if not model.built:
        raise ValueError(
            f"The Keras model {model.name!r} is not built (it has no weights yet). Call it on a batch "
            "(model(x)) or call model.build(input_shape) before analyzing it.")
    trainable, frozen = list(model.trainable_variables), list(model.non_trainable_variables)
    # Every floating variable is a leaf, trainable or not (a frozen layer's kernel is analyzed, as a
    # torch weight without requires_grad is; BatchNormalization's moving statistics are excluded by
    # their layer's rule); the others (seed generators' states) ride along.
    floating = [v for v in trainable + frozen if _is_floating(v.value)]
    rest = [v for v in trainable + frozen if not _is_floating(v.value)]
    dtype = dtype or pick_dtype([v.value for v in floating])
    leaves = [_as(v.value, dtype) for v in floating]
    extra = [v.value for v in rest]
    paths = [v.path for v in floating]
    slot = {id(v): ("leaf", i) for i, v in enumerate(floating)}
    slot.update({id(v): ("extra", i) for i, v in enumerate(rest)})
    order_t, order_n = [slot[id(v)] for v in trainable], [slot[id(v)] for v in frozen]
    owners: dict[str, Any] = {}
    names: dict[str, str] = {}
    layers = _keras_layers(model)
    for layer, name in layers:
        # Its own variables, not its sub-layers' (SpectralNormalization also tracks its layer's kernel as
        # its own `kernel`), as the TensorFlow backend reads them.
        inner = {id(v) for child in getattr(layer, "_layers", []) for v in getattr(child, "weights", [])}
        own = [v for v in (*getattr(layer, "_trainable_variables", []), *getattr(layer, "_non_trainable_variables", []))
               if id(v) not in inner]
        for v in own:
            if v.path not in owners:
                owners[v.path], suffix = _keras_owner(layer, v)
                names[v.path] = name + suffix
    for layer, _ in layers:
        if REGISTRY.lookup(layer) is IGNORE:
            # Every variable inside an ignored layer is held fixed with it, as the TensorFlow backend
            # holds them.
            for v in layer.weights:
                owners[v.path] = layer

    variables = trainable + frozen
    order = order_t + order_n
    stateless = sys.modules["keras"].StatelessScope
    state = ModelState(model)  # the detection reads instance attributes another analysis may set
    try:
        strip = final_softmax(model) if strip_softmax else None
    finally:
        state.restore()

    def call(leaves, extra, x):
        pick = {"leaf": leaves, "extra": extra}
        state = ModelState(model)
        try:
            logits_only(state, strip)
            # The model's own __call__ (as the TensorFlow backend calls it: `training` passed only to
            # a call that takes it, inputs converted and cast as Keras does), reading the given values.
            with stateless(state_mapping=[(v, pick[kind][i]) for v, (kind, i) in zip(variables, order)]):
                return model(x, training=False)
        finally:
            state.restore()

    def apply_batch(leaves, extra, x):
        return invoke(call, x, list(leaves), list(extra))

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("keras", leaves, paths, [], extra, apply_batch, apply_example, dtype=dtype)
    view.struct = _struct("keras", ("id", id(model)), strip is not None, _avals(leaves), _avals(extra),
                          refs=view.struct_refs)
    view.stripped_softmax = None if strip is None else strip[0].name  # type: ignore[attr-defined]
    view.struct_refs.append(model)
    view.layer_names = names  # type: ignore[attr-defined]  (_select_weights: the path's layer otherwise)
    return view, {p: owners.get(p) for p in paths}, {}


def _keras_layers(model: Any) -> list[tuple[Any, str]]:
    """Every layer of a Keras model with the name the TensorFlow backend reports it under: its name,
    prefixed by those of the layers holding it (``bert_backbone/token_embedding``), from the direct
    children down (``Layer._layers``, private: Keras has no public list of a layer's direct children)."""
    found: list[tuple[Any, str]] = []
    seen: set[int] = set()

    def visit(layer: Any, prefix: str) -> None:
        for child in getattr(layer, "_layers", []):
            if id(child) in seen or not hasattr(child, "_layers"):
                continue
            seen.add(id(child))
            found.append((child, prefix + child.name))
            visit(child, prefix + child.name + "/")

    visit(model, "")
    return [*found, (model, model.name)]


class _KerasPart:
    """What the registry sees as the owner of some of a Keras layer's variables, in place of the layer
    (:func:`_keras_owner`): a refusal, or one of several weights the layer holds."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer


class _KerasRefused(_KerasPart):
    """The owner of a Keras layer's variables that this backend refuses."""


class _Quantized(_KerasRefused):
    pass


class _LoraRefused(_KerasRefused):
    pass


class _LoraFactor:
    """One factor of a LoRA-enabled Keras layer (``enable_lora``: the kernel ``W + (α/r)·A·B``), the
    owner of its variable for the registry (method §3, "LoRA adapters"): ``A`` has the kernel's axes but
    the last, then the rank; ``B`` the rank, then the kernel's last axis.

    Attributes:
        leaf: The factor variable's name.
        b_into_rank: For ``B``, whether the kernel's last axis is an input (``B`` maps it to the rank:
            canonical ``(r, in)`` as stored; else ``(out, r)``).
        rank_equation: For an ``EinsumDense``'s ``A``, the equation with the rank as the last axis.
    """

    def __init__(self, layer: Any, leaf: str, b_into_rank: bool = False, rank_equation: str | None = None) -> None:
        self.layer, self.leaf, self.b_into_rank, self.rank_equation = layer, leaf, b_into_rank, rank_equation


class _LoraDense(_LoraFactor):
    """``A`` of a ``Dense`` ``(in, r)``, or any ``B``: a dense matrix."""


class _LoraEmbedding(_LoraFactor):
    """``A`` of an ``Embedding`` ``(vocabulary, r)``: a lookup of ``r`` features."""


class _LoraConv(_LoraFactor):
    """``A`` of a convolution ``(*k, in, r)``: a convolution with ``r`` output channels."""


class _LoraEinsum(_LoraFactor):
    """``A`` of an ``EinsumDense``: read by its rank equation."""


def _lora_supported(layer: Any) -> bool:
    """Whether normflat reads the LoRA factors of ``layer``'s kind (as the TensorFlow backend does)."""
    L = sys.modules["keras"].layers
    if isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
        return int(getattr(layer, "groups", 1) or 1) == 1
    return isinstance(layer, (L.Dense, L.EinsumDense, L.Embedding))


def _lora(layer: Any, variable: Any) -> tuple[Any, str] | None:
    """``(owner, name suffix)`` of a LoRA factor of a :func:`_lora_supported` ``layer`` (``None``:
    ``variable`` is none; the frozen kernel and the bias take the layer's own rule), named ``/lora_a``
    and ``/lora_b`` as on TensorFlow."""
    from normflat.backends.keras_shared import rank_equation

    L = sys.modules["keras"].layers
    embedding = isinstance(layer, L.Embedding)
    a = getattr(layer, "lora_embeddings_a" if embedding else "lora_kernel_a", None)
    b = getattr(layer, "lora_embeddings_b" if embedding else "lora_kernel_b", None)
    if variable is not a and variable is not b:
        return None
    leaf = variable.path.rpartition("/")[2]
    equation, last_is_input = rank_equation(layer.equation) if isinstance(layer, L.EinsumDense) else (None, False)
    if variable is b:
        return _LoraDense(layer, leaf, b_into_rank=last_is_input), "/lora_b"
    if equation is not None:
        return _LoraEinsum(layer, leaf, rank_equation=equation), "/lora_a"
    kind = _LoraEmbedding if embedding else _LoraDense if isinstance(layer, L.Dense) else _LoraConv
    return kind(layer, leaf), "/lora_a"


class _ReverseProjection(_KerasPart):
    """The ``reverse_embeddings`` of an untied ``ReversibleEmbedding``, the owner of its variable for
    the registry (the layer itself owns the table)."""


class _SeparablePart(_KerasPart):
    """One of the two kernels of a Keras ``SeparableConv1D/2D`` (a depthwise, then a pointwise
    convolution), the owner of its variables for the registry."""


class _SeparableDepthwise(_SeparablePart):
    pass


class _SeparablePointwise(_SeparablePart):
    pass


class _ExpertsKernel:
    """One stacked kernel ``(experts, in, out)`` of a keras-hub experts layer
    (:data:`~normflat.backends.keras_shared.HUB_EXPERTS`), the owner of its variable for the registry."""

    def __init__(self, layer: Any, attribute: str, maps: str, leaf: str) -> None:
        self.layer, self.attribute, self.maps, self.leaf = layer, attribute, maps, leaf


def _hub_experts(layer: Any, variable: Any) -> tuple[Any, str] | None:
    """``(owner, name suffix)`` of a keras-hub experts layer's variable (``None``: not such a layer);
    its biases and scales get an owner with no weight leaf (held fixed)."""
    from normflat.backends.keras_shared import HUB_EXPERTS

    for (module_name, cls_name), kernels in HUB_EXPERTS.items():
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        if isinstance(cls, type) and isinstance(layer, cls):
            for attribute, maps in kernels:
                if getattr(layer, attribute, None) is variable:
                    leaf = variable.path.rpartition("/")[2]
                    suffix = "/gate_up" if maps.startswith("gate_up") else f"/{maps}"
                    return _ExpertsKernel(layer, attribute, maps, leaf), suffix
            return _ExpertsKernel(layer, "", "", ""), ""
    return None


class _HubOwn:
    """A weight a keras-hub layer multiplies by in its own call
    (:data:`~normflat.backends.keras_shared.HUB_OWN_WEIGHTS`), the owner of its variable for the registry."""

    def __init__(self, layer: Any, leaf: str, channels: int = 0, excluded_because: str | None = None) -> None:
        self.layer, self.leaf, self.channels, self.excluded_because = layer, leaf, channels, excluded_because


class _HubOwnDense(_HubOwn):
    """A matrix ``(in, out)``: canonical ``(out, in)``."""


class _HubOwnDepthwise(_HubOwn):
    """A depthwise 1-D kernel ``(channels, kernel)``: canonical ``(channels, 1, kernel)``, one group per channel."""


class _HubOwnExcluded(_HubOwn):
    """A weight in a matrix's shape that is no weight matrix: held fixed, with the reason."""


def _hub_own(layer: Any, variable: Any) -> tuple[Any, str] | None:
    """``(owner, name suffix)`` of a variable a keras-hub layer multiplies by itself (``None``: not one),
    named ``<layer>/<variable>`` as on the TensorFlow backend."""
    from normflat.backends.keras_shared import HUB_OWN_WEIGHTS, holding_attribute

    for (module_name, cls_name), weights in HUB_OWN_WEIGHTS.items():
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        if not (isinstance(cls, type) and isinstance(layer, cls)):
            continue
        attribute = holding_attribute(layer, variable)
        role = weights.get(attribute) if attribute is not None else None
        leaf = variable.path.rpartition("/")[2]
        if role == "dense":
            return _HubOwnDense(layer, leaf), f"/{variable.name}"
        if role == "depthwise":
            return _HubOwnDepthwise(layer, leaf, channels=int(variable.shape[0])), f"/{variable.name}"
        if role is not None:
            return _HubOwnExcluded(layer, leaf, excluded_because=role), ""
    return None


def _keras_owner(layer: Any, variable: Any) -> tuple[Any, str]:
    """The registry's view of the Keras layer holding ``variable``, and the suffix of the layer name it
    is reported under: the layer; a refusal (a quantized layer; LoRA on a grouped convolution or a kind
    without LoRA factors); a LoRA factor (``/lora_a``, ``/lora_b``); the reverse projection of an untied
    ``ReversibleEmbedding`` (``/reverse``); or one part of a ``SeparableConv`` (``/depthwise``,
    ``/pointwise``, as the TensorFlow backend names them); one kernel of a keras-hub experts layer
    (``/gate``, ``/up``, ``/gate_up``, ``/down``); a weight a keras-hub layer multiplies by in its own
    call (``/<variable>``); a relative-position bias table held by its layer (keras-hub's T5), excluded."""
    from normflat.backends.keras_shared import holding_attribute

    if getattr(layer, "quantization_mode", None):
        return _Quantized(layer), ""
    if getattr(layer, "lora_enabled", False):
        if not _lora_supported(layer):
            return _LoraRefused(layer), ""
        lora = _lora(layer, variable)
        if lora is not None:
            return lora
    if variable is getattr(layer, "reverse_embeddings", None) and not getattr(layer, "tie_weights", True):
        return _ReverseProjection(layer), "/reverse"
    experts = _hub_experts(layer, variable) or _hub_own(layer, variable)
    if experts is not None:
        return experts
    # keras-hub's T5 holds its relative-position bias table as `relative_attention_bias`: added to the
    # scores, no weight matrix (method §3), as on the TensorFlow backend.
    relative = relative_bias_table(holding_attribute(layer, variable) or "")
    if relative is not None:
        return _HubOwnExcluded(layer, variable.path.rpartition("/")[2], excluded_because=relative), ""
    L = sys.modules["keras"].layers
    if isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
        if variable is getattr(layer, "depthwise_kernel", None):
            return _SeparableDepthwise(layer), "/depthwise"
        return _SeparablePointwise(layer), "/pointwise"
    return layer, ""


# ----------------------------------------------------------------------------- flax linen


_LINEN_OWNERS = LRU(32)


def _linen(module, variables, x0, dtype, apply_kwargs, invoke):
    import flax.linen as nn

    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError(
            "A flax linen model is passed as (module, variables) with variables = module.init(...), a "
            f"mapping with a 'params' collection; got {type(variables).__name__}."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(variables["params"])
    dtype = dtype or pick_dtype([a for _, a in flat])
    module = _full_precision_linen(module, dtype)
    o_leaves, o_def = jax.tree_util.tree_flatten(_cast({k: v for k, v in variables.items() if k != "params"}, dtype))
    paths = [path_str(p) for p, _ in flat]
    leaves = [_as(a, dtype) for _, a in flat]

    def apply_batch(leaves, extra, x):
        others = jax.tree_util.tree_unflatten(o_def, extra)
        return invoke(module.apply, x, {**others, "params": jax.tree_util.tree_unflatten(treedef, leaves)},
                      **apply_kwargs)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    refs: list = []
    struct = _struct("linen", module, treedef, o_def, _avals(leaves), _avals(o_leaves),
                     tuple(sorted(apply_kwargs.items())), _avals(jax.tree_util.tree_leaves(x0)), refs=refs)
    view = ModelView("flax.linen", leaves, paths, [], o_leaves, apply_batch, apply_example, struct=struct,
                     struct_refs=refs, dtype=dtype)
    seen = _LINEN_OWNERS.get(struct) if struct is not None else None
    if seen is None:
        # The module behind each parameter path, recorded during one abstract call
        # (linen modules exist only while bound; intercept_methods is linen's public hook).
        seen = {}

        def interceptor(f, args, kwargs, context):
            seen.setdefault(tuple(context.module.path), context.module)
            return f(*args, **kwargs)

        with nn.intercept_methods(interceptor):
            _check_linen_call(lambda: jax.eval_shape(apply_batch, leaves, o_leaves, x0))
        if struct is not None:
            _LINEN_OWNERS.put(struct, seen)
    owners = {path: seen.get(tuple(path_str([k]) for k in p[:-1])) for (p, _), path in zip(flat, paths)}
    return view, owners, {}


def _full_precision_linen(module: Any, dtype: Any) -> Any:
    """``module``, or a copy computing in ``dtype`` when its own ``dtype`` field is a narrower float.

    flax's convention is a ``dtype`` field for the compute dtype (``param_dtype`` for the parameters),
    which a model passes down to its layers (``nn.Dense(..., dtype=self.dtype)``): a model built for
    mixed precision (``dtype=jnp.bfloat16`` over float32 parameters) rounds its function to bfloat16.
    The analysis measures the function itself, as the PyTorch backend does under ``torch.autocast``
    and the Keras backend under a mixed policy, and as the nnx view does for its layers
    (:func:`_promote_compute_dtypes`). linen modules are immutable descriptions: ``clone`` makes the
    copy, the user's module is untouched. A layer with a half-precision ``dtype`` of its own, not passed
    down, still computes in it and is refused by the trace (``half_precision_ops``).
    """
    if not dataclasses.is_dataclass(module) or "dtype" not in {f.name for f in dataclasses.fields(module)}:
        return module
    own = getattr(module, "dtype", None)
    try:
        narrower = (own is not None and jnp.issubdtype(own, jnp.floating)
                    and jnp.dtype(own).itemsize < jnp.dtype(dtype).itemsize)
    except TypeError:
        return module
    return module.clone(dtype=jnp.dtype(dtype)) if narrower else module


def _check_linen_call(fn):
    try:
        return fn()
    except Exception as err:
        if is_frozen_collection_error(err):
            raise ValueError(
                "The linen model tried to update a variable collection (e.g. BatchNorm batch_stats in "
                "training mode). normflat analyzes the model in inference mode: pass the call arguments "
                "that select it, e.g. apply_kwargs={'train': False}."
            ) from err
        raise


# ----------------------------------------------------------------------------- (apply_fn, params)


def _pair(apply_fn, params, dtype, apply_kwargs, invoke):
    if not callable(apply_fn) or not isinstance(params, Mapping):
        raise TypeError("A plain JAX model is passed as (apply_fn, params) with a mapping of parameters.")
    # Flax-style variables {'params': ..., 'batch_stats': ...}: only 'params' holds weights.
    collections = "params" in params and isinstance(params["params"], Mapping)
    tree = params["params"] if collections else params
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    dtype = dtype or pick_dtype([a for _, a in flat])
    owner = getattr(apply_fn, "__self__", None)
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(owner, linen.Module) and getattr(apply_fn, "__name__", "") == "apply":
        apply_fn = _full_precision_linen(owner, dtype).apply  # module.apply passed as apply_fn
    o_leaves, o_def = jax.tree_util.tree_flatten(
        _cast({k: v for k, v in params.items() if k != "params"}, dtype) if collections else {})
    paths = [path_str(p) for p, _ in flat]
    leaves = [_as(a, dtype) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a for _, a in flat]

    def apply_batch(leaves, extra, x):
        t = jax.tree_util.tree_unflatten(treedef, leaves)
        others = jax.tree_util.tree_unflatten(o_def, extra)
        return invoke(apply_fn, x, {**others, "params": t} if collections else t, **apply_kwargs)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("jax", leaves, paths, [], o_leaves, apply_batch, apply_example, dtype=dtype)
    view.struct = _struct("pair", apply_fn, treedef, o_def, _avals(leaves), _avals(o_leaves),
                          tuple(sorted(apply_kwargs.items())), refs=view.struct_refs)
    return view, {}, {}  # no module objects: the leaf-name convention applies
