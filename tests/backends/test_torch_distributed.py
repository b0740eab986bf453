"""PyTorch backend under torch.distributed: 2 gloo processes on CPU, spawned by the test.

One spawn runs every scenario on both ranks (process start-up and ``import torch``
dominate the run time) and pickles what each rank returned; the tests compare those
results with single-process runs on the full data, made here in the parent. Failure
scenarios record the exception each rank raised. The spawn is bounded by a join
timeout and the process group by its own timeout, so no test can hang.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import sys
import traceback

import numpy as np
import pytest

from tests.builders import require_frameworks

require_frameworks("torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, hessian  # noqa: E402

import normflat  # noqa: E402

DT = torch.float64
WORLD = 2
#: Batch sizes of the full data; shards take whole batches.
SIZES = (4, 3, 5, 2, 4)
#: rank -> batch indices. "uneven": 3 and 2 batches; "zero": rank 1 has none.
SHARDS = {"uneven": {0: [0, 2, 4], 1: [1, 3]}, "zero": {0: [0, 1, 2, 3, 4], 1: []}}
JOIN_TIMEOUT_S = 150
PG_TIMEOUT_S = 30
FAST = dict(progress=False)


# ----------------------------------------------------------------------------- problems


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    elif name == "cnn":
        model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 3))
    elif name == "mlp_other":  # a different structure, for the agreement check
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    else:
        raise KeyError(name)
    return model.to(DT)


def make_batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (6,) if name.startswith("mlp") else (2, 4, 4)
    return [(torch.randn(n, *shape, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g))
            for n in SIZES]


def make_token_model() -> nn.Module:
    """Token logits (n, 4 tokens, 30 classes)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(30, 4), nn.Tanh(), nn.Linear(4, 30)).to(DT)


def make_token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 30, (n, 4), generator=g), torch.randint(0, 30, (n, 4), generator=g)) for n in SIZES]


def shard(name: str, split: str, rank: int) -> list:
    batches = make_batches(name)
    return [batches[i] for i in SHARDS[split][rank]]


def summary(report) -> dict:
    return {
        "totals": report.totals,
        "layers": {l.name: (l.normalized_sharpness, l.hessian_trace, l.standard_error, l.details)
                   for l in report.layers},
        "standard_error": report.standard_error,
        "metadata": dict(report.metadata),
    }


def diag_np(d: dict) -> dict:
    return {k: v.detach().numpy().copy() for k, v in d.items()}


# ----------------------------------------------------------------------------- worker


def _capture(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded for the parent to assert on
        return (type(e).__name__, str(e))
    return None


def _bad_labels(batches):
    yield batches[0]
    x, y = batches[1]
    yield x, y + 10  # labels out of range on this rank only


def _raising(batches):
    yield batches[0]
    raise RuntimeError("data loader exploded")


def _dying(batches):
    yield batches[0]
    os._exit(3)  # a rank that dies without a word


def _scenarios(rank: int, results: dict) -> None:
    for model_name in ("mlp", "cnn"):
        for est in ("ggn", "exact"):
            model = make_model(model_name)
            data = shard(model_name, "uneven", rank)
            rep = normflat.analyze(model, data, estimator=est, **FAST)
            results[f"{model_name}/{est}"] = summary(rep)
            results[f"{model_name}/{est}/diag"] = diag_np(
                normflat.hessian_diagonal(model, data, estimator=est, **FAST))
    model = make_model("mlp")
    results["zero/ggn"] = summary(normflat.analyze(model, shard("mlp", "zero", rank), **FAST))
    results["zero/ggn/diag"] = diag_np(normflat.hessian_diagonal(model, shard("mlp", "zero", rank), **FAST))
    results["zero/exact/diag"] = diag_np(
        normflat.hessian_diagonal(model, shard("mlp", "zero", rank), estimator="exact", **FAST))
    tokens = [make_token_batches()[i] for i in SHARDS["zero"][rank]]
    results["zero/tokens"] = summary(normflat.analyze(make_token_model(), tokens, **FAST))
    ddp = nn.parallel.DistributedDataParallel(make_model("mlp"))
    results["ddp/ggn"] = summary(normflat.analyze(ddp, shard("mlp", "uneven", rank), **FAST))
    results["local/ggn"] = summary(normflat.analyze(model, shard("mlp", "uneven", rank), distributed=False,
                                                    **FAST))
    for est, samples in (("hutchinson", 20), ("ggn-mc", 4)):
        runs = [summary(normflat.analyze(model, shard("mlp", "uneven", rank), estimator=est, samples=samples,
                                         seed=7, **FAST)) for _ in range(2)]
        results[f"{est}/runs"] = runs
        # Both ranks see the full data: equal per-rank seeds would reproduce the one-process result.
        results[f"{est}/dup"] = summary(normflat.analyze(model, make_batches("mlp"), estimator=est,
                                                         samples=samples, seed=7, **FAST))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:  # FSDP2 on CPU; where this torch cannot build it, the parent tests the check alone
        from torch.distributed.fsdp import fully_shard

        sharded = fully_shard(make_model("mlp"))
    except Exception as e:  # noqa: BLE001
        results["fsdp"] = ("unavailable", str(e))
    else:
        results["fsdp"] = _capture(lambda: normflat.analyze(sharded, shard("mlp", "uneven", rank), **FAST))

    # Failures on rank 1 only: every rank must raise, and the group stays usable afterwards.
    full = make_batches("mlp")
    results["fail/labels"] = _capture(lambda: normflat.analyze(
        model, _bad_labels(full) if rank == 1 else full, **FAST))
    results["fail/raise"] = _capture(lambda: normflat.hessian_diagonal(
        model, _raising(full) if rank == 1 else full, estimator="exact", **FAST))
    results["fail/structure"] = _capture(lambda: normflat.analyze(
        make_model("mlp_other") if rank == 1 else model, full, **FAST))
    results["fail/setup"] = _capture(lambda: normflat.analyze(
        model, torch.utils.data.TensorDataset(*full[0]) if rank == 1 else full, **FAST))
    results["fail/options"] = _capture(lambda: normflat.analyze(model, full, seed=rank, estimator="ggn-mc",
                                                                **FAST))
    results["after_failures"] = summary(normflat.analyze(model, shard("mlp", "uneven", rank), **FAST))
    results["model_unchanged"] = all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def _worker(rank: int, port: int, outdir: str) -> None:
    out = os.path.join(outdir, f"rank{rank}.pkl")
    results: dict = {}
    try:
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        _scenarios(rank, results)
        if rank == 1:
            with open(out, "wb") as f:  # before dying below
                pickle.dump(results, f)
            normflat.analyze(make_model("mlp"), _dying(make_batches("mlp")), **FAST)
        else:
            results["dead_peer"] = _capture(lambda: normflat.analyze(make_model("mlp"), make_batches("mlp"),
                                                                     **FAST))
    except Exception:  # noqa: BLE001
        results["worker_error"] = traceback.format_exc()
    with open(out, "wb") as f:
        pickle.dump(results, f)
    os._exit(0)  # skip destroying a group whose peer is gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    outdir = str(tmp_path_factory.mktemp("torch_dist"))
    ctx = mp.get_context("spawn")
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, outdir)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if env["OMP_NUM_THREADS"] is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
    assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S}s (a hang)"
    out = []
    for r in range(WORLD):
        path = os.path.join(outdir, f"rank{r}.pkl")
        assert os.path.exists(path), f"rank {r} wrote no results (exit code {procs[r].exitcode})"
        with open(path, "rb") as f:
            res = pickle.load(f)
        assert "worker_error" not in res, f"rank {r} failed:\n{res['worker_error']}"
        out.append(res)
    return out


# ----------------------------------------------------------------------------- helpers


def reference(model_name: str, batches, **kwargs):
    model = make_model(model_name)
    return (summary(normflat.analyze(model, batches, **FAST, **kwargs)),
            diag_np(normflat.hessian_diagonal(model, batches, **FAST, **kwargs)))


def assert_close_summary(got: dict, want: dict, rtol: float = 1e-10) -> None:
    for m, v in want["totals"].items():
        np.testing.assert_allclose(got["totals"][m], v, rtol=rtol, atol=0, err_msg=m)
    assert list(got["layers"]) == list(want["layers"])
    for name, (ns, tr, _, _) in want["layers"].items():
        np.testing.assert_allclose(got["layers"][name][:2], (ns, tr), rtol=rtol, atol=0, err_msg=name)


def assert_close_diag(got: dict, want: dict, rtol: float = 1e-10) -> None:
    assert list(got) == list(want)
    for name in want:
        scale = np.abs(want[name]).max()
        assert scale > 0
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=rtol * scale, err_msg=name)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("est", ["ggn", "exact"])
def test_uneven_shards_equal_single_process(ranks, model_name, est):
    want, want_diag = reference(model_name, make_batches(model_name), estimator=est)
    for r, res in enumerate(ranks):
        assert_close_summary(res[f"{model_name}/{est}"], want)
        assert_close_diag(res[f"{model_name}/{est}/diag"], want_diag)
        meta = res[f"{model_name}/{est}"]["metadata"]
        assert meta["examples"] == sum(SIZES) and meta["batches"] == len(SIZES)
        assert meta["world_size"] == WORLD
        assert meta["backend"]["examples_per_rank"] == [sum(SIZES[i] for i in SHARDS["uneven"][q])
                                                       for q in range(WORLD)]
    # Every rank returns the identical report.
    assert ranks[0][f"{model_name}/{est}"] == ranks[1][f"{model_name}/{est}"]


def test_exact_matches_brute_force_hessian(ranks):
    """The distributed exact diagonal against torch.func.hessian of the mean loss on all data."""
    model = make_model("mlp")
    x = torch.cat([b[0] for b in make_batches("mlp")])
    y = torch.cat([b[1] for b in make_batches("mlp")])
    params = dict(model.named_parameters())
    for name in ("0.weight", "2.weight"):
        def loss(w, name=name):
            z = functional_call(model, {**params, name: w}, (x,))
            z = z - z.mean(1, keepdim=True)
            z = z / torch.sqrt(z.square().mean(1, keepdim=True) + 1e-12)
            return torch.nn.functional.cross_entropy(z, y)
        w = params[name].detach()
        h = hessian(loss)(w).detach().reshape(w.numel(), w.numel()).diagonal().reshape(w.shape)
        for res in ranks:
            np.testing.assert_allclose(res["mlp/exact/diag"][name[:-len(".weight")]], h.numpy(), rtol=1e-10,
                                       atol=1e-13)


def test_rank_with_zero_batches(ranks):
    want, want_diag = reference("mlp", make_batches("mlp"))
    _, want_exact = reference("mlp", make_batches("mlp"), estimator="exact")
    for res in ranks:
        assert_close_summary(res["zero/ggn"], want)
        assert_close_diag(res["zero/ggn/diag"], want_diag)
        assert_close_diag(res["zero/exact/diag"], want_exact)
        assert res["zero/ggn"]["metadata"]["backend"]["examples_per_rank"] == [sum(SIZES), 0]
    # The idle rank never ran the layer checks; the paths are merged from the rank that did.
    assert ranks[0]["zero/ggn"] == ranks[1]["zero/ggn"]


def test_token_logits_on_a_rank_with_zero_batches(ranks):
    """auto on token logits: per-sequence ggn-topk (method §6.3), whose dense head keeps only its
    exact shared sum; the idle rank adopts the estimator, has all 1 + K sums of every layer, and
    reports the token logits it never saw; rank 0's draws are the one-process run's."""
    want = summary(normflat.analyze(make_token_model(), make_token_batches(), **FAST))
    assert want["metadata"]["sequence_signals"] is True and want["metadata"]["estimator"] == "ggn-topk"
    for res in ranks:
        assert_close_summary(res["zero/tokens"], want)
        meta = res["zero/tokens"]["metadata"]
        assert meta["sequence_signals"] is True
        assert meta["loss_terms"] == 4 * sum(SIZES)
    assert ranks[0]["zero/tokens"] == ranks[1]["zero/tokens"]


def test_ddp_model_is_unwrapped(ranks):
    want, _ = reference("mlp", make_batches("mlp"))
    for res in ranks:
        assert list(res["ddp/ggn"]["layers"]) == ["0", "2"]  # no "module." prefix
        assert_close_summary(res["ddp/ggn"], want)


def test_distributed_false_analyzes_own_shard(ranks):
    for r, res in enumerate(ranks):
        want, _ = reference("mlp", shard("mlp", "uneven", r))
        assert_close_summary(res["local/ggn"], want)
        assert res["local/ggn"]["metadata"]["world_size"] == 1


@pytest.mark.parametrize("est,samples", [("hutchinson", 20), ("ggn-mc", 4)])
def test_stochastic_reproducible_and_independent_of_the_split(ranks, est, samples):
    first, second = ranks[0][f"{est}/runs"]
    assert first == second  # same seed and world size: the same result
    assert ranks[1][f"{est}/runs"][0] == first  # identical on every rank
    assert first["standard_error"] is not None
    assert all(v[2] is not None and all(np.isfinite(list(v[2].values()))) for v in first["layers"].values())
    one, _ = reference("mlp", make_batches("mlp"), estimator=est, samples=samples, seed=7)
    dup = ranks[0][f"{est}/dup"]  # both ranks saw all the data
    assert dup["metadata"]["examples"] == 2 * sum(SIZES)
    if est == "hutchinson":
        # The same probes for every batch and every rank (normflat.engine.random): the sharded
        # run equals the one-process run on all the data, and duplicating the data changes nothing.
        assert_close_summary(first, one)
        assert_close_summary(dup, one)
    else:
        # ggn-mc draws are keyed on (seed, rank, sample position): the ranks' draws are
        # independent, so duplicated data gives another estimate, whose mean over the two
        # ranks includes rank 0's, the one-process estimate.
        assert not np.isclose(dup["totals"]["normalized_sharpness"], one["totals"]["normalized_sharpness"],
                              rtol=1e-6)
        ggn, _ = reference("mlp", make_batches("mlp"))
        np.testing.assert_allclose(dup["totals"]["hessian_trace"], ggn["totals"]["hessian_trace"], rtol=0.5)


def test_failing_rank_raises_everywhere(ranks):
    r0, r1 = ranks
    # Rank 1 raises its own error; rank 0 the engine's DistributedFailure (a RuntimeError)
    # naming rank 1 and the cause.
    assert r1["fail/labels"][0] == "ValueError" and "labels must be class indices" in r1["fail/labels"][1]
    assert r0["fail/labels"][0] == "DistributedFailure"  # a RuntimeError
    assert "rank 1" in r0["fail/labels"][1] and "labels must be class indices" in r0["fail/labels"][1]
    assert r1["fail/raise"] == ("RuntimeError", "data loader exploded")
    assert r0["fail/raise"][0] == "DistributedFailure" and "data loader exploded" in r0["fail/raise"][1]
    assert r1["fail/setup"][0] == "TypeError" and "DataLoader" in r1["fail/setup"][1]
    assert r0["fail/setup"][0] == "DistributedFailure" and "rank 1" in r0["fail/setup"][1]
    for res in ranks:
        assert res["fail/structure"][0] == "ValueError" and "same model" in res["fail/structure"][1]
        assert "(5, 6)" in res["fail/structure"][1] and "(4, 6)" in res["fail/structure"][1]
        assert res["fail/options"][0] == "ValueError"
        assert res["model_unchanged"]
    # The group is still usable and the results still right after the failures.
    want, _ = reference("mlp", make_batches("mlp"))
    for res in ranks:
        assert_close_summary(res["after_failures"], want)


def test_dead_rank_raises_instead_of_hanging(ranks):
    # Rank 1 exited in the middle of the data; rank 0 got an error from the process group
    # (peer connection closed, or at worst the group timeout) rather than waiting forever.
    assert ranks[0]["dead_peer"] is not None


def test_fsdp_model_is_refused_with_the_alternative(ranks):
    for res in ranks:
        if res["fsdp"][0] == "unavailable":
            pytest.skip(f"fully_shard unavailable on CPU here: {res['fsdp'][1]}")
        assert res["fsdp"][0] == "TypeError" and "FSDP" in res["fsdp"][1]
        assert "full_state_dict" in res["fsdp"][1] and "DistributedDataParallel" in res["fsdp"][1]


def test_fsdp_wrapper_detected_by_class():
    class FullyShardedDataParallel(nn.Module):  # stands in for torch's FSDP wrapper
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    with pytest.raises(TypeError, match="FSDP-sharded"):
        normflat.analyze(FullyShardedDataParallel(make_model("mlp")), make_batches("mlp"), **FAST)


def test_data_parallel_unwrapped_without_process_group():
    model = make_model("mlp")
    got = normflat.hessian_diagonal(nn.DataParallel(model), make_batches("mlp"), **FAST)
    want = normflat.hessian_diagonal(model, make_batches("mlp"), **FAST)
    assert list(got) == ["0", "2"]
    assert_close_diag(diag_np(got), diag_np(want), rtol=0)


def test_distributed_option_checked():
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="not initialized"):
        normflat.analyze(make_model("mlp"), make_batches("mlp"), distributed=True, **FAST)
    with pytest.raises(TypeError, match="ProcessGroup"):
        normflat.analyze(make_model("mlp"), make_batches("mlp"), distributed="yes", **FAST)
