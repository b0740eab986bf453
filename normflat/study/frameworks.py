"""Per-framework pieces of the study: build, train, evaluate, copy for analysis, rescale.

Every adapter offers the same operations on the same three architectures
(:data:`normflat.study.models.ARCHITECTURES`) and on models from a ``--model``
factory (:meth:`build_user`), so :func:`normflat.study.run_study` runs unchanged
with ``framework="torch"`` (default), ``"keras"`` or ``"jax"`` (equinox models,
optax training). Arrays come in as the dataset's numpy arrays (NCHW float32
images for the built-in datasets; whatever the user's data hold otherwise) and
int64 labels; each adapter converts them once with :meth:`inputs`. Only the
built-in architectures get their images in another layout (NHWC for Keras): a
user model sees its inputs as they are.

Each adapter is created for one device (``"auto"``, ``"cpu"`` or ``"cuda"``) and
one training precision (``"float32"`` or ``"mixed"``); :meth:`placement` is the
context every framework operation of a study runs in.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import numpy as np

from normflat.study.datasets import StudyInputError
from normflat.study.training import TrainResult

__all__ = ["FRAMEWORKS", "DEVICES", "PRECISIONS", "ANALYSIS_DTYPES", "FUNCTION_RTOL", "adapter", "TorchAdapter",
           "KerasAdapter", "JaxAdapter"]

#: Frameworks the study can train in (``jax`` means equinox models trained with optax).
FRAMEWORKS = ("torch", "keras", "jax")
#: ``--device`` values: the framework's choice (CUDA when present), the CPU, or CUDA.
DEVICES = ("auto", "cpu", "cuda")
#: ``--precision`` values (training only; the analysis runs in ``--analysis-dtype``).
PRECISIONS = ("float32", "mixed")
#: ``--analysis-dtype`` values.
ANALYSIS_DTYPES = ("float64", "float32")
#: Largest relative change of the logits a function-preserving rescaling may make,
#: per analysis dtype: rounding only (float64 ~1e-16, float32 ~1e-7, times depth).
FUNCTION_RTOL = {"float64": 1e-9, "float32": 1e-4}


def adapter(name: str, *, device: str = "auto", precision: str = "float32") -> Any:
    """The adapter of framework ``name``.

    Args:
        name: One of :data:`FRAMEWORKS`.
        device: One of :data:`DEVICES`.
        precision: One of :data:`PRECISIONS`.

    Raises:
        ValueError: For an unsupported framework, device or precision, or
            ``device="cuda"`` where the framework finds no CUDA device.
        ImportError: If the framework is not installed.
    """
    if device not in DEVICES:
        raise ValueError(f"Unknown device {device!r}; choose one of {', '.join(DEVICES)}.")
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}.")
    if name == "torch":
        return TorchAdapter(device=device, precision=precision)
    if name == "keras":
        return KerasAdapter(device=device, precision=precision)
    if name == "jax":
        return JaxAdapter(device=device, precision=precision)
    raise ValueError(
        f"The study trains models in {', '.join(FRAMEWORKS)}; --framework {name!r} is not supported "
        f"yet. Use --framework {' or '.join(FRAMEWORKS)}, or analyze your own models with "
        "normflat.analyze()."
    )


def _no_cuda(framework: str, detail: str, build: str | None = None) -> StudyInputError:
    return StudyInputError(f"--device cuda: {framework} finds no CUDA device ({detail}). Run on a machine with a GPU "
                           f"and a CUDA build of {build or framework}, or use --device cpu (or auto, which falls back "
                           "to the CPU).")


def _probe_error(label: str, framework: str, what: str) -> StudyInputError:
    return StudyInputError(f"The model factory {label} {what}; with --framework {framework} it must return a fresh "
                           "model mapping a batch of inputs to logits of shape (n, num_classes).")


class TorchAdapter:
    """PyTorch: ``nn.Sequential`` or user models, AdamW/SGD training, float64 analysis copies.

    Args:
        device: ``"auto"`` (CUDA when torch finds it, else the CPU), ``"cpu"`` or
            ``"cuda"``: models and data live there.
        precision: ``"float32"`` or ``"mixed"`` (autocast during training).
    """

    name = "torch"

    def __init__(self, *, device: str = "auto", precision: str = "float32") -> None:
        import torch

        self.torch = torch
        self.precision = precision
        if device == "cuda" and not torch.cuda.is_available():
            raise _no_cuda("torch", f"torch {torch.__version__}, torch.cuda.is_available() is False")
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if use_cuda else "cpu")

    def set_threads(self, threads: int | None) -> None:
        if threads is not None:
            self.torch.set_num_threads(threads)

    def placement(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # torch places explicitly: models and tensors are moved to self.device

    def device_description(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({self.torch.cuda.get_device_name(self.device)})"
        return str(self.device)

    def inputs(self, x: np.ndarray, *, images: bool = True) -> Any:
        """``x`` as a tensor on the device (``images`` changes nothing: torch models take NCHW)."""
        t = self.torch.as_tensor(x)
        if t.is_floating_point() and t.dtype != self.torch.float32:
            t = t.float()  # the models train in float32 (the analysis copy gets its own dtype)
        return t.to(self.device)

    def labels(self, y: np.ndarray) -> Any:
        return self.torch.as_tensor(y).to(self.device)

    def build(self, arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None, seed: int) -> Any:
        from normflat.study.models import build_model

        return build_model(arch, input_shape, num_classes, width=width, seed=seed).to(self.device)

    def build_user(self, factory: Callable[..., Any], input_shape: tuple[int, ...], num_classes: int, *,
                   width: int | None, seed: int, probe: Any) -> Any:
        """A model from a ``--model`` factory, checked on ``probe`` inputs and moved to the device.

        The check runs a deep copy in eval mode, so the model's BatchNorm
        statistics are not touched by it.

        Raises:
            ValueError: If the factory does not return a ``torch.nn.Module`` whose
                output on ``probe`` has shape ``(len(probe), num_classes)``.
        """
        import copy

        from normflat.study.models import call_model_factory, callable_label

        torch, label = self.torch, callable_label(factory)
        model = call_model_factory(factory, input_shape=input_shape, num_classes=num_classes, width=width, seed=seed)
        if not isinstance(model, torch.nn.Module):
            raise _probe_error(label, "torch", f"returned a {type(model).__module__}.{type(model).__name__}, not a "
                                               "torch.nn.Module")
        model = model.to(self.device)
        if not any(p.requires_grad for p in model.parameters()):
            raise _probe_error(label, "torch", "returned a module without trainable parameters")
        check = copy.deepcopy(model).eval()
        try:
            with torch.no_grad():
                out = check(probe.to(self.device))
        except Exception as err:
            raise _probe_error(label, "torch", f"returned a module that fails on inputs of shape "
                                               f"{tuple(probe.shape)} ({type(err).__name__}: "
                                               f"{' '.join(str(err).split())[:200]})") from err
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(probe), num_classes):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise _probe_error(label, "torch", f"returned a module whose output on {len(probe)} examples is {shape}, "
                                               f"not ({len(probe)}, {num_classes})")
        return model.train()

    def train(self, model: Any, x: Any, y: Any, **kwargs: Any) -> TrainResult:
        from normflat.study.training import train_model

        return train_model(model, x, y, precision=self.precision, **kwargs)

    def accuracy(self, model: Any, x: Any, y: Any) -> float:
        from normflat.study.training import accuracy

        return accuracy(model, x, y)

    def evaluation_model(self, model: Any) -> Any:
        return model  # the weights are float32 even with --precision mixed (autocast is training-only)

    def analysis_copy(self, model: Any, dtype: str = "float64") -> Any:
        """A deep copy in ``dtype``, eval mode (the trained model is left as it is)."""
        import copy

        return copy.deepcopy(model).to(getattr(self.torch, dtype)).eval()

    def float64(self, model: Any) -> Any:
        return self.analysis_copy(model, "float64")

    def _cast(self, x: Any, dtype: str) -> Any:
        # Integer inputs (token ids, indices) stay integers: only real-valued inputs take the dtype.
        return x.to(getattr(self.torch, dtype)) if x.is_floating_point() else x

    def analysis_data(self, x: Any, y: Any, batch_size: int, dtype: str = "float64") -> tuple[Any, dict[str, Any]]:
        # Slices of tensors already on the device, in order: what an unshuffled DataLoader yields.
        x = self._cast(x, dtype)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size)], {}

    def check_inputs(self, x: Any, dtype: str = "float64") -> Any:
        return self._cast(x, dtype)

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        from normflat.study.reparametrize import apply_rescaling, random_rescaling

        rescaling = random_rescaling(model, orders=orders, seed=seed)
        return apply_rescaling(model, rescaling), rescaling.spread

    def function_error(self, a: Any, b: Any, x: Any, rtol: float = 1e-9) -> float:
        from normflat.study.reparametrize import check_same_function

        return check_same_function(a, b, x, rtol=rtol)

    def version(self) -> str:
        return self.torch.__version__


class KerasAdapter:
    """Keras 3: ``keras.Sequential`` models mirroring the torch ones (NHWC images), or user models.

    Args:
        device: ``"auto"`` (Keras' own placement), ``"cpu"`` or ``"cuda"``
            (everything runs under ``keras.device``).
        precision: ``"float32"`` or ``"mixed"``: the built-in architectures get the
            per-layer dtype policy ``"mixed_bfloat16"`` (bfloat16 compute, float32
            weights; the output layer computes in float32). No global policy is set.
    """

    name = "keras"

    def __init__(self, *, device: str = "auto", precision: str = "float32") -> None:
        import os

        # TensorFlow's C++ log (grappler notes on float64 graphs) would drown the table.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras

        self.keras = keras
        self.precision = precision
        self.device = device
        if device == "cuda" and not keras.distribution.list_devices("gpu"):
            backend = keras.backend.backend()
            raise _no_cuda("Keras", f"backend {backend}, devices {keras.distribution.list_devices()}",
                           build=f"Keras' backend ({backend})")

    def set_threads(self, threads: int | None) -> None:
        pass  # the TensorFlow thread pools are fixed once TF starts

    def placement(self) -> contextlib.AbstractContextManager:
        if self.device == "auto":
            return contextlib.nullcontext()  # Keras places on its own (a GPU when it has one)
        return self.keras.device("gpu:0" if self.device == "cuda" else "cpu:0")

    def device_description(self) -> str:
        names = self.keras.distribution.list_devices()
        return {"auto": f"auto (Keras placement; devices {', '.join(names)})", "cpu": "cpu:0",
                "cuda": "gpu:0"}[self.device]

    def inputs(self, x: np.ndarray, *, images: bool = True) -> np.ndarray:
        """``images``: NCHW images for a built-in architecture, transposed to NHWC; else as they are."""
        x = np.asarray(x)
        if x.dtype.kind == "f" and x.dtype != np.float32:
            x = x.astype(np.float32)
        if not images:
            return x
        return np.ascontiguousarray(np.transpose(x, (0, 2, 3, 1)))  # NCHW -> NHWC

    def labels(self, y: np.ndarray) -> np.ndarray:
        return np.asarray(y, dtype=np.int64)

    def build(self, arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None,
              seed: int, dtype: str | None = None) -> Any:
        from normflat.study.models import ARCHITECTURES

        keras = self.keras
        L = keras.layers
        if arch not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
        if dtype is None:
            dtype = "mixed_bfloat16" if self.precision == "mixed" else "float32"
        keras.utils.set_random_seed(seed)
        channels, height, wide = input_shape
        # A mixed policy computes in bfloat16 and keeps float32 weights; inputs stay float32.
        mixed = dtype.startswith("mixed")
        layers: list[Any] = [keras.Input((height, wide, channels), dtype="float32" if mixed else dtype)]
        kw = {"dtype": dtype}
        # The output layer computes in float32 under a mixed policy: logits and loss keep float32's range.
        out_kw = {"dtype": "float32" if mixed else dtype}
        if arch == "mlp":
            hidden = width or 128
            layers += [L.Flatten(**kw), L.Dense(hidden, **kw), L.ReLU(**kw), L.Dense(hidden, **kw), L.ReLU(**kw),
                       L.Dense(num_classes, **out_kw)]
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
            layers += [L.Flatten(**kw), L.Dense(hidden, **kw), L.ReLU(**kw), L.Dense(num_classes, **out_kw)]
        return keras.Sequential(layers)

    def build_user(self, factory: Callable[..., Any], input_shape: tuple[int, ...], num_classes: int, *,
                   width: int | None, seed: int, probe: np.ndarray) -> Any:
        """A ``keras.Model`` from a ``--model`` factory, checked on ``probe`` inputs (inference mode).

        Raises:
            ValueError: If the factory does not return a built ``keras.Model`` whose
                output on ``probe`` has shape ``(len(probe), num_classes)``, or with
                ``--precision mixed`` (a user model brings its own dtype policy).
        """
        from normflat.study.models import call_model_factory, callable_label

        keras, label = self.keras, callable_label(factory)
        if self.precision == "mixed":
            raise StudyInputError("--precision mixed with --framework keras applies to the built-in architectures; a "
                                  "--model factory sets its own precision: build its layers with "
                                  "dtype='mixed_bfloat16' (never a global policy) and keep --precision float32.")
        model = call_model_factory(factory, input_shape=input_shape, num_classes=num_classes, width=width, seed=seed)
        if not isinstance(model, keras.Model):
            raise _probe_error(label, "keras", f"returned a {type(model).__module__}.{type(model).__name__}, not a "
                                               "keras.Model")
        try:
            out = np.asarray(model(probe, training=False))
        except Exception as err:
            raise _probe_error(label, "keras", f"returned a model that fails on inputs of shape {probe.shape} "
                                               f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from err
        if out.shape != (len(probe), num_classes):
            raise _probe_error(label, "keras", f"returned a model whose output on {len(probe)} examples has shape "
                                               f"{out.shape}, not ({len(probe)}, {num_classes})")
        return model

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

    def evaluation_model(self, model: Any) -> Any:
        """The model whose accuracies the study reports: under ``--precision mixed`` a
        float32 copy (the trained model computes in bfloat16; mixed precision is for
        training only)."""
        return self.analysis_copy(model, "float32") if self.precision == "mixed" else model

    def analysis_copy(self, model: Any, dtype: str = "float64") -> Any:
        """The same model in ``dtype`` (weights cast; the model itself is left as it is).

        Raises:
            StudyInputError: For a model Keras cannot clone (a subclassed model).
        """
        keras = self.keras

        def recast(layer: Any) -> Any:
            if not isinstance(layer, keras.layers.Layer):
                return layer  # a bare operation of the graph (x + y): no weights, no dtype of its own
            return type(layer).from_config({**layer.get_config(), "dtype": dtype})

        if isinstance(model, keras.Sequential):
            # Rebuild the same architecture in dtype and copy the (cast) weights over.
            clone = keras.Sequential([keras.Input(model.input_shape[1:], dtype=self._input_dtype(model, dtype))]
                                     + [recast(layer) for layer in model.layers])
        else:
            try:
                inputs = [keras.Input(t.shape[1:], dtype=self._input_dtype(t, dtype)) for t in model.inputs]
                clone = keras.models.clone_model(model, clone_function=recast,
                                                 input_tensors=inputs if len(inputs) > 1 else inputs[0])
            except Exception as err:
                raise StudyInputError(
                    f"Cannot copy the Keras model {model.name!r} ({type(model).__name__}) to {dtype} for the analysis "
                    f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); build it with keras.Sequential or "
                    "the functional API (keras.Model(inputs, outputs)) in the --model factory."
                ) from err
        clone.set_weights([np.asarray(w, dtype=dtype) if np.asarray(w).dtype.kind == "f" else np.asarray(w)
                           for w in model.get_weights()])
        return clone

    @staticmethod
    def _input_dtype(model_or_tensor: Any, dtype: str) -> str:
        # Integer inputs (token ids) keep their dtype; real-valued ones take the analysis dtype.
        inputs = getattr(model_or_tensor, "inputs", None) or [model_or_tensor]
        current = str(getattr(inputs[0], "dtype", "float32"))
        return current if ("int" in current or "bool" in current) else dtype

    def float64(self, model: Any) -> Any:
        return self.analysis_copy(model, "float64")

    def analysis_data(self, x: np.ndarray, y: np.ndarray, batch_size: int,
                      dtype: str = "float64") -> tuple[Any, dict[str, Any]]:
        # A list of (x, y) batches, as for the other frameworks: the Keras backend takes a
        # single (x, y) pair as one batch (its batch_size option is deprecated).
        x = self.check_inputs(x, dtype)
        return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size)], {}

    def check_inputs(self, x: np.ndarray, dtype: str = "float64") -> np.ndarray:
        return x.astype(dtype) if x.dtype.kind == "f" else x

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        """A rescaled float64 copy: the same symmetries as :mod:`normflat.study.reparametrize`."""
        if orders < 0:
            raise ValueError(f"orders must be >= 0, got {orders}.")
        if not isinstance(model, self.keras.Sequential):
            raise TypeError(f"The Keras rescaler handles keras.Sequential models (Dense, Conv2D, BatchNormalization, "
                            f"ReLU, MaxPooling2D, Flatten); {model.name!r} is a {type(model).__name__}.")
        rng = np.random.default_rng(seed)
        layers = model.layers
        weights = {id(layer): [np.array(w, dtype=np.float64) for w in layer.get_weights()] for layer in layers}
        widx = [i for i, layer in enumerate(layers) if type(layer).__name__ in ("Dense", "Conv2D")]
        drawn = []
        for i, j in zip(widx[:-1], widx[1:]):
            between = [type(layer).__name__ for layer in layers[i + 1:j]]
            kernel, *bias = weights[id(layers[i])]
            c = 10.0 ** rng.uniform(-orders, orders, size=kernel.shape[-1])
            activation = getattr(getattr(layers[i], "activation", None), "__name__", "linear")
            if activation not in ("linear", "relu"):
                continue  # only a positively homogeneous activation commutes with the factors
            if between and between[0] == "BatchNormalization":
                if len(weights[id(layers[i + 1])]) != 4:
                    continue  # without its scale (gamma) the BatchNorm cannot absorb the factors exactly
                kind = "bn"
            elif ("ReLU" in between or activation == "relu") and all(
                    n in ("ReLU", "MaxPooling2D", "Flatten") for n in between):
                kind = "relu"
            else:
                continue
            drawn.append(c)
            kernel *= c  # output units are the last kernel axis in Keras
            for b in bias:
                b *= c
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
        # The factors are applied in float64 and the copy keeps the model's dtype (the analysis dtype).
        dtype = str(np.asarray(model.get_weights()[0]).dtype)
        new = self.analysis_copy(model, dtype)
        for layer, new_layer in zip(layers, new.layers):
            if weights[id(layer)]:
                new_layer.set_weights([w.astype(dtype) for w in weights[id(layer)]])
        allf = np.concatenate(drawn)
        return new, float(np.log10(allf.max() / allf.min()))

    def function_error(self, a: Any, b: Any, x: np.ndarray, rtol: float = 1e-9) -> float:
        from normflat.study.reparametrize import FunctionChangedError

        la, lb = self._logits(a, x), self._logits(b, x)
        err = float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30))
        if not err <= rtol:
            raise FunctionChangedError(
                f"The rescaled Keras model's logits differ from the original's by {err:.3g} (relative, "
                f"tolerance {rtol:g}). The rescaling is not function-preserving for this model."
            )
        return err

    def version(self) -> str:
        return self.keras.__version__


class JaxAdapter:
    """JAX: equinox models mirroring the torch ones (per-example NCHW), trained with optax.

    Models are ``{"net": net, "state": state}`` dicts: ``net(x, state)`` maps one
    example to ``(logits, state)``, and BatchNorm layers keep their running
    statistics in the ``eqx.nn.State`` (mode ``"ema"``). The built-in nets are
    ``_EqxNet`` modules; a ``--model`` factory's ``(module, state)`` pair is used as
    it is and a stateless module is wrapped (``_EqxStateless``). What is analyzed
    is an inference-mode ``_EqxInference`` module holding the state, which maps one
    example to its logits.

    Args:
        device: ``"auto"`` (JAX's default device), ``"cpu"`` or ``"cuda"`` (run
            under ``jax.default_device``).
        precision: ``"float32"`` only: mixed precision is not implemented for JAX.
    """

    name = "jax"

    def __init__(self, *, device: str = "auto", precision: str = "float32") -> None:
        if precision != "float32":
            raise StudyInputError("--precision mixed is implemented for torch (autocast) and Keras' built-in "
                                  "architectures (dtype policy mixed_bfloat16); JAX trains in float32: drop "
                                  "--precision mixed or use --framework torch.")
        import jax

        # float64 analysis copies need x64; training stays float32 (dtypes are explicit).
        jax.config.update("jax_enable_x64", True)
        import equinox as eqx
        import jax.numpy as jnp
        import optax

        self.jax, self.eqx, self.jnp, self.optax = jax, eqx, jnp, optax
        self.precision = precision
        self.device = device
        self._device = None
        if device != "auto":
            platform = "gpu" if device == "cuda" else "cpu"
            try:
                self._device = jax.devices(platform)[0]
            except RuntimeError as err:
                raise _no_cuda("JAX", f"jax {jax.__version__}, devices {jax.devices()}") from err

    def set_threads(self, threads: int | None) -> None:
        pass  # XLA's CPU thread pool is fixed when JAX starts

    def placement(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._device is None else self.jax.default_device(self._device)

    def device_description(self) -> str:
        return str(self._device if self._device is not None else self.jax.devices()[0])

    def inputs(self, x: np.ndarray, *, images: bool = True) -> np.ndarray:
        """``x`` for training (``images`` changes nothing: the equinox models take NCHW examples)."""
        x = np.asarray(x)
        return x.astype(np.float32) if x.dtype.kind == "f" else x  # integer inputs (token ids) stay integers

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

    def build_user(self, factory: Callable[..., Any], input_shape: tuple[int, ...], num_classes: int, *,
                   width: int | None, seed: int, probe: np.ndarray) -> dict[str, Any]:
        """A model from a ``--model`` factory: an equinox module mapping one example to
        logits, or a ``(module, state)`` pair of ``eqx.nn.make_with_state`` whose
        ``module(x, state)`` returns ``(logits, state)``; checked on ``probe``.

        Raises:
            ValueError: If the factory returns something else, or the logits of
                ``probe`` do not have shape ``(len(probe), num_classes)``.
        """
        from normflat.study.models import call_model_factory, callable_label

        eqx, jax, label = self.eqx, self.jax, callable_label(factory)
        out = call_model_factory(factory, input_shape=input_shape, num_classes=num_classes, width=width, seed=seed)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State):
            net, state = out
        elif isinstance(out, eqx.Module):
            net, state = _eqx_stateless_class()(out), None
        else:
            raise _probe_error(label, "jax", f"returned a {type(out).__module__}.{type(out).__name__}, not an "
                                             "equinox module (or a (module, state) pair from "
                                             "eqx.nn.make_with_state)")
        if not isinstance(net, eqx.Module):
            raise _probe_error(label, "jax", f"returned a pair whose first item is a {type(net).__name__}, not an "
                                             "equinox module")
        model = {"net": net, "state": state, "axis_name": self._batch_axis_name(net)}
        try:
            logits = self._logits(model, probe)
        except Exception as err:
            raise _probe_error(label, "jax", f"returned a module that fails on one example of shape "
                                             f"{probe.shape[1:]} ({type(err).__name__}: "
                                             f"{' '.join(str(err).split())[:200]}); it must map ONE example (no "
                                             "batch axis) to its logits") from err
        if logits.shape != (len(probe), num_classes):
            raise _probe_error(label, "jax", f"returned a module whose logits for {len(probe)} examples (vmapped) "
                                             f"have shape {logits.shape}, not ({len(probe)}, {num_classes}); it "
                                             "must map ONE example to a vector of num_classes logits")
        return model

    def _batch_axis_name(self, net: Any) -> Any:
        """The vmap axis name the BatchNorm layers of ``net`` average over (``"batch"`` without any)."""
        eqx = self.eqx
        norms = [leaf for leaf in self.jax.tree_util.tree_leaves(net, is_leaf=lambda m: isinstance(m, eqx.nn.BatchNorm))
                 if isinstance(leaf, eqx.nn.BatchNorm)]
        names = {bn.axis_name if isinstance(bn.axis_name, str) else tuple(bn.axis_name) for bn in norms}
        if len(names) > 1:
            raise StudyInputError(f"The BatchNorm layers of the model use different axis names "
                                  f"{sorted(map(str, names))}; give them all the same axis_name (e.g. 'batch').")
        return names.pop() if names else "batch"

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

        axis_name = model.get("axis_name", "batch")

        @eqx.filter_jit
        def step(net, state, opt_state, xb, yb):
            def loss_fn(net, state):
                logits, state = jax.vmap(net, axis_name=axis_name, in_axes=(0, None), out_axes=(0, None))(xb, state)
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

    def evaluation_model(self, model: Any) -> Any:
        return model  # JAX trains in float32

    def analysis_copy(self, model: dict[str, Any], dtype: str = "float64") -> Any:
        """The inference-mode model with every real-valued array (weights, state) cast to ``dtype``."""
        target = getattr(self.jnp, dtype)

        def cast(a):
            return a.astype(target) if self.eqx.is_inexact_array(a) else a

        return self.jax.tree_util.tree_map(cast, self._inference(model))

    def float64(self, model: dict[str, Any]) -> Any:
        return self.analysis_copy(model, "float64")

    def analysis_data(self, x: np.ndarray, y: np.ndarray, batch_size: int,
                      dtype: str = "float64") -> tuple[Any, dict[str, Any]]:
        jnp = self.jnp
        x = self.check_inputs(x, dtype)
        batches = [(jnp.asarray(x[i:i + batch_size]), jnp.asarray(y[i:i + batch_size]))
                   for i in range(0, len(y), batch_size)]
        return batches, {}

    def check_inputs(self, x: np.ndarray, dtype: str = "float64") -> np.ndarray:
        return x.astype(dtype) if x.dtype.kind == "f" else x

    def rescale(self, model: Any, *, orders: float, seed: int) -> tuple[Any, float]:
        """A rescaled copy of a float64 inference model (same symmetries as the torch rescaler).

        The network must apply a sequence of layers in order: a built-in ``_EqxNet``
        or an ``eqx.nn.Sequential`` of a ``--model`` factory.

        Raises:
            TypeError: For any other network.
            ValueError: If no layer can be rescaled.
        """
        eqx, jnp = self.eqx, self.jnp
        if orders < 0:
            raise ValueError(f"orders must be >= 0, got {orders}.")
        rng = np.random.default_rng(seed)
        where = self._layers_of(model.net)
        layers = list(where(model.net))
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
        new_net = eqx.tree_at(where, model.net, tuple(layers))
        allf = np.concatenate(drawn)
        return type(model)(new_net, state), float(np.log10(allf.max() / allf.min()))

    def _layers_of(self, net: Any) -> Callable[[Any], Any]:
        """Where the layer sequence of ``net`` is (for ``eqx.tree_at``)."""
        eqx = self.eqx
        if isinstance(net, _eqx_net_class()) or isinstance(net, eqx.nn.Sequential):
            return lambda n: n.layers
        if isinstance(net, _eqx_stateless_class()) and isinstance(net.module, eqx.nn.Sequential):
            return lambda n: n.module.layers
        inner = net.module if isinstance(net, _eqx_stateless_class()) else net
        raise TypeError(f"The JAX rescaler handles eqx.nn.Sequential models (Linear, Conv2d, BatchNorm, "
                        f"Lambda(jax.nn.relu), MaxPool2d, Lambda(jnp.ravel)); the model is a {type(inner).__name__}.")

    def function_error(self, a: Any, b: Any, x: np.ndarray, rtol: float = 1e-9) -> float:
        from normflat.study.reparametrize import FunctionChangedError

        la, lb = self._logits(a, x), self._logits(b, x)
        err = float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30))
        if not err <= rtol:
            raise FunctionChangedError(
                f"The rescaled JAX model's logits differ from the original's by {err:.3g} (relative, "
                f"tolerance {rtol:g}). The rescaling is not function-preserving for this model."
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


def _eqx_stateless_class() -> Any:
    """The wrapper giving a stateless user module the ``net(x, state) -> (logits, state)`` call."""
    if "stateless" not in _EQX_CLASSES:
        import equinox as eqx

        class _EqxStateless(eqx.Module):
            """A user module without state: ``module(x)`` -> logits, called as ``(x, state)``."""

            module: Any

            def __call__(self, x, state):
                return self.module(x), state

        _EQX_CLASSES["stateless"] = _EqxStateless
    return _EQX_CLASSES["stateless"]


def _jitted_vmap(eqx: Any, jax: Any) -> Any:
    if "vmap" not in _EQX_CLASSES:
        _EQX_CLASSES["vmap"] = eqx.filter_jit(lambda model, x: jax.vmap(model)(x))
    return _EQX_CLASSES["vmap"]
