"""What the torch backend needs to know about model libraries built on torch (Hugging Face, timm).

Everything here is looked up lazily: a library is only consulted when the user
has already imported it (``sys.modules``), so ``import normflat`` never imports
it and no hook imports a library the user has not loaded. The session calls:

* :func:`register_known_layers` before the model walk: extractors for the layer
  types of loaded libraries (Hugging Face ``Conv1D``, timm's padded and
  weight-standardized convolutions);
* :func:`packed_blocks` during the walk: the row blocks of projections that pack
  several linear maps (GPT-2's ``c_attn``, timm's ``qkv``; method §3, "Packed
  maps are split");
* :func:`is_causal_lm` to decide ``shift_labels=None`` (method §6.3);
* :func:`analysis_mode` around every forward of the analysis: Hugging Face
  attention that does not go through ``F.scaled_dot_product_attention`` (flash,
  flex) runs as ``"sdpa"``, which the session can differentiate as every
  estimator needs, and fused mixture-of-experts kernels run as the loop over the
  experts; restored on exit;
* ``expert_weights`` / ``check_experts`` and ``check_router`` (registered by
  :func:`register_known_layers`): one problem per expert and linear map of a
  transformers experts module, and the router's matrix (method §3,
  "Mixture-of-experts layers").

Which library layer maps to which canonical matrix is listed in
``docs/guide/huggingface.md`` and ``docs/guide/timm.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import sys
import threading
import weakref
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from normflat.backends.torch.ggn import (PER_SAMPLE_GRADIENTS, USE_INPUTS, Deltas, KernelSums, NoFastPath, _builtin,
                                         _conv_gradients, _conv_patches, _dense_squares, _first_of_tuple, _foldable,
                                         _inner_uses, _patch_squares, _takes_kernel_sums, _with_call, folded_patches,
                                         lookup_squares)

__all__ = ["register_known_layers", "packed_blocks", "is_causal_lm", "analysis_mode", "keyword_inputs"]

_REGISTER_LOCK = threading.Lock()


# ============================================================================ Hugging Face Conv1D


def _transposed(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    # Conv1D stores (in, out) and computes x @ W: canonical (out, in) is the transpose; a table
    # (vocabulary, features) is the embedding's (features, vocabulary) transposed (method §3).
    return t.transpose(0, 1)


#: The whole body of a Hugging Face scaled word embedding's ``forward`` (Gemma, BART, Pegasus-X,
#: M2M-100, ...): the lookup times ``embed_scale``. A class whose forward does anything else (one
#: also overwrites the rows of a special token) keeps the generic path.
_SCALED_EMBEDDING_BODIES = (
    ("return super().forward(input_ids) * self.embed_scale",),
    ("return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)",),
)

#: The whole body of Falcon's ``FalconLinear.forward``: ``nn.Linear``'s map written out.
_LINEAR_BODIES = (
    ("hidden_states = input @ self.weight.T", "if self.bias is None:", "return hidden_states",
     "return hidden_states + self.bias"),
)


@functools.lru_cache(maxsize=None)
def _forward_body(cls: Any) -> tuple[str, ...] | None:
    """The statements of ``cls.forward`` (stripped lines, without its docstring and comments), or
    ``None`` when the class has no forward of its own or its source cannot be read. Read once per
    class: every analysis looks again at the loaded classes not registered (those refused too)."""
    if not (isinstance(cls, type) and "forward" in vars(cls)):
        return None
    try:
        lines = inspect.getsource(cls.forward).splitlines()
    except (OSError, TypeError):
        return None
    body = [line.strip() for line in lines[1:] if line.strip() and not line.strip().startswith("#")]
    if body and body[0].startswith(('"""', "'''")):  # a docstring, on one or several lines
        quote = body[0][:3]
        end = next((i for i, line in enumerate(body) if line.endswith(quote) and (i or len(line) > 3)), None)
        body = [] if end is None else body[end + 1:]
    return tuple(body)


def _scaled_word_embedding(cls: Any) -> bool:
    """Whether ``cls`` is an ``nn.Embedding`` whose forward is exactly a body of
    :data:`_SCALED_EMBEDDING_BODIES` (read from its source; none readable: no)."""
    return isinstance(cls, type) and issubclass(cls, nn.Embedding) and _forward_body(cls) in _SCALED_EMBEDDING_BODIES


#: ``(len(sys.modules), [(name, module), ...])``: the loaded transformers model modules when
#: :func:`_register_transformers` last looked (looked for again when a module was loaded since).
_MODEL_MODULES: tuple[int, list[tuple[str, Any]]] = (-1, [])


def _register_transformers() -> None:
    from normflat.backends.torch.ggn import linear_squares, scaled_embedding_squares, transposed_linear_squares
    from normflat.backends.torch.layers import DIRECT_WEIGHTS, check_embedding, register_layer, registered_layers

    known = registered_layers()
    for module_name, cls_name, read in _DIRECT_WEIGHT_CLASSES:
        cls = _loaded_class(module_name, cls_name)
        if cls is not None and cls not in known and cls not in DIRECT_WEIGHTS:  # a user's own entry wins
            DIRECT_WEIGHTS[cls] = read
    conv1d = _loaded_class("transformers.pytorch_utils", "Conv1D")
    if conv1d is not None and conv1d not in known:  # a user's own entry wins
        # y = x W + b on the last axis (any leading axes): nn.Linear's rule on the transposed layout.
        register_layer(conv1d, kind="dense", to_canonical=_transposed, ggn_squares=transposed_linear_squares)
    _register_convs("transformers.")
    falcon = _loaded_class("transformers.models.falcon.modeling_falcon", "FalconLinear")
    if falcon is not None and falcon not in known and issubclass(falcon, nn.Linear) \
            and _forward_body(falcon) in _LINEAR_BODIES:
        register_layer(falcon, kind="dense", ggn_squares=linear_squares)  # F.linear written out
    global _MODEL_MODULES
    if _MODEL_MODULES[0] != len(sys.modules):  # a module loaded since the last look (3000+ of them to scan)
        _MODEL_MODULES = (len(sys.modules), [(name, module) for name, module in list(sys.modules.items())
                                             if name.startswith("transformers.models.") and module is not None])
    for name, module in _MODEL_MODULES[1]:
        for role, cls in _model_classes(name, module):
            if cls in known:  # a user's own entry wins
                continue
            if role == "scaled_embedding":
                # nn.Embedding's rule with the signals times embed_scale; tied to the head too.
                register_layer(cls, kind="embedding", to_canonical=_transposed,
                               ggn_squares=scaled_embedding_squares, check=check_embedding)
            elif role == "experts":
                register_layer(cls, kind="expert", weights=expert_weights, check=check_experts,
                               generic_reason=_EXPERTS_REASON)
            else:
                register_layer(cls, kind="router", check=check_router, ggn_squares=router_squares)


# ============================================================================ raw attention kernels


def _into_heads(t: torch.Tensor) -> torch.Tensor:
    """``(d_model, heads, d_head)`` applied as ``einsum("ibh,hnd->ibnd")`` (a projection into the
    heads) -> canonical ``(heads·d_head, d_model)``."""
    return t.reshape(t.shape[0], -1).transpose(0, 1)


def _out_of_heads(t: torch.Tensor) -> torch.Tensor:
    """``(d_model, heads, d_head)`` applied as ``einsum("ibnd,hnd->ibh")`` (the heads' output
    projection) -> canonical ``(d_model, heads·d_head)``."""
    return t.reshape(t.shape[0], -1)


def _per_head(t: torch.Tensor) -> torch.Tensor:
    """``(out, heads, d_head)`` applied per head to the head's ``d_head`` features
    (``einsum("bind,snd->bnis")``: each head's query against its own keys) -> canonical
    ``(heads·out, d_head)``, one group per head."""
    return t.transpose(0, 1).reshape(-1, t.shape[2])


def _xlnet_weights(module: nn.Module) -> list[Any]:
    """XLNet's relative attention: ``q``, ``k``, ``v`` and ``r`` (the relative positions' key
    projection) project into the heads, ``o`` out of them, ``seg_embed`` holds each head's keys of
    the two segment classes, applied to the head's query (method §3, "Attention kernels stored
    raw")."""
    from normflat.backends.torch.layers import ModuleWeight

    heads = int(module.seg_embed.shape[1])
    return [*(ModuleWeight(name, getattr(module, name), _into_heads) for name in ("q", "k", "v", "r")),
            ModuleWeight("o", module.o, _out_of_heads),
            ModuleWeight("seg_embed", module.seg_embed, _per_head, groups=heads)]


def _funnel_weights(module: nn.Module) -> list[Any]:
    """Funnel's relative attention (its query, key, value and output projections are
    ``nn.Linear`` modules of their own): ``r_kernel`` projects the relative position encodings
    into the heads (``attention_type="relative_shift"``), or maps each head's query to the model
    width (``"factorized"``: ``einsum("binh,dnh->bind")``, one group per head); ``seg_embed`` as
    XLNet's (method §3, "Attention kernels stored raw")."""
    from normflat.backends.torch.layers import ModuleWeight

    heads = int(module.seg_embed.shape[1])
    factorized = getattr(getattr(module, "config", None), "attention_type", None) == "factorized"
    kernel = (ModuleWeight("r_kernel", module.r_kernel, _per_head, groups=heads) if factorized
              else ModuleWeight("r_kernel", module.r_kernel, _into_heads))
    return [kernel, ModuleWeight("seg_embed", module.seg_embed, _per_head, groups=heads)]


def _block_diagonal(t: torch.Tensor) -> torch.Tensor:
    """``(heads, in, out)`` applied per head as ``baddbmm(b, x, W)`` (``x`` ``(heads, N, in)``) -> canonical
    ``(heads·out, in)``, one group per head."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])


def _rglru_weights(module: nn.Module) -> list[Any]:
    """RecurrentGemma's RG-LRU: its input and recurrence gates are block-diagonal dense maps, one
    ``(in, out)`` block per head, applied with ``torch.baddbmm`` in its forward (method §3, "Attention
    kernels stored raw"); its ``recurrent_param`` is a vector."""
    from normflat.backends.torch.layers import ModuleWeight

    heads = int(module.input_gate_weight.shape[0])
    reason = "a raw parameter its module applies itself (a per-head torch.baddbmm in its forward): no fast rule"
    return [ModuleWeight(name, getattr(module, name), _block_diagonal, groups=heads, reason=reason)
            for name in ("input_gate_weight", "recurrent_gate_weight")]


#: Modules whose weight matrices are raw parameters they apply themselves (transformers' XLNet and Funnel
#: attention by einsum, RecurrentGemma's RG-LRU gates by baddbmm, PEFT's embedding adapters and other
#: tuners' factors): ``(module, class, reader)`` (:data:`~normflat.backends.torch.layers.DIRECT_WEIGHTS`).
_DIRECT_WEIGHT_CLASSES = (
    ("transformers.models.xlnet.modeling_xlnet", "XLNetRelativeAttention", _xlnet_weights),
    ("transformers.models.funnel.modeling_funnel", "FunnelRelMultiheadAttention", _funnel_weights),
    ("transformers.models.recurrent_gemma.modeling_recurrent_gemma", "RecurrentGemmaRglru", _rglru_weights),
    ("peft.tuners.lora.layer", "Embedding", lambda module: _peft_embedding_weights(module)),
    ("peft.tuners.tuners_utils", "BaseTunerLayer", lambda module: _peft_adapter_weights(module)),
)


@functools.lru_cache(maxsize=None)
def _classes_of(name: str, module_id: int) -> tuple[tuple[str, type], ...]:
    """The classes a transformers model module defines that normflat registers, with their role:
    scaled word embeddings, experts and linear routers (read once per loaded module: every analysis
    looks the loaded modules through again)."""
    module = sys.modules[name]
    found: list[tuple[str, type]] = []
    for attr, cls in list(vars(module).items()):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == name):
            continue
        if attr.endswith("ScaledWordEmbedding") and _scaled_word_embedding(cls):
            found.append(("scaled_embedding", cls))
        elif _experts_class(cls) or (name, attr) in _UNDECORATED_EXPERTS:
            found.append(("experts", cls))
        elif attr.lower().endswith("router") and _linear_router(cls):
            found.append(("router", cls))
    return tuple(found)


def _model_classes(name: str, module: Any) -> tuple[tuple[str, type], ...]:
    return _classes_of(name, id(module))


# ============================================================================ mixture-of-experts layers


def _experts_class(cls: Any) -> bool:
    """Whether ``cls`` is a transformers experts module: a class decorated with
    ``use_experts_implementation`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/3, GPT-OSS, ...), whose
    forward dispatches on ``config._experts_implementation``. Its wrapper is defined in
    ``transformers.integrations.moe``; every implementation computes the same function."""
    forward = vars(cls).get("forward") if isinstance(cls, type) else None
    return (forward is not None and issubclass(cls, nn.Module)
            and getattr(forward, "__globals__", {}).get("__name__") == "transformers.integrations.moe")


#: Experts classes that predate ``use_experts_implementation``: their layout
#: ``(gated, transposed, interleaved)``. Llama 4 stores ``(experts, in, out)`` and runs every expert
#: on every token, the tokens' routing scores applied to its input.
_UNDECORATED_EXPERTS = {
    ("transformers.models.llama4.modeling_llama4", "Llama4TextExperts"): (True, True, False),
}


def _expert_layout(module: nn.Module) -> tuple[bool, bool, bool]:
    """``(gated, transposed, interleaved)`` of an experts module: the flags
    ``use_experts_implementation`` sets on it (``has_gate``, ``is_transposed``,
    ``is_concatenated``), or the known layout of an older class."""
    for cls in type(module).__mro__:
        known = _UNDECORATED_EXPERTS.get((cls.__module__, cls.__name__))
        if known is not None:
            return known
    gated = bool(getattr(module, "has_gate", True))
    return gated, bool(getattr(module, "is_transposed", False)), gated and not getattr(module, "is_concatenated", True)


def _dispatches_experts(cls: type) -> bool:
    """Whether ``cls``'s forward (its own or inherited) is ``use_experts_implementation``'s dispatch."""
    forward = getattr(cls, "forward", None)
    return getattr(forward, "__globals__", {}).get("__name__") == "transformers.integrations.moe"


def check_experts(module: nn.Module) -> str | None:
    """Why an experts module cannot be read as one matrix per expert and map, or ``None``."""
    gated, transposed, _ = _expert_layout(module)
    first = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(first, nn.Parameter) and isinstance(down, nn.Parameter) and first.ndim == 3
            and down.ndim == 3 and first.shape[0] == down.shape[0]):
        return ("its experts' weights are not two (experts, out, in) parameters gate_up_proj (or up_proj) "
                "and down_proj; register the class with normflat.backends.torch.register_layer")
    rows = first.shape[2 if transposed else 1]
    if gated and rows % 2:
        return f"gate_up_proj packs {rows} rows per expert, not a gate and an up projection of equal size"
    return None


def _expert_canonical(transposed: bool, interleaved: bool):
    """``(experts, out, in)`` (``(experts, in, out)`` stored transposed) to the canonical
    ``(experts·out, in)``: expert after expert, each expert's gate rows before its up rows
    (an interleaved ``[gate₀, up₀, gate₁, ...]`` layout is de-interleaved)."""
    def convert(t: torch.Tensor) -> torch.Tensor:
        if transposed:
            t = t.transpose(-1, -2)
        experts, rows, cols = t.shape
        if interleaved:
            t = t.reshape(experts, rows // 2, 2, cols).transpose(1, 2)
        return t.reshape(experts * rows, cols)
    return convert


def expert_weights(module: nn.Module) -> list[Any]:
    """The weights of a transformers experts module (:func:`_experts_class`) as one problem per
    expert and linear map (method §3, "Mixture-of-experts layers"): ``{e}.gate_proj`` and
    ``{e}.up_proj`` (the halves of ``gate_up_proj``; ``up_proj`` alone for experts without a
    gate) and ``{e}.down_proj``, each the ``(out, in)`` matrix expert ``e`` applies to the tokens
    routed to it. Biases do not enter the measures."""
    from normflat.backends.torch.layers import ModuleWeight

    gated, transposed, interleaved = _expert_layout(module)
    first = module.gate_up_proj if gated else module.up_proj
    down = module.down_proj
    experts = int(first.shape[0])
    rows = int(first.shape[2 if transposed else 1])
    width = int(down.shape[2 if transposed else 1])
    if gated:
        half = rows // 2
        first_blocks = [block for e in range(experts) for block in (
            (f"{e}.gate_proj", e * rows, e * rows + half), (f"{e}.up_proj", e * rows + half, (e + 1) * rows))]
    else:
        first_blocks = [(f"{e}.up_proj", e * rows, (e + 1) * rows) for e in range(experts)]
    # The fast rules recompute the routed experts as use_experts_implementation's classes define
    # them; an older class (Llama 4's: every expert on every token) and a norm after each expert
    # take the generic path.
    ruled = _dispatches_experts(type(module)) and not getattr(module, "has_post_expert_norm", False)
    return [
        ModuleWeight(None, first, to_canonical=_expert_canonical(transposed, interleaved), blocks=first_blocks,
                     ggn_squares=expert_first_squares if ruled else None),
        ModuleWeight(None, down, to_canonical=_expert_canonical(transposed, False),
                     blocks=[(f"{e}.down_proj", e * width, (e + 1) * width) for e in range(experts)],
                     ggn_squares=expert_down_squares if ruled else None),
    ]


def _expert_routing(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(top_k_index, top_k_weights)`` of an experts call ``(hidden_states, index, weights)``."""
    index = args[0] if len(args) > 0 else next(
        (kwargs[k] for k in ("top_k_index", "router_indices", "selected_experts") if k in kwargs), None)
    weights = args[1] if len(args) > 1 else next(
        (kwargs[k] for k in ("top_k_weights", "routing_weights") if k in kwargs), None)
    if not (isinstance(index, torch.Tensor) and isinstance(weights, torch.Tensor)):
        raise NoFastPath("the experts are not called as (hidden_states, top_k_index, top_k_weights)")
    return index, weights


class _RoutedExperts:
    """One call of a transformers experts module, recomputed expert by expert for the fast rules.

    Expert ``e`` maps each token ``x`` routed to it (slot ``s`` of its top-k, routing weight
    ``w``) to ``w · (W_down (g(W_gu x + b_gu)) + b_down)``, ``g`` the module's own ``_apply_gate``
    (``act_fn`` without a gate), in the stored row order; the module's output is the sum over a
    token's slots. The rules back-propagate the signals at that output through this map, one
    expert at a time, and sum each sample's per-token gradients (method §6.1, "Mixture-of-experts
    layers")."""

    def __init__(self, module: nn.Module, x: torch.Tensor, args: tuple, kwargs: dict) -> None:
        if getattr(module, "has_post_expert_norm", False):
            raise NoFastPath("a normalization after each expert")
        self.module = module
        self.gated, self.transposed, _ = _expert_layout(module)
        index, weights = _expert_routing(args, kwargs)
        # A folded (n, f, H) input: f tokens per sample (the session's rows per sample).
        self.rows_per_sample = int(x.shape[1]) if x.dim() == 3 else 1
        self.x = x.reshape(-1, x.shape[-1])
        tokens = self.x.shape[0]
        if x.dim() not in (2, 3) or index.shape[0] != tokens or weights.shape[0] != tokens:
            raise NoFastPath("the experts' tokens are not one row of (hidden_states, top_k_index, top_k_weights)")
        self.index = index.detach().reshape(tokens, -1)
        self.weights = weights.detach().reshape(tokens, -1).to(self.x.dtype)
        self.first = module.gate_up_proj if self.gated else module.up_proj
        self.down = module.down_proj
        bias = getattr(module, "has_bias", False)
        self.first_bias = getattr(module, "gate_up_proj_bias" if self.gated else "up_proj_bias", None) if bias else None
        self.down_bias = getattr(module, "down_proj_bias", None) if bias else None

    def matrix(self, p: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e``'s ``(out, in)`` matrix of the stacked parameter ``p`` (stored row order)."""
        w = p[e].detach()
        return w.transpose(0, 1) if self.transposed else w

    def gate(self, u: torch.Tensor) -> torch.Tensor:
        return self.module._apply_gate(u) if self.gated else self.module.act_fn(u)

    def experts(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per expert hit: ``(e, tokens, routing weights, pre-activations u = W_gu x + b)``."""
        for e in range(int(self.first.shape[0])):
            tok, slot = torch.where(self.index == e)
            if tok.numel() == 0:
                continue
            u = self.x[tok] @ self.matrix(self.first, e).transpose(0, 1)
            if self.first_bias is not None:
                u = u + self.first_bias[e].detach()
            yield e, tok, self.weights[tok, slot], u

    def output(self) -> torch.Tensor:
        """The module's output recomputed (to check it against the module's own forward)."""
        out = torch.zeros_like(self.x)
        for e, tok, w, u in self.experts():
            y = self.gate(u) @ self.matrix(self.down, e).transpose(0, 1)
            if self.down_bias is not None:
                y = y + self.down_bias[e].detach()
            out.index_add_(0, tok, w[:, None] * y)
        return out

    def padded(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Each sample's routed tokens in rows of their own: ``(row, position)`` per token of
        ``tok`` (ascending) in an ``(samples hit, most tokens of one sample)`` grid."""
        sample = torch.div(tok, self.rows_per_sample, rounding_mode="floor")
        _, row, counts = torch.unique_consecutive(sample, return_inverse=True, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(tok.numel(), device=tok.device) - torch.repeat_interleave(starts, counts)
        return row, position, int(counts.shape[0])


def _grid(values: torch.Tensor, row: torch.Tensor, position: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``values`` ``(tokens, d)`` placed at ``(row, position)`` of zeros ``(rows, width, d)``
    (``(rows, d)`` for one position: the rank-one sums of a dense layer)."""
    if width == 1:
        return values.new_zeros((rows, values.shape[-1])).index_copy_(0, row, values)
    grid = values.new_zeros((rows, width, values.shape[-1]))
    grid[row, position] = values
    return grid


def _expert_squares(module: nn.Module, x: torch.Tensor, deltas: Any, args: tuple, kwargs: dict | None,
                    out: torch.Tensor | None, which: str) -> torch.Tensor:
    """Sums of squared per-sample gradients of one stacked experts parameter, ``(K, *shape)``:
    per expert, the dense rule on the tokens routed to it, each sample's tokens its positions."""
    call = _RoutedExperts(module, x, args, kwargs or {})
    _check_experts_forward(call)
    param = call.first if which == "first" else call.down
    k, m = deltas.k, deltas.m
    res = out if out is not None else param.new_zeros((k, *param.shape))
    flat = [None if p is None else p.reshape(-1, p.shape[-1]) for p in deltas.parts]
    live = [j for j, p in enumerate(flat) if p is not None]
    for e, tok, w, u in call.experts():
        row, position, rows = call.padded(tok)
        width = int(position.max()) + 1
        down = call.matrix(call.down, e)  # (H, I)
        # The signals at expert e's output for its tokens: the routing weight times the module's.
        at_output = torch.stack([w[:, None] * flat[j][tok] for j in live])  # (S, tokens, H)
        if which == "down":
            a = call.gate(u)
            signals = at_output
        else:
            a = call.x[tok]
            at_gate = at_output @ down  # (S, tokens, I): at the gate's output
            # The gate acts on each row's last axis: one backward for every signal at once.
            stacked = u.detach().expand(at_gate.shape[0], *u.shape).clone().requires_grad_(True)
            with torch.enable_grad():
                signals = torch.autograd.grad(call.gate(stacked), stacked, at_gate)[0]  # (S, tokens, rows)
        parts: list[torch.Tensor | None] = [None] * (k * m)
        for j, sig in zip(live, signals):
            parts[j] = _grid(sig, row, position, rows, width)
        target = res[:, e].transpose(1, 2) if call.transposed else res[:, e]
        _dense_squares(_grid(a, row, position, rows, width), Deltas(parts, k, m), int(target.shape[1]),
                       int(target.shape[2]), target)
    return res


#: Experts modules whose forward was checked against :meth:`_RoutedExperts.output` (by identity),
#: and routers checked by :func:`router_squares`; written under :data:`_CHECKED_LOCK` (analyses in
#: threads).
_CHECKED_EXPERTS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
_CHECKED_LOCK = threading.Lock()


def _checked_once(cache: "weakref.WeakKeyDictionary[nn.Module, bool]", module: nn.Module,
                  check: Any) -> bool:
    """``check()``, the first time ``module`` is looked up in ``cache``; its answer after that
    (written under :data:`_CHECKED_LOCK`: analyses in threads)."""
    with _CHECKED_LOCK:
        ok = cache.get(module)
    if ok is None:
        ok = bool(check())
        with _CHECKED_LOCK:
            cache[module] = ok
    return ok


def _agrees(value: Any, reference: torch.Tensor) -> bool:
    """Whether ``value`` is a tensor of ``reference``'s shape within 1000 units of rounding of its
    dtype, relative to its largest entry: what a module's own forward and a rule's reading of it
    may differ by."""
    if not isinstance(value, torch.Tensor) or value.shape != reference.shape:
        return False
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    tol = 1e3 * torch.finfo(reference.dtype).eps * max(scale, 1e-30)
    return bool((value.to(reference.dtype) - reference).abs().max() <= tol)


def _check_experts_forward(call: _RoutedExperts) -> None:
    """Once per module: its own forward (hooks bypassed) on a few of the call's tokens computes what
    the rules assume; otherwise the generic path, which differentiates the forward itself."""
    module = call.module

    def check() -> bool:
        few = slice(0, min(64, call.x.shape[0]))
        sub = _RoutedExperts(module, call.x[few], (call.index[few], call.weights[few]), {})
        with torch.no_grad():
            want = type(module).forward(module, call.x[few], call.index[few], call.weights[few].to(call.x.dtype))
            got = sub.output()
        return isinstance(want, torch.Tensor) and _agrees(got, want)

    if not _checked_once(_CHECKED_EXPERTS, module, check):
        raise NoFastPath("the experts' forward does not compute the routed gated MLP the fast rule assumes")


@_inner_uses
@_foldable
@_with_call
@_builtin
def expert_first_squares(module: nn.Module, x: torch.Tensor, deltas: Any, args: tuple = (),
                         kwargs: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of a transformers experts module's ``gate_up_proj`` (``up_proj``), ``(K, *shape)``."""
    return _expert_squares(module, x, deltas, args, kwargs, out, "first")


@_inner_uses
@_foldable
@_with_call
@_builtin
def expert_down_squares(module: nn.Module, x: torch.Tensor, deltas: Any, args: tuple = (),
                        kwargs: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of a transformers experts module's ``down_proj``, ``(K, *shape)``."""
    return _expert_squares(module, x, deltas, args, kwargs, out, "down")


_ROUTER_READ = re.compile(r"linear\(\s*[^,()]+(?:\([^()]*\))?\s*,\s*self\.weight")
_ROUTER_ALSO = re.compile(r"self\.weight\.(?:t\(\)|dtype)")


@functools.lru_cache(maxsize=None)
def _linear_router(cls: Any) -> bool:
    """Whether ``cls`` is a transformers router whose forward reads its ``(experts, features)``
    ``weight`` only as ``F.linear(hidden_states, self.weight)`` (cast or not; also ``mm`` with
    ``self.weight.t()``; an ``nn.Linear`` subclass by ``super().forward``): the router logits are
    that linear map of the tokens (read from the forward's source)."""
    body = _forward_body(cls)
    if not body:
        return False
    text = " ".join(body)
    rest, reads = _ROUTER_READ.subn("", text)
    if issubclass(cls, nn.Linear):  # PhiMoE's, Llama 4's: nn.Linear's own map, then the routing
        rest, more = re.subn(r"super\(\)\.forward\(", "", rest)
        reads += more
    return reads > 0 and "self.weight" not in _ROUTER_ALSO.sub("", rest)


#: Routers whose forward was checked to return their linear map's output first (by identity).
_CHECKED_ROUTERS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


@_first_of_tuple
@_foldable
@_builtin
def router_squares(module: nn.Module, x: torch.Tensor, deltas: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fast GGN rule of a router (:func:`_linear_router`): ``nn.Linear``'s, with the signals taken at
    the router logits it returns first (the session's capture), which are ``F.linear(x, weight)``,
    cast or not, its bias added or not. The router's softmax and top-k inside it lie between those logits and the model's,
    so the signals there carry them. Checked once per module on a few tokens: otherwise the generic
    path."""
    weight = module.weight
    like = next(p for p in deltas.parts if p is not None)
    rows = x.reshape(-1, x.shape[-1])
    def check() -> bool:
        few = rows[:64]
        bias = getattr(module, "bias", None)
        with torch.no_grad():
            returned = type(module).forward(module, few)
            first = returned[0] if isinstance(returned, tuple) and returned else None
            want = [F.linear(few.to(like.dtype), weight.detach().to(like.dtype))]
            if isinstance(bias, torch.Tensor):  # GPT-OSS's router adds its bias (no change to the signals)
                want.append(want[0] + bias.detach().to(like.dtype))
        return any(_agrees(first, w) for w in want)

    if not _checked_once(_CHECKED_ROUTERS, module, check):
        raise NoFastPath("the router does not return F.linear(hidden_states, weight) first")
    experts, features = weight.shape
    # The logits' dtype (a router may compute in float32); the sums in the weight's.
    a = x.to(like.dtype).reshape(*x.shape[:-1], features)
    if out is not None and out.dtype == like.dtype:
        return _dense_squares(a, deltas, experts, features, out)
    res = _dense_squares(a, deltas, experts, features).to(weight.dtype)
    return res if out is None else out.add_(res)


def check_router(module: nn.Module) -> str | None:
    """Why a router cannot be read as its ``(experts, features)`` matrix, or ``None``."""
    w = getattr(module, "weight", None)
    if not (isinstance(w, nn.Parameter) and w.ndim == 2):
        return "its weight is not an (experts, features) parameter; register the class with register_layer"
    return None


#: Why an experts module without a fast rule takes the generic path.
_EXPERTS_REASON = "experts of a class the fast rule does not know (every expert on every token, or a norm after each)"


# ============================================================================ PEFT


def _peft_embedding_read(module: nn.Module, adapter: str, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(A, B, s)`` of one adapter of PEFT's LoRA ``Embedding``, detached, where its forward is the one the
    rules read: ``base(x) + F.embedding(x, Aᵀ) Bᵀ · s`` (times the base's ``embed_scale``, Gemma 3's);
    :class:`NoFastPath` otherwise (a merged or disabled adapter, another variant such as DoRA,
    tensor-parallel hooks, a lookup that renormalizes or rescales the rows, adapters chosen per sample)."""
    base = module.get_base_layer()
    if module.merged or module.disable_adapters or adapter not in module.active_adapters \
            or adapter in getattr(module, "lora_variant", {}) or kwargs.get("adapter_names") is not None:
        raise NoFastPath("the LoRA adapter is merged, disabled, inactive, chosen per sample or a variant (DoRA)")
    if module.input_fns.get(adapter) is not None or module.output_fns.get(adapter) is not None:
        raise NoFastPath("the LoRA adapter's lookup has tensor-parallel hooks")
    if base.max_norm is not None or base.scale_grad_by_freq:
        raise NoFastPath("the lookup renormalizes its rows (max_norm) or scales its gradients by frequency")
    scale = module.scaling[adapter]
    embed_scale = module._get_embed_scale() if hasattr(module, "_get_embed_scale") else None
    if embed_scale is not None:
        scale = scale * float(embed_scale)
    return module.lora_embedding_A[adapter].detach(), module.lora_embedding_B[adapter].detach(), scale


#: ``{(adapter, "A" | "B"): rule}``: the fast rules of PEFT's LoRA ``Embedding`` factors, one pair per
#: adapter name (a rule object is a weight kind's identity).
_PEFT_EMBEDDING_RULES: dict[tuple[str, str], Any] = {}
_PEFT_LOCK = threading.Lock()


def peft_embedding_rule(adapter: str, factor: str) -> Any:
    """The fast GGN rule of factor ``"A"`` or ``"B"`` of adapter ``adapter`` of PEFT's LoRA ``Embedding``
    (``base(x) + F.embedding(x, Aᵀ) Bᵀ · s``; ``A`` ``(r, V)``, ``B`` ``(d, r)``, method §6.1 "LoRA
    adapters"), from the module's ids and the signals ``g`` at its output: ``A`` is a table of ``r``
    features looked up at the ids, whose per-sample gradient gathers ``s·g B`` into the rows read
    (as ``nn.Embedding``'s); ``B`` is the dense rule on ``u = s·Aᵀ[ids]`` and ``g``. Squares in the
    parameter's own layout."""
    key = (adapter, factor)
    with _PEFT_LOCK:
        if key not in _PEFT_EMBEDDING_RULES:
            _PEFT_EMBEDDING_RULES[key] = _make_peft_embedding_rule(adapter, factor)
        return _PEFT_EMBEDDING_RULES[key]


def _make_peft_embedding_rule(adapter: str, factor: str) -> Any:
    @_with_call
    @_builtin
    def squares(module: nn.Module, ids: torch.Tensor, deltas: Deltas, args: tuple = (), kwargs: dict | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        a, b, scale = _peft_embedding_read(module, adapter, kwargs or {})
        padding = module.get_base_layer().padding_idx
        if factor == "B":  # the dense rule on u = s·Aᵀ[ids] (n, ..., r)
            return _dense_squares(F.embedding(ids, a.T, padding_idx=padding) * scale, deltas, b.shape[0], b.shape[1],
                                  out)
        # A: the signals at its lookup (n, ..., r) are s·g B, in the dtype of the sums.
        mapped = Deltas([None if p is None else (p.to(a.dtype) @ b).mul_(scale) for p in deltas.parts],
                        deltas.k, deltas.m)
        deltas.parts.clear()
        sums = lookup_squares(a.T, ids, padding, mapped, None if out is None else out.transpose(1, 2))
        return sums.transpose(1, 2)  # (K, V, r) over A's (r, V)

    squares.__name__ = squares.__qualname__ = f"peft_embedding_{factor.lower()}_squares[{adapter}]"
    return squares


def _peft_embedding_weights(module: nn.Module) -> list[Any]:
    """PEFT's LoRA ``Embedding``: each adapter's ``lora_embedding_A`` ``(r, V)`` (a table of ``r`` features,
    canonical as stored) and ``lora_embedding_B`` ``(d, r)`` (a dense map, canonical as stored), which
    its forward applies itself (method §3, "LoRA adapters"); the base table is its ``base_layer``'s."""
    from normflat.backends.torch.layers import ModuleWeight

    out = []
    for adapter, a in module.lora_embedding_A.items():
        b = module.lora_embedding_B[adapter]
        out += [ModuleWeight(f"lora_embedding_A.{adapter}", a, kind="embedding",
                             ggn_squares=peft_embedding_rule(adapter, "A")),
                ModuleWeight(f"lora_embedding_B.{adapter}", b, kind="dense", ggn_squares=peft_embedding_rule(adapter, "B"))]
    return out


#: Why the factors PEFT's other adapters (AdaLoRA, LoHa, LoKr, ...) apply themselves take the generic path.
_PEFT_ADAPTER_REASON = ("a PEFT adapter's factor its layer applies itself (a product or Kronecker product of "
                        "factors formed in its forward): no fast rule")


def _peft_adapter_weights(module: nn.Module) -> list[Any]:
    """The raw factor parameters of a PEFT tuner layer (its class's ``adapter_layer_names``, each a
    ``ParameterDict`` per adapter: AdaLoRA's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)``, LoHa's
    ``hada_w*``, LoKr's ``lokr_w*``) with two axes or more, each one matrix as stored (a kernel with
    four axes as a convolution's), on the generic path (method §3, "LoRA adapters"); vectors and
    scalars among them (AdaLoRA's ``lora_E``) are left to the engine's rule. Adapters held as modules
    (LoRA's ``lora_A``, ``lora_B``) are read as the layers they are."""
    from normflat.backends.torch.layers import ModuleWeight
    from normflat.engine.registry import excluded_reason

    out = []
    for attr in getattr(type(module), "adapter_layer_names", ()):
        container = getattr(module, attr, None)
        if not isinstance(container, nn.ParameterDict):
            continue
        for adapter, param in container.items():
            if param.dim() < 2 or excluded_reason(f"{attr}.{adapter}", tuple(param.shape)) is not None:
                continue
            kind = "dense" if param.dim() == 2 else f"conv{param.dim() - 2}d"
            out.append(ModuleWeight(f"{attr}.{adapter}", param, kind=kind, reason=_PEFT_ADAPTER_REASON))
    return out


# ============================================================================ timm

def _same_padded(a: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
                 value: float = 0.0) -> torch.Tensor:
    """``a`` padded as TensorFlow's ``"SAME"`` convolutions pad it (timm's ``pad_same``, Hugging
    Face's ``DynamicPad2d``): per spatial axis of size ``i``, ``max((⌈i/s⌉ − 1)·s + (k − 1)·d + 1 − i,
    0)`` in all, the odd one at the end."""
    pads: list[int] = []
    for axis in reversed(range(len(kernel))):
        size = int(a.shape[a.ndim - len(kernel) + axis])
        total = max((-(-size // stride[axis]) - 1) * stride[axis] + (kernel[axis] - 1) * dilation[axis] + 1 - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(a, pads, value=value) if any(pads) else a


def _timm_same(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    # timm's Conv2dSame always pads; its Std*Same classes when the padding was not static.
    if getattr(module, "same_pad", True):
        return _same_padded(a, tuple(module.weight.shape[2:]), tuple(module.stride), tuple(module.dilation))
    return a


def _hf_dynamic_pad(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    pad = getattr(module, "pad", None)  # Hugging Face BiT: a DynamicPad2d module, or None (static padding)
    if pad is None:
        return a
    return _same_padded(a, tuple(pad.kernel_size), tuple(pad.stride), tuple(pad.dilation), float(pad.value))


def _unpadded(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
    return a


def _timm_scaled_gain(module: nn.Module) -> torch.Tensor:
    # ScaledStdConv2d: batch_norm's affine weight is gain · scale (scale = γ / √fan-in, a float).
    return (module.gain.detach() * module.scale).reshape(-1)


@dataclasses.dataclass(frozen=True)
class _ConvForward:
    """What a convolution's own forward does before ``F.convNd(x, weight, bias, stride, padding,
    dilation, groups)`` with its attributes: ``pad`` its input (``(module, x) -> x``), and, when
    ``standardized``, apply ``γ (W − mean) / √(var + eps)`` per output channel instead of the
    parameter ``W`` (mean and biased variance over the channel's ``in/groups·∏k`` entries, ``eps``
    the module's, ``γ`` ``gain(module)`` or ones): timm's and Hugging Face's weight standardization."""

    pad: Any
    standardized: bool = False
    gain: Any = None
    does: str = "pads its input"


#: The convolutions whose forward pads its input itself or standardizes the weight first, by
#: module and class name. Their parameter is still a convolution kernel (canonical as stored),
#: with a fast rule of its own (:func:`conv_rule`).
_KNOWN_CONVS: dict[str, dict[str, _ConvForward]] = {
    "timm.layers.conv2d_same": {"Conv2dSame": _ConvForward(_timm_same)},
    "timm.layers.std_conv": {
        "StdConv2d": _ConvForward(_unpadded, True, does="standardizes its weight"),
        "StdConv2dSame": _ConvForward(_timm_same, True, does="standardizes its weight"),
        "ScaledStdConv2d": _ConvForward(_unpadded, True, _timm_scaled_gain, "standardizes and scales its weight"),
        "ScaledStdConv2dSame": _ConvForward(_timm_same, True, _timm_scaled_gain,
                                            "standardizes and scales its weight"),
    },
    "transformers.models.bit.modeling_bit": {
        "WeightStandardizedConv2d": _ConvForward(_hf_dynamic_pad, True, does="standardizes its weight")},
}


def _standardization(module: nn.Module, form: _ConvForward
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(applied weight, u, γ/σ)``: the kernel the forward convolves with, and for a standardized
    one the standardized rows ``u = (W − mean)/σ`` ``(out, in/groups·∏k)`` and the factor ``(out, 1)``
    of the Jacobian ``∂W'/∂W = (γ/σ)(I − 11ᵀ/m − uuᵀ/m)`` of each output channel's ``m`` entries
    (method §6.1, "Weight-standardized convolutions")."""
    w = module.weight.detach()
    if not form.standardized:
        return w, None, None
    rows = w.reshape(w.shape[0], -1)
    centered = rows - rows.mean(1, keepdim=True)
    sigma = (centered.square().mean(1, keepdim=True) + float(module.eps)).sqrt()
    u = centered / sigma
    gain = form.gain(module).to(w.dtype).reshape(-1, 1) if form.gain is not None else torch.ones_like(sigma)
    return (gain * u).reshape(w.shape), u, gain / sigma


#: Convolutions whose forward was checked against their rule's reading of it (by identity), written
#: under :data:`_CHECKED_LOCK`.
_CHECKED_CONVS: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _check_conv_forward(module: nn.Module, a: torch.Tensor, form: _ConvForward) -> None:
    """Once per module: its own forward (hooks bypassed) on two of the inputs equals the applied
    weight times the patches of the padded input, with the bias, as the rule reads them; otherwise
    the generic path, which differentiates the forward itself."""
    def check() -> bool:
        few = a[:2]
        with torch.no_grad():
            want = type(module).forward(module, few)
            weight, _, _ = _standardization(module, form)
            patches = _conv_patches(module, form.pad(module, few))  # (n, g, m, L)
            n, g = patches.shape[:2]
            got = torch.matmul(weight.reshape(g, weight.shape[0] // g, -1), patches)
            if module.bias is not None:
                got = got + module.bias.detach().reshape(g, -1, 1)
        return (isinstance(want, torch.Tensor) and want.numel() == got.numel()
                and want.shape[:2] == (n, weight.shape[0]) and _agrees(got, want.reshape(got.shape)))

    if not _checked_once(_CHECKED_CONVS, module, check):
        raise NoFastPath(f"its forward does not compute what {type(module).__name__}'s rule assumes (it "
                         f"{form.does} before the convolution)")


def conv_rule(form: _ConvForward) -> Any:
    """The fast GGN rule of a convolution whose forward does ``form``.

    The captured input is padded as the forward pads it, then unfolded. A plain kernel takes
    ``nn.ConvNd``'s rule on those patches. A standardized one: each per-sample gradient of the
    applied kernel, ``g``, becomes ``(γ/σ)(g − mean(g)·1 − u·s)`` with ``s = uᵀg/m``. The mean is
    removed by centering each patch over its ``m`` entries (``δ Ũᵀ = g − mean(g)·1``), so ``nn.ConvNd``'s
    rule on the centered patches gives ``Σ g̃²``; the ``u`` direction is two more sums,
    ``Σ s²`` (per channel) and ``Σ s·g̃`` (one weight-gradient product of the signals weighted by
    ``s``, per group of signals): ``Σ G² = (γ/σ)² (Σ g̃² − 2u ⊙ Σ s g̃ + u² Σ s²)``.
    """

    def squares(module: nn.Module, a: torch.Tensor, deltas: Deltas,
                out: torch.Tensor | KernelSums | None = None) -> torch.Tensor | KernelSums:
        if module.padding_mode != "zeros":
            raise NoFastPath(f"padding_mode={module.padding_mode!r}, which its forward does not apply")
        _check_conv_forward(module, a.flatten(0, 1) if a.dim() == module.weight.dim() + 1 else a, form)
        patches = folded_patches(module, a, deltas, form.pad)  # (n, g, m, L)
        shape = tuple(module.weight.shape)
        if not form.standardized:
            return _patch_squares(patches, deltas, shape, out)
        _, u, factor = _standardization(module, form)
        assert u is not None and factor is not None
        n, g, m, L = patches.shape
        cout_g = shape[0] // g
        patches = patches - patches.mean(2, keepdim=True)
        u = u.to(patches.dtype).reshape(g, cout_g, m)
        along = torch.matmul(u, patches)  # uᵀ times each patch: (n, g, cout_g, L)
        k, per = deltas.k, deltas.m
        s_squares = patches.new_zeros(k, g, cout_g)
        s_cross = patches.new_zeros(k, g, cout_g, m)
        for group in range(k):
            weighted = None
            for j in range(group * per, (group + 1) * per):
                if deltas.parts[j] is None:
                    continue
                d = deltas.parts[j].reshape(n, g, cout_g, L)
                s = (d * along).sum(-1) / m  # (n, g, cout_g)
                s_squares[group] += s.square().sum(0)
                term = d * s[..., None]
                weighted = term if weighted is None else weighted.add_(term)
            if weighted is not None:
                s_cross[group] = torch.einsum("ngol,ngml->gom", weighted, patches)
        centered = _patch_squares(patches, deltas, shape)  # Σ g̃², (K, *shape)
        res = centered.reshape(k, g, cout_g, m) - 2 * u * s_cross + u.square() * s_squares[..., None]
        res = (res * factor.to(res.dtype).reshape(g, cout_g, 1).square()).reshape(k, *shape)
        return res if out is None else out.add_(res)

    def prepared(module: nn.Module, a: torch.Tensor) -> torch.Tensor:
        _check_conv_forward(module, a, form)
        return _conv_patches(module, form.pad(module, a))

    def gradients(module: nn.Module, patches: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        g = _conv_gradients(module, patches, d)  # of the applied kernel, (n, *shape)
        if not form.standardized:
            return g
        _, u, factor = _standardization(module, form)
        assert u is not None and factor is not None
        rows = g.reshape(g.shape[0], *u.shape)
        rows = rows - rows.mean(-1, keepdim=True)
        s = (rows * u).sum(-1, keepdim=True) / u.shape[-1]
        return ((rows - u * s) * factor).reshape(g.shape)

    squares = _foldable(_builtin(squares))
    if not form.standardized:
        squares = _takes_kernel_sums(squares)
    squares.__doc__ = conv_rule.__doc__
    # A kernel used by several calls or modules sums their per-sample gradients before squaring.
    PER_SAMPLE_GRADIENTS[squares] = gradients
    USE_INPUTS[squares] = prepared
    return squares


#: One rule per form, made once (a weight tied across modules needs one rule object per kind).
_CONV_RULES: dict[_ConvForward, Any] = {}


def _register_convs(prefix: str) -> None:
    """Register the rules of the loaded :data:`_KNOWN_CONVS` classes of one library (its module
    prefix); never replaces a user's entry."""
    from normflat.backends.torch.layers import register_layer, registered_layers

    known = registered_layers()
    for module_name, classes in _KNOWN_CONVS.items():
        if not module_name.startswith(prefix):
            continue
        for cls_name, form in classes.items():
            cls = _loaded_class(module_name, cls_name)
            if cls is None or not issubclass(cls, nn.Conv2d) or cls in known:
                continue
            if form not in _CONV_RULES:
                _CONV_RULES[form] = conv_rule(form)
            register_layer(cls, kind="conv2d", groups=_groups_of, ggn_squares=_CONV_RULES[form])


_CONDCONV_REASON = ("CondConv2d mixes several expert kernels per sample (routing weights), so its "
                    "parameter is not one weight matrix applied to inputs")


def _groups_of(module: nn.Module) -> int:
    return int(module.groups)


def _register_timm() -> None:
    from normflat.backends.torch.ggn import linear_squares
    from normflat.backends.torch.layers import register_layer, registered_layers

    known = registered_layers()
    linear = _loaded_class("timm.layers.linear", "Linear")
    if linear is not None and issubclass(linear, nn.Linear) and linear not in known:
        # nn.Linear with its own forward only to cast the weight to the input's dtype under
        # TorchScript (MobileNetV3's and GhostNet's classifiers): F.linear otherwise, the same map.
        register_layer(linear, kind="dense", ggn_squares=linear_squares)
    _register_convs("timm.")
    cond = getattr(sys.modules.get("timm.layers.cond_conv2d"), "CondConv2d", None)
    if isinstance(cond, type) and issubclass(cond, nn.Module) and cond not in known:
        register_layer(cond, unsupported=_CONDCONV_REASON)


def register_known_layers() -> None:
    """Register the extractors of the layer types of already-imported libraries.

    Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, ImageGPT...):
    a dense layer stored ``(in, out)``, canonical transposed (method §3), with
    ``nn.Linear``'s fast GGN rule on the transposed layout
    (:func:`~normflat.backends.torch.ggn.transposed_linear_squares`; inputs may
    have sequence axes). timm: ``Linear`` (an ``nn.Linear`` whose forward casts the weight
    only under TorchScript) takes ``nn.Linear``'s rule; ``Conv2dSame`` and the weight-standardized
    convolutions (and Hugging Face BiT's ``WeightStandardizedConv2d``) are convolutions with
    rules of their own (:func:`conv_rule`); ``CondConv2d`` is refused with its reason. PEFT: the
    adapters its tuner layers apply themselves (:data:`_DIRECT_WEIGHT_CLASSES`).
    Idempotent, never imports a library, and never replaces an entry the user registered
    (``normflat.backends.torch.register_layer``).
    """
    with _REGISTER_LOCK:
        if "transformers" in sys.modules or "peft" in sys.modules:
            _register_transformers()
        if "timm" in sys.modules:
            _register_timm()


# ============================================================================ packed projections


def _loaded_class(module_name: str, cls_name: str) -> type | None:
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls if isinstance(cls, type) else None


def _adapted(child: Any) -> tuple[Any, list[nn.Module]]:
    """``(base layer, adapter layers with the same output rows)`` of a projection that PEFT wrapped
    (a LoRA adapter's ``lora_B``: ``base(x) + lora_B(lora_A(x)) · s``), or ``(child, [])`` for any other.

    PEFT's tuner layers (classes of ``peft.tuners``) keep the projection they adapt as
    ``base_layer`` and add their output to it, so a packed projection stays packed: its blocks
    apply to the base layer and to each ``lora_B`` linear map, whose output rows are the base's.
    """
    adapters: list[nn.Module] = []
    while (isinstance(child, nn.Module) and type(child).__module__.startswith("peft.")
           and isinstance(getattr(child, "base_layer", None), nn.Module)):
        lora_b = child._modules.get("lora_B")
        if isinstance(lora_b, nn.ModuleDict):
            adapters.extend(m for m in lora_b.values() if isinstance(m, nn.Linear))
        child = child.base_layer
    return child, adapters


def _sharing_rows(base: nn.Module, adapters: list[nn.Module], rows: int) -> list[nn.Module]:
    """The packed projection and those of its adapters with its ``rows`` output rows (split alike)."""
    return [base, *(m for m in adapters if m.out_features == rows)]


def _hf_packed(module: nn.Module) -> tuple[list[nn.Module], list[tuple[str, int, int]]] | None:
    """GPT-2-style attention: ``c_attn`` (a ``Conv1D``) packs query, key and value (self
    attention) or key and value (cross attention, the query is ``q_attn``), each
    ``split_size`` wide, split in that order by the forward (also under a PEFT adapter:
    :func:`_adapted`)."""
    if not type(module).__module__.startswith("transformers.") or not type(module).__name__.endswith("Attention"):
        return None
    conv1d = _loaded_class("transformers.pytorch_utils", "Conv1D")
    c_attn, adapters = _adapted(module._modules.get("c_attn"))
    width = getattr(module, "split_size", None)
    if conv1d is None or not isinstance(c_attn, conv1d) or not isinstance(width, int) or width < 1:
        return None
    q_attn, _ = _adapted(module._modules.get("q_attn"))
    names = ("key", "value") if isinstance(q_attn, conv1d) else ("query", "key", "value")
    if c_attn.weight.shape[1] != len(names) * width:
        return None
    return (_sharing_rows(c_attn, adapters, len(names) * width),
            [(s, i * width, (i + 1) * width) for i, s in enumerate(names)])


#: timm attention classes whose ``qkv`` output is reshaped ``(B, N, 3, heads, head_dim)``:
#: rows ``[query | key | value]``, each ``heads · head_dim`` wide.
_TIMM_QKV_CLASSES = (("timm.layers.attention", "Attention"), ("timm.layers.attention", "AttentionRope"))


def _timm_packed(module: nn.Module) -> tuple[list[nn.Module], list[tuple[str, int, int]]] | None:
    if not type(module).__module__.startswith("timm."):
        return None
    classes = tuple(c for c in (_loaded_class(*entry) for entry in _TIMM_QKV_CLASSES) if c is not None)
    if not classes or not isinstance(module, classes):
        return None
    qkv, adapters = _adapted(module._modules.get("qkv"))
    width = getattr(module, "attn_dim", None)
    if not isinstance(qkv, nn.Linear) or not isinstance(width, int) or qkv.out_features != 3 * width:
        return None
    return (_sharing_rows(qkv, adapters, 3 * width),
            [(s, i * width, (i + 1) * width) for i, s in enumerate(("query", "key", "value"))])


def packed_blocks(model: nn.Module) -> dict[int, list[tuple[str, int, int]]]:
    """The projections of ``model`` that pack several linear maps along their rows.

    A packed projection is one module whose output the enclosing attention module
    splits into query, key and value (method §3, "Packed maps are split"): GPT-2's
    ``c_attn`` (``Conv1D``, also OpenAI GPT, ImageGPT, Decision Transformer; a
    cross-attention ``c_attn`` packs key and value, its ``q_attn`` is one matrix)
    and timm's ``Attention.qkv``, also under a PEFT (LoRA) adapter, whose ``lora_B`` maps
    get the same blocks. Only the parent module knows this, so the walk asks here, once
    per model.

    Args:
        model: The (unwrapped) model.

    Returns:
        ``{id(projection module): [(suffix, start, stop), ...]}``, canonical row
        blocks; empty when no library is loaded or nothing is packed.
    """
    found: dict[int, list[tuple[str, int, int]]] = {}
    hf = "transformers" in sys.modules
    timm = "timm" in sys.modules
    if not (hf or timm):
        return found
    for module in model.modules():
        hit = (_hf_packed(module) if hf else None) or (_timm_packed(module) if timm else None)
        if hit is not None:
            for projection in hit[0]:
                found[id(projection)] = hit[1]
    return found


# ============================================================================ causal language models


def _hf_model(model: Any) -> Any:
    """The transformers model behind ``model``: itself, the model inside normflat's ``HFLogits`` view,
    or the model a PEFT model adapts.

    A PEFT model (``PeftModel`` and its task classes such as ``PeftModelForCausalLM``) passes its
    inputs on to the transformers model it adapts (``get_base_model()``, PEFT's public accessor, the
    adapters injected into it), so that model's class decides the label shift, the cache and an
    encoder-decoder's decoder inputs.
    """
    view = getattr(sys.modules.get("normflat.integrations.huggingface"), "HFLogits", None)
    if isinstance(view, type) and isinstance(model, view):
        model = model._inner
    if type(model).__module__.startswith("peft.") and callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    return model


@functools.lru_cache(maxsize=None)
def _causal_lm_class(cls: type) -> bool:
    from transformers.models.auto import modeling_auto  # transformers is loaded: only its registry

    names: set[str] = set()
    for value in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update((value,) if isinstance(value, str) else value)
    return any(c.__module__.startswith("transformers.") and c.__name__ in names for c in cls.__mro__)


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face causal language model (its own loss shifts the labels).

    The test is transformers' own registry of causal language models
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, the classes ``AutoModelForCausalLM``
    builds: ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...), matched on the model's
    class or a transformers base class of it (so subclasses count). Their
    forward computes ``ForCausalLMLoss``, which predicts the label at ``t+1`` from
    the logits at ``t`` (method §6.3). The loss type (``model.loss_type``) is not
    used: it is ``None`` for ``GPT2LMHeadModel`` and ``"ForConditionalGeneration"``
    also for encoder-decoders such as T5, whose labels are not shifted.

    Args:
        model: The (unwrapped) model, or normflat's ``HFLogits`` view of one.

    Returns:
        ``False`` when transformers is not loaded or for anything else.
    """
    if "transformers" not in sys.modules:
        return False
    model = _hf_model(model)
    base = _loaded_class("transformers.modeling_utils", "PreTrainedModel")
    if base is None or not isinstance(model, base):
        return False
    return _causal_lm_class(type(model))


@functools.lru_cache(maxsize=None)
def _takes_use_cache(cls: type) -> bool:
    try:
        return "use_cache" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def _without_cache(model: Any, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` for a transformers model whose forward takes it (unless given):
    the analysis never generates, so the cache would only cost memory, and a model updating its cache
    in place inside the forward (RWKV's recurrent state) cannot be differentiated in eval mode."""
    base = _loaded_class("transformers.modeling_utils", "PreTrainedModel")
    if base is None or not isinstance(model, base) or "use_cache" in kwargs or not _takes_use_cache(type(model)):
        return kwargs
    return {**kwargs, "use_cache": False}


def _shifted_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """``labels`` one position to the right, ``start`` first and ``pad`` for ``-100``: the decoder
    inputs a Hugging Face encoder-decoder makes from its labels (``shift_tokens_right``)."""
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill_(shifted == -100, pad)


def keyword_inputs(model: Any, kwargs: dict, labels: Any, device: torch.device) -> dict:
    """The keyword inputs of a Hugging Face model for the analysis: without its cache
    (:func:`_without_cache`) and, for an encoder-decoder, with the decoder's inputs made from the
    labels (:func:`_with_decoder_inputs`). Anything else: ``kwargs`` as they are."""
    model = _hf_model(model)
    return _with_decoder_inputs(model, _without_cache(model, kwargs), labels, device)


def _with_decoder_inputs(model: Any, kwargs: dict, labels: Any, device: torch.device) -> dict:
    """The keyword inputs of a Hugging Face encoder-decoder (T5, BART, Marian, ...) with the decoder's
    inputs made from the labels, as the model's own forward does when it is given ``labels``.

    normflat takes the labels out of a mapping batch (they are the targets, not an input), so a
    batch of ``input_ids`` and ``labels`` alone would leave the decoder without inputs. Unless the
    batch has ``decoder_input_ids`` or ``decoder_inputs_embeds`` of its own, they are the labels
    shifted right (``prepare_decoder_input_ids_from_labels``: the start token first, ``-100`` as
    the padding token), and the logits at ``t`` are scored against ``labels[:, t]``, unshifted.
    A model without that method (M2M100, NLLB, Whisper, Speech2Text, Blenderbot) shifts its labels
    in its forward the same way from its config's ``decoder_start_token_id`` and ``pad_token_id``:
    so does this. Anything else: ``kwargs`` as they are.
    """
    config = getattr(model, "config", None)
    if (labels is None or not getattr(config, "is_encoder_decoder", False)
            or "decoder_input_ids" in kwargs or "decoder_inputs_embeds" in kwargs):
        return kwargs
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if prepare is None:
        start, pad = getattr(config, "decoder_start_token_id", None), getattr(config, "pad_token_id", None)
        if not (isinstance(start, int) and isinstance(pad, int)):
            return kwargs
        prepare = functools.partial(_shifted_right, start=start, pad=pad)
    ids = torch.as_tensor(labels, device=device)
    if ids.dtype.is_floating_point or ids.dim() != 2:
        return kwargs  # not token labels: the model's own error, on the labels it was given
    return {**kwargs, "decoder_input_ids": prepare(labels=ids.long())}


# ============================================================================ analysis mode


def _hf_configs(model: nn.Module) -> list[tuple[Any, str]]:
    """Every distinct transformers config the modules of ``model`` read (with their sub-configs),
    and the attention implementation the analysis runs it with: ``"sdpa"`` if the model that
    owns it supports it (its calls then run on the math kernel, in the model's dtype),
    otherwise ``"eager"``."""
    config_cls = _loaded_class("transformers.configuration_utils", "PreTrainedConfig") or \
        _loaded_class("transformers.configuration_utils", "PretrainedConfig")
    if config_cls is None:
        return []
    modules = [_hf_model(model), *model.modules()]
    # Outer models first: a sub-config inherits its owner's choice unless a model of its own says otherwise.
    owners: dict[int, str] = {}
    for m in modules:
        config = getattr(m, "config", None)
        if isinstance(config, config_cls) and hasattr(type(m), "_supports_sdpa") and id(config) not in owners:
            owners[id(config)] = "sdpa" if type(m)._supports_sdpa else "eager"
    seen: dict[int, tuple[Any, str]] = {}
    todo = [(getattr(m, "config", None), "eager") for m in reversed(modules)]
    while todo:
        config, inherited = todo.pop()
        if not isinstance(config, config_cls) or id(config) in seen:
            continue
        target = owners.get(id(config), inherited)
        seen[id(config)] = (config, target)
        for key in getattr(config, "sub_configs", None) or ():
            todo.append((getattr(config, key, None), target))
    return list(seen.values())


#: Hugging Face experts implementations that compute with plain tensor operations, differentiable
#: twice and under ``vmap`` in any dtype: the loop over the experts (``"eager"``, the reference) and
#: the gather of each token's expert matrices (``"batched_mm"``). The fused kernels
#: (``"grouped_mm"``, the default where it dispatches; ``"deepgemm"``, ``"sonicmoe"``) have no
#: ``vmap`` batching rule, and ``grouped_mm`` no float64.
_VMAP_EXPERTS = ("eager", "batched_mm")


def _experts_configs(model: nn.Module) -> list[Any]:
    """The distinct configs whose ``_experts_implementation`` the experts modules of ``model`` read."""
    found: dict[int, Any] = {}
    for m in model.modules():
        if _dispatches_experts(type(m)):
            config = getattr(m, "config", None)
            if config is not None:
                found.setdefault(id(config), config)
    return list(found.values())


#: Hugging Face attention implementations that run through ``F.scaled_dot_product_attention``
#: (or are its explicit form). The session runs SDPA on its math kernel wherever an estimator
#: needs more than one backward (:class:`~normflat.backends.torch.compat.FunctionalKernels`).
_SDPA_IMPLEMENTATIONS = ("eager", "sdpa")


@contextlib.contextmanager
def without_input_grad_hooks(model: Any) -> Iterator[None]:
    """Inside the block, the forward hooks of Hugging Face's ``enable_input_require_grads`` do not run;
    they are back in their place among the modules' hooks on exit, also after an error.

    ``gradient_checkpointing_enable()`` (and PEFT's adapters) register them on the input embeddings:
    ``output.requires_grad_(True)``, so that a frozen embedding still passes gradients to the
    checkpointed blocks. Under ``torch.func`` transforms (the Hessian-vector products, the generic
    path, the measures' gradients) that call fails inside torch, in eval mode too; the analysis sets
    ``requires_grad`` on the weights it differentiates itself, so the hooks change nothing it computes.
    """
    suspended: list[tuple[dict, list, int]] = []
    modules = model.modules() if isinstance(model, nn.Module) else ()
    for module in modules:
        for handle in module.__dict__.get("_require_grads_hooks", None) or ():
            hooks = handle.hooks_dict_ref() if hasattr(handle, "hooks_dict_ref") else None
            if hooks is not None and handle.id in hooks:
                suspended.append((hooks, list(hooks.items()), handle.id))
                del hooks[handle.id]
    try:
        yield
    finally:
        for hooks, order, key in reversed(suspended):
            # The hook back at its place: the module's hooks in the order they had, any registered
            # meanwhile after them.
            current = dict(hooks)
            hooks.clear()
            for k, fn in order:
                if k == key or k in current:
                    hooks[k] = current.get(k, fn)
            for k, fn in current.items():
                hooks.setdefault(k, fn)


@contextlib.contextmanager
def analysis_mode(model: Any, options: Any) -> Iterator[None]:
    """The context every forward and autodiff computation of the analysis runs in.

    Attention must be differentiable the way every estimator needs: twice and in
    forward mode (``exact``, ``hutchinson``), under ``vmap`` (the generic GGN
    path). Hugging Face models with ``attn_implementation="sdpa"`` (their default)
    and timm attention (``fused_attn``) call ``F.scaled_dot_product_attention``,
    which the session already puts on torch's math kernel where needed (a
    thread-local torch function mode). Hugging Face attention that does not go
    through it (``flash_attention_2``, ``flex_attention``, hub kernels, paged
    attention) is set to ``"sdpa"`` (``"eager"`` for a model without SDPA
    support) on each config the model reads, for the analysis only: the same
    function, restored on exit, also after an error. Mixture-of-experts layers on a
    fused experts kernel (``"grouped_mm"``, transformers' default where it
    dispatches, ``"deepgemm"``, ``"sonicmoe"``) run as ``"eager"``, the loop over the
    experts, the same way and for the same reasons. These changes are visible to
    another thread running the same model meanwhile (which then computes the same
    function another way); the session refuses two analyses of one model at a time.
    Nothing is changed for models without such configs. The input-gradient hooks of
    gradient checkpointing and adapters are suspended (:func:`without_input_grad_hooks`).

    Args:
        model: The (unwrapped) model.
        options: The analysis options (every estimator runs the same attention).
    """
    changed: list[tuple[Any, Any]] = []
    experts: list[tuple[Any, Any]] = []
    try:
        if isinstance(model, nn.Module) and "transformers" in sys.modules:
            for config, target in _hf_configs(model):
                current = config.__dict__.get("_attn_implementation_internal")
                if isinstance(current, str) and current not in _SDPA_IMPLEMENTATIONS:
                    changed.append((config, current))
                    # The internal attribute: the public setter would recurse into the sub-configs,
                    # which are handled (and restored) one by one here.
                    config._attn_implementation_internal = target
            for config in _experts_configs(model):
                current = config.__dict__.get("_experts_implementation_internal")
                if isinstance(current, str) and current not in _VMAP_EXPERTS:
                    experts.append((config, current))
                    config._experts_implementation_internal = "eager"
        with without_input_grad_hooks(model):
            yield
    finally:
        for config, value in reversed(changed):
            config._attn_implementation_internal = value
        for config, value in reversed(experts):
            config._experts_implementation_internal = value
