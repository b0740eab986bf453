"""The framework-free tracker core: schedule, fixed subset, random streams, history."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import normflat
from normflat.integrations import HistoryEntry, Tracker, TrackingHistory


def _problems_report(scale: float):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2))
    return normflat.analyze([normflat.LayerProblem("a", w, scale * np.ones((3, 2))),
                             normflat.LayerProblem("b", w.T, np.ones((2, 3)))])


def test_step_schedule_fires_once_per_multiple():
    t = Tracker(([0.0], [0]), every_n_steps=4)
    fired = []
    for step in (1, 2, 3, 4, 4, 5, 8, 9):  # step 4 reported twice (gradient accumulation)
        if t.due_step(step):
            fired.append(step)
            t.record(_problems_report(1.0), step=step, epoch=0)
    assert fired == [4, 8]
    # hooks that report every 3rd step only (Keras steps_per_execution=3) still fire per multiple
    t = Tracker(([0.0], [0]), every_n_steps=4)
    fired = []
    for step in (3, 6, 9, 12, 15):
        if t.due_step(step):
            fired.append(step)
            t.record(_problems_report(1.0), step=step, epoch=0)
    assert fired == [6, 9, 12]
    t = Tracker(([0.0], [0]), every_n_epochs=3)
    assert [e for e in range(9) if t.due_epoch(e)] == [2, 5, 8] and not t.due_step(3)
    assert Tracker(([0.0], [0])).every_n_epochs == 1


def test_options_are_checked():
    with pytest.raises(ValueError, match="data first"):
        Tracker(None)
    with pytest.raises(ValueError, match="max_batches"):
        Tracker([], max_batches=0)
    with pytest.raises(TypeError, match="prefix"):
        Tracker([], prefix=3)
    with pytest.raises(TypeError, match="no model= option"):
        Tracker([], model=object())
    t = Tracker([], log="hessian_trace", per_layer=True, prefix="p_")
    metrics = t.record(_problems_report(2.0), step=1, epoch=None)
    assert set(metrics) == {"p_hessian_trace", "p_normalized_sharpness/a", "p_normalized_sharpness/b"}
    assert set(t.nan_metrics()) == set(metrics) and all(math.isnan(v) for v in t.nan_metrics().values())


def test_fixed_subset_is_drawn_once():
    draws = []

    def batches():
        while True:
            draws.append(1)
            yield np.zeros((2, 3)), np.zeros(2, dtype=int)

    t = Tracker(batches(), max_batches=2)
    first = t.analysis_data()
    assert len(first) == 2 and t.analysis_data() is first and len(draws) == 2


@pytest.mark.parametrize("sampler", ["shuffle", "sequential", "subset"])
def test_shuffling_loader_is_read_without_the_global_torch_rng(sampler):
    # normflat never saves or restores a global random stream; a DataLoader would draw
    # its base seed and permutation from torch's, so it is read in index order instead.
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

    from normflat.integrations.tracking import iterate_quietly

    ds = TensorDataset(torch.arange(10.0)[:, None], torch.arange(10) % 3)
    if sampler == "subset":
        loader = DataLoader(ds, batch_size=3, sampler=SubsetRandomSampler([7, 1, 4, 8]))
        expected = [1, 4, 7, 8]
    else:
        loader = DataLoader(ds, batch_size=3, shuffle=sampler == "shuffle")
        expected = list(range(10))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    seen = [int(v) for x, _ in iterate_quietly(loader) for v in x[:, 0]]
    assert torch.equal(torch.get_rng_state(), before)
    assert seen == expected
    assert [len(x) for x, _ in iterate_quietly(loader)] == [3] * (len(expected) // 3) + (
        [len(expected) % 3] if len(expected) % 3 else [])


def test_history_columns_records_and_json(tmp_path):
    h = TrackingHistory()
    for step, scale in ((10, 1.0), (20, 4.0)):
        h.append(HistoryEntry.from_report(_problems_report(scale), step=step, epoch=step // 10 - 1))
    assert h.steps == [10, 20] and h.epochs == [0, 1] and len(h[1:]) == 1
    assert h.values("hessian_trace") == [h[0].hessian_trace, h[1].hessian_trace]
    assert h.values("normalized_sharpness", layer="a")[1] > h.values("normalized_sharpness", layer="a")[0]
    assert math.isnan(h.values("hessian_trace", layer="zzz")[0])
    with pytest.raises(ValueError, match="per-layer"):
        h.values("elementwise_bound", layer="a")
    with pytest.raises(ValueError, match="Unknown measure"):
        h.values("accuracy")
    rec = h.to_records()[0]
    assert rec["step"] == 10 and rec["normalized_sharpness/b"] == h[0].layers["b"]
    data = json.loads(h.to_json(tmp_path / "h.json"))
    assert len(data["entries"]) == 2 and (tmp_path / "h.json").exists()
    with pytest.raises(TypeError):
        h.append({"step": 1})
    fig = h.plot(x="epoch", layers=False)
    assert fig.axes[0].get_xlabel() == "epoch"
    with pytest.raises(ValueError, match="x must be"):
        h.plot(x="time")
