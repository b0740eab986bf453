"""Plain-PyTorch and Lightning trackers in real training runs: the run is unchanged."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import normflat  # noqa: E402
from normflat.integrations.history import TrackingHistory  # noqa: E402


def _data(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def _net() -> nn.Module:
    # Dropout makes the training run consume the global RNG, so a stolen draw would show.
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))


def _next_draws() -> tuple[float, float, float]:
    return float(torch.rand(())), float(np.random.random()), random.random()


def _loop(tracker=None, epochs: int = 2):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    x, y = _data()
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # A shuffling loader: each iteration draws from torch's global generator.
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    step = 0
    for epoch in range(epochs):
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if tracker is not None:
                tracker.step(model, step, epoch=epoch)
        if tracker is not None:
            tracker.epoch_end(model, epoch)
    return model, opt, _next_draws()


def _assert_same_run(a, b) -> None:
    (m1, o1, d1), (m2, o2, d2) = a, b
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)
    assert d1 == d2


def test_plain_torch_tracker_leaves_the_run_bit_identical_and_logs():
    from normflat.integrations.torch import SharpnessTracker

    x, y = _data(64, seed=1)
    # The analysis data is a shuffling loader too: its iteration must not steal draws.
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    logged = []
    tracker = SharpnessTracker(val, every_n_steps=4, max_batches=2, per_layer=True,
                               logger=lambda m, s: logged.append((s, m)))
    baseline = _loop(None)
    tracked = _loop(tracker)
    _assert_same_run(baseline, tracked)
    # 6 steps per epoch, 12 in all: analyses after steps 4, 8, 12.
    assert tracker.history.steps == [4, 8, 12]
    assert tracker.history.epochs == [0, 1, 1]
    assert [s for s, _ in logged] == [4, 8, 12]
    keys = set(logged[0][1])
    assert {"normalized_sharpness", "hessian_trace", "normalized_sharpness/0", "normalized_sharpness/3"} <= keys
    ns = tracker.history.values("normalized_sharpness")
    assert all(v > 0 and math.isfinite(v) for v in ns) and len(set(ns)) == 3
    # The fixed subset: the last analysis equals a direct one on the same two batches.
    model = tracked[0]
    subset = tracker.tracker._subset
    assert len(subset) == 2
    direct = normflat.analyze(model, subset, progress=False)
    assert tracker.history[-1].normalized_sharpness == pytest.approx(direct.normalized_sharpness, rel=1e-6)


def test_plain_torch_tracker_by_epoch_and_options():
    from normflat.integrations.torch import SharpnessTracker

    x, y = _data(32, seed=2)
    tracker = SharpnessTracker((x, y), every_n_epochs=2, log="hessian_trace", estimator="exact", loss="ce",
                               keep_reports=False)
    _loop(tracker, epochs=4)
    assert tracker.history.epochs == [1, 3]
    assert tracker.history.reports == [None, None]
    assert tracker.history[0].report is None
    with pytest.raises(ValueError, match="not both"):
        SharpnessTracker((x, y), every_n_epochs=1, every_n_steps=1)
    with pytest.raises(ValueError, match="every_n_steps"):
        SharpnessTracker((x, y), every_n_steps=0)
    with pytest.raises(ValueError, match="unknown"):
        SharpnessTracker((x, y), log=("accuracy",))
    with pytest.raises(TypeError, match="logger"):
        SharpnessTracker((x, y), logger="stdout")


def _lightning_run(tmp_path, callback=None, steps: bool = False):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.cross_entropy(self(xb), yb)
            self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(yb))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    pl.seed_everything(0, verbose=False)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    module = Module()
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path)),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[] if callback is None else [callback])
    trainer.fit(module, loader)
    return module, trainer, _next_draws()


def test_lightning_callback_leaves_the_run_bit_identical_and_logs(tmp_path):
    require_frameworks("lightning")
    from normflat.integrations.lightning import SharpnessCallback

    x, y = _data(48, seed=3)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)
    cb = SharpnessCallback(val, every_n_epochs=1, max_batches=2, log=("normalized_sharpness", "hessian_trace"),
                           per_layer=True, prefix="val_")
    m1, t1, d1 = _lightning_run(tmp_path / "a")
    m2, t2, d2 = _lightning_run(tmp_path / "b", cb)
    _assert_same_run((m1, t1.optimizers[0], d1), (m2, t2.optimizers[0], d2))
    assert len(cb.history) == 2 and cb.history.epochs == [0, 1] and cb.history.steps == [6, 12]
    assert "val_normalized_sharpness" in t2.callback_metrics
    assert float(t2.callback_metrics["val_normalized_sharpness"]) == pytest.approx(
        cb.history[-1].normalized_sharpness, rel=1e-6)
    metrics_csv = next((tmp_path / "b").rglob("metrics.csv"))
    rows = list(csv.DictReader(Path(metrics_csv).read_text().splitlines()))
    logged = [r for r in rows if r.get("val_normalized_sharpness")]
    assert len(logged) == 2
    assert {"val_hessian_trace", "val_normalized_sharpness/net.0", "val_normalized_sharpness/net.3"} <= set(rows[0])
    assert "val_matrix_normalized_sharpness" not in rows[0]


def test_lightning_callback_by_steps_on_a_submodule(tmp_path):
    require_frameworks("lightning")
    from normflat.integrations.lightning import SharpnessCallback

    x, y = _data(32, seed=4)
    cb = SharpnessCallback((x, y), every_n_steps=5, module="net", estimator="ggn")
    m1, t1, d1 = _lightning_run(tmp_path / "a")
    m2, t2, d2 = _lightning_run(tmp_path / "b", cb)
    _assert_same_run((m1, t1.optimizers[0], d1), (m2, t2.optimizers[0], d2))
    assert cb.history.steps == [5, 10]
    assert [layer.name for layer in cb.history[0].report.layers] == ["0", "3"]
    rows = list(csv.DictReader(next((tmp_path / "b").rglob("metrics.csv")).read_text().splitlines()))
    assert sum(1 for r in rows if r.get("normalized_sharpness")) == 2


def test_history_plots_and_exports(tmp_path):
    from normflat.integrations.torch import SharpnessTracker

    x, y = _data(32, seed=5)
    tracker = SharpnessTracker((x, y), every_n_steps=3)
    _loop(tracker)
    history = tracker.history
    assert isinstance(history, TrackingHistory) and len(history) == 4
    records = history.to_records()
    assert records[0]["step"] == 3 and "normalized_sharpness/0" in records[0] and "hessian_trace/3" in records[0]
    fig = history.plot(tmp_path / "curves.png", title="test")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert len(fig.axes) == 3  # totals, its twin axis for the trace, per layer
    per_layer = next(ax for ax in fig.axes if ax.get_title() == "per layer")
    assert [ln.get_label() for ln in per_layer.lines] == ["0", "3"]
    history.to_csv(tmp_path / "h.csv")
    assert len(list(csv.DictReader(Path(tmp_path / "h.csv").read_text().splitlines()))) == 4
    with pytest.raises(ValueError, match="empty"):
        TrackingHistory().plot()


def test_pytorch_lightning_package_gets_its_own_callback_class(tmp_path):
    require_frameworks("pytorch_lightning")
    import pytorch_lightning

    from normflat.integrations.lightning import PLSharpnessCallback, SharpnessCallback

    assert issubclass(PLSharpnessCallback, pytorch_lightning.Callback)
    assert not issubclass(SharpnessCallback, pytorch_lightning.Callback)

    class Module(pytorch_lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x, y = _data(32)
    cb = PLSharpnessCallback((x, y), every_n_epochs=1)
    trainer = pytorch_lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    trainer.fit(Module(), loader)
    assert len(cb.history) == 1 and "normalized_sharpness" in trainer.callback_metrics
