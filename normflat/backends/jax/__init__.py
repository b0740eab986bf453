"""JAX backend: equinox, flax nnx, flax linen and plain ``(apply_fn, params)`` models.

Backend options (keyword arguments of :func:`normflat.analyze`):

``vmap``
    equinox only: ``True`` if the model maps one example to logits of shape
    ``(classes,)`` (equinox's own layers) and is applied with :func:`jax.vmap`,
    ``False`` if it takes a batch. Default: detected from the first batch.
``state``
    equinox only: the ``eqx.nn.State`` of a stateful model (BatchNorm); the
    model is then called as ``model(x, state)`` and must return ``(logits, state)``.
``apply_kwargs``
    linen / ``(apply_fn, params)`` only: extra call arguments, e.g.
    ``{"train": False}``.
``layouts``
    ``{leaf path: layout}`` declaring weight tensors that normflat does not
    recognise (or overriding it): ``"out,in,*k"`` (torch/equinox order),
    ``"*k,in,out"`` (flax/Keras order), or ``None`` to exclude a leaf.
``dtype``
    Compute dtype. Default: the weights' dtype (at least float32). ``"float64"``
    computes in double precision, enabling ``jax_enable_x64`` locally if needed.
``chunk_size``
    Examples per device per vectorised chunk of ``ggn``/``ggn-mc`` (default:
    chosen from an internal bound on the per-example intermediates).
    ``exact_chunk``: basis vectors per chunk of ``exact`` (default 64);
    ``probe_chunk``: Hutchinson probes per chunk (default 16).
``memory_budget``
    Bound on the memory of the per-example work of one compiled step *per
    device*: an int number of bytes or a string such as ``"512MB"`` or
    ``"2GiB"`` (see :mod:`normflat.core.memory`). The examples per step are
    chosen from it (for every estimator); a ``ValueError`` names the need when
    one example does not fit. Exclusive with ``chunk_size``. Default None.
``devices``
    Data parallelism over local devices: ``None`` (default) uses all local
    devices of the default backend when there are several (each batch is
    sharded over a 1-D :class:`jax.sharding.Mesh` with axis ``"data"``, the
    weights replicated, and XLA inserts the cross-device sums), an int ``n``
    the first ``n`` local devices, or a list of local ``jax.Device`` objects.
    One device means no sharding. Results equal the one-device results (up
    to floating-point summation order), also for the stochastic estimators.
``distributed``
    ``None``/``True`` (default): shard over ``devices`` and, after
    :func:`jax.distributed.initialize` with several processes, treat the data
    each process passes as its shard and combine the per-layer sums and
    example counts of all processes, so every process returns the identical
    report. ``False``: one device, this process's data only.
``force``, ``max_exact_params``
    ``estimator="exact"`` refuses models with more than ``max_exact_params``
    (default :data:`DEFAULT_MAX_EXACT_PARAMS`) weight entries unless ``force=True``.

Compiled estimators are cached by the traced per-example program (structure,
shapes, dtypes and options), so analysing the same architecture again, with
other weight values, does not recompile.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from normflat.backends.jax import _data, _estimators
from normflat.backends.jax._models import make_view
from normflat.backends.jax._program import trace_program
from normflat.core.memory import parse_memory_budget
from normflat.core.options import AnalysisOptions, limited, progress_bar
from normflat.core.problem import LayerProblem

__all__ = ["layer_problems", "hessian_diagonal", "DEFAULT_MAX_EXACT_PARAMS"]

#: estimator="exact" needs one Hessian-vector product per weight entry; above this
#: many entries it refuses unless force=True (same default as the torch backend).
DEFAULT_MAX_EXACT_PARAMS = 20_000

_OPTIONS = {"vmap": None, "state": None, "apply_kwargs": None, "layouts": None, "dtype": None,
            "chunk_size": None, "exact_chunk": 64, "probe_chunk": 16, "force": False,
            "max_exact_params": DEFAULT_MAX_EXACT_PARAMS, "memory_budget": None, "devices": None,
            "distributed": None}
# Compiled estimators of recent models, keyed by the traced per-example program, so that
# repeated analyses (e.g. during training) do not recompile. Small: each holds XLA executables.
_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 8
# Traced and analysed per-example programs, keyed by the model's structure.
_TRACES: dict = {}


def layer_problems(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any):
    """Per-layer problems of a JAX model (see the module docstring for the options)."""
    res = _compute(model, data, options, backend_options)
    problems = []
    for info, w, d, s, path in zip(res["weights"], res["weight_arrays"], res["diags"], res["samples"],
                                   res["paths"]):
        problems.append(LayerProblem(
            info.name, w, d, kind=info.kind, hessian_diag_samples=s,
            details={"path": path, "leaf": info.path},
        ))
    return problems, res["metadata"]


def hessian_diagonal(model: Any, data: Any, options: AnalysisOptions, **backend_options: Any) -> dict:
    """``{layer name: diagonal}`` in canonical ``(out, in, *kernel)`` layout, model order."""
    res = _compute(model, data, options, backend_options)
    return {info.name: d for info, d in zip(res["weights"], res["diags"])}


# ----------------------------------------------------------------------------- driver


def _settings(backend_options: dict) -> dict:
    unknown = set(backend_options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"Unknown option(s) {sorted(unknown)} for a JAX model; the JAX backend accepts "
                        f"{', '.join(_OPTIONS)}.")
    s = {**_OPTIONS, **backend_options}
    for name in ("exact_chunk", "probe_chunk", "max_exact_params"):
        v = s[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}.")
    v = s["chunk_size"]
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {v!r}.")
    if s["memory_budget"] is not None and s["chunk_size"] is not None:
        raise ValueError("Pass either chunk_size (examples per step) or memory_budget (the chunk size is then "
                         "chosen from it), not both.")
    s["memory_budget"] = parse_memory_budget(s["memory_budget"])
    if s["distributed"] is not None and not isinstance(s["distributed"], bool):
        raise TypeError(f"distributed must be True, False or None, got {s['distributed']!r}.")
    d = s["devices"]
    if d is not None and not (isinstance(d, int) and not isinstance(d, bool) and d >= 1):
        if isinstance(d, (str, bytes)) or not hasattr(d, "__iter__"):
            raise TypeError(f"devices must be None, a positive int or a list of jax devices, got {d!r}.")
        d = list(d)
        if not d or not all(isinstance(v, jax.Device) for v in d):
            raise TypeError(f"devices must be a non-empty list of jax.Device objects (e.g. jax.local_devices()), "
                            f"got {s['devices']!r}.")
        s["devices"] = d
    if s["vmap"] is not None and not isinstance(s["vmap"], bool):
        raise TypeError(f"vmap must be True, False or None, got {s['vmap']!r}.")
    for name in ("apply_kwargs", "layouts"):
        if s[name] is not None and not isinstance(s[name], dict):
            raise TypeError(f"{name} must be a dict, got {type(s[name]).__name__}.")
    if s["dtype"] is not None:
        try:
            dt = jnp.dtype(s["dtype"])
        except TypeError as err:
            raise ValueError(f"dtype={s['dtype']!r} is not a dtype.") from err
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"dtype={s['dtype']!r} is not a floating-point dtype.")
        s["dtype"] = dt
    return s


def _compute(model, data, options: AnalysisOptions, backend_options: dict) -> dict:
    settings = _settings(backend_options)
    need_x64 = settings["dtype"] == jnp.float64 and not jax.config.jax_enable_x64
    # float64 without global x64: enable it for this computation only (documented).
    ctx = jax.enable_x64(True) if need_x64 else contextlib.nullcontext()
    with ctx:
        res = _compute_in_dtype(model, data, options, settings)
        if need_x64:
            # JAX cannot hold float64 arrays once x64 is off again: hand numpy arrays over.
            for key in ("weight_arrays", "diags", "samples"):
                res[key] = [None if a is None else np.asarray(a) for a in res[key]]
    return res


def _mesh(settings: dict):
    """The 1-D ``("data",)`` mesh of local devices to shard batches over, or None for one device."""
    if settings["distributed"] is False:
        return None
    local = jax.local_devices()
    devs = settings["devices"]
    if devs is None:
        devs = local
    elif isinstance(devs, int):
        if devs > len(local):
            raise ValueError(f"devices={devs} but this process has {len(local)} local device(s): {local}.")
        devs = local[:devs]
    else:
        foreign = [d for d in devs if d not in local]
        if foreign:
            raise ValueError(
                f"devices {foreign} are not local devices of this process; pass local devices only. Across "
                "processes (after jax.distributed.initialize) each process passes its own data and the results "
                "are combined automatically."
            )
        if len(set(devs)) != len(devs):
            raise ValueError(f"devices lists a device twice: {devs}.")
    if len(devs) < 2:
        return None
    return jax.sharding.Mesh(np.asarray(devs, dtype=object), ("data",))


def _multi_process(settings: dict) -> bool:
    return settings["distributed"] is not False and jax.process_count() > 1


def _prepare(model, x, options, settings, pending):
    """View, program and (possibly cached) estimator for the first batch ``x``."""
    view = make_view(model, x, dtype=settings["dtype"], vmap=settings["vmap"], state=settings["state"],
                     apply_kwargs=dict(settings["apply_kwargs"] or {}), layouts=dict(settings["layouts"] or {}),
                     on_unsupported=options.on_unsupported)
    dtype = view.dtype
    x = _data.cast_inputs(x, dtype)
    weights = list(view.weights)

    def weight_check(ok):
        if not ok:
            bad = [w.path for w in weights if not bool(jnp.all(jnp.isfinite(view.leaves[w.leaf])))]
            raise ValueError(f"The weight(s) {bad} contain NaN or inf; normflat needs finite weights.")
    # Checked together with the first batch's values (one compiled call, one sync at the end).
    view.weight_check = ([view.leaves[w.leaf] for w in weights], weight_check)
    x0 = jax.tree_util.tree_map(lambda a: a[0], x)
    tkey = None
    if view.struct is not None:
        tkey = (view.struct, tuple(w.path for w in view.weights),
                _models_avals(jax.tree_util.tree_leaves(x0)), str(jax.tree_util.tree_structure(x0)))
    entry = _TRACES.get(tkey) if tkey is not None else None
    if entry is None:
        ws, others = view.split()
        fn = view.example_fn()
        treedef = jax.tree_util.tree_structure(x0)
        prog = trace_program(lambda w_, o_, xl: [fn(w_, o_, jax.tree_util.tree_unflatten(treedef, xl))],
                             ws, others, jax.tree_util.tree_leaves(x0))
        _check_program_output(prog, view)
        # Model order: where each weight first meets the data in the forward pass.
        order = sorted(range(len(ws)), key=lambda k: (prog.first_use[k], k))
        prog.reorder(order)
        if tkey is not None:
            # The traced program depends only on the structure (like jax.jit's cache).
            _TRACES[tkey] = (prog, order, view.struct_refs)
            while len(_TRACES) > _CACHE_SIZE:
                _TRACES.pop(next(iter(_TRACES)))
    else:
        prog, order, _ = entry
    view.weights = [view.weights[k] for k in order]
    ws, others = view.split()
    num_classes = prog.shapes[prog.out_refs[0][1]][0]
    if options.estimator == "exact":
        total = sum(int(np.prod(w.shape)) for w in ws)
        if total > settings["max_exact_params"] and not settings["force"]:
            raise ValueError(
                f"estimator='exact' needs one Hessian-vector product per weight entry ({total} here, more "
                f"than max_exact_params={settings['max_exact_params']}). Use estimator='ggn' or "
                "'hutchinson', or pass force=True if you really want it."
            )
    key = (prog.text, tuple(str(w.dtype) for w in ws), options.estimator, options.samples,
           options.loss if callable(options.loss) else str(options.loss), options.temperature,
           settings["chunk_size"], settings["memory_budget"], settings["exact_chunk"], settings["probe_chunk"])
    est = None
    cached = _CACHE.get(key)
    if cached is not None and _same_consts(cached[0], prog.consts):
        est = cached[1]
        _CACHE.move_to_end(key)
    if est is None:
        est = _estimators.make(options, prog, ws, dtype, num_classes, settings)
        _CACHE[key] = (prog.consts, est)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    multi = _multi_process(settings)
    # Processes draw independent probes (ggn-mc, hutchinson): their process index is folded in.
    est.reset(ws, others, options.seed, mesh=_mesh(settings), stream=jax.process_index() if multi else 0)
    return view, est, dtype, ws, num_classes


def _models_avals(leaves) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in leaves)


def _same_consts(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if x is y:
            continue
        if np.shape(x) != np.shape(y) or getattr(x, "dtype", None) != getattr(y, "dtype", None):
            return False
        if not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True


def _compute_in_dtype(model, data, options, settings) -> dict:
    it = progress_bar(limited(_data.batches(data), options.max_batches), enabled=options.progress,
                      desc=f"normflat {options.estimator}", total=_data.total(data, options.max_batches))
    view = est = dtype = None
    examples = n_batches = 0
    pending: list = []  # value checks, evaluated together at the end (one device sync)
    multi = _multi_process(settings)
    try:
        for x, y in it:
            if view is None:
                view, est, dtype, ws, num_classes = _prepare(model, x, options, settings, pending)
            x = _data.cast_inputs(x, dtype)
            n = _data.check_batch(x, y, options, num_classes, n_batches, pending,
                                  view.weight_check if n_batches == 0 else None)
            est.add_batch(jax.tree_util.tree_leaves(x), y, n, n_batches, examples)
            examples += n
            n_batches += 1
        if multi:
            # Input checks before the exchange, so that a bad shard fails on every process.
            _data.run_checks(pending)
            pending = []
    except Exception as err:
        if not multi:
            raise
        _exchange_status(err, view is not None, examples, n_batches)
        raise
    processes = 1
    if multi:
        examples, n_batches, processes = _exchange_status(None, view is not None, examples, n_batches)
        _combine_sums(est)
    if view is None:
        raise ValueError("The data is empty: it yielded no (x, y) batch. Pass an iterable of (x, y) batches "
                         "or one (x, y) pair of arrays.")
    ndev = est.ndev
    diags, samples, ws, finite = est.finish(examples, tuple(w.layout == "flax" for w in view.weights))
    paths = list(est.paths)
    # Drop references to this model's arrays from the cached estimator.
    est.ws = est.others = est.sums = None

    def diag_check(ok):
        if not ok:
            bad = [w.name for w, d in zip(view.weights, diags) if not bool(jnp.all(jnp.isfinite(d)))]
            raise ValueError(
                f"The Hessian diagonal of layer(s) {bad} contains NaN or inf; check the data and the weights "
                "for huge values, or compute in float64 (dtype='float64')."
            )
    pending.append((finite, diag_check))
    _data.run_checks(pending)
    device = str(next(iter(ws[0].devices()))) if hasattr(ws[0], "devices") else "cpu"
    meta = {"examples": examples, "batches": n_batches, "dtype": str(jnp.dtype(dtype)), "device": device,
            "model_type": view.framework, "devices": ndev, "processes": processes}
    if settings["memory_budget"] is not None:
        meta["memory_budget"] = settings["memory_budget"]
    if est.max_block is not None:
        meta["chunk_size"] = est.max_block  # examples per device and compiled step
    if view.vmap is not None:
        meta["vmap"] = view.vmap
    return {"weights": view.weights, "weight_arrays": ws, "diags": diags, "samples": samples,
            "paths": paths, "metadata": meta}


def _exchange_status(error, has_data: bool, examples: int, n_batches: int):
    """All-gather every process's status; raise on every process if any failed or had no data.

    Called by every process exactly once per analysis (also by a failing one,
    before it re-raises its own error), so no process waits for a peer that
    has given up. Returns the total examples, batches and the process count.
    """
    from jax.experimental import multihost_utils

    status = np.asarray([error is not None, has_data, examples, n_batches], np.int32)
    table = np.asarray(multihost_utils.process_allgather(status))
    failed = [int(i) for i in np.flatnonzero(table[:, 0])]
    if failed:
        if error is not None:
            return None  # the caller re-raises its own error
        raise RuntimeError(f"normflat: process(es) {failed} failed during the analysis (see their error); this "
                           f"process {jax.process_index()} stops too.")
    empty = [int(i) for i in np.flatnonzero(table[:, 1] == 0)]
    if empty:
        raise ValueError(f"Process(es) {empty} received no (x, y) batch; in a multi-process analysis every process "
                         "needs at least one batch of its data shard (or pass distributed=False).")
    return int(table[:, 2].sum()), int(table[:, 3].sum()), int(table.shape[0])


def _combine_sums(est) -> None:
    """Sum the per-layer accumulators of all processes (same order everywhere: identical results)."""
    from jax.experimental import multihost_utils

    est.reduce_devices()
    local = [np.asarray(s) for s in est.sums]
    gathered = multihost_utils.process_allgather(local)
    est.sums = [jnp.asarray(np.asarray(g).sum(axis=0)) for g in gathered]


def _check_program_output(prog, view) -> None:
    if len(prog.out_refs) != 1 or prog.out_refs[0][0] != "ref" or len(prog.shapes[prog.out_refs[0][1]]) != 1:
        shape = prog.shapes.get(prog.out_refs[0][1]) if prog.out_refs and prog.out_refs[0][0] == "ref" else None
        raise ValueError(
            f"The {view.framework} model must return logits of shape (batch, classes) (one vector per "
            f"example); per example it returned shape {shape}."
        )
    c = prog.shapes[prog.out_refs[0][1]][0]
    if c < 2:
        raise ValueError(f"The model returns {c} logit per example; normflat's losses need at least 2 classes.")
