"""Benchmark: normflat's GGN diagonal in Keras/TensorFlow against one gradient, next to PyTorch.

Problems (float32, random data, 10 classes), the same as ``benchmarks/torch_diag.py``:

* ``mlp``: 784-512-256-10 ReLU MLP, batch 128;
* ``3c3d``: the DeepOBS 3C3D CIFAR-10 CNN (three conv + max-pool blocks, two
  hidden dense layers), batch 32 (NHWC in Keras).

Methods, all with ``loss="ce"``: one gradient of the mean cross-entropy with
respect to all trainable variables (a ``tf.function``-compiled
``GradientTape``, as in ``model.fit`` without the optimizer step), normflat
``estimator="ggn"`` and ``"ggn-mc"`` (one sample) through the public
``normflat.hessian_diagonal``. Times are medians of ``repeats`` rounds after a
warm-up (which also traces the compiled functions); the methods alternate
within each round. Results are reported as multiples of one gradient, next to
the PyTorch figures measured in the same run by
``benchmarks.torch_diag.torch_figures``.

``--position-table`` times instead a tiny ViT (a custom layer adding a learned
``(1, 17, 64)`` position table to a class token and 16 patch embeddings, one MLP
block, batch 32): ``ggn`` with the table on its fast rule (method §6.1 "Position
tables") and on the generic path (:func:`position_table_figures`).

``--tied-lm`` times a tiny language model whose head is its token embedding (a
``ReversibleEmbedding`` of 1000 ids and 64 features, ``tie_weights=True``, one
causal attention block and one MLP block, 16 sequences of 16 tokens):
``ggn-topk`` per sequence (``auto`` for token logits) with the table on its fast
rule (method §6.1 "Tied weights") and on the generic path (:func:`tied_lm_figures`).

``--sequence-lm V`` times a small language model with its own head (an ``Embedding`` of ``V``
ids and 64 features, a residual MLP block of 128 hidden units, a ``Dense`` head of ``V``
token logits, 4 sequences of 64 tokens): ``ggn-topk`` per sequence (``auto`` for token
logits) against one gradient (:func:`sequence_lm_figures`); with ``--memory`` also the peak of
TensorFlow's CPU allocations of a training step, ``hessian_diagonal`` and ``analyze``, each in a
fresh process (:func:`sequence_lm_memory`).

``--recurrent`` times three sequence classifiers (a 2000-token ``Embedding`` of width 64, one
``LSTM``, ``GRU`` or ``SimpleRNN`` of 128 units, the last step's state into a 10-class head; 32
sequences of 32 tokens), the problems of ``benchmarks.classes``' ``lstm-10``/``gru-10``: ``ggn``
(the recurrent weights on their fast rule, method §6.1 "Recurrent weights"), ``ggn-mc`` and
``ggn`` with ``fast=False`` (every weight on the generic path) against one gradient
(:func:`recurrent_figures`); with ``--memory`` also the peaks of a training step,
``hessian_diagonal`` and ``analyze`` (:func:`recurrent_memory`).

``--albert`` times keras-hub's ALBERT (a 2000-token vocabulary, embeddings of 64, width 128, 4 layers
that are one shared transformer layer called 4 times, a 10-class head on the pooled output; 16
sequences of 32 tokens): ``ggn`` against one gradient (:func:`albert_figures`); each of the shared
layer's ``EinsumDense``/``Dense`` weights is called 4 times per forward.

``--llama`` times keras-hub's Llama causal LM (2 layers of width 64, MLP 256, a 5000-token vocabulary
and its untied output projection, 4 sequences of 32 tokens with next-token labels): ``auto``
(``ggn-topk`` per sequence) against one gradient (:func:`llama_figures`).

``--decoder`` times a convolutional encoder-decoder classifier (two strided ``Conv2D`` layers, two
``Conv2DTranspose`` layers, 32×32 inputs, 16 images, 10 classes): ``ggn`` on the transposed
convolutions' fast rule and on the generic path against one gradient (:func:`decoder_figures`).

``--text-cnn`` times a 1-D convolutional text classifier (an embedding, three ``Conv1D`` layers, two
``MaxPooling1D``, 32 sequences of 128 tokens, 10 classes): ``ggn`` as it runs and with TensorFlow's own
max-pooling gradient in its step, against one gradient (:func:`text_cnn_figures`).

``--separable`` times Keras' Xception (``keras.applications``, ``weights=None``, 71×71 inputs,
10 classes, 8 images), whose blocks are ``SeparableConv2D`` layers: ``ggn`` against one gradient
(:func:`separable_figures`).

Run::

    python -m benchmarks.keras_diag [--repeats 5] [--threads 1] [--no-torch]
    python -m benchmarks.keras_diag --position-table [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --tied-lm [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --sequence-lm 8000 [--repeats 5] [--threads 1] [--memory]
    python -m benchmarks.keras_diag --separable [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --decoder [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --text-cnn [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --recurrent [--repeats 5] [--threads 1] [--memory]
    python -m benchmarks.keras_diag --albert [--repeats 5] [--threads 1]
    python -m benchmarks.keras_diag --llama [--repeats 5] [--threads 1]

``--threads N`` limits both frameworks to N CPU threads (TensorFlow intra- and
inter-op pools, ``torch.set_num_threads``): on a shared machine one thread
gives the most stable multiples.

Grouped and depthwise convolutions on a real model (Keras ConvNeXt-Tiny next to
PyTorch's ``convnext_tiny``) are timed by ``benchmarks/convnext.py``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
from benchmarks._common import time_interleaved  # noqa: E402

__all__ = ["mlp", "cnn_3c3d", "PROBLEMS", "METHODS", "make_problem", "keras_figures", "position_table_figures",
           "tied_lm_figures", "separable_figures", "text_cnn_figures", "recurrent_figures", "recurrent_memory", "albert_figures", "llama_figures", "main"]

METHODS = ("gradient", "normflat_ggn", "normflat_ggn_mc")


def mlp():
    """784-512-256-10 ReLU MLP on 28x28x1 images."""
    import keras

    L = keras.layers
    return keras.Sequential([keras.Input((28, 28, 1)), L.Flatten(), L.Dense(512, activation="relu"),
                             L.Dense(256, activation="relu"), L.Dense(10)], name="mlp")


def cnn_3c3d():
    """DeepOBS 3C3D CIFAR-10 network, NHWC."""
    import keras

    L = keras.layers
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        L.Conv2D(64, 5, activation="relu"), L.MaxPooling2D(3, strides=2, padding="same"),
        L.Conv2D(96, 3, activation="relu"), L.MaxPooling2D(3, strides=2, padding="same"),
        L.Conv2D(128, 3, padding="same", activation="relu"), L.MaxPooling2D(3, strides=2, padding="same"),
        L.Flatten(), L.Dense(512, activation="relu"), L.Dense(256, activation="relu"), L.Dense(10),
    ], name="3c3d")


#: name -> (model factory, input shape with batch axis)
PROBLEMS: dict[str, tuple[Callable[[], Any], tuple[int, ...]]] = {
    "mlp": (mlp, (128, 28, 28, 1)),
    "3c3d": (cnn_3c3d, (32, 32, 32, 3)),
}


def make_problem(name: str, seed: int = 0):
    """Model (float32) and one batch ``(x, y)`` as tensors."""
    import keras
    import tensorflow as tf

    factory, shape = PROBLEMS[name]
    keras.utils.set_random_seed(seed)
    model = factory()
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=shape).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=shape[0]))
    return model, x, y


def _runner(method: str, model, x, y) -> Callable[[], Any]:
    import tensorflow as tf

    import normflat

    if method == "gradient":
        variables = model.trainable_variables

        @tf.function
        def gradient(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=False)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            return tape.gradient(loss, variables)

        def run():
            # .numpy(): wait for the result (an embedding's sparse gradient: its values, not densified)
            return [(g.values if isinstance(g, tf.IndexedSlices) else g).numpy() for g in gradient(x, y)][-1]
        return run
    estimator = {"normflat_ggn": "ggn", "normflat_ggn_mc": "ggn-mc"}[method]

    def run():
        # One (x, y) pair is one batch; the chunk size is chosen automatically.
        out = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator, progress=False)
        return [v.numpy() for v in out.values()]
    return run


def keras_figures(repeats: int = 5, problems: tuple[str, ...] = tuple(PROBLEMS)) -> dict[str, dict[str, Any]]:
    """``{problem: {"seconds": {method: s}, "x_gradient": {method: multiple of one gradient}}}``."""
    out: dict[str, dict[str, Any]] = {}
    for name in problems:
        model, x, y = make_problem(name)
        seconds = time_interleaved({m: _runner(m, model, x, y) for m in METHODS}, repeats)
        out[name] = {"seconds": seconds, "x_gradient": {m: seconds[m] / seconds["gradient"] for m in METHODS}}
    return out


def _tiny_vit(generic: bool):
    """16 patches of 48 features -> Dense 64, a custom layer adding a class token and a (1, 17, 64)
    position table, one residual MLP block (128 hidden units), the class token's head (10 classes).

    ``generic``: the layer holds its table in a list rather than an attribute of its own, which
    sends the table to the generic path (no attribute to set to the expanded view) and changes
    nothing else.
    """
    import keras
    import tensorflow as tf

    L = keras.layers

    class Tokens(L.Layer):
        def build(self, input_shape):
            self.cls_token = self.add_weight(shape=(1, 1, 64), initializer="zeros", name="cls_token")
            table = self.add_weight(shape=(1, 17, 64), initializer="random_normal", name="pos_embed")
            if generic:
                self.tables = [table]
            else:
                self.pos_embed = table

        def call(self, h):
            table = self.tables[0] if generic else self.pos_embed
            cls = tf.broadcast_to(self.cls_token, [tf.shape(h)[0], 1, 64])
            return tf.concat([cls, h], axis=1) + table

    keras.utils.set_random_seed(0)
    inp = keras.Input((16, 48))
    h = Tokens(name="tokens")(L.Dense(64, name="patch")(inp))
    h = L.Add()([h, L.Dense(64, name="down")(L.Dense(128, activation="gelu", name="up")(h))])
    return keras.Model(inp, L.Dense(10, name="head")(h[:, 0]))


def position_table_figures(repeats: int = 5) -> dict[str, float]:
    """Seconds of ``ggn`` on a tiny ViT (batch 32) with the position table on its fast rule and on
    the generic path (:func:`_tiny_vit`), the other layers fast in both, and their ratio."""
    import tensorflow as tf

    import normflat

    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(32, 16, 48)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=32))
    runs = {}
    for name in ("fast", "generic"):
        model = _tiny_vit(name == "generic")

        def run(model=model):
            return [v.numpy() for v in normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn",
                                                                 progress=False).values()]
        runs[name] = run
    seconds = time_interleaved(runs, repeats)
    return {**seconds, "generic_over_fast": seconds["generic"] / seconds["fast"]}


def _tiny_tied_lm(generic: bool):
    """Ids (16 tokens) -> a tied ``ReversibleEmbedding`` (1000 ids, 64 features) -> a causal 2-head
    attention block and an MLP block (128 hidden units), each residual -> the reverse projection.

    ``generic``: the embedding is a subclass with its own ``call`` (the same numbers), which sends the
    table to the generic path and changes nothing else.
    """
    import keras

    L = keras.layers

    class OwnCall(L.ReversibleEmbedding):
        def call(self, inputs, reverse=False):
            return super().call(inputs, reverse=reverse)

    keras.utils.set_random_seed(0)
    emb = (OwnCall if generic else L.ReversibleEmbedding)(1000, 64, tie_weights=True, name="emb")
    ids = keras.Input((16,), dtype="int32")
    h = emb(ids)
    h = L.Add()([h, L.MultiHeadAttention(2, 32, name="attn")(h, h, use_causal_mask=True)])
    h = L.Add()([h, L.Dense(64, name="down")(L.Dense(128, activation="gelu", name="up")(h))])
    return keras.Model(ids, emb(h, reverse=True))


def tied_lm_figures(repeats: int = 5) -> dict[str, float]:
    """Seconds of ``ggn-topk`` (per sequence) on a tiny tied LM (:func:`_tiny_tied_lm`, 16 sequences)
    with the table on its fast rule and on the generic path, the other layers fast in both, and their
    ratio."""
    import tensorflow as tf

    import normflat

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, size=(16, 16)).astype("int32")
    data = (tf.constant(ids), tf.constant(np.concatenate([ids[:, 1:], np.full((16, 1), -100)], axis=1)))
    runs = {}
    for name in ("fast", "generic"):
        model = _tiny_tied_lm(name == "generic")
        report = normflat.analyze(model, data, loss="ce", estimator="ggn-topk", progress=False)
        assert report.layer("emb").details["path"] == name, report.layer("emb").details

        def run(model=model):
            return [v.numpy() for v in normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn-topk",
                                                                 progress=False).values()]
        runs[name] = run
    seconds = time_interleaved(runs, repeats)
    return {**seconds, "generic_over_fast": seconds["generic"] / seconds["fast"]}


def _sequence_lm(vocabulary: int):
    """Ids (64 tokens) -> an ``Embedding`` (``vocabulary`` ids, 64 features) -> a residual MLP block
    (128 hidden units) -> a ``Dense`` head: token logits ``(n, 64, vocabulary)``; and 4 sequences
    with their next-token labels (the last one ignored)."""
    import keras
    import tensorflow as tf

    L = keras.layers
    keras.utils.set_random_seed(0)
    ids = keras.Input((64,), dtype="int32")
    h = L.Embedding(vocabulary, 64, name="emb")(ids)
    h = L.Add()([h, L.Dense(64, name="down")(L.Dense(128, activation="gelu", name="up")(h))])
    model = keras.Model(ids, L.Dense(vocabulary, name="head")(h))
    x = np.random.default_rng(0).integers(0, vocabulary, size=(4, 64)).astype("int32")
    y = np.concatenate([x[:, 1:], np.full((4, 1), -100)], axis=1)
    return model, (tf.constant(x), tf.constant(y))


def _sequence_lm_runs(vocabulary: int) -> dict[str, Callable[[], Any]]:
    """``gradient`` (of the mean token cross-entropy) and ``normflat`` (``hessian_diagonal``,
    ``ggn-topk`` per sequence) on :func:`_sequence_lm`."""
    import tensorflow as tf

    import normflat

    model, (x, y) = _sequence_lm(vocabulary)
    gradient = _token_gradient(model, x, y)

    def normflat_run():
        return [v.numpy() for v in normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn-topk",
                                                             progress=False).values()]

    return {"gradient": lambda: [tf.convert_to_tensor(g).numpy() for g in gradient()], "normflat": normflat_run}


def _token_gradient(model, x, y) -> Callable[[], Any]:
    """A compiled gradient of the mean token cross-entropy of ``model`` on ``(x, y)`` (label -100
    ignored) with respect to all trainable variables."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=False))
        return tape.gradient(loss, model.trainable_variables)

    return gradient


def _print_generic(model, data, **options) -> None:
    """Print the weights ``normflat.analyze(model, data, **options)`` puts on the generic path."""
    import normflat

    report = normflat.analyze(model, data, progress=False, **options)
    generic = [r.name for r in report.layers if r.details["path"] != "fast"]
    print(f"  weights on the generic path: {generic or 'none'}")


def sequence_lm_figures(vocabulary: int = 8000, repeats: int = 5) -> dict[str, float]:
    """Seconds of one gradient and of ``ggn-topk`` per sequence on :func:`_sequence_lm` (median of
    interleaved rounds)."""
    runs = _sequence_lm_runs(vocabulary)
    return time_interleaved({m: runs[m] for m in ("gradient", "normflat")}, repeats)


def _peak_worker(problem: str, arg: Any, method: str, threads: int | None, queue) -> None:
    """Peak MiB of TensorFlow's CPU allocations that a second run of ``method`` adds (``training
    step``: a gradient and an SGD step with momentum, its slots created by the first run;
    ``hessian_diagonal``; ``analyze``), in this fresh process; ``problem``: ``"sequence_lm"``
    (``arg`` the vocabulary, ``ggn-topk``) or ``"recurrent"`` (``arg`` the layer, ``ggn``)."""
    import os

    # TensorFlow's CPU memory is visible only through its BFC allocator's statistics (the resident
    # set keeps what its default allocator freed); read when TensorFlow starts.
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import keras
    import tensorflow as tf

    import normflat

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    if problem == "sequence_lm":
        model, (x, y) = _sequence_lm(arg)
        estimator = "ggn-topk"
    else:
        model, x, y = _recurrent_classifier(arg)
        estimator = "ggn"
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-100)
    optimizer = keras.optimizers.SGD(1e-3, momentum=0.9)

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=False))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    runs = {
        "training step": train_step,
        "hessian_diagonal": lambda: normflat.hessian_diagonal(model, (x, y), loss="ce", estimator=estimator,
                                                              progress=False),
        "analyze": lambda: normflat.analyze(model, (x, y), loss="ce", estimator=estimator, progress=False),
    }
    runs[method]()  # compilation, the optimizer's slots, normflat's compiled steps
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    runs[method]()
    queue.put((tf.config.experimental.get_memory_info("CPU:0")["peak"] - base) / 2**20)


def sequence_lm_memory(vocabulary: int = 8000, threads: int | None = None) -> dict[str, float]:
    """Peak MiB of a training step, ``hessian_diagonal`` and ``analyze`` (``ggn-topk`` per sequence)
    on :func:`_sequence_lm`, each in a fresh process (:func:`_peak_worker`). normflat's
    numpy sums on the host are not TensorFlow's and are not counted (one or ``1 + K`` float64
    arrays of each analyzed weight)."""
    from benchmarks._common import value_from_fresh_process

    return {m: value_from_fresh_process(_peak_worker, ("sequence_lm", vocabulary, m, threads))
            for m in ("training step", "hessian_diagonal", "analyze")}


#: The recurrent layers of ``--recurrent``.
RECURRENT_LAYERS = ("LSTM", "GRU", "SimpleRNN")


def _recurrent_classifier(layer: str):
    """Ids (32 tokens) -> an ``Embedding`` (2000 ids, 64 features) -> one ``layer`` (``LSTM``, ``GRU``,
    ``SimpleRNN``) of 128 units -> a 10-class ``Dense`` head on the last step's state; 32 sequences
    and their labels (``benchmarks.classes``' ``lstm-10``/``gru-10`` in Keras)."""
    import keras
    import tensorflow as tf

    L = keras.layers
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,), dtype="int32"), L.Embedding(2000, 64, name="emb"),
                              getattr(L, layer)(128, name="rnn"), L.Dense(10, name="head")])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 2000, size=(32, 32)).astype("int32"))
    return model, x, tf.constant(rng.integers(0, 10, size=32))


def recurrent_figures(repeats: int = 5) -> dict[str, dict[str, float]]:
    """``{layer: {method: seconds}}`` on :func:`_recurrent_classifier`: one gradient, ``ggn`` (the
    recurrent weights on their fast rule), ``ggn-mc`` and ``ggn`` with ``fast=False`` (every weight on
    the generic path), medians of interleaved rounds."""
    import normflat

    out = {}
    for layer in RECURRENT_LAYERS:
        model, x, y = _recurrent_classifier(layer)
        report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
        assert all(r.details["path"] == "fast" for r in report.layers), [r.details for r in report.layers]

        def diagonal(model=model, x=x, y=y, **kw):
            return [v.numpy() for v in normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False,
                                                                 **kw).values()]

        runs = {"gradient": _runner("gradient", model, x, y),
                "ggn": lambda d=diagonal: d(estimator="ggn"),
                "ggn-mc": lambda d=diagonal: d(estimator="ggn-mc"),
                "ggn generic": lambda d=diagonal: d(estimator="ggn", fast=False)}
        out[layer] = time_interleaved(runs, repeats)
    return out


def recurrent_memory(threads: int | None = None) -> dict[str, dict[str, float]]:
    """``{layer: peak MiB}`` of a training step, ``hessian_diagonal`` and ``analyze`` (``ggn``) on
    :func:`_recurrent_classifier`, each in a fresh process (:func:`_peak_worker`)."""
    from benchmarks._common import value_from_fresh_process

    return {layer: {m: value_from_fresh_process(_peak_worker, ("recurrent", layer, m, threads))
                    for m in ("training step", "hessian_diagonal", "analyze")} for layer in RECURRENT_LAYERS}


def albert_figures(repeats: int = 5) -> dict[str, float]:
    """keras-hub's ALBERT (4 layers sharing one) with a 10-class head on its pooled output, 16 sequences
    of 32 tokens: ``{"gradient": s, "normflat": s}`` (``ggn``, medians of interleaved rounds)."""
    import keras
    import tensorflow as tf
    from keras_hub.models import AlbertBackbone

    keras.utils.set_random_seed(0)
    backbone = AlbertBackbone(vocabulary_size=2000, num_layers=4, num_heads=2, embedding_dim=64, hidden_dim=128,
                              intermediate_dim=256, num_groups=1, num_inner_repetitions=1, max_sequence_length=32)
    names = ("token_ids", "segment_ids", "padding_mask")
    inputs = {k: keras.Input((32,), dtype="int32", name=k) for k in names}
    model = keras.Model(inputs, keras.layers.Dense(10, name="head")(backbone(inputs)["pooled_output"]))
    rng = np.random.default_rng(0)
    x = {"token_ids": tf.constant(rng.integers(1, 2000, (16, 32)).astype("int32")),
         "segment_ids": tf.zeros((16, 32), tf.int32), "padding_mask": tf.ones((16, 32), tf.int32)}
    y = tf.constant(rng.integers(0, 10, 16))
    _print_generic(model, (x, y), loss="ce", estimator="ggn")
    runs = {"gradient": _runner("gradient", model, x, y), "normflat": _runner("normflat_ggn", model, x, y)}
    return time_interleaved(runs, repeats)


def llama_figures(repeats: int = 5) -> dict[str, float]:
    """keras-hub's ``LlamaCausalLM`` (untied head), 4 sequences of 32 tokens: ``{"gradient": s,
    "normflat": s}`` (``auto``, medians of interleaved rounds)."""
    import keras
    import tensorflow as tf
    from keras_hub.models import LlamaBackbone, LlamaCausalLM

    import normflat

    keras.utils.set_random_seed(0)
    backbone = LlamaBackbone(vocabulary_size=5000, num_layers=2, num_query_heads=2, num_key_value_heads=1,
                             hidden_dim=64, intermediate_dim=256)
    model = LlamaCausalLM(backbone=backbone, preprocessor=None)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 5000, (4, 32)).astype("int32")
    x = {"token_ids": tf.constant(ids), "padding_mask": tf.ones((4, 32), tf.int32)}
    y = tf.constant(np.concatenate([ids[:, 1:], np.full((4, 1), -100)], 1))
    _print_generic(model, (x, y), loss="ce")
    gradient = _token_gradient(model, x, y)

    def run_gradient():
        return [(g.values if isinstance(g, tf.IndexedSlices) else g).numpy() for g in gradient()][-1]

    def run_normflat():
        return [v.numpy() for v in normflat.hessian_diagonal(model, (x, y), loss="ce", progress=False).values()]

    return time_interleaved({"gradient": run_gradient, "normflat": run_normflat}, repeats)


def separable_figures(repeats: int = 5) -> dict[str, float]:
    """Xception (71×71, 10 classes, 8 images): ``{"gradient": s, "normflat": s}`` (``ggn``, medians)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.applications.Xception(weights=None, input_shape=(71, 71, 3), classes=10)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(8, 71, 71, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=8))
    runs = {"gradient": _runner("gradient", model, x, y), "normflat": _runner("normflat_ggn", model, x, y)}
    return time_interleaved(runs, repeats)


def decoder_figures(repeats: int = 5) -> dict[str, float]:
    """A convolutional encoder-decoder classifier (32×32×3, 16 images, 10 classes): two strided
    ``Conv2D`` layers down, two ``Conv2DTranspose`` layers up (4×4, stride 2, ``"same"``), a 1×1
    ``Conv2D``, global average pooling, a ``Dense`` head. ``{"gradient", "ggn", "ggn generic": s}``
    (medians; ``ggn generic``: ``fast=False``, what the transposed convolutions cost before their
    rule, when they were not read at all)."""
    import keras
    import tensorflow as tf

    import normflat

    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        L.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        L.Conv2D(64, 3, strides=2, padding="same", activation="relu"),
        L.Conv2DTranspose(32, 4, strides=2, padding="same", activation="relu"),
        L.Conv2DTranspose(16, 4, strides=2, padding="same", activation="relu"),
        L.Conv2D(16, 1, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(16, 32, 32, 3)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=16))

    def generic():
        out = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", fast=False, progress=False)
        return [v.numpy() for v in out.values()]

    runs = {"gradient": _runner("gradient", model, x, y), "ggn": _runner("normflat_ggn", model, x, y),
            "ggn generic": generic}
    return time_interleaved(runs, repeats)


def text_cnn_figures(repeats: int = 5) -> dict[str, float]:
    """A 1-D convolutional text classifier (an ``Embedding`` of 2000 tokens and 64 features, three
    ``Conv1D`` layers of 128 filters of width 5 with ReLU, the first two followed by ``MaxPooling1D(2)``,
    global max pooling, a 10-class ``Dense`` head; 32 sequences of 128 tokens).
    ``{"gradient", "ggn", "ggn tensorflow pooling": s}`` (medians): ``ggn`` as it runs, and with
    TensorFlow's own max-pooling gradient in its step (``ggn.argmax_pooling_wins`` answering no, on a
    second copy of the model, whose step is traced that way) in place of the signals' scatter to the
    maxima of the forward (Keras guide, "Signals back through ``MaxPooling2D``")."""
    import keras
    import tensorflow as tf

    import normflat
    from normflat.backends.keras import ggn as keras_ggn

    L = keras.layers

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([
            keras.Input((128,), dtype="int32"), L.Embedding(2000, 64),
            L.Conv1D(128, 5, activation="relu"), L.MaxPooling1D(2),
            L.Conv1D(128, 5, activation="relu"), L.MaxPooling1D(2),
            L.Conv1D(128, 5, activation="relu"), L.GlobalMaxPooling1D(), L.Dense(10)])

    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 2000, size=(32, 128)).astype("int32"))
    y = tf.constant(rng.integers(0, 10, size=32))
    ours, twin = model(), model()
    wins = keras_ggn.argmax_pooling_wins

    def tensorflow_pooling():
        keras_ggn.argmax_pooling_wins = lambda: False  # only while this copy runs (and traces)
        try:
            out = normflat.hessian_diagonal(twin, (x, y), loss="ce", estimator="ggn", progress=False)
        finally:
            keras_ggn.argmax_pooling_wins = wins
        return [v.numpy() for v in out.values()]

    runs = {"gradient": _runner("gradient", ours, x, y), "ggn": _runner("normflat_ggn", ours, x, y),
            "ggn tensorflow pooling": tensorflow_pooling}
    return time_interleaved(runs, repeats)


def _print_against_gradient(what: str, f: dict[str, float], args: argparse.Namespace) -> None:
    """The figures of a problem timed against one gradient (``f``: ``gradient`` and ``normflat`` seconds)."""
    print(f"{what}, device {_device()}, threads {args.threads or 'default'}, median of {args.repeats}")
    print(f"  gradient {f['gradient']:.4f} s, normflat {f['normflat']:.4f} s "
          f"({f['normflat'] / f['gradient']:.1f}x a gradient)")


def _device() -> str:
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else "CPU"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per framework")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch figures")
    parser.add_argument("--position-table", action="store_true",
                        help="time a tiny ViT's position table: fast rule against the generic path")
    parser.add_argument("--tied-lm", action="store_true",
                        help="time a tiny LM's table tied to its head: fast rule against the generic path")
    parser.add_argument("--sequence-lm", type=int, default=None, metavar="V",
                        help="time ggn-topk (per sequence) on a small LM with its own head and a vocabulary of V "
                             "(4 sequences of 64 tokens) against a gradient")
    parser.add_argument("--recurrent", action="store_true",
                        help="time ggn on LSTM, GRU and SimpleRNN sequence classifiers: fast rule, generic path, "
                             "one gradient")
    parser.add_argument("--memory", action="store_true",
                        help="with --sequence-lm or --recurrent: also the peak of TensorFlow's CPU allocations "
                             "against a training step")
    parser.add_argument("--llama", action="store_true",
                        help="time auto on keras-hub's Llama causal LM (untied head) against a gradient")
    parser.add_argument("--albert", action="store_true",
                        help="time ggn on keras-hub's ALBERT (one layer shared by 4) against a gradient")
    parser.add_argument("--separable", action="store_true",
                        help="time ggn on Keras' Xception (SeparableConv2D blocks) against a gradient")
    parser.add_argument("--text-cnn", action="store_true",
                        help="time ggn on a 1-D convolutional text classifier (MaxPooling1D): as it runs, with "
                             "TensorFlow's own pooling gradient, one gradient")
    parser.add_argument("--decoder", action="store_true",
                        help="time ggn on a convolutional encoder-decoder classifier (Conv2DTranspose layers): "
                             "fast rule, generic path, one gradient")
    args = parser.parse_args(argv)
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.recurrent:
        f = recurrent_figures(args.repeats)
        print(f"sequence classifiers (32 sequences of 32 tokens, vocabulary 2000, d 64, 128 units, 10 classes), "
              f"device {_device()}, threads {args.threads or 'default'}, median of {args.repeats}; multiples of "
              "one gradient")
        mem = recurrent_memory(args.threads) if args.memory else None
        for layer, seconds in f.items():
            line = (f"  {layer:9} gradient {seconds['gradient'] * 1e3:6.1f} ms; " + ", ".join(
                f"{m} {seconds[m] / seconds['gradient']:.1f}x" for m in ("ggn", "ggn-mc", "ggn generic")))
            if mem:
                step = mem[layer]["training step"]
                line += (f"; peak MiB training step {step:.1f}, hessian_diagonal {mem[layer]['hessian_diagonal']:.1f}"
                         f" ({mem[layer]['hessian_diagonal'] / step:.1f}x), analyze {mem[layer]['analyze']:.1f}"
                         f" ({mem[layer]['analyze'] / step:.1f}x)")
            print(line)
        return {"recurrent": f, "peak_mib": mem}
    if args.llama:
        f = llama_figures(args.repeats)
        _print_against_gradient("keras-hub Llama causal LM (2 layers, width 64, vocabulary 5000, untied head, 4 "
                                "sequences of 32 tokens), auto", f, args)
        return {"llama": f}
    if args.albert:
        f = albert_figures(args.repeats)
        _print_against_gradient("keras-hub ALBERT (4 layers sharing one, width 128, 16 sequences of 32 tokens, "
                                "10 classes), ggn", f, args)
        return {"albert": f}
    if args.decoder:
        f = decoder_figures(args.repeats)
        print(f"encoder-decoder classifier (32x32x3, 16 images, two Conv2DTranspose layers, 10 classes), device "
              f"{_device()}, threads {args.threads or 'default'}, median of {args.repeats}")
        print(f"  gradient {f['gradient'] * 1e3:.1f} ms; ggn {f['ggn'] / f['gradient']:.1f}x, ggn generic path "
              f"{f['ggn generic'] / f['gradient']:.1f}x a gradient")
        return {"decoder": f}
    if args.text_cnn:
        f = text_cnn_figures(args.repeats)
        print(f"1-D convolutional text classifier (32 sequences of 128 tokens, three Conv1D, two MaxPooling1D, 10 "
              f"classes), device {_device()}, threads {args.threads or 'default'}, median of {args.repeats}")
        print(f"  gradient {f['gradient'] * 1e3:.1f} ms; ggn {f['ggn'] / f['gradient']:.1f}x, ggn with TensorFlow's "
              f"pooling gradient {f['ggn tensorflow pooling'] / f['gradient']:.1f}x a gradient "
              f"(ggn / the latter {f['ggn'] / f['ggn tensorflow pooling']:.2f})")
        return {"text_cnn": f}
    if args.separable:
        f = separable_figures(args.repeats)
        _print_against_gradient("Xception (keras.applications, 71x71, 10 classes, 8 images), ggn", f, args)
        return {"separable": f}
    if args.position_table:
        f = position_table_figures(args.repeats)
        print(f"tiny ViT (batch 32, 17 tokens, d 64), ggn, device {_device()}, threads {args.threads or 'default'}, "
              f"median of {args.repeats}")
        print(f"  position table fast {f['fast']:.4f} s, generic {f['generic']:.4f} s, "
              f"generic / fast {f['generic_over_fast']:.2f}")
        return {"position_table": f}
    if args.sequence_lm:
        f = sequence_lm_figures(args.sequence_lm, args.repeats)
        _print_against_gradient(f"LM with its own head (4 sequences of 64 tokens, vocabulary {args.sequence_lm}, "
                                "d 64), ggn-topk per sequence", f, args)
        if args.memory:
            mem = sequence_lm_memory(args.sequence_lm, args.threads)
            step = mem["training step"]
            print(f"  peak MiB (TensorFlow's CPU allocations): training step {step:.1f}, hessian_diagonal "
                  f"{mem['hessian_diagonal']:.1f} ({mem['hessian_diagonal'] / step:.1f}x), analyze "
                  f"{mem['analyze']:.1f} ({mem['analyze'] / step:.1f}x)")
            f = {**f, "peak_mib": mem}
        return {"sequence_lm": f}
    if args.tied_lm:
        f = tied_lm_figures(args.repeats)
        print(f"tiny tied LM (16 sequences of 16 tokens, vocabulary 1000, d 64), ggn-topk, device {_device()}, "
              f"threads {args.threads or 'default'}, median of {args.repeats}")
        print(f"  tied table fast {f['fast']:.4f} s, generic {f['generic']:.4f} s, "
              f"generic / fast {f['generic_over_fast']:.2f}")
        return {"tied_lm": f}

    keras_fig = keras_figures(args.repeats)
    torch_fig = None
    if not args.no_torch:
        try:
            from benchmarks.torch_diag import torch_figures
        except ImportError as err:
            print(f"(no PyTorch figures: {err})")
        else:
            if args.threads:
                import torch

                torch.set_num_threads(args.threads)
            torch_fig = torch_figures(repeats=args.repeats, device="cpu", memory=False)

    import keras
    import tensorflow as tf

    print(f"keras {keras.__version__}, tensorflow {tf.__version__}, device {_device()}, "
          f"threads {args.threads or 'default'}, median of {args.repeats}")
    header = f"{'problem':8} {'method':17} {'keras s':>9} {'keras xgrad':>12}"
    if torch_fig:
        header += f" {'torch s':>9} {'torch xgrad':>12} {'keras/torch':>12}"
    print(header)
    for name, fig in keras_fig.items():
        for m in METHODS:
            line = f"{name:8} {m:17} {fig['seconds'][m]:9.4f} {fig['x_gradient'][m]:12.2f}"
            if torch_fig:
                tf_ = torch_fig[name]
                line += (f" {tf_['seconds'][m]:9.4f} {tf_['x_gradient'][m]:12.2f}"
                         f" {fig['x_gradient'][m] / tf_['x_gradient'][m]:12.2f}")
            print(line)
    return {"keras": keras_fig, "torch": torch_fig}


if __name__ == "__main__":
    main()
