"""Every touch of a private or internal JAX / flax API, in one place.

The jaxpr tracing of :mod:`normflat.backends.jax.program` needs a few things JAX
exposes only through ``jax.extend`` or attributes of its internal objects; the
multi-process reduction uses ``jax.experimental.multihost_utils``; flax linen
reports a write to a frozen collection with an exception class that lives in
``flax.errors``. If a JAX or flax release moves one of them, this module is the
only one to adapt.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["Literal", "bind_params", "eqn_context", "process_allgather", "x64_enabled", "enable_x64",
           "is_frozen_collection_error"]

# ``jax.extend.core`` is the supported home of the jaxpr node classes for libraries that walk
# jaxprs; ``Literal`` tells a constant operand from a variable.
from jax.extend.core import Literal  # noqa: E402


def bind_params(eqn: Any) -> dict:
    """The keyword arguments that re-bind ``eqn``'s primitive.

    ``Primitive.get_bind_params`` is internal: a jaxpr equation stores its sub-jaxprs
    in a form that ``bind`` does not take directly (closed vs open), and this is the
    method JAX itself uses to convert them back.
    """
    return eqn.primitive.get_bind_params(eqn.params)


def eqn_context(eqn: Any) -> Any:
    """The context manager (source info, named scopes) an equation was traced under.

    ``JaxprEqn.ctx.manager`` is internal; re-binding inside it keeps the names and
    axis contexts of the user's program (e.g. ``shard_map`` axis names) intact.
    """
    return eqn.ctx.manager


def process_allgather(tree: Any) -> Any:
    """All-gather a pytree of host arrays over the processes of ``jax.distributed``.

    ``multihost_utils`` lives under ``jax.experimental``; it is the only collective
    across processes that works on host (numpy) data without a user-supplied mesh.
    """
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree)


def x64_enabled() -> bool:
    """Whether 64-bit types are enabled in this thread (``jax_enable_x64``)."""
    return bool(jax.config.jax_enable_x64)


def enable_x64(flag: bool = True) -> Any:
    """Thread-local context that enables 64-bit types (``jax.enable_x64``; older: experimental)."""
    fn = getattr(jax, "enable_x64", None)
    if fn is None:  # jax < 0.6: only the experimental spelling exists
        from jax.experimental import enable_x64 as fn  # type: ignore[no-redef]
    return fn(flag)


def is_frozen_collection_error(err: BaseException) -> bool:
    """Whether ``err`` is flax linen's refusal to write a variable collection during ``apply``.

    Matched by class name: ``flax.errors.ModifyScopeVariableError`` is not re-exported
    by ``flax.linen`` and its module path has changed between releases.
    """
    return type(err).__name__ == "ModifyScopeVariableError"
