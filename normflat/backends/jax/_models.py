"""Adapters: equinox, flax nnx, flax linen and ``(apply_fn, params)`` as one pure function.

Every adapter produces a :class:`ModelView`: the model's floating-point leaves
(cast to the compute dtype), which of them are weight tensors of recognised
layers, and pure functions ``(leaves, x) -> logits`` for a batch and for one
example. The user's objects are only read: equinox and linen models are
immutable, and an nnx module is split into a private copy that is switched to
evaluation mode (the user's module keeps its mode and state).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["ModelView", "WeightInfo", "make_view", "LAYOUT_ALIASES", "path_str"]

#: Accepted names of weight layouts in ``layouts=``: canonical (torch/equinox) or flax/Keras.
LAYOUT_ALIASES = {
    "out,in,*k": "canonical", "out,in": "canonical", "(out, in, *k)": "canonical", "torch": "canonical",
    "canonical": "canonical",
    "*k,in,out": "flax", "in,out": "flax", "(*k, in, out)": "flax", "flax": "flax",
}


@dataclass
class WeightInfo:
    """A recognised weight tensor.

    Attributes:
        name: Layer name (the pytree path of the layer, e.g. ``layers/0``).
        path: Full path of the leaf (``layers/0/weight``).
        leaf: Index in :attr:`ModelView.leaves`.
        kind: ``"dense"``, ``"conv2d"``, ...
        layout: ``"canonical"`` (out, in, *k) or ``"flax"`` (*k, in, out).
    """

    name: str
    path: str
    leaf: int
    kind: str
    layout: str

    def to_canonical(self, a: Any, batch_dims: int = 0) -> Any:
        """Transpose an array in this weight's native layout (after ``batch_dims`` axes)."""
        if self.layout == "canonical":
            return a
        nd = a.ndim - batch_dims
        lead = tuple(range(batch_dims))
        perm = lead + (batch_dims + nd - 1, batch_dims + nd - 2) + tuple(batch_dims + i for i in range(nd - 2))
        return jnp.transpose(a, perm)


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
    #: (weight arrays, check) evaluated with the first batch's checks.
    weight_check: Any = None
    #: Hashable description of everything the traced program depends on besides the
    #: leaf values (None: not hashable, the program is traced every time).
    struct: Any = None
    #: Objects whose ids appear in ``struct``, kept alive with cache entries.
    struct_refs: list = field(default_factory=list)

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
              layouts: dict, on_unsupported: str) -> ModelView:
    """Build the :class:`ModelView` of any supported model (``x0``: the first input batch)."""
    import sys

    eqx = sys.modules.get("equinox")
    nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    if eqx is not None and isinstance(model, eqx.Module):
        view, types = _equinox(model, x0, dtype, vmap, state)
    else:
        if vmap is not None or state is not None:
            raise TypeError("vmap= and state= are options of equinox models only.")
        if nnx is not None and isinstance(model, nnx.Module):
            view, types = _nnx(model, dtype)
        elif linen is not None and isinstance(model, tuple) and isinstance(model[0], linen.Module):
            view, types = _linen(model[0], model[1], x0, dtype, apply_kwargs)
        else:
            view, types = _pair(model[0], model[1], dtype, apply_kwargs)
    if apply_kwargs and view.framework in ("equinox", "flax.nnx"):
        raise TypeError("apply_kwargs= is an option of (flax linen module, variables) and (apply_fn, params) "
                        "models; call options of equinox / nnx modules belong in the module.")
    _select_weights(view, types, layouts, on_unsupported)
    return view


def _select_weights(view: ModelView, types: dict, layouts: dict, on_unsupported: str) -> None:
    """Decide which leaves are weight tensors of recognised layers, and their layout."""
    unknown = set(layouts) - set(view.paths)
    if unknown:
        raise ValueError(
            f"layouts= names {sorted(unknown)}, which are not parameter leaves of this model. "
            f"Parameter leaves with at least 2 dimensions: "
            f"{[p for p, l in zip(view.paths, view.leaves) if np.ndim(l) >= 2]}."
        )
    unsupported = []
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
            view.weights.append(WeightInfo(name, path, i, _conv_kind(np.ndim(leaf)), LAYOUT_ALIASES[lay]))
            continue
        if np.ndim(leaf) < 2:
            continue  # biases, normalization scales: not weights (SPEC §9)
        rec = types.get(path)
        if rec == "ignore":
            continue  # a known non-weight leaf of a recognised layer (e.g. equinox conv bias (out, 1, 1))
        if rec is not None:
            kind, layout = rec
            view.weights.append(WeightInfo(name, path, i, kind, layout))
        else:
            unsupported.append(f"{path} {tuple(np.shape(leaf))}")
    if unsupported:
        msg = (f"normflat holds these parameters fixed because they do not belong to a recognised dense or "
               f"convolution layer of {view.framework}: {', '.join(unsupported)}. If one is a weight matrix, "
               "declare its layout with layouts={path: 'out,in,*k' or '*k,in,out'}; pass "
               "on_unsupported='skip' to silence this.")
        if on_unsupported == "error":
            raise ValueError(msg)
        if on_unsupported == "warn":
            warnings.warn(msg, stacklevel=4)
    if not view.weights:
        raise ValueError(
            f"The {view.framework} model has no weight tensor of a recognised dense or convolution layer, so "
            "there is nothing to analyze. Declare weight layouts with layouts={path: ...}."
        )


# ----------------------------------------------------------------------------- equinox


def _equinox(model, x0, dtype, vmap, state):
    import equinox as eqx

    model = eqx.nn.inference_mode(model)  # a new pytree: BatchNorm running stats, Dropout off
    params, static = eqx.partition(model, eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_str(p) for p, _ in flat]
    dtype = dtype or pick_dtype([a for _, a in flat])
    leaves = [_as(a, dtype) for _, a in flat]
    st_leaves, st_def = jax.tree_util.tree_flatten(_cast(state, dtype)) if state is not None else ([], None)
    types = {}
    for (p, leaf), path in zip(flat, paths):
        parent = _walk(model, p[:-1])
        last = path.rpartition("/")[2]
        if last == "weight" and isinstance(parent, eqx.nn.Linear) and np.ndim(leaf) == 2:
            types[path] = ("dense", "canonical")
        elif last == "weight" and isinstance(parent, eqx.nn.Conv) and not isinstance(parent, eqx.nn.ConvTranspose):
            types[path] = (_conv_kind(np.ndim(leaf)), "canonical")
        elif last == "bias" and isinstance(parent, (eqx.nn.Conv, eqx.nn.Linear)):
            types[path] = "ignore"

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
                _VMAP_CACHE[dkey] = vmap
                while len(_VMAP_CACHE) > 32:
                    _VMAP_CACHE.pop(next(iter(_VMAP_CACHE)))
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
    return view, types


_VMAP_CACHE: dict = {}


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


_NNX_EVAL: dict = {}


def _nnx(model, dtype):
    from flax import nnx

    user_gdef, params, rest = nnx.split(model, nnx.Param, ...)  # reads only: the user's module is unchanged
    cached = None
    try:
        cached = _NNX_EVAL.get(user_gdef)
    except TypeError:
        pass
    if cached is None:
        # A private copy switched to evaluation mode (BatchNorm running averages, no dropout);
        # the mode lives in the graph definition, so it is cached per user graph definition.
        clone = nnx.merge(user_gdef, params, rest)
        clone.eval()
        gdef, params_e, _ = nnx.split(clone, nnx.Param, ...)
        flat = jax.tree_util.tree_flatten_with_path(params_e)[0]
        clean = [p[:-1] if p and getattr(p[-1], "name", None) == "value" else p for p, _ in flat]
        types = {}
        for (_, leaf), p in zip(flat, clean):
            path = path_str(p)
            parent = _walk(clone, p[:-1])
            if path.rpartition("/")[2] != "kernel":
                continue
            if isinstance(parent, nnx.Linear) and np.ndim(leaf) == 2:
                types[path] = ("dense", "flax")
            elif isinstance(parent, nnx.Conv) and not isinstance(parent, nnx.ConvTranspose):
                types[path] = (_conv_kind(np.ndim(leaf)), "flax")
        cached = (gdef, [path_str(p) for p in clean], types)
        try:
            _NNX_EVAL[user_gdef] = cached
            while len(_NNX_EVAL) > 32:
                _NNX_EVAL.pop(next(iter(_NNX_EVAL)))
        except TypeError:
            pass
    gdef, paths, types = cached
    leaves, treedef = jax.tree_util.tree_flatten(params)
    dtype = dtype or pick_dtype(leaves)
    leaves = [_as(a, dtype) for a in leaves]
    rest_leaves, rest_def = jax.tree_util.tree_flatten(_cast(rest, dtype))

    def apply_batch(leaves, extra, x):
        return nnx.merge(gdef, jax.tree_util.tree_unflatten(treedef, leaves),
                         jax.tree_util.tree_unflatten(rest_def, extra))(x)

    def apply_example(leaves, extra, x):
        return apply_batch(leaves, extra, jax.tree_util.tree_map(lambda a: a[None], x))[0]

    view = ModelView("flax.nnx", leaves, paths, [], rest_leaves, apply_batch, apply_example)
    view.struct = _struct("nnx", gdef, treedef, rest_def, _avals(leaves), _avals(rest_leaves), refs=view.struct_refs)
    view.dtype = dtype
    return view, types


# ----------------------------------------------------------------------------- flax linen


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
    if struct is not None and struct in _LINEN_TYPES:
        return view, _LINEN_TYPES[struct]
    # The module types behind each parameter path, recorded during one abstract call.
    seen: dict[tuple, type] = {}

    def interceptor(f, args, kwargs, context):
        seen.setdefault(tuple(context.module.path), type(context.module))
        return f(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        _check_linen_call(lambda: jax.eval_shape(apply_batch, leaves, o_leaves, x0))
    types = {}
    for (p, leaf), path in zip(flat, paths):
        owner = seen.get(tuple(path_str([k]) for k in p[:-1]))
        if path.rpartition("/")[2] != "kernel":
            continue
        if owner is not None and issubclass(owner, nn.Dense) and np.ndim(leaf) == 2:
            types[path] = ("dense", "flax")
        elif owner is not None and issubclass(owner, nn.Conv):
            types[path] = (_conv_kind(np.ndim(leaf)), "flax")
    if struct is not None:
        _LINEN_TYPES[struct] = types
        while len(_LINEN_TYPES) > 32:
            _LINEN_TYPES.pop(next(iter(_LINEN_TYPES)))
    return view, types


_LINEN_TYPES: dict = {}


def _check_linen_call(fn):
    try:
        return fn()
    except Exception as err:
        if type(err).__name__ == "ModifyScopeVariableError":
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

    types = {}
    for path, leaf in zip(paths, leaves):
        if path.rpartition("/")[2] == "kernel" and 2 <= np.ndim(leaf) <= 5:
            types[path] = (_conv_kind(np.ndim(leaf)), "flax")
    view = ModelView("jax", leaves, paths, [], o_leaves, apply_batch, apply_example, dtype=dtype)
    view.struct = _struct("pair", apply_fn, treedef, o_def, _avals(leaves), _avals(o_leaves),
                          tuple(sorted(apply_kwargs.items())), refs=view.struct_refs)
    return view, types
