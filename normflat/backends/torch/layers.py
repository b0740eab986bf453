"""The torch layer registry, its built-in entries and the model walk.

One :class:`~normflat.engine.registry.LayerRegistry` maps module types to a
:class:`LayerExtractor` (how to read the weight, its canonical layout, its
groups and an optional fast GGN rule), to
:data:`~normflat.engine.registry.IGNORE` (normalization and activation
parameters, which never enter the measures, method §9) or to an
:class:`~normflat.engine.registry.Unsupported` reason. Lookups follow the MRO, so
subclasses of a registered type match too.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

from normflat.backends.torch import compat
from normflat.backends.torch.ggn import (
    PER_SAMPLE_GRADIENTS, attention_squares, conv_squares, conv_transpose_squares, embedding_bag_squares, embedding_squares,
    linear_squares, position_table_squares, recorded_lookup_squares, recurrent_squares, spectral_norm_rule,
    spectral_normalization, weight_norm_rule, weight_normalization)
from normflat.engine.options import GGN_ESTIMATORS, AnalysisOptions
from normflat.engine.problems import LayerSpec, ParameterStatus
from normflat.engine.registry import (IGNORE, IGNORED_REASON, LayerRegistry, Skipped, Unsupported, excluded_reason,
                                      position_table, relative_bias_table)

__all__ = [
    "LayerExtractor",
    "ModuleWeight",
    "REGISTRY",
    "register_layer",
    "registered_layers",
    "TorchLayer",
    "collect_layers",
    "unwrap",
]


def _default_weight(module: nn.Module) -> Any:
    return getattr(module, "weight", None)


@dataclass(frozen=True)
class ModuleWeight:
    """One of several weight matrices of a module (attention projections, recurrent weights).

    Args:
        suffix: The report name is ``f"{module name}.{suffix}"``; ``None``: the module's name.
        param: The ``nn.Parameter``.
        to_canonical: ``tensor -> tensor`` to the canonical layout (only moves entries);
            ``None``: the parameter is canonical as stored.
        blocks: ``[(suffix, start, stop), ...]``: canonical row blocks that are separate
            linear maps (method §3, "Packed maps are split"); ``None``: one map.
        kind: The report kind; ``None``: the extractor's.
        ggn_squares: This weight's fast GGN rule (as :class:`LayerExtractor`'s, for this
            parameter); ``None``: the generic path.
        groups: The groups of a map that is block diagonal in its canonical layout
            ``(out, in/groups)`` (one block per attention head); ``None``: the extractor's.
        reason: Why a weight its module applies itself (:data:`DIRECT_WEIGHTS`) without a fast rule
            takes the generic path; ``None``: :data:`DIRECT_WEIGHT_REASON`.
    """

    suffix: str | None
    param: Any
    to_canonical: Callable[[torch.Tensor], torch.Tensor] | None = None
    blocks: list[tuple[str, int, int]] | None = None
    kind: str | None = None
    ggn_squares: Callable[..., torch.Tensor] | None = None
    groups: int | None = None
    reason: str | None = None


#: ``{module type: module -> [ModuleWeight, ...]}``: weight matrices a module applies itself as
#: raw parameters (an einsum in its forward: XLNet's and Funnel's attention; PEFT's LoRA ``Embedding``
#: its adapters, held in ``ParameterDict`` containers of its own), read with the direct parameters of a
#: module without an extractor, whose sub-modules keep their own extractors (a registered module's
#: are not walked). Each ``suffix`` is the parameter's name under the module; they take their
#: ``ggn_squares`` rule (on the module's input and the signals at its output), or the generic path.
DIRECT_WEIGHTS: dict[type, Callable[[nn.Module], list[ModuleWeight]]] = {}

#: Why a direct weight (:data:`DIRECT_WEIGHTS`) takes the generic path.
DIRECT_WEIGHT_REASON = "a raw parameter its module applies itself (an einsum in its forward): no fast rule"


def direct_weights(module: nn.Module) -> dict[int, ModuleWeight]:
    """The :data:`DIRECT_WEIGHTS` of ``module`` (its type or the nearest base class listed), by
    parameter id."""
    for cls in type(module).__mro__:
        read = DIRECT_WEIGHTS.get(cls)
        if read is not None:
            return {id(mw.param): mw for mw in read(module)}
    return {}


@dataclass(frozen=True)
class LayerExtractor:
    """How normflat reads one module type.

    Args:
        kind: Short label recorded in reports (``"dense"``, ``"conv2d"``, ...).
        weight: ``module -> nn.Parameter``, the weight matrix or kernel (biases never
            enter the measures). Default: ``module.weight``.
        to_canonical: ``(module, tensor) -> tensor`` converting a tensor of the
            parameter's shape to the canonical ``(out, in/groups, *kernel)`` layout
            (applied to the weight and its Hessian diagonal). It must only move
            entries (reshape, transpose, permute): normflat inverts it to lay the
            Hutchinson probes, which are drawn in the canonical layout, onto the
            parameter. Default: identity.
        ggn_squares: Optional fast GGN rule ``(module, layer_input, signals) ->
            (K, *weight.shape)``: ``layer_input`` is the module's first positional
            input for a chunk of ``n`` samples, ``signals`` the back-propagated output
            signals of shape ``(K, M, n, *output.shape[1:])``; return, for each of the
            ``K`` groups, ``Σ_{m, sample} (∂⟨signal, output⟩/∂weight)²`` of the
            per-sample, per-signal weight gradients. Without it the layer uses the
            generic (``vmap``) path.
        unsupported: If set, modules of this type are reported as unsupported with
            this reason (their sub-modules are not analyzed either).
        groups: ``module -> int``, the groups of a grouped convolution (each output
            channel sees ``in/groups`` input channels). Default: 1.
        blocks: ``module -> [(suffix, start, stop), ...] | None``: for a weight that
            packs several linear maps along its canonical rows (a fused query/key/value
            projection, recurrent gates), the row range of each map; each becomes its
            own problem ``f"{name}.{suffix}"`` (method §3, "Packed maps are split").
            Default: one problem.
        weights: ``module -> [ModuleWeight, ...]`` for a module with several weight
            matrices; replaces ``weight``/``to_canonical``/``blocks``. Such weights use
            their :attr:`ModuleWeight.ggn_squares`, or the generic GGN path
            (``generic_reason`` says why).
        generic_reason: Why a layer without a fast rule takes the generic path
            (recorded in the details as ``generic_reason``). Default: ``"no fast rule"``.
        check: ``module -> str | None``: a reason to refuse this module configuration
            (raised as a ``ValueError`` naming the layer). Default: accept.
    """

    kind: str = "layer"
    weight: Callable[[nn.Module], Any] = _default_weight
    to_canonical: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    ggn_squares: Callable[[nn.Module, torch.Tensor, Any], torch.Tensor] | None = None
    unsupported: str | None = None
    groups: Callable[[nn.Module], int] | None = None
    blocks: Callable[[nn.Module], list[tuple[str, int, int]] | None] | None = None
    weights: Callable[[nn.Module], list[ModuleWeight]] | None = None
    generic_reason: str | None = None
    check: Callable[[nn.Module], str | None] | None = None


#: ``{module type: LayerExtractor | IGNORE | Unsupported}``.
REGISTRY: LayerRegistry[LayerExtractor] = LayerRegistry(
    "torch", nn.Module, "normflat.backends.torch.register_layer")


def register_layer(module_type: type, extractor: LayerExtractor | None = None, **kwargs: Any) -> None:
    """Register (or replace) how normflat reads a module type, in one call.

    Examples::

        register_layer(MyDense, kind="dense")                      # weight: module.weight, (out, in)
        register_layer(MyDense, LayerExtractor(kind="dense", weight=lambda m: m.kernel,
                                               to_canonical=lambda m, t: t.T))
        register_layer(MyAttention, unsupported="attention is not a weight matrix layer")

    Args:
        module_type: A ``torch.nn.Module`` subclass; subclasses of it are matched too
            unless registered themselves.
        extractor: A :class:`LayerExtractor`; or give its fields as keywords.
        **kwargs: Fields of :class:`LayerExtractor` when ``extractor`` is omitted.

    Raises:
        TypeError: If ``module_type`` is not an ``nn.Module`` subclass or the
            arguments are inconsistent.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_layer needs a torch.nn.Module subclass, got {module_type!r}.")
    if extractor is None:
        extractor = LayerExtractor(**kwargs)
    elif kwargs:
        raise TypeError("Pass either a LayerExtractor or its fields as keywords, not both.")
    if not isinstance(extractor, LayerExtractor):
        raise TypeError(f"extractor must be a LayerExtractor, got {type(extractor).__name__}.")
    entry: Any = Unsupported(extractor.unsupported) if extractor.unsupported else extractor
    REGISTRY.register(module_type, entry)


def registered_layers() -> dict[type, Any]:
    """A copy of the registry ``{module type: LayerExtractor | IGNORE | Unsupported}``."""
    return REGISTRY.entries()


def _conv_transpose_canonical(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    # torch stores (in, out/groups, *k); canonical is (out, in/groups, *k), group by group.
    g = module.groups
    cin, cout_g, *k = t.shape
    return t.reshape(g, cin // g, cout_g, *k).transpose(1, 2).reshape(g * cout_g, cin // g, *k)


def _groups_of(module: nn.Module) -> int:
    return int(module.groups)


def _transposed(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)


def _attention_weights(module: nn.Module) -> list[ModuleWeight]:
    """``nn.MultiheadAttention``: the query, key and value maps and the output projection.

    The packed ``in_proj_weight`` ``(3E, E)`` is one parameter with three row blocks;
    with ``kdim``/``vdim`` different from ``E`` torch keeps three parameters.
    """
    e = module.embed_dim
    rule = attention_squares  # each applied by one F.linear call, recorded there (ggn.Capture)
    out: list[ModuleWeight] = []
    if module.in_proj_weight is not None:
        out.append(ModuleWeight(None, module.in_proj_weight,
                                blocks=[("query", 0, e), ("key", e, 2 * e), ("value", 2 * e, 3 * e)],
                                ggn_squares=rule))
    else:
        out += [ModuleWeight("query", module.q_proj_weight, ggn_squares=rule),
                ModuleWeight("key", module.k_proj_weight, ggn_squares=rule),
                ModuleWeight("value", module.v_proj_weight, ggn_squares=rule)]
    out.append(ModuleWeight("out_proj", module.out_proj.weight, kind="dense", ggn_squares=rule))
    return out


#: Gate names of torch's recurrent weights, in torch's row order.
_GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("r", "z", "n"), "RNN_TANH": None, "RNN_RELU": None}


def _recurrent_weights(module: nn.Module) -> list[ModuleWeight]:
    """``nn.RNN``/``nn.LSTM``/``nn.GRU``: input, recurrent (and projection) weights of every
    layer and direction, each ``(gates · hidden, in)`` split per gate (method §3), each with the
    fast rule the plain recurrence records it for (:func:`~normflat.backends.torch.ggn.recurrent_squares`)."""
    gates = _GATES.get(module.mode)
    h = module.hidden_size
    out: list[ModuleWeight] = []
    for name, p in module.named_parameters(recurse=False):
        if not name.startswith("weight_"):
            continue
        blocks = None
        if gates is not None and not name.startswith("weight_hr"):
            blocks = [(g, i * h, (i + 1) * h) for i, g in enumerate(gates)]
        out.append(ModuleWeight(name, p, blocks=blocks, ggn_squares=recurrent_squares))
    return out


#: Why a weight-normalized layer's direction takes the generic path (its layer has no per-sample
#: gradient rule), and why its norms are excluded.
_WEIGHT_NORM_REASON = ("its weight is weight-normalized (g · v / ‖v‖) and its layer's rule has no per-sample "
                       "gradients to map to the direction v; the generic path differentiates through the "
                       "normalization")
_WEIGHT_NORM_SCALE = "the norms g of a weight normalization (a vector of scales), not a weight matrix"
#: Why a spectrally normalized layer's weight takes the generic path.
_SPECTRAL_NORM_REASON = ("its weight is spectrally normalized (V / σ) and its layer's rule has no per-sample "
                         "gradients to map to V; the generic path differentiates through the normalization")


@contextlib.contextmanager
def _parametrizations_in_eval(model: nn.Module) -> Iterator[None]:
    """Every parametrization of ``model`` in eval mode while the walk reads the weights, put back after:
    reading a parametrized weight runs its parametrization, and torch's ``spectral_norm`` in train
    mode then takes a power-iteration step on its buffers (the user's model must stay as it was)."""
    from torch.nn.utils import parametrize

    held = [(m, m.training) for lst in model.modules() if isinstance(lst, parametrize.ParametrizationList)
            for m in lst.modules()]
    for m, _ in held:
        m.training = False
    try:
        yield
    finally:
        for m, mode in held:
            m.training = mode


def check_embedding(module: nn.Module) -> str | None:
    """Why an ``nn.Embedding`` (or a subclass registered as one) cannot be analyzed as it is, or ``None``."""
    if module.max_norm is not None:
        return ("max_norm is set: torch renormalizes the table rows in place during every forward, "
                "which would change the model's weights; normflat never changes the model. Analyze a "
                "copy with max_norm=None after renormalizing it once (copy.deepcopy(model), then set "
                "max_norm=None on the copy's embeddings)")
    if module.scale_grad_by_freq:
        return ("scale_grad_by_freq=True rescales the gradients autograd computes by the token "
                "frequencies of the batch, so they are not the derivatives of the loss; analyze a copy "
                "with scale_grad_by_freq=False (it does not change the function)")
    if getattr(module, "sparse", False):
        return ("sparse=True makes autograd return sparse gradients, which torch.func cannot "
                "differentiate again; analyze a copy with sparse=False (it does not change the function)")
    return None


def _register_builtins() -> None:
    register_layer(nn.Linear, kind="dense", ggn_squares=linear_squares)
    for cls, kind in ((nn.Conv1d, "conv1d"), (nn.Conv2d, "conv2d"), (nn.Conv3d, "conv3d")):
        register_layer(cls, kind=kind, ggn_squares=conv_squares, groups=_groups_of)
    for cls, kind in ((nn.ConvTranspose1d, "conv_transpose1d"), (nn.ConvTranspose2d, "conv_transpose2d"),
                      (nn.ConvTranspose3d, "conv_transpose3d")):
        register_layer(cls, kind=kind, to_canonical=_conv_transpose_canonical,
                       ggn_squares=conv_transpose_squares, groups=_groups_of)
    register_layer(nn.MultiheadAttention, kind="attention", weights=_attention_weights)
    # A lookup of row v is E^T times the one-hot vector of v: canonical (features, vocabulary).
    register_layer(nn.Embedding, kind="embedding", to_canonical=_transposed, ggn_squares=embedding_squares,
                   check=check_embedding)
    register_layer(nn.EmbeddingBag, kind="embedding_bag", to_canonical=_transposed,
                   ggn_squares=embedding_bag_squares, check=check_embedding)
    for cls, kind in ((nn.LSTM, "lstm"), (nn.GRU, "gru"), (nn.RNN, "rnn")):
        register_layer(cls, kind=kind, weights=_recurrent_weights)
    register_layer(nn.RNNBase, unsupported="a recurrent layer type other than nn.RNN, nn.LSTM and nn.GRU")
    # Normalization and activation parameters never enter the measures (method §4).
    ignored = [compat.NORM_BASE, nn.LayerNorm, nn.GroupNorm, nn.PReLU]
    if hasattr(nn, "RMSNorm"):
        ignored.append(nn.RMSNorm)
    for cls in ignored:
        REGISTRY.register(cls, IGNORE)


_register_builtins()


# ============================================================================ the model walk


@dataclass
class TorchLayer:
    """One analyzed weight: its report spec and what the kernels need.

    ``convert`` (set for the weights of multi-weight modules and position tables)
    maps a tensor of the parameter's shape to the canonical layout; otherwise the
    extractor's ``to_canonical`` does.
    """

    spec: LayerSpec
    module: nn.Module
    param: nn.Parameter
    ext: LayerExtractor
    fast: bool
    convert: Callable[[torch.Tensor], torch.Tensor] | None = None
    _perm: torch.Tensor | None = field(default=None, repr=False)
    #: The other modules that use this weight (a tied embedding and output layer), when every use
    #: has a per-sample gradient rule (:data:`~normflat.backends.torch.ggn.PER_SAMPLE_GRADIENTS`):
    #: the fast path sums the uses' per-sample gradients before squaring (method §6.1).
    tied: list["TiedUse"] = field(default_factory=list)
    #: The modules sharing this weight that the first forward never ran (BART's ``model.shared``,
    #: whose table only the encoder's and decoder's embeddings and the head use): not among the
    #: :attr:`uses`; the session checks that they stay idle.
    idle: list["TorchLayer | TiedUse"] = field(default_factory=list)
    #: Whether the layer runs on no batch axis (a table of coordinates through a small MLP into
    #: attention biases): its signals are each sample's, pulled back from where its output meets
    #: the batch (method §6.1, "Layers on no batch axis").
    batchless: bool = False
    #: Whether the weight itself is the followed tensor: its module never runs and the model reads
    #: the weight as a tensor (DeBERTa-v3's ``rel_embeddings.weight``), squared as a table is.
    direct: bool = False

    @property
    def uses(self) -> list["TorchLayer | TiedUse"]:
        """The modules using this weight: the layer itself, then its :attr:`tied` uses (less the
        :attr:`idle` ones)."""
        return [use for use in (self, *self.tied) if not any(use is quiet for quiet in self.idle)]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def param_name(self) -> str:
        return self.spec.param

    @property
    def sums_uses(self) -> bool:
        """Whether this weight's per-sample gradient is a sum of its uses' (a weight tied to other
        modules, or a module called several times): its rule has one
        (:data:`~normflat.backends.torch.ggn.PER_SAMPLE_GRADIENTS`) in the weight's own layout, and the
        weight is not split into blocks."""
        return self.convert is None and not self.spec.blocks and self.ext.ggn_squares in PER_SAMPLE_GRADIENTS

    def _moves(self) -> bool:
        return self.convert is not None or self.ext.to_canonical is not None

    def canonical(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the parameter's shape in the canonical layout."""
        if self.convert is not None:
            return self.convert(t)
        return self.ext.to_canonical(self.module, t) if self.ext.to_canonical else t

    def kernel_axes(self) -> tuple[int, ...]:
        """The kernel axes of the parameter's native layout (``()`` for a matrix), where
        :meth:`canonical` is known to accept them with size 1: a convolution's
        ``(out, in/groups, *k)`` and a transposed convolution's ``(in, out/groups, *k)``."""
        if self.param.ndim <= 2 or self.convert is not None or math.prod(self.param.shape[2:]) == 1:
            return ()  # no kernel, or a 1×1 one: the kernel sums would be as large
        if self.ext.to_canonical not in (None, _conv_transpose_canonical):
            return ()  # a registered conversion may need the full shape
        return tuple(range(2, self.param.ndim))

    def canonical_shape(self) -> tuple[int, ...]:
        return tuple(self.canonical(torch.empty(self.param.shape, device="meta")).shape)

    def from_canonical(self, t: torch.Tensor) -> torch.Tensor:
        """``(m, *canonical)`` tensors laid onto the parameter's native ``(m, *shape)`` layout.

        ``to_canonical`` only moves entries, so applying it to the native positions
        ``0 .. numel-1`` gives, for each canonical entry, the native position it came from.
        """
        if not self._moves():
            return t
        if self._perm is None:
            native = torch.arange(self.param.numel(), device=t.device).reshape(self.param.shape)
            self._perm = self.canonical(native).reshape(-1)
        out = torch.empty((t.shape[0], self.param.numel()), dtype=t.dtype, device=t.device)
        out[:, self._perm] = t.reshape(t.shape[0], -1)
        return out.reshape(t.shape[0], *self.param.shape)

    @property
    def table(self) -> bool:
        """Whether this is a loose position table: no module of its own to hook, the session
        passes it expanded over the batch instead (:func:`~normflat.backends.torch.ggn.position_table_squares`)."""
        return self.ext is POSITION_TABLE

    def disable_fast(self, reason: str) -> None:
        self.fast = False
        self.spec.path, self.spec.reason = "generic", reason
        self.spec.extra.pop("unused", None)


@dataclass
class TiedUse:
    """A further module using the weight of a :class:`TorchLayer` (``module.weight`` is the same
    parameter), e.g. a language model's output layer tied to its token embedding."""

    module: nn.Module
    ext: LayerExtractor
    #: Whether this call runs on no batch axis (DeBERTa-v3's projections of the relative
    #: embeddings): followed to the batch (method §6.1, "Layers on no batch axis").
    batchless: bool = False


def unwrap(model: Any) -> nn.Module:
    """The user's module inside DDP / DataParallel wrappers and ``torch.compile``'s (layer names
    without ``module.`` or ``_orig_mod.``: the same names as the plain model's).

    A compiled model is analyzed through its eager module, which holds the same parameters: the
    analysis' hooks and ``torch.func`` transforms would make the compiler retrace or fall back on
    every call, and the numbers are the eager forward's either way.

    Raises:
        TypeError: For non-modules, TorchScript modules and FSDP-sharded models.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"The torch backend needs a torch.nn.Module, got {type(model).__name__}.")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif compat.compiled_original(model) is not None:
            model = compat.compiled_original(model)
        else:
            break
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "normflat cannot analyze a TorchScript module: its compiled graph bypasses the forward "
            "hooks and torch.func transforms the estimators rely on. Analyze the eager nn.Module "
            "instead (save it with torch.save(model) or torch.save(model.state_dict()) and rebuild it)."
        )
    if any(compat.is_fsdp(m) for m in model.modules()) or any(compat.is_dtensor(p) for p in model.parameters()):
        raise TypeError(
            "normflat cannot analyze an FSDP-sharded model: each rank holds only a shard of the "
            "weights, and the Hessian diagonal needs the full weights on every rank. Gather a full "
            "copy (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            "options=StateDictOptions(full_state_dict=True))), load it into an unwrapped model (or "
            "one wrapped in DistributedDataParallel) and analyze that: normflat shards the data "
            "across ranks, not the model."
        )
    return model


#: Parameter dtypes that an analysis does not compute in (method §6: at least float32).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def computing_copy(model: nn.Module) -> nn.Module:
    """``model`` itself, or a private float32 copy of it where some of its floating parameters are
    float16 or bfloat16 (a model loaded with ``torch_dtype=torch.bfloat16``).

    A torch model computes in its parameters' dtype, and Hessians in half precision are those of the
    rounding: the analysis computes in float32 through the copy, as JAX computes a float16 model's
    forward in float32. The copy holds the same weights exactly (float16 and bfloat16 widen to float32
    without rounding), so the report's layers, weights and numbers are those of the model's function at
    float32; the user's model is never touched. It costs the float32 weights' memory once more.

    Raises:
        ValueError: If ``copy.deepcopy`` cannot copy the model (the fix: analyze a float32 copy made
            by the caller).
    """
    half = [(name, p.dtype) for name, p in model.named_parameters() if p.dtype in HALF_DTYPES]
    if not half:
        return model
    try:
        duplicate = copy.deepcopy(model)
    except Exception as err:  # noqa: BLE001 - any failure of the copy gets the same fix
        name, dtype = half[0]
        raise ValueError(
            f"The torch model's parameters are {str(dtype).removeprefix('torch.')} ({name}"
            f"{f' and {len(half) - 1} more' if len(half) > 1 else ''}): Hessians in half precision are "
            "meaningless, so normflat computes in float32 through a private copy of the model, which "
            f"copy.deepcopy could not make ({type(err).__name__}: {err}). Analyze a float32 copy that you "
            "make (your model's own copy, then .float())."
        ) from err
    return duplicate.float()


#: Extractor of learned position tables held as loose parameters (method §3, "Position tables";
#: the fast rule, method §6.1: the session runs the model with the table expanded over the batch).
POSITION_TABLE = LayerExtractor(kind="position_embedding", ggn_squares=position_table_squares)


def _position_convert(shape: tuple[int, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    features, positions = shape

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(positions, features).transpose(0, 1)
    return convert


def _tied_fast(first: TorchLayer, module: nn.Module, ext: LayerExtractor, rule: bool) -> bool:
    """Whether a second module using the weight of ``first`` (a layer on the fast path, so with its
    class's own forward) keeps the fast path: both uses have a per-sample gradient rule in the
    weight's own layout and ``module`` does not override its class's forward."""
    owner = REGISTRY.lookup_class(module)
    return (rule and first.sums_uses and ext.ggn_squares in PER_SAMPLE_GRADIENTS
            and owner is not None and type(module).forward is owner.forward)


class _Walk:
    """State of one model walk: the layers found and every parameter's status."""

    def __init__(self, model: nn.Module, ggn: bool, use_fast: bool) -> None:
        self.ggn, self.use_fast = ggn, use_fast
        self.names = {id(p): compat.plain_name(n) for n, p in model.named_parameters()}
        self.status: dict[str, ParameterStatus] = {}
        self.layers: list[TorchLayer] = []
        self.by_param: dict[int, TorchLayer] = {}
        self.skipped = Skipped(REGISTRY)
        # Direct parameters of modules without an extractor, settled after the walk (settle_loose).
        self.loose_params: list[tuple[str, nn.Module, Any]] = []

    def mark(self, p: Any, status: str, reason: str | None = None) -> None:
        name = self.names.get(id(p))
        if name is not None and name not in self.status:
            self.status[name] = ParameterStatus(name, tuple(p.shape), status, reason)

    def add(self, label: str, module: nn.Module, w: Any, ext: LayerExtractor, *, kind: str | None = None,
            convert: Callable | None = None, blocks: list | None = None, rule: bool = True,
            groups: int | None = None) -> None:
        if not isinstance(w, nn.Parameter) or id(w) not in self.names:
            self.skipped.add(label, module, (
                "its weight is not a parameter of the model, e.g. computed by "
                "torch.nn.utils.parametrize; remove the parametrization first"))
            return
        if id(w) in self.by_param:  # tied weight: one Hessian diagonal, reported under the first name
            first = self.by_param[id(w)]
            first.spec.shared_with.append(label)
            if self.ggn and first.fast and _tied_fast(first, module, ext, rule):
                first.tied.append(TiedUse(module, ext))
            elif self.ggn:
                first.disable_fast("weight shared between modules")
            return
        fast = self.ggn and self.use_fast and rule and ext.ggn_squares is not None
        owner = REGISTRY.lookup_class(module)
        overridden = owner is not None and type(module).forward is not owner.forward
        if fast and overridden and ext.ggn_squares is embedding_squares:
            # An embedding computing its ids inside (OPT's positions): its lookup is recorded where
            # it happens, and checked on the first forward (ggn.FunctionalTaps).
            ext = replace(ext, ggn_squares=recorded_lookup_squares)
            reason = None
        elif fast and overridden:
            # A subclass with its own forward (padding, weight standardization, adapters) may not
            # compute what the registered class's fast rule assumes: the generic path is exact.
            fast = False
            reason = f"{type(module).__name__} overrides the forward of {owner.__name__}"
        elif fast or not self.ggn:
            reason = None
        elif not self.use_fast:
            reason = "fast=False"
        else:
            reason = ext.generic_reason or "no fast rule"
        if groups is None:
            groups = int(ext.groups(module)) if ext.groups is not None and rule else 1
        spec = LayerSpec(label, kind or ext.kind, self.names[id(w)], groups=groups,
                         path=("fast" if fast else "generic") if self.ggn else "hvp",
                         reason=reason, blocks=blocks)
        layer = TorchLayer(spec, module, w, ext, fast, convert)
        self.layers.append(layer)
        self.by_param[id(w)] = layer
        self.mark(w, "analyzed")

    def loose(self, name: str, module: nn.Module) -> None:
        """The direct parameters of a module without an extractor, and the weights it applies itself
        (:data:`DIRECT_WEIGHTS`), also from a container of its own (PEFT's ``ParameterDict`` adapters)."""
        label = name or type(module).__name__
        direct = direct_weights(module)
        own = {id(p) for p in module.parameters(recurse=False)}
        for mw in direct.values():
            if id(mw.param) not in own and id(mw.param) not in self.by_param:
                self._direct(self.names.get(id(mw.param), f"{label}.{mw.suffix}"), module, mw)
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            shape = tuple(p.shape)
            mw = direct.get(id(p))
            if mw is not None:
                self._direct(self.names.get(id(p), full), module, mw)
                continue
            why = excluded_reason(full, shape)
            if why is not None:
                self.mark(p, "excluded", why)
                continue
            table = position_table(full, shape)
            if table is not None and id(p) not in self.by_param:
                self.add(self.names.get(id(p), full), module, p, POSITION_TABLE,
                         convert=_position_convert(table))
                continue
            if id(p) not in self.by_param:
                self.loose_params.append((f"{label}.{pname}" if name else pname, module, p))

    def _direct(self, label: str, module: nn.Module, mw: ModuleWeight) -> None:
        """A weight ``module`` applies itself (:data:`DIRECT_WEIGHTS`): its own fast rule, or the generic path."""
        ext = LayerExtractor(kind=mw.kind or "dense", ggn_squares=mw.ggn_squares,
                             generic_reason=None if mw.ggn_squares is not None else mw.reason or DIRECT_WEIGHT_REASON)
        self.add(label, module, mw.param, ext, convert=mw.to_canonical, blocks=mw.blocks, groups=mw.groups)

    def settle_loose(self) -> None:
        """The loose parameters no layer analyzed are skipped. Settled after the walk: a module
        registered before a layer (an ``nn.ParameterList`` holding its weight) may hold it too."""
        for label, module, p in self.loose_params:
            if id(p) not in self.by_param:
                self.skipped.add(label, module)
                self.mark(p, "skipped", "no registered extractor for its module")


def collect_layers(model: nn.Module, options: AnalysisOptions, use_fast: bool,
                   on_unsupported: str) -> tuple[list[TorchLayer], list[str], list[ParameterStatus]]:
    """The analyzed weights of ``model`` in ``named_modules()`` order, the skipped ones, and
    the status of every parameter (analyzed, excluded or skipped; method §3).

    Args:
        model: The (unwrapped) module.
        options: The analysis options (the estimator decides the reported path).
        use_fast: Whether the fast GGN rules may be used (backend option ``fast``).
        on_unsupported: ``"error"``, ``"warn"`` or ``"skip"`` (a distributed run warns
            on rank 0 only).

    Raises:
        ValueError: For no supported layer, non-finite weights, several devices, a
            refused layer configuration, or an unsupported layer with
            ``on_unsupported="error"``.
        TypeError: For non-floating weights.
    """
    with _parametrizations_in_eval(model):
        return _collect_layers(model, options, use_fast, on_unsupported)


def _collect_layers(model: nn.Module, options: AnalysisOptions, use_fast: bool,
                    on_unsupported: str) -> tuple[list[TorchLayer], list[str], list[ParameterStatus]]:
    from normflat.backends.torch import hf

    hf.register_known_layers()
    # Packed projections only their parent knows about (GPT-2's c_attn, timm's qkv).
    packed = hf.packed_blocks(model)
    walk = _Walk(model, options.estimator in GGN_ESTIMATORS, use_fast)
    skip_prefixes: list[str] = []
    for name, module in model.named_modules():
        name = compat.plain_name(name)
        if any(name == p or name.startswith(p + ".") for p in skip_prefixes):
            continue
        label = name or type(module).__name__
        entry = REGISTRY.lookup(module)
        if entry is IGNORE:
            for p in module.parameters(recurse=False):
                walk.mark(p, "excluded", IGNORED_REASON)
            continue
        if isinstance(entry, Unsupported):
            if any(True for _ in module.parameters()):
                walk.skipped.add(label, module, entry.reason)
            for p in module.parameters():
                walk.mark(p, "skipped", entry.reason)
            skip_prefixes.append(name)
            continue
        if entry is None:
            walk.loose(name, module)
            continue
        relative = relative_bias_table(name) if isinstance(module, nn.Embedding) else None
        if relative is not None:  # T5's relative_attention_bias: added to the scores (method §3)
            for p in module.parameters():
                walk.mark(p, "excluded", relative)
            skip_prefixes.append(name)
            continue
        ext: LayerExtractor = entry
        skip_prefixes.append(name)
        if ext.check is not None:
            refused = ext.check(module)
            if refused:
                raise ValueError(f"Layer {label!r} ({type(module).__name__}): {refused}.")
        if ext.weights is not None:
            for mw in ext.weights(module):
                sub = label if mw.suffix is None else f"{label}.{mw.suffix}"
                # convert=identity keeps a module-level to_canonical from applying to every weight.
                convert = mw.to_canonical or (_identity if ext.to_canonical is not None else None)
                own = ext if mw.ggn_squares is None else replace(ext, ggn_squares=mw.ggn_squares)
                walk.add(sub, module, mw.param, own, kind=mw.kind, convert=convert,
                         blocks=mw.blocks, rule=mw.ggn_squares is not None, groups=mw.groups)
        else:
            w = ext.weight(module)
            computed = w is not None and not isinstance(w, nn.Parameter)
            normed = weight_normalization(module) if computed else None
            spectral = spectral_normalization(module) if computed and normed is None else None
            if normed is not None:
                # W = g · v / ‖v‖: the direction v is the kernel analyzed (method §3, "Weight
                # normalization"), its norms g a vector like a normalization's scale.
                w, scale, _ = normed
                walk.mark(scale, "excluded", _WEIGHT_NORM_SCALE)
                rule = weight_norm_rule(ext.ggn_squares) if ext.ggn_squares is not None else None
                ext = replace(ext, ggn_squares=rule, generic_reason=None if rule else _WEIGHT_NORM_REASON)
            elif spectral is not None:
                # W = V / σ(V): V is the kernel analyzed (method §3, "Spectral normalization").
                w = spectral[0]
                rule = spectral_norm_rule(ext.ggn_squares) if ext.ggn_squares is not None else None
                ext = replace(ext, ggn_squares=rule, generic_reason=None if rule else _SPECTRAL_NORM_REASON)
            if w is not None:
                walk.add(label, module, w, ext, blocks=packed.get(id(module)) or _blocks_of(ext, module))
        # The module's other parameters (biases; sub-modules are not walked): excluded
        # by definition, or weights its extractor does not read.
        for pname, p in module.named_parameters():
            if id(p) in walk.by_param:
                continue
            full = compat.plain_name(f"{name}.{pname}" if name else pname)
            why = excluded_reason(full, tuple(p.shape))
            table = position_table(full, tuple(p.shape))
            if why is not None:
                walk.mark(p, "excluded", why)
            elif table is not None:
                walk.add(walk.names.get(id(p), full), module, p, POSITION_TABLE,
                         convert=_position_convert(table))
            elif walk.names.get(id(p)) not in walk.status:
                walk.skipped.add(full, module, "a parameter its layer extractor does not read")
                walk.mark(p, "skipped", "a parameter its layer extractor does not read")
    walk.settle_loose()
    messages = walk.skipped.report(on_unsupported)
    layers = walk.layers
    if not layers:
        raise ValueError(
            f"The model {type(model).__name__} has no supported weight layer (nn.Linear, nn.Conv1d/2d/3d, "
            "nn.ConvTranspose1d/2d/3d, nn.Embedding, nn.MultiheadAttention, nn.RNN/LSTM/GRU, or a type "
            "registered with normflat.backends.torch.register_layer)."
        )
    for layer in layers:
        if not torch.is_floating_point(layer.param):
            raise TypeError(f"Layer {layer.name!r}: weight dtype {layer.param.dtype} is not floating point.")
        if not all_finite(layer.param.detach()):
            raise ValueError(
                f"Layer {layer.name!r}: the weights contain NaN or infinite values; normflat needs "
                "a model with finite weights (check the training run or the checkpoint)."
            )
    devices = {layer.param.device for layer in layers}
    if len(devices) > 1:
        raise ValueError(
            f"The model's weights are on several devices {sorted(map(str, devices))}; normflat needs "
            "the whole model on one device (model.to(device))."
        )
    params = {compat.plain_name(n): p for n, p in model.named_parameters()}
    names = list(params)
    inventory = [walk.status.get(n) or ParameterStatus(n, tuple(params[n].shape), "skipped",
                                                       "not reached by the model walk")
                 for n in names]
    return layers, messages, inventory


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _blocks_of(ext: LayerExtractor, module: nn.Module) -> list[tuple[str, int, int]] | None:
    if ext.blocks is None:
        return None
    blocks = ext.blocks(module)
    return [(str(s), int(a), int(b)) for s, a, b in blocks] if blocks else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor has no NaN or infinity.

    One reduction decides the common case; the element-wise test runs only if the sum
    is not finite (it can overflow for huge finite values).
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
