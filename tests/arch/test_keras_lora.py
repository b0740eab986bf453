"""Keras layers with LoRA enabled (``layer.enable_lora(rank)``, keras-hub's ``backbone.enable_lora``).

Keras computes such a layer's kernel as ``W + (α/r)·A·B`` in its call. normflat reports
the frozen kernel and the two factors as the linear maps they are (method §3, "LoRA
adapters"): ``<layer>``, ``<layer>/lora_a``, ``<layer>/lora_b``. On a ``Dense``, an ``Embedding``, a
(channels-last, ungrouped) convolution and an ``EinsumDense`` whose kernel's last axis is an output
all three take the fast rule from the layer's one tapped call (method §6.1, "LoRA adapters"); on an
``EinsumDense`` whose kernel's last axis is contracted the generic path.

The reference is the same function written with separate layers (the base layer, then
``A`` and ``B`` as layers of their own, their outputs added), whose diagonals take the
brute-force-tested fast rules: every LoRA weight's diagonal must equal its separate layer's,
for ``ggn`` and ``exact``, on Dense, EinsumDense (the kernel's last axis an output or an
input), Embedding and Conv2D. ``enable_lora`` creates float32 factors, so these models are
float32 and the tolerances are float32's. The fast rule is also checked in float64 against brute
force (:class:`_Dense64`: float64 factors), whole, in chunks, on one sample, for a layer called
twice, for a LoRA head of many classes and on a batch folded into windows. The rank rescaling (``A``'s column × c, ``B``'s row
/ c) leaves every normalized sharpness unchanged (method §8 item 9); a keras-hub backbone
with fresh adapters has the plain model's numbers on its base kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("keras")

import keras  # noqa: E402
import keras_hub  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras.layers import LORA_REASON  # noqa: E402
from tests.arch.test_keras_layers import RTOL as RTOL64  # noqa: E402
from tests.arch.test_keras_layers import _Windows, check_against  # noqa: E402

L = keras.layers
RTOL = 2e-4  # float32: the merged kernel W + A·B rounds apart from the separate layers' products
RANK = 2


def _lora(layer, rng):
    """Enable LoRA (α = r: the factor s is 1) and draw B away from its zero initialization."""
    layer.enable_lora(RANK, lora_alpha=RANK)
    b = layer.lora_kernel_b if hasattr(layer, "lora_kernel_b") else layer.lora_embeddings_b
    b.assign(0.5 * rng.normal(size=b.shape).astype("float32"))


def _pair(kind):
    """``(LoRA model, the same function with separate layers, {LoRA weight: separate layer}, (x, y))``."""
    keras.utils.set_random_seed(5)
    rng = np.random.default_rng(5)
    y = rng.integers(0, 3, 12)
    if kind == "embedding":
        ids = keras.Input((5,), dtype="int32")
        x = rng.integers(0, 9, (12, 5)).astype("int32")
        inp, make_base = ids, lambda name: L.Embedding(9, 4, name=name)
    elif kind == "conv2d":
        inp = keras.Input((6, 6, 2))
        x = rng.normal(size=(12, 6, 6, 2)).astype("float32")
        make_base = lambda name: L.Conv2D(4, 3, name=name)  # noqa: E731
    elif kind == "einsum_in_last":  # kernel (h, d): its last axis d is contracted with the input
        inp = keras.Input((6,))
        x = rng.normal(size=(12, 6)).astype("float32")
        make_base = lambda name: L.EinsumDense("bd,hd->bh", (5,), bias_axes="h", name=name)  # noqa: E731
    else:
        inp = keras.Input((5, 6))
        x = rng.normal(size=(12, 5, 6)).astype("float32")
        make_base = {"dense": lambda name: L.Dense(4, name=name),
                     "einsum_out_last": lambda name: L.EinsumDense("btd,dnh->btnh", (5, 2, 4), bias_axes="nh",
                                                                   name=name)}[kind]

    def head(h):
        h = L.Flatten()(L.Activation("tanh")(h))
        return L.Dense(3, name="head")(h)

    base = make_base("layer")
    model = keras.Model(inp, head(base(inp)))
    _lora(base, rng)

    # The same function with A and B as layers of their own.
    sep_base = make_base("base")
    if kind == "embedding":
        sep_a, sep_b = L.Embedding(9, RANK, name="a"), L.Dense(4, use_bias=False, name="b")
    elif kind == "conv2d":
        sep_a, sep_b = L.Conv2D(RANK, 3, use_bias=False, name="a"), L.Conv2D(4, 1, use_bias=False, name="b")
    elif kind == "einsum_in_last":  # u = B x first (rank r), then A u
        sep_b = L.EinsumDense("bd,rd->br", (RANK,), name="b")
        sep_a = L.EinsumDense("br,hr->bh", (5,), name="a")
    elif kind == "dense":
        sep_a, sep_b = L.Dense(RANK, use_bias=False, name="a"), L.Dense(4, use_bias=False, name="b")
    else:
        sep_a = L.EinsumDense("btd,dnr->btnr", (5, 2, RANK), name="a")
        sep_b = L.EinsumDense("btnr,rh->btnh", (5, 2, 4), name="b")
    low = sep_a(sep_b(inp)) if kind == "einsum_in_last" else sep_b(sep_a(inp))
    separate = keras.Model(inp, head(L.Add()([sep_base(inp), low])))
    a_var = base.lora_kernel_a if hasattr(base, "lora_kernel_a") else base.lora_embeddings_a
    b_var = base.lora_kernel_b if hasattr(base, "lora_kernel_b") else base.lora_embeddings_b
    table = base._embeddings if kind == "embedding" else base._kernel
    sep_base.set_weights([table.numpy(), *([base.bias.numpy()] if getattr(base, "bias", None) is not None else [])])
    sep_a.set_weights([a_var.numpy()])
    sep_b.set_weights([b_var.numpy().reshape(sep_b.get_weights()[0].shape)])
    separate.get_layer("head").set_weights(model.get_layer("head").get_weights())
    np.testing.assert_allclose(np.asarray(separate(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-5)
    names = {"layer": "base", "layer/lora_a": "a", "layer/lora_b": "b", "head": "head"}
    return model, separate, names, (x, y)


@pytest.mark.parametrize("kind", ["dense", "einsum_out_last", "einsum_in_last", "embedding", "conv2d"])
def test_lora_weights_equal_the_separate_layers(kind):
    """Each weight of a LoRA-enabled layer (the frozen kernel and both factors) has the diagonal and the
    normalized sharpness of the same map written as a layer of its own, for ``ggn`` and ``exact``; the
    layer is analyzed, not skipped (it was reported unsupported), on the fast rule where it has one."""
    model, separate, names, data = _pair(kind)
    for estimator in ("ggn", "exact"):
        report = normflat.analyze(model, data, loss="ce", estimator=estimator, progress=False)
        assert report.metadata["unsupported"] == [] and report.metadata["coverage"] == 1.0
        assert [layer.name for layer in report.layers] == list(names)
        fast = kind != "einsum_in_last"
        details = report.layer("layer/lora_a").details
        assert details["path"] == ("hvp" if estimator == "exact" else "fast" if fast else "generic")
        if estimator == "ggn" and not fast:
            assert details["generic_reason"] == LORA_REASON
        want_report = normflat.analyze(separate, data, loss="ce", estimator=estimator, progress=False)
        got = normflat.hessian_diagonal(model, data, loss="ce", estimator=estimator, progress=False)
        want = normflat.hessian_diagonal(separate, data, loss="ce", estimator=estimator, progress=False)
        for name, other in names.items():
            g, w = np.asarray(got[name]), np.asarray(want[other])
            assert np.abs(w).max() > 0, name
            np.testing.assert_allclose(g.reshape(w.shape), w, rtol=RTOL, atol=RTOL * np.abs(w).max(), err_msg=name)
            assert report.layer(name).normalized_sharpness == pytest.approx(
                want_report.layer(other).normalized_sharpness, rel=RTOL), name


def test_lora_rank_rescaling_leaves_normalized_sharpness_unchanged():
    """``A``'s rank column k times c_k and ``B``'s row k divided by it (Dense and EinsumDense): the same
    function, every normalized sharpness unchanged, the factors' traces moved (method §8 item 9)."""
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(10, 5, 6)).astype("float32"), rng.integers(0, 3, 10)

    def build():
        keras.utils.set_random_seed(6)
        inp = keras.Input((5, 6))
        h = L.EinsumDense("btd,dnh->btnh", (5, 2, 4), activation="tanh", name="ein")(inp)
        h = L.Dense(4, activation="tanh", name="dense")(L.Reshape((5, 8))(h))
        model = keras.Model(inp, L.Dense(3, name="head")(L.Flatten()(h)))
        draw = np.random.default_rng(7)
        for name in ("ein", "dense"):
            _lora(model.get_layer(name), draw)
        return model

    model, other = build(), build()
    factors = np.array([3.0, 0.4], "float32")
    for name in ("ein", "dense"):
        layer = other.get_layer(name)
        layer.lora_kernel_a.assign(layer.lora_kernel_a.numpy() * factors)
        layer.lora_kernel_b.assign(layer.lora_kernel_b.numpy() / factors[:, None])
    np.testing.assert_allclose(np.asarray(other(x)), np.asarray(model(x)), rtol=1e-5, atol=1e-6)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-4), lb.name
        if "/lora_" in lb.name:
            assert abs(la.hessian_trace - lb.hessian_trace) > 0.05 * abs(lb.hessian_trace), lb.name


def test_keras_hub_backbone_with_fresh_adapters_keeps_the_plain_numbers():
    """keras-hub's ``backbone.enable_lora(rank)`` (query and value projections): every weight is analyzed
    (coverage 1, nothing unsupported, the factors named ``…/lora_a``, ``…/lora_b``), and with the fresh
    adapters (B = 0: the plain model's function) the other weights have the plain model's numbers; the
    model's variables and their trainable flags are left as they were."""
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=40, num_layers=1, num_query_heads=2, hidden_dim=8,
                                              intermediate_dim=16, num_key_value_heads=1)
    model = keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 40, (3, 6)).astype("int32")
    data = ({"token_ids": ids, "padding_mask": np.ones((3, 6), "int32")},
            np.concatenate([ids[:, 1:], np.full((3, 1), -100)], axis=1))
    plain = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    backbone.enable_lora(rank=RANK)
    before = [(v.path, v.trainable, v.numpy().copy()) for v in model.weights]
    report = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    assert report.metadata["unsupported"] == [] and report.metadata["coverage"] == 1.0
    query = f"{backbone.name}/transformer_layer_0/self_attention/query"  # llama_backbone, _1, ... per process
    names = [layer.name for layer in report.layers]
    assert query + "/lora_a" in names and query + "/lora_b" in names
    for layer in plain.layers:
        got = report.layer(layer.name)
        assert got.normalized_sharpness == pytest.approx(layer.normalized_sharpness, rel=1e-5), layer.name
        assert got.hessian_trace == pytest.approx(layer.hessian_trace, rel=1e-5), layer.name
    after = [(v.path, v.trainable, v.numpy()) for v in model.weights]
    assert [(p, t) for p, t, _ in after] == [(p, t) for p, t, _ in before]
    assert all(np.array_equal(a, b) for (_, _, a), (_, _, b) in zip(after, before))


# ----------------------------------------------------------------------------- the fast rule in float64


F64 = "float64"


class _Lora64:
    """``enable_lora`` with float64 factors (Keras makes them float32 always), so that the fast rule is
    checked against brute force at float64's accuracy; the layer's call stays Keras' own."""

    def add_weight(self, *args, **kwargs):
        if str(kwargs.get("name", "")).startswith("lora_"):
            kwargs["dtype"] = F64
        return super().add_weight(*args, **kwargs)


class _Dense64(_Lora64, L.Dense):
    pass


class _EinsumDense64(_Lora64, L.EinsumDense):
    pass


class _Embedding64(_Lora64, L.Embedding):
    pass


class _Conv1D64(_Lora64, L.Conv1D):
    pass


def _factor_variables(layer):
    """``(frozen kernel or table, A, B)`` of a LoRA-enabled layer."""
    if hasattr(layer, "lora_embeddings_a"):
        return layer._embeddings, layer.lora_embeddings_a, layer.lora_embeddings_b
    return layer._kernel, layer.lora_kernel_a, layer.lora_kernel_b


def _conv1d_canonical(k):  # W (k, in, out) -> (out, in, k); A (k, in, r) -> (r, in, k)
    return k.transpose(2, 1, 0)


def _canonical_dense(k):  # (in, out) -> (out, in); A (in, r) -> (r, in); B (r, out) -> (out, r)
    return k.T


def _einsum_btd_dnh(k):  # W (d, n, h) -> (n·h, d); A (d, n, r) -> (n·r, d)
    return k.transpose(1, 2, 0).reshape(-1, k.shape[0])


def _lora64(layer, rng, alpha=3):
    """Rank 2, α = 3 (the factor s = 1.5, not 1), every factor entry drawn."""
    layer.enable_lora(RANK, lora_alpha=alpha)
    for v in _factor_variables(layer)[1:]:
        v.assign(0.6 * rng.normal(size=v.shape))


def _lora_model(case, activation="tanh"):
    """``(model, x, y, {report name: (variable path, canonical)})`` for a LoRA-enabled layer in float64:
    ``"dense"`` (on positions), ``"einsum"`` (an attention projection ``btd,dnh->btnh``), ``"embedding"``
    (a table looked up at token ids), ``"conv"`` (a ``Conv1D``), ``"twice"`` (a Dense called on two branches), ``"head"`` (a LoRA head of 40 classes:
    ``ggn``'s exact head rule would start the others' signals at its input), ``"windows"`` (a Dense on
    the batch folded into windows). ``activation``: the LoRA layer's in the ``"dense"``, ``"einsum"``
    and convolution cases."""
    keras.utils.set_random_seed(11)
    rng = np.random.default_rng(11)
    classes = 40 if case == "head" else 3
    if case == "embedding":
        inp = keras.Input((4,), dtype="int32")
        lora = _Embedding64(9, 5, dtype=F64, name="lora")
        h = lora(inp)
    else:
        inp = keras.Input((4, 3), dtype=F64)
        h = L.Dense(5, activation="tanh", dtype=F64, name="embed")(inp)
    if case == "einsum":
        lora = _EinsumDense64("btd,dnh->btnh", (4, 2, 3), bias_axes="nh", activation=activation, dtype=F64,
                              name="lora")
        h = L.Reshape((4, 6), dtype=F64)(lora(h))
    elif case == "conv":
        lora = _Conv1D64(4, 2, padding="same", activation=activation, dtype=F64, name="lora")
        h = lora(h)
    elif case == "twice":
        lora = _Dense64(5, activation="tanh", dtype=F64, name="lora")
        h = lora(h) + lora(L.Dense(5, dtype=F64, name="branch")(h))
    elif case == "windows":
        lora = _Dense64(5, activation="tanh", dtype=F64, name="lora")
        h = _Windows("blocks", inverse=True, dtype=F64)(lora(_Windows("blocks", dtype=F64)(h)))
    elif case != "embedding":
        lora = _Dense64(5, activation=activation, dtype=F64, name="lora")
        h = lora(h) if case == "dense" else h
    h = L.GlobalAveragePooling1D(dtype=F64)(h)
    head = (_Dense64 if case == "head" else L.Dense)(classes, dtype=F64, name="head")
    model = keras.Model(inp, head(h))
    for v in model.weights:
        v.assign(0.7 * rng.normal(size=v.shape))
    _lora64(head if case == "head" else lora, rng)
    x = rng.integers(0, 9, (6, 4)).astype("int32") if case == "embedding" else rng.normal(size=(6, 4, 3))
    y = rng.integers(0, classes, 6)
    name = "head" if case == "head" else "lora"
    canonical = {"einsum": _einsum_btd_dnh, "conv": _conv1d_canonical}.get(case, _canonical_dense)
    expected = {} if case == "embedding" else {"embed": ("embed/kernel", _canonical_dense)}
    if case == "twice":
        expected["branch"] = ("branch/kernel", _canonical_dense)
    table, a, b = _factor_variables(head if case == "head" else lora)
    expected.update({name: (table.path, canonical), f"{name}/lora_a": (a.path, canonical),
                     f"{name}/lora_b": (b.path, _canonical_dense)})
    if case != "head":
        expected["head"] = ("head/kernel", _canonical_dense)
    return model, x, y, expected


@pytest.mark.parametrize("case", ["dense", "einsum", "embedding", "conv", "twice", "head", "windows"])
def test_lora_fast_rule_equals_brute_force(case):
    """The frozen kernel and both factors of a LoRA-enabled ``Dense``, ``EinsumDense``, ``Embedding`` or
    convolution take the fast rule (method §6.1, "LoRA adapters"): against float64 brute force, whole and
    in chunks of 2 (and on one sample where a layer's rows could be misread: the lookup, the folded
    windows); ``ggn-mc`` against the generic path, and ``ggn-topk`` where an exact head rule is in play.
    Before, all three took the generic path (about twice the plain model's time on a keras-hub Llama)."""
    model, x, y, expected = _lora_model(case)
    report = normflat.analyze(model, (x, y), loss="ce", progress=False)
    assert [layer.name for layer in report.layers] == list(expected)
    assert {layer.name: layer.details["path"] for layer in report.layers} == dict.fromkeys(expected, "fast")
    runs = ((6, {}), (6, {"chunk_size": 2}), (1, {})) if case in ("dense", "embedding", "windows") else \
        ((6, {}), (6, {"chunk_size": 2}))
    for n, kw in runs:
        check_against(model, x[:n], y[:n], expected, **kw)
    estimators = [dict(estimator="ggn-mc", samples=3, seed=2)]
    if case in ("dense", "head"):  # ggn-topk's exact head rule beside (or refused for) a LoRA layer
        estimators.append(dict(estimator="ggn-topk", seed=2))
    for kw in estimators:
        fast = normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False, **kw)
        generic = normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False, fast=False, **kw)
        for name in expected:
            want = np.asarray(generic[name])
            np.testing.assert_allclose(np.asarray(fast[name]), want, rtol=RTOL64, atol=1e-14 * np.abs(want).max(),
                                       err_msg=name)


@pytest.mark.parametrize("case", ["dense", "einsum", "embedding", "conv"])
def test_lora_rescalings_on_the_fast_rule(case):
    """On the fast rule, in float64 (the LoRA layer without activation): the rank rescaling (``A``'s column
    k × c_k, ``B``'s row k / c_k), then the layer's output features × d_h (the frozen kernel's and ``B``'s
    columns for the kernel's last axis ``h``, the bias) and the head's matching input rows / d_h, leave
    every normalized sharpness unchanged; the factors', the frozen kernel's and the head's traces move
    (method §8)."""
    model, x, y, _ = _lora_model(case, activation=None)
    other, _, _, _ = _lora_model(case, activation=None)
    lora, head = other.get_layer("lora"), other.get_layer("head")
    table, a, b = _factor_variables(lora)
    rank = np.array([2.5, 0.3])
    a.assign(a.numpy() * rank)
    b.assign(b.numpy() / rank[:, None])
    features = np.array([0.5, 3.0, 1.5, 0.8, 2.0])[:int(b.shape[-1])]
    table.assign(table.numpy() * features)
    b.assign(b.numpy() * features)
    if getattr(lora, "bias", None) is not None:
        lora.bias.assign(lora.bias.numpy() * features)
    rows = np.tile(features, int(head.kernel.shape[0]) // features.size)  # (positions, features) flattened
    head.kernel.assign(head.kernel.numpy() / rows[:, None])
    np.testing.assert_allclose(np.asarray(other(x)), np.asarray(model(x)), rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, (x, y), loss="ce", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", progress=False)
    assert {layer.details["path"] for layer in after.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-10), lb.name
    for name in ("lora", "lora/lora_a", "lora/lora_b", "head"):
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name
