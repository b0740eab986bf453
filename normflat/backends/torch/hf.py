"""What the torch backend needs to know about model libraries built on torch (Hugging Face, timm).

Everything here is imported lazily: a library is only consulted when the user
has already imported it (``sys.modules``), so ``import normflat`` never imports
it. The session calls three hooks:

* :func:`register_known_layers` before the model walk: extractors for the layer
  types of loaded libraries (Hugging Face ``Conv1D``...);
* :func:`is_causal_lm` to decide ``shift_labels=None`` (method §6.3);
* :func:`analysis_mode` around every forward of the analysis.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["register_known_layers", "is_causal_lm", "analysis_mode"]


def register_known_layers() -> None:
    """Register the extractors of the layer types of already-imported libraries (idempotent)."""


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a causal language model whose labels are shifted by its own loss."""
    return False


@contextlib.contextmanager
def analysis_mode(model: Any, options: Any) -> Iterator[None]:
    """A context every forward of the analysis runs in (thread-local effects only)."""
    yield
