"""The Keras rescaling tests (method §8), run on Keras' JAX backend (``KERAS_BACKEND=jax``).

Every Keras layer kind has a function-preserving rescaling test, written against the Keras API and
run on the TensorFlow backend in the test process. A model on Keras' JAX backend is analyzed by
normflat's JAX backend (program analysis, its own fast rules and generic path), so the same tests
run here again, in a fresh interpreter on the JAX backend in float64, where every analysis is
checked to be the JAX backend's: the function unchanged, every normalized sharpness unchanged, the
rescaled layers' traces moved, each layer on the path the test expects on that backend. Keras'
JAX backend computes parts of a float64 model in float32 (its type promotion maps float64 to
float32), so a test whose model runs such an operation compares at float32's accuracy there
(``tests/arch/_keras_invariance.py``).

Not run here, each for a reason outside normflat or specific to the TensorFlow side: the tanh
``SimpleRNN`` (Keras' own JAX scan fails on its float64 carry, which its ``tanh`` demotes to
float32); the ``MaxPooling1D`` test (it spies on the TensorFlow backend's pooling scatter); the
batch folded into windows (a test layer whose reshape Keras' JAX backend cannot infer for a
symbolic batch); Qwen3.5's gated delta net (its brute force is a TensorFlow tape; its reading on JAX
is compared with TensorFlow's in ``tests/backends/test_keras_hub_on_jax.py``); RWKV-7's own
matrices (they take the JAX backend's fast dense rule, rescaled in ``tests/arch/test_jax_rescalings.py``;
the model compiles for about 20 s on JAX, and its numbers equal TensorFlow's in
``tests/backends/test_keras_hub_on_jax.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.builders import require_frameworks

require_frameworks("keras", "tensorflow", "jax", "keras_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The convolution kinds (plain and grouped 1-D to 3-D, transposed 1-D to 3-D, depthwise with a depth
#: multiplier, separable) and multi-axis ``EinsumDense`` kernels: 9 tests, every layer in float64.
CONVOLUTIONS = [f"tests/arch/test_keras_rescalings.py::{name}" for name in (
    "test_einsum_dense_multi_axis_feature_rescaling", "test_conv_channel_rescaling_plain_and_grouped",
    "test_transposed_conv_channel_rescaling", "test_depthwise_conv_with_depth_multiplier_rescaling",
    "test_separable_conv1d_depthwise_and_pointwise_rescaling")]

#: The other kinds: attention (multi-head, called twice, grouped-query), embeddings (looked up once and
#: twice, position ids, keras-hub's position and DeBERTa-v3 relative tables, the tied and untied
#: reversible embeddings), recurrent input kernels (LSTM, GRU both ways) and a ReLU ``SimpleRNN``'s
#: hidden units, a layer shared across depth, LoRA factors and the experts layers (Mixtral, Qwen-MoE,
#: GPT-OSS): 19 tests.
OTHER_KINDS = [
    "tests/arch/test_keras_rescalings.py::test_group_query_attention_per_key_value_head_rescalings",
    "tests/arch/test_keras_rescalings.py::test_keras_hub_position_embedding_feature_rescaling",
    "tests/arch/test_keras_rescalings.py::test_keras_hub_relative_embedding_position_rescaling",
    "tests/arch/test_keras_rescalings.py::test_keras_hub_packed_experts_rescaling",
    "tests/arch/test_keras_rescalings.py::test_recurrent_input_kernels_against_embedding_features[gru-reset-after]",
    "tests/arch/test_keras_layers.py::test_attention_per_head_rescalings_are_invariant",
    "tests/arch/test_keras_layers.py::test_multi_head_attention_called_twice_per_head_rescalings_are_invariant",
    "tests/arch/test_keras_layers.py::test_embedding_feature_rescaling_is_invariant",
    "tests/arch/test_keras_layers.py::test_embedding_looked_up_twice_feature_rescaling_is_invariant",
    "tests/arch/test_keras_layers.py::test_position_ids_embedding_rescaling_invariance",
    "tests/arch/test_keras_layers.py::test_relu_rnn_hidden_unit_rescaling_is_invariant",
    "tests/arch/test_keras_layers.py::test_dense_called_several_times_conjugation_is_invariant",
    "tests/arch/test_keras_layers.py::test_untied_reverse_projection_rescaling_is_invariant",
    "tests/arch/test_keras_models.py::test_tied_reversible_embedding_feature_rescaling_is_invariant",
    "tests/arch/test_keras_recurrent.py::test_input_feature_rescaling_is_invariant",
    "tests/arch/test_keras_lora.py::test_lora_rank_rescaling_leaves_normalized_sharpness_unchanged",
    "tests/arch/test_keras_moe.py::test_expert_rescaling_invariance",
]

#: Runs pytest on the JAX backend with every analysis checked to be the JAX backend's (not a fallback
#: to TensorFlow).
RUNNER = """
import sys, keras, normflat, pytest
assert keras.backend.backend() == "jax"
analyze = normflat.analyze
def on_jax(*args, **kwargs):
    report = analyze(*args, **kwargs)
    assert report.metadata["framework"] == "jax", report.metadata["framework"]
    return report
normflat.analyze = on_jax
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"] + sys.argv[1:]))
"""


def _run_on_jax(tests: list[str], expected: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *tests], capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", JAX_ENABLE_X64="1"))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and summary.startswith(f"{expected} passed") and "skipped" not in summary, \
        done.stdout[-4000:] + done.stderr[-2000:]


def test_keras_convolution_rescalings_hold_on_the_jax_backend():
    """:data:`CONVOLUTIONS` on Keras' JAX backend, each layer on its fast rule."""
    _run_on_jax(CONVOLUTIONS, 9)


def test_keras_rescalings_of_the_other_kinds_hold_on_the_jax_backend():
    """:data:`OTHER_KINDS` on Keras' JAX backend: the recurrent cells' kernels used inside the traced scan
    on the generic path, the experts' matrices on the fast dense rule."""
    _run_on_jax(OTHER_KINDS, 19)
