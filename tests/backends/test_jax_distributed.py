"""JAX backend at scale: batches sharded over 2 devices, 2 processes, memory budget.

The sharded runs need ``XLA_FLAGS=--xla_force_host_platform_device_count=2``
before JAX initializes, and the multi-process run needs
``jax.distributed.initialize``; both therefore run in subprocesses (this file
run as a script), each with a timeout so that a hang fails the test instead of
blocking CI. Reference: the same model and data analyzed with
``distributed=False`` (one device, one process) in float64.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-10
TIMEOUT = 150  # seconds per subprocess; a hang fails instead of blocking CI


# ----------------------------------------------------------------------------- worker side


def _model_and_data(n=13, seed=0):
    """A tiny conv + dense (apply_fn, params) model and ``n`` examples (NHWC images)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    params = {
        "conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 2, 3)) * 0.5), "bias": jnp.asarray(rng.normal(size=3))},
        "dense": {"kernel": jnp.asarray(rng.normal(size=(12, 4)) * 0.5), "bias": jnp.asarray(rng.normal(size=4))},
    }

    def apply(p, x):
        h = jax.lax.conv_general_dilated(x, p["conv"]["kernel"], (2, 2), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        h = jnp.tanh(h + p["conv"]["bias"])
        h = h.reshape(h.shape[0], -1)
        return h @ p["dense"]["kernel"] + p["dense"]["bias"]

    x = rng.normal(size=(n, 4, 4, 2))
    y = rng.integers(0, 4, size=n)
    return (apply, params), x, y


def _batches(x, y, sizes):
    out, s = [], 0
    for b in sizes:
        out.append((x[s:s + b], y[s:s + b]))
        s += b
    assert s == len(x)
    return out


def _diag(model, data, **kw):
    import normflat

    d = normflat.hessian_diagonal(model, data, progress=False, dtype="float64", **kw)
    return {k: np.asarray(v) for k, v in d.items()}


def _max_rel(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    scale = max(float(np.abs(v).max()) for v in b.values())
    return max(float(np.abs(a[k] - b[k]).max()) for k in a) / scale


def _report(model, data, **kw):
    import normflat

    r = normflat.analyze(model, data, progress=False, dtype="float64", **kw)
    meta = {"examples": r.metadata["examples"], "batches": r.metadata["batches"],
            "devices": r.metadata["backend"]["devices"], "processes": r.metadata["world_size"]}
    return {"totals": r.totals, "se": r.standard_error, "meta": meta}


def worker_devices() -> dict:
    """Two forced host devices: sharded vs one-device results."""
    import jax

    assert len(jax.local_devices()) == 2, jax.local_devices()
    model, x, y = _model_and_data()
    data = _batches(x, y, [5, 5, 3])  # odd sizes: every piece is padded to a multiple of 2
    out = {"diff": {}}
    for est in ("ggn", "exact"):
        for loss in ("nsce", "ce"):
            ref = _diag(model, data, estimator=est, loss=loss, distributed=False)
            out["diff"][f"{est}/{loss}"] = _max_rel(_diag(model, data, estimator=est, loss=loss), ref)
    ref = _diag(model, data, estimator="ggn", distributed=False)
    # Several pieces per batch with a padded last one; 1 example per device per step.
    out["diff"]["ggn/chunk1"] = _max_rel(_diag(model, data, estimator="ggn", chunk_size=1), ref)
    out["diff"]["ggn/devices=1"] = _max_rel(_diag(model, data, estimator="ggn", devices=1), ref)
    out["diff"]["ggn/device_list"] = _max_rel(_diag(model, data, estimator="ggn", devices=jax.local_devices()), ref)
    out["diff"]["ggn/budget"] = _max_rel(_diag(model, data, estimator="ggn", memory_budget="20KB"), ref)
    # One example's signals a step at a time on the mesh (method §9, "Memory"): a budget of one signal.
    from normflat.backends.jax import ggn as jax_ggn
    from normflat.backends.jax import session

    kernel = [k for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN)][-1]
    budget = int(kernel._step_base + kernel._step_signal)
    out["diff"]["ggn/signal_steps"] = _max_rel(_diag(model, data, estimator="ggn", memory_budget=budget), ref)
    stepped = [k for _, k in session._CACHE._data.values() if isinstance(k, jax_ggn.GGN)][-1]
    out["signal_steps"] = [stepped.signal_step, stepped.bp * stepped.cols,
                           [key[0] is not None for key in stepped._compiled]]
    out["diff"]["ggn/one_pair"] = _max_rel(_diag(model, (x, y), estimator="ggn"), ref)

    def squared_error(z, labels):
        import jax.numpy as jnp
        return jnp.mean(jnp.sum((z - jax.nn.one_hot(labels, 4, dtype=z.dtype)) ** 2, axis=-1))

    # A callable loss sees whole batches: even ones are sharded, odd ones stay whole.
    for sizes in ([5, 5, 3], [6, 4, 3]):
        d = _batches(x, y, sizes)
        out["diff"][f"exact/callable/{sizes}"] = _max_rel(
            _diag(model, d, estimator="exact", loss=squared_error),
            _diag(model, d, estimator="exact", loss=squared_error, distributed=False))
    for est in ("ggn-mc", "hutchinson"):
        one = _report(model, data, estimator=est, samples=4, seed=3, distributed=False)
        two = _report(model, data, estimator=est, samples=4, seed=3)
        again = _report(model, data, estimator=est, samples=4, seed=3)
        out[est] = {"one": one, "two": two, "again": again}
    out["meta"] = _report(model, data, estimator="ggn")["meta"]

    # Errors inside the sharded computation raise (the parent's timeout catches hangs).
    errors = {}

    def failing():
        yield x[:5], y[:5]
        raise RuntimeError("data source failed")

    for name, call in {
        "iterator": lambda: _diag(model, failing(), estimator="ggn"),
        "labels": lambda: _diag(model, [(x[:5], y[:5] + 10)], estimator="ggn"),
        "budget": lambda: _diag(model, data, estimator="ggn", memory_budget=100),
        "devices": lambda: _diag(model, data, estimator="ggn", devices=3),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - reported to the parent
            errors[name] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    return out


def worker_process(pid: int, port: int, fail: bool) -> dict:
    """One of 2 processes: process 0 feeds batches [5, 5], process 1 feeds [3]."""
    import jax

    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    model, x, y = _model_and_data()
    full = _batches(x, y, [5, 5, 3])
    shard = full[:2] if pid == 0 else full[2:]
    if fail:
        def failing():
            yield shard[0]
            if pid == 1:
                raise RuntimeError("data source of process 1 failed")
        try:
            _diag(model, failing(), estimator="ggn")
            return {"error": None}
        except Exception as err:  # noqa: BLE001 - reported to the parent
            return {"error": f"{type(err).__name__}: {err}"}
    out = {"diff": {}, "diag": {}}
    for est in ("ggn", "exact"):
        mine = _diag(model, shard, estimator=est)
        out["diff"][est] = _max_rel(mine, _diag(model, full, estimator=est, distributed=False))
        out["diag"][est] = {k: v.tolist() for k, v in mine.items()}
    out["ggn-mc"] = _report(model, shard, estimator="ggn-mc", samples=4, seed=3)
    out["meta"] = _report(model, shard, estimator="ggn")["meta"]
    # ggn-topk: the dense head is exact, one shared sum per process (SumState.add_exact) brought to the
    # full form before the sums are reduced; its diagonal is the single process's whatever the draws.
    topk = dict(estimator="ggn-topk", samples=4, top_classes=1, seed=3)
    mine, single = _diag(model, shard, **topk), _diag(model, full, distributed=False, **topk)
    head = [k for k in mine if "dense" in k]
    out["topk_head"] = _max_rel({k: mine[k] for k in head}, {k: single[k] for k in head}) if head else None
    out["topk"] = _report(model, shard, **topk)
    return out


if __name__ == "__main__":
    import numpy as np

    mode = sys.argv[1]
    if mode == "devices":
        result = worker_devices()
    else:
        result = worker_process(int(sys.argv[2]), int(sys.argv[3]), mode == "fail")
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0)

# ----------------------------------------------------------------------------- test side

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.builders import require_frameworks  # noqa: E402

require_frameworks("jax")


def _env(devices: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env.pop("JAX_ENABLE_X64", None)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _start(args, devices):
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *map(str, args)], cwd=ROOT,
                            env=_env(devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc) -> dict:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"worker hung (killed after {TIMEOUT} s); stderr:\n{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker failed (rc {proc.returncode}); stderr:\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def results():
    """Run all workers concurrently: 2 forced devices; 2 processes × 2 devices; 2 failing processes."""
    p1, p2 = _free_port(), _free_port()
    procs = {
        "devices": _start(["devices"], 2),
        "proc0": _start(["process", 0, p1], 2),
        "proc1": _start(["process", 1, p1], 2),
        "fail0": _start(["fail", 0, p2], 1),
        "fail1": _start(["fail", 1, p2], 1),
    }
    return {name: _result(p) for name, p in procs.items()}


def test_sharded_equals_single_device(results):
    diffs = results["devices"]["diff"]
    assert len(diffs) == 12
    for case, diff in diffs.items():
        assert diff < TOL, (case, diff)
    assert results["devices"]["meta"] == {"examples": 13, "batches": 3, "devices": 2, "processes": 1}
    # the signals one at a time, compiled for the mesh
    assert results["devices"]["signal_steps"] == [1, 3, [True]], results["devices"]["signal_steps"]


@pytest.mark.parametrize("estimator", ["ggn-mc", "hutchinson"])
def test_sharded_stochastic_estimators_reproduce_single_device(results, estimator):
    r = results["devices"][estimator]
    assert r["one"]["meta"]["devices"] == 1 and r["two"]["meta"]["devices"] == 2
    # Draws are keyed by example / batch index, not by device: sharding changes nothing.
    assert r["two"] == r["again"]
    for part in ("totals", "se"):
        assert r["two"][part] is not None
        for m, v in r["one"][part].items():
            assert r["two"][part][m] == pytest.approx(v, rel=TOL), (part, m)


def test_errors_raise_instead_of_hanging(results):
    errors = results["devices"]["errors"]
    assert errors["iterator"] == "RuntimeError: data source failed"
    assert errors["labels"].startswith("ValueError: Batch 0: labels must be class indices in [0, 3]")
    assert errors["budget"].startswith("ValueError: memory_budget=100 bytes")
    assert errors["devices"].startswith("ValueError: devices=3 but this process has 2 local device(s)")


def test_two_processes_equal_single_process_and_each_other(results):
    a, b = results["proc0"], results["proc1"]
    for est in ("ggn", "exact"):
        assert a["diff"][est] < TOL and b["diff"][est] < TOL, (est, a["diff"], b["diff"])
        # Every process returns the identical report (same summation order everywhere).
        assert a["diag"][est] == b["diag"][est]
    assert a["meta"] == b["meta"] == {"examples": 13, "batches": 3, "devices": 2, "processes": 2}
    assert a["ggn-mc"] == b["ggn-mc"] and a["ggn-mc"]["se"] is not None
    assert a["topk"] == b["topk"] and a["topk"]["se"] is not None
    assert a["topk_head"] is not None and a["topk_head"] < TOL and b["topk_head"] < TOL


def test_failing_process_raises_on_every_process(results):
    assert results["fail1"]["error"] == "RuntimeError: data source of process 1 failed"
    # The engine's failure agreement: the other process raises DistributedFailure naming rank 1.
    assert results["fail0"]["error"].startswith("DistributedFailure: normflat stopped on rank 0 because 1 of 2")
    assert "rank 1: RuntimeError: data source of process 1 failed" in results["fail0"]["error"]


# ----------------------------------------------------------------------------- GGN speed-ups (in-process)


@pytest.mark.parametrize("case", ["padded", "ties", "dilated", "valid"])
def test_fast_max_pool_vjp_equals_xla(case):
    """The GGN's max-pool VJP (argmax found once) equals XLA's select_and_scatter VJP."""
    import jax
    import jax.numpy as jnp

    from normflat.backends.jax.program import _fast_max_pool, _hashable

    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        x = jnp.asarray(rng.normal(size=(7, 6, 3)))
        kw = {"window_dimensions": (3, 3, 1), "window_strides": (2, 2, 1), "padding": ((1, 1), (1, 1), (0, 0)),
              "base_dilation": (1, 1, 1), "window_dilation": (1, 1, 1)}
        if case == "ties":  # many equal maxima: both pick the first in row-major window order
            x = jnp.asarray(rng.integers(0, 2, size=(7, 6, 3)).astype(float))
        elif case == "dilated":
            # (JAX has no VJP for window dilation; the fast path leaves such pools to JAX.)
            kw.update(base_dilation=(2, 1, 1), padding=((0, 1), (2, 2), (0, 0)))
        elif case == "valid":
            kw.update(window_strides=(1, 1, 1), padding=((0, 0), (0, 0), (0, 0)))

        def xla(a):
            return jax.lax.reduce_window(a, -jnp.inf, jax.lax.max, kw["window_dimensions"], kw["window_strides"],
                                         kw["padding"], kw["base_dilation"], kw["window_dilation"])

        y, vjp_ref = jax.vjp(xla, x)
        (prim,) = {e.primitive for e in jax.make_jaxpr(xla)(x).jaxpr.eqns}
        assert prim.name == "reduce_window_max"
        pool = _fast_max_pool(prim, _hashable(kw))
        y2, vjp_fast = jax.vjp(pool, x)
        np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
        dys = jnp.asarray(rng.normal(size=(4,) + y.shape))
        got = jax.vmap(lambda d: vjp_fast(d)[0])(dys)
        ref = jax.vmap(lambda d: vjp_ref(d)[0])(dys)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
