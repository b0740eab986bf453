"""PyTorch backend: estimators against float64 brute force, model safety, bad input."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, hessian, jacrev  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import normflat  # noqa: E402
from normflat.backends import torch as tb  # noqa: E402
from normflat.backends.torch.session import TorchSession  # noqa: E402
from normflat.backends.torch import ggn as ggn_kernels  # noqa: E402
from normflat.engine.options import NSCE_EPS  # noqa: E402

DT = torch.float64


# ----------------------------------------------------------------------------- models


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _randomize_bn(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g))
                m.weight.copy_(1 + 0.2 * torch.randn(m.num_features, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=g))
    return model


def mlp_tanh():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def mlp_relu():
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))


def cnn_relu():
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.ReLU(inplace=True), nn.Flatten(),
                         nn.Linear(36, 3))


def cnn_smooth():
    return nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="reflect"), nn.BatchNorm2d(3),
                         nn.Tanh(), nn.Conv2d(3, 4, 2, dilation=2, padding="same"), nn.Softplus(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5), nn.LayerNorm(5),
                         nn.GELU(), nn.Dropout(0.5), nn.Linear(5, 3))


def res_block():
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), Residual(3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 3))


def conv_nd():
    return nn.Sequential(nn.Conv1d(2, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 2, groups=4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(12, 3))


def conv3d():
    return nn.Sequential(nn.Conv3d(1, 2, 2, padding=1, padding_mode="circular"), nn.ReLU(),
                         nn.Conv3d(2, 4, (1, 2, 2), stride=(1, 2, 1), groups=2), nn.ReLU(),
                         nn.AdaptiveMaxPool3d(1), nn.Flatten(), nn.Linear(4, 3))


def conv_transpose():
    return nn.Sequential(nn.ConvTranspose2d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
                         nn.ReLU(), nn.ConvTranspose2d(4, 2, 2, dilation=2), nn.ReLU(), nn.Flatten(),
                         nn.LazyLinear(3))


MODELS = {  # name -> (factory, input shape per sample)
    "mlp_tanh": (mlp_tanh, (4,)),
    "mlp_relu": (mlp_relu, (4,)),
    "cnn_relu": (cnn_relu, (2, 6, 6)),
    "cnn_smooth": (cnn_smooth, (2, 6, 6)),
    "res_block": (res_block, (2, 4, 4)),
    "conv1d": (conv_nd, (2, 8)),
    "conv3d": (conv3d, (1, 3, 3, 3)),
    "conv_transpose": (conv_transpose, (2, 3, 3)),
}


def make(name, n=7, seed=0, dtype=DT):
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    model = factory()
    x = torch.randn(n, *shape)
    model(x)  # materialize lazy modules
    model = _randomize_bn(model, seed).to(dtype).eval()
    y = torch.randint(0, 3, (n,))
    return model, x.to(dtype), y


def weight_names(model):
    return {name: (name[: -len(".weight")] if name != "weight" else type(model).__name__)
            for name, p in model.named_parameters() if name.endswith("weight") and p.dim() >= 2}


# ----------------------------------------------------------------------------- references


def loss_fn(loss, logits, y, tau=1.0):
    if loss == "ce":
        return F.cross_entropy(logits, y)
    z = logits - logits.mean(1, keepdim=True)
    z = z / torch.sqrt((z**2).mean(1, keepdim=True) + NSCE_EPS)
    return F.cross_entropy(tau * z, y)


def brute_hessian_diag(model, x, y, loss="ce"):
    """Diagonal of torch.func.hessian of the mean loss, per weight tensor (torch layout)."""
    out = {}
    for pname, lname in weight_names(model).items():
        w = dict(model.named_parameters())[pname].detach()

        def f(wt):
            return loss_fn(loss, functional_call(model, {pname: wt}, (x,), strict=False), y)

        out[lname] = hessian(f)(w).reshape(w.numel(), w.numel()).diagonal().reshape(w.shape).detach()
    return out


def brute_ggn_diag(model, x, y, loss="ce", tau=1.0):
    """diag(Σ_n J_nᵀ (diag p − p pᵀ) J_n)/N with J the Jacobian of the (normalized) logits."""
    out = {}
    for pname, lname in weight_names(model).items():
        w = dict(model.named_parameters())[pname].detach()

        def z_of(wt):
            z = functional_call(model, {pname: wt}, (x,), strict=False)
            if loss == "nsce":
                z = z - z.mean(1, keepdim=True)
                z = tau * z / torch.sqrt((z**2).mean(1, keepdim=True) + NSCE_EPS)
            return z

        z = z_of(w).detach()
        p = torch.softmax(z, 1)
        hout = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        J = jacrev(z_of)(w).reshape(z.shape[0], z.shape[1], -1)  # (N, C, P)
        ggn = (torch.matmul(hout, J) * J).sum((0, 1)) / z.shape[0]  # diag of Σ_n J_nᵀ H_n J_n
        out[lname] = ggn.reshape(w.shape).detach()
    return out


def canonical(model, name, t):
    mod = dict(model.named_modules())[name]
    if isinstance(mod, nn.modules.conv._ConvTransposeNd):
        g = mod.groups
        cin, cout_g, *k = t.shape
        return t.reshape(g, cin // g, cout_g, *k).transpose(1, 2).reshape(g * cout_g, cin // g, *k)
    return t


def assert_diag_close(got, want, model, atol=1e-8, rtol=1e-7):
    assert list(got) == list(want), "layers or their order differ"
    for name in want:
        w = canonical(model, name, want[name])
        assert got[name].shape == w.shape, name
        torch.testing.assert_close(got[name], w, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def nf(model, data, **kw):
    kw.setdefault("progress", False)
    return normflat.hessian_diagonal(model, data, **kw)


# ----------------------------------------------------------------------------- exact


@pytest.mark.parametrize("name", ["mlp_tanh", "cnn_relu", "res_block", "cnn_smooth", "conv_transpose"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_exact_matches_torch_func_hessian(name, loss):
    model, x, y = make(name)
    got = nf(model, (x, y), loss=loss, estimator="exact")
    assert_diag_close(got, brute_hessian_diag(model, x, y, loss), model, atol=1e-10, rtol=1e-8)


def test_exact_custom_loss_callable_and_uneven_batches():
    model, x, y = make("mlp_tanh", n=10)

    def my_loss(logits, labels):
        return F.cross_entropy(logits, labels) + 0.1 * (logits**2).mean()

    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # batches 4, 4, 2: mean over all samples
    got = nf(model, loader, loss=my_loss, estimator="exact")
    want = {}
    for pname, lname in weight_names(model).items():
        w = dict(model.named_parameters())[pname].detach()
        f = lambda wt, pname=pname: my_loss(functional_call(model, {pname: wt}, (x,), strict=False), y)  # noqa: E731
        want[lname] = hessian(f)(w).reshape(w.numel(), w.numel()).diagonal().reshape(w.shape)
    assert_diag_close(got, want, model, atol=1e-10, rtol=1e-8)


def test_exact_size_limit_and_force():
    model, x, y = make("mlp_tanh")
    with pytest.raises(ValueError, match="force=True"):
        nf(model, (x, y), estimator="exact", max_exact_params=10)
    forced = nf(model, (x, y), estimator="exact", max_exact_params=10, force=True)
    assert_diag_close(forced, nf(model, (x, y), estimator="exact"), model, atol=0, rtol=0)


# ----------------------------------------------------------------------------- ggn


@pytest.mark.parametrize("name", ["mlp_relu", "cnn_relu", "conv1d", "conv3d", "conv_transpose"])
def test_ggn_equals_exact_hessian_on_piecewise_linear_nets_with_ce(name):
    model, x, y = make(name)
    exact = brute_hessian_diag(model, x, y, "ce")
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert all(layer.details["path"] == "fast" for layer in report.layers)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn"), exact, model, atol=1e-10, rtol=1e-8)
    generic = nf(model, (x, y), loss="ce", estimator="ggn", fast=False)
    assert_diag_close(generic, exact, model, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("name", ["mlp_tanh", "cnn_smooth", "res_block", "conv_transpose"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_ggn_matches_brute_force_jhj(name, loss):
    model, x, y = make(name)
    want = brute_ggn_diag(model, x, y, loss, tau=1.7)
    fast = normflat.analyze(model, (x, y), loss=loss, estimator="ggn", temperature=1.7, progress=False)
    assert [layer.details["path"] for layer in fast.layers] == ["fast"] * len(want)
    assert_diag_close(nf(model, (x, y), loss=loss, estimator="ggn", temperature=1.7), want, model)
    assert_diag_close(nf(model, (x, y), loss=loss, estimator="ggn", temperature=1.7, fast=False), want, model)


def test_ggn_differs_from_hessian_on_smooth_net():
    # Guards against a reference that cannot tell the GGN from the Hessian.
    model, x, y = make("mlp_tanh")
    ggn, hess = brute_ggn_diag(model, x, y), brute_hessian_diag(model, x, y)
    assert max(float((ggn[k] - hess[k]).abs().max()) for k in ggn) > 1e-4


class SharedAndFunctional(nn.Module):
    """Weight reuse: a module called twice (its calls recorded one by one, their per-sample
    gradients summed), a weight used functionally by one ``F.linear`` call (recorded at that call),
    a Linear applied to a sequence (per-sample gradients sum over positions)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.twice = nn.Linear(4, 4)
        self.seq = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.extra = nn.Linear(4, 4)

    def forward(self, x):  # x: (N, T, 3)
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        h = torch.tanh(self.seq(h)).mean(1)
        h = h + torch.tanh(F.linear(h, self.extra.weight))  # functional use, module never called
        return self.head(h)


def test_ggn_generic_path_for_shared_and_functional_weights():
    torch.manual_seed(3)
    model = SharedAndFunctional().to(DT).eval()
    x, y = torch.randn(6, 5, 3, dtype=DT), torch.randint(0, 3, (6,))
    report = normflat.analyze(model, (x, y), loss="nsce", estimator="ggn", progress=False)
    paths = {layer.name: layer.details["path"] for layer in report.layers}
    assert paths == {"inp": "fast", "twice": "fast", "seq": "fast", "head": "fast", "extra": "fast"}
    generic = nf(model, (x, y), loss="nsce", estimator="ggn", fast=False)
    for name, value in nf(model, (x, y), loss="nsce", estimator="ggn").items():
        torch.testing.assert_close(value, generic[name], rtol=1e-10, atol=1e-14)
    assert_diag_close(nf(model, (x, y), loss="nsce", estimator="ggn"), brute_ggn_diag(model, x, y, "nsce"), model)


class Repeated(nn.Module):
    """A dense layer, an embedding and a grouped convolution called several times per forward
    (ALBERT's shared layers, a siamese encoder). ``how``: ``plain``; ``functional`` (the shared
    weight also read by ``F.linear``); ``transposed`` (a transposed convolution called twice too);
    ``dynamic`` (a fourth call from the second forward with gradients on: normflat's forwards
    without gradients, the first rows together and alone, are all of the first kind)."""

    def __init__(self, how="plain"):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(7, 4)
        self.inp = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.up = nn.ConvTranspose1d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.forwards = 0

    def forward(self, ids):  # ids: (N, 2, T): two token sequences per sample, one encoder
        self.forwards += int(torch.is_grad_enabled())
        a, b = self.emb(ids[:, 0]), self.emb(ids[:, 1])
        h = torch.relu(self.inp(a + 0.5 * b))
        for _ in range(4 if self.how == "dynamic" and self.forwards > 1 else 3):
            h = torch.relu(self.shared(h))
        if self.how == "functional":
            h = h + torch.tanh(F.linear(h, self.shared.weight))
        h = self.conv(torch.relu(self.conv(h.transpose(1, 2))))
        if self.how == "transposed":
            h = self.up(torch.tanh(self.up(h)))
        return self.head(h.transpose(1, 2).mean(1))


@pytest.mark.parametrize("estimator, how", [("ggn", "plain"), ("ggn-mc", "plain"), ("ggn", "transposed")])
def test_modules_called_several_times_sum_their_calls(estimator, how):
    """Each call of a module called several times per forward is recorded on its own and the
    calls' per-sample gradients are summed before they are squared (method §6.1, "Tied
    weights"): the fast path for the shared dense layer, the grouped and the transposed
    convolution and the embedding looked up twice, the same diagonals as brute force and the
    generic path, with the default probe and chunks."""
    torch.manual_seed(4)
    model = Repeated(how).to(DT).eval()
    g = torch.Generator().manual_seed(5)
    ids, y = torch.randint(0, 7, (6, 2, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
    report = normflat.analyze(model, (ids, y), loss="nsce", estimator=estimator, progress=False, seed=1,
                              samples=4 if estimator == "ggn-mc" else None)
    paths = {layer.name: layer.details["path"] for layer in report.layers}
    assert paths == {"emb": "fast", "inp": "fast", "shared": "fast", "conv": "fast", "up": "fast", "head": "fast"}
    # Unless called, never run: zero curvature, no path.
    assert ("unused" in report.layer("up").details) == (how == "plain")
    kw = {"loss": "nsce", "estimator": estimator, "seed": 1, "samples": 4 if estimator == "ggn-mc" else None}
    fast = nf(model, (ids, y), **kw)
    generic = nf(model, (ids, y), fast=False, **kw)
    _same_diagonals(fast, generic)
    for chunk in (1, 4):
        _same_diagonals(nf(model, (ids, y), chunk_size=chunk, **kw), generic)
    if estimator == "ggn":
        want = brute_ggn_diag(model, ids, y, "nsce")
        want["emb"] = want["emb"].T  # the canonical (features, vocabulary) layout
        assert_diag_close(fast, want, model)


@pytest.mark.parametrize("how, layer, reason", [
    ("functional", "shared", "module called 3 times per forward and its weight used 4 times in the graph"),
    ("dynamic", "shared", "called"),
])
def test_modules_called_several_times_otherwise_take_the_generic_path(how, layer, reason):
    """A further functional use of the shared weight, or calls that change between forwards: the
    exact generic path, with the reason."""
    torch.manual_seed(4)
    model = Repeated(how).to(DT).eval()
    g = torch.Generator().manual_seed(5)
    ids, y = torch.randint(0, 7, (6, 2, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
    report = normflat.analyze(model, (ids, y), loss="nsce", estimator="ggn", progress=False, chunk_size=2)
    details = report.layer(layer).details
    assert details["path"] == "generic" and reason in details["generic_reason"], details
    if how == "dynamic":
        return  # a function that changes between forwards has no one diagonal to compare
    got = nf(model, (ids, y), loss="nsce", estimator="ggn", chunk_size=2)
    want = nf(model, (ids, y), loss="nsce", estimator="ggn", chunk_size=2, fast=False)
    _same_diagonals(got, want)


def _same_diagonals(got, want):
    """Two of normflat's diagonals (both canonical) equal to rounding."""
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-10, msg=lambda m: f"{name}: {m}")


def test_shared_layer_conjugation_invariance():
    """A ReLU layer applied three times, ``h -> relu(W h)``, then a grouped convolution applied
    twice with a ReLU between: hidden unit k times c_k throughout (the layer before's row k times
    c_k, the shared dense ``W -> D W D⁻¹``, the convolution's ``W[o, j] -> c_o W[o, j] / c_i`` for
    input channel ``i`` of output ``o``'s group, the head's column k times 1/c_k) leaves the
    function, and every normalized sharpness, unchanged; the traces move."""
    torch.manual_seed(4)
    model = Repeated().to(DT).eval()
    g = torch.Generator().manual_seed(5)
    ids, y = torch.randint(0, 7, (6, 2, 5), generator=g), torch.randint(0, 3, (6,), generator=g)
    moved = copy.deepcopy(model)
    c = torch.tensor([0.5, 2.0, 3.0, 0.25], dtype=DT)
    with torch.no_grad():
        moved.inp.weight *= c[:, None]
        moved.inp.bias *= c
        moved.shared.weight.copy_(c[:, None] * moved.shared.weight / c[None, :])
        moved.shared.bias *= c
        per_group = moved.conv.weight.shape[1]
        inputs = torch.stack([c[(o // per_group) * per_group + torch.arange(per_group)] for o in range(4)])
        moved.conv.weight.mul_(c[:, None, None] / inputs[:, :, None])
        moved.conv.bias *= c
        moved.head.weight /= c[None, :]
        assert torch.allclose(model(ids), moved(ids), rtol=1e-12, atol=1e-12)
    r0 = normflat.analyze(model, (ids, y), loss="nsce", progress=False)
    r1 = normflat.analyze(moved, (ids, y), loss="nsce", progress=False)
    assert r0.layer("shared").details["path"] == r0.layer("conv").details["path"] == "fast"
    for l0, l1 in zip(r0.layers, r1.layers):
        assert math.isclose(l0.normalized_sharpness, l1.normalized_sharpness, rel_tol=1e-8), l0.name
    for name in ("shared", "conv"):
        assert not math.isclose(r0.layer(name).hessian_trace, r1.layer(name).hessian_trace, rel_tol=1e-3)


def test_tied_weights_reported_once():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), nn.Linear(4, 3)).to(DT).eval()
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert [layer.name for layer in report.layers] == ["0", "4"]
    assert report.layer("0").details["shared_with"] == ["2"]
    # Both uses have per-sample gradient rules: the fast path sums them before squaring.
    assert report.layer("0").details["path"] == "fast"
    want = brute_ggn_diag(model, x, y)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn"), want, model)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn", fast=False), want, model)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="exact"), brute_hessian_diag(model, x, y), model)


class _HardGate(nn.Module):
    """A squeeze-excite style gate ``x · hardsigmoid(W x)`` (MobileNetV3's), with ``nn.Hardsigmoid`` or
    the same function written as ``relu6(u + 3) / 6``."""

    def __init__(self, written_out: bool):
        super().__init__()
        self.fc, self.gate, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.written_out = written_out

    def forward(self, x):
        u = self.gate(torch.tanh(self.fc(x)))
        g = F.relu6(u + 3.0) / 6.0 if self.written_out else nn.Hardsigmoid()(u)
        return self.head(torch.tanh(self.fc(x)) * g)


def test_hardsigmoid_gets_its_second_derivatives():
    """``exact`` and ``hutchinson`` on a model with ``nn.Hardsigmoid`` (torch has no derivative of its
    backward: they failed inside torch) equal those of the same function written with ``relu6``, and
    ``exact`` the autodiff Hessian diagonal of that one; ``ggn`` runs on torch's own kernel."""
    torch.manual_seed(0)
    model = _HardGate(written_out=False).to(DT)
    other = _HardGate(written_out=True).to(DT)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        model.gate.weight.mul_(4.0)  # gates on the clamps' both sides and between
        other.gate.weight.mul_(4.0)
    x, y = torch.randn(16, 4, dtype=DT), torch.randint(0, 3, (16,))
    torch.testing.assert_close(model(x), other(x), rtol=1e-15, atol=1e-15)
    for estimator in ("exact", "hutchinson", "ggn"):
        options = dict(samples=4) if estimator == "hutchinson" else {}
        got = nf(model, (x, y), loss="ce", estimator=estimator, **options)
        want = nf(other, (x, y), loss="ce", estimator=estimator, **options)
        # ggn runs torch's own hardsigmoid, whose backward's 1/6 is float32's (4.97e-9 off in float64).
        rtol = 1e-6 if estimator == "ggn" else 1e-12
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=1e-15)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="exact"), brute_hessian_diag(other, x, y), model)


def test_compiled_model_is_analyzed_through_its_eager_module():
    """``torch.compile(model)`` gives the plain model's report (the same layer names, not
    ``_orig_mod.…``, and the same numbers) and ``normflat.measures``' values, without ever calling the
    compiler (the analysis runs the eager module inside the wrapper); the wrapper still compiles and
    runs afterwards."""
    torch.manual_seed(0)
    model = mlp_tanh().to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    compiled_graphs = []

    def backend(graph, example_inputs):
        compiled_graphs.append(graph)
        return graph.forward

    compiled = torch.compile(model, backend=backend)
    for estimator in ("ggn", "exact"):
        got = normflat.analyze(compiled, (x, y), estimator=estimator, progress=False)
        want = normflat.analyze(model, (x, y), estimator=estimator, progress=False)
        assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers] == ["0", "2", "4"]
        assert got.normalized_sharpness == want.normalized_sharpness
        assert got.hessian_trace == want.hessian_trace
    measures = ["fisher_rao_norm", "adaptive_sharpness"]
    got = normflat.measures(compiled, (x, y), measures, loss="ce", progress=False)
    want = normflat.measures(model, (x, y), measures, loss="ce", progress=False)
    assert all(got[name] == want[name] for name in measures)
    assert compiled_graphs == []  # the compiler never ran
    torch.testing.assert_close(compiled(x), model(x))
    assert len(compiled_graphs) == 1


def _relu_mlp_with_block() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), block).to(DT)


@pytest.mark.parametrize("how", ["compiled_child", "child_compile_in_place", "model_compile_in_place"])
def test_compiled_submodules_run_eagerly_with_the_plain_names(how):
    """Compiled parts inside the model (``model.block = torch.compile(model.block)``, regional
    compilation with ``block.compile()``, or ``model.compile()`` in place) give the plain model's layer
    names (no ``_orig_mod.``), numbers and measures (the path norm included) without calling the
    compiler; the compiled parts compile again afterwards. Before, the compiler traced normflat's hooks
    (with dynamo's errors logged), the names held ``_orig_mod`` and the path norm refused the wrapper."""
    model = _relu_mlp_with_block()
    plain = _relu_mlp_with_block()
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    compiled_graphs = []

    def backend(graph, example_inputs):
        compiled_graphs.append(graph)
        return graph.forward

    if how == "compiled_child":
        model[2] = torch.compile(model[2], backend=backend)
    elif how == "child_compile_in_place":
        model[2].compile(backend=backend)
    else:
        model.compile(backend=backend)
    for estimator in ("ggn", "hutchinson", "exact"):
        got = normflat.analyze(model, (x, y), estimator=estimator, progress=False)
        want = normflat.analyze(plain, (x, y), estimator=estimator, progress=False)
        assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers] == ["0", "2.0", "2.2"]
        assert got.metadata["excluded"] == want.metadata["excluded"] and "2.0.bias" in got.metadata["excluded"]
        assert got.metadata["coverage"] == want.metadata["coverage"]
        assert got.normalized_sharpness == want.normalized_sharpness
        assert got.hessian_trace == want.hessian_trace
    measures = ["fisher_rao_norm", "adaptive_sharpness", "path_norm"]
    got = normflat.measures(model, (x, y), measures, loss="ce", progress=False)
    want = normflat.measures(plain, (x, y), measures, loss="ce", progress=False)
    assert all(got[name] == want[name] for name in measures)
    assert compiled_graphs == []  # the compiler never ran
    torch.testing.assert_close(model(x), plain(x))
    assert len(compiled_graphs) >= 1  # compiled again after the analysis


def test_an_enclosing_autocast_is_off_for_the_analysis():
    """An analysis called inside ``torch.autocast`` (a training loop's mixed-precision block): its
    forwards run in the model's dtype, as outside, for every estimator and the measures; the block's
    autocast is on again after each call. Before, the analysis failed on the bfloat16 logits
    ("Got unsupported ScalarType BFloat16") and the measures returned bfloat16 values silently."""
    torch.manual_seed(0)
    model = mlp_tanh()
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    measures = ["fisher_rao_norm", "adaptive_sharpness"]
    want = {estimator: normflat.hessian_diagonal(model, (x, y), estimator=estimator, progress=False)
            for estimator in ("ggn", "hutchinson", "exact")}
    want_measures = normflat.measures(model, (x, y), measures, loss="ce", progress=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16  # the block is in effect
        for estimator, diagonals in want.items():
            got = normflat.hessian_diagonal(model, (x, y), estimator=estimator, progress=False)
            for name in diagonals:
                assert got[name].dtype == torch.float32
                torch.testing.assert_close(got[name], diagonals[name], rtol=1e-6, atol=1e-9)
            assert torch.is_autocast_enabled("cpu")
        report = normflat.analyze(model, (x, y), progress=False)
        got_measures = normflat.measures(model, (x, y), measures, loss="ce", progress=False)
        assert torch.is_autocast_enabled("cpu") and model(x).dtype == torch.bfloat16
    assert report.metadata["dtype"] == "float32"
    assert [got_measures[m] for m in measures] == pytest.approx([want_measures[m] for m in measures], rel=1e-6)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_analyzed_in_float32_through_a_copy(half):
    """A model whose weights are bfloat16 or float16 (loaded with ``torch_dtype=…``): the analysis
    computes in float32 through a private copy, the numbers of ``copy.deepcopy(model).float()`` on
    the same data, and the model keeps its dtype and everything else. Before, bfloat16 failed on the
    logits' check ("Got unsupported ScalarType BFloat16") and float16 was analyzed in float16."""
    torch.manual_seed(0)
    model = mlp_tanh().to(half)
    x, y = torch.randn(8, 4).to(half), torch.randint(0, 3, (8,))
    widened = copy.deepcopy(model).float()
    for estimator in ("ggn", "exact"):
        got = normflat.analyze(model, (x, y), estimator=estimator, progress=False)
        want = normflat.analyze(widened, (x.float(), y), estimator=estimator, progress=False)
        assert got.metadata["dtype"] == "float32"
        assert [layer.name for layer in got.layers] == [layer.name for layer in want.layers]
        assert (got.normalized_sharpness, got.hessian_trace) == (want.normalized_sharpness, want.hessian_trace)
        diagonals = normflat.hessian_diagonal(model, (x, y), estimator=estimator, progress=False)
        assert all(d.dtype == torch.float32 for d in diagonals.values())
    assert all(p.dtype == half and p.grad is None for p in model.parameters())

    class Uncopyable(nn.Sequential):
        def __deepcopy__(self, memo):
            raise TypeError("holds a lock")

    with pytest.raises(ValueError, match=rf"parameters are {str(half).removeprefix('torch.')} \(0.weight and 5 more\)"
                                         r".*copy.deepcopy could not make \(TypeError: holds a lock\)"):
        normflat.analyze(Uncopyable(*model), (x, y), progress=False)


class _ScalesItsInputs(nn.Module):
    """An MLP whose forward scales its input: in place (``x.mul_``), out of place, or by a clamp in place
    that changes no value of these inputs."""

    def __init__(self, how):
        super().__init__()
        self.net, self.how = mlp_tanh(), how

    def forward(self, x):
        if self.how == "in place":
            x.mul_(2.0)
        elif self.how == "clamp":
            x.clamp_(-1e6, 1e6)
        else:
            x = x * 2.0
        return self.net(x)


def test_a_forward_that_changes_its_inputs_in_place_is_refused():
    """A forward that writes into its inputs: normflat runs the forward several times on a batch, so
    each would see what the one before wrote (before, the samples-apart check refused it as logits that
    depend on the other samples, a wrong cause). One error that says so, for the analysis and the
    measures, and the data (a tensor, or a numpy array whose memory the tensor shares) left as it was.
    A write that leaves the values (a clamp within their range) runs, with the numbers of the plain
    forward."""
    torch.manual_seed(0)
    model = _ScalesItsInputs("in place")
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    kept, host = x.clone(), x.numpy().copy()
    for data in ((x, y), (host, y.numpy())):
        for estimator in ("ggn", "hutchinson"):
            with pytest.raises(ValueError, match=r"changes its inputs in place in its forward .*out of place"):
                normflat.analyze(model, data, estimator=estimator, progress=False)
        with pytest.raises(ValueError, match="changes its inputs in place"):
            normflat.measures(model, data, ["fisher_rao_norm"], loss="ce", progress=False)
    assert torch.equal(x, kept) and np.array_equal(host, kept.numpy())
    clamped, plain = _ScalesItsInputs("clamp"), _ScalesItsInputs("out of place")
    plain.net.load_state_dict(clamped.net.state_dict())
    got = normflat.hessian_diagonal(clamped, (x, y), progress=False)
    want = normflat.hessian_diagonal(plain, (x / 2, y), progress=False)
    for name in want:
        torch.testing.assert_close(got[name], want[name])


class _TiedThrice(nn.Module):
    """A weight used by two modules and once more functionally: the fast rule cannot see the third use."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(torch.tanh(nn.functional.linear(h, self.a.weight)))


def test_tied_weight_with_a_functional_use_takes_the_generic_path():
    torch.manual_seed(0)
    model = _TiedThrice().to(DT).eval()
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    report = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    assert report.layer("a").details["path"] == "generic"
    assert "tied weight used 3 times" in report.layer("a").details["generic_reason"]
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn"), brute_ggn_diag(model, x, y), model)


def test_ggn_chunks_and_batches_give_the_same_mean():
    model, x, y = make("cnn_smooth", n=11)
    whole = nf(model, (x, y), estimator="ggn")
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    chunked = nf(model, loader, estimator="ggn", chunk_size=3)
    batches = [(x[:5], y[:5]), (x[5:], y[5:])]
    assert_diag_close(chunked, whole, model, atol=1e-12, rtol=1e-10)
    assert_diag_close(nf(model, iter(batches), estimator="ggn"), whole, model, atol=1e-12, rtol=1e-10)
    assert_diag_close(nf(model, (x, y), estimator="ggn", max_batches=1), whole, model, atol=0, rtol=0)
    partial = nf(model, batches, estimator="ggn", max_batches=1)
    assert_diag_close(partial, nf(model, batches[0], estimator="ggn"), model, atol=0, rtol=0)


# ----------------------------------------------------------------------------- stochastic estimators


def _trace_and_se(report):
    return report.hessian_trace, report.standard_error["hessian_trace"]


def test_ggn_mc_converges_to_ggn():
    model, x, y = make("cnn_smooth", n=6)
    target = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    errors, ses = [], []
    for samples in (10, 1000):
        r = normflat.analyze(model, (x, y), estimator="ggn-mc", samples=samples, seed=1, progress=False)
        trace, se = _trace_and_se(r)
        assert se > 0
        errors.append(abs(trace - target.hessian_trace))
        ses.append(se)
        # The group estimates are independent: the error is a few standard errors at most.
        assert errors[-1] < 5 * se
        for layer, ref in zip(r.layers, target.layers):
            assert abs(layer.hessian_trace - ref.hessian_trace) < 5 * layer.standard_error["hessian_trace"] + 1e-12
    # 100x more draws: standard error ~10x smaller.
    assert ses[1] < ses[0] / 4
    # Seeded and reproducible; another seed gives another estimate.
    a = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=5)
    b = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=5)
    c = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # Fast and generic paths draw the same labels.
    g = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=5, fast=False)
    assert_diag_close(g, a, model, atol=1e-12, rtol=1e-10)


def test_ggn_mc_single_draw_has_no_standard_error():
    model, x, y = make("mlp_relu")
    r = normflat.analyze(model, (x, y), estimator="ggn-mc", progress=False)
    assert r.standard_error is None and r.hessian_trace > 0


def test_hutchinson_converges_to_exact():
    model, x, y = make("mlp_tanh", n=6)
    exact = normflat.analyze(model, (x, y), estimator="exact", progress=False)
    ses = []
    for samples in (20, 2000):
        r = normflat.analyze(model, (x, y), estimator="hutchinson", samples=samples, seed=2, progress=False,
                             probe_chunk=500)
        trace, se = _trace_and_se(r)
        ses.append(se)
        assert abs(trace - exact.hessian_trace) < 5 * se
        for layer, ref in zip(r.layers, exact.layers):
            assert abs(layer.hessian_trace - ref.hessian_trace) < 5 * layer.standard_error["hessian_trace"]
    assert ses[1] < ses[0] / 4
    a = nf(model, (x, y), estimator="hutchinson", samples=4, seed=3)
    b = nf(model, DataLoader(TensorDataset(x, y), batch_size=4), estimator="hutchinson", samples=4, seed=3)
    # The same probes in every batch: batching does not change the estimate.
    assert_diag_close(b, a, model, atol=1e-12, rtol=1e-10)


def test_hutchinson_per_entry_mean_matches_exact_diagonal():
    model, x, y = make("cnn_relu", n=4)
    exact = nf(model, (x, y), estimator="exact")
    est = nf(model, (x, y), estimator="hutchinson", samples=400, seed=0, probe_chunk=200)
    for name in exact:
        # Hutchinson is unbiased entry-wise; compare the layer sums with a generous bound.
        assert float(est[name].sum()) == pytest.approx(float(exact[name].sum()), rel=0.3, abs=1e-3)


# ----------------------------------------------------------------------------- model untouched


def _snapshot(model):
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "modes": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "grad_ids": [id(p.grad) for p in model.parameters()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def _assert_same(before, after):
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        a, b = before["state"][k], after["state"][k]
        assert a.dtype == b.dtype and torch.equal(a, b), k
    for key in ("modes", "requires_grad", "grad_ids", "hooks"):
        assert before[key] == after[key], key
    for a, b in zip(before["grads"], after["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(before["rng"], after["rng"])


def _prepared_model():
    model, x, y = make("res_block")
    model.train()
    model[1].eval()  # a mix of modes
    model[0].bias.requires_grad_(False)
    model[-1].weight.grad = torch.ones_like(model[-1].weight)
    model[3].register_forward_hook(lambda m, i, o: None)
    return model, x, y


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "hutchinson", "exact"])
def test_model_untouched(estimator):
    model, x, y = _prepared_model()
    before = _snapshot(model)
    bn_stats = model[1].running_mean.clone()
    # A list of batches, not a DataLoader: iterating a DataLoader draws its base seed from the
    # global RNG (the user's loader, not normflat); normflat itself never reads or sets it.
    batches = [(x[i:i + 3], y[i:i + 3]) for i in range(0, 7, 3)]
    report = normflat.analyze(model, batches, estimator=estimator,
                              samples=2 if estimator != "ggn" and estimator != "exact" else None,
                              progress=False)
    assert report.metadata["examples"] == 7 and report.metadata["batches"] == 3
    _assert_same(before, _snapshot(model))
    assert torch.equal(model[1].running_mean, bn_stats)


@pytest.mark.parametrize("estimator", ["ggn", "exact"])
def test_model_untouched_after_error_midway(estimator):
    model, x, y = _prepared_model()
    before = _snapshot(model)
    bad = [(x[:3], y[:3]), (x[3:], torch.full_like(y[3:], 7))]  # second batch: labels out of range
    with pytest.raises(ValueError, match="labels must be class indices"):
        nf(model, bad, estimator=estimator)
    _assert_same(before, _snapshot(model))


def test_train_mode_dropout_and_bn_are_disabled():
    model, x, y = make("cnn_smooth")
    want = nf(model, (x, y), estimator="ggn")
    model.train()
    got = nf(model, (x, y), estimator="ggn")
    assert model.training and all(m.training for m in model.modules())
    assert_diag_close(got, want, model, atol=0, rtol=0)


def test_frozen_model_and_no_grad_context():
    model, x, y = make("mlp_relu")
    want = nf(model, (x, y), loss="ce", estimator="ggn")
    for p in model.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        got = nf(model, (x, y), loss="ce", estimator="ggn")
        exact = nf(model, (x, y), loss="ce", estimator="exact")
    with torch.inference_mode():
        xi, yi = x.clone(), y.clone()
        inference = nf(model, (xi, yi), loss="ce", estimator="ggn")
    assert_diag_close(inference, want, model, atol=0, rtol=0)
    assert_diag_close(got, want, model, atol=0, rtol=0)
    assert_diag_close(exact, want, model, atol=1e-10, rtol=1e-8)  # ReLU net: GGN == Hessian
    assert not any(p.requires_grad for p in model.parameters())


def test_no_jit_deprecation_warning_leaks():
    model, x, y = make("mlp_tanh")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        nf(model, (x, y), estimator="exact")
        nf(model, (x, y), estimator="hutchinson", samples=2)
        warnings.warn("user warning stays visible", UserWarning)
    messages = [str(w.message) for w in rec]
    assert not any("torch.jit.script" in m for m in messages), messages
    assert "user warning stays visible" in messages


# ----------------------------------------------------------------------------- report, names, registry


def test_report_names_kinds_and_metadata():
    model, x, y = make("res_block")
    report = normflat.analyze(model, (x, y), progress=False)
    assert [layer.name for layer in report.layers] == ["0", "3.conv1", "3.conv2", "6"]
    assert [layer.kind for layer in report.layers] == ["conv2d", "conv2d", "conv2d", "dense"]
    assert report.layers[1].shape == (3, 3, 3, 3)
    md = report.metadata
    assert md["framework"] == "torch" and md["examples"] == 7 and md["batches"] == 1
    assert md["dtype"] == "float64" and md["device"] == "cpu" and md["loss"] == "nsce"
    assert math.isfinite(report.normalized_sharpness) and report.normalized_sharpness > 0


def test_unsupported_layers():
    class WithAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.att = nn.MultiheadAttention(4, 2, batch_first=True)
            self.scale = nn.Parameter(torch.ones(4))
            self.mix = nn.Parameter(torch.eye(4))  # a loose weight matrix: no extractor reads it
            self.head = nn.Linear(4, 3)

        def forward(self, tokens):
            h = self.emb(tokens)
            h, _ = self.att(h, h, h)
            return self.head(h.mean(1) @ self.mix * self.scale)

    torch.manual_seed(0)
    model = WithAttention().to(DT).eval()
    x, y = torch.randint(0, 10, (5, 6)), torch.randint(0, 3, (5,))
    with pytest.raises(ValueError, match=r"mix \(WithAttention has parameters") as info:
        normflat.analyze(model, (x, y), on_unsupported="error", progress=False)
    assert "scale" not in str(info.value)  # a vector is excluded by definition, never warned about
    with pytest.warns(UserWarning, match="cannot analyze"):
        report = normflat.analyze(model, (x, y), on_unsupported="warn", progress=False)
    assert [layer.name for layer in report.layers] == [
        "emb", "att.query", "att.key", "att.value", "att.out_proj", "head"]
    assert len(report.metadata["unsupported"]) == 1
    assert set(report.metadata["excluded"]) == {"scale", "att.in_proj_bias", "att.out_proj.bias", "head.bias"}
    assert report.metadata["coverage"] < 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normflat.analyze(model, (x, y), on_unsupported="skip", progress=False)


class Dense(nn.Module):
    """A dense layer storing its kernel as (in, out), Keras style."""

    def __init__(self, w):
        super().__init__()
        self.kernel = nn.Parameter(w.T.clone())

    def forward(self, x):
        return x @ self.kernel


def test_register_layer_one_call():
    model, x, y = make("mlp_tanh")
    clone = nn.Sequential(*[Dense(m.weight.detach()) if isinstance(m, nn.Linear) else copy.deepcopy(m)
                            for m in model])
    for m_new, m_old in zip(clone, model):
        if isinstance(m_old, nn.Linear):
            m_old.bias.data.zero_()
    with pytest.raises(ValueError, match="no supported weight layer"):
        nf(clone, (x, y), on_unsupported="skip")
    saved = tb.registered_layers()
    try:
        tb.register_layer(Dense, kind="dense", weight=lambda m: m.kernel, to_canonical=lambda m, t: t.T)
        for estimator in ("ggn", "exact"):
            got = nf(clone, (x, y), estimator=estimator)
            want = nf(model, (x, y), estimator=estimator)
            assert list(got) == list(want)
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=1e-12, rtol=1e-10)
        report = normflat.analyze(clone, (x, y), progress=False)
        assert report.layers[0].details["path"] == "generic" and report.layers[0].kind == "dense"

        def squares(module, a, signals):  # signals (K, M, n, out); kernel gradient a δᵀ per sample
            return torch.einsum("ni,kmno->kio", a**2, signals**2)

        tb.register_layer(Dense, kind="dense", weight=lambda m: m.kernel, to_canonical=lambda m, t: t.T,
                          ggn_squares=squares)
        report = normflat.analyze(clone, (x, y), estimator="ggn-mc", samples=4, progress=False)
        assert [layer.details["path"] for layer in report.layers] == ["fast"] * 3
        generic = normflat.analyze(clone, (x, y), estimator="ggn-mc", samples=4, progress=False, fast=False)
        assert report.hessian_trace == pytest.approx(generic.hessian_trace, rel=1e-10)
        assert report.standard_error["hessian_trace"] == pytest.approx(
            generic.standard_error["hessian_trace"], rel=1e-8)
    finally:
        for cls in set(tb.registered_layers()) - set(saved):
            tb.layers.REGISTRY.unregister(cls)
        for cls, entry in saved.items():
            tb.layers.REGISTRY.register(cls, entry)
    with pytest.raises(TypeError, match="nn.Module subclass"):
        tb.register_layer(int, kind="x")


# ----------------------------------------------------------------------------- bad input


@pytest.fixture
def small():
    return make("mlp_relu")


def test_bad_empty_data(small):
    model, x, y = small
    with pytest.raises(ValueError, match="data is empty"):
        nf(model, [])
    with pytest.raises(ValueError, match="data is empty"):
        nf(model, (x[:0], y[:0]))


def test_bad_no_supported_layer():
    model = nn.Sequential(nn.Flatten(), nn.ReLU())
    with pytest.raises(ValueError, match="no supported weight layer"):
        nf(model, (torch.randn(2, 3), torch.tensor([0, 1])))


def test_bad_nan_weights_data_and_loss(small):
    model, x, y = small
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="'2'.*NaN"):
        nf(broken, (x, y))
    xb = x.clone()
    xb[1, 2] = float("inf")
    with pytest.raises(ValueError, match="inputs contain NaN"):
        nf(model, (xb, y))
    with pytest.raises(ValueError, match="loss is NaN"):
        nf(model, (x, y), loss=lambda z, t: (z.sum() * float("nan")), estimator="exact")
    class Log(nn.Module):
        def forward(self, h):
            return torch.log(torch.relu(h))

    with pytest.raises(ValueError, match="logits contain NaN or infinite"):
        nf(nn.Sequential(model, Log()), (x, y))


def _host_calls(model, data, **kw):
    """The tensor methods that return a value to the host (each waits for an accelerator) called
    during one analysis: the counter of the GPU benchmark (``benchmarks/device.py``)."""
    from benchmarks.device import HostCalls

    mode = HostCalls()
    with mode:
        nf(model, data, **kw)
    return sum(mode.count.values())


class _TokenLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("case", ["mlp-ggn", "mlp-ggn-topk", "mlp-ggn-mc", "mlp-hutchinson", "mlp-exact",
                                  "conv-ggn", "lm-ggn-topk"])
def test_no_host_round_trip_per_batch(case):
    """After the first batch a batch never waits for the device: the logits' and the loss's value
    checks (and those of inputs on an accelerator) are read in one go after the loop, the labels
    and draws are host arrays copied without waiting. Host data (numpy), so that every call
    counted is normflat's own; the count of four batches equals that of two (both read the
    deferred checks once)."""
    name, estimator = case.split("-", 1)
    if name == "lm":
        torch.manual_seed(0)
        model = _TokenLM().to(DT).eval()
        ids = torch.randint(0, 11, (4, 5)).numpy()
        batch = (ids, ids)
    else:
        model, x, y = make("mlp_relu" if name == "mlp" else "res_block")
        batch = (x.numpy(), y.numpy())
    two = _host_calls(model, [batch] * 2, estimator=estimator)
    four = _host_calls(model, [batch] * 4, estimator=estimator)
    assert two > 0  # the first batch's checks and the diagonals' finite checks: the counter counts
    assert four == two


def test_deferred_logit_check_names_its_batch(small):
    """A later batch's non-finite logits (finite inputs that overflow) get the eager message, with
    their batch index, before the diagonal's finite check."""
    model, x, y = small

    class Exp(nn.Module):
        def forward(self, z):
            return torch.exp(z)

    overflowing = nn.Sequential(model, Exp())
    for estimator in ("ggn", "ggn-topk", "hutchinson"):
        nf(overflowing, [(x, y), (x, y)], estimator=estimator)  # finite logits: no error
        with pytest.raises(ValueError, match=r"Batch 1: the model's logits contain NaN or infinite"):
            nf(overflowing, [(x, y), (x * 1e6, y), (x, y)], estimator=estimator)


def test_deferred_labels_are_checked_after_the_loop(small, monkeypatch):
    """Labels on a CUDA device are copied without waiting and checked after the loop (the GGN of
    (n, C) logits does not use them; the Hessian-vector products' loss compares class indices with
    the classes, so a bad one selects nothing until then): the same numbers, and a later batch's bad labels get the eager message
    naming it. Run on the CPU by deferring every tensor's labels."""
    from normflat.backends.torch import session as torch_session
    from normflat.backends.torch.session import TorchSession
    from normflat.engine.data import labels_for

    model, x, y = small
    eager = nf(model, [(x, y)] * 3, estimator="ggn")
    eager_exact = nf(model, [(x, y)] * 3, estimator="exact")
    monkeypatch.setattr(TorchSession, "_deferred_labels", staticmethod(lambda labels: isinstance(labels, torch.Tensor)))
    deferred = nf(model, [(x, y)] * 3, estimator="ggn")
    for name in eager:
        torch.testing.assert_close(deferred[name], eager[name], rtol=0, atol=0)
    bad = y.clone()
    bad[1] = 7
    with pytest.raises(ValueError, match=r"Batch 1: .*class indices in \[0, 2\]"):
        nf(model, [(x, y), (x, bad), (x, y)], estimator="ggn")
    with pytest.raises(ValueError, match=r"Batch 1: .*class indices in \[0, 2\]"):
        nf(model, [(x, y), (x, bad), (x, y)], estimator="ggn-topk")
    # The Hessian-vector products use the class indices on the device before the checks: the same
    # numbers, the eager message, never an error from inside the loss.
    for estimator in ("exact", "hutchinson"):
        monkeypatch.undo()
        eager = nf(model, [(x, y)] * 3, estimator=estimator, seed=1)
        monkeypatch.setattr(TorchSession, "_deferred_labels",
                            staticmethod(lambda labels: isinstance(labels, torch.Tensor)))
        checked = []
        monkeypatch.setattr(torch_session, "labels_for",
                            lambda batch, *a, **k: checked.append((batch.index, batch.x is None))
                            or labels_for(batch, *a, **k))
        deferred = nf(model, [(x, y)] * 3, estimator=estimator, seed=1)
        # the first batch at once, the later ones after the loop (kept without their inputs)
        assert checked == [(0, False), (1, True), (2, True)], checked
        for name in eager:
            torch.testing.assert_close(deferred[name], eager[name], rtol=0, atol=0)
        for wrong in (7, -1):
            bad = y.clone()
            bad[1] = wrong
            with pytest.raises(ValueError, match=r"Batch 1: .*class indices in \[0, 2\]"):
                nf(model, [(x, y), (x, bad), (x, y)], estimator=estimator)
    # One-hot rows on the device are converted by the data contract on the host, as before.
    onehot = nf(model, [(x, y), (x, F.one_hot(y, 3)), (x, y)], estimator="exact")
    for name in onehot:
        torch.testing.assert_close(onehot[name], eager_exact[name], rtol=1e-12, atol=0)


def test_bad_labels(small):
    model, x, y = small
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
        nf(model, (x, y + 3))
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
        nf(model, (x, y - 5), estimator="exact")
    with pytest.raises(TypeError, match="integer class indices"):
        nf(model, (x, y > 0))
    with pytest.raises(ValueError, match="must hold integer class indices"):
        nf(model, (x, y.double() + 0.5))
    with pytest.raises(ValueError, match="one-hot rows"):
        nf(model, (x, F.one_hot(y, 3).double() * 0.9))  # soft labels are refused
    with pytest.raises(ValueError, match="7 inputs but 6 labels"):
        nf(model, (x, y[:6]))
    # The engine's data contract: one-hot rows and integral floats are class indices.
    want = nf(model, (x, y))
    for labels in (F.one_hot(y, 3), y.double(), y[:, None]):
        got = nf(model, (x, labels))
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_logits_rank():
    # (batch, tokens, classes) are token logits (method §6.3); four axes are neither.
    model = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (3, 1, 2)))
    with pytest.raises(ValueError, match=r"logits of shape \(batch, classes\)"):
        nf(model.double(), (torch.randn(2, 4, dtype=DT), torch.tensor([0, 1])))


def test_bad_names_and_options(small):
    model, x, y = small
    with pytest.raises(ValueError, match="Unknown estimator"):
        nf(model, (x, y), estimator="diag")
    with pytest.raises(ValueError, match="Unknown loss"):
        nf(model, (x, y), loss="mse")
    with pytest.raises(ValueError, match="custom loss"):
        nf(model, (x, y), loss=lambda z, t: z.sum(), estimator="ggn")
    with pytest.raises(TypeError, match="Unknown option"):
        nf(model, (x, y), frobnicate=True)
    with pytest.raises(TypeError, match="DataLoader"):
        nf(model, 3)
    with pytest.raises(TypeError, match=r"\(x, y\) pair"):
        nf(model, [x, x, y])
    with pytest.raises(TypeError, match="wrap it in a DataLoader"):
        nf(model, TensorDataset(x, y))
    with pytest.raises(ValueError, match="labels are a scalar"):
        nf(model, list(TensorDataset(x, y)))  # single samples: one label each
    with pytest.raises(ValueError, match="loss is NaN"):
        nf(model, (x, y), loss=lambda z, t: torch.tensor(float("inf"), dtype=DT) + z.sum(), estimator="hutchinson")


def test_bad_device(small):
    model, x, y = small
    meta = x.to("meta")
    with pytest.raises(ValueError, match="device meta but the model is on cpu"):
        nf(model, (meta, y))


# ----------------------------------------------------------------------------- data forms, dtypes


def test_numpy_data_and_float32_inputs_are_cast(small):
    model, x, y = small
    want = nf(model, (x, y))
    got = nf(model, (x.float().numpy(), y.numpy()))
    assert all(g.dtype == DT for g in got.values())
    assert_diag_close(got, want, model, atol=1e-6, rtol=1e-5)  # inputs rounded to float32


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "hutchinson", "exact"])
def test_float32_model(estimator):
    model64, x64, y = make("cnn_smooth")
    model = copy.deepcopy(model64).float()
    kw = {"samples": 3} if estimator in ("ggn-mc", "hutchinson") else {}
    got = nf(model, (x64.float(), y), estimator=estimator, **kw)
    want = nf(model64, (x64, y), estimator=estimator, **kw)
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), want[k], atol=1e-5, rtol=1e-3)
    report = normflat.analyze(model, (x64.float(), y), estimator=estimator, progress=False, **kw)
    assert report.metadata["dtype"] == "float32" and math.isfinite(report.normalized_sharpness)


def test_progress_bar(small, capsys):
    model, x, y = small
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    normflat.hessian_diagonal(model, loader, progress=True)
    assert "normflat ggn" in capsys.readouterr().err
    normflat.hessian_diagonal(model, loader, progress=False)
    assert "normflat" not in capsys.readouterr().err


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, u, v):
        return self.head(torch.tanh(self.a(u) + self.b(v)))


def test_multi_input_model():
    torch.manual_seed(0)
    model = TwoInputs().to(DT).eval()
    u, v, y = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT), torch.randint(0, 3, (6,))
    loader = DataLoader(TensorDataset(u, v, y), batch_size=4, collate_fn=lambda b: (
        (torch.stack([s[0] for s in b]), torch.stack([s[1] for s in b])), torch.stack([s[2] for s in b])))
    got = nf(model, loader, estimator="ggn", loss="ce")
    for pname, lname in weight_names(model).items():
        w = dict(model.named_parameters())[pname].detach()

        def z_of(wt, pname=pname):
            return functional_call(model, {pname: wt}, (u, v), strict=False)

        z = z_of(w)
        p = torch.softmax(z, 1)
        J = jacrev(z_of)(w).reshape(6, 3, -1)
        want = torch.einsum("ncp,ncd,ndp->p", J, torch.diag_embed(p) - p[:, :, None] * p[:, None, :], J) / 6
        torch.testing.assert_close(got[lname], want.reshape(w.shape).detach(), atol=1e-12, rtol=1e-9)
    assert list(nf(model, ((u, v), y), estimator="exact")) == ["a", "b", "head"]


def test_default_chunking_with_many_classes():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 130)).to(DT).eval()
    x, y = torch.randn(70, 4, dtype=DT), torch.randint(0, 130, (70,))
    # 129 signals per sample: the default bound of 8192 rows splits the batch into chunks of 63.
    chunked = nf(model, (x, y), loss="ce", estimator="ggn")
    whole = nf(model, (x, y), loss="ce", estimator="ggn", chunk_size=70)
    assert_diag_close(chunked, whole, model, atol=1e-14, rtol=1e-11)
    assert_diag_close(chunked, brute_ggn_diag(model, x, y), model, atol=1e-12, rtol=1e-9)


class Branchy(nn.Module):
    """Data-dependent control flow: vmap cannot batch it, the one-sample fallbacks must."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if float(h.detach().sum()) > 0:  # .item() on a tensor: not batchable
            h = h * 1.5
        return self.b(h)


def test_fallbacks_without_vmap(monkeypatch):
    torch.manual_seed(2)
    model = Branchy().to(DT).eval()
    x, y = torch.randn(1, 4, dtype=DT), torch.randint(0, 3, (1,))
    with torch.no_grad():
        x = x if float(torch.tanh(model.a(x)).sum()) > 0 else -x  # take the scaled branch
    assert_diag_close(nf(model, (x, y), estimator="exact", loss="ce"), brute_hessian_diag(model, x, y), model)
    assert_diag_close(nf(model, (x, y), estimator="ggn", loss="ce", fast=False), brute_ggn_diag(model, x, y),
                      model)
    assert_diag_close(nf(model, (x, y), estimator="ggn", loss="ce"), brute_ggn_diag(model, x, y), model)
    # The one-sample loop with the real signals of a padded ggn-topk layout (2 exact classes, one
    # draw in each of 3 groups): every group's sums, as the fast path's.
    from normflat.engine.options import validate_options

    options = validate_options(loss="ce", estimator="ggn-topk", top_classes=2, samples=3, seed=4, progress=False)
    generic, _ = tb.layer_problems(model, (x, y), options, fast=False)
    fast, _ = tb.layer_problems(model, (x, y), options)
    for g, f in zip(generic, fast):
        assert g.details["path"] == "generic" and f.details["path"] == "fast"
        np.testing.assert_allclose(g.hessian_diag_samples, f.hessian_diag_samples, rtol=1e-12, atol=1e-16)
    # and plain autograd, one signal at a time, where not even one sample's vjp runs under torch.func
    loops = []
    original = ggn_kernels._per_sample_loop

    def failing_vjp(*args, **kwargs):
        raise RuntimeError("no torch.func here")

    def counted(*args):
        loops.append(args[5])  # the group of each real signal
        return original(*args)

    monkeypatch.setattr(ggn_kernels, "vjp", failing_vjp)
    monkeypatch.setattr(ggn_kernels, "_per_sample_loop", counted)
    looped, _ = tb.layer_problems(model, (x, y), options, fast=False)
    assert loops == [[0, 0, 1, 2, 3]]
    for g, f in zip(looped, fast):
        np.testing.assert_allclose(g.hessian_diag_samples, f.hessian_diag_samples, rtol=1e-12, atol=1e-16)


def test_conv_transpose_canonical_layout():
    from normflat.engine.options import validate_options

    torch.manual_seed(0)
    layer = nn.ConvTranspose2d(4, 6, 2, groups=2).to(DT)  # weight (in=4, out/groups=3, 2, 2)
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(3, dtype=DT))
    model(torch.randn(1, 4, 3, 3, dtype=DT))
    x, y = torch.randn(5, 4, 3, 3, dtype=DT), torch.randint(0, 3, (5,))
    problems, _ = tb.layer_problems(model.to(DT), (x, y), validate_options(progress=False))
    w = problems[0].weight
    assert problems[0].shape == (6, 2, 2, 2)  # (out, in/groups, kh, kw)
    for o in range(6):
        for i in range(2):
            g, og = divmod(o, 3)  # output channel o is channel og of group g
            torch.testing.assert_close(w[o, i], layer.weight[g * 2 + i, og].detach(), atol=0, rtol=0)


def test_memory_budget_chooses_the_chunk_size():
    model, x, y = make("cnn_smooth", n=9)
    want = nf(model, (x, y), estimator="ggn")
    report = normflat.analyze(model, (x, y), estimator="ggn", memory_budget="20KB", progress=False)
    assert report.metadata["memory_budget"] == 20_000
    got = nf(model, (x, y), estimator="ggn", memory_budget=20_000)
    assert_diag_close(got, want, model, atol=1e-14, rtol=1e-11)
    with pytest.raises(ValueError, match="too small"):
        nf(model, (x, y), estimator="ggn", memory_budget=100)
    with pytest.raises(ValueError, match="not both"):
        nf(model, (x, y), estimator="ggn", memory_budget="1MB", chunk_size=2)


def _signal_steps(monkeypatch):
    """Record the signal blocks formed and those the fast and generic paths receive (their signals per
    sample)."""
    seen = []
    fast, generic = TorchSession._fast_squares, TorchSession._generic_squares

    def fast_spy(self, logits, block, *rest):
        seen.append(int(block[0].shape[0]) * int(block[0].shape[1]))
        return fast(self, logits, block, *rest)

    def generic_spy(self, xc, block, *rest):
        seen.append(int(block[0].shape[0]) * int(block[0].shape[1]))
        return generic(self, xc, block, *rest)

    monkeypatch.setattr(TorchSession, "_fast_squares", fast_spy)
    monkeypatch.setattr(TorchSession, "_generic_squares", generic_spy)
    # The signals formed (at the logits, or pulled back through a head), not only those
    # back-propagated: one sample's C − 1 signals never exist at once.
    from normflat.engine import losses

    def formed(fn):
        def spy(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.append(int(out.shape[0]) * int(out.shape[1]))
            return out
        return spy

    for owner, name in [(losses, "output_signals"), (losses.Factor, "dense"), (losses.Factor, "through")]:
        monkeypatch.setattr(owner, name, formed(getattr(owner, name)))
    return seen


@pytest.mark.parametrize("case", ["structured-head", "at-the-logits", "generic", "topk-groups", "default-budget"])
def test_one_samples_signals_in_steps_when_they_exceed_the_memory(case, monkeypatch):
    """When one sample's signals alone exceed the memory (the exact ggn with many classes), they are
    back-propagated a few at a time: every block within the budget, the same numbers as all at once
    and as the brute-force GGN; the groups of ggn-topk kept apart; an error only if one signal of
    every group does not fit."""
    from normflat.engine.options import validate_options

    torch.manual_seed(1)
    classes = 130 if case in ("structured-head", "topk-groups", "default-budget") else 20
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(12, 6), nn.Tanh(),
                          nn.Linear(6, classes)).to(DT).eval()
    x, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, classes, (5,))
    options = {"loss": "ce", **({"fast": False} if case == "generic" else {})}
    if case == "topk-groups":
        validated = validate_options(loss="ce", estimator="ggn-topk", top_classes=2, samples=60, progress=False)
        want, _ = tb.layer_problems(model, (x, y), validated, chunk_size=5)
        seen = _signal_steps(monkeypatch)
        got, _ = tb.layer_problems(model, (x, y), validated, memory_budget=20_000)
        for a, b in zip(got, want):  # every group's sums, not only their mean
            torch.testing.assert_close(torch.as_tensor(a.hessian_diag_samples), torch.as_tensor(b.hessian_diag_samples),
                                       rtol=1e-10, atol=1e-15)
        assert len(seen) > 5 and max(seen) < 6 * 60, seen  # (1 + K) · M signals per sample, in steps
        return
    whole = nf(model, (x, y), estimator="ggn", chunk_size=5, **options)
    seen = _signal_steps(monkeypatch)
    if case == "default-budget":  # the default budget (twice a training step) too small for one sample
        import normflat.core.memory as memory

        monkeypatch.setattr(memory, "default_budget", lambda step, state: 20_000)
        got = nf(model, (x, y), estimator="ggn", **options)
    else:
        # The structured head's signals start at its 6 inputs: 24 entries per signal, not 278.
        budget = 20_000 if classes == 130 else 9_000
        got = nf(model, (x, y), estimator="ggn", memory_budget=budget, **options)
    assert len(seen) > 5 and max(seen) < classes - 1, seen  # one sample at a time, its signals in steps
    assert_diag_close(got, whole, model, atol=1e-14, rtol=1e-11)
    assert_diag_close(got, brute_ggn_diag(model, x, y), model, atol=1e-12, rtol=1e-9)
    with pytest.raises(ValueError, match="memory_budget=.* is too small: one back-propagated GGN signal"):
        nf(model, (x, y), estimator="ggn", memory_budget=500, **options)


def test_chunked_first_batch_is_never_run_whole():
    """The chunk size is chosen from a 2-row forward: the model never sees the whole first batch
    (whose graph would double the time of the forward and hold the peak), only the chunks. Before
    them, without gradients, the first 2 rows together and each alone (method §6, "Samples apart")."""
    model, x, y = make("cnn_smooth", n=9)
    seen, checks = [], []
    handle = model.register_forward_pre_hook(
        lambda module, args: (seen if torch.is_grad_enabled() else checks).append(int(args[0].shape[0])))
    try:
        got = nf(model, (x, y), estimator="ggn", memory_budget=6_000)
    finally:
        handle.remove()
    assert checks == [2, 1, 1], checks
    assert seen[0] == 2 and max(seen[1:]) < 9 and sum(seen[1:]) == 9, seen
    assert_diag_close(got, nf(model, (x, y), estimator="ggn"), model, atol=1e-14, rtol=1e-11)


@pytest.mark.parametrize("estimator", ["ggn-mc", "hutchinson"])
def test_group_estimates_average_to_the_diagonal(estimator):
    from normflat.engine.options import validate_options

    model, x, y = make("mlp_tanh")
    options = validate_options(estimator=estimator, samples=13, progress=False)  # 10 uneven groups
    problems, _ = tb.layer_problems(model, DataLoader(TensorDataset(x, y), batch_size=3), options)
    for p in problems:
        assert p.hessian_diag_samples.shape == (10, *p.shape)
        torch.testing.assert_close(p.hessian_diag_samples.mean(0), p.hessian_diag, atol=1e-15, rtol=1e-12)


def test_torchscript_module_is_refused_clearly():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).double()
    scripted = torch.jit.script(model)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    for estimator in ("ggn", "exact"):
        with pytest.raises(TypeError, match=r"TorchScript module.*torch\.save\(model\)"):
            normflat.analyze(scripted, (x, y), estimator=estimator, progress=False)


# ---------------------------------------------------------------- many classes, small conv outputs (method §6.1–6.2)


def _pair_model(positions):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, groups=2), nn.Flatten(),
                          nn.Linear(6 * positions**2, 5)).to(DT)
    x = torch.randn(6, 3, positions + 2, positions + 2, dtype=DT)
    return model, x, torch.randint(0, 5, (6,))


@pytest.mark.parametrize("positions", [1, 2, 3, 5])
@pytest.mark.parametrize("way", ["pairs", "chunks", "one_by_one"])
@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_conv_squares_by_pairs_of_positions_match_brute_force(positions, way, loss, monkeypatch):
    """Every way of summing a convolution's squares (over the pairs of output positions with the
    signals of a group summed first, or per-sample gradients, in chunks of samples or one sample
    at a time), whichever the cost rules pick."""
    monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape: way == "pairs")
    monkeypatch.setattr(ggn_kernels, "_ONE_BY_ONE_CONV_ENTRIES", 1 if way == "one_by_one" else 1 << 60)
    model, x, y = _pair_model(positions)
    got = normflat.hessian_diagonal(model, (x, y), loss=loss, estimator="ggn", progress=False)
    want = brute_ggn_diag(model, x, y, loss)
    for name, value in want.items():
        torch.testing.assert_close(got[name], canonical(model, name, value), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("way", ["pairs", "one_by_one", "chunks"])
@pytest.mark.parametrize("positions", [1, 3, 7])
def test_dense_squares_on_positions_every_way(way, positions, monkeypatch):
    """A dense layer on positions sums its per-sample squares ``Σ_n (Σ_t δ_t a_tᵀ)²`` three ways: by
    pairs of positions (method §6.1, "Squares by pairs of positions"), per-sample gradients one
    sample at a time (large layers), or in chunks of samples. Each equals the einsum formula in
    float64, with zero padding signals, groups of several signals, and into the sums of a
    transposed layout (``Conv1D``'s)."""
    monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape: way == "pairs")
    monkeypatch.setattr(ggn_kernels, "_ONE_BY_ONE_ENTRIES", 1 if way == "one_by_one" else 1 << 60)
    g = torch.Generator().manual_seed(positions)
    n, out_f, in_f, k, m = 4, 5, 3, 2, 3
    a = torch.randn(n, positions, in_f, generator=g, dtype=DT)
    parts = [torch.randn(n, positions, out_f, generator=g, dtype=DT) for _ in range(k * m)]
    parts[1] = None  # a padding signal
    want = torch.zeros(k, out_f, in_f, dtype=DT)
    for j, d in enumerate(parts):
        if d is not None:
            want[j // m] += torch.einsum("nto,nti->noi", d, a).square().sum(0)
    got = ggn_kernels._dense_squares(a, ggn_kernels.Deltas(list(parts), k, m), out_f, in_f)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    stored = torch.ones(k, in_f, out_f, dtype=DT)  # running sums in the (in, out) layout
    ggn_kernels._dense_squares(a, ggn_kernels.Deltas(list(parts), k, m), out_f, in_f, stored.transpose(1, 2))
    torch.testing.assert_close(stored.transpose(1, 2), want + 1, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("way", ["pairs", "one_by_one", "chunks"])
def test_dense_layers_on_positions_match_brute_force_every_way(way, monkeypatch):
    """The three ways of :func:`test_dense_squares_on_positions_every_way` in a model: dense layers on
    a sequence of 3 positions, the brute-force diagonal with every loss and in chunks."""
    monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape: way == "pairs")
    monkeypatch.setattr(ggn_kernels, "_ONE_BY_ONE_ENTRIES", 1 if way == "one_by_one" else 1 << 60)
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Flatten(), nn.Linear(15, 3)).to(DT)
    x, y = torch.randn(5, 3, 4, dtype=DT), torch.tensor([0, 1, 2, 1, 0])
    for loss in ("ce", "nsce"):
        want = brute_ggn_diag(model, x, y, loss)
        for chunk in (None, 2):
            got = normflat.hessian_diagonal(model, (x, y), loss=loss, estimator="ggn", progress=False,
                                            chunk_size=chunk)
            for name, value in want.items():
                torch.testing.assert_close(got[name], canonical(model, name, value), rtol=1e-10, atol=1e-13)


def _branch_batches() -> tuple[torch.Tensor, torch.Tensor, list]:
    """Five samples whose first feature stays below 5 (the models' branch off), and the same
    samples as two batches, the second with that feature 6 (the branch on)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 5, generator=g, dtype=DT), torch.tensor([0, 1, 2, 1, 0])
    later = x.clone()
    later[3:, 0] = 6.0
    return x, y, [(x[:3], y[:3]), (later[3:], y[3:])]


def _branch_on_later_is_exact(model: nn.Module, data: list, name: str) -> None:
    """Over ``data`` (:func:`_branch_batches`), ``name``'s curvature, nonzero from the second batch
    on, and every other layer's equal the generic path's."""
    got = nf(model, data, loss="ce", estimator="ggn")
    assert float(got[name].abs().max()) > 0
    assert_diag_close(got, nf(model, data, loss="ce", estimator="ggn", fast=False), model, atol=1e-13, rtol=1e-10)


class AuxiliaryHead(nn.Module):
    """A body, a head and an auxiliary head that runs only on inputs whose first feature exceeds 5
    in every sample (Inception's in training mode): otherwise the auxiliary weight is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.aux = nn.Linear(6, 3)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h) + self.aux(h) if bool((x[:, 0] > 5).all()) else self.head(h)


def test_a_weight_no_forward_uses_has_zero_curvature_on_no_path():
    """A weight whose module never runs and that the logits do not depend on (mBART's
    cross-attention without an encoder, Inception's auxiliary head in eval mode) takes no path:
    its diagonal is zero, as brute force and the generic path say, and its details say why; the
    other layers are exact. A later batch that runs it sends it to the generic path from there on,
    the earlier batches' zeros exact."""
    torch.manual_seed(0)
    model = AuxiliaryHead().double()
    x, y, data = _branch_batches()
    report = normflat.analyze(model, (x, y), estimator="ggn", loss="ce", progress=False)
    aux = report.layer("aux")
    assert aux.details["path"] == "fast" and "curvature is zero" in aux.details["unused"], aux.details
    assert aux.hessian_trace == 0.0 and report.layer("head").hessian_trace > 0
    want = brute_ggn_diag(model, x, y)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn"), want, model, atol=1e-13, rtol=1e-10)
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn", chunk_size=2), want, model, atol=1e-13,
                      rtol=1e-10)
    assert float(want["aux"].abs().max()) == 0.0
    report = normflat.analyze(model, data, estimator="ggn", loss="ce", progress=False)  # the second runs it
    details = report.layer("aux").details
    assert details["path"] == "generic" and "unused" not in details, details
    assert "run by a later one" in details["generic_reason"]
    _branch_on_later_is_exact(model, data, "aux")


class WeightNormalized(nn.Module):
    """A weight-normalized convolution (``torch.nn.utils.parametrizations.weight_norm``, norms over
    the kernel positions as wav2vec 2.0's positional convolution, or per output channel) and a
    weight-normalized dense layer (the older ``torch.nn.utils.weight_norm`` hook), then a head."""

    def __init__(self, dim: int = 2) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the older API is deprecated
            self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(3, 4, 3, padding=1), dim=dim)
            self.lin = nn.utils.weight_norm(nn.Linear(4 * 6, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.relu(self.lin(torch.relu(self.conv(x)).flatten(1))))


_DIRECTIONS = {"conv": "conv.parametrizations.weight.original1", "lin": "lin.weight_v", "head": "head.weight"}


def _parameter_ggn(model, x, y, names):
    """The ``nsce`` GGN diagonal of the named parameters from per-sample Jacobians (no copy of the
    model: a module with the older weight-norm hook cannot be deep-copied after a forward)."""
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        w = params[name].detach()

        def z_of(wt, name=name):
            z = functional_call(model, {name: wt}, (x,), strict=False)
            z = z - z.mean(1, keepdim=True)
            return z / torch.sqrt((z**2).mean(1, keepdim=True) + NSCE_EPS)

        z = z_of(w).detach()
        p = torch.softmax(z, 1)
        h = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
        J = jacrev(z_of)(w).reshape(z.shape[0], z.shape[1], -1)
        out[name] = ((h @ J) * J).sum((0, 1)).reshape(w.shape).detach() / z.shape[0]
    return out


def test_weight_normalized_layers_analyze_their_direction_on_a_fast_rule():
    """torch's weight normalization ``W = g · v / ‖v‖`` (both APIs): the direction ``v`` is the
    weight analyzed (method §3, "Weight normalization"), on its fast rule (method §6.1,
    "Weight-normalized layers"), the norms ``g`` excluded; the coverage is whole, the diagonal the
    brute-force one."""
    torch.manual_seed(0)
    model = WeightNormalized().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 6, generator=g, dtype=DT), torch.tensor([0, 1, 2, 0])
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    assert {"conv.parametrizations.weight.original0", "lin.weight_g"} <= set(report.metadata["excluded"])
    for name in ("conv", "lin"):
        details = report.layer(name).details
        assert details["param"] == _DIRECTIONS[name] and details["path"] == "fast", details
    got = nf(model, (x, y), estimator="ggn")
    want = _parameter_ggn(model, x, y, list(_DIRECTIONS.values()))
    for name, param in _DIRECTIONS.items():
        torch.testing.assert_close(got[name], want[param], rtol=1e-10, atol=1e-13)


class WeightNormalizedKinds(nn.Module):
    """Weight normalization over each axis a user picks, on every layer kind with a fast rule: a
    transposed convolution (HiFi-GAN's upsamplers), a 2-D convolution, a dense layer on a sequence,
    and a dense layer called twice (its per-sample gradients summed before the map to ``v``)."""

    def __init__(self, dims: tuple) -> None:
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.up = wn(nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, groups=1), dim=dims[0])
        self.conv = wn(nn.Conv2d(1, 2, (2, 3), groups=1), dim=dims[1])
        self.seq = wn(nn.Linear(4, 4), dim=dims[2])
        self.twice = wn(nn.Linear(4, 4, bias=False), dim=dims[3])
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.up(x))  # (n, 4, 11)
        h = torch.tanh(self.conv(h[:, None]))  # (n, 2, 3, 9)
        h = h.flatten(1, 2).transpose(1, 2)[..., :4]  # a sequence (n, 9, 4)
        h = torch.tanh(self.seq(h)).mean(1)
        return self.head(torch.tanh(self.twice(torch.tanh(self.twice(h)))))


_KIND_DIRECTIONS = {name: f"{name}.parametrizations.weight.original1" for name in ("up", "conv", "seq", "twice")}


def _assert_kinds_against_brute_force(model, x, y, params):
    """The ``ggn`` diagonal of each layer's parameter (``{layer: parameter name}``, the ``up`` transposed
    convolution's in the canonical ``(out, in, k)``) is the brute-force one in one chunk or two, and
    ``ggn-mc`` equals the generic path's on the same signals."""
    want = _parameter_ggn(model, x, y, list(params.values()))
    want[params["up"]] = want[params["up"]].transpose(0, 1)
    for chunk in (None, 2):
        got = nf(model, (x, y), estimator="ggn", chunk_size=chunk)
        for name, param in params.items():
            torch.testing.assert_close(got[name], want[param], rtol=1e-10, atol=1e-13)
    mc = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=2)
    generic = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=2, fast=False)
    for name in params:
        torch.testing.assert_close(mc[name], generic[name], rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dims", [(0, 0, 0, 0), (1, 2, 1, None), (2, 3, None, 1), (None, 1, 1, 0)])
def test_weight_normalized_layer_kinds_against_brute_force(dims):
    """Every fast layer kind under weight normalization over any axis, or the whole tensor (``None``):
    the fast rule's diagonal of ``v`` is the brute-force one, in one chunk or two, and the
    Monte-Carlo estimator's equals the generic path's on the same signals."""
    torch.manual_seed(0)
    model = WeightNormalizedKinds(dims).double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, 3, 6, generator=g, dtype=DT), torch.tensor([0, 1, 2, 0, 1])
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0
    assert all(layer.details["path"] == "fast" for layer in report.layers), [lb.details for lb in report.layers]
    _assert_kinds_against_brute_force(model, x, y, _KIND_DIRECTIONS)


def test_weight_normalized_jacobian_is_formed_once_per_pass_not_per_signal(monkeypatch):
    """The normalization's Jacobian (its norms, and the check of the applied weight) is formed once
    per layer and pass, also on the path of a module called twice, whatever the number of signals."""
    calls = []
    real = ggn_kernels._direction_jacobian
    monkeypatch.setattr(ggn_kernels, "_direction_jacobian", lambda module: calls.append(module) or real(module))
    torch.manual_seed(0)
    model = WeightNormalizedKinds((0, 0, 0, 0)).double()
    x, y = torch.randn(4, 3, 6, dtype=DT), torch.tensor([0, 1, 2, 0])
    counts = []
    for samples in (1, 6):
        calls.clear()
        nf(model, (x, y), estimator="ggn-mc", samples=samples, seed=0)
        counts.append(len(calls))
    assert counts[0] == counts[1] and 4 <= counts[0] <= 8, counts


def _refused_once_its_stored_weight_changes(normalize, read, match):
    """A ``Linear`` under an older normalization hook (``normalize``), in eval mode: once the hook's stored
    weight is changed after the forward that computed it, ``read`` (the rule's Jacobian) refuses it with
    ``match``; the layer is returned after one more forward (the stored weight recomputed)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older APIs are deprecated
        layer = normalize(nn.Linear(4, 3)).double().eval()
    x = torch.randn(2, 4, dtype=DT)
    layer(x)
    with pytest.raises(ggn_kernels.NoFastPath, match=match):
        with torch.no_grad():
            layer.weight.mul_(2.0)  # the hook's stored weight, recomputed at the next forward
            read(layer)
    layer(x)
    return layer


def test_weight_normalized_rule_refuses_a_weight_it_does_not_read():
    """A weight normalization whose applied weight no longer is ``g · v / ‖v‖`` (the older hook's
    stored weight, changed after the forward that computed it) sends the layer to the generic path,
    which differentiates the forward itself."""
    layer = _refused_once_its_stored_weight_changes(nn.utils.weight_norm, ggn_kernels._direction_jacobian,
                                                    "not g · v / ‖v‖")
    direction, factor, axes = ggn_kernels._direction_jacobian(layer)
    torch.testing.assert_close(layer.weight_g.detach() * direction, layer.weight.detach())  # W = g · û
    torch.testing.assert_close(factor * layer.weight_v.detach(), layer.weight.detach())
    assert axes == (1,)


def _assert_normalized_rescaling(model, other, g):
    """``other`` is ``model`` with its normalized weights rescaled: the same function on a batch drawn from
    ``g``, every layer on its fast rule, every normalized sharpness the same, every trace but the head's
    moved (method §8)."""
    x, y = torch.randn(6, 3, 6, generator=g, dtype=DT), torch.tensor([0, 1, 2, 0, 1, 2])
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert all(layer.details["path"] == "fast" for layer in after.layers)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
        if lb.name != "head":
            assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), lb.name


@pytest.mark.parametrize("dims", [(0, 0, 0, 0), (1, 1, 1, None), (None, None, None, 1)])
def test_weight_normalized_direction_rescaling_invariance(dims):
    """``W = g · v / ‖v‖`` does not change when a slice of ``v`` normalized together is multiplied
    by a positive factor, and the Hessian in that slice is divided by its square. Where the slices
    are channels (an input or an output channel: a row or a column scaling) or the whole tensor, on
    every layer kind, the normalized sharpness of each direction stays and its trace moves (method
    §3, §8). Slices along a kernel axis are not channels (a scaling the measure does not promise to
    ignore, method §3)."""
    torch.manual_seed(0)
    model = WeightNormalizedKinds(dims).double()
    other = WeightNormalizedKinds(dims).double()
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, dim in zip(("up", "conv", "seq", "twice"), dims):
            v = getattr(other, name).parametrizations.weight.original1
            shape = torch.norm_except_dim(v, 2, -1 if dim is None else dim).shape
            v.mul_(torch.exp(torch.randn(shape, generator=g, dtype=DT)))
    _assert_normalized_rescaling(model, other, g)


class SpectrallyNormalized(WeightNormalizedKinds):
    """torch's spectral normalization on every layer kind with a fast rule (``W = V / σ``, ``σ = uᵀ V v``
    from the power iteration's buffers): a transposed convolution (its ``dim=1``), a 2-D convolution,
    a dense layer on a sequence with the older ``torch.nn.utils.spectral_norm`` hook, a dense layer
    called twice (its per-sample gradients summed before the map to ``V``), then a head. ``dims``:
    the axis each is normalized over (the layer kinds' defaults, or others)."""

    def __init__(self, dims: tuple = (None, None, None, None)) -> None:
        nn.Module.__init__(self)  # the same layers and forward as WeightNormalizedKinds, spectrally normalized
        sn = nn.utils.parametrizations.spectral_norm

        def kw(dim):
            return {} if dim is None else {"dim": dim}

        self.up = sn(nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1), **kw(dims[0]))
        self.conv = sn(nn.Conv2d(1, 2, (2, 3)), **kw(dims[1]))
        self.seq = nn.utils.spectral_norm(nn.Linear(4, 4), **kw(dims[2]))
        self.twice = sn(nn.Linear(4, 4, bias=False), **kw(dims[3]))
        self.head = nn.Linear(4, 3)


_SPECTRAL_PARAMS = {"up": "up.parametrizations.weight.original", "conv": "conv.parametrizations.weight.original",
                    "seq": "seq.weight_orig", "twice": "twice.parametrizations.weight.original"}


def _spectral_model(dims=(None, None, None, None)):
    """:class:`SpectrallyNormalized` in float64 with its power iteration run a few steps in train mode
    (``u``, ``v`` near the top singular vectors, as after training), then left in train mode."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the older API is deprecated
        model = SpectrallyNormalized(dims).double()
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        model(torch.randn(2, 3, 6, generator=g, dtype=DT))
    return model


@pytest.mark.parametrize("dims", [(None, None, None, None), (0, 1, 1, 1)])
def test_spectrally_normalized_layers_against_brute_force(dims):
    """torch's spectral normalization (both APIs, every fast layer kind, any axis): ``V`` is the weight
    analyzed (method §3, "Spectral normalization"), on its fast rule (method §6.1, "Spectrally
    normalized layers"); the diagonal is the brute-force one (per-sample Jacobians with respect to ``V``), in
    one chunk or two, and the Monte-Carlo estimator's equals the generic path's. The model is in
    train mode: its power-iteration buffers and modes are left as they were (before, the layers were
    skipped, coverage 0.2, and reading the weights took a power-iteration step on the buffers)."""
    model = _spectral_model(dims)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 3, 6, generator=g, dtype=DT), torch.tensor([0, 1, 2, 0, 1])
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert report.metadata["coverage"] == 1.0 and report.metadata["unsupported"] == []
    for name, param in _SPECTRAL_PARAMS.items():
        details = report.layer(name).details
        assert details["param"] == param and details["path"] == "fast", details
    assert all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.eval()
    _assert_kinds_against_brute_force(model, x, y, _SPECTRAL_PARAMS)


def test_spectrally_normalized_rule_refuses_a_weight_it_does_not_read():
    """A spectral normalization whose applied weight no longer is ``V / σ`` (the older hook's stored
    weight, changed after the forward that computed it) sends the layer to the generic path."""
    layer = _refused_once_its_stored_weight_changes(nn.utils.spectral_norm, ggn_kernels._spectral_norm_map,
                                                    "not V / σ")
    parameter, of_weight = ggn_kernels._spectral_norm_map(layer)
    assert parameter is not None and of_weight(torch.zeros(1, 3, 4, dtype=DT)).abs().max() == 0


@pytest.mark.parametrize("dims", [(None, None, None, None), (0, 1, 1, 1)])
def test_spectrally_normalized_scale_invariance(dims):
    """``W = V / σ`` does not change when ``V`` is multiplied by a positive factor (``σ`` scales with it,
    ``u`` and ``v`` stay), and the Hessian in ``V`` is divided by its square: every layer's normalized
    sharpness stays and the normalized layers' traces move (method §3, §8)."""
    model, other = _spectral_model(dims), _spectral_model(dims)
    model.eval()
    other.eval()
    with torch.no_grad():
        for factor, param in zip((3.0, 0.4, 2.5, 0.7), _SPECTRAL_PARAMS.values()):
            other.get_parameter(param).mul_(factor)
    g = torch.Generator().manual_seed(2)
    _assert_normalized_rescaling(model, other, g)


class DeadPooler(nn.Module):
    """An encoder whose pooler runs but whose head reads the first token, not the pooled output
    (BigBird's classifier): the pooler's weight gets no signal, but on inputs whose first feature
    exceeds 5 in every sample, where the head reads the pooled output too."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(5, 6)
        self.pooler = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.encode(x))
        pooled = torch.tanh(self.pooler(h))
        return self.head(h + pooled) if bool((x[:, 0] > 5).all()) else self.head(h)


def test_a_layer_whose_output_the_logits_do_not_read_keeps_its_fast_rule():
    """A module that runs but whose output the logits do not depend on (an unused pooler) keeps
    its fast rule: no signal reaches it, its diagonal is zero, as brute force says; a later batch
    whose logits read it gets its curvature from the same rule, as the generic path."""
    torch.manual_seed(0)
    model = DeadPooler().double()
    x, y, data = _branch_batches()
    report = normflat.analyze(model, (x, y), estimator="ggn", loss="ce", progress=False)
    assert {layer.details["path"] for layer in report.layers} == {"fast"}
    assert report.layer("pooler").hessian_trace == 0.0
    assert_diag_close(nf(model, (x, y), loss="ce", estimator="ggn"), brute_ggn_diag(model, x, y), model,
                      atol=1e-13, rtol=1e-10)
    _branch_on_later_is_exact(model, data, "pooler")
    assert normflat.analyze(model, data, estimator="ggn", loss="ce", progress=False).layer(
        "pooler").details["path"] == "fast"


class FoldedPooling(nn.Module):
    """MViTv2's pooling: each sample's ``heads`` maps of ``d`` channels folded into the batch axis,
    ``(n·heads, d, h, w)``, through one convolution (``groups``: 1, or ``d`` for a depthwise one)."""

    def __init__(self, heads: int = 3, d: int = 4, groups: int = 1) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.embed = nn.Conv2d(3, heads * d, 3, padding=1)
        self.pool = nn.Conv2d(d, d, 3, stride=2, padding=1, groups=groups)
        self.head = nn.Linear(heads * d * 3 * 3, 5)

    def forward(self, x):
        n = x.shape[0]
        maps = self.embed(x).relu().reshape(n * self.heads, self.d, *x.shape[2:])
        return self.head(torch.tanh(self.pool(maps)).reshape(n, -1))


@pytest.mark.parametrize("groups", [1, 4], ids=["dense", "depthwise"])
@pytest.mark.parametrize("way", ["pairs", "chunks", "one_by_one"])
def test_convolution_on_maps_folded_into_the_batch_axis_matches_brute_force(groups, way, monkeypatch):
    """A convolution fed ``(n·heads, d, h, w)`` (each sample's maps one after the other) keeps its
    fast rule: a sample's per-sample gradient sums its maps' (their positions as one sample's,
    method §6.1); with every way of summing the squares (by pairs, per-sample gradients in chunks
    or one sample at a time), in chunks of one and of two samples and over two batches, and
    ``ggn-mc`` (its groups' kernel sums) equal to the generic path."""
    monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape: way == "pairs")
    monkeypatch.setattr(ggn_kernels, "_ONE_BY_ONE_CONV_ENTRIES", 1 if way == "one_by_one" else 1 << 60)
    torch.manual_seed(0)
    model = FoldedPooling(groups=groups).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 6, 6, generator=g, dtype=DT), torch.tensor([0, 1, 4, 2])
    report = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    assert report.layer("pool").details["path"] == "fast", report.layer("pool").details
    want = brute_ggn_diag(model, x, y)
    for data, kw in [((x, y), {}), ((x, y), {"chunk_size": 1}), ((x, y), {"chunk_size": 2}),
                     ([(x[:1], y[:1]), (x[1:], y[1:])], {})]:
        assert_diag_close(nf(model, data, loss="ce", estimator="ggn", **kw), want, model, atol=1e-13, rtol=1e-10)
    fast = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=4)
    generic = nf(model, (x, y), estimator="ggn-mc", samples=3, seed=4, fast=False)
    assert_diag_close(fast, generic, model, atol=1e-13, rtol=1e-10)


def test_folded_convolution_channel_rescaling_invariance():
    """The folded pooling convolution's output channels times positive factors, the head's matching
    inputs divided by them through ``relu``: the function is unchanged, the normalized sharpness of
    every layer stays and the pooling convolution's trace moves."""
    class ReluPooling(FoldedPooling):
        def forward(self, x):
            n = x.shape[0]
            maps = self.embed(x).relu().reshape(n * self.heads, self.d, *x.shape[2:])
            return self.head(self.pool(maps).relu().reshape(n, -1))

    torch.manual_seed(0)
    model = ReluPooling().double()
    other = copy.deepcopy(model)
    units = torch.exp(torch.linspace(-1.0, 1.0, 4, dtype=DT))
    with torch.no_grad():
        other.pool.weight.mul_(units[:, None, None, None])
        other.pool.bias.mul_(units)
        # The head reads (n, heads, d, 3, 3) flattened: channel c of every head and position.
        other.head.weight.div_(units[None, :, None].expand(3, 4, 9).reshape(1, -1))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 3, 6, 6, generator=g, dtype=DT), torch.tensor([0, 1, 4, 2, 3])
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert after.layer("pool").details["path"] == "fast"
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    assert abs(after.layer("pool").hessian_trace - before.layer("pool").hessian_trace) > 1e-3 * abs(
        before.layer("pool").hessian_trace)


def test_conv_squares_by_pairs_keep_every_group_apart(monkeypatch):
    """ggn-topk's shared and sampled groups summed by pairs equal the per-sample gradients' groups
    (the signals are summed within a group, never across), chunked or not, and both equal the
    generic path's (per-sample gradients of the whole model, its K' full-size sums reduced by the
    state): the rule adds each group's squares into the kernel sums and the numerator itself
    (ggn.KernelSums), from the second chunk on into the state's own."""
    from normflat.engine.options import validate_options

    model, x, y = _pair_model(2)
    runs, diags = {}, {}
    options = validate_options(loss="ce", estimator="ggn-topk", top_classes=2, samples=6, progress=False)
    for by_pairs in (True, False):
        for chunk in (None, 4):
            monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape, on=by_pairs: on)
            backend = {} if chunk is None else {"chunk_size": chunk}
            problems, _ = tb.layer_problems(model, (x, y), options, **backend)
            runs[by_pairs, chunk] = [p.hessian_diag_samples for p in problems[:2]]
            diags[by_pairs, chunk] = [p.hessian_diag for p in problems[:2]]
    # The convolutions (the dense head is exact on the fast path, sampled on the generic one).
    problems, _ = tb.layer_problems(model, (x, y), options, fast=False)
    reference = [p.hessian_diag_samples for p in problems[:2]]
    for key, means in diags.items():
        for got, want in zip(means, [p.hessian_diag for p in problems[:2]]):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-10, atol=1e-14)
    for key, groups in runs.items():
        for got, want in zip(groups, reference):
            torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), rtol=1e-10, atol=1e-14)
    assert not torch.equal(torch.as_tensor(reference[1][0]), torch.as_tensor(reference[1][1]))  # groups differ


@pytest.mark.parametrize("name", ["cnn_relu", "conv1d", "conv3d", "conv_transpose"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_kernel_summed_groups_equal_the_generic_paths(name, chunk):
    """Under analyze a convolution's groups are kernel sums beside one full-size numerator
    (method §6.2): the convolution rules (ConvNd, ConvTransposeNd) add each group's squares into
    them as they go (ggn.KernelSums, into the state's own arrays from the second chunk on). Both
    equal the generic path's, whose K' full-size sums the state reduces."""
    from normflat.engine.options import validate_options

    model, x, y = make(name, n=7)
    options = validate_options(loss="ce", estimator="ggn-mc", samples=4, progress=False)
    backend = {} if chunk is None else {"chunk_size": chunk}
    fast, _ = tb.layer_problems(model, (x, y), options, **backend)
    generic, _ = tb.layer_problems(model, (x, y), options, fast=False)
    kernels = 0
    for got, want in zip(fast, generic):
        samples = torch.as_tensor(got.hessian_diag_samples)
        kernels += samples.dim() > 2 and samples.shape[2:] != torch.as_tensor(got.hessian_diag).shape[1:]
        torch.testing.assert_close(samples, torch.as_tensor(want.hessian_diag_samples), rtol=1e-10, atol=1e-15)
        torch.testing.assert_close(torch.as_tensor(got.hessian_diag), torch.as_tensor(want.hessian_diag),
                                   rtol=1e-10, atol=1e-15)
    assert kernels >= 1  # some layer's groups were kept as kernel sums


@pytest.mark.parametrize("estimator, options", [("exact", {}), ("ggn", {}), ("ggn-mc", {"samples": 4})])
def test_conv_transpose_channel_rescaling_invariance(estimator, options):
    """Method §8 for ConvTransposeNd, whose weight is (in, out/groups, *k): scaling the grouped
    first layer's output channel o by α_o (its weight slice [group of o, o within it] and bias)
    and the second layer's input channel o (weight[o]) by 1/α_o, and the second layer's output
    channel p by β_p against the head's columns of p, leaves the function (ReLU between) and
    every layer's normalized sharpness unchanged and moves the traces. ggn-mc keeps its groups
    as kernel sums (ggn.KernelSums)."""
    model, x, y = make("conv_transpose", n=9)
    first, second, head = model[0], model[2], model[5]
    alpha = torch.tensor([0.5, 3.0, 1.7, 0.25], dtype=DT)
    beta = torch.tensor([2.5, 0.4], dtype=DT)
    positions = head.in_features // second.out_channels
    scaled = copy.deepcopy(model)
    with torch.no_grad():
        cout_g = first.out_channels // first.groups
        for o in range(first.out_channels):
            group, j = divmod(o, cout_g)
            cin_g = first.in_channels // first.groups
            scaled[0].weight[group * cin_g:(group + 1) * cin_g, j] *= alpha[o]
        scaled[0].bias *= alpha
        scaled[2].weight /= alpha[:, None, None, None]
        scaled[2].weight *= beta[None, :, None, None]
        scaled[2].bias *= beta
        scaled[5].weight /= beta.repeat_interleave(positions)[None, :]
    torch.testing.assert_close(scaled(x), model(x), rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, (x, y), estimator=estimator, progress=False, seed=5, **options)
    after = normflat.analyze(scaled, (x, y), estimator=estimator, progress=False, seed=5, **options)
    for a, b in zip(before.layers, after.layers):
        assert b.normalized_sharpness == pytest.approx(a.normalized_sharpness, rel=1e-8), a.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=1e-8)
    for i in (0, 1, 2):  # every layer's curvature moves with its weights
        assert not math.isclose(after.layers[i].hessian_trace, before.layers[i].hessian_trace, rel_tol=1e-3)


def test_squares_by_pairs_cost_rule():
    """The measured cost rule: small maps of big layers by pairs, large maps per sample."""
    assert ggn_kernels.squares_by_pairs(1, 2, 512 * 4608)
    assert ggn_kernels.squares_by_pairs(4, 2, 256 * 2304)
    assert ggn_kernels.squares_by_pairs(9, 1, 256 * 2304)
    assert ggn_kernels.squares_by_pairs(16, 9, 128 * 1152) and not ggn_kernels.squares_by_pairs(16, 2, 128 * 1152)
    assert not ggn_kernels.squares_by_pairs(36, 9, 128 * 864) and not ggn_kernels.squares_by_pairs(25, 9, 32 * 288)
    assert not ggn_kernels.squares_by_pairs(784, 9, 64 * 75)


def _head_model(classes):
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, classes)).to(DT)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_ggn_through_a_structured_head_matches_brute_force(loss):
    """At 40 classes the head is squared from the logit-Hessian diagonal and the other layers' signals
    start at its input (no C² term); the numbers are those of the brute-force GGN."""
    model = _head_model(40)
    x = torch.randn(9, 6, dtype=DT)
    y = torch.randint(0, 40, (9,))
    got = normflat.hessian_diagonal(model, (x, y), loss=loss, estimator="ggn", progress=False)
    for name, value in brute_ggn_diag(model, x, y, loss).items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("loss", ["ce", "nsce"])
def test_ggn_topk_with_every_class_on_top_is_exact(loss):
    model = _head_model(7)
    x = torch.randn(9, 6, dtype=DT)
    y = torch.randint(0, 7, (9,))
    got = normflat.hessian_diagonal(model, (x, y), loss=loss, estimator="ggn-topk", top_classes=7, progress=False)
    for name, value in brute_ggn_diag(model, x, y, loss).items():
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-14)


def test_ggn_topk_head_is_exact_and_hidden_layers_within_their_errors():
    model = _head_model(30)
    x = torch.randn(64, 6, dtype=DT)
    y = torch.randint(0, 30, (64,))
    exact = normflat.analyze(model, (x, y), estimator="ggn", progress=False)
    auto = normflat.analyze(model, (x, y), progress=False)  # the default: 30 classes take ggn-topk
    assert (auto.metadata["estimator"], auto.metadata["samples"], auto.metadata["top_classes"]) == ("ggn-topk", 10, 2)
    assert normflat.analyze(_head_model(10), (x, y % 10), progress=False).metadata["estimator"] == "ggn"
    head_exact, head = exact.layers[-1], auto.layers[-1]
    assert head.normalized_sharpness == pytest.approx(head_exact.normalized_sharpness, rel=1e-10)
    assert head.standard_error["normalized_sharpness"] == pytest.approx(0.0, abs=1e-12)
    for a, b in zip(exact.layers[:-1], auto.layers[:-1]):
        se = b.standard_error["normalized_sharpness"]
        assert 0 < se < 0.5 * a.normalized_sharpness
        assert abs(b.normalized_sharpness - a.normalized_sharpness) < 5 * se + 1e-12


class _TokenModel(nn.Module):
    """Token logits (n, T, C) from an embedding, a convolution over the tokens and a dense head."""

    def __init__(self, vocab=30, width=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Conv1d(width, width, 3, padding=1)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(h)


@pytest.mark.parametrize("case", ["cnn_relu", "tokens", "generic", "chunked"])
@pytest.mark.parametrize("estimator", ["ggn-topk", "ggn-mc"])
def test_hessian_diagonal_pools_the_group_sums_to_their_mean(case, estimator):
    """hessian_diagonal keeps one sum per weight for all groups (ggn-topk: 1 instead of 1 + K):
    the same draws, so the mean of analyze's group estimates, on the fast path (padding signals not
    back-propagated), token logits, the generic path and chunks."""
    from normflat.engine.options import validate_options

    backend: dict = {}
    if case == "tokens":
        torch.manual_seed(1)
        model = _TokenModel().to(DT)
        x = torch.randint(0, 30, (5, 7))
        y = torch.randint(0, 30, (5, 7))
        y[0, :3] = -100
    else:
        model, x, _ = make("cnn_relu", n=9)
        y = torch.randint(0, 3, (9,))
        backend = {"generic": {"fast": False}, "chunked": {"chunk_size": 4}}.get(case, {})
    options = dict(loss="ce", estimator=estimator, samples=7, progress=False)
    if estimator == "ggn-topk":
        options["top_classes"] = 3 if case == "tokens" else 1
    pooled = normflat.hessian_diagonal(model, (x, y), **options, **backend)
    validated = validate_options(**options)
    problems, _ = tb.layer_problems(model, (x, y), validated, **backend)
    distinct = 0
    for (name, value), problem in zip(pooled.items(), problems):
        groups = torch.as_tensor(problem.hessian_diag_samples)
        assert groups.shape[0] == validated.groups > 1
        distinct += not torch.allclose(groups[0], groups[1])  # ggn-topk's dense head is exact: equal groups
        # A convolution's groups are kept as kernel sums (engine.estimators, kernel_axes).
        summed = value if groups.shape[1:] == value.shape else value.sum(dim=tuple(range(2, value.dim())), keepdim=True)
        torch.testing.assert_close(summed, groups.mean(0), rtol=1e-10, atol=1e-15)
        torch.testing.assert_close(value, torch.as_tensor(problem.hessian_diag), rtol=1e-10, atol=1e-15)
    assert distinct >= 2


@pytest.mark.parametrize("case", ["cnn_relu", "tokens", "per token", "signal steps", "generic"])
@pytest.mark.parametrize("estimator, options", [
    ("ggn-topk", dict(samples=7, top_classes=4)), ("ggn-mc", dict(samples=13)),
])
def test_padding_signals_are_not_back_propagated(monkeypatch, case, estimator, options):
    """Groups shorter than the (K', M) layout are padded with zero signals (ggn-topk's 4 exact
    classes against 2 draws per group, 7 draws in 5 groups; ggn-mc's 13 draws in 10): only the real ones are
    back-propagated (losses.padding_signals), pooled or not, and every sum is the one the padded
    layout gives."""
    from normflat.engine import losses
    from normflat.engine.options import validate_options

    backend: dict = {}
    if case in ("tokens", "per token"):
        torch.manual_seed(1)
        model = _TokenModel().to(DT)
        x, y = torch.randint(0, 30, (5, 7)), torch.randint(0, 30, (5, 7))
        y[0, :3] = -100
        if case == "per token":
            options = dict(options, sequence_signals=False)
    else:
        model, x, _ = make("cnn_relu", n=9)
        y = torch.randint(0, 3, (9,))
        if case == "signal steps":  # one sample at a time, its signals a few members at a time
            backend = {"memory_budget": 20_000 if estimator == "ggn-topk" else 24_000}
        if case == "generic":  # vmap over the per-sample vjp: the real signals in groups of unequal sizes
            backend = {"fast": False}
    kw = dict(loss="ce", estimator=estimator, progress=False, seed=3, **options, **backend)
    validated = validate_options(**{k: v for k, v in kw.items() if k not in backend})
    seen: list[int] = []
    original = ggn_kernels.backprop_signals

    def counting(logits, outs, sig, batched):
        seen.append(int(sig.shape[0]))
        return original(logits, outs, sig, batched)

    monkeypatch.setattr(ggn_kernels, "backprop_signals", counting)
    generic = ggn_kernels.generic_ggn

    def counting_generic(model, inputs, sig, layers, pick, counts=None):
        seen.append(int(sig.shape[0]) if counts is not None else int(sig.shape[0] * sig.shape[1]))
        return generic(model, inputs, sig, layers, pick, counts=counts)

    monkeypatch.setattr(ggn_kernels, "generic_ggn", counting_generic)
    results = {}
    for padded in (False, True):
        if padded:
            monkeypatch.setattr(losses, "padding_signals", lambda *a, **k: [])
        seen.clear()
        pooled = normflat.hessian_diagonal(model, (x, y), **kw)
        counts = {"pooled": sum(seen)}
        if case == "signal steps":
            assert len(seen) > x.shape[0]  # more than one back-propagation per sample
        seen.clear()
        problems, _ = tb.layer_problems(model, (x, y), validated, **backend)
        counts["groups"] = sum(seen)
        results[padded] = (pooled, problems, counts)
    (pooled, problems, counts), (pooled_all, problems_all, counts_all) = results[False], results[True]
    c = 30 if case in ("tokens", "per token") else 3
    per_sequence = case == "tokens"
    real = len(losses.signal_slots(validated, c, sequence=per_sequence))
    layout = validated.state_groups * (validated.token_signals_per_group(c, 1) if per_sequence
                                       else validated.signals_per_group(c))
    assert real < layout - (validated.token_signals_per_group(c, 1) if per_sequence and validated.shared_group else 0)
    for key in ("pooled", "groups"):
        assert counts[key] < counts_all[key], (key, counts, counts_all)
        if case in ("cnn_relu", "generic"):  # one block of every signal per chunk
            assert counts[key] % real == 0 and counts_all[key] % layout == 0
            assert counts[key] // real == counts_all[key] // layout
    for name in pooled:
        torch.testing.assert_close(pooled[name], pooled_all[name], rtol=1e-12, atol=1e-16)
    for p, q in zip(problems, problems_all):
        np.testing.assert_allclose(np.asarray(p.hessian_diag_samples), np.asarray(q.hessian_diag_samples),
                                   rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize("estimator, options", [
    ("ggn-mc", dict(samples=6)), ("ggn-topk", dict(samples=6, top_classes=3)), ("hutchinson", dict(samples=7)),
])
def test_convolution_groups_kept_as_kernel_sums_give_the_full_groups_report(monkeypatch, estimator, options):
    """analyze keeps a convolution's (grouped, transposed) groups as kernel sums (method §6.2, memory
    of the groups): the report, standard errors included, is the one from the full groups, over two
    batches; the problems' samples are the kernel sums."""
    from normflat.backends.torch.layers import TorchLayer
    from normflat.engine.options import validate_options

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, groups=2), nn.ReLU(),
                          nn.ConvTranspose2d(4, 6, 3, groups=2), nn.Flatten(), nn.Linear(6 * 8 * 8, 40)).to(DT)
    x, y = torch.randn(24, 3, 8, 8, dtype=DT), torch.randint(0, 40, (24,))
    data = [(x[:12], y[:12]), (x[12:], y[12:])]
    kw = dict(loss="ce", estimator=estimator, progress=False, **options)
    problems, _ = tb.layer_problems(model, data, validate_options(**kw))
    summed = normflat.analyze(problems)
    k = validate_options(**kw).groups
    assert [tuple(p.hessian_diag_samples.shape) for p in problems] == [
        (k, 6, 3, 1, 1), (k, 4, 3, 1, 1), (k, 6, 2, 1, 1), (k, 40, 384)]
    monkeypatch.setattr(TorchLayer, "kernel_axes", lambda self: ())
    full = normflat.analyze(model, data, **kw)
    for a, b in zip(summed.layers, full.layers):
        assert a.normalized_sharpness == pytest.approx(b.normalized_sharpness, rel=1e-13)
        for m, se in b.standard_error.items():
            assert se > 0 or (a.name == "6" and estimator == "ggn-topk")  # its exact dense head: 0
            assert a.standard_error[m] == pytest.approx(se, rel=1e-12, abs=1e-300), (a.name, m)


# ----------------------------------------------------------------------------- weights functional_call cannot swap


class _HeldWeight(nn.Module):
    """A dense layer whose weight the forward reaches through ``held`` instead of the module
    (``held``: a plain list, which ``functional_call`` does not swap, or an ``nn.ParameterList``,
    whose registered name is tied to the module's and swapped with it); ``held=None``: the module."""

    def __init__(self, held):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)
        self.held = None if held is None else held([self.a.weight])

    def forward(self, x):
        w = self.a.weight if self.held is None else self.held[0]
        return self.b(torch.relu(F.linear(x, w, self.a.bias)))


def _held_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(6, 4, generator=g, dtype=DT), torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("estimator", ["ggn", "ggn-mc", "exact", "hutchinson"])
def test_weight_held_in_a_plain_list_is_refused_not_zero(estimator):
    """``functional_call`` (the generic path, the Hessian-vector products) swaps module attributes:
    a weight the forward takes from a plain list would keep its original, and its curvature would
    read as zero. Refused with the cause and the fix, and the fix (an ``nn.ParameterList``) gives the
    numbers of the model that uses its module."""
    plain, listed, fixed = (_HeldWeight(held).double() for held in (None, list, nn.ParameterList))
    for other in (listed, fixed):  # in place: the references stay the module's parameters
        with torch.no_grad():
            for p, q in zip(other.parameters(), plain.parameters()):
                p.copy_(q)
    data = _held_data()
    flags = [p.requires_grad for p in listed.parameters()]
    # The GGN's fast path records the weight at its F.linear call and swaps nothing: the right
    # numbers. The generic path (and the Hessian-vector products) would read zero: refused.
    with pytest.raises(ValueError, match=r"'a\.weight' through a reference other than their module attribute"
                                         r".*functional_call.*nn\.ParameterList"):
        normflat.hessian_diagonal(listed, data, estimator=estimator, progress=False,
                                  **({"fast": False} if estimator.startswith("ggn") else {}))
    assert [p.requires_grad for p in listed.parameters()] == flags
    if estimator.startswith("ggn"):
        seen = normflat.hessian_diagonal(listed, data, estimator=estimator, progress=False)
        want = normflat.hessian_diagonal(plain, data, estimator=estimator, progress=False)
        assert set(seen) == set(want) and all(torch.allclose(seen[k], want[k], rtol=1e-12, atol=0) for k in want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the list's entry is the layer's weight, not a skipped parameter
        got = normflat.hessian_diagonal(fixed, data, estimator=estimator, progress=False)
    ref = normflat.hessian_diagonal(plain, data, estimator=estimator, progress=False)
    assert set(got) == set(ref) == {"a", "b"}
    for name in ref:
        assert float(ref[name].abs().sum()) > 0
        torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["adaptive_sharpness", "fisher_rao_norm", "path_norm"])
def test_rival_measures_refuse_a_weight_held_in_a_plain_list(name):
    """The rival measures swap perturbed (or squared) weights in with ``functional_call`` too."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"'a\.weight' through a reference other than their module attribute"):
        normflat.measures(_HeldWeight(list).double(), _held_data(), names=[name], progress=False)


def test_a_parameter_list_registered_before_the_layer_holding_its_weight_is_not_skipped():
    """The loose parameters of modules without an extractor are settled after the walk: an
    ``nn.ParameterList`` registered before the layer whose weight it holds is that layer's
    weight, not a skipped parameter."""

    class ListFirst(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.Linear(4, 3)
            self.held = nn.ParameterList([layer.weight])
            self.a = layer

        def forward(self, x):
            return F.linear(x, self.held[0], self.a.bias)

    torch.manual_seed(0)
    model = ListFirst().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = normflat.analyze(model, _held_data(), progress=False, estimator="ggn")
    assert [layer.name for layer in report.layers] == ["a"]
    assert report.metadata["unsupported"] == [] and report.metadata["coverage"] == 1.0
