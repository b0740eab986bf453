"""Load the checkpoints and data people have, for ``normflat analyze`` and ``normflat compare``.

:func:`load_model` reads

* a torch ``state_dict`` (``.pt``/``.pth``/``.bin``, read with
  ``torch.load(weights_only=True)``) or a ``.safetensors`` file, with a
  ``factory`` (``"module:function"``) that builds the architecture;
* a Hugging Face model directory (``save_pretrained`` output), offline;
* a Keras ``.keras`` file;
* a whole pickled torch module (``torch.save(model)``), only with
  ``trust_pickle=True``: unpickling runs code from the file;
* an equinox checkpoint (``eqx.tree_serialise_leaves``; ``.eqx``) with a factory;
* a flax checkpoint (``.msgpack``) with a factory: the ``flax.serialization``
  msgpack of ``nnx.state(model)`` as a pure dict (:func:`save_flax_nnx` writes
  one), or of a linen module's variables when the factory returns
  ``(module, variables)``. msgpack is flax's own format and needs no other
  package (orbax is not required).

:func:`load_data` reads an ``.npz`` (arrays ``x`` and ``y``, or its only two
arrays), a folder with ``x.npy`` and ``y.npy``, or a ``"module:function"``
returning a loader, an iterable of batches or an ``(x, y)`` pair.

Every wrong combination raises :class:`CheckpointError` (a ``ValueError``) whose
one-line message names the cause and the fix. :func:`check_fits` runs one
forward pass on two examples, so data the model cannot take is a clear error
before a long analysis; :func:`predict` and :func:`accuracy` run the forward
pass of a model of any framework.

The command line (``normflat analyze`` and ``normflat compare``, in
:mod:`normflat.cli`) is a thin layer over these functions.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from normflat._callables import SpecMessages, import_callable, one_line

__all__ = [
    "CheckpointError", "load_model", "load_data", "resolve_factory", "save_flax_nnx", "predict", "accuracy",
    "framework_of", "check_fits", "analysis_data", "CHECKPOINT_SUFFIXES",
]

_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
#: The checkpoint file suffixes :func:`load_model` reads (a Hugging Face directory is one checkpoint too).
CHECKPOINT_SUFFIXES = (*_TORCH_SUFFIXES, ".ckpt", ".safetensors", ".keras", ".eqx", ".msgpack")
_SAVE_NPZ = "save the data with numpy.savez(path, x=inputs, y=labels)"


class CheckpointError(ValueError):
    """A checkpoint, factory or data specification that cannot be used; the message says how to fix it."""


#: The most characters of an exception's message that the messages quote.
_DETAIL_LIMIT = 240


def _one_line(err: BaseException) -> str:
    """``err``'s message on one line, shortened to :data:`_DETAIL_LIMIT` characters."""
    return one_line(err, _DETAIL_LIMIT)


# ============================================================================ factories


# The wording of resolve_factory's failures (see normflat._callables.SpecMessages for the fields).
_FACTORY_MESSAGES = SpecMessages(
    missing_file=("The factory file {module} does not exist; give 'file.py:function' with an existing file, or "
                  "'module:function' of an importable module."),
    unloadable_file=("Cannot import the factory file {module} as a Python module; give 'file.py:function' with a "
                     "Python source file, or 'module:function' of an importable module."),
    file_failed="Importing the factory file {module} failed ({error}); fix the file so that it imports.",
    missing_module=("Cannot import the factory module {module!r} ({error}); put {module}.py in the current directory "
                    "or on PYTHONPATH, or give a file: path/to/file.py:function."),
    missing_dependency=("Importing the factory module {module!r} failed: it needs a package that is missing "
                        "({error}); install it."),
    module_failed="Importing the factory module {module!r} failed ({error}); fix the module so that it imports.",
    missing_attribute=("The module {module!r} has no function {function!r}; its callables are {callables}. Give "
                       "--model {module}:NAME with one of them."),
    not_callable="{spec} is a {kind}, not a function; the factory must be callable.",
)


def resolve_factory(spec: str | Callable[[], Any]) -> Callable[[], Any]:
    """The callable named by ``"module:function"`` (or ``"path/to/file.py:function"``).

    The current directory is importable, as with ``python -m``, so
    ``--model mymodels:make_net`` finds ``./mymodels.py``.

    Raises:
        CheckpointError: If the module or the function is missing or not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise CheckpointError(
            f"The model factory {spec!r} must be 'module:function' (e.g. mymodels:make_net), a function "
            "that takes no arguments and returns the untrained architecture."
        )
    return import_callable(spec, error=CheckpointError, messages=_FACTORY_MESSAGES, detail_limit=_DETAIL_LIMIT)


def _build(factory: str | Callable[[], Any], path: str) -> Any:
    func = resolve_factory(factory)
    try:
        return func()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"The model factory {getattr(func, '__name__', func)!r} failed ({_one_line(err)}); "
                              f"it must build the architecture of {path} without arguments.") from err


# ============================================================================ models


def framework_of(model: Any) -> str:
    """``"torch"``, ``"keras"`` or ``"jax"``: the backend that analyzes ``model``.

    Raises:
        CheckpointError: For an object no backend recognises.
    """
    from normflat.backends import backend_for

    try:
        return backend_for(model)[0]
    except TypeError as err:
        raise CheckpointError(_one_line(err)) from err


def load_model(path: str | os.PathLike, *, factory: str | Callable[[], Any] | None = None,
               framework: str | None = None, trust_pickle: bool = False) -> Any:
    """Load a model checkpoint for analysis; returns the model (torch module, Keras model,
    equinox / flax nnx module, or a ``(linen module, variables)`` pair).

    A Hugging Face directory gives a :class:`~normflat.integrations.huggingface.HFLogits`
    view that takes ``input_ids`` and returns the logits.

    Args:
        path: The checkpoint file or directory.
        factory: ``"module:function"`` (or a callable) building the architecture,
            for weight-only checkpoints (state_dict, safetensors, equinox, flax).
        framework: ``"torch"``, ``"keras"``, ``"jax"`` (``"equinox"``, ``"flax"``):
            the framework the checkpoint must load as. The file's suffix and the
            factory decide how it is read; a model of another framework is an error.
        trust_pickle: Allow unpickling a whole torch module. Unpickling runs
            arbitrary code from the file, so normflat loads tensors only
            (``weights_only=True``) unless you say you trust the file.

    Raises:
        CheckpointError: For a missing or unreadable file, a wrong combination
            (e.g. a state_dict without a factory), or weights that do not fit the
            factory's architecture (naming the missing and unexpected keys).
    """
    if framework is not None and framework not in ("torch", "keras", "jax", "equinox", "flax"):
        raise CheckpointError(f"Unknown framework {framework!r}; use torch, keras, jax, equinox or flax.")
    model = _load(Path(path), factory, trust_pickle)
    if framework is not None:
        found = framework_of(model)
        if found != {"equinox": "jax", "flax": "jax"}.get(framework, framework):
            raise CheckpointError(f"{path} loaded as a {found} model, but --framework {framework} was given; drop "
                                  "--framework or pass the checkpoint of that framework.")
    return model


def _load(p: Path, factory: Any, trust_pickle: bool) -> Any:
    path = str(p)
    if not p.exists():
        raise CheckpointError(f"The checkpoint {path} does not exist; check the path.")
    if p.is_dir():
        return _load_directory(p, factory)
    suffix = p.suffix.lower()
    if suffix == ".keras":
        if factory is not None:
            raise CheckpointError(f"{path} is a .keras file, which holds its architecture; drop the model "
                                  "factory (--model).")
        return _load_keras(p)
    if suffix == ".safetensors":
        if factory is None:
            raise CheckpointError(f"{path} holds weights only; pass the architecture with --model module:function "
                                  "(a function returning the untrained model).")
        return _load_safetensors(p, factory)
    if suffix in _TORCH_SUFFIXES or suffix == ".ckpt":
        return _load_torch(p, factory, trust_pickle)
    if suffix == ".eqx":
        if factory is None:
            raise CheckpointError(f"{path} is an equinox checkpoint (leaves only); pass --model module:function "
                                  "returning a model of the same structure (eqx.tree_deserialise_leaves needs it).")
        return _load_equinox(p, factory)
    if suffix == ".msgpack":
        if factory is None:
            raise CheckpointError(f"{path} is a flax msgpack checkpoint; pass --model module:function returning the "
                                  "flax nnx module (or a (linen module, variables) pair) to load it into.")
        return _load_flax(p, factory)
    raise CheckpointError(
        f"Unknown checkpoint type {suffix or '(no suffix)'!r} of {path}; normflat reads .pt/.pth/.bin/.ckpt torch "
        "files (a state_dict with --model, or a whole module with --trust-pickle), .safetensors, .keras, .eqx "
        "(equinox), .msgpack (flax) files and Hugging Face directories: save the model in one of these formats "
        "(e.g. model.save('model.keras') or torch.save(model.state_dict(), 'weights.pt'))."
    )


def _load_directory(p: Path, factory: Any) -> Any:
    if (p / "config.json").is_file():
        if factory is not None:
            raise CheckpointError(f"{p} is a Hugging Face model directory, which holds its architecture "
                                  "(config.json); drop the model factory (--model).")
        return _load_hf(p)
    if (p / "saved_model.pb").is_file():
        raise CheckpointError(f"{p} is a TensorFlow SavedModel, which Keras 3 cannot load as a model to analyze; "
                              "save the model with model.save('model.keras') and pass that file.")
    raise CheckpointError(f"{p} is a folder but not a Hugging Face model directory (no config.json); pass a "
                          "model file (.pt, .safetensors, .keras, ...), or the folder written by "
                          "model.save_pretrained(folder).")


def _load_hf(p: Path) -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError("Loading a Hugging Face directory needs transformers: pip install transformers "
                              "(or normflat[huggingface]).") from None
    from normflat.integrations.huggingface import HFLogits

    errors = []
    for auto in (transformers.AutoModelForSequenceClassification, transformers.AutoModelForImageClassification,
                 transformers.AutoModel):
        try:
            model = auto.from_pretrained(str(p), local_files_only=True)
            break
        except Exception as err:  # the wrong head class for this config: try the next
            errors.append(_one_line(err))
    else:
        raise CheckpointError(f"Cannot load the Hugging Face directory {p} offline ({errors[0]}); it must hold "
                              "config.json and the weights written by save_pretrained.")
    model.eval()
    main_input = getattr(model, "main_input_name", "input_ids")
    return HFLogits(model, keys=(main_input,))


def _load_keras(p: Path) -> Any:
    # Keras says "File not found" for any file that is not a zip archive: check first.
    if not zipfile.is_zipfile(p):
        raise CheckpointError(f"{p} is not a valid .keras file (a .keras file is a zip archive written by "
                              "model.save('model.keras'); this one is truncated, corrupted or of another format).")
    try:
        import keras
    except ImportError:
        raise CheckpointError("Loading a .keras file needs Keras: pip install keras tensorflow.") from None
    try:
        return keras.saving.load_model(str(p), compile=False)
    except Exception as err:
        raise CheckpointError(f"Cannot load {p} as a Keras model ({_one_line(err)}); custom layers must be "
                              "importable and registered with keras.saving.register_keras_serializable.") from err


def _is_torchscript(p: Path) -> bool:
    if not zipfile.is_zipfile(p):
        return False
    with zipfile.ZipFile(p) as zf:
        return any(name.split("/", 1)[-1].startswith("code/") or name.endswith("/constants.pkl")
                   for name in zf.namelist())


def _load_torch(p: Path, factory: Any, trust_pickle: bool) -> Any:
    import torch

    if _is_torchscript(p):
        raise CheckpointError(f"{p} is a TorchScript archive; normflat analyzes eager modules (TorchScript bypasses "
                              "the hooks it needs). Save torch.save(model.state_dict(), path) and pass it with --model "
                              "module:function, or torch.save(model) and pass --trust-pickle.")
    if not _looks_like_torch_file(p):
        raise CheckpointError(
            f"Cannot load {p} as a torch checkpoint: it is neither a zip archive written by torch.save nor a "
            "legacy torch pickle (it is truncated, corrupted or of another format). Save the weights with "
            "torch.save(model.state_dict(), path) and pass --model module:function, or the whole module with "
            "torch.save(model, path) and pass --trust-pickle."
        )
    try:
        obj = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as err:
        if "weights only" not in str(err).lower() and "weights_only" not in str(err):
            raise CheckpointError(
                f"Cannot load {p} with torch.load ({_one_line(err)}); the file may be truncated or corrupted. "
                "Save it again with torch.save(model.state_dict(), path) (with --model module:function) or "
                "torch.save(model, path) (with --trust-pickle)."
            ) from err
        if factory is not None:
            raise CheckpointError(f"{p} is not a state_dict of tensors ({_one_line(err)}); with --model, save "
                                  "torch.save(model.state_dict(), path).") from err
        if not trust_pickle:
            raise CheckpointError(
                f"{p} holds pickled Python objects (a whole torch module?), and unpickling runs code from the "
                "file, so normflat does not do it by default: pass --trust-pickle (trust_pickle=True) if you trust "
                "the file, or save model.state_dict() and pass --model module:function."
            ) from err
        try:
            obj = torch.load(str(p), map_location="cpu", weights_only=False)
        except Exception as err2:
            raise CheckpointError(f"Cannot load {p} with torch.load ({_one_line(err2)}); the model's classes must "
                                  "be importable, or save model.state_dict() and pass --model.") from err2
        if not isinstance(obj, torch.nn.Module):
            raise CheckpointError(f"{p} holds a {type(obj).__name__}, not an nn.Module; save the module with "
                                  "torch.save(model, path) or a state_dict with --model module:function.")
        return obj.eval()
    if isinstance(obj, torch.nn.Module):  # only possible with a custom safe-globals list: accept it
        return obj.eval()
    state = _state_dict_of(obj, p)
    if factory is None:
        raise CheckpointError(f"{p} holds a state_dict (weights only, {len(state)} tensors); pass the architecture "
                              "with --model module:function (a function returning the untrained model).")
    return _into_torch_model(_build(factory, str(p)), state, p)


def _looks_like_torch_file(p: Path) -> bool:
    """A torch.save file: a zip archive (torch 1.6+) or a legacy pickle (protocol 2+ starts with 0x80)."""
    with open(p, "rb") as fh:
        head = fh.read(4)
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def _state_dict_of(obj: Any, p: Path) -> dict[str, Any]:
    import torch

    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]  # a Lightning .ckpt or a {"state_dict": ...} training checkpoint
    elif isinstance(obj, dict) and "model_state_dict" in obj and isinstance(obj["model_state_dict"], dict):
        obj = obj["model_state_dict"]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        what = type(obj).__name__ if not isinstance(obj, dict) else f"dict with keys {sorted(map(str, obj))[:6]}"
        raise CheckpointError(f"{p} holds a {what}, not a state_dict of tensors; save "
                              "torch.save(model.state_dict(), path).")
    return obj


def _into_torch_model(model: Any, state: dict[str, Any], p: Path) -> Any:
    import torch

    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"The model factory returned a {type(model).__name__}, but {p} holds torch weights; "
                              "the factory must return the torch nn.Module whose state_dict was saved.")
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        def show(keys: list[str]) -> str:
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
        parts = ([f"missing keys: {show(missing)}"] if missing else []) + (
            [f"unexpected keys: {show(unexpected)}"] if unexpected else [])
        hint = ""
        prefixes = {k.split(".", 1)[0] for k in unexpected}
        if len(prefixes) == 1 and all(k.split(".", 1)[-1] in expected for k in unexpected):
            hint = f" (the saved keys carry the prefix '{prefixes.pop()}.': build the wrapping module)"
        raise CheckpointError(f"The weights in {p} do not match the factory's architecture: {'; '.join(parts)}"
                              f"{hint}. Pass the factory that built the saved model.")
    bad = [k for k in expected if tuple(expected[k].shape) != tuple(state[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(f"The weights in {p} do not match the factory's architecture: {k} has shape "
                              f"{tuple(state[k].shape)} in the file but {tuple(expected[k].shape)} in the model"
                              f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}. Pass the factory that "
                              "built the saved model.")
    model.load_state_dict(state, strict=True)
    return model.eval()


def _load_safetensors(p: Path, factory: Any) -> Any:
    try:
        from safetensors import SafetensorError  # type: ignore[attr-defined]
    except ImportError:
        SafetensorError = Exception  # noqa: N806
    try:
        from safetensors.numpy import load_file as load_numpy
    except ImportError:
        raise CheckpointError("Loading a .safetensors file needs safetensors: pip install safetensors.") from None
    model = _build(factory, str(p))
    try:
        arrays = load_numpy(str(p))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"Cannot read {p} as a safetensors file ({_one_line(err)}); it may be truncated or "
                              "not a safetensors file.") from err
    if framework_of(model) != "torch":
        raise CheckpointError(f"{p}: .safetensors checkpoints are read into torch models; the factory returned a "
                              f"{type(model).__name__}. Save Keras weights as .keras, JAX ones as .eqx/.msgpack.")
    import torch

    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
    return _into_torch_model(model, state, p)


def _load_equinox(p: Path, factory: Any) -> Any:
    try:
        import equinox as eqx
    except ImportError:
        raise CheckpointError("Loading an .eqx checkpoint needs equinox: pip install equinox.") from None
    like = _build(factory, str(p))
    if not isinstance(like, eqx.Module):
        raise CheckpointError(f"The model factory returned a {type(like).__name__}, but {p} is an equinox "
                              "checkpoint; the factory must return an equinox Module of the saved structure.")
    try:
        return eqx.tree_deserialise_leaves(str(p), like=like)
    except Exception as err:
        raise CheckpointError(f"The leaves in {p} do not fit the factory's model ({_one_line(err)}); pass the "
                              "factory that built the saved model (same layers and sizes).") from err


def save_flax_nnx(model: Any, path: str | os.PathLike) -> str:
    """Write ``nnx.state(model)`` as flax msgpack (the ``.msgpack`` format :func:`load_model` reads)."""
    import flax.serialization
    from flax import nnx

    pure = nnx.to_pure_dict(nnx.state(model))
    Path(path).write_bytes(flax.serialization.msgpack_serialize(pure))
    return str(path)


def _load_flax(p: Path, factory: Any) -> Any:
    try:
        import flax.serialization
    except ImportError:
        raise CheckpointError("Loading a .msgpack checkpoint needs flax: pip install flax.") from None
    built = _build(factory, str(p))
    try:
        restored = flax.serialization.msgpack_restore(p.read_bytes())
    except Exception as err:
        raise CheckpointError(f"Cannot read {p} as a flax msgpack file ({_one_line(err)}); it may be truncated or "
                              "of another format.") from err
    from flax import nnx

    if isinstance(built, nnx.Module):
        state = nnx.state(built)
        try:
            nnx.replace_by_pure_dict(state, restored)
        except Exception as err:
            raise CheckpointError(f"The state in {p} does not fit the factory's nnx module ({_one_line(err)}); "
                                  "pass the factory that built the saved model.") from err
        _check_shapes_match(nnx.to_pure_dict(nnx.state(built)), nnx.to_pure_dict(state), p)
        nnx.update(built, state)
        return built
    if isinstance(built, tuple) and len(built) == 2:  # (linen module, template variables)
        module, template = built
        try:
            variables = flax.serialization.from_state_dict(template, restored)
        except Exception as err:
            raise CheckpointError(f"The variables in {p} do not fit the factory's template ({_one_line(err)}); pass "
                                  "the factory that built the saved model.") from err
        _check_shapes_match(template, variables, p)
        return (module, variables)
    raise CheckpointError(f"The model factory returned a {type(built).__name__}; for a .msgpack checkpoint it must "
                          "return a flax nnx module or a (linen module, variables) pair.")


def _check_shapes_match(template: Any, loaded: Any, p: Path) -> None:
    import jax

    a = jax.tree_util.tree_leaves_with_path(template)
    b = jax.tree_util.tree_leaves_with_path(loaded)
    if len(a) != len(b):
        raise CheckpointError(f"{p} holds {len(b)} arrays, the factory's model {len(a)}; pass the factory that "
                              "built the saved model.")
    for (path_a, u), (_, v) in zip(a, b):
        if np.shape(u) != np.shape(v):
            raise CheckpointError(f"The weights in {p} do not fit the factory's model: "
                                  f"{jax.tree_util.keystr(path_a)} has shape {np.shape(v)} in the file but "
                                  f"{np.shape(u)} in the model. Pass the factory that built the saved model.")


# ============================================================================ data


def load_data(spec: Any) -> Any:
    """Training data from a path or a ``"module:function"``.

    Args:
        spec: An ``.npz`` file (arrays ``x`` and ``y``, or exactly two arrays: the
            labels are the 1-D integer one), a directory holding ``x.npy`` and
            ``y.npy``, or ``"module:function"`` returning a DataLoader, an iterable
            of ``(x, y)`` batches or an ``(x, y)`` pair.

    Returns:
        ``(x, y)`` numpy arrays, or what the function returned.

    Raises:
        CheckpointError: For a missing or malformed file, or a function that fails.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise CheckpointError(f"The data must be a path or 'module:function', got {type(spec).__name__}.")
    text = str(spec)
    p = Path(text)
    if not p.exists() and ":" in text and not text.endswith((".npz", ".npy")):
        func = resolve_factory(text)
        try:
            data = func()
        except Exception as err:
            raise CheckpointError(f"The data function {text} failed ({_one_line(err)}); it must return a loader, "
                                  "an iterable of (x, y) batches or an (x, y) pair without arguments.") from err
        if data is None:
            raise CheckpointError(f"The data function {text} returned None; return a loader, an iterable of (x, y) "
                                  "batches or an (x, y) pair.")
        return data
    if not p.exists():
        raise CheckpointError(f"The data {text} does not exist; pass an .npz file, a folder with x.npy and y.npy, "
                              "or module:function.")
    if p.is_dir():
        return _load_npy_folder(p)
    if p.suffix.lower() == ".npy":
        raise CheckpointError(f"{text} is an .npy file (a single .npy array); the data needs inputs and labels: "
                              f"pass an .npz file or the folder holding x.npy and y.npy; {_SAVE_NPZ}.")
    return _load_npz(p)


def _load_npz(p: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(p, "rb") as fh:
        magic = fh.read(6)
    # np.load guesses the format from the content and calls a text file "pickled data".
    if magic.startswith(b"\x93NUMPY"):
        raise CheckpointError(f"{p} is an .npy file (a single array) named like an .npz; the data needs inputs and "
                              f"labels: {_SAVE_NPZ}.")
    if not magic.startswith(b"PK\x03\x04"):
        raise CheckpointError(f"{p} is not an .npz file (an .npz is a zip archive of arrays; this file "
                              f"{'is empty' if not magic else 'is not a zip archive'}); {_SAVE_NPZ}.")
    try:
        with np.load(p, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except ValueError as err:
        if "pickle" in str(err):
            raise CheckpointError(f"{p} holds object (pickled) arrays, which normflat does not load; save x and y "
                                  "as numeric arrays.") from err
        raise CheckpointError(f"Cannot read {p} as an .npz file ({_one_line(err)}); it may be truncated or "
                              f"corrupted: {_SAVE_NPZ}.") from err
    except Exception as err:  # zipfile.BadZipFile, EOFError, OSError: a damaged archive
        raise CheckpointError(f"Cannot read {p} as an .npz file ({_one_line(err)}); it may be truncated or "
                              f"corrupted: {_SAVE_NPZ}.") from err
    if "x" in arrays and "y" in arrays:
        x, y = arrays["x"], arrays["y"]
    elif len(arrays) == 2:
        (ka, a), (kb, b) = arrays.items()
        labels = [k for k, v in ((ka, a), (kb, b)) if v.ndim == 1 and v.dtype.kind in "iu"]
        if len(labels) != 1:
            raise CheckpointError(f"{p} holds two arrays {sorted(arrays)} but which are the labels is unclear; "
                                  f"name them x and y: {_SAVE_NPZ}.")
        y = arrays[labels[0]]
        x = b if labels[0] == ka else a
    else:
        raise CheckpointError(f"{p} must hold arrays named 'x' and 'y'; it has {sorted(arrays)}. {_SAVE_NPZ[0].upper()}"
                              f"{_SAVE_NPZ[1:]}.")
    return _check_xy(x, y, str(p))


def _load_npy_folder(p: Path) -> tuple[np.ndarray, np.ndarray]:
    missing = [n for n in ("x.npy", "y.npy") if not (p / n).is_file()]
    if missing:
        raise CheckpointError(f"The data {p} is a folder that lacks {' and '.join(missing)}; pass an .npz file with "
                              "arrays x and y, or a folder holding x.npy (inputs) and y.npy (labels) written with "
                              "numpy.save.")
    arrays = []
    for name in ("x.npy", "y.npy"):
        try:
            arrays.append(np.load(p / name, allow_pickle=False))
        except Exception as err:
            raise CheckpointError(f"Cannot read {p / name} as an .npy array ({_one_line(err)}); write it with "
                                  "numpy.save.") from err
    return _check_xy(arrays[0], arrays[1], str(p))


def _check_xy(x: np.ndarray, y: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    if x.dtype.kind not in "biuf":
        raise CheckpointError(f"x in {where} must be a numeric array, got dtype {x.dtype}.")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise CheckpointError(f"y in {where} must be a 1-D array of integer class labels, got {y.dtype} {y.shape}.")
    if x.ndim < 1 or len(x) != len(y):
        raise CheckpointError(f"x in {where} must have one row per label (examples first): x has shape {x.shape}, "
                              f"y has {len(y)} labels.")
    if len(y) == 0:
        raise CheckpointError(f"{where} holds no examples (x and y are empty).")
    if y.min() < 0:
        raise CheckpointError(f"y in {where} has negative labels ({int(y.min())}); labels are class indices 0..C-1.")
    return x, y


# ============================================================================ forward passes


def _batches(data: Any, batch_size: int) -> Iterable[tuple[Any, Any]]:
    """``(x, y)`` batches of an ``(x, y)`` pair or of an iterable of batches."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and hasattr(data[1], "shape"):
        x, y = data
        n = len(y)
        for i in range(0, n, batch_size):
            yield x[i:i + batch_size], y[i:i + batch_size]
        return
    for batch in data:
        if isinstance(batch, dict) and "x" in batch and "y" in batch:
            yield batch["x"], batch["y"]
        else:
            yield batch[0], batch[1]


def predict(model: Any, x: Any) -> np.ndarray:
    """Logits of ``model`` on one batch ``x``, as a numpy array (inference mode, no state change).

    torch: ``model(x)`` under ``no_grad`` in eval mode (modes restored); Keras:
    ``model(x, training=False)``; JAX: the nnx / equinox module (applied with
    ``jax.vmap`` when it maps single examples), ``module.apply(variables, x)`` of a
    linen pair, or ``apply_fn(params, x)``.
    """
    framework = framework_of(model)
    if framework == "torch":
        import torch

        modes = [(m, m.training) for m in model.modules()]
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        model.eval()
        try:
            with torch.no_grad():
                t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x, device=device)
                if t.is_floating_point():
                    t = t.to(dtype)
                out = model(t)
        finally:
            for m, mode in modes:
                m.training = mode
        return out.detach().cpu().double().numpy()
    if framework == "keras":
        import keras

        return np.asarray(keras.ops.convert_to_numpy(model(x, training=False)), dtype=np.float64)
    return _predict_jax(model, x)


def _predict_jax(model: Any, x: Any) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(x)
    if isinstance(model, tuple):
        fn, variables = model
        out = fn.apply(variables, x) if hasattr(fn, "apply") else fn(variables, x)
        return np.asarray(out, dtype=np.float64)
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(model, eqx.Module):
        model = eqx.nn.inference_mode(model)
        try:
            out = model(x)
            if np.ndim(out) == 2 and np.shape(out)[0] == x.shape[0]:
                return np.asarray(out, dtype=np.float64)
        except Exception:  # a per-example model (equinox's own layers): vmap it
            pass
        return np.asarray(jax.vmap(model)(x), dtype=np.float64)
    from flax import nnx

    if isinstance(model, nnx.Module):
        # nnx.view would be cleaner, but eval() with a restore is available in every flax 0.10+.
        state = nnx.state(model)
        graphdef = nnx.graphdef(model)
        copy = nnx.merge(graphdef, state)
        copy.eval()
        return np.asarray(copy(x), dtype=np.float64)
    return np.asarray(model(x), dtype=np.float64)


def accuracy(model: Any, data: Any, *, batch_size: int = 256) -> float:
    """Fraction of examples whose arg-max logit is the label (over ``(x, y)`` or batches)."""
    right = total = 0
    for x, y in _batches(data, batch_size):
        labels = np.asarray(y.detach().cpu().numpy() if hasattr(y, "detach") else y)
        if labels.ndim == 2 and labels.shape[1] > 1:
            labels = labels.argmax(axis=1)  # one-hot rows
        labels = labels.reshape(-1)
        if len(labels) == 0:
            continue
        logits = predict(model, x)
        right += int(np.sum(logits.argmax(axis=1) == labels))
        total += len(labels)
    if total == 0:
        raise CheckpointError("The data holds no examples, so no accuracy can be measured.")
    return right / total


# ============================================================================ analysis data


def analysis_data(model: Any, data: Any, batch_size: int) -> Any:
    """``data`` as the model's backend takes it: ``(x, y)`` numpy arrays become
    batches (torch tensors in the model's dtype for torch models); anything else
    (a loader, an iterable of batches) is returned as it is."""
    if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], np.ndarray)):
        return data
    x, y = data
    if framework_of(model) == "torch":
        import torch

        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        xt = torch.as_tensor(x)
        xt = xt.to(dtype) if xt.is_floating_point() else xt
        yt = torch.as_tensor(y).long()
        return [(xt[i:i + batch_size], yt[i:i + batch_size]) for i in range(0, len(yt), batch_size)]
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size)]


def check_fits(model: Any, data: Any, where: str = "the data") -> None:
    """One forward pass on the first two examples of ``(x, y)`` arrays, so an ``x``
    the model cannot take, an output that is not ``(batch, classes)`` logits or a
    label outside the model's classes is a clear error before the analysis starts.

    The pass runs in inference mode (torch eval mode, restored; Keras
    ``training=False``): BatchNorm statistics and dropout are left as they were.
    Data that is not a pair of arrays (a loader from ``module:function``) is not
    checked, so that no batch of a one-shot iterator is consumed.

    Raises:
        CheckpointError: Naming the shapes and the fix.
    """
    if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], np.ndarray)
            and isinstance(data[1], np.ndarray)):
        return
    x, y = data
    try:
        logits = predict(model, x[: min(2, len(x))])
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the user's model on the user's x
        expects = getattr(model, "input_shape", None)
        expected = f" (the model expects {expects})" if expects is not None else ""
        raise CheckpointError(
            f"The model cannot take x from {where}: x has shape {x.shape}, i.e. examples of shape "
            f"{x.shape[1:]}{expected}, and the model fails on them ({_one_line(err)}). Save x in the layout the "
            "model expects, examples first."
        ) from err
    shape = tuple(np.shape(logits))
    if len(shape) != 2:
        raise CheckpointError(f"The model's output has shape {shape} on x from {where}; normflat analyzes "
                              "classifiers whose output is (batch, classes) logits.")
    if int(y.max()) >= shape[1]:
        raise CheckpointError(f"y in {where} has labels up to {int(y.max())}, but the model outputs {shape[1]} "
                              f"classes; labels must be class indices 0..{shape[1] - 1}.")
