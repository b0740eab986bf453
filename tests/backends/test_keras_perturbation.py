"""The Keras ``PerturbationModel`` of the rival measures (method §10), against brute force in float64.

Every quantity is checked against a reference that shares nothing with the
implementation but the model: Keras' own cross-entropy on the model's logits, a
copy of the model whose kernels were moved by hand (the canonical deltas of
method §3 transposed to Keras' layouts by hand), per-sample gradients from a
plain ``GradientTape``, central differences, the explicit sum over the paths of
an MLP and a hand-folded CNN computed with numpy loops.
"""

from __future__ import annotations

import os
import threading

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras import perturbation_model  # noqa: E402
from normflat.engine.perturbation import PATH_NORM_SCOPE  # noqa: E402
from normflat.backends.keras.state import model_lock  # noqa: E402
from normflat.engine.options import NSCE_EPS, validate_options  # noqa: E402
from normflat.engine.perturbation import UnsupportedMeasureError  # noqa: E402

L = keras.layers
F64 = "float64"
RTOL = 1e-12


# ----------------------------------------------------------------------------- models and data


def mlp(seed=0, head_activation=None, hidden_activation="relu"):
    """4 -> 5 -> 6 -> 3, biases everywhere (two hidden layers: the path-norm brute force)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,), dtype=F64)
    h = L.Dense(5, activation=hidden_activation, bias_initializer="random_normal", dtype=F64, name="d1")(inp)
    h = L.Dense(6, activation="relu", bias_initializer="random_normal", dtype=F64, name="d2")(h)
    out = L.Dense(3, activation=head_activation, bias_initializer="random_normal", dtype=F64, name="head")(h)
    return keras.Model(inp, out, name="mlp")


def cnn(seed=0):
    """Conv2D -> BatchNorm (inference, non-trivial statistics) -> ReLU -> max-pool -> Dense."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((5, 5, 2), dtype=F64),
        L.Conv2D(3, 2, bias_initializer="random_normal", dtype=F64, name="conv"),  # 4x4x3
        L.BatchNormalization(epsilon=1e-3, dtype=F64, name="bn"),
        L.ReLU(dtype=F64, name="relu"),
        L.MaxPooling2D(2, dtype=F64, name="pool"),  # 2x2x3
        L.Flatten(dtype=F64, name="flat"),
        L.Dense(3, bias_initializer="random_normal", dtype=F64, name="head"),
    ], name="cnn")
    rng = np.random.default_rng(seed + 100)
    bn = model.get_layer("bn")
    bn.gamma.assign(rng.uniform(0.5, 1.5, 3))
    bn.beta.assign(rng.normal(size=3))
    bn.moving_mean.assign(rng.normal(size=3) * 0.3)
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 3))
    return model


def token_model(seed=0, vocab=7, classes=5):
    """Embedding -> Dense: token logits (n, T, C)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,), dtype="int32")
    h = L.Embedding(vocab, 3, dtype=F64, name="emb")(inp)
    out = L.Dense(classes, bias_initializer="random_normal", dtype=F64, name="head")(h)
    return keras.Model(inp, out, name="tokens")


def lstm_model(seed=0):
    """LSTM -> Dense: the recurrent kernels are reported one matrix per gate (blocks)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((3, 2), dtype=F64)
    h = L.LSTM(2, dtype=F64, name="lstm")(inp)
    return keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h), name="rnn")


def feature_data(model, sizes=(5, 3), classes=3, seed=0):
    """A list of ``(x, y)`` batches of the given sizes (several batches: data order and means)."""
    rng = np.random.default_rng(seed)
    shape = tuple(model.inputs[0].shape[1:])
    return [(rng.normal(size=(n, *shape)), rng.integers(0, classes, size=n)) for n in sizes]


def token_data(sizes=(3, 2), tokens=4, vocab=7, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        y = rng.integers(0, classes, size=(n, tokens))
        y[rng.random((n, tokens)) < 0.3] = -100  # ignore_index: not predictions
        y[0, 1] = 2  # at least one counted token per batch
        out.append((rng.integers(0, vocab, size=(n, tokens)).astype(np.int32), y))
    return out


def options(loss="nsce", **kw):
    return validate_options(loss=loss, progress=False, **kw)


# ----------------------------------------------------------------------------- hand references

#: Keras layout of a canonical (out, in, *kernel) delta, by layer kind (method §3), written by hand.
TO_KERAS = {
    "dense": lambda d: d.T,                                  # (out, in) -> (in, out)
    "embedding": lambda d: d.T,                              # (features, vocab) -> (vocab, features)
    "conv2d": lambda d: np.transpose(d, (2, 3, 1, 0)),       # (out, in, kh, kw) -> (kh, kw, in, out)
}


def moved_copy(model, kernels):
    """A copy of ``model`` with each named kernel moved: ``{layer name: keras-layout delta}``."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    for name, delta in kernels.items():
        layer = copy.get_layer(name)
        variable = layer.embeddings if isinstance(layer, L.Embedding) else layer.kernel
        variable.assign(variable.numpy() + delta)
    return copy


def keras_deltas(pm, deltas):
    return {name: TO_KERAS[kind](d) for name, kind, d in zip(pm.names, pm.kinds, deltas)}


def hand_losses(z, y, loss, temperature=1.0):
    """Per-prediction losses by Keras' own cross-entropy, on (normalized) logits; tokens flattened.

    Works on tensors (differentiable) and numpy arrays; ignored tokens (``y < 0``) dropped.
    """
    z = tf.reshape(tf.convert_to_tensor(z, tf.float64), [-1, int(z.shape[-1])])
    y = np.asarray(y).reshape(-1)
    keep = np.flatnonzero(y >= 0)
    z, y = tf.gather(z, keep), y[keep]
    if loss == "nsce":
        zc = z - tf.reduce_mean(z, axis=-1, keepdims=True)
        sigma = tf.sqrt(tf.reduce_mean(zc * zc, axis=-1, keepdims=True) + NSCE_EPS)
        z = temperature * zc / sigma
    return keras.losses.sparse_categorical_crossentropy(y, z, from_logits=True)


def hand_correct(z, y):
    z = np.asarray(z).reshape(-1, z.shape[-1])
    y = np.asarray(y).reshape(-1)
    return (z.argmax(-1) == y)[y >= 0]


def hand_eval(model, data, loss):
    losses, correct = [], []
    for x, y in data:
        z = model(x, training=False).numpy()
        losses.append(hand_losses(z, y, loss).numpy())
        correct.append(hand_correct(z, y))
    return np.concatenate(losses), np.concatenate(correct)


def random_deltas(pm, scale=0.1, seed=3):
    rng = np.random.default_rng(seed)
    return [scale * rng.normal(size=w.shape) for w in pm.weights()]


def snapshot(model, data=None):
    """What must not change: every variable's value and flags, and the layers' instance attributes.

    Taken after one plain inference call of the model: Keras itself creates a few
    instance attributes on a layer's first call (a recurrent cell's ``_dropout_mask``),
    which are not the measures' doing.
    """
    if data is not None:
        model(data[0][0], training=False)
    values = [(v.path, v.numpy().copy(), v.trainable) for v in model.weights]
    layers = [(layer.name, layer.trainable, sorted(layer.__dict__),
               layer.__dict__.get("call"), layer.__dict__.get("activation"))
              for layer in [model, *model._flatten_layers(include_self=False)]]
    return values, layers


def assert_unchanged(model, before):
    values, layers = snapshot(model)
    assert [(p, t) for p, _, t in values] == [(p, t) for p, _, t in before[0]]
    for (_, now, _), (_, then, _) in zip(values, before[0]):
        np.testing.assert_array_equal(now, then)
    assert layers == before[1]
    # The model's lock is free: another thread can take it at once.
    taken = []

    def try_lock():
        lock = model_lock(model)
        taken.append(lock.acquire(blocking=False))
        if taken[-1]:
            lock.release()

    thread = threading.Thread(target=try_lock)
    thread.start()
    thread.join()
    assert taken == [True]


# ----------------------------------------------------------------------------- names and kinds


@pytest.mark.parametrize("build,estimator", [(mlp, "exact"), (cnn, "exact"), (token_model, "exact"),
                                             (lstm_model, "ggn")])  # the LSTM's exact Hessian is slow
def test_names_and_kinds_are_the_reports(build, estimator):
    model = build()
    # One batch: each batch shape costs the analysis another trace of its compiled steps.
    batches = token_data(sizes=(3,)) if build is token_model else feature_data(model, sizes=(4,))
    report = normflat.analyze(model, batches, estimator=estimator, progress=False)
    pm = perturbation_model(model, batches, options())
    assert pm.names == [layer.name for layer in report.layers]
    assert pm.kinds == [layer.kind for layer in report.layers]
    weights = pm.weights()
    assert [w.dtype for w in weights] == [np.float64] * len(weights)
    assert [w.shape for w in weights] == [tuple(layer.shape) for layer in report.layers]
    if build is not lstm_model:  # (the gate blocks' rows: test_packed_recurrent_blocks_...)
        for w, name, kind in zip(weights, pm.names, pm.kinds):
            layer = model.get_layer(name)
            variable = layer.embeddings if isinstance(layer, L.Embedding) else layer.kernel
            np.testing.assert_array_equal(TO_KERAS[kind](w), variable.numpy())
    pm.close()


# ----------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("build", [mlp, cnn])
def test_evaluate_matches_keras_cross_entropy_and_a_moved_copy(build, loss):
    model = build()
    data = feature_data(model)
    before = snapshot(model, data)
    pm = perturbation_model(model, data, options(loss), chunk_size=2)  # chunks inside the batches
    losses, correct = pm.evaluate(None)
    ref_losses, ref_correct = hand_eval(model, data, loss)
    assert losses.dtype == np.float64 and correct.dtype == bool and losses.shape == (8,)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    np.testing.assert_array_equal(correct, ref_correct)

    deltas = random_deltas(pm)
    moved_losses, moved_correct = pm.evaluate(deltas)
    copy = moved_copy(model, keras_deltas(pm, deltas))
    ref_losses, ref_correct = hand_eval(copy, data, loss)
    np.testing.assert_allclose(moved_losses, ref_losses, rtol=RTOL)
    np.testing.assert_array_equal(moved_correct, ref_correct)
    assert not np.allclose(moved_losses, losses)  # the deltas did move the loss
    pm.close()
    assert_unchanged(model, before)


def test_evaluate_token_logits_ignore_index_and_shift():
    model, data = token_model(), token_data()
    pm = perturbation_model(model, data, options("ce"))
    losses, correct = pm.evaluate(None)
    ref_losses, ref_correct = hand_eval(model, data, "ce")
    assert losses.shape == (sum(int((y >= 0).sum()) for _, y in data),)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    np.testing.assert_array_equal(correct, ref_correct)

    deltas = random_deltas(pm)
    copy = moved_copy(model, keras_deltas(pm, deltas))
    np.testing.assert_allclose(pm.evaluate(deltas)[0], hand_eval(copy, data, "ce")[0], rtol=RTOL)

    shifted = perturbation_model(model, data, options("nsce", shift_labels=True))
    # Logits at t predict the label at t + 1; the last position predicts nothing.
    moved = [(x, np.concatenate([y[:, 1:], np.full((len(y), 1), -100)], 1)) for x, y in data]
    np.testing.assert_allclose(shifted.evaluate(None)[0], hand_eval(model, moved, "nsce")[0], rtol=RTOL)


def test_output_selection_and_stripped_softmax():
    """``output=`` picks the logits of a multi-output model; a final softmax is measured as logits."""
    plain = mlp()
    data = feature_data(plain)
    soft = mlp(head_activation="softmax")
    soft.set_weights(plain.get_weights())
    ref = perturbation_model(plain, data, options()).evaluate(None)[0]
    np.testing.assert_allclose(perturbation_model(soft, data, options()).evaluate(None)[0], ref, rtol=RTOL)
    both = keras.Model(plain.inputs, {"aux": plain.get_layer("d2").output, "logits": plain.outputs[0]})
    np.testing.assert_allclose(perturbation_model(both, data, options(output="logits")).evaluate(None)[0], ref,
                               rtol=RTOL)


# ----------------------------------------------------------------------------- gradient


def autodiff_gradient(copy, names, kinds, data, loss):
    """Mean loss of ``copy`` over all predictions and its gradient, canonical, by GradientTape."""
    variables = []
    for name in names:
        layer = copy.get_layer(name)
        variables.append(layer.embeddings if isinstance(layer, L.Embedding) else layer.kernel)
    with tf.GradientTape() as tape:
        per = [hand_losses(copy(x, training=False), y, loss) for x, y in data]
        mean = tf.reduce_mean(tf.concat(per, 0))
    grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(mean, variables)]
    # Back to the canonical layout (the inverse maps of TO_KERAS).
    canonical = [g.T if kind in ("dense", "embedding") else np.transpose(g, (3, 2, 0, 1))
                 for g, kind in zip(grads, kinds)]
    return float(mean), canonical


@pytest.mark.parametrize("build,loss", [(mlp, "nsce"), (cnn, "ce"), (token_model, "nsce")])
def test_gradient_matches_autodiff_of_a_moved_copy_and_finite_differences(build, loss):
    model = build()
    data = token_data() if build is token_model else feature_data(model)
    before = snapshot(model, data)
    pm = perturbation_model(model, data, options(loss))
    deltas = random_deltas(pm)
    mean, grads = pm.gradient(deltas)
    copy = moved_copy(model, keras_deltas(pm, deltas))
    ref_mean, ref_grads = autodiff_gradient(copy, pm.names, pm.kinds, data, loss)
    np.testing.assert_allclose(mean, ref_mean, rtol=RTOL)
    assert [g.shape for g in grads] == [w.shape for w in pm.weights()]
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(mean, pm.evaluate(deltas)[0].mean(), rtol=RTOL)

    # Central differences of the mean loss in three single entries.
    h = 1e-5
    rng = np.random.default_rng(7)
    for layer in (0, len(grads) - 1, len(grads) - 1):
        index = tuple(int(rng.integers(0, s)) for s in grads[layer].shape)
        if grads[layer][index] == 0:  # an unused embedding row: look elsewhere
            index = np.unravel_index(np.argmax(np.abs(grads[layer])), grads[layer].shape)
        up = [d.copy() for d in deltas]
        down = [d.copy() for d in deltas]
        up[layer][index] += h
        down[layer][index] -= h
        fd = (pm.evaluate(up)[0].mean() - pm.evaluate(down)[0].mean()) / (2 * h)
        np.testing.assert_allclose(grads[layer][index], fd, rtol=1e-6)
    pm.close()
    assert_unchanged(model, before)


def test_packed_recurrent_blocks_are_perturbed_as_their_rows():
    """An LSTM's gate blocks: deltas assembled into the packed kernel, the gradient split back."""
    model = lstm_model()
    data = feature_data(model, sizes=(4,))
    pm = perturbation_model(model, data, options("ce"))
    deltas = random_deltas(pm, scale=0.2)
    cell = model.get_layer("lstm").cell
    blocks = {name: d for name, d in zip(pm.names, deltas)}
    gates = "ifco"
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    copy_cell = copy.get_layer("lstm").cell
    for part, variable in (("kernel", copy_cell.kernel), ("recurrent_kernel", copy_cell.recurrent_kernel)):
        # Canonical (4H, in): the gates' rows stacked in Keras' gate order; Keras stores its transpose.
        packed = np.concatenate([blocks[f"lstm/lstm_cell/{part}.{g}"] for g in gates], 0)
        variable.assign(variable.numpy() + packed.T)
    copy.get_layer("head").kernel.assign(copy.get_layer("head").kernel.numpy() + blocks["head"].T)
    np.testing.assert_allclose(pm.evaluate(deltas)[0], hand_eval(copy, data, "ce")[0], rtol=RTOL)

    mean, grads = pm.gradient(deltas)
    variables = [copy.get_layer("lstm").cell.kernel, copy.get_layer("lstm").cell.recurrent_kernel]
    with tf.GradientTape() as tape:
        ref = tf.reduce_mean(tf.concat([hand_losses(copy(x, training=False), y, "ce") for x, y in data], 0))
    kernel, recurrent = (g.numpy().T for g in tape.gradient(ref, variables))
    hidden = int(cell.units)
    for k, g in enumerate(gates):
        rows = slice(k * hidden, (k + 1) * hidden)
        np.testing.assert_allclose(grads[pm.names.index(f"lstm/lstm_cell/kernel.{g}")], kernel[rows], rtol=1e-10)
        np.testing.assert_allclose(grads[pm.names.index(f"lstm/lstm_cell/recurrent_kernel.{g}")], recurrent[rows],
                                   rtol=1e-10)
    np.testing.assert_allclose(mean, float(ref), rtol=RTOL)


def test_bad_deltas_name_the_layer():
    model = mlp()
    pm = perturbation_model(model, feature_data(model), options())
    with pytest.raises(ValueError, match="list of 3 arrays"):
        pm.evaluate(random_deltas(pm)[:2])
    bad = random_deltas(pm)
    bad[1] = bad[1].T
    with pytest.raises(ValueError, match="'d2'.*canonical"):
        pm.gradient(bad)
    with pytest.raises(TypeError, match="Unknown Keras backend option"):
        perturbation_model(model, feature_data(model), options(), memory_budgett="1GB")
    # analyze's options are accepted (measures() passes one set to both) and checked the same way.
    perturbation_model(model, feature_data(model), options(), memory_budget="1GB").close()
    with pytest.raises(ValueError):
        perturbation_model(model, feature_data(model), options(), chunk_size=0)
    pm.close()
    with pytest.raises(RuntimeError, match="closed"):
        pm.evaluate(None)


# ----------------------------------------------------------------------------- weight derivatives


def brute_weight_derivatives(model, names, data, loss):
    """Per prediction: its own loss gradient, by a GradientTape per prediction, dotted with W."""
    variables = []
    for name in names:
        layer = model.get_layer(name)
        variables.append(layer.embeddings if isinstance(layer, L.Embedding) else layer.kernel)
    out = []
    for x, y in data:
        for i in range(len(x)):
            yi = np.asarray(y[i:i + 1])
            for t in np.flatnonzero(yi.reshape(-1) >= 0):
                only = np.full(yi.size, -100)
                only[t] = yi.reshape(-1)[t]
                with tf.GradientTape() as tape:
                    value = hand_losses(model(x[i:i + 1], training=False), only.reshape(yi.shape), loss)[0]
                grads = tape.gradient(value, variables)
                out.append(sum(float(np.sum(tf.convert_to_tensor(g).numpy() * v.numpy()))
                               for g, v in zip(grads, variables)))
    return np.array(out)


@pytest.mark.parametrize("build,loss", [(mlp, "nsce"), (cnn, "ce"), (token_model, "ce"), (lstm_model, "nsce")])
def test_weight_derivatives_match_per_sample_gradients(build, loss):
    model = build()
    data = token_data() if build is token_model else feature_data(model)
    before = snapshot(model, data)
    pm = perturbation_model(model, data, options(loss), chunk_size=3)
    got = pm.weight_derivatives()
    ref = brute_weight_derivatives(model, pm.names if build is not lstm_model else ["head"], data, loss)
    if build is lstm_model:  # the packed kernels: <W, grad> over the whole variables
        cell = model.get_layer("lstm").cell
        extra = []
        for x, y in data:
            for i in range(len(x)):
                with tf.GradientTape() as tape:
                    value = hand_losses(model(x[i:i + 1], training=False), y[i:i + 1], loss)[0]
                grads = tape.gradient(value, [cell.kernel, cell.recurrent_kernel])
                extra.append(sum(float(np.sum(g.numpy() * v.numpy()))
                                 for g, v in zip(grads, [cell.kernel, cell.recurrent_kernel])))
        ref = ref + np.array(extra)
    assert got.dtype == np.float64 and got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-8, atol=1e-13)
    # The same as d/dt loss_i(W (1 + t)) at 0: a central difference through evaluate.
    t = 1e-5
    up = pm.evaluate([w * t for w in pm.weights()])[0]
    down = pm.evaluate([-w * t for w in pm.weights()])[0]
    np.testing.assert_allclose(got, (up - down) / (2 * t), rtol=1e-5, atol=1e-9)
    pm.close()
    assert_unchanged(model, before)


# ----------------------------------------------------------------------------- squared output


def test_squared_output_is_the_sum_over_the_paths_of_an_mlp():
    model = mlp()
    data = feature_data(model)
    before = snapshot(model, data)
    w1, b1, w2, b2, w3, b3 = (v.numpy() for v in model.weights)  # kernels (in, out)
    paths = 0.0
    for i, j, k, o in np.ndindex(w1.shape[0], w1.shape[1], w2.shape[1], w3.shape[1]):
        paths += w1[i, j] ** 2 * w2[j, k] ** 2 * w3[k, o] ** 2  # input i -> j -> k -> output o
    for j, k, o in np.ndindex(w2.shape[0], w2.shape[1], w3.shape[1]):
        paths += b1[j] ** 2 * w2[j, k] ** 2 * w3[k, o] ** 2  # from the first layer's bias
    for k, o in np.ndindex(w3.shape[0], w3.shape[1]):
        paths += b2[k] ** 2 * w3[k, o] ** 2
    paths += float(np.sum(b3 ** 2))
    pm = perturbation_model(model, data, options())
    np.testing.assert_allclose(pm.squared_output(), paths, rtol=RTOL)
    pm.close()
    assert_unchanged(model, before)


def test_squared_output_of_a_cnn_with_folded_batch_norm():
    model = cnn()
    data = feature_data(model)
    before = snapshot(model, data)
    conv, bn, head = model.get_layer("conv"), model.get_layer("bn"), model.get_layer("head")
    kernel, bias = conv.kernel.numpy() ** 2, conv.bias.numpy() ** 2  # (2, 2, in, out)
    x = np.ones((5, 5, 2))
    h = np.zeros((4, 4, 3))
    for r, c, o in np.ndindex(4, 4, 3):
        h[r, c, o] = np.sum(x[r:r + 2, c:c + 2, :] * kernel[:, :, :, o]) + bias[o]
    a = bn.gamma.numpy() / np.sqrt(bn.moving_variance.numpy() + bn.epsilon)
    b = bn.beta.numpy() - a * bn.moving_mean.numpy()
    h = h * a ** 2 + b ** 2  # folded, squared; every value >= 0, so the ReLU passes it
    pooled = np.array([[[h[2 * r:2 * r + 2, 2 * c:2 * c + 2, o].max() for o in range(3)] for c in range(2)]
                       for r in range(2)])
    out = pooled.reshape(-1) @ head.kernel.numpy() ** 2 + head.bias.numpy() ** 2
    pm = perturbation_model(model, data, options())
    np.testing.assert_allclose(pm.squared_output(), out.sum(), rtol=RTOL)
    pm.close()
    assert_unchanged(model, before)


def test_squared_output_refuses_other_layers():
    tanh = mlp(hidden_activation="tanh")
    pm = perturbation_model(tanh, feature_data(tanh), options())
    with pytest.raises(UnsupportedMeasureError) as err:
        pm.squared_output()
    assert "'d1'" in str(err.value) and "Dense" in str(err.value) and "tanh" in str(err.value)
    assert PATH_NORM_SCOPE in str(err.value)

    keras.utils.set_random_seed(0)
    inp = keras.Input((4,), dtype=F64)
    h = L.LayerNormalization(dtype=F64, name="norm")(L.Dense(5, dtype=F64, name="d1")(inp))
    normed = keras.Model(inp, L.Dense(3, dtype=F64, name="head")(h))
    before = snapshot(normed, feature_data(normed))
    pm = perturbation_model(normed, feature_data(normed), options())
    with pytest.raises(UnsupportedMeasureError, match=r"'norm' \(LayerNormalization\): path_norm is defined"):
        pm.squared_output()
    assert_unchanged(normed, before)

    tokens = token_model()
    with pytest.raises(UnsupportedMeasureError, match=r"'emb' \(Embedding\)"):
        perturbation_model(tokens, token_data(), options()).squared_output()
