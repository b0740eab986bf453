"""One registry model for every framework: ``{layer type: extractor}`` with MRO lookup.

Each backend keeps one :class:`LayerRegistry` of its own extractor type (a
torch ``LayerExtractor``, a Keras weight function, a JAX ``LayerRule``);
adding a layer type is one :meth:`LayerRegistry.register` call. A type can also
be registered as :data:`IGNORE` (its parameters never enter the measures, e.g.
normalization scales) or as :class:`Unsupported` (a known type normflat refuses,
with the reason). :class:`Skipped` collects what a model walk could not analyze
and reports it once, according to ``on_unsupported``.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["IGNORE", "IGNORED_REASON", "Unsupported", "LayerRegistry", "Skipped", "warn_user", "excluded_reason",
           "relative_bias_table", "RELATIVE_BIAS_TABLES",
           "position_table", "ADDED_TABLE_NAMES", "POSITION_TABLE_NAMES"]

#: Parameter names (last component) of tables and tokens that models *add* to their
#: activations and that are not position tables: biases over tokens or heads, tokens,
#: layer-scale vectors (method §3). Matched case-insensitively.
ADDED_TABLE_NAMES = (
    "relative_position_bias_table", "rel_pos_h", "rel_pos_w", "relative_position_bias", "pos_bias",
    "attention_biases", "cls_token", "dist_token", "reg_token", "register_tokens", "mask_token",
    "class_token", "gamma", "gamma_1", "gamma_2", "layer_scale", "layerscale", "ls1", "ls2", "scale",
    "lambda1",
)
#: Names (last component) of the embedding layers, or the attributes, holding a relative-position
#: bias table: one row per bucket of relative positions, one column per head, added to the
#: attention scores (T5 and its family, keras-hub's T5; WavLM's ``rel_attn_embed``). Excluded like
#: the added tables above (method §3), although an embedding layer looks them up.
RELATIVE_BIAS_TABLES = ("relative_attention_bias", "rel_attn_embed")

#: The reason given for a table of :data:`RELATIVE_BIAS_TABLES`.
RELATIVE_BIAS_REASON = ("a relative-position bias table (one row per bucket of relative positions, added to the "
                        "attention scores per head), not a weight matrix")

#: Names (last component) of learned position tables held as plain parameters
#: (timm ``pos_embed``, Hugging Face ViT ``position_embeddings``): analyzed as
#: embeddings of the positions (method §3).
POSITION_TABLE_NAMES = (
    "pos_embed", "pos_embedding", "position_embeddings", "position_embedding", "absolute_pos_embed",
    "positional_embedding", "pos_emb",
)


def _last_name(name: str) -> str:
    return name.replace("/", ".").replace(":", ".").split(".")[-1].lower()


#: Leaf names of a selective state-space layer's state decay rates (Mamba's ``A_log``, ``(channels,
#: state)``: ``A = −exp(A_log)`` scales each channel's state at every step), shaped like a matrix but
#: no map between units (method §3, "What is not a weight matrix").
STATE_DECAY_NAMES = ("a_log",)  # lower case, as _last_name gives it
#: Why a state decay table (:data:`STATE_DECAY_NAMES`) is excluded.
STATE_DECAY_REASON = ("a state-space layer's state decay rates (A = −exp(A_log), per channel and state), "
                      "not a weight matrix")


def excluded_reason(name: str, shape: tuple[int, ...]) -> str | None:
    """Why a parameter outside every recognised layer is not a weight matrix, or ``None``.

    One rule for every framework (method §3): a parameter with fewer than two axes
    longer than 1 is a vector or a scalar (bias, scale, layer-scale, a token); a
    parameter named like a bias table, token or scale (:data:`ADDED_TABLE_NAMES`) is
    added to activations; a state-space layer's decay rates (:data:`STATE_DECAY_NAMES`) scale its
    state. Such parameters are listed in the report's ``excluded``
    metadata, never warned about. ``None``: a weight matrix (a position table, see
    :func:`position_table`, or a weight the user could register a layer rule for).
    """
    shape = tuple(int(d) for d in shape)
    last = _last_name(name)
    if last.endswith("bias") or last in ("b", "beta"):
        return "bias"
    if sum(1 for d in shape if d > 1) < 2:
        return "a vector or scalar (scale, layer-scale or token), not a weight matrix"
    if last in ADDED_TABLE_NAMES:
        return "a bias table, token or scale added to activations, not a weight matrix"
    if last in STATE_DECAY_NAMES:
        return STATE_DECAY_REASON
    return None


def relative_bias_table(name: str) -> str | None:
    """Why the layer or attribute ``name`` holds no weight matrix when it is a relative-position bias
    table looked up by its own embedding layer (:data:`RELATIVE_BIAS_TABLES`), else ``None``.

    One rule for every framework (method §3): such a table is added to the attention scores
    per head, as the bias tables :func:`excluded_reason` recognises by name are; the layer's
    ``name`` decides, since its parameter is named like any embedding's (``weight``,
    ``embeddings``).
    """
    return RELATIVE_BIAS_REASON if _last_name(name) in RELATIVE_BIAS_TABLES else None


def position_table(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(features, positions)``, the canonical shape of a learned position table, or ``None``.

    A parameter outside every recognised layer is a position table when it is named
    like one (:data:`POSITION_TABLE_NAMES`) or shaped to broadcast over the batch (a
    leading axis of 1, two more axes longer than 1, e.g. ``(1, N, d)``). Adding row
    ``t`` of the table at position ``t`` is the lookup of position ``t``: the table is
    the embedding of the positions, canonical ``(features, positions)`` with the
    last axis the features and the others (leading 1 dropped) the positions.
    """
    shape = tuple(int(d) for d in shape)
    if excluded_reason(name, shape) is not None:
        return None
    named = _last_name(name) in POSITION_TABLE_NAMES
    broadcast = len(shape) >= 3 and shape[0] == 1
    if not (named or broadcast):
        return None
    rest = shape[1:] if shape[0] == 1 else shape
    features, positions = rest[-1], 1
    for d in rest[:-1]:
        positions *= d
    return features, positions

E = TypeVar("E")


class _Ignore:
    def __repr__(self) -> str:
        return "IGNORE"


#: Registered for types whose parameters are not weight matrices (normalization and activation
#: layers; method §4).
IGNORE: Any = _Ignore()

#: Why a parameter of a layer registered as :data:`IGNORE` is excluded: one text in every backend,
#: so that the same layer gets the same reason whatever the framework (method §4).
IGNORED_REASON = "a normalization or activation layer's scale, shift, statistics or slope, not a weight matrix"


@dataclass(frozen=True)
class Unsupported:
    """A registry entry refusing a layer type, with the reason shown to the user."""

    reason: str


class LayerRegistry(Generic[E]):
    """``{type: extractor}``; a lookup walks the object's MRO (subclasses match).

    Args:
        framework: Name used in messages.
        base: The framework's layer base class (``torch.nn.Module``), checked on
            registration; ``None`` accepts any class.
        hint: How a user registers a type (shown in messages).
    """

    def __init__(self, framework: str, base: type | tuple[type, ...] | None, hint: str) -> None:
        self.framework = framework
        self.base = base
        self.hint = hint
        self._entries: dict[type, Any] = {}

    def register(self, cls: type, entry: E | Unsupported | Any) -> None:
        """Register (or replace) the extractor of ``cls``."""
        if not isinstance(cls, type) or (self.base is not None and not issubclass(cls, self.base)):
            base = self.base.__name__ if isinstance(self.base, type) else self.base
            raise TypeError(f"register_layer needs a {self.framework} layer class ({base} subclass), got {cls!r}.")
        self._entries[cls] = entry

    def unregister(self, cls: type) -> None:
        """Forget ``cls`` (a no-op if it was not registered)."""
        self._entries.pop(cls, None)

    def lookup(self, obj: Any) -> Any:
        """The entry of the closest registered class in ``type(obj).__mro__`` (or None)."""
        for cls in type(obj).__mro__:
            entry = self._entries.get(cls)
            if entry is not None:
                return entry
        return None

    def lookup_class(self, obj: Any) -> type | None:
        """The registered class in ``type(obj).__mro__`` whose entry :meth:`lookup` returns."""
        for cls in type(obj).__mro__:
            if self._entries.get(cls) is not None:
                return cls
        return None

    def entries(self) -> dict[type, Any]:
        """A copy of the registry."""
        return dict(self._entries)


@dataclass(frozen=True)
class _Skip:
    label: str
    type_name: str
    reason: str


class Skipped:
    """What a model walk could not analyze, reported once as ``on_unsupported`` says."""

    def __init__(self, registry: LayerRegistry[Any]) -> None:
        self.registry = registry
        self.items: list[_Skip] = []

    def add(self, label: str, obj: Any, reason: str | None = None) -> None:
        """Record ``obj`` (named ``label``); without ``reason`` it lacks an extractor."""
        name = type(obj).__name__
        if reason is None:
            reason = f"{name} has parameters but no registered extractor; register one with {self.registry.hint}"
        self.items.append(_Skip(label, name, reason))

    def messages(self) -> list[str]:
        """``"label (Type: reason)"`` per skipped layer (the report's ``unsupported``)."""
        return [f"{s.label} ({s.type_name}: {s.reason})" if not s.reason.startswith(s.type_name)
                else f"{s.label} ({s.reason})" for s in self.items]

    def report(self, on_unsupported: str) -> list[str]:
        """Raise (``"error"``), warn once (``"warn"``) or stay silent (``"skip"``); return the messages."""
        msgs = self.messages()
        if msgs:
            text = "normflat skips layers it cannot analyze: " + "; ".join(msgs)
            if on_unsupported == "error":
                raise ValueError(text + ". Pass on_unsupported='warn' or 'skip' to analyze the other layers.")
            if on_unsupported == "warn":
                warn_user(text + ".")
        return msgs


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """Stack level of the first frame outside normflat (so warnings point at the user's call)."""
    frame = sys._getframe(2)
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's code; never touches the warning filters."""
    warnings.warn(message, category, stacklevel=_user_stacklevel())
