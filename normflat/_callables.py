"""Import the callable that a ``"module:function"`` or ``"path/to/file.py:function"`` names.

Both command lines take factories this way: ``normflat analyze --model`` for the
architecture of a checkpoint (:func:`normflat.checkpoints.resolve_factory`) and
the study's ``--model`` and ``--dataset`` (:func:`normflat.study.models.import_object`).
The resolution is the same; each caller has its own error class and its own
wording (:class:`SpecMessages`), so its messages name its own options.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["SpecMessages", "import_callable", "one_line"]


def one_line(err: BaseException, limit: int) -> str:
    """An exception's message on one line, at most ``limit`` characters (its class name if it has none)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class SpecMessages:
    """The messages of :func:`import_callable`, as :meth:`str.format` templates.

    Every template may use ``{spec}``, ``{module}`` (the part before the colon),
    ``{function}`` (the part after it) and the caller's ``context`` fields; the
    failures add their own: ``{error}`` (the exception's message on one line) and
    ``{error_type}`` (its class name) for a failed import, ``{missing}`` (the
    package a ``ModuleNotFoundError`` names), ``{callables}`` (up to ten public
    callables of the module, as a list) and ``{kind}`` (the type of an attribute
    that is not callable).

    Attributes:
        missing_file: The ``.py`` file does not exist.
        unloadable_file: importlib cannot make a module of the ``.py`` file.
        file_failed: Executing the ``.py`` file raised.
        missing_module: The module itself cannot be found.
        missing_dependency: The module imports a package that is not installed.
        module_failed: Importing the module raised anything else.
        missing_attribute: The module has no attribute of that name.
        not_callable: The attribute is not callable.
    """

    missing_file: str
    unloadable_file: str
    file_failed: str
    missing_module: str
    missing_dependency: str
    module_failed: str
    missing_attribute: str
    not_callable: str


def import_callable(spec: str, *, error: type[Exception], messages: SpecMessages,
                    context: Mapping[str, Any] | None = None, file_module_prefix: str = "",
                    detail_limit: int = 240) -> Callable[..., Any]:
    """The callable named by ``"module:function"`` or ``"path/to/file.py:function"``.

    The module is imported from ``sys.path`` or the current directory (as with
    ``python -m``: the directory is on the path only during the import); a
    ``.py`` path is executed as a module of its own, which is not added to
    ``sys.modules``.

    Args:
        spec: The specification, already checked by the caller to be two
            non-empty parts around one colon (each caller words that message).
        error: The exception class raised for every failure.
        messages: The wording of each failure.
        context: Further fields for the templates (e.g. the option's name).
        file_module_prefix: Prefix of the name given to a module made of a
            ``.py`` file (its stem follows).
        detail_limit: The most characters of an exception's message quoted in
            ``{error}``.

    Returns:
        The callable.

    Raises:
        error: If the file or the module cannot be imported, or has no such
            callable; the message (from ``messages``) says how to fix it.
    """
    module_name, func_name = spec.split(":")
    fields = {**(context or {}), "spec": spec, "module": module_name, "function": func_name}

    def fail(template: str, cause: BaseException | None = None, **more: Any) -> Exception:
        if cause is not None:
            more.update(error=one_line(cause, detail_limit), error_type=type(cause).__name__)
        return error(template.format(**fields, **more))

    if module_name.endswith(".py"):
        module = _exec_file(Path(module_name), file_module_prefix, messages, fail)
    else:
        module = _import_module(module_name, messages, fail)
    func = getattr(module, func_name, None)
    if func is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise fail(messages.missing_attribute, callables=public[:10])
    if not callable(func):
        raise fail(messages.not_callable, kind=type(func).__name__)
    return func


def _exec_file(path: Path, prefix: str, messages: SpecMessages, fail: Callable[..., Exception]) -> ModuleType:
    """Execute ``path`` as a module of its own (not registered in ``sys.modules``)."""
    if not path.is_file():
        raise fail(messages.missing_file)
    loader_spec = importlib.util.spec_from_file_location(f"{prefix}{path.stem}", path)
    if loader_spec is None or loader_spec.loader is None:
        raise fail(messages.unloadable_file)
    module = importlib.util.module_from_spec(loader_spec)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        raise fail(messages.file_failed, err) from err
    return module


def _import_module(module_name: str, messages: SpecMessages, fail: Callable[..., Exception]) -> ModuleType:
    """Import ``module_name`` with the current directory importable during the import."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # like `python -m`: modules in the current directory are importable
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # The module itself is missing, or (err.name is another package) something it imports.
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise fail(messages.missing_module, err) from err
        raise fail(messages.missing_dependency, err, missing=err.name) from err
    except Exception as err:
        raise fail(messages.module_failed, err) from err
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
