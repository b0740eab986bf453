"""Subprocess half of test_keras_distributed: MirroredStrategy over 2 logical CPU devices.

Run as ``python _keras_distributed_worker.py OUT.json``. Logical devices must be
configured before TensorFlow initializes its devices, hence a fresh process.
Writes one JSON object with the measured differences; the test asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import normflat  # noqa: E402

L = keras.layers
DEVICES = ["/cpu:0", "/cpu:1"]


class FailOnLargeInput(L.Layer):
    """Identity that fails at run time (inside the compiled replica step) on inputs above 100."""

    def call(self, x):
        tf.debugging.assert_less(tf.reduce_max(x), tf.constant(100.0, x.dtype), message="replica failure")
        return x


def build_mlp(fail: bool = False) -> keras.Model:
    keras.utils.set_random_seed(1)
    layers = [keras.Input((5,))]
    if fail:
        layers.append(FailOnLargeInput())
    layers += [L.Dense(6, activation="tanh"), L.Dense(4)]
    return keras.Sequential(layers)


def build_cnn() -> keras.Model:
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((6, 6, 2)), L.Conv2D(3, 3, activation="tanh"), L.Flatten(), L.Dense(3),
    ])


def batches(x, y, size):
    """A list of (x, y) batches of ``size`` (the last one shorter)."""
    return [(x[a:a + size], y[a:a + size]) for a in range(0, len(y), size)]


def diagonals(model, data, **kw):
    return [np.asarray(v.numpy()) for v in normflat.hessian_diagonal(model, data, progress=False, **kw).values()]


def max_rel_diff(a, b):
    return max(float(np.max(np.abs(p - q)) / max(np.max(np.abs(q)), 1e-300)) for p, q in zip(a, b))


def report_diff(a, b) -> float:
    """Largest relative difference of every per-layer quantity of two reports."""
    worst = 0.0
    for la, lb in zip(a.layers, b.layers):
        for key in ("normalized_sharpness", "matrix_normalized_sharpness", "hessian_trace", "elementwise_bound",
                    "row_sigma", "col_sigma"):
            va, vb = np.asarray(getattr(la, key), float), np.asarray(getattr(lb, key), float)
            finite = np.isfinite(va)
            if not np.array_equal(finite, np.isfinite(vb)) or np.any(va[~finite] != vb[~finite]):
                return float("inf")  # e.g. a degenerate row in one report only
            fa, fb = va[np.isfinite(va)], vb[np.isfinite(vb)]
            if fa.size:
                worst = max(worst, float(np.max(np.abs(fa - fb)) / max(float(np.max(np.abs(fb))), 1e-300)))
    return worst


def main(out_path: str) -> None:
    keras.backend.set_floatx("float64")
    strategy = tf.distribute.MirroredStrategy(DEVICES)
    result: dict = {"replicas": strategy.num_replicas_in_sync, "cases": {}}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(23, 5))
    y = rng.integers(0, 4, size=23)
    xi = rng.normal(size=(7, 6, 6, 2))
    yi = rng.integers(0, 3, size=7)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(6)
    with strategy.scope():
        mlp, cnn = build_mlp(), build_cnn()
    mlp_single, cnn_single = build_mlp(), build_cnn()
    mlp_single.set_weights(mlp.get_weights())
    cnn_single.set_weights(cnn.get_weights())
    outside = build_mlp()  # built outside any scope; distributed because analyze runs inside it
    for name, (model, single), data, estimators, kw in [
        # 23 samples: 5 batches of 5 (odd count, last one partial), one (x, y) pair (one batch of 23,
        # split between the replicas), 6 of 4 in chunks of 2 through the generic per-sample Jacobian path.
        ("mlp_b5", (mlp, mlp_single), batches(x, y, 5), ("ggn", "exact"), {}),
        ("mlp_one_batch", (mlp, mlp_single), (x, y), ("ggn", "exact"), {}),
        ("mlp_generic_chunked", (mlp, mlp_single), batches(x, y, 4), ("ggn",), {"chunk_size": 2, "fast": False}),
        ("cnn_b3", (cnn, cnn_single), batches(xi, yi, 3), ("ggn",), {}),
        ("scope_only_dataset", (outside, outside), dataset, ("ggn",), {}),
    ]:
        for est in estimators:
            ref_report = normflat.analyze(single, data, estimator=est, **kw, progress=False, distributed=False)
            with strategy.scope():
                dist_report = normflat.analyze(model, data, estimator=est, **kw, progress=False)
            case = {
                "report": report_diff(dist_report, ref_report),
                "examples": [dist_report.metadata["examples"], ref_report.metadata["examples"]],
                "batches": [dist_report.metadata["batches"], ref_report.metadata["batches"]],
                "replicas": dist_report.metadata["backend"].get("replicas"),
                "ref_replicas": ref_report.metadata["backend"].get("replicas"),
                "paths": [layer.details["path"] for layer in dist_report.layers],
                "ref_paths": [layer.details["path"] for layer in ref_report.layers],
            }
            if name == "mlp_b5" and est == "ggn":
                ref = diagonals(single, data, estimator=est, **kw)
                case["diag"] = max_rel_diff(diagonals(model, data, estimator=est, **kw), ref)
                opt_out = normflat.analyze(model, data, estimator=est, distributed=False, **kw, progress=False)
                case["opt_out_replicas"] = opt_out.metadata["backend"].get("replicas", 1)
                case["opt_out_report"] = report_diff(opt_out, ref_report)
            result["cases"][f"{name}/{est}"] = case

    # Stochastic estimators: run distributed (twice: reproducible), report standard errors.
    # ggn-topk: the Dense head's exact squares are one shared sum per replica (SumState.add_exact).
    for est, samples in (("ggn-mc", 4), ("hutchinson", 8), ("ggn-topk", 4)):
        rep = normflat.analyze(mlp, batches(x, y, 5), estimator=est, samples=samples, progress=False)
        again = normflat.analyze(mlp, batches(x, y, 5), estimator=est, samples=samples, progress=False)
        single = normflat.analyze(mlp_single, batches(x, y, 5), estimator=est, samples=samples, progress=False)
        result["cases"][f"stochastic/{est}"] = {
            "has_se": all(layer.standard_error is not None for layer in rep.layers),
            "reproducible": all(a.normalized_sharpness == b.normalized_sharpness
                                for a, b in zip(rep.layers, again.layers)),
            "replicas": rep.metadata["backend"].get("replicas"),
            # The draws are keyed on sample positions and the probes fixed: the same numbers as on one device.
            "single_device": report_diff(rep, single),
        }

    # The first forward's checks inside the scope (a cross-replica context, where a mirrored variable
    # cannot be watched): the same paths and reasons as on one device, fast where that is fast, and
    # the same report; a position table also read through a second reference is still refused (a
    # gradient reaches its per-device copy).
    from tests.arch.test_keras_layers import position_model

    with strategy.scope():
        table, xt, yt = position_model("alias")
    with strategy.scope():
        inside = normflat.analyze(table, (xt, yt), progress=False)
    single = normflat.analyze(table, (xt, yt), progress=False, distributed=False)
    result["cases"]["checks_in_scope/table_alias"] = {
        "replicas": inside.metadata["backend"].get("replicas"),
        "details": [[layer.details["path"], layer.details.get("generic_reason")] for layer in inside.layers],
        "ref_details": [[layer.details["path"], layer.details.get("generic_reason")] for layer in single.layers],
        "report": report_diff(inside, single),
    }

    # A failure inside replica 1 only (its batch holds a value > 100): raises, no hang.
    with strategy.scope():
        failing = build_mlp(fail=True)
    xf = x.copy()
    xf[9] = 1e3  # batch 1 (samples 5-9) is split 3 + 2 between the replicas: sample 9 -> replica 1
    for est in ("ggn", "exact"):
        try:
            normflat.analyze(failing, batches(xf, y, 5), estimator=est, progress=False)
            result[f"failure/{est}"] = "no error"
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            result[f"failure/{est}"] = f"{type(err).__name__}: {err}"[:300]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
