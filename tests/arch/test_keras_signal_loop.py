"""The Keras GGN step with its signals' back-propagations looped (``tf.map_fn``), not unrolled.

A compiled GGN step back-propagates a block of signals, one backward pass per signal. It
unrolls them in the graph while the graph stays small, and loops over them above
``ggn.UNROLL_OPS`` (block × the forward pass's graph operations; Keras guide, "Performance").
The tiny models of the brute-force tests all fall under the threshold, so each case here
forces the loop (``UNROLL_OPS = 0``) and runs a brute-force test of another module unchanged:
every fast rule the loop feeds (dense, einsum and attention, convolutions and their
transposes, pooling by argmax, embeddings and tied tables, recurrent steps, token logits, the
structured head's signals, an output the logits do not reach) against its reference. A spy
checks that some step of each case did loop.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import pytest  # noqa: E402

from normflat.backends.keras import ggn  # noqa: E402
from tests.arch import test_keras_layers as layers  # noqa: E402
from tests.backends import test_keras as backend  # noqa: E402
from tests.backends import test_keras_topk as topk  # noqa: E402


def _spy(monkeypatch):
    """The ``(block, unrolled)`` of each GGN step traced from now on (filled as they are traced)."""
    traced = []
    original = ggn._signal_gradients

    def spy(tape, target, pre, signals, block, unrolled):
        traced.append((block, unrolled))
        return original(tape, target, pre, signals, block, unrolled)

    monkeypatch.setattr(ggn, "_signal_gradients", spy)
    return traced


@pytest.fixture
def looped(monkeypatch):
    """Every step of more than one signal loops; yields the ``(block, unrolled)`` of each step traced."""
    traced = _spy(monkeypatch)
    monkeypatch.setattr(ggn, "UNROLL_OPS", 0)
    yield traced
    assert any(block > 1 and not unrolled for block, unrolled in traced), traced


CASES = {
    "attention-called-twice": layers.test_multi_head_attention_called_twice_fast_rule,
    "attention": lambda: layers.test_multi_head_attention_ggn(layers.attention_model_problem(), "nsce"),
    "recurrent": lambda: layers.test_recurrent_layers_ggn_through_time(layers.recurrent_model_problem()),
    "token-logits": lambda: layers.test_token_logits_with_ignore_index(layers.token_model_problem(), "ce"),
    "embedding": lambda: layers.test_embedding_with_repeated_ids(True),
    "tied-table": lambda: layers.test_tied_reversible_embedding_fast_rule("tied"),
    "transposed-conv": lambda: layers.test_transposed_convolutions_fast_rule("2d"),
    "unreached-output": layers.test_fast_layer_whose_output_the_logits_do_not_reach,
    "relu-cnn": lambda: backend.test_ggn_equals_hessian_on_relu_nets_with_ce(backend.relu_cnn),
    "conv-zoo": lambda: backend.test_ggn_equals_brute_force_jthj_on_smooth_nets("nsce"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_looped_signals_equal_brute_force(case, looped):
    CASES[case]()


def test_looped_structured_head_signals_equal_generic(looped, monkeypatch):
    """The structured head's signals (many classes, started at the head's input) looped."""
    topk.test_ggn_structured_head_equals_generic("nsce", monkeypatch)


def test_small_graphs_unroll_and_large_ones_loop(monkeypatch):
    """The rule itself: the same model's step unrolls under the threshold and loops over it."""
    traced = _spy(monkeypatch)
    layers.test_multi_head_attention_ggn(layers.attention_model_problem(), "ce")
    assert traced and all(unrolled for _, unrolled in traced), traced
    traced.clear()
    monkeypatch.setattr(ggn, "UNROLL_OPS", 1)
    layers.test_multi_head_attention_ggn(layers.attention_model_problem(), "ce")
    assert traced and not any(unrolled for _, unrolled in traced), traced
