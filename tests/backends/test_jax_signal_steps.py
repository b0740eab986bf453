"""JAX backend: one example's GGN signals in steps (method §9, "Memory").

When one example's signals alone exceed the memory (the exact ``ggn`` with many classes:
``C − 1`` back-propagated signals, each with its gradients of every layer output), the
example's signals go a few at a time through one forward (a ``lax.scan`` over steps of the
VJP), each step's squares added into the group sums, as the torch and Keras backends do.
Every fast tap takes its squares from a step of signals: dense squares, convolution
patches, the structured head's pulled-back signals, the signals at the logits formed from
the factor a step at a time, embedding lookups, a tied table, a learned position table,
and the generic path. Checked in float64 against the same analysis with all signals at
once (every group of ``ggn-topk`` and ``ggn-mc``, not only their mean) and against the
brute force; a ``memory_budget`` that one signal does not fit is refused with the torch
backend's message, and without options the default budget steps through the signals too.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import load_builder, require_frameworks, stored_groups

require_frameworks("jax", "flax", "equinox")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import normflat  # noqa: E402
from normflat.backends import jax as jax_backend  # noqa: E402
from normflat.backends.jax import ggn as jax_ggn  # noqa: E402
from normflat.backends.jax import session  # noqa: E402
from normflat.engine import validate_options  # noqa: E402
from tests import netspec, reference  # noqa: E402

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def fresh_kernels():
    """Kernels are cached by program and options: each case builds and compiles its own."""
    session._TRACES.clear()
    session._CACHE.clear()
    yield
    session._TRACES.clear()
    session._CACHE.clear()


def _kernel():
    """The GGN kernel of the last analysis (the caches hold one per analysis here)."""
    kernels = [k for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN)]
    assert kernels
    return kernels[-1]


def _budget(run, signals):
    """Run ``run(chunk_size=1)`` (all signals at once) and return its result and a memory budget
    that holds one example with ``signals`` signals at a time, less than all of them need."""
    whole = run(chunk_size=1)
    kernel = _kernel()
    budget = kernel._step_base + signals * kernel._step_signal
    assert budget < kernel.need, "the case must be one whose signals do not all fit"
    session._CACHE.clear()
    return whole, budget


def _stepped(run, signals):
    """The same analysis under a budget of ``signals`` signals per step: ``(whole, stepped)``,
    with the steps (equal, of at most ``signals``) checked to be fewer signals than the example has."""
    whole, budget = _budget(run, signals)
    stepped = run(memory_budget=int(budget))
    kernel = _kernel()
    total = kernel.total  # the real signals (a padded layout's padding is never back-propagated)
    step = -(-total // -(-total // signals))  # equal steps of at most that many
    assert kernel.signal_step == step < total, (kernel.signal_step, step, total)
    assert kernel.max_block == 1 and [key[1] for key in kernel._compiled] == [(("step", step),)]
    return whole, stepped


def _close(got, ref, tol=1e-10):
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1e-300, float(np.abs(r).max())))


def _diag(model, data, **kw):
    return [np.asarray(v) for v in normflat.hessian_diagonal(model, data, progress=False, **kw).values()]


def _groups(model, data, options, **kw):
    """Every group's sums (the exact ``ggn``: its one diagonal)."""
    problems, _ = jax_backend.layer_problems(model, data, options, **kw)
    return [p.hessian_diag if p.hessian_diag_samples is None else p.hessian_diag_samples for p in problems]


# ----------------------------------------------------------------------------- (n, C) logits


@pytest.mark.parametrize("case, loss, signals", [
    ("structured-head", "ce", 7), ("structured-head", "nsce", 5), ("at-the-logits", "nsce", 4),
    ("generic", "ce", 6)])
def test_one_examples_signals_in_steps_equal_all_at_once_and_brute_force(case, loss, signals):
    """Convolutions (patches) and a structured dense head at 40 classes; dense taps with the
    signals at the logits (20 classes, formed from the factor a step at a time); every weight on
    the generic path. Steps that do not divide the signals (the last one padded)."""
    if case == "structured-head":
        spec = netspec.cnn(channels=(2, 3, 4), image=6, classes=40, seed=61)
    else:
        spec = netspec.mlp((5, 6, 20), activation="tanh", seed=62)
    x, y = netspec.data(spec, n=5, seed=3)
    builder = load_builder("flax_nnx")
    model, data = builder.build(spec), builder.make_data(x, y, 3)
    kw = dict(loss=loss, estimator="ggn", **({"fast": False} if case == "generic" else {}))
    whole, stepped = _stepped(lambda **extra: _diag(model, data, **kw, **extra), signals)
    _close(stepped, whole, 1e-12)
    _close(stepped, reference.ggn_diagonal(spec, x, y, loss), 1e-10)


@pytest.mark.parametrize("estimator, kw", [("ggn-topk", dict(top_classes=2, samples=9)),
                                           ("ggn-mc", dict(samples=12))])
def test_every_group_is_kept_apart_in_steps(estimator, kw):
    """Steps cut across the groups: every group's sums (the standard errors' input), not only
    their mean, equal those of all signals at once."""
    spec = netspec.cnn(channels=(2, 3, 4), image=6, classes=40, seed=63)
    x, y = netspec.data(spec, n=4, seed=4)
    builder = load_builder("equinox")
    model, data = builder.build(spec), builder.make_data(x, y, 4)
    options = validate_options(loss="ce", estimator=estimator, seed=3, progress=False, **kw)
    whole, stepped = _stepped(lambda **extra: _groups(model, data, options, **extra), 2)
    _close(stepped, whole, 1e-12)


def test_memory_budget_too_small_for_one_signal_is_refused():
    spec = netspec.cnn(channels=(2, 3, 4), image=6, classes=40, seed=61)
    x, y = netspec.data(spec, n=3, seed=3)
    builder = load_builder("flax_nnx")
    model, data = builder.build(spec), builder.make_data(x, y, 3)
    with pytest.raises(ValueError, match=r"memory_budget=500 bytes .* is too small: one back-propagated GGN "
                                         r"signal needs \d+ bytes"):
        _diag(model, data, estimator="ggn", memory_budget=500)


def test_default_budget_steps_through_one_examples_signals(monkeypatch):
    """No options: when one example's signals exceed about twice a training step, they go in steps."""
    spec = netspec.cnn(channels=(2, 3, 4), image=6, classes=40, seed=64)
    x, y = netspec.data(spec, n=4, seed=5)
    builder = load_builder("flax_nnx")
    model, data = builder.build(spec), builder.make_data(x, y, 4)
    whole = _diag(model, data, loss="ce", estimator="ggn", chunk_size=4)
    kernel = _kernel()
    budget = kernel._step_base + 3 * kernel._step_signal
    session._CACHE.clear()
    monkeypatch.setattr(jax_ggn, "default_budget", lambda step, state: budget)
    got = _diag(model, data, loss="ce", estimator="ggn")
    kernel = _kernel()
    assert kernel.signal_step is None and [key[1] for key in kernel._compiled] == [(("step", 3),)]
    _close(got, whole, 1e-12)
    _close(got, reference.ggn_diagonal(spec, x, y, "ce"), 1e-10)


# ----------------------------------------------------------------------------- token logits, tables


@pytest.mark.parametrize("name, kw", [
    ("tokens", dict(loss="nsce", estimator="ggn", sequence_signals=False)),
    ("tokens", dict(loss="ce", estimator="ggn-topk", top_classes=2, samples=3, seed=5)),
    ("tied", dict(loss="ce", estimator="ggn", sequence_signals=False)),
    ("tied", dict(loss="nsce", estimator="ggn-mc", samples=3, seed=8)),
    ("tokens", dict(loss="nsce", estimator="ggn-mc", samples=2, seed=4, sequence_signals=False)),
    ("tied", dict(loss="ce", estimator="ggn-topk", top_classes=1, samples=7, seed=9)),
], ids=["tokens-per-token", "tokens-per-sequence", "tied-per-token", "tied-per-sequence", "tokens-per-token-mc",
        "tied-per-sequence-padded"])
def test_token_logits_lookups_and_tied_tables_in_steps(name, kw, monkeypatch):
    """Token logits: an embedding lookup, a convolution over the tokens, attention and a dense
    head, or a head tied to the embedding (its per-example gradient formed a step of signals at a
    time): every group against all signals at once and the brute force of every group. Each
    step's signals are formed as it comes, never the example's whole signal tensor: per token
    from the per-token factor (its draws too), per sequence from the tokens' classes and scales."""
    from tests.backends.test_jax_sequences import MODELS, _data, reference_estimates

    make, layers, _ = MODELS[name]
    model, options = make(), validate_options(progress=False, **kw)
    # per sequence: 9, 3 and 12 signals (7 draws in 5 groups of 2: 3 of the 15 slots are padding,
    # never back-propagated), the last step padded
    signals = 2 if options.per_sequence else 5
    whole_tensors, factors = [], []
    traced, factor = jax_ggn.token_signals, jax_ggn.sequence_factor

    def spy(*args, **kwargs):
        whole_tensors.append(kwargs.get("members"))
        return traced(*args, **kwargs)

    monkeypatch.setattr(jax_ggn, "token_signals", spy)
    monkeypatch.setattr(jax_ggn, "sequence_factor", lambda *a, **k: (factors.append(1), factor(*a, **k))[1])
    # ggn-topk per sequence with a dense head on the logits: the signals start at the head's input,
    # from the tokens' classes and scales, a step at a time or all at once (never at the logits).
    structured = name == "tokens" and options.per_sequence and options.estimator == "ggn-topk"

    def run(**extra):
        whole_tensors.clear(), factors.clear()
        got = _groups(model, _data(), options, **extra)
        if structured:
            assert factors and not whole_tensors
        else:  # formed whole only with all at once
            assert bool(whole_tensors) == ("memory_budget" not in extra) and not factors
        return got

    whole, stepped = _stepped(run, signals)
    _close(stepped, whole, 1e-12)
    want = reference_estimates(name, options)
    for got, layer in zip(stepped, layers):
        groups = want[layer] if options.groups > 1 else want[layer][0]  # the exact ggn: its one diagonal
        _close([got], [stored_groups(groups, got.shape)], 1e-10)


def test_position_table_in_steps():
    """A learned position table added to the activations (its rows' squares from the signals at
    its operand of the addition), with the brute force."""
    from tests.arch.test_jax_embedding_fast import PATCH_Y, PATCHES, _table, _vit

    model, ref, name = _vit("nnx")
    data = (PATCHES, PATCH_Y)
    whole, stepped = _stepped(lambda **extra: normflat.hessian_diagonal(model, data, loss="nsce", estimator="ggn",
                                                                        progress=False, **extra), 1)
    assert set(stepped) == set(whole)
    for key in whole:
        _close([stepped[key]], [whole[key]], 1e-12)
    _close([stepped[name]], [_table(ref(*data, "nsce")[name])], 1e-10)


# ----------------------------------------------------------------------------- padding


_TOPK, _MC = ("ggn-topk", dict(top_classes=4, samples=7)), ("ggn-mc", dict(samples=13))


@pytest.mark.parametrize("case, estimator, kw, stepped, pooled", [
    ("structured-head", *_TOPK, True, False), ("at-the-logits", *_MC, False, True),
    ("tokens", *_TOPK, False, False), ("per token", *_MC, True, False)])
def test_padding_signals_are_not_back_propagated(monkeypatch, case, estimator, kw, stepped, pooled):
    """Groups shorter than the (K', M) layout (ggn-topk's 4 exact classes against 2 draws per
    group, 7 draws in 5 groups; ggn-mc's 13 draws in 10) are padded with zero signals: only the
    real ones are back-propagated (losses.real_signals), all at once or in steps, and every
    group's sums (and, pooled, their mean) are those of the padded layout."""
    from tests.backends.test_jax_topk import _token_data, _token_model

    if case in ("tokens", "per token"):
        model, extra = _token_model("flax_nnx")
        x, y = _token_data()
        data = [(jnp.asarray(x[:3]), jnp.asarray(y[:3])), (jnp.asarray(x[3:]), jnp.asarray(y[3:]))]
        if case == "per token":
            kw = dict(kw, sequence_signals=False)
    else:
        spec = (netspec.cnn(channels=(2, 3, 4), image=6, classes=12, seed=64) if case == "structured-head"
                else netspec.mlp((5, 6, 12), activation="tanh", seed=65))
        x, y = netspec.data(spec, n=5, seed=3)
        builder = load_builder("flax_nnx")
        model, data, extra = builder.build(spec), builder.make_data(x, y, 3), {}
    options = validate_options(loss="ce", estimator=estimator, seed=3, progress=False, **kw)

    def run(**more):
        got = [_groups(model, data, options, **extra, **more)]
        if pooled:
            got.append(_diag(model, data, loss="ce", estimator=estimator, seed=3, **kw, **extra, **more))
        return got

    budget = {}
    if stepped:  # a budget of 3 signals per step
        _, budget["memory_budget"] = _budget(lambda **more: run(**more)[0], 3)
    real = run(**budget)
    kernels = [k for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN)]
    assert len(kernels) == len(real) and all(k.real is not None and k.total < k.bp * k.cols for k in kernels)
    assert all((k.signal_step is not None) == stepped for k in kernels)
    session._CACHE.clear()
    real_signals = jax_ggn.real_signals

    def padded_layout(options, c, tokens=1, sequence=False):
        """Every signal of the groups back-propagated, padding included (the leading all-zero
        groups of per-sequence ggn-topk still skipped)."""
        width = (options.token_signals_per_group(c, 1) if sequence else options.signals_per_group(c)) * tokens
        first = real_signals(options, c, tokens=tokens, sequence=sequence)[0] // width
        return np.arange(first * width, options.state_groups * width)

    monkeypatch.setattr(jax_ggn, "real_signals", padded_layout)
    padded = run(**budget)
    assert all(k.real is None for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN))
    for got, want in zip(real, padded):
        _close(got, want, 1e-12)


# ----------------------------------------------------------------------------- group sums


@pytest.mark.parametrize("form", ["in order", "padded layout", "a step"])
def test_group_sums_of_every_form_under_the_examples_vmap(form):
    """``GGN._group_sum`` adds each signal's squares into its group: all ``bp·cols`` signals in
    order (a constant membership contraction), the real signals of a padded layout (numpy groups,
    the same), and a step's traced groups (a segment sum), also under the ``vmap`` over a chunk's
    examples, where the signals' axis is an inner one (the layout whose plain sum XLA:CPU ran
    slowly), jit-compiled. Against numpy, float64."""
    bp, cols, entries = 3, 4, (5, 2)
    kernel = type("Groups", (), {"bp": bp, "cols": cols})()
    rng = np.random.default_rng(0)
    if form == "in order":
        groups = None
        signals = bp * cols
    elif form == "padded layout":
        groups = np.array([0, 0, 1, 2, 2, 2, 2])  # group 1 has one real signal, group 2 four
        signals = groups.size
    else:
        groups = np.array([2, 0, 2, 1, 0])
        signals = groups.size
    v = rng.standard_normal((6, signals) + entries)  # 6 examples
    member = np.arange(signals) // cols if groups is None else groups
    want = np.stack([[v[n, member == g].sum(axis=0) for g in range(bp)] for n in range(6)])

    def one(vn, traced):
        return jax_ggn.GGN._group_sum(kernel, vn, traced if form == "a step" else groups)

    got = jax.jit(jax.vmap(one, in_axes=(0, None)))(jnp.asarray(v), jnp.asarray(member))
    assert got.shape == (6, bp) + entries
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-13, atol=1e-13)
    # one example alone, unbatched
    np.testing.assert_allclose(np.asarray(one(jnp.asarray(v[0]), jnp.asarray(member))), want[0], rtol=1e-13)
