"""Memory budgets of the per-sample work, shared by the backends (framework-free).

The backends' ``memory_budget`` option bounds the memory of the per-sample
intermediates of one step (per-sample gradients or back-propagated signals of a
chunk of samples); the chunk size, the number of samples per step, is chosen
from it with :func:`chunk_size_for`.

Units follow SI and IEC: ``"512MB"`` is 512·10⁶ bytes, ``"512MiB"`` is 512·2²⁰
bytes; a bare number is bytes.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_memory_budget", "chunk_size_for", "format_bytes", "equal_step"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory_budget(value: int | str | None) -> int | None:
    """A memory budget in bytes.

    Args:
        value: ``None`` (no budget), a positive int of bytes, or a string such as
            ``"512MB"``, ``"2GB"``, ``"1.5GiB"`` or ``"4096"`` (units B, KB, MB, GB,
            TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024; case-insensitive).

    Returns:
        The budget in bytes (at least 1), or ``None``.

    Raises:
        TypeError: If ``value`` is neither None, an int nor a str.
        ValueError: If the string is malformed, the unit unknown or the budget not positive.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"memory_budget must be an int number of bytes or a string like '512MB' or '2GiB', "
            f"got {type(value).__name__} {value!r}."
        )
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"memory_budget must be positive, got {value} bytes.")
        return value
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"memory_budget {value!r} is not understood; write a number with an optional unit "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '512MB'."
        )
    size = math.floor(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"memory_budget must be at least 1 byte, got {value!r}.")
    return size


def equal_step(total: int, most: int) -> int:
    """The step that cuts ``total`` items into as few equal steps of at most ``most`` as possible.

    The same number of steps as steps of ``most``, but balanced: 20 items with at most 16
    per step go as 10 + 10, not 16 + 4 (a compiled step of fixed size pads the last one,
    and a smaller remainder wastes a pass on little work). ``total`` and ``most`` >= 1.
    """
    return -(-int(total) // -(-int(total) // int(most)))


def format_bytes(size: float) -> str:
    """``size`` bytes in a short human form (``"1.5 MiB"``), for messages."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} B"


def chunk_size_for(
    budget_bytes: int,
    bytes_per_sample: int,
    what: str = "the per-sample work",
    maximum: int | None = None,
) -> int:
    """Samples per step so that ``chunk * bytes_per_sample <= budget_bytes``.

    Args:
        budget_bytes: The budget (from :func:`parse_memory_budget`).
        bytes_per_sample: Memory one sample needs in a step.
        what: What needs the memory, for the error message.
        maximum: Optional upper bound on the chunk size.

    Returns:
        The largest chunk size within budget (at least 1, at most ``maximum``).

    Raises:
        ValueError: If one sample alone needs more than the budget; the message
            names the budget, the per-sample need and the fixes.
    """
    budget_bytes, bytes_per_sample = int(budget_bytes), int(bytes_per_sample)
    if budget_bytes < 1:
        raise ValueError(f"The memory budget must be positive, got {budget_bytes} bytes.")
    if bytes_per_sample < 1:
        raise ValueError(f"bytes_per_sample must be positive, got {bytes_per_sample}.")
    chunk = budget_bytes // bytes_per_sample
    if chunk < 1:
        raise ValueError(
            f"memory_budget={budget_bytes} bytes ({format_bytes(budget_bytes)}) is too small: "
            f"{what} needs {bytes_per_sample} bytes ({format_bytes(bytes_per_sample)}) for a single "
            "sample. Raise memory_budget to at least that, or use "
            "an estimator with less per-sample work (ggn-mc with samples=1, or hutchinson)."
        )
    if maximum is not None:
        chunk = min(chunk, int(maximum))
    return max(1, chunk)


#: The least working memory the automatic chunking allows itself (small models are not cut
#: into single samples to stay under twice a training step of a few MiB).
DEFAULT_BUDGET_FLOOR = 32 * 2**20


def training_step_bytes(parameters: int, activations: int, itemsize: int) -> int:
    """Estimated memory of one training step: gradients and one optimizer buffer per
    parameter, and the activations kept for the backward pass (about twice the layer
    outputs, counting what the nonlinearities save)."""
    return int(itemsize) * (2 * int(parameters) + 2 * int(activations))


def default_budget(step_bytes: int, state_bytes: int) -> int:
    """The working memory of an analysis without ``memory_budget``: about twice a training step.

    The per-layer sums the estimator must hold (``state_bytes``: one array per group and
    weight) are part of the peak, so the chunks get what is left of twice the step, but
    at least one training step (the sums of ``ggn-topk``'s groups can exceed the step;
    cutting the batch into tiny chunks then would cost time and save little) and at least
    :data:`DEFAULT_BUDGET_FLOOR`.
    """
    return max(2 * int(step_bytes) - int(state_bytes), int(step_bytes), DEFAULT_BUDGET_FLOOR)

