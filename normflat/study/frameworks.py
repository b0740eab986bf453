"""Per-framework pieces of the study: build, train, evaluate, copy to float64, rescale.

Every adapter offers the same operations on the same three architectures
(:data:`normflat.study.models.ARCHITECTURES`), so :func:`normflat.study.run_study`
runs unchanged with ``framework="torch"`` (default), ``"keras"`` or ``"jax"``
(equinox models, optax training). Arrays come in
as the dataset's numpy NCHW float32 images and int64 labels; each adapter converts
them once with :meth:`inputs`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from normflat.study.training import TrainResult

__all__ = ["FRAMEWORKS", "adapter", "TorchAdapter", "KerasAdapter", "JaxAdapter"]

#: Frameworks the study can train in (``jax`` means equinox models trained with optax).
FRAMEWORKS = ("torch", "keras", "jax")


def adapter(name: str) -> Any:
    """The adapter of framework ``name``.

    Raises:
        ValueError: For an unsupported framework, naming the supported ones.
        ImportError: If the framework is not installed.
    """
    if name == "torch":
        return TorchAdapter()
    if name == "keras":
        return KerasAdapter()
    if name == "jax":
        return JaxAdapter()
    raise ValueError(
        f"The study trains models in {', '.join(FRAMEWORKS)}; --framework {name!r} is not supported "
        f"yet. Use --framework {' or '.join(FRAMEWORKS)}, or analyze your own models with "
        "normflat.analyze()."
    )


class TorchAdapter:
    """PyTorch: ``nn.Sequential`` models, AdamW/SGD training, float64 analysis copies."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def set_threads(self, threads: int | None) -> None:
        if threads is not None:
            self.torch.set_num_threads(threads)

    def inputs(self, x: np.ndarray) -> Any:
        return self.torch.as_tensor(x)

    def labels(self, y: np.ndarray) -> Any:
        return self.torch.as_tensor(y)

    def build(self, arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None, seed: int) -> Any:
        from normflat.study.models import build_model

        return build_model(arch, input_shape, num_classes, width=width, seed=seed)

    def train(self, model: Any, x: Any, y: Any, **kwargs: Any) -> TrainResult:
        from normflat.study.training import train_model

        return train_model(model, x, y, **kwargs)

    def accuracy(self, model: Any, x: Any, y: Any) -> float:
        from normflat.study.training import accuracy

        return accuracy(model, x, y)

    def float64(self, model: Any) -> Any:
        import copy

        return copy.deepcopy(model).double().eval()

    def analysis_data(self, x: Any, y: Any, batch_size: int) -> tuple[Any, dict[str, Any]]:
        from torch.utils.data import DataLoader, TensorDataset

        return DataLoader(TensorDataset(x.double(), y), batch_size=batch_size, shuffle=False), {}

    def check_inputs(self, x: Any) -> Any:
        return x.double()

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        from normflat.study.reparametrize import apply_rescaling, random_rescaling

        rescaling = random_rescaling(model, orders=orders, seed=seed)
        return apply_rescaling(model, rescaling), rescaling.spread

    def function_error(self, a: Any, b: Any, x: Any) -> float:
        from normflat.study.reparametrize import check_same_function

        return check_same_function(a, b, x, rtol=1e-9)

    def version(self) -> str:
        return self.torch.__version__


class KerasAdapter:
    """Keras 3: ``keras.Sequential`` models mirroring the torch ones, NHWC images."""

    name = "keras"

    def __init__(self) -> None:
        import os

        # TensorFlow's C++ log (grappler notes on float64 graphs) would drown the table.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras

        self.keras = keras

    def set_threads(self, threads: int | None) -> None:
        pass  # the TensorFlow thread pools are fixed once TF starts

    def inputs(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))  # NCHW -> NHWC

    def labels(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.int64)

    def build(self, arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None,
              seed: int, dtype: str = "float32") -> Any:
        from normflat.study.models import ARCHITECTURES

        keras = self.keras
        L = keras.layers
        if arch not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
        keras.utils.set_random_seed(seed)
        channels, height, wide = input_shape
        layers: list[Any] = [keras.Input((height, wide, channels), dtype=dtype)]
        kw = {"dtype": dtype}
        if arch == "mlp":
            hidden = width or 128
            layers += [L.Flatten(**kw), L.Dense(hidden, **kw), L.ReLU(**kw), L.Dense(hidden, **kw), L.ReLU(**kw),
                       L.Dense(num_classes, **kw)]
        else:
            small = min(height, wide) < 16
            k = 3 if small else 5
            c1, c2 = (16, 32) if small else (6, 16)
            for i, c in enumerate((c1, c2)):
                # Same geometry as the torch models: 'same' padding except LeNet's second conv.
                layers.append(L.Conv2D(c, k, padding="same" if (small or i == 0) else "valid", **kw))
                if arch == "cnn-bn":
                    layers.append(L.BatchNormalization(epsilon=1e-5, momentum=0.9, **kw))
                layers += [L.ReLU(**kw), L.MaxPooling2D(2, **kw)]
            hidden = width or (128 if small else 120)
            layers += [L.Flatten(**kw), L.Dense(hidden, **kw), L.ReLU(**kw), L.Dense(num_classes, **kw)]
        return keras.Sequential(layers)

    def train(self, model: Any, x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, batch_size: int,
              weight_decay: float, optimizer: str, target_accuracy: float, seed: int, progress: bool,
              desc: str) -> TrainResult:
        keras = self.keras
        from tqdm.auto import tqdm

        keras.utils.set_random_seed(seed)
        if optimizer == "adam":
            opt = keras.optimizers.AdamW(learning_rate=lr, weight_decay=weight_decay)
        elif optimizer == "sgd":
            opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9, weight_decay=weight_decay or None)
        else:
            raise ValueError(f"Unknown optimizer {optimizer!r}; choose 'adam' or 'sgd'.")
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        adapter_self = self
        bar = tqdm(total=epochs, desc=desc, unit="epoch", leave=False, disable=not progress)
        state = {"acc": 0.0, "loss": float("nan"), "epochs": 0}

        class _Fit(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                state["epochs"] = epoch + 1
                state["loss"] = float((logs or {}).get("loss", float("nan")))
                state["acc"] = adapter_self.accuracy(self.model, x, y)
                bar.update(1)
                bar.set_postfix(acc=f"{state['acc']:.3f}", loss=f"{state['loss']:.3g}", refresh=False)
                if state["acc"] >= target_accuracy:
                    self.model.stop_training = True

        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0, callbacks=[_Fit()])
        bar.close()
        return TrainResult(state["epochs"], state["acc"], state["loss"], state["acc"] >= target_accuracy,
                           time.perf_counter() - start)

    def _logits(self, model: Any, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        parts = [np.asarray(model(x[i:i + batch_size], training=False)) for i in range(0, len(x), batch_size)]
        return np.concatenate(parts) if parts else np.zeros((0,))

    def accuracy(self, model: Any, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self._logits(model, x).argmax(1) == y)) if len(y) else 0.0

    def float64(self, model: Any) -> Any:
        # Rebuild the same architecture in float64 and copy the (cast) weights over.
        clone = self.keras.Sequential(
            [self.keras.Input(model.input_shape[1:], dtype="float64")]
            + [type(layer).from_config({**layer.get_config(), "dtype": "float64"}) for layer in model.layers]
        )
        clone.set_weights([np.asarray(w, dtype=np.float64) for w in model.get_weights()])
        return clone

    def analysis_data(self, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[Any, dict[str, Any]]:
        # A list of (x, y) batches, as for the other frameworks: the Keras backend takes a
        # single (x, y) pair as one batch (its batch_size option is deprecated).
        x = x.astype(np.float64)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size)], {}

    def check_inputs(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float64)

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        """A rescaled float64 copy: the same symmetries as :mod:`normflat.study.reparametrize`."""
        if orders < 0:
            raise ValueError(f"orders must be >= 0, got {orders}.")
        rng = np.random.default_rng(seed)
        layers = model.layers
        weights = {id(layer): [np.array(w, dtype=np.float64) for w in layer.get_weights()] for layer in layers}
        widx = [i for i, layer in enumerate(layers) if type(layer).__name__ in ("Dense", "Conv2D")]
        drawn = []
        for i, j in zip(widx[:-1], widx[1:]):
            between = [type(layer).__name__ for layer in layers[i + 1:j]]
            kernel, bias = weights[id(layers[i])]
            c = 10.0 ** rng.uniform(-orders, orders, size=kernel.shape[-1])
            if between and between[0] == "BatchNormalization":
                kind = "bn"
            elif "ReLU" in between and all(n in ("ReLU", "MaxPooling2D", "Flatten") for n in between):
                kind = "relu"
            else:
                continue
            drawn.append(c)
            kernel *= c  # output units are the last kernel axis in Keras
            bias *= c
            if kind == "bn":
                bn = layers[i + 1]
                gamma, beta, mean, var = weights[id(bn)]
                eps = bn.epsilon
                gamma *= np.sqrt(c * c * var + eps) / (c * np.sqrt(var + eps))
                mean *= c
                var *= c * c
            else:
                nxt = weights[id(layers[j])][0]
                if nxt.ndim == 4:  # Conv2D kernel (kh, kw, in, out)
                    nxt /= c[None, None, :, None]
                else:  # Dense (in, out); after Flatten of NHWC maps, channels vary fastest
                    reps = nxt.shape[0] // len(c)
                    nxt /= np.tile(c, reps)[:, None]
        if not drawn:
            raise ValueError("This model has no weight layer that can be rescaled without changing its function.")
        new = self.float64(model)
        for layer, new_layer in zip(layers, new.layers):
            if weights[id(layer)]:
                new_layer.set_weights(weights[id(layer)])
        allf = np.concatenate(drawn)
        return new, float(np.log10(allf.max() / allf.min()))

    def function_error(self, a: Any, b: Any, x: np.ndarray) -> float:
        from normflat.study.reparametrize import FunctionChangedError

        la, lb = self._logits(a, x), self._logits(b, x)
        err = float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30))
        if not err <= 1e-9:
            raise FunctionChangedError(
                f"The rescaled Keras model's logits differ from the original's by {err:.3g} (relative, "
                "tolerance 1e-09). The rescaling is not function-preserving for this model."
            )
        return err

    def version(self) -> str:
        return self.keras.__version__


class JaxAdapter:
    """JAX: equinox models mirroring the torch ones (per-example NCHW), trained with optax.

    Models are ``_EqxNet`` modules whose BatchNorm layers keep their running
    statistics in an ``eqx.nn.State`` (mode ``"ema"``); what is analyzed is an
    inference-mode ``_EqxInference`` module holding that state, which maps one
    example to its logits.
    """

    name = "jax"

    def __init__(self) -> None:
        import jax

        # float64 analysis copies need x64; training stays float32 (dtypes are explicit).
        jax.config.update("jax_enable_x64", True)
        import equinox as eqx
        import jax.numpy as jnp
        import optax

        self.jax, self.eqx, self.jnp, self.optax = jax, eqx, jnp, optax

    def set_threads(self, threads: int | None) -> None:
        pass  # XLA's CPU thread pool is fixed when JAX starts

    def inputs(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def labels(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.int32)

    def build(self, arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None,
              seed: int) -> Any:
        from normflat.study.models import ARCHITECTURES

        if arch not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
        eqx, jnp, jax = self.eqx, self.jnp, self.jax
        dt = jnp.float32
        keys = iter(jax.random.split(jax.random.key(seed), 16))
        channels, height, wide = input_shape
        relu = eqx.nn.Lambda(jax.nn.relu)
        layers: list[Any] = []
        if arch == "mlp":
            hidden = width or 128
            layers = [eqx.nn.Lambda(jnp.ravel),
                      eqx.nn.Linear(channels * height * wide, hidden, dtype=dt, key=next(keys)), relu,
                      eqx.nn.Linear(hidden, hidden, dtype=dt, key=next(keys)), relu,
                      eqx.nn.Linear(hidden, num_classes, dtype=dt, key=next(keys))]
        else:
            small = min(height, wide) < 16
            k = 3 if small else 5
            c1, c2 = (16, 32) if small else (6, 16)
            size, cin = (height, wide), channels
            for i, c in enumerate((c1, c2)):
                pad = k // 2 if (small or i == 0) else 0
                layers.append(eqx.nn.Conv2d(cin, c, k, padding=pad, dtype=dt, key=next(keys)))
                if arch == "cnn-bn":
                    layers.append(eqx.nn.BatchNorm(c, axis_name="batch", eps=1e-5, momentum=0.9, mode="ema", dtype=dt))
                layers += [relu, eqx.nn.MaxPool2d(2, stride=2)]
                size = tuple((s + 2 * pad - k + 1) // 2 for s in size)
                cin = c
            hidden = width or (128 if small else 120)
            layers += [eqx.nn.Lambda(jnp.ravel),
                       eqx.nn.Linear(cin * size[0] * size[1], hidden, dtype=dt, key=next(keys)), relu,
                       eqx.nn.Linear(hidden, num_classes, dtype=dt, key=next(keys))]
        net, state = eqx.nn.make_with_state(_eqx_net_class())(tuple(layers))
        return {"net": net, "state": state}

    def _inference(self, model: dict[str, Any]) -> Any:
        return _eqx_inference_class()(self.eqx.nn.inference_mode(model["net"]), model["state"])

    def train(self, model: dict[str, Any], x: np.ndarray, y: np.ndarray, *, epochs: int, lr: float, batch_size: int,
              weight_decay: float, optimizer: str, target_accuracy: float, seed: int, progress: bool,
              desc: str) -> TrainResult:
        from tqdm.auto import tqdm

        eqx, jax, jnp, optax = self.eqx, self.jax, self.jnp, self.optax
        if optimizer == "adam":
            opt = optax.adamw(lr, weight_decay=weight_decay)
        elif optimizer == "sgd":
            opt = optax.chain(optax.add_decayed_weights(weight_decay), optax.sgd(lr, momentum=0.9))
        else:
            raise ValueError(f"Unknown optimizer {optimizer!r}; choose 'adam' or 'sgd'.")
        net, state = model["net"], model["state"]
        opt_state = opt.init(eqx.filter(net, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(net, state, opt_state, xb, yb):
            def loss_fn(net, state):
                logits, state = jax.vmap(net, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(xb, state)
                return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), state

            (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(net, state)
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(net, eqx.is_inexact_array))
            return eqx.apply_updates(net, updates), state, opt_state, loss

        rng = np.random.default_rng(seed)
        n = len(y)
        bar = tqdm(total=epochs, desc=desc, unit="epoch", leave=False, disable=not progress)
        start = time.perf_counter()
        acc, loss_value, epoch = 0.0, float("nan"), 0
        for epoch in range(1, epochs + 1):
            perm = rng.permutation(n)
            total = 0.0
            for i in range(0, n, batch_size):
                idx = perm[i:i + batch_size]
                if len(idx) < 2 and n >= 2:
                    continue  # BatchNorm cannot train on a batch of one
                net, state, opt_state, loss = step(net, state, opt_state, jnp.asarray(x[idx]), jnp.asarray(y[idx]))
                total += float(loss) * len(idx)
            loss_value = total / n
            acc = self.accuracy({"net": net, "state": state}, x, y)
            bar.update(1)
            bar.set_postfix(acc=f"{acc:.3f}", loss=f"{loss_value:.3g}", refresh=False)
            if acc >= target_accuracy:
                break
        bar.close()
        model["net"], model["state"] = net, state
        return TrainResult(epoch, acc, loss_value, acc >= target_accuracy, time.perf_counter() - start)

    def _logits(self, model: Any, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        inf = model if not isinstance(model, dict) else self._inference(model)
        fn = _jitted_vmap(self.eqx, self.jax)
        parts = [np.asarray(fn(inf, self.jnp.asarray(x[i:i + batch_size]))) for i in range(0, len(x), batch_size)]
        return np.concatenate(parts)

    def accuracy(self, model: Any, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self._logits(model, x).argmax(1) == y)) if len(y) else 0.0

    def float64(self, model: dict[str, Any]) -> Any:
        jnp = self.jnp

        def cast(a):
            return a.astype(jnp.float64) if self.eqx.is_inexact_array(a) else a

        inf = self._inference(model)
        return self.jax.tree_util.tree_map(cast, inf)

    def analysis_data(self, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[Any, dict[str, Any]]:
        jnp = self.jnp
        batches = [(jnp.asarray(x[i:i + batch_size], dtype=jnp.float64), jnp.asarray(y[i:i + batch_size]))
                   for i in range(0, len(y), batch_size)]
        return batches, {}

    def check_inputs(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float64)

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        """A rescaled copy of a float64 inference model (same symmetries as the torch rescaler)."""
        eqx, jnp = self.eqx, self.jnp
        if orders < 0:
            raise ValueError(f"orders must be >= 0, got {orders}.")
        rng = np.random.default_rng(seed)
        layers = list(model.net.layers)
        # State.set invalidates the State it is called on: work on a clone so the
        # original model stays usable.
        leaves, treedef = self.jax.tree_util.tree_flatten(model.state)
        state = self.jax.tree_util.tree_unflatten(treedef, leaves)
        names = [type(layer).__name__ for layer in layers]
        is_relu = [isinstance(layer, eqx.nn.Lambda) and layer.fn is self.jax.nn.relu for layer in layers]
        widx = [i for i, n in enumerate(names) if n in ("Linear", "Conv2d")]
        drawn = []
        for i, j in zip(widx[:-1], widx[1:]):
            between = list(range(i + 1, j))
            out = layers[i].weight.shape[0]
            if between and names[between[0]] == "BatchNorm":
                kind = "bn"
            elif any(is_relu[b] for b in between) and all(
                    is_relu[b] or names[b] == "MaxPool2d" or (names[b] == "Lambda" and layers[b].fn is jnp.ravel)
                    for b in between):
                kind = "relu"
            else:
                continue
            c = 10.0 ** rng.uniform(-orders, orders, size=out)
            drawn.append(c)
            cj = jnp.asarray(c, dtype=layers[i].weight.dtype)
            shape = (-1,) + (1,) * (layers[i].weight.ndim - 1)
            lay = eqx.tree_at(lambda l: l.weight, layers[i], layers[i].weight * cj.reshape(shape))
            if lay.bias is not None:
                lay = eqx.tree_at(lambda l: l.bias, lay, lay.bias * cj.reshape((-1,) + (1,) * (lay.bias.ndim - 1)))
            layers[i] = lay
            if kind == "bn":
                bn = layers[i + 1]
                mean, var = state.get(bn.ema_state_index)
                eps = bn.eps
                layers[i + 1] = eqx.tree_at(lambda l: l.weight, bn,
                                            bn.weight * jnp.sqrt(cj * cj * var + eps) / (cj * jnp.sqrt(var + eps)))
                state = state.set(bn.ema_state_index, (mean * cj, var * cj * cj))
            else:
                nxt = layers[j]
                reps = nxt.weight.shape[1] // out  # a ravel between conv and linear: channel-major blocks
                layers[j] = eqx.tree_at(lambda l: l.weight, nxt,
                                        nxt.weight / jnp.repeat(cj, reps).reshape((1, -1) + (1,) * (nxt.weight.ndim - 2)))
        if not drawn:
            raise ValueError("This model has no weight layer that can be rescaled without changing its function.")
        new_net = eqx.tree_at(lambda n: n.layers, model.net, tuple(layers))
        allf = np.concatenate(drawn)
        return type(model)(new_net, state), float(np.log10(allf.max() / allf.min()))

    def function_error(self, a: Any, b: Any, x: np.ndarray) -> float:
        from normflat.study.reparametrize import FunctionChangedError

        la, lb = self._logits(a, x), self._logits(b, x)
        err = float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30))
        if not err <= 1e-9:
            raise FunctionChangedError(
                f"The rescaled JAX model's logits differ from the original's by {err:.3g} (relative, "
                "tolerance 1e-09). The rescaling is not function-preserving for this model."
            )
        return err

    def version(self) -> str:
        return f"jax {self.jax.__version__}, equinox {self.eqx.__version__}"


_EQX_CLASSES: dict[str, Any] = {}


def _eqx_net_class() -> Any:
    """The equinox module classes are defined on first use: equinox is imported lazily."""
    if "net" not in _EQX_CLASSES:
        import equinox as eqx

        class _EqxNet(eqx.Module):
            layers: tuple

            def __call__(self, x, state):
                for layer in self.layers:
                    if isinstance(layer, eqx.nn.BatchNorm):
                        x, state = layer(x, state)
                    else:
                        x = layer(x)
                return x, state

        class _EqxInference(eqx.Module):
            """Inference-mode network with its BatchNorm state: one example -> logits."""

            net: Any
            state: Any

            def __call__(self, x):
                return self.net(x, self.state)[0]

        _EQX_CLASSES["net"], _EQX_CLASSES["inference"] = _EqxNet, _EqxInference
    return _EQX_CLASSES["net"]


def _eqx_inference_class() -> Any:
    _eqx_net_class()
    return _EQX_CLASSES["inference"]


def _jitted_vmap(eqx: Any, jax: Any) -> Any:
    if "vmap" not in _EQX_CLASSES:
        _EQX_CLASSES["vmap"] = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
    return _EQX_CLASSES["vmap"]
