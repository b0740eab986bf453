"""Batches of token sequences of other lengths in one analysis (a collator that pads each batch to
its own longest sequence), the same in every framework.

The model is one token model built with the same float64 weights in PyTorch, Keras and flax nnx
(an embedding, tanh, a dense head: token logits ``(n, T, C)``), fed a batch of 5 tokens and a batch
of 9, with ignored tokens. The mean loss is over the counted tokens of both (method §6.3), so the
diagonal over both batches is the counted-token-weighted mean of each batch's own diagonal. Until
the JAX backend traced a program per input shape, JAX refused the second batch, reading the first
batch's 5 tokens as the model's output ("9 token labels per sample but the model returns logits for
5 tokens"); PyTorch and Keras took it.
"""

from __future__ import annotations

import numpy as np
import pytest

import normflat
from tests.builders import require_frameworks

V, D, C = 7, 4, 6
FRAMEWORKS = ("torch", "keras", "jax")
RNG = np.random.default_rng(31)
TABLE = RNG.normal(size=(V, D))
KERNEL = RNG.normal(size=(D, C))  # the head as x @ KERNEL + BIAS
BIAS = RNG.normal(size=C) * 0.1
SHORT, LONG = RNG.integers(0, V, size=(4, 5)), RNG.integers(0, V, size=(3, 9))
SHORT_Y, LONG_Y = RNG.integers(0, C, size=(4, 5)), RNG.integers(0, C, size=(3, 9))
SHORT_Y[0, 3:] = LONG_Y[1, 6:] = LONG_Y[2, 8:] = -100  # padding: ignored tokens
COUNTS = (int((SHORT_Y >= 0).sum()), int((LONG_Y >= 0).sum()))
TABLE_NAME = {"torch": "0", "keras": "embedding", "jax": "emb"}
HEAD_NAME = {"torch": "2", "keras": "dense", "jax": "head"}


def _model(framework):
    """The token model with the module's weights, in ``framework``."""
    if framework == "torch":
        require_frameworks("torch")
        import torch

        model = torch.nn.Sequential(torch.nn.Embedding(V, D), torch.nn.Tanh(), torch.nn.Linear(D, C)).double()
        with torch.no_grad():
            model[0].weight.copy_(torch.from_numpy(TABLE))
            model[2].weight.copy_(torch.from_numpy(KERNEL.T))
            model[2].bias.copy_(torch.from_numpy(BIAS))
        return model
    if framework == "keras":
        require_frameworks("keras", "tensorflow")
        import keras

        model = keras.Sequential([keras.Input((None,), dtype="int32"),
                                  keras.layers.Embedding(V, D, dtype="float64", name="embedding"),
                                  keras.layers.Activation("tanh", dtype="float64"),
                                  keras.layers.Dense(C, dtype="float64", name="dense")])
        model.get_layer("embedding").set_weights([TABLE])
        model.get_layer("dense").set_weights([KERNEL, BIAS])
        return model
    require_frameworks("jax", "flax")
    import jax
    import jax.numpy as jnp
    from flax import nnx

    jax.config.update("jax_enable_x64", True)

    class Tokens(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.emb = nnx.Embed(V, D, param_dtype=jnp.float64, rngs=rngs)
            self.head = nnx.Linear(D, C, param_dtype=jnp.float64, rngs=rngs)

        def __call__(self, ids):
            return self.head(jnp.tanh(self.emb(ids)))

    model = Tokens()
    model.emb.embedding[...] = jnp.asarray(TABLE)
    model.head.kernel[...] = jnp.asarray(KERNEL)
    model.head.bias[...] = jnp.asarray(BIAS)
    return model


def _data(framework, pairs):
    if framework == "torch":
        import torch

        return [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in pairs]
    return list(pairs)


def _diagonals(framework, model, pairs, **kw):
    out = normflat.hessian_diagonal(model, _data(framework, pairs), shift_labels=False, progress=False, **kw)
    return {kind: np.asarray(out[names[framework]], dtype=np.float64)
            for kind, names in (("table", TABLE_NAME), ("head", HEAD_NAME))}


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_batches_of_other_lengths_weigh_their_counted_tokens(framework, estimator):
    """Over a batch of 5 tokens and one of 9: the diagonal is the counted-token-weighted mean of the
    two batches' own diagonals, each layer on its fast path, in every framework."""
    model = _model(framework)
    both = _diagonals(framework, model, [(SHORT, SHORT_Y), (LONG, LONG_Y)], estimator=estimator)
    short = _diagonals(framework, model, [(SHORT, SHORT_Y)], estimator=estimator)
    long = _diagonals(framework, model, [(LONG, LONG_Y)], estimator=estimator)
    for kind in both:
        expected = (COUNTS[0] * short[kind] + COUNTS[1] * long[kind]) / sum(COUNTS)
        np.testing.assert_allclose(both[kind], expected, rtol=1e-10, atol=1e-14, err_msg=kind)
        assert np.all(np.abs(short[kind] - long[kind]) > 0)  # the second batch counts: not a repeat
    report = normflat.analyze(model, _data(framework, [(SHORT, SHORT_Y), (LONG, LONG_Y)]), shift_labels=False,
                              estimator=estimator, progress=False)
    assert report.metadata["loss_terms"] == sum(COUNTS)
    for name in (TABLE_NAME[framework], HEAD_NAME[framework]):
        assert report.layer(name).details["path"] == ("fast" if estimator == "ggn" else "hvp"), name


def test_every_framework_gives_the_same_numbers_over_both_lengths():
    """The same weights and data: the same diagonals (``ggn``) and the same measures of
    ``normflat.measures`` over both batches in PyTorch, Keras and JAX."""
    pairs = [(SHORT, SHORT_Y), (LONG, LONG_Y)]
    diagonals, measures = {}, {}
    for framework in FRAMEWORKS:
        model = _model(framework)
        diagonals[framework] = _diagonals(framework, model, pairs, estimator="ggn")
        result = normflat.measures(model, _data(framework, pairs), ["fisher_rao_norm", "adaptive_sharpness"],
                                   loss="ce", shift_labels=False, progress=False)
        assert result.metadata["predictions"] == sum(COUNTS), framework
        measures[framework] = {name: result[name] for name in ("fisher_rao_norm", "adaptive_sharpness")}
    for framework in FRAMEWORKS[1:]:
        for kind in ("table", "head"):
            np.testing.assert_allclose(diagonals[framework][kind], diagonals["torch"][kind], rtol=1e-9,
                                       err_msg=(framework, kind))
        for name, value in measures[framework].items():
            assert value == pytest.approx(measures["torch"][name], rel=1e-6), (framework, name)
