"""The torch PerturbationModel (method §10) against float64 brute force on tiny models.

Every quantity is checked against an independent computation: per-prediction
losses with torch's own ``F.cross_entropy`` on a hand-moved copy of the model,
gradients with plain autograd and central differences, weight derivatives per
prediction, and the path norm as an explicit sum over paths (MLP) or a hand-folded
forward (CNN). The models are built on the meta device and filled from seeded
generators, so the global RNG is never drawn from.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import normflat  # noqa: E402
from normflat.backends import torch as tb  # noqa: E402
from normflat.engine.options import NSCE_EPS, validate_options  # noqa: E402
from normflat.engine.perturbation import UnsupportedMeasureError  # noqa: E402

DT = torch.float64
SCOPE = ("path_norm is defined for feed-forward ReLU networks of dense and convolution layers "
         "(inference-mode BatchNorm is folded); leave 'path_norm' out of measures=... for this model")


# ----------------------------------------------------------------------------- models and data


def _filled(model: nn.Module, seed: int) -> nn.Module:
    """``model`` (built on the meta device) on the CPU in float64, every tensor drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    model = model.to_empty(device="cpu").to(DT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.6 * torch.randn(p.shape, generator=g, dtype=DT))
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g, dtype=DT))
            elif name.endswith("running_mean"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=DT))
            else:
                b.zero_()
    return model.eval()


def mlp(seed=0):
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    return _filled(m, seed)


def cnn(seed=1):
    with torch.device("meta"):
        m = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Dropout(0.3), nn.Linear(12, 4))
    return _filled(m, seed)


def grouped_cnn(seed=2):
    with torch.device("meta"):
        m = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.BatchNorm2d(4, affine=False), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 3))
    return _filled(m, seed)


class TokenLM(nn.Module):
    """Token logits ``(n, T, C)``: an embedding tied to the head, and packed attention projections."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 6)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h + a)


def token_lm(seed=3):
    with torch.device("meta"):
        m = TokenLM()
    m = _filled(m, seed)
    m.head.weight = m.emb.weight  # to_empty unties parameters: tie them again
    return m


def batches_of(x, y, sizes):
    out, start = [], 0
    for size in sizes:
        out.append((x[start:start + size], y[start:start + size]))
        start += size
    return out


def vector_data(seed=10, n=7, classes=3):
    g = torch.Generator().manual_seed(seed)
    return batches_of(torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g),
                      (4, n - 4))


def image_data(seed=11, n=6, classes=4):
    g = torch.Generator().manual_seed(seed)
    return batches_of(torch.randn(n, 2, 4, 4, generator=g, dtype=DT),
                      torch.randint(0, classes, (n,), generator=g), (2, n - 2))


def token_data(seed=12, n=5, tokens=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (n, tokens), generator=g)
    labels = torch.randint(0, 6, (n, tokens), generator=g)
    labels[0, 1] = labels[2, 4] = labels[3, 0] = -100  # ignored tokens
    return batches_of(ids, labels, (2, n - 2))


#: ``(report name, parameter name, layout)`` of each model's weights: ``"same"`` (torch is
#: canonical), ``"T"`` (canonical is the transpose) or ``(start, stop)`` canonical rows.
LAYOUTS = {
    "mlp": [("0", "0.weight", "same"), ("2", "2.weight", "same"), ("4", "4.weight", "same")],
    "cnn": [("0", "0.weight", "same"), ("6", "6.weight", "same")],
    "token": [("emb", "emb.weight", "T"), ("attn.query", "attn.in_proj_weight", (0, 4)),
              ("attn.key", "attn.in_proj_weight", (4, 8)), ("attn.value", "attn.in_proj_weight", (8, 12)),
              ("attn.out_proj", "attn.out_proj.weight", "same")],
}
CASES = {
    "mlp": (mlp, vector_data),
    "cnn": (cnn, image_data),
    "token": (token_lm, token_data),
}


def options(loss="nsce", **kw):
    return validate_options(loss=loss, progress=False, **kw)


def canonical(param, layout):
    if layout == "same":
        return param
    if layout == "T":
        return param.transpose(0, 1)
    return param[layout[0]:layout[1]]


def moved_copy(model, case, deltas):
    """A copy of ``model`` with each weight moved by its canonical delta, converted by hand."""
    moved = copy.deepcopy(model)
    params = dict(moved.named_parameters())
    with torch.no_grad():
        for (_, pname, layout), d in zip(LAYOUTS[case], deltas):
            canonical(params[pname], layout).add_(torch.as_tensor(d, dtype=DT))
    return moved


def hand_losses(model, data, loss, shift=False, temperature=1.0):
    """Per-prediction losses (differentiable) and correctness, with torch's own cross-entropy."""
    losses, correct = [], []
    for x, y in data:
        z = model(x)
        if z.dim() == 3:
            if shift:
                z, y = z[:, :-1], y[:, 1:]
            z, y = z.reshape(-1, z.shape[-1]), y.reshape(-1)
            keep = y != -100
            z, y = z[keep], y[keep]
        u = z
        if loss == "nsce":
            zc = z - z.mean(-1, keepdim=True)
            u = temperature * zc / torch.sqrt((zc ** 2).mean(-1, keepdim=True) + NSCE_EPS)
        losses.append(F.cross_entropy(u, y, reduction="none"))
        correct.append(z.argmax(-1) == y)
    return torch.cat(losses), torch.cat(correct)


def random_deltas(pm, seed, scale=0.05):
    rng = np.random.default_rng(seed)
    return [scale * rng.standard_normal(w.shape) for w in pm.weights()]


# ----------------------------------------------------------------------------- layers and weights


@pytest.mark.parametrize("case", sorted(CASES))
def test_names_kinds_and_weights_are_the_reports(case):
    build, make_data = CASES[case]
    model, data = build(), make_data()
    report = normflat.analyze(model, data, estimator="exact", progress=False, loss="ce")
    pm = tb.perturbation_model(model, data, options())
    assert pm.names == [layer.name for layer in report.layers]
    assert pm.kinds == [layer.kind for layer in report.layers]
    assert pm.names == [name for name, _, _ in LAYOUTS[case]]
    params = dict(model.named_parameters())
    weights = pm.weights()
    for (_, pname, layout), w in zip(LAYOUTS[case], weights):
        assert w.dtype == np.float64 and w.flags.owndata
        np.testing.assert_array_equal(w, canonical(params[pname], layout).detach().numpy())
    weights[0][...] = 0  # a copy: the model's weight is untouched
    assert float(params[LAYOUTS[case][0][1]].detach().abs().sum()) > 0


# ----------------------------------------------------------------------------- evaluate


@pytest.mark.parametrize("loss", ["ce", "nsce"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_evaluate_matches_torch_cross_entropy_at_w_and_at_w_plus_delta(case, loss):
    build, make_data = CASES[case]
    model, data = build(), make_data()
    pm = tb.perturbation_model(model, data, options(loss))
    losses, correct = pm.evaluate(None)
    with torch.no_grad():
        ref, ref_correct = hand_losses(model, data, loss)
    assert losses.dtype == np.float64 and correct.dtype == bool and losses.shape == (ref.numel(),)
    np.testing.assert_allclose(losses, ref.numpy(), rtol=1e-12, atol=0)
    np.testing.assert_array_equal(correct, ref_correct.numpy())

    deltas = random_deltas(pm, seed=5)
    moved = moved_copy(model, case, deltas)
    at_delta, correct_delta = pm.evaluate(deltas)
    np.testing.assert_allclose(at_delta, tb.perturbation_model(moved, data, options(loss)).evaluate(None)[0],
                               rtol=1e-12, atol=0)
    with torch.no_grad():
        ref_delta, ref_correct_delta = hand_losses(moved, data, loss)
    np.testing.assert_allclose(at_delta, ref_delta.numpy(), rtol=1e-12, atol=0)
    np.testing.assert_array_equal(correct_delta, ref_correct_delta.numpy())
    assert not np.allclose(at_delta, losses)  # the deltas did move the weights


def test_evaluate_follows_shift_labels_and_temperature_as_analyze():
    model, data = token_lm(), token_data()
    pm = tb.perturbation_model(model, data, options("nsce", shift_labels=True, temperature=2.0))
    with torch.no_grad():
        ref, _ = hand_losses(model, data, "nsce", shift=True, temperature=2.0)
    np.testing.assert_allclose(pm.evaluate(None)[0], ref.numpy(), rtol=1e-12, atol=0)


def test_evaluate_selects_the_output_and_reads_mapping_batches():
    class DictOut(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            return {"aux": features.sum(-1), "scores": self.inner(features)}

    inner = mlp()
    model = DictOut(inner)
    data = [{"features": x, "labels": y} for x, y in vector_data()]
    pm = tb.perturbation_model(model, data, options("ce", output="scores"))
    assert pm.names == ["inner.0", "inner.2", "inner.4"]
    with torch.no_grad():
        ref, _ = hand_losses(inner, vector_data(), "ce")
    np.testing.assert_allclose(pm.evaluate(None)[0], ref.numpy(), rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- gradient


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_is_autograd_of_the_moved_copy_and_a_central_difference(case):
    build, make_data = CASES[case]
    model, data = build(), make_data()
    pm = tb.perturbation_model(model, data, options("nsce"))
    deltas = random_deltas(pm, seed=6)
    mean, grads = pm.gradient(deltas)

    moved = moved_copy(model, case, deltas)
    params = dict(moved.named_parameters())
    losses, _ = hand_losses(moved, data, "nsce")
    ref_mean = losses.mean()
    names = list(dict.fromkeys(pname for _, pname, _ in LAYOUTS[case]))
    ref = dict(zip(names, torch.autograd.grad(ref_mean, [params[n] for n in names])))
    assert mean == pytest.approx(float(ref_mean.detach()), rel=1e-12)
    assert [g.shape for g in grads] == [w.shape for w in pm.weights()]
    for (_, pname, layout), g in zip(LAYOUTS[case], grads):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, canonical(ref[pname], layout).numpy(), rtol=1e-10, atol=1e-13)

    h = 1e-5
    for layer, entry in ((0, 0), (len(grads) - 1, 3), (len(grads) // 2, 1)):
        def mean_at(step):
            moved_deltas = [d.copy() for d in deltas]
            moved_deltas[layer].reshape(-1)[entry] += step
            return pm.evaluate(moved_deltas)[0].mean()

        central = (mean_at(h) - mean_at(-h)) / (2 * h)
        assert grads[layer].reshape(-1)[entry] == pytest.approx(central, rel=1e-6, abs=1e-9)


def test_gradient_without_a_counted_prediction_is_an_error():
    model = token_lm()
    ids = torch.zeros(2, 5, dtype=torch.long)
    data = [(ids, torch.full((2, 5), -100))]
    with pytest.raises(ValueError, match="no counted prediction"):
        tb.perturbation_model(model, data, options("ce")).gradient(None)


# ----------------------------------------------------------------------------- weight derivatives


@pytest.mark.parametrize("case", sorted(CASES))
def test_weight_derivatives_are_per_prediction_gradients_dotted_with_the_weights(case):
    build, make_data = CASES[case]
    model, data = build(), make_data()
    pm = tb.perturbation_model(model, data, options("nsce"))
    got = pm.weight_derivatives()

    probe = copy.deepcopy(model)
    params = dict(probe.named_parameters())
    weights = [params[n] for n in dict.fromkeys(pname for _, pname, _ in LAYOUTS[case])]
    losses, _ = hand_losses(probe, data, "nsce")
    ref = []
    for i in range(losses.numel()):
        gs = torch.autograd.grad(losses[i], weights, retain_graph=True)
        ref.append(float(sum((g * w.detach()).sum() for g, w in zip(gs, weights))))
    assert got.dtype == np.float64 and got.shape == (losses.numel(),)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)

    # The same as d/dt loss_i(W (1 + t)) at t = 0: a central difference along the weights.
    t = 1e-5
    w = pm.weights()
    central = (pm.evaluate([t * a for a in w])[0] - pm.evaluate([-t * a for a in w])[0]) / (2 * t)
    np.testing.assert_allclose(got, central, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- path norm


def test_squared_output_of_a_mlp_is_the_sum_over_paths():
    model = mlp()
    pm = tb.perturbation_model(model, vector_data(), options())
    (w1, b1), (w2, b2), (w3, b3) = [(model[i].weight.detach().numpy() ** 2, model[i].bias.detach().numpy() ** 2)
                                    for i in (0, 2, 4)]
    total = 0.0
    for o in range(w3.shape[0]):
        total += b3[o]
        for k in range(w3.shape[1]):
            total += b2[k] * w3[o, k]
            for j in range(w2.shape[1]):
                total += b1[j] * w2[k, j] * w3[o, k]
                for i in range(w1.shape[1]):
                    total += w1[j, i] * w2[k, j] * w3[o, k]  # input entry i is 1
    assert pm.squared_output() == pytest.approx(total, rel=1e-12)
    # The einsum form of the same sum.
    paths = np.einsum("ok,kj,ji->", w3, w2, w1) + np.einsum("ok,kj,j->", w3, w2, b1) + (w3 @ b2).sum() + b3.sum()
    assert total == pytest.approx(paths, rel=1e-12)


def _folded(bn):
    a = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        a = bn.weight * a
    b = -a * bn.running_mean
    if bn.bias is not None:
        b = b + bn.bias
    return (a ** 2)[:, None, None], (b ** 2)[:, None, None]


def test_squared_output_of_a_cnn_folds_inference_batchnorm_then_squares():
    model = cnn()
    pm = tb.perturbation_model(model, image_data(), options())
    conv, bn, lin = model[0], model[1], model[6]
    with torch.no_grad():
        a2, b2 = _folded(bn)
        h = F.conv2d(torch.ones(1, 2, 4, 4, dtype=DT), conv.weight ** 2, conv.bias ** 2, padding=1)
        h = torch.relu(a2 * h + b2)
        h = F.max_pool2d(h, 2).flatten(1)
        ref = float(F.linear(h, lin.weight ** 2, lin.bias ** 2).sum())
    assert pm.squared_output() == pytest.approx(ref, rel=1e-12)

    model = grouped_cnn()
    pm = tb.perturbation_model(model, image_data(), options())
    conv, bn, lin = model[0], model[1], model[6]
    with torch.no_grad():
        a2, b2 = _folded(bn)
        h = F.conv2d(torch.ones(1, 2, 4, 4, dtype=DT), conv.weight ** 2, conv.bias ** 2, groups=2)
        h = torch.relu(a2 * h + b2).mean((2, 3))
        ref = float(F.linear(h, lin.weight ** 2, lin.bias ** 2).sum())
    assert pm.squared_output() == pytest.approx(ref, rel=1e-12)


def test_squared_output_of_a_module_with_a_functional_relu_forward():
    class Net(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = F.relu(self.inner[0](x))
            h = torch.relu(self.inner[2](h))
            return self.inner[4](h.view(h.size(0), -1))

    inner = mlp()
    expected = tb.perturbation_model(inner, vector_data(), options()).squared_output()
    got = tb.perturbation_model(Net(inner), vector_data(), options()).squared_output()
    assert got == pytest.approx(expected, rel=1e-14)


class TanhForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class ResidualForward(nn.Module):
    def __init__(self, shift=None):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.shift = shift

    def forward(self, x):
        h = x + self.a(x)
        return self.b(h if self.shift is None else h + self.shift)


def test_squared_output_sums_the_paths_of_a_residual_block():
    with torch.device("meta"):
        model = ResidualForward()
    model = _filled(model, 4)
    pm = tb.perturbation_model(model, vector_data(), options())
    a, b = model.a, model.b
    with torch.no_grad():
        # The skip path carries the input (ones) unchanged; the branch its squared layer.
        h = torch.ones(4, dtype=DT) + (a.weight ** 2) @ torch.ones(4, dtype=DT) + a.bias ** 2
        expected = float(((b.weight ** 2) @ h + b.bias ** 2).sum())
    assert pm.squared_output() == pytest.approx(expected, rel=1e-13)


@pytest.mark.parametrize("build, named", [
    (lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.ReLU(), nn.Linear(5, 3)), "Layer '1' (LayerNorm)"),
    (lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "Layer '1' (Tanh)"),
    (lambda: nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5, track_running_stats=False), nn.Linear(5, 3)),
     "Layer '1' (BatchNorm1d)"),
    (lambda: nn.Sequential(ScaledLinear(4, 5), nn.ReLU(), nn.Linear(5, 3)),
     "Layer '0' (ScaledLinear) (it overrides the forward of Linear)"),
    (TanhForward, "calls torch.tanh"),
    (lambda: ResidualForward(shift=1.0), "The forward of ResidualForward calls"),
])
def test_squared_output_refuses_what_is_not_a_relu_network(build, named):
    with torch.device("meta"):
        model = build()
    model = _filled(model, 4)
    pm = tb.perturbation_model(model, vector_data(), options())
    with pytest.raises(UnsupportedMeasureError) as info:
        pm.squared_output()
    assert named in str(info.value) and SCOPE in str(info.value)
    assert pm.evaluate(None)[0].shape == (7,)  # the other measures still work


def test_squared_output_refuses_several_or_keyword_inputs():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x, z):
            return self.a(x)

    with torch.device("meta"):
        two = Two()
    two = _filled(two, 5)
    data = [((x, x), y) for x, y in vector_data()]
    with pytest.raises(UnsupportedMeasureError, match="takes 2 inputs") as info:
        tb.perturbation_model(two, data, options()).squared_output()
    assert SCOPE in str(info.value)

    class Keywords(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, features):
            return self.inner(features)

    data = [{"features": x, "labels": y} for x, y in vector_data()]
    pm = tb.perturbation_model(Keywords(mlp()), data, options())
    with pytest.raises(UnsupportedMeasureError, match=r"keyword inputs \(\['features'\]\)") as info:
        pm.squared_output()
    assert SCOPE in str(info.value)


# ----------------------------------------------------------------------------- the user's model


def _snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "modes": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "grad_values": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    }


def _assert_same(before, after):
    assert before["modes"] == after["modes"]
    assert before["requires_grad"] == after["requires_grad"]
    assert all(a is b for a, b in zip(before["grads"], after["grads"]))
    for a, b in zip(before["grad_values"], after["grad_values"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k


def test_the_users_model_is_unchanged_and_runs_in_inference_mode():
    model = cnn().train()  # BatchNorm would update its statistics, dropout would drop
    model[0].bias.requires_grad_(False)
    model[6].weight.grad = torch.full_like(model[6].weight, 0.25)
    data = image_data()
    before = _snapshot(model)
    pm = tb.perturbation_model(model, data, options())
    deltas = random_deltas(pm, seed=7)
    losses, _ = pm.evaluate(deltas)
    _assert_same(before, _snapshot(model))
    pm.gradient(deltas)
    _assert_same(before, _snapshot(model))
    pm.weight_derivatives()
    _assert_same(before, _snapshot(model))
    pm.squared_output()
    _assert_same(before, _snapshot(model))
    pm.close()
    pm.close()  # idempotent
    _assert_same(before, _snapshot(model))
    with torch.no_grad():
        ref, _ = hand_losses(moved_copy(model, "cnn", deltas).eval(), data, "nsce")
    np.testing.assert_allclose(losses, ref.numpy(), rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError, match="closed"):
        pm.evaluate(None)


def test_calls_under_inference_mode_and_no_grad():
    model, data = mlp(), vector_data()
    pm = tb.perturbation_model(model, data, options())
    expected = pm.gradient(None)[1]
    with torch.inference_mode():
        got = pm.gradient(None)[1]
    with torch.no_grad():
        derivatives = pm.weight_derivatives()
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(derivatives, pm.weight_derivatives())


def test_float32_model_computes_in_float32_and_returns_float64():
    model, data = mlp(), vector_data()
    single = copy.deepcopy(model).float()
    pm32 = tb.perturbation_model(single, [(x.float(), y) for x, y in data], options())
    pm64 = tb.perturbation_model(model, data, options())
    losses32 = pm32.evaluate(None)[0]
    assert losses32.dtype == np.float64
    np.testing.assert_allclose(losses32, pm64.evaluate(None)[0], rtol=1e-5)
    assert not np.array_equal(losses32, pm64.evaluate(None)[0])


# ----------------------------------------------------------------------------- bad input


def test_bad_deltas_and_options_are_clear_errors():
    model, data = mlp(), vector_data()
    pm = tb.perturbation_model(model, data, options())
    deltas = random_deltas(pm, seed=8)
    with pytest.raises(ValueError, match="list of 3 arrays"):
        pm.evaluate(deltas[:2])
    with pytest.raises(ValueError, match=r"layer '2' has shape \(4, 4\).*canonical shape \(4, 5\)"):
        pm.evaluate([deltas[0], np.zeros((4, 4)), deltas[2]])
    deltas[1][0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        pm.gradient(deltas)
    # analyze's options are accepted (normflat.measures passes the same ones) and checked as there.
    tb.perturbation_model(model, data, options(), chunk_size=2, force=True, distributed=False)
    with pytest.raises(TypeError, match=r"Unknown option\(s\) for the torch backend: \['chunks'\]"):
        tb.perturbation_model(model, data, options(), chunks=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        tb.perturbation_model(model, data, options(), chunk_size=0)
    with pytest.raises(ValueError, match="this process's data only"):
        tb.perturbation_model(model, data, options(), distributed=True)
