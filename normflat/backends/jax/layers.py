"""The JAX layer registry and the model views of equinox, flax nnx, flax linen and ``(apply_fn, params)``.

**Registry.** One :class:`~normflat.engine.registry.LayerRegistry` ``{module class:
entry}`` with MRO lookup, as in every backend: an entry is a :class:`LayerRule`
(which leaf of the module is its weight, in which layout, with how many groups),
:data:`~normflat.engine.registry.IGNORE` (normalization layers: their scales are
held fixed, method §9) or :class:`~normflat.engine.registry.Unsupported` (a known
type normflat refuses, with the reason). Keys are equinox, flax nnx or flax linen
module classes. A floating leaf with at least 2 dimensions that no rule claims is
reported through :class:`~normflat.engine.registry.Skipped` (``on_unsupported``);
``layouts={leaf path: layout}`` declares or overrides single leaves.

**Views.** Every model kind becomes a :class:`ModelView`: its floating-point
leaves (cast to the compute dtype), the weight leaves found by the registry, and
pure functions ``(leaves, x) -> logits`` for a batch and for one example. The
user's objects are only read: equinox and linen models are immutable, and an nnx
module is split into a private copy switched to evaluation mode.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax.cache import LRU
from normflat.backends.jax.compat import is_frozen_collection_error
from normflat.engine.registry import IGNORE, LayerRegistry, Skipped, Unsupported

__all__ = ["LayerRule", "REGISTRY", "register_layer", "registered_layers", "ModelView", "WeightInfo",
           "make_view", "LAYOUT_ALIASES", "path_str", "pick_dtype"]

#: Accepted names of weight layouts in ``layouts=``: canonical (torch/equinox) or flax/Keras.
LAYOUT_ALIASES = {
    "out,in,*k": "canonical", "out,in": "canonical", "(out, in, *k)": "canonical", "torch": "canonical",
    "canonical": "canonical",
    "*k,in,out": "flax", "in,out": "flax", "(*k, in, out)": "flax", "flax": "flax",
}


@dataclass(frozen=True)
class LayerRule:
    """How normflat reads the weight of one module class.

    Attributes:
        leaf: Name of the module's weight leaf (``"weight"`` in equinox, ``"kernel"``
            in flax); the module's other leaves (biases) are held fixed.
        layout: ``"canonical"`` (``(out, in/groups, *k)``, torch/equinox order) or
            ``"flax"`` (``(*k, in/groups, out)``).
        groups: Attribute of the module holding its number of groups (grouped
            convolutions), a function ``module -> int``, or ``None`` (1).
        kind: Short type label; ``None``: ``"dense"`` for 2-D weights, ``"conv{N}d"``
            otherwise.
    """

    leaf: str = "kernel"
    layout: str = "flax"
    groups: str | Callable[[Any], int] | None = None
    kind: str | None = None

    def groups_of(self, module: Any) -> int:
        """The number of groups of ``module`` (1 when the rule has none)."""
        if self.groups is None or module is None:
            return 1
        g = self.groups(module) if callable(self.groups) else getattr(module, self.groups, 1)
        return int(g or 1)

    def kind_of(self, ndim: int) -> str:
        """The layer kind for a weight with ``ndim`` dimensions."""
        return self.kind or _conv_kind(ndim)


def _check_entry(entry: Any) -> None:
    if entry is IGNORE or isinstance(entry, Unsupported):
        return
    if not isinstance(entry, LayerRule):
        raise TypeError(f"A JAX layer entry is a LayerRule, IGNORE or Unsupported(reason), got {entry!r}.")
    if entry.layout not in ("canonical", "flax"):
        raise ValueError(f"LayerRule.layout must be 'canonical' or 'flax', got {entry.layout!r}.")


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
    return tuple(bases)


def register_layer(module_type: type, entry: LayerRule | Unsupported | Any = None, *,
                   unsupported: str | None = None, **rule: Any) -> None:
    """Register (or replace) how normflat reads a JAX module class, in one call.

    Examples::

        register_layer(MyDense, LayerRule(leaf="w", layout="canonical"))  # w: (out, in)
        register_layer(MyConv, leaf="kernel", layout="flax", groups="feature_group_count")
        register_layer(MyNorm, IGNORE)                                   # scales held fixed
        register_layer(MyAttention, unsupported="attention is not a weight matrix layer")

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


_TRANSPOSED = ("transposed convolutions are not supported yet (their kernel maps out to in); declare a "
               "leaf with layouts= if you know its canonical order")
_EMBED = ("embeddings are lookup tables, not weight matrices fed by activations; their curvature is not "
          "covered by the per-layer problem")
_GENERAL = "its kernel has several input or output axes; declare its layout with layouts= if it is a matrix"


def _load_builtins() -> None:
    """Register the built-in types of every JAX library imported so far (once per library)."""
    eqx = sys.modules.get("equinox")
    if eqx is not None and "equinox" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("equinox")
        nn = eqx.nn
        REGISTRY.register(nn.Linear, LayerRule(leaf="weight", layout="canonical", kind="dense"))
        REGISTRY.register(nn.Conv, LayerRule(leaf="weight", layout="canonical", groups="groups"))
        REGISTRY.register(nn.ConvTranspose, Unsupported(_TRANSPOSED))
        REGISTRY.register(nn.Embedding, Unsupported(_EMBED))
        _ignore_norms(nn)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and "flax.nnx" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("flax.nnx")
        _register_flax(nnx, nnx.Linear, nnx.Embed, ("LinearGeneral", "Einsum"))
    linen = sys.modules.get("flax.linen")
    if linen is not None and "flax.linen" not in _BUILTINS_LOADED:
        _BUILTINS_LOADED.add("flax.linen")
        _register_flax(linen, linen.Dense, linen.Embed, ("DenseGeneral", "Einsum"))


def _register_flax(api: Any, dense: type, embed: type, general: tuple[str, ...]) -> None:
    """The built-in entries of one flax API (nnx or linen): the same rules, other class names."""
    REGISTRY.register(dense, LayerRule(kind="dense"))
    REGISTRY.register(api.Conv, LayerRule(groups="feature_group_count"))
    REGISTRY.register(api.ConvTranspose, Unsupported(_TRANSPOSED))
    REGISTRY.register(embed, Unsupported(_EMBED))
    for name in general:
        if hasattr(api, name):
            REGISTRY.register(getattr(api, name), Unsupported(_GENERAL))
    _ignore_norms(api)


def _ignore_norms(api: Any) -> None:
    """Normalization layers: their scales and shifts never enter the measures (method §9)."""
    for name in ("LayerNorm", "BatchNorm", "GroupNorm", "RMSNorm"):
        if hasattr(api, name):
            REGISTRY.register(getattr(api, name), IGNORE)


@dataclass
class WeightInfo:
    """A recognised weight tensor.

    Attributes:
        name: Layer name (the pytree path of the layer, e.g. ``layers/0``).
        path: Full path of the leaf (``layers/0/weight``).
        leaf: Index in :attr:`ModelView.leaves`.
        kind: ``"dense"``, ``"conv2d"``, ...
        layout: ``"canonical"`` (out, in/groups, *k) or ``"flax"`` (*k, in/groups, out).
        groups: Groups of a grouped convolution.
    """

    name: str
    path: str
    leaf: int
    kind: str
    layout: str
    groups: int = 1

    def to_canonical(self, a: Any, batch_dims: int = 0) -> Any:
        """Transpose an array in this weight's native layout (after ``batch_dims`` axes)."""
        if self.layout == "canonical":
            return a
        return _transpose(a, batch_dims, to_canonical=True)

    def to_native(self, a: Any, batch_dims: int = 0) -> Any:
        """The inverse of :meth:`to_canonical` (numpy or JAX arrays)."""
        if self.layout == "canonical":
            return a
        return _transpose(a, batch_dims, to_canonical=False)


def _transpose(a: Any, batch_dims: int, to_canonical: bool) -> Any:
    nd = a.ndim - batch_dims
    lead = tuple(range(batch_dims))
    # flax (*k, in, out) <-> canonical (out, in, *k): the two permutations are inverses.
    if to_canonical:
        perm = lead + (batch_dims + nd - 1, batch_dims + nd - 2) + tuple(batch_dims + i for i in range(nd - 2))
    else:
        perm = lead + tuple(batch_dims + 2 + i for i in range(nd - 2)) + (batch_dims + 1, batch_dims)
    return a.transpose(perm) if isinstance(a, np.ndarray) else _transposer(perm)(a)


@functools.lru_cache(maxsize=256)
def _transposer(perm: tuple) -> Callable[[Any], Any]:
    # A compiled transpose: one fast dispatch instead of JAX's eager path, which costs
    # more than the transpose itself for the few arrays of a report.
    return jax.jit(lambda a: jnp.transpose(a, perm))


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


def _cast(tree, dtype):
    def f(a):
        if isinstance(a, (jax.Array, np.ndarray)) and jnp.issubdtype(a.dtype, jnp.floating):
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
              layouts: dict) -> ModelView:
    """Build the :class:`ModelView` of any supported model (``x0``: the first input batch).

    The unsupported leaves are listed in :attr:`ModelView.unsupported`; the caller
    reports them according to ``on_unsupported``.
    """
    _load_builtins()
    eqx = sys.modules.get("equinox")
    nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    if eqx is not None and isinstance(model, eqx.Module):
        view, owners = _equinox(model, x0, dtype, vmap, state)
    else:
        if vmap is not None or state is not None:
            raise TypeError("vmap= and state= are options of equinox models only.")
        if nnx is not None and isinstance(model, nnx.Module):
            view, owners = _nnx(model, dtype)
        elif linen is not None and isinstance(model, tuple) and isinstance(model[0], linen.Module):
            view, owners = _linen(model[0], model[1], x0, dtype, apply_kwargs)
        else:
            view, owners = _pair(model[0], model[1], dtype, apply_kwargs)
    if apply_kwargs and view.framework in ("equinox", "flax.nnx"):
        raise TypeError("apply_kwargs= is an option of (flax linen module, variables) and (apply_fn, params) "
                        "models; call options of equinox / nnx modules belong in the module.")
    _select_weights(view, owners, layouts)
    return view


_PAIR_REASON = ("a parameter leaf of an (apply_fn, params) model not named 'kernel'; declare its layout with "
                "layouts={path: 'out,in,*k' or '*k,in,out'}")


def _select_weights(view: ModelView, owners: dict, layouts: dict) -> None:
    """Decide which leaves are weight tensors, from ``layouts=`` and the registry.

    Args:
        view: The model view (its ``weights`` list is filled).
        owners: ``{leaf path: owning module}`` (``None``: unknown owner, the
            ``(apply_fn, params)`` convention of leaves named ``kernel`` applies).
        layouts: The user's ``layouts=``.
    """
    unknown = set(layouts) - set(view.paths)
    if unknown:
        raise ValueError(
            f"layouts= names {sorted(unknown)}, which are not parameter leaves of this model. "
            f"Parameter leaves with at least 2 dimensions: "
            f"{[p for p, l in zip(view.paths, view.leaves) if np.ndim(l) >= 2]}."
        )
    skipped = Skipped(REGISTRY)
    for i, (path, leaf) in enumerate(zip(view.paths, view.leaves)):
        name, _, last = path.rpartition("/")
        name = name or last
        if path in layouts:
            lay = layouts[path]
            if lay is None or lay == "skip":
                continue
            if lay not in LAYOUT_ALIASES:
                raise ValueError(f"layouts[{path!r}] = {lay!r}; choose one of {sorted(LAYOUT_ALIASES)} or None.")
            if np.ndim(leaf) < 2:
                raise ValueError(f"layouts[{path!r}]: the leaf has shape {np.shape(leaf)}; a weight needs >= 2 dims.")
            owner = owners.get(path)
            rule = REGISTRY.lookup(owner) if owner is not None else None
            groups = rule.groups_of(owner) if isinstance(rule, LayerRule) else 1
            view.weights.append(WeightInfo(name, path, i, _conv_kind(np.ndim(leaf)), LAYOUT_ALIASES[lay], groups))
            continue
        if path not in owners:
            # (apply_fn, params): flax's convention, leaves named "kernel" are (*k, in, out) kernels.
            if last == "kernel" and 2 <= np.ndim(leaf) <= 5:
                view.weights.append(WeightInfo(name, path, i, _conv_kind(np.ndim(leaf)), "flax"))
            elif np.ndim(leaf) >= 2:
                skipped.add(f"{path} {tuple(np.shape(leaf))}", leaf, _PAIR_REASON)
            continue
        owner = owners[path]
        entry = REGISTRY.lookup(owner) if owner is not None else None
        if entry is IGNORE:
            continue  # normalization layers: their parameters are held fixed (method §9)
        if isinstance(entry, LayerRule):
            if last == entry.leaf and np.ndim(leaf) >= 2:
                view.weights.append(WeightInfo(name, path, i, entry.kind_of(np.ndim(leaf)), entry.layout,
                                               entry.groups_of(owner)))
            continue  # the rule's other leaves (biases) are held fixed
        if np.ndim(leaf) < 2:
            continue  # biases, scales of unknown modules: not weights (method §9)
        label = f"{path} {tuple(np.shape(leaf))}"
        if isinstance(entry, Unsupported):
            skipped.add(label, owner, entry.reason)
        else:
            skipped.add(label, owner if owner is not None else leaf)
    view.unsupported = skipped.messages()
    view.skipped = skipped  # type: ignore[attr-defined]


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


def _equinox(model, x0, dtype, vmap, state):
    import equinox as eqx

    model = eqx.nn.inference_mode(model)  # a new pytree: BatchNorm running stats, Dropout off
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    dtype = dtype or pick_dtype([a for _, a in flat])
    leaves = [_as(a, dtype) for _, a in flat]
    st_leaves, st_def = jax.tree_util.tree_flatten(_cast(state, dtype)) if state is not None else ([], None)
    owners = {path: _walk(model, p[:-1]) for (p, _), path in zip(flat, paths)}

    def call(leaves, extra, x):
        m = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
        st = jax.tree_util.tree_unflatten(st_def, extra) if st_def is not None else None
        out = m(x, st) if st is not None else m(x)
        if st is not None:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("With state=..., the equinox model must return (logits, state).")
            out = out[0]
        return out

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
    return view, owners


def _detect_vmap(call, leaves, x0) -> bool:
    """Per-example model (equinox's own layers) if it maps one example to a 1-D logit vector."""
    n = jax.tree_util.tree_leaves(x0)[0].shape[0]
    errors = []
    try:
        out = jax.eval_shape(call, leaves, jax.tree_util.tree_map(lambda a: a[0], x0))
        if getattr(out, "ndim", None) == 1:
            return True
        errors.append(f"called on one example it returned shape {getattr(out, 'shape', type(out))}")
    except Exception as err:  # noqa: BLE001 - any failure means "not per example"
        errors.append(f"called on one example it raised {type(err).__name__}: {str(err)[:200].rstrip('.')}")
    try:
        out = jax.eval_shape(call, leaves, x0)
        if getattr(out, "ndim", None) == 2 and out.shape[0] == n:
            return False
        errors.append(f"called on a batch it returned shape {getattr(out, 'shape', type(out))}")
    except Exception as err:  # noqa: BLE001
        errors.append(f"called on a batch it raised {type(err).__name__}: {str(err)[:200].rstrip('.')}")
    raise ValueError(
        "Cannot tell whether the equinox model takes one example (logits of shape (classes,)) or a "
        f"batch (logits of shape (batch, classes)): {'; '.join(errors)}. Pass vmap=True (per example) or "
        "vmap=False (batch); models with BatchNorm need state=... (they return (logits, state))."
    )


# ----------------------------------------------------------------------------- flax nnx


_NNX_EVAL = LRU(32)


def _nnx(model, dtype):
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
        cached = (gdef, paths, owner_list)
        _NNX_EVAL.put(key, cached)
    gdef, paths, owner_list = cached
    # Every floating module attribute in the compute dtype: nnx layers with param_dtype
    # float16 but dtype=None compute in the promoted dtype of inputs and parameters, and a
    # float16 statistic or constant left in the graph would meet float32 values in lax.add.
    leaves = [_as(a, dtype) for a in leaves]
    rest_leaves, rest_def = jax.tree_util.tree_flatten(_cast(rest, dtype))

    def apply_batch(leaves, extra, x):
        return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, leaves),
                         jax.tree_util.tree_unflatten(rest_def, extra))(x)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("flax.nnx", leaves, paths, [], rest_leaves, apply_batch, apply_example)
    view.user_states = (params, rest)  # type: ignore[attr-defined]  (for state.ModelState)
    view.struct = _struct("nnx", gdef, treedef, rest_def, _avals(leaves), _avals(rest_leaves), refs=view.struct_refs)
    view.dtype = dtype
    return view, dict(zip(paths, owner_list))


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


# ----------------------------------------------------------------------------- flax linen


_LINEN_OWNERS = LRU(32)


def _linen(module, variables, x0, dtype, apply_kwargs):
    import flax.linen as nn

    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError(
            "A flax linen model is passed as (module, variables) with variables = module.init(...), a "
            f"mapping with a 'params' collection; got {type(variables).__name__}."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(variables["params"])
    dtype = dtype or pick_dtype([a for _, a in flat])
    o_leaves, o_def = jax.tree_util.tree_flatten(_cast({k: v for k, v in variables.items() if k != "params"}, dtype))
    paths = [path_str(p) for p, _ in flat]
    leaves = [_as(a, dtype) for _, a in flat]

    def apply_batch(leaves, extra, x):
        others = jax.tree_util.tree_unflatten(o_def, extra)
        return module.apply({**others, "params": jax.tree_util.tree_unflatten(treedef, leaves)}, x,
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
    return view, owners


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


def _pair(apply_fn, params, dtype, apply_kwargs):
    if not callable(apply_fn) or not isinstance(params, Mapping):
        raise TypeError("A plain JAX model is passed as (apply_fn, params) with a mapping of parameters.")
    # Flax-style variables {'params': ..., 'batch_stats': ...}: only 'params' holds weights.
    collections = "params" in params and isinstance(params["params"], Mapping)
    tree = params["params"] if collections else params
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    dtype = dtype or pick_dtype([a for _, a in flat])
    o_leaves, o_def = jax.tree_util.tree_flatten(
        _cast({k: v for k, v in params.items() if k != "params"}, dtype) if collections else {})
    paths = [path_str(p) for p, _ in flat]
    leaves = [_as(a, dtype) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a for _, a in flat]

    def apply_batch(leaves, extra, x):
        t = jax.tree_util.tree_unflatten(treedef, leaves)
        others = jax.tree_util.tree_unflatten(o_def, extra)
        return apply_fn({**others, "params": t} if collections else t, x, **apply_kwargs)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("jax", leaves, paths, [], o_leaves, apply_batch, apply_example, dtype=dtype)
    view.struct = _struct("pair", apply_fn, treedef, o_def, _avals(leaves), _avals(o_leaves),
                          tuple(sorted(apply_kwargs.items())), refs=view.struct_refs)
    return view, {}  # no module objects: the leaf-name convention applies
