"""Torch sequence models: invariances of attention, embeddings and recurrent layers (method §8,
items 5–7), token logits with keyword batches and model outputs (method §6.3, §9), and the
errors for bad sequence data."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import nn

import normflat
from tests.arch import _torch_reference as ref
from tests.arch.test_torch_layers import DT, TinyLM, TokenTagger, _ids, _init, _labels

V, D, T, N, C = 13, 8, 5, 3, 4


def _analyze(model, data, **kw):
    return normflat.analyze(model, data, progress=False, **kw)


def _assert_invariant(before, after, x_call):
    """Function unchanged, normalized sharpness unchanged per layer and in total, trace moved."""
    with torch.no_grad():
        a, b = x_call(before), x_call(after)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    data = x_call.data
    r0, r1 = _analyze(before, data), _analyze(after, data)
    assert [layer.name for layer in r0.layers] == [layer.name for layer in r1.layers]
    for l0, l1 in zip(r0.layers, r1.layers):
        assert math.isclose(l0.normalized_sharpness, l1.normalized_sharpness, rel_tol=1e-8), l0.name
    assert math.isclose(r0.normalized_sharpness, r1.normalized_sharpness, rel_tol=1e-8)
    assert not math.isclose(r0.hessian_trace, r1.hessian_trace, rel_tol=1e-3)


class _Call:
    def __init__(self, data):
        self.data = data

    def __call__(self, model):
        x = self.data[0][0]
        return model(*x) if isinstance(x, tuple) else model(x)


class AttentionTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.att = nn.MultiheadAttention(D, 2, batch_first=True)
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        h = self.emb(ids)
        a, _ = self.att(h, h, h)
        return self.head(torch.tanh(a + h))


def _head_factors(heads, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(heads, generator=g, dtype=DT) * 3 + 0.3


def test_attention_per_head_query_key_and_value_output_rescaling():
    model = _init(AttentionTagger())
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    att, hd = moved.att, D // 2
    cq = _head_factors(2, 5).repeat_interleave(hd)  # one factor per head, over its rows
    cv = _head_factors(2, 6).repeat_interleave(hd)
    with torch.no_grad():
        w, b = att.in_proj_weight, att.in_proj_bias  # packed (3E, E): query, key, value rows
        w[:D] *= cq[:, None]
        b[:D] *= cq
        w[D:2 * D] /= cq[:, None]
        b[D:2 * D] /= cq
        w[2 * D:] *= cv[:, None]
        b[2 * D:] *= cv
        att.out_proj.weight /= cv[None, :]
    _assert_invariant(model, moved, _Call(data))


class EmbedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, 6)
        self.head = nn.Linear(6, C)

    def forward(self, ids):
        return self.head(torch.tanh(self.proj(self.emb(ids))))


def test_embedding_feature_scaling_against_the_next_linear():
    model = _init(EmbedLinear())
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 7)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.proj.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


class RecurrentTagger(nn.Module):
    def __init__(self, cell, **kw):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.rnn = cell(D, 4, batch_first=True, **kw)
        self.head = nn.Linear(4, C)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


def test_relu_rnn_hidden_unit_rescaling():
    model = _init(RecurrentTagger(nn.RNN, nonlinearity="relu"))
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(4, 8)
    with torch.no_grad():
        r = moved.rnn
        r.weight_ih_l0 *= c[:, None]
        r.bias_ih_l0 *= c
        r.bias_hh_l0 *= c
        r.weight_hh_l0.copy_(c[:, None] * r.weight_hh_l0 / c[None, :])  # D W D^-1
        moved.head.weight /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_gated_input_column_scaling_against_a_scaled_embedding(cell):
    model = _init(RecurrentTagger(cell))
    data = [(_ids(N, T), _labels(N, T))]
    moved = copy.deepcopy(model)
    c = _head_factors(D, 9)
    with torch.no_grad():
        moved.emb.weight *= c[None, :]
        moved.rnn.weight_ih_l0 /= c[None, :]
    _assert_invariant(model, moved, _Call(data))


# ----------------------------------------------------------------------------- token logits


def test_keyword_batches_model_outputs_and_chunking():
    model = _init(TinyLM())
    ids = _ids(2, T, seed=3)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    whole = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False)
    chunked = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False, chunk_size=1)
    for k in whole:
        assert torch.allclose(torch.as_tensor(whole[k]), torch.as_tensor(chunked[k]), rtol=1e-10, atol=0)
    # output= picks the logits by key or callable, the same numbers.
    by_key = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False, output="logits")
    by_call = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False,
                                        output=lambda out: out["logits"])
    for k in whole:
        assert torch.equal(torch.as_tensor(whole[k]), torch.as_tensor(by_key[k]))
        assert torch.equal(torch.as_tensor(whole[k]), torch.as_tensor(by_call[k]))


def test_token_logits_ggn_mc_within_its_standard_error_of_ggn():
    model = _init(TokenTagger())
    data = [(_ids(N, T), _labels(N, T))]
    ggn = _analyze(model, data)
    mc = _analyze(model, data, estimator="ggn-mc", samples=400, seed=1)
    # ggn-mc with many draws per token is within a few of its own standard errors of ggn.
    se = mc.standard_error["hessian_trace"]
    assert abs(mc.hessian_trace - ggn.hessian_trace) < 5 * se
    assert mc.metadata["loss_terms"] == ggn.metadata["loss_terms"] == N * T


def test_padding_mask_keyword_reaches_the_model():
    model = _init(TinyLM(tied=False))
    ids = _ids(2, T, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 3:] = 0
    labels = ids.clone()
    labels[mask == 0] = ref.IGNORE
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    data = [({"input_ids": ids, "attention_mask": mask}, labels)]
    got = normflat.hessian_diagonal(model, batch, shift_labels=True, progress=False)
    want = ref.problems(model, ref.ggn_diagonal(model, data, "nsce", shift=True), {"pos_embed": D})
    for k in want:
        err = (torch.as_tensor(got[k]) - want[k]).abs().max() / want[k].abs().max()
        assert err < 1e-10, k


def test_the_model_is_untouched_and_analyses_run_in_threads():
    model = _init(TinyLM())
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = _ids(2, T)
    batch = {"input_ids": ids, "labels": ids}
    results = {}

    def run(key, m):
        results[key] = normflat.hessian_diagonal(m, batch, estimator="hutchinson", samples=2,
                                                 shift_labels=True, progress=False)

    threads = [threading.Thread(target=run, args=(i, copy.deepcopy(model))) for i in range(2)]
    for t in threads:
        t.start()
    run("main", model)
    for t in threads:
        t.join()
    assert model.training and not any(p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    for k in results["main"]:
        assert torch.equal(torch.as_tensor(results[0][k]), torch.as_tensor(results["main"][k]))


# ----------------------------------------------------------------------------- errors


def test_token_errors_are_clear():
    model = _init(TokenTagger())
    ids = _ids(N, T)
    with pytest.raises(ValueError, match="one class per sample"):
        _analyze(model, (ids, _labels(N)))
    bad = _labels(N, T)
    bad[0, 0] = C
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        _analyze(model, (ids, bad))
    with pytest.raises(ValueError, match="ignore"):
        _analyze(model, (ids, torch.full((N, T), ref.IGNORE)))


def test_output_without_logits_is_clear():
    class NoLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return {"hidden": self.lin(x)}

    model = NoLogits().to(DT)
    data = (torch.randn(3, 4, dtype=DT), torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="output="):
        _analyze(model, data)
    report = _analyze(model, data, output="hidden")
    assert report.layers[0].name == "lin"


def test_embedding_max_norm_is_refused_and_the_table_unchanged():
    model = _init(TokenTagger())
    model.emb.max_norm = 0.1
    before = model.emb.weight.detach().clone()
    with pytest.raises(ValueError, match="max_norm"):
        _analyze(model, (_ids(N, T), _labels(N, T)))
    assert torch.equal(model.emb.weight, before)


def test_token_signals_formed_a_few_tokens_at_a_time_give_the_same_diagonal(monkeypatch):
    from normflat.backends.torch import session as torch_session

    model = _init(TinyLM(tied=False))
    ids = _ids(1, T, seed=9)
    data = [(ids, ids)]
    whole = normflat.hessian_diagonal(model, data, shift_labels=True, progress=False)
    monkeypatch.setattr(torch_session, "TOKEN_SIGNAL_ENTRIES", 1)  # one token per block of signals
    blocks = normflat.hessian_diagonal(model, data, shift_labels=True, progress=False)
    for k in whole:
        assert torch.allclose(torch.as_tensor(whole[k]), torch.as_tensor(blocks[k]), rtol=1e-12, atol=0), k
