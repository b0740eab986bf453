"""PyTorch backend over the engine: the data contract, bad input, randomness, side effects.

Every bad input of the issue gets a test here, with the engine's message; the
stochastic estimators are checked against the framework-free reference session
of ``tests/engine/_fakes.py`` (same draws, same numbers); two analyses in two
threads must leave warnings, the global RNG and the models untouched.
"""

from __future__ import annotations

import copy
import itertools
import threading
import warnings

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import normflat  # noqa: E402
from normflat.backends.torch import ggn as ggn_kernels  # noqa: E402
from normflat.engine import METADATA_KEYS, DETAIL_KEYS, driver  # noqa: E402
from normflat.engine.options import validate_options  # noqa: E402

DT = torch.float64


def mlp(seed=0, classes=3, bias=True):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6, bias=bias), nn.ReLU(), nn.Linear(6, classes, bias=bias)).to(DT).eval()


def data(n=9, seed=1, classes=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def nf(model, d, **kw):
    kw.setdefault("progress", False)
    return normflat.hessian_diagonal(model, d, **kw)


def assert_same(a, b, rtol=1e-12, atol=1e-15):
    assert list(a) == list(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


ESTIMATORS = [("ggn", {}), ("ggn-mc", {"samples": 3}), ("hutchinson", {"samples": 4}), ("exact", {})]


# ----------------------------------------------------------------------------- model outputs


@pytest.mark.parametrize("estimator,kw", ESTIMATORS)
def test_probabilities_as_logits_refused(estimator, kw):
    model = nn.Sequential(mlp(), nn.Softmax(-1))
    with pytest.raises(ValueError, match="probabilities.*Remove the final softmax"):
        nf(model, data(), estimator=estimator, **kw)


def test_constant_logits_nsce_refused_ce_valid():
    model = mlp()
    with torch.no_grad():
        model[2].weight.zero_()
        model[2].bias.zero_()  # a zero-initialized head: every sample's logits are equal
    for estimator in ("ggn", "exact"):
        with pytest.raises(ValueError, match=r"\(nearly\) equal across classes"):
            nf(model, data(), estimator=estimator)
    report = normflat.analyze(model, data(), loss="ce", progress=False)
    assert np.isfinite(report.normalized_sharpness) and report.hessian_trace > 0


def test_single_output_unit_refused():
    with pytest.raises(ValueError, match="single output unit"):
        nf(mlp(classes=1), data(classes=1))


def test_logits_near_the_float32_range():
    # Bias-free ReLU net: scaling both layers by 1e10 scales the logits to ~1e20, which nsce
    # does not see, so normalized sharpness must equal the unscaled float64 model's.
    model = mlp(bias=False)
    x, _ = data(40)
    x = x[model(x).std(1) > 0.1][:20]  # no sample with all hidden units dead (constant logits)
    y = torch.randint(0, 3, (len(x),), generator=torch.Generator().manual_seed(2))
    big = copy.deepcopy(model).float()
    with torch.no_grad():
        big[0].weight.mul_(1e10)
        big[2].weight.mul_(1e10)
        assert float(big(x.float()).abs().max()) > 1e19
    for estimator, kw in ESTIMATORS:
        want = normflat.analyze(model, (x, y), estimator=estimator, progress=False, **kw)
        got = normflat.analyze(big, (x.float(), y), estimator=estimator, progress=False, **kw)
        assert got.normalized_sharpness == pytest.approx(want.normalized_sharpness, rel=1e-4), estimator


def test_nan_logits_refused():
    model = mlp()
    with torch.no_grad():
        model[2].bias[0] = float("inf")
    with pytest.raises(ValueError, match="logits contain NaN or infinite"):
        nf(model, data())


# ----------------------------------------------------------------------------- losses


def test_custom_loss_returning_per_sample_vector_refused():
    def per_sample(z, y):
        return F.cross_entropy(z, y, reduction="none")

    for estimator in ("exact", "hutchinson"):
        with pytest.raises(TypeError, match="must return the mean loss of the batch, a scalar"):
            nf(mlp(), data(), loss=per_sample, estimator=estimator)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_loss_refused(bad):
    with pytest.raises(ValueError, match="the loss is NaN or infinite"):
        nf(mlp(), data(), loss=lambda z, y: F.cross_entropy(z, y) * bad, estimator="exact")


def test_custom_loss_labels_checked_against_the_logits():
    x, y = data()
    for estimator in ("exact", "hutchinson"):
        with pytest.raises(ValueError, match=r"class indices in \[0, 2\]"):
            nf(mlp(), (x, y + 3), loss=lambda z, t: F.cross_entropy(z, t % 3), estimator=estimator)


def test_custom_loss_gets_non_index_labels_as_given():
    x, y = data()
    target = F.one_hot(y, 3).to(DT) * 0.8 + 0.2 / 3  # soft labels are fine for a custom loss

    def soft_ce(z, t):
        return -(t * torch.log_softmax(z, 1)).sum(1).mean()

    got = nf(mlp(), (x, target), loss=soft_ce, estimator="exact")
    assert all(torch.isfinite(v).all() for v in got.values())


def test_samples_with_ggn_refused():
    with pytest.raises(ValueError, match="samples=3 has no meaning"):
        nf(mlp(), data(), estimator="ggn", samples=3)


# ----------------------------------------------------------------------------- the data contract


def test_mismatched_lengths_refused():
    x, y = data()
    with pytest.raises(ValueError, match="9 inputs but 8 labels"):
        nf(mlp(), (x, y[:8]))
    with pytest.raises(ValueError, match="different numbers of samples"):
        normflat.analyze(TwoInputs(), ((x, x[:5, :2]), y), progress=False)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3, dtype=DT)
        self.b = nn.Linear(2, 3, dtype=DT)

    def forward(self, u, v):
        return self.a(u) + self.b(v)


def test_single_pair_is_one_batch_and_chunks_do_not_matter():
    x, y = data(30)
    for estimator, kw in ESTIMATORS:
        report = normflat.analyze(mlp(), (x, y), estimator=estimator, progress=False, **kw)
        assert report.metadata["batches"] == 1 and report.metadata["examples"] == 30
    whole = nf(mlp(), (x, y), estimator="ggn")
    assert_same(nf(mlp(), (x, y), estimator="ggn", chunk_size=4), whole)


@pytest.mark.parametrize("estimator,kw", ESTIMATORS)
def test_estimates_do_not_depend_on_the_batch_split(estimator, kw):
    # ggn-mc draws are keyed on the sample position, hutchinson probes are the same for
    # every batch: every estimator is independent of how the data is cut.
    x, y = data(11)
    whole = nf(mlp(), (x, y), estimator=estimator, seed=3, **kw)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    assert_same(nf(mlp(), loader, estimator=estimator, seed=3, **kw), whole)
    if estimator.startswith("ggn"):
        assert_same(nf(mlp(), loader, estimator=estimator, seed=3, chunk_size=3, **kw), whole)
    other = nf(mlp(), (x, y), estimator=estimator, seed=4, **kw)
    assert (estimator in ("ggn", "exact")) == all(torch.equal(other[k], whole[k]) for k in whole)


def test_one_hot_labels_equal_indices():
    x, y = data()
    for estimator, kw in ESTIMATORS:
        assert_same(nf(mlp(), (x, F.one_hot(y, 3)), estimator=estimator, **kw),
                    nf(mlp(), (x, y), estimator=estimator, **kw), rtol=0, atol=0)


def test_empty_batches_skipped():
    x, y = data()
    batches = [(x[:4], y[:4]), (x[:0], y[:0]), (x[4:], y[4:])]
    report = normflat.analyze(mlp(), batches, progress=False)
    assert report.metadata["batches"] == 2 and report.metadata["examples"] == 9
    assert_same(nf(mlp(), batches), nf(mlp(), (x, y)))
    with pytest.raises(ValueError, match="data is empty"):
        nf(mlp(), [(x[:0], y[:0])])


def test_max_batches_and_endless_data():
    x, y = data()
    drawn = []

    def endless():
        for i in itertools.count():
            drawn.append(i)
            yield x[:3], y[:3]

    report = normflat.analyze(mlp(), endless(), max_batches=3, progress=False)
    assert report.metadata["batches"] == 3 and report.metadata["examples"] == 9
    assert drawn == [0, 1, 2]  # no further batch is drawn
    assert_same(nf(mlp(), endless(), max_batches=3), nf(mlp(), (torch.cat([x[:3]] * 3), torch.cat([y[:3]] * 3))))


def test_batch_with_sample_weights_refused():
    x, y = data()
    with pytest.raises(TypeError, match="sample weights"):
        nf(mlp(), [(x, y, torch.ones(9))])


# ----------------------------------------------------------------------------- report keys, groups


def test_metadata_and_detail_keys():
    for estimator, kw in ESTIMATORS:
        report = normflat.analyze(mlp(), data(), estimator=estimator, progress=False, **kw)
        assert set(METADATA_KEYS) <= set(report.metadata), estimator
        for layer in report.layers:
            assert set(DETAIL_KEYS) <= set(layer.details)
            assert layer.details["path"] == ("hvp" if estimator in ("exact", "hutchinson") else "fast")


def test_grouped_convolutions_carry_their_groups():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, groups=2), nn.ReLU(),
                          nn.Conv2d(6, 6, 1, groups=6), nn.Flatten(), nn.Linear(24, 3),
                          nn.Unflatten(1, (3, 1, 1)), nn.ConvTranspose2d(3, 4, 1, groups=1), nn.Flatten(),
                          nn.Linear(4, 3)).to(DT)
    x, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    report = normflat.analyze(model, (x, y), loss="ce", progress=False)
    groups = [layer.details["groups"] for layer in report.layers]
    assert groups == [1, 2, 6, 1, 1, 1]
    assert report.layers[1].shape == (6, 2, 3, 3) and report.layers[2].shape == (6, 1, 1, 1)
    assert report.layers[1].col_sigma.shape == (4,)  # one variance per real input channel
    problems, _ = normflat.backends.torch.layer_problems(model, (x, y), validate_options(progress=False))
    assert [p.groups for p in problems] == groups


def test_batched_backward_chosen_from_the_graph():
    def decide(*modules):
        # The signals go back from the logits to the first layer's output: what runs between?
        first = modules[0](torch.randn(3, 2, 6, 6))
        out = nn.Sequential(*modules[1:])(first)
        return ggn_kernels.inspect_graph(out.grad_fn, {}, [first])[1]

    assert decide(nn.Sequential(nn.Flatten(), nn.Linear(72, 5)), nn.ReLU(), nn.Linear(5, 3))
    assert decide(nn.Conv2d(2, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32, 3))  # only linear ops above
    # Convolutions, SiLU and softplus (a Mamba mixer's steps) batch too.
    assert decide(nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 3), nn.SiLU(), nn.Softplus(), nn.Flatten(), nn.Linear(8, 3))
    # Pooling and tanh backward are not batched: one backward per signal.
    assert not decide(nn.Conv2d(2, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 3))
    assert not decide(nn.Sequential(nn.Flatten(), nn.Linear(72, 5)), nn.Tanh(), nn.Linear(5, 3))


# ----------------------------------------------------------------------------- the engine's randomness


@pytest.mark.parametrize("estimator,samples", [("ggn-mc", 5), ("hutchinson", 7)])
def test_stochastic_estimators_match_the_framework_free_reference(estimator, samples):
    # The engine's numpy reference session draws from normflat.engine.random exactly as
    # every backend must: torch gives the same numbers on the same weights and data.
    from tests.engine._fakes import LinearSession

    torch.manual_seed(5)
    model = nn.Linear(4, 3, bias=False).to(DT)
    x, y = data(10)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    options = validate_options(loss="ce", estimator=estimator, samples=samples, seed=11, progress=False)
    w = model.weight.detach().numpy().copy()
    want = driver.hessian_diagonal(lambda: LinearSession(w, options), [(b[0].numpy(), b[1].numpy())
                                                                     for b in batches], options)
    got = normflat.backends.torch.hessian_diagonal(model, batches, options)
    np.testing.assert_allclose(got[type(model).__name__].numpy(), want["fc"], rtol=1e-10, atol=1e-14)


# ----------------------------------------------------------------------------- side effects


def _state(model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()],
            [p.requires_grad for p in model.parameters()], [p.grad for p in model.parameters()],
            [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()])


def _assert_state(model, before):
    after = _state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:3] == after[1:3]
    assert all(a is b for a, b in zip(before[3], after[3]))
    assert before[4] == after[4]


def _cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
                          nn.Dropout(0.3), nn.Linear(48, 3)).to(DT)
    model.train()
    model[0].bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("estimator,kw", ESTIMATORS)
def test_keyboard_interrupt_mid_pass_leaves_the_model_untouched(estimator, kw):
    model = _cnn()
    x, y = torch.randn(6, 2, 4, 4, dtype=DT), torch.randint(0, 3, (6,))
    calls = []

    def interrupt(module, args, output):  # raised inside a forward after the first one
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt

    handle = model[5].register_forward_hook(interrupt)
    before = _state(model)
    with pytest.raises(KeyboardInterrupt):
        nf(model, [(x[:3], y[:3]), (x[3:], y[3:])], estimator=estimator, **kw)
    _assert_state(model, before)
    handle.remove()

    def interrupted_data():
        yield x[:3], y[:3]
        raise KeyboardInterrupt

    before = _state(model)
    with pytest.raises(KeyboardInterrupt):
        nf(model, interrupted_data(), estimator=estimator, **kw)
    _assert_state(model, before)
    assert model.training and not model[0].bias.requires_grad


def test_two_analyses_in_two_threads():
    x, y = torch.randn(16, 2, 4, 4, dtype=DT), torch.randint(0, 3, (16,))
    loader = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    jobs = [("ggn-mc", {"samples": 3}), ("hutchinson", {"samples": 6})]
    sequential = [nf(_cnn(), loader, estimator=e, **kw) for e, kw in jobs]
    models = {i: [_cnn() for _ in range(3)] for i in range(2)}  # built first: _cnn() seeds the global RNG

    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    stop = threading.Event()
    draws: list[torch.Tensor] = []

    def analyze(i):
        try:
            for model in models[i]:
                results[i] = nf(model, loader, estimator=jobs[i][0], **jobs[i][1])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def draw():  # a third thread consuming the global RNG meanwhile
        while not stop.is_set() or len(draws) < 10:
            draws.append(torch.rand(64))

    torch.manual_seed(1234)
    threads = [threading.Thread(target=analyze, args=(i,)) for i in range(2)]
    drawer = threading.Thread(target=draw)
    drawer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    drawer.join(10)
    assert not errors, errors
    state_after = torch.get_rng_state()
    # The drawing thread got exactly the stream of its seed: nothing was consumed or rewound.
    torch.manual_seed(1234)
    expected = [torch.rand(64) for _ in draws]
    assert all(torch.equal(a, b) for a, b in zip(draws, expected))
    assert torch.equal(torch.get_rng_state(), state_after)
    for i in range(2):
        assert_same(results[i], sequential[i], rtol=0, atol=0)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        warnings.warn("still visible", UserWarning)
    assert [str(w.message) for w in rec] == ["still visible"]


def test_global_rng_stream_not_consumed():
    models = [mlp(seed=i) for i in range(len(ESTIMATORS))]  # nn.Linear init draws from the global RNG
    d = data()  # a private generator
    state = torch.get_rng_state()
    for model, (estimator, kw) in zip(models, ESTIMATORS):
        nf(model, d, estimator=estimator, **kw)
    assert torch.equal(torch.get_rng_state(), state)


def test_same_model_in_two_threads_refused():
    model = mlp()
    x, y = data()
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow_data():
        yield x[:4], y[:4]
        inside.set()
        release.wait(30)
        yield x[4:], y[4:]

    def first():
        try:
            nf(model, slow_data())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="already analyzing this model"):
            nf(model, (x, y))
    finally:
        release.set()
        t.join(30)
    assert not errors
    nf(model, (x, y))  # free again afterwards


def test_refused_second_analysis_reads_nothing(monkeypatch):
    """The second analysis of a module under analysis is refused before its layer walk, which reads
    parametrized weights with their parametrizations in eval mode for a moment: it must not touch a
    module another thread is analyzing (the first analysis restores the modes it saw)."""
    from normflat.backends.torch import layers as torch_layers

    walks = []
    real = torch_layers._parametrizations_in_eval
    monkeypatch.setattr(torch_layers, "_parametrizations_in_eval", lambda m: walks.append(m) or real(m))
    model = mlp()
    x, y = data()
    inside, release = threading.Event(), threading.Event()

    def slow_data():
        yield x[:4], y[:4]
        inside.set()
        release.wait(30)
        yield x[4:], y[4:]

    t = threading.Thread(target=lambda: nf(model, slow_data()))
    t.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="already analyzing this model"):
            nf(model, (x, y))
        assert len(walks) == 1  # the first analysis's walk only
    finally:
        release.set()
        t.join(30)


def test_no_warning_filters_installed():
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for estimator, kw in ESTIMATORS:
            nf(mlp(), data(), estimator=estimator, **kw)
        nf(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT), data(), estimator="exact")
    assert not [str(w.message) for w in rec]  # no torch.jit.script or vmap fallback warning either
    assert list(warnings.filters) == filters


class KerasDense(nn.Module):
    """A dense layer storing its kernel as (in, out): the probes are laid through ``.T``."""

    def __init__(self, w):
        super().__init__()
        self.kernel = nn.Parameter(w.T.clone())

    def forward(self, x):
        return x @ self.kernel


def test_hutchinson_probes_drawn_in_the_canonical_layout():
    from normflat.backends import torch as tb

    model = mlp(bias=False)
    clone = nn.Sequential(KerasDense(model[0].weight.detach()), nn.ReLU(), KerasDense(model[2].weight.detach()))
    saved = tb.registered_layers()
    try:
        tb.register_layer(KerasDense, kind="dense", weight=lambda m: m.kernel, to_canonical=lambda m, t: t.T)
        got = nf(clone, data(), estimator="hutchinson", samples=5, seed=2)
    finally:
        tb.layers.REGISTRY.unregister(KerasDense)
    assert tb.registered_layers().keys() == saved.keys()
    want = nf(model, data(), estimator="hutchinson", samples=5, seed=2)
    for (_, g), (_, w) in zip(got.items(), want.items()):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)
