"""Keras backend at scale: tf.distribute MirroredStrategy and the memory budget.

The MirroredStrategy checks run in a subprocess (``_keras_distributed_worker.py``)
because the 2 logical CPU devices must be configured before TensorFlow
initializes its devices; the subprocess has a timeout so a hang fails the test.
Reference: the same model and data analyzed on one device, in float64.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("tensorflow", "keras")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import normflat  # noqa: E402

WORKER = Path(__file__).with_name("_keras_distributed_worker.py")
MULTI_WORKER = Path(__file__).with_name("_keras_multiworker_worker.py")
ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10
EXACT_CASES = [
    "mlp_b5/ggn", "mlp_b5/exact", "mlp_one_batch/ggn", "mlp_one_batch/exact",
    "mlp_generic_chunked/ggn", "cnn_b3/ggn", "scope_only_dataset/ggn",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Start the MirroredStrategy worker and the two MultiWorkerMirroredStrategy workers together.

    All three run concurrently (the test's wall time is the slowest one); each
    is killed after a timeout, so a hang fails the test instead of blocking CI.
    """
    tmp = tmp_path_factory.mktemp("keras_dist")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TF_CONFIG", None)
    ports = f"{_free_port()},{_free_port()}"
    commands = {
        "mirrored": [str(WORKER), str(tmp / "mirrored.json")],
        "worker0": [str(MULTI_WORKER), "0", ports, str(tmp / "worker0.json")],
        "worker1": [str(MULTI_WORKER), "1", ports, str(tmp / "worker1.json")],
    }
    procs = {name: subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, cwd=ROOT)
             for name, args in commands.items()}
    outcomes = {}
    try:
        for name, proc in procs.items():
            try:
                _, err = proc.communicate(timeout=480)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                outcomes[name] = f"{name} hung (killed after 480 s)"
                continue
            path = tmp / f"{name}.json"
            outcomes[name] = (json.loads(path.read_text()) if proc.returncode == 0 and path.exists()
                              else f"{name} failed (exit {proc.returncode}):\n{err[-4000:]}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return outcomes


@pytest.fixture(scope="module")
def mirrored(workers):
    """Results of the MirroredStrategy worker (2 logical CPU replicas)."""
    if isinstance(workers["mirrored"], str):
        pytest.fail(workers["mirrored"])
    return workers["mirrored"]


def test_strategy_has_two_replicas(mirrored):
    assert mirrored["replicas"] == 2


@pytest.mark.parametrize("case", EXACT_CASES)
def test_distributed_report_equals_single_device(mirrored, case):
    result = mirrored["cases"][case]
    assert result["replicas"] == 2  # really distributed
    assert result["ref_replicas"] is None  # the reference really on one device
    assert result["report"] <= TOL
    # The first forward's checks ran inside the scope too: the single device's paths (the GGN's
    # fast rules unless fast=False; Hessian-vector products for exact), not the generic path everywhere.
    assert result["paths"] == result["ref_paths"]
    expected = {"mlp_generic_chunked/ggn": "generic"}.get(case, "hvp" if case.endswith("/exact") else "fast")
    assert set(result["paths"]) == {expected}
    # Uneven shards: every sample and batch counted once, whichever replica had it.
    assert result["examples"][0] == result["examples"][1]
    assert result["batches"][0] == result["batches"][1]


def test_distributed_hessian_diagonal_and_opt_out(mirrored):
    result = mirrored["cases"]["mlp_b5/ggn"]
    assert result["diag"] <= TOL
    # distributed=False on the mirrored model: the single-device path (no replicas), same report.
    assert result["opt_out_replicas"] == 1
    assert result["opt_out_report"] <= TOL


def test_first_forward_checks_inside_the_scope(mirrored):
    """Inside ``strategy.scope()`` a mirrored variable cannot be watched by a tape; the checks watch
    its per-device copies: the same paths and reasons as on one device (a position table also read
    through a second reference: refused; the other layers fast), the same report. (The dense rules'
    in-scope paths: :func:`test_distributed_report_equals_single_device`.)"""
    result = mirrored["cases"]["checks_in_scope/table_alias"]
    assert result["replicas"] == 2
    assert result["details"] == result["ref_details"]
    assert [path for path, _ in result["details"]].count("generic") == 1
    assert any(reason and "also used outside its layer attribute" in reason for _, reason in result["details"])
    assert result["report"] <= TOL


@pytest.mark.parametrize("est", ["ggn-mc", "hutchinson", "ggn-topk"])
def test_distributed_stochastic_estimators(mirrored, est):
    result = mirrored["cases"][f"stochastic/{est}"]
    assert result["replicas"] == 2
    assert result["has_se"]  # group estimates reduced across replicas -> standard errors
    assert result["reproducible"]
    assert result["single_device"] <= TOL  # draws keyed on sample positions, fixed probes


@pytest.mark.parametrize("est", ["ggn", "exact"])
def test_failure_in_one_replica_raises(mirrored, est):
    message = mirrored[f"failure/{est}"]
    assert message.startswith("InvalidArgumentError")
    assert "replica_1" in message  # it was replica 1's batch that failed


@pytest.mark.parametrize("index", [0, 1])
def test_multi_worker_mirrored_strategy(workers, index):
    """Two local workers (TF_CONFIG, one CPU replica each), each with its own shard: both get the
    single-device result on all the data."""
    result = workers[f"worker{index}"]
    if isinstance(result, str):
        pytest.fail(result)
    assert result["replicas"] == 2
    for est in ("ggn", "exact"):
        assert result[est] <= TOL
        assert result[f"{est}_metadata"] == {"examples": 23, "batches": 5, "replicas": 2, "workers": 2}
    # Worker 1's first batch fails in its model's first forward: worker 1 raises the engine's error for
    # inputs the model fails on (the model's error quoted), worker 0 is told (through the engine's
    # per-batch status step) and raises too, instead of waiting forever.
    expected = ("ValueError: The keras model fails on the inputs of batch 0" if index == 1
                else "DistributedFailure: normflat stopped on rank 0")
    assert result["failure"].startswith(expected), result["failure"]
    if index == 1:
        assert "InvalidArgumentError: replica failure" in result["failure"]


# ----------------------------------------------------------------------------- in-process checks


@pytest.fixture
def mlp():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(7, activation="tanh", dtype="float64"),
        keras.layers.Dense(4, dtype="float64"),
    ])
    rng = np.random.default_rng(1)
    return model, (rng.normal(size=(20, 5)), rng.integers(0, 4, size=20))


def _diag(model, data, **kw):
    return [v.numpy() for v in normflat.hessian_diagonal(model, data, progress=False, **kw).values()]


def test_distributed_true_needs_a_strategy(mlp):
    model, data = mlp
    with pytest.raises(ValueError, match="strategy scope"):
        normflat.analyze(model, data, distributed=True, progress=False)
    with pytest.raises(TypeError, match="distributed"):
        normflat.analyze(model, data, distributed="yes", progress=False)


def test_analyze_inside_strategy_run_is_an_error(mlp):
    model, data = mlp
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with pytest.raises(RuntimeError, match="inside strategy.run"):
        strategy.run(lambda: normflat.analyze(model, data, progress=False))


def test_distributed_dataset_is_refused_with_the_fix(mlp):
    model, (x, y) = mlp
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
    with pytest.raises(TypeError, match="plain tf.data.Dataset"):
        normflat.analyze(model, dataset, progress=False)


def test_single_replica_strategy_runs_on_one_device(mlp):
    model, data = mlp
    ref = _diag(model, data, chunk_size=8)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        report = normflat.analyze(model, data, chunk_size=8, progress=False)
        got = _diag(model, data, chunk_size=8)
    assert "replicas" not in report.metadata["backend"] and report.metadata["world_size"] == 1
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_memory_budget_chooses_chunk_and_keeps_result(mlp):
    model, data = mlp
    ref = _diag(model, data)
    small = normflat.analyze(model, data, memory_budget="3KB", progress=False).metadata
    smaller = normflat.analyze(model, data, memory_budget=1500, progress=False).metadata
    assert 1 <= smaller["chunk_size"] < small["chunk_size"] < 20  # a whole batch does not fit
    assert small["memory_budget"] == 3000
    for budget in ("3KB", 1500):
        for a, b in zip(_diag(model, data, memory_budget=budget), ref):
            np.testing.assert_allclose(a, b, rtol=1e-12)
    large = normflat.analyze(model, data, memory_budget="1GiB", progress=False).metadata
    assert large["chunk_size"] >= 20


def test_default_budget_is_formed_once_per_step(mlp, monkeypatch):
    """Without ``memory_budget`` the default budget (about twice a training step) decides both the
    signals' block and the chunk of a new compiled step: it is formed once for both."""
    model, data = mlp
    from normflat.backends.keras import session as keras_session

    calls, own = [], keras_session.KerasSession._default_budget
    monkeypatch.setattr(keras_session.KerasSession, "_default_budget",
                        lambda self, rows: calls.append(rows) or own(self, rows))
    _diag(model, data)
    assert calls == [20], calls


def test_memory_budget_too_small_for_one_sample(mlp):
    model, data = mlp
    with pytest.raises(ValueError, match=r"memory_budget=100 bytes .* too small.*bytes .* for a single sample"):
        normflat.analyze(model, data, memory_budget=100, progress=False)


def test_memory_budget_validation(mlp):
    model, data = mlp
    with pytest.raises(ValueError, match="not understood"):
        normflat.analyze(model, data, memory_budget="lots", progress=False)
    with pytest.raises(ValueError, match="not both"):
        normflat.analyze(model, data, memory_budget="1GB", chunk_size=4, progress=False)


def test_memory_budget_on_the_generic_path_chunks_and_keeps_result(mlp):
    """The generic path forms its per-sample gradients one sample at a time: its estimate counts
    one sample's forward and weight gradients once and, per sample of the chunk, the signals at
    the logits. A larger budget takes a larger chunk (3 KB: blocks of one signal), the numbers
    unchanged; a budget that one sample with one signal does not fit is refused."""
    model, data = mlp
    ref = _diag(model, data)
    chunks = []
    for budget in ("3KB", "6KB"):
        chunks.append(normflat.analyze(model, data, memory_budget=budget, fast=False, progress=False)
                      .metadata["chunk_size"])
        for a, b in zip(_diag(model, data, memory_budget=budget, fast=False), ref):
            np.testing.assert_allclose(a, b, rtol=1e-12)
    assert 1 <= chunks[0] < chunks[1] < 20, chunks  # a whole batch of 20 does not fit
    with pytest.raises(ValueError, match="too small"):
        normflat.analyze(model, data, memory_budget="2KB", fast=False, progress=False)


@pytest.mark.parametrize("case", ["structured-head", "at-the-logits", "topk-groups", "default-budget"])
def test_memory_budget_takes_fewer_signals_per_block_when_one_sample_does_not_fit(case, monkeypatch):
    """A budget that one sample with the default block of signals exceeds: smaller blocks (as the
    torch and JAX backends step through one sample's signals; method §9, "Memory"), the same
    numbers as the default blocks and as the brute force, every group of ggn-topk kept apart; a
    budget that one signal does not fit is refused with the other backends' message. Without
    options, the same when the default budget (about twice a training step) is exceeded."""
    from normflat.backends import keras as keras_backend
    from normflat.backends.keras import session as keras_session
    from normflat.engine.options import validate_options
    from tests import netspec, reference
    from tests.builders import load_builder

    if case == "at-the-logits":
        spec = netspec.mlp((5, 6, 20), activation="tanh", seed=71)
    else:
        spec = netspec.cnn(channels=(2, 3, 4), image=6, classes=40, seed=72)
    x, y = netspec.data(spec, n=6 if case == "default-budget" else 4, seed=6)
    builder = load_builder("keras")
    model, data = builder.build(spec), builder.make_data(x, y, 4)  # default-budget: batches of 4 and 2
    kw = dict(loss="ce", estimator="ggn-topk", top_classes=2, samples=12, seed=3) if case == "topk-groups" \
        else dict(loss="ce", estimator="ggn")
    sessions, blocks = [], []
    step_bytes, step_fn = keras_session.KerasSession._step_bytes, keras_session.ggn_step_fn
    monkeypatch.setattr(keras_session.KerasSession, "_step_bytes",
                        lambda self, block: (sessions.append(self), step_bytes(self, block))[1])
    monkeypatch.setattr(keras_session, "ggn_step_fn",
                        lambda *args, **kwargs: (blocks.append(args[4]), step_fn(*args, **kwargs))[1])

    def groups(**extra):
        problems, _ = keras_backend.layer_problems(model, data, validate_options(progress=False, **kw), **extra)
        return [p.hessian_diag if p.hessian_diag_samples is None else p.hessian_diag_samples for p in problems]

    whole = groups(memory_budget="1GiB")
    default = blocks[-1]
    assert default > 2
    session = sessions[-1]
    budget = (sum(session._step_bytes(2)) + sum(session._step_bytes(default))) // 2
    if case == "default-budget":
        # The budget of the first batch decides; the smaller last one (a larger budget here) keeps
        # the block and the compiled step.
        monkeypatch.setattr(keras_session.KerasSession, "_default_budget",
                            lambda self, rows: budget if rows == 4 else 2**40)
        used, ggn_step = [], keras_session.KerasSession._ggn_step
        monkeypatch.setattr(keras_session.KerasSession, "_ggn_step",
                            lambda self, rows: (lambda out: (used.append((rows, out[2])), out)[1])(ggn_step(self, rows)))
        stepped = groups()
        assert [rows for rows, _ in used] == [4, 2] and used[0][1] == used[1][1] < default, used
    else:
        stepped = groups(memory_budget=budget)
    assert 1 <= blocks[-1] < default, blocks
    for got, want in zip(stepped, whole):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-14 * np.abs(want).max())
    if case != "topk-groups":
        for got, want in zip(stepped, reference.ggn_diagonal(spec, x, y, "ce")):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"memory_budget=500 bytes .* is too small: one back-propagated GGN "
                                         r"signal needs \d+ bytes"):
        groups(memory_budget=500)
