"""keras-hub mixture-of-experts layers in the Keras backend (method §3, "Mixture-of-experts layers").

keras-hub stores a block's experts as ``(experts, in, out)`` kernels: separate gate, up and
down kernels (Mixtral), a kernel packing each expert's gate then up columns (Qwen-MoE), or
alternating them (GPT-OSS). normflat reports one problem per expert and map. Checked: each
layout's blocks against brute force (per-sample Jacobians by ``tf.GradientTape``; the test
slices the kernels itself), a keras-hub Mixtral backbone covered whole, and a
function-preserving rescaling of every expert.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras  # noqa: E402
import keras_hub  # noqa: E402, F401  (loads the experts classes normflat registers)
from keras import ops  # noqa: E402
from keras_hub.src.models.gpt_oss.gpt_oss_decoder import GptOssExperts  # noqa: E402
from keras_hub.src.models.mixtral.mixtral_decoder import MixtralMoeExperts  # noqa: E402
from keras_hub.src.models.qwen_moe.qwen_moe_decoder import QwenMoeExperts  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.keras.layers import walk  # noqa: E402
from normflat.engine.problems import coverage  # noqa: E402
from tests.arch.test_keras_layers import ggn_reference  # noqa: E402

EXPERTS, HIDDEN, INTER, CLASSES = 3, 6, 4, 3


def _experts(kind: str):
    common = dict(num_experts=EXPERTS, hidden_dim=HIDDEN, intermediate_dim=INTER, dtype="float64", name="experts")
    return {"mixtral": MixtralMoeExperts, "qwen_moe": QwenMoeExperts, "gpt_oss": GptOssExperts}[kind](**common)


class _RoutedClassifier(keras.Model):
    """Features -> dense -> every expert on every token, weighted by a softmax router (as keras-hub's
    blocks combine them) -> mean over the tokens -> dense head."""

    def __init__(self, experts):
        super().__init__(dtype="float64", name="routed_classifier")
        self.embed = keras.layers.Dense(HIDDEN, dtype="float64", name="embed")
        self.router = keras.layers.Dense(EXPERTS, use_bias=False, dtype="float64", name="router")
        self.experts = experts
        self.head = keras.layers.Dense(CLASSES, dtype="float64", name="head")

    def call(self, x):
        n, t = ops.shape(x)[0], ops.shape(x)[1]
        h = ops.reshape(self.embed(x), (-1, HIDDEN))
        weights = ops.transpose(ops.softmax(self.router(h), axis=-1))  # (E, tokens)
        mixed = ops.sum(self.experts(h) * weights[:, :, None], axis=0)
        return self.head(ops.mean(ops.reshape(mixed, (n, t, HIDDEN)), axis=1))


def _model(kind: str):
    keras.utils.set_random_seed(3)
    model = _RoutedClassifier(_experts(kind))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(4, 3, 5)), rng.integers(0, CLASSES, 4)
    model(x)
    # Biases (GPT-OSS) away from zero so that they matter.
    for v in model.experts.weights:
        if len(v.shape) == 2:
            v.assign(rng.normal(size=v.shape) * 0.3)
    return model, x, y


def _blocks(kind: str, model, per_variable: dict) -> dict:
    """The reference diagonals per expert and map, each expert's ``(out, in)`` matrix sliced by hand."""
    prefix = model.experts.name
    out = {}
    kernels = {v.name: per_variable[v.path] for v in model.experts.weights if len(v.shape) == 3}
    for e in range(EXPERTS):
        if kind == "mixtral":
            out[f"{prefix}/gate.{e}"] = kernels["expert_feedforward_gate_dense"][e].T
            out[f"{prefix}/up.{e}"] = kernels["expert_feedforward_intermediate_dense"][e].T
        else:
            packed = (kernels["expert_feedforward_gate_dense"] if kind == "qwen_moe" else kernels["gate_up_proj"])[e].T
            gate, up = (packed[:INTER], packed[INTER:]) if kind == "qwen_moe" else (packed[0::2], packed[1::2])
            out[f"{prefix}/gate_up.{e}.gate"], out[f"{prefix}/gate_up.{e}.up"] = gate, up
    down = kernels["down_proj" if kind == "gpt_oss" else "expert_feedforward_output_dense"]
    for e in range(EXPERTS):
        out[f"{prefix}/down.{e}"] = down[e].T
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen_moe", "gpt_oss"])
def test_each_expert_layout_matches_the_brute_force_ggn(kind):
    """One problem per expert and map, in the canonical ``(out, in)`` layout of every stored layout,
    equal to brute force (Mixtral's experts apply SiLU in float32: hence the tolerance)."""
    model, x, y = _model(kind)
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    variables = [v for v in model.experts.weights if len(v.shape) == 3]
    want = _blocks(kind, model, dict(zip([v.path for v in variables],
                                         ggn_reference(model, variables, x, y, "nsce"))))
    names = [layer.name for layer in report.layers if layer.kind == "expert"]
    assert sorted(names) == sorted(want)
    assert {report.layer(name).details["generic_reason"] for name in names} == {
        f"{type(model.experts).__name__}: keras-hub experts (every expert on every token) have no fast rule"}
    got = normflat.hessian_diagonal(model, (x, y), estimator="ggn", progress=False)
    tol = 1e-6 if kind == "mixtral" else 1e-10
    for name, w in want.items():
        assert np.abs(w).max() > 0, name
        np.testing.assert_allclose(np.asarray(got[name]), w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=name)


def test_mixtral_backbone_is_covered():
    """A keras-hub Mixtral language model: every weight matrix analyzed, the experts per expert and map."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.MixtralBackbone(vocabulary_size=20, num_layers=1, num_query_heads=2,
                                                num_key_value_heads=1, hidden_dim=8, intermediate_dim=6,
                                                num_experts=EXPERTS, top_k=2)
    model = keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)
    entries, unsupported, parameters = walk(model, "warn", None)
    assert unsupported == [] and coverage(parameters) == 1.0
    experts = [e for e in entries if e.weight.kind == "expert"]
    assert [e.name.rsplit("/", 1)[1] for e in experts] == ["gate", "up", "down"]
    assert [block for block, _, _ in experts[0].weight.blocks] == [str(e) for e in range(EXPERTS)]


def test_expert_rescaling_invariance():
    """Per expert, its up map's output units times positive factors and its down map's inputs
    divided by them (``up · silu(gate)`` is linear in ``up``): the function is unchanged, every
    normalized sharpness stays, the rescaled experts' traces move."""
    model, x, y = _model("mixtral")
    other, _, _ = _model("mixtral")
    up = other.experts._expert_feedforward_intermediate_dense
    down = other.experts._expert_feedforward_output_dense
    units = np.exp(np.linspace(-0.8, 0.8, EXPERTS * INTER)).reshape(EXPERTS, 1, INTER)
    up.assign(np.asarray(up) * units)
    down.assign(np.asarray(down) / units.transpose(0, 2, 1))
    np.testing.assert_allclose(np.asarray(other(x)), np.asarray(model(x)), rtol=1e-6, atol=1e-7)
    before = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), estimator="ggn", progress=False)
    for lb, la in zip(before.layers, after.layers):
        # 1e-5: Mixtral's experts apply SiLU in float32.
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-5), lb.name
    for layer in before.layers:
        if "/up." in layer.name or "/down." in layer.name:
            moved = after.layer(layer.name).hessian_trace
            assert abs(moved - layer.hessian_trace) > 1e-2 * abs(layer.hessian_trace), layer.name
