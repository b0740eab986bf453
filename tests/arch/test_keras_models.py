"""Whole Keras architectures: every weight matrix is analyzed (``coverage``, method §3).

Transformers and recurrent classifiers built from Keras layers, keras-hub BERT
and GPT-2 built from tiny configs (no downloads), and ``keras.applications``
ConvNeXtTiny / MobileNetV2 / ResNet50 with ``weights=None`` at 32×32. One tiny
batch each; the numbers themselves are checked against brute force in
``test_keras_layers.py``, those of keras-hub's ``PositionEmbedding`` (its fast rule,
method §6.1 "Position tables") here.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras  # noqa: E402
import keras_hub  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras.layers import walk  # noqa: E402
from normflat.engine.problems import coverage  # noqa: E402
from tests.arch._keras_invariance import invariance_tolerance, tensorflow_generic  # noqa: E402
from tests.arch.test_keras_layers import RTOL, check_against, ggn_reference  # noqa: E402

L = keras.layers
F64 = "float64"


def _covered(model, data, **kw):
    rep = normflat.analyze(model, data, progress=False, **kw)
    assert rep.metadata["unsupported"] == []
    assert rep.metadata["coverage"] >= 0.99, rep.metadata
    assert np.isfinite(rep.normalized_sharpness) and rep.normalized_sharpness > 0
    return rep


def test_attention_transformer_classifier():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 8), dtype=F64)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4, dtype=F64, name="mha")(inp, inp)
    h = L.LayerNormalization(dtype=F64, name="ln1")(L.Add(dtype=F64)([inp, a]))
    f = L.Dense(8, dtype=F64, name="ff_out")(L.Dense(16, activation="gelu", dtype=F64, name="ff_in")(h))
    h = L.LayerNormalization(dtype=F64, name="ln2")(L.Add(dtype=F64)([h, f]))
    out = L.Dense(3, dtype=F64, name="cls")(L.GlobalAveragePooling1D(dtype=F64)(h))
    model = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    rep = _covered(model, (rng.normal(size=(3, 4, 8)), np.array([0, 1, 2])))
    assert [l.name for l in rep.layers] == ["mha/query", "mha/key", "mha/value", "mha/attention_output", "ff_in",
                                            "ff_out", "cls"]
    assert rep.metadata["coverage"] == 1.0
    excluded = rep.metadata["excluded"]
    assert {"ln1/gamma", "ln1/beta", "mha/query/bias", "cls/bias"} <= set(excluded)
    assert "normalization" in excluded["ln1/gamma"] and excluded["mha/query/bias"] == "bias"


def test_lstm_classifier():
    keras.utils.set_random_seed(1)
    inp = keras.Input((5,), dtype="int32")
    h = L.Embedding(20, 6, mask_zero=True, dtype=F64, name="emb")(inp)
    h = L.LSTM(4, dtype=F64, name="lstm")(h)
    model = keras.Model(inp, L.Dense(2, dtype=F64, name="cls")(h))
    x = np.array([[3, 4, 5, 0, 0], [1, 2, 3, 4, 5], [7, 0, 0, 0, 0]], dtype="int32")  # zero = padding
    rep = _covered(model, (x, np.array([0, 1, 1])), loss="ce")  # two classes: nsce would be constant
    assert rep.metadata["coverage"] == 1.0
    assert "lstm/lstm_cell/kernel.o" in [l.name for l in rep.layers]


def test_token_language_model():
    keras.utils.set_random_seed(2)
    inp = keras.Input((5,), dtype="int32")
    e = L.Embedding(12, 8, dtype=F64, name="emb")(inp)
    a = L.MultiHeadAttention(num_heads=2, key_dim=4, dtype=F64, name="mha")(e, e, use_causal_mask=True)
    h = L.LayerNormalization(dtype=F64)(L.Add(dtype=F64)([e, a]))
    model = keras.Model(inp, L.Dense(12, dtype=F64, name="vocab")(h))  # logits (B, T, V)
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 12, (2, 5)).astype("int32")
    labels = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)  # next token, last not counted
    rep = _covered(model, (ids, labels))
    assert rep.metadata["loss_terms"] == 8


def test_keras_hub_bert_classifier():
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
    rng = np.random.default_rng(3)
    batch = {"token_ids": rng.integers(0, 30, (2, 6)).astype("int32"),
             "segment_ids": np.zeros((2, 6), "int32"),
             "padding_mask": np.array([[1] * 6, [1] * 4 + [0] * 2], "int32"),
             "labels": np.array([0, 1])}  # a Hugging Face style mapping batch: named inputs
    rep = _covered(model, batch, loss="ce")  # random init: nearly equal logits, nsce would refuse them
    names = [l.name for l in rep.layers]
    assert "bert_backbone/token_embedding" in names and "bert_backbone/position_embedding" in names
    assert "bert_backbone/transformer_layer_0/self_attention_layer/query" in names


def test_keras_hub_deberta_v3_relative_embedding_is_analyzed():
    """DeBERTa-v3's table of relative positions (keras-hub's ``RelativeEmbedding``, read whole and
    layer-normalized) is analyzed as the embedding of the position buckets on the generic path, as
    Hugging Face's ``rel_embeddings`` is in the torch backend (it was skipped: coverage 0.28 on a
    small model): every weight matrix covered, the table's diagonal against brute force (float64
    weights; keras-hub computes the attention softmax in float32, hence the tolerance)."""
    keras.utils.set_random_seed(4)
    backbone = keras_hub.models.DebertaV3Backbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                                                  intermediate_dim=16, max_sequence_length=8, bucket_size=4,
                                                  dtype="float64")
    model = keras_hub.models.DebertaV3TextClassifier(backbone, num_classes=3, preprocessor=None, dtype="float64")
    rng = np.random.default_rng(4)
    ids = rng.integers(1, 20, (3, 6))
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids, bool)}, rng.integers(0, 3, 3)
    entries, unsupported, parameters = walk(model, "warn", None)
    assert unsupported == [] and coverage(parameters) == 1.0
    table = next(e for e in entries if e.name == "deberta_v3_backbone/rel_embedding")
    assert table.weight.kind == "position_embedding" and table.fast is None
    got = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)[table.name]
    assert got.shape == (8, 8)  # (features, 2 · buckets)
    want = ggn_reference(model, [table.variable], x, y, "ce")[0].T
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_keras_hub_gpt2_causal_lm_with_tied_embedding():
    keras.utils.set_random_seed(4)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=20, num_layers=1, num_heads=2, hidden_dim=8,
                                             intermediate_dim=16, max_sequence_length=8, dtype=F64)
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 20, (2, 5)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones((2, 5), "int32")}
    # keras-hub's preprocessor shifts the labels in the data; the model itself does not.
    y = np.concatenate([ids[:, 1:], np.full((2, 1), -100)], axis=1)
    rep = _covered(model, (x, y), loss="ce", estimator="ggn-mc", samples=2)
    names = [l.name for l in rep.layers]
    assert names.count("gpt2_backbone/token_embedding") == 1  # tied with the LM head: reported once
    assert rep.metadata["loss_terms"] == 8
    # the lookup inside the backbone and the reverse projection outside it: the tied fast rule
    # (method §6.1), the numbers of the generic path
    assert rep.layer("gpt2_backbone/token_embedding").details["path"] == "fast"
    fast, generic = (normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn-mc", samples=2, fast=f,
                                               progress=False) for f in (True, False))
    for k in fast:
        np.testing.assert_allclose(np.asarray(fast[k]), np.asarray(generic[k]), rtol=RTOL, err_msg=k)


def test_tied_reversible_embedding_feature_rescaling_is_invariant():
    """keras-hub's tied ``ReversibleEmbedding`` (the lookup and the LM head, one table): feature j
    times c_j, the next Dense's input row j and the previous Dense's output column j times 1/c_j
    leave the function and each layer's normalized sharpness unchanged (method §8); the trace moves."""
    ids_in = keras.Input((4,), dtype="int32")
    emb = keras_hub.layers.ReversibleEmbedding(9, 4, tie_weights=True, dtype=F64, name="emb")
    h = L.Dense(6, activation="tanh", dtype=F64, name="mix_in")(emb(ids_in))
    model = keras.Model(ids_in, emb(L.Dense(4, dtype=F64, name="mix_out")(h), reverse=True))
    rng = np.random.default_rng(11)
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.7)
    ids, y = rng.integers(0, 9, (3, 4)).astype("int32"), rng.integers(0, 9, (3, 4))
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    c = np.array([2.0, 0.5, 3.0, 0.25])
    table, mix_in, mix_out = twin.get_layer("emb").embeddings, twin.get_layer("mix_in"), twin.get_layer("mix_out")
    table.assign(table.numpy() * c)
    mix_in.kernel.assign(mix_in.kernel.numpy() / c[:, None])
    mix_out.kernel.assign(mix_out.kernel.numpy() / c)
    mix_out.bias.assign(mix_out.bias.numpy() / c)
    rtol = invariance_tolerance(twin(ids), model(ids))
    before, after = (normflat.analyze(m, (ids, y), loss="ce", estimator="ggn", progress=False) for m in (model, twin))
    assert sorted(l.name for l in before.layers) == sorted(l.name for l in after.layers) == ["emb", "mix_in", "mix_out"]
    assert before.layer("emb").details["path"] == after.layer("emb").details["path"] == "fast"  # the tied rule
    for a in before.layers:
        b = after.layer(a.name)
        assert b.normalized_sharpness == pytest.approx(a.normalized_sharpness, rel=rtol), a.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=rtol)
    assert abs(after.hessian_trace / before.hessian_trace - 1) > 1e-3


class HubTagger(keras.Model):
    """keras-hub's ``TokenAndPositionEmbedding`` (5 positions; the tokens read rows
    ``start .. start + 2``), a tanh mixer averaged over the tokens, a head. ``also``: the model
    also adds the position table's first rows itself, a second use of the variable."""

    def __init__(self, start=1, also=False):
        super().__init__(name="tagger")
        self.start, self.also = start, also
        self.tpe = keras_hub.layers.TokenAndPositionEmbedding(7, 5, 4, dtype=F64, name="tpe")
        self.mix = L.Dense(6, activation="tanh", dtype=F64, name="mix")
        self.head = L.Dense(3, dtype=F64, name="head")

    def call(self, ids):
        h = self.tpe(ids, start_index=self.start)
        if self.also:
            h = h + 0.5 * self.tpe.position_embedding.position_embeddings[:3]
        return self.head(keras.ops.mean(self.mix(h), axis=1))


def _tagger(**kw):
    model = HubTagger(**kw)
    rng = np.random.default_rng(13)
    ids, y = rng.integers(0, 7, (3, 3)).astype("int32"), rng.integers(0, 3, 3)
    model(ids)
    for v in model.weights:
        v.assign(rng.normal(size=v.shape) * 0.7)
    return model, ids, y


def _transposed(k):
    return k.T


TAGGER_LAYERS = {"tpe/token_embedding": ("tagger/tpe/token_embedding/embeddings", _transposed),
                 "tpe/position_embedding": ("tagger/tpe/position_embedding/embeddings", _transposed),
                 "mix": ("tagger/mix/kernel", _transposed), "head": ("tagger/head/kernel", _transposed)}


def test_keras_hub_position_embedding_fast_rule():
    """keras-hub's ``PositionEmbedding`` (inside ``TokenAndPositionEmbedding``, started at row 1) on
    its fast rule: its output is per sample, so the signal there is each sample's gradient of the
    rows it read (method §6.1). ``ggn`` against brute force on the fast and the generic path,
    ``ggn-mc`` and ``ggn-topk`` fast against generic; batches of 3 and 2."""
    model, ids, y = _tagger()
    rep = normflat.analyze(model, (ids, y), progress=False)
    table = rep.layer("tpe/position_embedding")
    assert table.details["path"] == "fast" and table.shape == (4, 5), table.details
    for n in (3, 2):
        got = check_against(model, ids[:n], y[:n], TAGGER_LAYERS, loss="nsce")
        check_against(model, ids[:n], y[:n], TAGGER_LAYERS, loss="nsce", fast=False)
        rows = np.abs(np.asarray(got["tpe/position_embedding"])).sum(0)
        assert rows[0] == rows[4] == 0 and np.all(rows[1:4] > 0)  # the rows start_index=1 reads, no others
        for kw in (dict(estimator="ggn-mc", samples=3, seed=4), dict(estimator="ggn-topk", top_classes=1,
                                                                       samples=3, seed=5)):
            fast = normflat.hessian_diagonal(model, (ids[:n], y[:n]), progress=False, **kw)
            generic = normflat.hessian_diagonal(model, (ids[:n], y[:n]), progress=False, fast=False, **kw)
            for k in fast:
                # ggn-topk squares the fast head exactly (method §6.2), the generic path samples it
                want = got[k] if (k, kw["estimator"]) == ("head", "ggn-topk") else generic[k]
                np.testing.assert_allclose(np.asarray(fast[k]), np.asarray(want), rtol=RTOL, err_msg=k)


def test_keras_hub_position_embedding_used_twice_is_generic_and_exact():
    """A ``PositionEmbedding`` table the model also reads itself: a gradient reaches the variable
    besides the layer's output, so the fast rule is refused (with the reason), exactly."""
    model, ids, y = _tagger(also=True)
    details = normflat.analyze(model, (ids, y), progress=False).layer("tpe/position_embedding").details
    assert details["path"] == "generic", details
    assert "also used outside its PositionEmbedding layer" in details["generic_reason"]
    check_against(model, ids, y, TAGGER_LAYERS, loss="nsce")


def test_keras_hub_vit_position_ids_fast_rule():
    """keras-hub's ViT looks its position table up with one row of position ids ``(1, N)`` and adds
    the rows to every image: the lookup runs once per image in the GGN step, so the position
    embedding keeps its fast rule (method §6.1, "Position tables"), equal to the generic path in
    float64 for every layer (before, the one row was read as one image: 83 % off)."""
    keras.utils.set_random_seed(6)
    backbone = keras_hub.models.ViTBackbone(image_shape=(8, 8, 3), patch_size=4, num_layers=1, num_heads=2,
                                            hidden_dim=8, mlp_dim=16, dtype="float64")
    model = keras_hub.models.ViTImageClassifier(backbone, num_classes=3, preprocessor=None, dtype="float64")
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(3, 8, 8, 3)), rng.integers(0, 3, 3)
    rep = normflat.analyze(model, (x, y), loss="ce", progress=False)
    assert {layer.details["path"] for layer in rep.layers} == {"fast"}, [
        (layer.name, layer.details) for layer in rep.layers if layer.details["path"] != "fast"]
    assert any(layer.name.endswith("position_embedding") for layer in rep.layers)
    fast = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)
    generic = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False, fast=False)
    for k in fast:
        np.testing.assert_allclose(np.asarray(fast[k]), np.asarray(generic[k]), rtol=RTOL,
                                   atol=1e-14 * float(np.abs(np.asarray(generic[k])).max()), err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["MobileNetV2", "ResNet50"])
def test_keras_applications(name):
    keras.utils.set_random_seed(5)
    model = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=2)
    x = np.random.default_rng(5).uniform(0, 255, (1, 32, 32, 3)).astype("float32")
    _covered(model, (x, np.array([1])), loss="ce", estimator="ggn-mc", samples=1)


def test_keras_applications_convnext_inventory():
    """ConvNeXtTiny's inventory (its depthwise convolutions are Conv2D with groups = channels).

    Only the walk is run: the analysis splits each grouped convolution into one
    convolution per group (TensorFlow has no CPU derivative of grouped
    convolutions), thousands of ops that take minutes to compile on a CPU.
    """
    keras.utils.set_random_seed(6)
    model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(32, 32, 3), classes=2)
    entries, unsupported, parameters = walk(model, "warn", None)
    assert unsupported == []
    assert coverage(parameters) >= 0.99
    assert {p.name for p in parameters} == {v.path for v in model.weights}
    assert any(e.weight.groups > 1 for e in entries)  # the depthwise 7×7 convolutions are analyzed
    excluded = {p.name: p.reason for p in parameters if p.status == "excluded"}
    assert any(name.endswith("gamma") for name in excluded)  # layer-scale vectors, not weight matrices


class IdleBranch(keras.Model):
    """A classifier with a second dense layer built but called by no forward (a head left over
    from pre-training): its weight exists and no logit depends on it."""

    def __init__(self):
        super().__init__()
        self.hidden = L.Dense(6, activation="tanh", dtype=F64, name="hidden")
        self.head = L.Dense(3, dtype=F64, name="head")
        self.spare = L.Dense(4, dtype=F64, name="spare")

    def build(self, shape):
        self.hidden.build(shape)
        self.head.build((None, 6))
        self.spare.build((None, 6))

    def call(self, x):
        return self.head(self.hidden(x))


def test_weights_no_forward_uses_take_no_path():
    """A weight whose layer no forward calls and that the logits do not depend on (an idle head; the
    untied reverse projection of a keras-hub backbone under a classifier) has zero curvature and
    takes no path, its details say so (method §6.1, "Weights no forward uses"), as in the torch
    backend; the other weights' diagonals are the generic path's."""
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    idle = IdleBranch()
    x, y = rng.normal(size=(5, 4)), np.array([0, 1, 2, 1, 0])
    idle(x)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=40, num_layers=1, num_query_heads=2, hidden_dim=8,
                                              intermediate_dim=16, num_key_value_heads=1, dtype=F64)
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="int32", name="padding_mask")
    pooled = L.GlobalAveragePooling1D(dtype=F64)(backbone({"token_ids": ids, "padding_mask": mask}))
    classifier = keras.Model({"token_ids": ids, "padding_mask": mask}, L.Dense(3, dtype=F64)(pooled))
    tokens = {"token_ids": rng.integers(0, 40, (3, 5)).astype("int32"), "padding_mask": np.ones((3, 5), "int32")}
    for model, data, name in [(idle, (x, y), "spare"),
                              (classifier, (tokens, np.array([0, 2, 1])), "llama_backbone/token_embedding/reverse")]:
        report = _covered(model, data, loss="ce")
        details = report.layer(name).details
        assert details["path"] == "fast" and "its curvature is zero" in details["unused"], details
        assert report.layer(name).hessian_trace == 0.0
        assert [n for n, layer in ((lr.name, lr) for lr in report.layers) if "unused" in layer.details] == [name]
        fast, generic = (normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", fast=f, progress=False)
                         for f in (True, False))
        assert not np.any(np.asarray(fast[name]))
        # keras-hub's rotary embedding computes its angles in float32: the generic path's one-sample
        # forward rounds them apart from the chunk's (logits 1e-7 apart), float32's agreement there.
        rtol = RTOL if model is idle else 1e-5
        for k in fast:
            np.testing.assert_allclose(np.asarray(fast[k]), np.asarray(generic[k]), rtol=rtol,
                                       atol=rtol * 1e-4 * float(np.abs(np.asarray(generic[k])).max()), err_msg=k)


def _rwkv7(layers):
    """A tiny keras-hub RWKV-7 causal LM (float64 weights; keras-hub keeps its recurrent state in
    float32) with the time mixing's low-rank maps and mixing vectors drawn away from their zero
    initialization, and 3 sequences of 5 tokens with next-token labels."""
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.RWKV7Backbone(hidden_size=8, head_size=4, num_layers=layers, vocabulary_size=11,
                                              intermediate_dim=16, gate_lora=3, mv_lora=2, aaa_lora=2, decay_lora=3,
                                              dtype=F64)
    model = keras_hub.models.RWKV7CausalLM(backbone, preprocessor=None)
    rng = np.random.default_rng(7)
    for v in model.weights:
        if "TIME_MIX" in v.path and v.path.rsplit("/", 1)[-1] in ("w1", "w2", "a1", "a2", "g1", "g2", "x_w", "x_a",
                                                                      "x_g"):
            v.assign(rng.normal(size=v.shape) * 0.8)
    ids = rng.integers(1, 11, (3, 5)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones((3, 5), "int32")}
    return model, x, np.concatenate([ids[:, 1:], np.full((3, 1), -100)], axis=1)


def test_keras_hub_rwkv7_own_matrices_inventory():
    """RWKV-7's time mixing multiplies by low-rank matrices of its own (``w1``, ``w2``, ``a1``, ``a2``,
    ``g1``, ``g2``, and ``v1``, ``v2`` from the second layer on) beside its ``Dense`` projections: each
    is analyzed (it was skipped, coverage 0.33 on a small model); ``r_k`` scales entry by entry and is
    excluded with its reason; the time mixing loops through time (per-sample gradients one by one)."""
    from normflat.backends.keras.hvp import has_recurrence

    model, _, _ = _rwkv7(2)
    entries, unsupported, parameters = walk(model, "warn", None)
    assert unsupported == [] and coverage(parameters) == 1.0
    names = {e.name.rsplit("/", 1)[-1] for e in entries if "RWKV_TIME_MIX" in e.name}
    assert names == {"receptance", "key", "value", "output_layer", "w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2"}
    assert {e.name.split("/", 1)[1] for e in entries if e.name.endswith(("/v1", "/v2"))} == {
        "rwkv_layer_1/RWKV_TIME_MIX/v1", "rwkv_layer_1/RWKV_TIME_MIX/v2"}
    own = [e for e in entries if e.name.rsplit("/", 1)[-1] in ("w1", "w2", "a1", "a2", "v1", "v2", "g1", "g2")]
    assert all(e.fast is None and "applies its own" in e.reason for e in own)
    excluded = {p.name: p.reason for p in parameters if p.status == "excluded"}
    assert "bonus scale" in excluded["rwkv_layer_0/RWKV_TIME_MIX/r_k"]
    assert "bonus scale" in excluded["rwkv_layer_1/RWKV_TIME_MIX/r_k"]
    assert has_recurrence(model)


RWKV7_OWN_MAPS = ("w1", "w2", "a1", "a2", "g1", "g2")


def _rwkv7_own_variables(model):
    """The first time mixing's own matrices, in the order of :data:`RWKV7_OWN_MAPS`."""
    return [next(v for v in model.weights if v.path == f"rwkv_layer_0/RWKV_TIME_MIX/{m}") for m in RWKV7_OWN_MAPS]


@pytest.mark.slow
def test_keras_hub_rwkv7_own_matrices_brute_force():
    """The time mixing's own matrices, canonical ``(out, in)``: the GGN diagonal against brute force
    (to keras-hub's float32 state)."""
    model, x, y = _rwkv7(1)
    got = normflat.hessian_diagonal(model, (x, y), loss="ce", estimator="ggn", progress=False)
    mix = next(name for name in got if name.endswith("/RWKV_TIME_MIX/w1")).rsplit("/", 1)[0]  # the model's name
    for m, ref in zip(RWKV7_OWN_MAPS, ggn_reference(model, _rwkv7_own_variables(model), x, y, "ce")):
        assert np.abs(ref).max() > 0
        np.testing.assert_allclose(np.asarray(got[f"{mix}/{m}"]), ref.T, rtol=1e-4, atol=1e-6 * np.abs(ref).max(),
                                   err_msg=m)


@pytest.mark.slow
def test_keras_hub_rwkv7_own_matrices_rescaling():
    """``a1 → a2`` (no nonlinearity between) rescaled, ``a1``'s columns by positive factors and
    ``a2``'s rows by their inverses: the function unchanged, every normalized sharpness unchanged,
    the two traces moved (the same model rescaled in place: its compiled step is reused); the own
    matrices on the generic path (on Keras' JAX backend on the fast dense rule)."""
    from tests._invariance import assert_reports_invariant

    model, x, y = _rwkv7(1)
    z = np.asarray(model(x))
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    # the layer names' prefix: the model's name
    mix = next(layer.name for layer in before.layers if layer.name.endswith("/RWKV_TIME_MIX/a1")).rsplit("/", 1)[0]
    a1, a2 = _rwkv7_own_variables(model)[2:4]
    factors = np.exp(np.random.default_rng(8).uniform(-1.0, 1.0, size=a1.shape[1]))
    a1.assign(a1.numpy() * factors)
    a2.assign(a2.numpy() / factors[:, None])
    rtol = invariance_tolerance(model(x), z)
    after = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert_reports_invariant(before, after, moved=(f"{mix}/a1", f"{mix}/a2"),
                             generic=tensorflow_generic(lambda name: name.rsplit("/", 1)[-1] in RWKV7_OWN_MAPS), rtol=rtol)
