"""The study's PyTorch models, and the ``--model`` factories of the user's.

The built-in architectures are a ReLU MLP and a LeNet-style CNN with or without
BatchNorm: plain ``nn.Sequential`` stacks of ``Flatten``, ``Linear``, ``Conv2d``,
``BatchNorm2d``, ``ReLU`` and ``MaxPool2d``, so that
:mod:`normflat.study.reparametrize` can rescale them without changing their function.

A model family of your own is a factory ``module:function`` (or
``path/to/file.py:function``) called as ``function(input_shape=...,
num_classes=..., width=..., seed=...)`` for every model of the study
(:func:`resolve_model_factory`, :func:`call_model_factory`); each framework
adapter checks what it returns (:mod:`normflat.study.frameworks`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from normflat._callables import SpecMessages, import_callable, one_line
from normflat.study.datasets import StudyInputError

__all__ = ["ARCHITECTURES", "build_model", "import_object", "resolve_model_factory", "call_model_factory",
           "callable_label"]

#: Architecture names accepted by :func:`build_model`.
ARCHITECTURES = ("mlp", "cnn", "cnn-bn")


def build_model(arch: str, input_shape: tuple[int, ...], num_classes: int, *, width: int | None = None, seed: int = 0) -> Any:
    """A freshly initialized torch model.

    Args:
        arch: ``"mlp"`` (two hidden ReLU layers), ``"cnn"`` (LeNet-style: two
            conv + max-pool stages and two dense layers) or ``"cnn-bn"`` (the
            same with BatchNorm after each convolution).
        input_shape: ``(channels, height, width)`` of one image.
        num_classes: Number of outputs.
        width: Hidden width of the MLP (default 128) or of the CNN's dense layer
            (default 128 for 8x8 inputs, 120 otherwise).
        seed: Seed of the initialization.

    Returns:
        A ``torch.nn.Sequential`` in float32, train mode.
    """
    import torch
    from torch import nn

    if arch not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}.")
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (channels, height, width), got {input_shape}.")
    channels, height, wide = input_shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "mlp":
            hidden = width or 128
            return nn.Sequential(
                nn.Flatten(),
                nn.Linear(channels * height * wide, hidden), nn.ReLU(),
                nn.Linear(hidden, hidden), nn.ReLU(),
                nn.Linear(hidden, num_classes),
            )
        bn = arch == "cnn-bn"
        small = min(height, wide) < 16
        # 8x8 digits: 3x3 'same' convolutions; 28x28 images: LeNet-5's 5x5 kernels.
        k, pad = (3, 1) if small else (5, 2)
        c1, c2 = (16, 32) if small else (6, 16)

        def stage(cin, cout, padding):
            layers = [nn.Conv2d(cin, cout, k, padding=padding)]
            if bn:
                layers.append(nn.BatchNorm2d(cout))
            layers += [nn.ReLU(), nn.MaxPool2d(2)]
            return layers

        features = [*stage(channels, c1, pad), *stage(c1, c2, 1 if small else 0)]
        probe = nn.Sequential(*features).eval()
        with torch.no_grad():
            flat = probe(torch.zeros(1, *input_shape)).numel()
        hidden = width or (128 if small else 120)
        model = nn.Sequential(
            *features,
            nn.Flatten(),
            nn.Linear(flat, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )
        return model.train()  # the shape probe left the shared feature modules in eval mode


# ============================================================================ user factories


#: The most characters of an exception's message that the study's messages quote.
_DETAIL_LIMIT = 200


def _one_line(err: BaseException, limit: int = _DETAIL_LIMIT) -> str:
    """``err``'s message on one line, shortened to ``limit`` characters."""
    return one_line(err, limit)


def callable_label(func: Any) -> str:
    """``module:qualname`` of a callable (how results.json records a factory passed as an object)."""
    return f"{getattr(func, '__module__', '?')}:{getattr(func, '__qualname__', type(func).__name__)}"


# The wording of import_object's failures ({option}: --model or --dataset; {what}: what it names).
_IMPORT_MESSAGES = SpecMessages(
    missing_file=("{option} {spec}: the file {module} does not exist; give an existing path/to/file.py:function or "
                  "an importable module:function."),
    unloadable_file="{option} {spec}: cannot import {module} as a Python module.",
    file_failed=("{option} {spec}: importing {module} failed ({error_type}: {error}); fix the file so that it "
                 "imports."),
    missing_module=("{option} {spec}: cannot import the module {module!r}; put {module}.py in the current directory "
                    "or on PYTHONPATH, or give path/to/file.py:{function}."),
    missing_dependency=("{option} {spec}: importing {module!r} failed because it needs the missing package "
                        "{missing!r}; install it."),
    module_failed=("{option} {spec}: importing {module!r} failed ({error_type}: {error}); fix the module so that "
                   "it imports."),
    missing_attribute=("{option} {spec}: {module} has no {function!r}; its public callables are {callables}. Name "
                       "the {what} after the colon."),
    not_callable="{option} {spec}: {function} is a {kind}, not a function; the {what} must be callable.",
)


def import_object(spec: str, option: str, what: str) -> Callable[..., Any]:
    """The callable named by ``"module:function"`` or ``"path/to/file.py:function"``.

    The module is imported from ``sys.path`` or the current directory (as with
    ``python -m``); a ``.py`` path is executed as a module of its own
    (:func:`normflat._callables.import_callable`).

    Args:
        spec: The specification.
        option: The command-line option it came from, for the messages (``--model``).
        what: What the callable is, for the messages (``model factory``).

    Raises:
        StudyInputError: If the specification is malformed, the module cannot be
            imported, or it has no such callable; the message says how to fix it.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(part.strip() for part in spec.split(":")):
        raise StudyInputError(f"{option} {spec!r} must be 'module:function' (e.g. mymodels:make_net, with mymodels.py "
                              f"in the current directory) or 'path/to/file.py:function', naming the {what}.")
    # A file's module is named _normflat_user_<stem>, a name no importable module has (callable_label shows it).
    return import_callable(spec, error=StudyInputError, messages=_IMPORT_MESSAGES,
                           context={"option": option, "what": what}, file_module_prefix="_normflat_user_",
                           detail_limit=_DETAIL_LIMIT)


def resolve_model_factory(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The ``--model`` factory: ``module:function``, ``file.py:function`` or a callable.

    Raises:
        StudyInputError: If it cannot be imported (see :func:`import_object`).
    """
    return spec if callable(spec) else import_object(spec, "--model", "model factory")


def call_model_factory(factory: Callable[..., Any], *, input_shape: tuple[int, ...], num_classes: int,
                       width: int | None, seed: int) -> Any:
    """Call ``factory(input_shape=..., num_classes=..., width=..., seed=...)``.

    torch's global random state is forked around the call (and seeded with
    ``seed``), so a factory that relies on torch's default initialization builds
    the same model for the same seed and the caller's random state does not move.

    Raises:
        StudyInputError: If the factory does not take these keyword arguments or fails.
    """
    import inspect

    label = callable_label(factory)
    kwargs = {"input_shape": tuple(input_shape), "num_classes": int(num_classes), "width": width, "seed": int(seed)}
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as err:
        raise StudyInputError(f"The model factory {label} cannot be called as "
                              f"{label.rpartition(':')[2]}(input_shape=..., num_classes=..., width=..., seed=...) "
                              f"({_one_line(err)}); give it these four keyword arguments (width may be None: the "
                              "architecture's default).") from err
    except ValueError:
        pass  # no signature to check (some builtins): the call itself will tell
    torch = sys.modules.get("torch")  # fork its random state only if it is in use: no import for Keras / JAX
    try:
        if torch is None:
            return factory(**kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return factory(**kwargs)
    except Exception as err:
        raise StudyInputError(f"The model factory {label} failed for input_shape={kwargs['input_shape']}, "
                              f"num_classes={num_classes}, width={width}, seed={seed} ({type(err).__name__}: "
                              f"{_one_line(err)}).") from err
