"""Every touch of a private or internal PyTorch API, in one place.

Each entry says why the public API does not suffice, so that a torch upgrade
that breaks one of them breaks it here, visibly, and nowhere else.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "FunctionalKernels",
    "recurrent_taps",
    "RecurrentTanh",
    "MathAttention",
    "NORM_BASE",
    "one_sample_norm_gradients",
    "unchanging_conversions",
    "model_workarounds",
    "no_gradient_checkpointing",
    "no_compilation",
    "plain_name",
    "without_autocast",
    "checkpointing_refusal",
    "tensor_version",
    "graph_node_name",
    "graph_leaf",
    "is_fsdp",
    "is_dtensor",
]

#: BatchNorm/InstanceNorm share this private base class; registering it ignores all of
#: them (and user subclasses) at once, where the public classes would need a list that
#: misses new variants (LazyBatchNorm, SyncBatchNorm).
NORM_BASE: type = nn.modules.batchnorm._NormBase


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout ``x`` is stored in: channels-last (2-D or 3-D) where it is that and not contiguous."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


@contextlib.contextmanager
def one_sample_norm_gradients(model: nn.Module) -> Iterator[None]:
    """Work around a torch CPU bug for the analysis of ``model``, inside the block.

    The backward of batch normalization (eval-mode ``BatchNorm2d``/``3d``; ``InstanceNorm``,
    which normalizes through it) on a batch of *one* sample returns a wrong input gradient
    when the gradient at its output is laid out otherwise than its input: channels-last
    strides, as after ``y.flatten(2).transpose(1, 2)``, the token layout of CvT, LeViT and
    hybrid ViTs (torch 2.14; the GGN diagonal of such a model was off by up to 30× on chunks
    of one sample; two samples or more, and ``torch.func``'s batching rules, are right).
    Every such module's output on a one-sample batch hands the gradient on laid out like
    its input, the same numbers in the layout the kernel reads correctly. Nothing changes for
    larger batches or under ``torch.func`` transforms, and the hooks are removed on exit.
    """

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        if (isinstance(output, torch.Tensor) and output.requires_grad and output.dim() >= 4
                and output.shape[0] == 1 and not torch._C._are_functorch_transforms_active()):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else output
            fmt = _memory_format(x)
            output.register_hook(lambda g: g.contiguous(memory_format=fmt))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, NORM_BASE)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _converts(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module.to(*args, **kwargs)`` would change any of its tensors (dtype, device or layout)."""
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if memory_format is not None:
        return True
    for t in itertools.chain(module.parameters(), module.buffers()):
        if device is not None and t.device != device:
            return True
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return True
    return False


@contextlib.contextmanager
def unchanging_conversions(model: nn.Module) -> Iterator[None]:
    """Inside the block, a ``.to(...)`` of a module of ``model`` that changes nothing returns the module
    without touching its parameters.

    Some models convert a submodule in their forward (Hugging Face's Switch Transformers and
    NLLB-MoE routers: ``self.classifier = self.classifier.to(self.dtype)``). Even when nothing
    changes, ``Module.to`` re-assigns every parameter's ``.data``, which under ``torch.func``
    transforms (the generic path's ``vmap`` of a ``vjp``) fails inside torch and leaves the
    parameter broken (the next use crashed the process). A conversion that changes something
    runs as usual. The instance attributes are removed on exit.
    """
    modules = []
    for module in model.modules():
        if "to" in getattr(module, "__dict__", {}):
            continue  # an instance attribute of its own: left as it is

        def to(*args: Any, _module: nn.Module = module, **kwargs: Any) -> nn.Module:
            if _converts(_module, args, kwargs):
                return type(_module).to(_module, *args, **kwargs)
            return _module
        try:
            object.__setattr__(module, "to", to)
        except (AttributeError, TypeError):  # a module that takes no instance attributes (scripted)
            continue
        modules.append(module)
    try:
        yield
    finally:
        for module in modules:
            object.__delattr__(module, "to")


#: The switches of gradient checkpointing that libraries keep on their modules: timm's
#: ``set_grad_checkpointing`` (read in eval mode too) and Hugging Face's
#: ``gradient_checkpointing_enable`` (read in training mode only).
CHECKPOINTING_SWITCHES = ("grad_checkpointing", "gradient_checkpointing")


@contextlib.contextmanager
def no_gradient_checkpointing(model: nn.Module) -> Iterator[None]:
    """Inside the block, the modules of ``model`` whose gradient checkpointing is switched on
    (:data:`CHECKPOINTING_SWITCHES` set to ``True``) run their blocks directly; the switches are
    set back on exit.

    ``torch.utils.checkpoint`` recomputes a block's activations in the backward instead of keeping
    them. It changes no number, but its saved-tensor hooks are not supported under ``torch.func``
    transforms (the Hessian-vector products, the generic path's per-sample gradients and the
    measures' gradients fail inside torch), and the fast rules' records would see the recomputed
    forward too. A forward that calls ``torch.utils.checkpoint`` itself is refused by
    :func:`checkpointing_refusal`.
    """
    switched = []
    for module in model.modules():
        for name in CHECKPOINTING_SWITCHES:
            if getattr(module, "__dict__", {}).get(name) is True:
                object.__setattr__(module, name, False)
                switched.append((module, name))
    try:
        yield
    finally:
        for module, name in switched:
            object.__setattr__(module, name, True)


def _raised_in_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` was raised inside ``torch.utils.checkpoint`` (a frame of its module)."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def checkpointing_refusal() -> Iterator[None]:
    """Around an analysis' forwards: an error raised inside ``torch.utils.checkpoint`` (a model that
    checkpoints its blocks in its own forward, where no library switch turns it off:
    :func:`no_gradient_checkpointing`) becomes a ``ValueError`` that names the cause and the fix."""
    try:
        yield
    except Exception as err:
        if not _raised_in_checkpoint(err):
            raise
        raise ValueError(
            "The torch model recomputes activations with torch.utils.checkpoint (gradient checkpointing) "
            f"in its forward, which normflat cannot differentiate through ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else 'no message'}): the Hessian-vector products and "
            "per-sample gradients run the forward under torch.func, which does not support checkpointing's "
            "saved-tensor hooks. Checkpointing changes no number: turn it off for the analysis (call the "
            "blocks directly). The switches of timm (set_grad_checkpointing) and Hugging Face "
            "(gradient_checkpointing_enable) need nothing: normflat turns them off for its forwards."
        ) from err


#: The device types whose ``torch.autocast`` an analysis turns off for its forwards.
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


@contextlib.contextmanager
def without_autocast() -> Iterator[None]:
    """Inside the block, the calling thread's ``torch.autocast`` regions are off (autocast is a
    thread-local switch: nothing changes for other threads, and it is on again on exit).

    An analysis called inside a mixed-precision block (a training loop's ``with torch.autocast(...)``)
    would otherwise run the model's matrix products in bfloat16 or float16: its Hessians would be
    those of the rounding (the analysis failed on the bfloat16 logits; ``normflat.measures`` returned
    their values silently). normflat computes in the model's dtype or the ``dtype`` option's.
    """
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_DEVICES:
            try:
                enabled = torch.is_autocast_enabled(device_type)
            except (RuntimeError, ValueError):  # a device type this build does not know
                continue
            if enabled:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@contextlib.contextmanager
def model_workarounds(model: nn.Module) -> Iterator[None]:
    """What an analysis sets for its forwards, removed on exit: on ``model``'s modules the batch-norm
    gradient on one sample (:func:`one_sample_norm_gradients`), the conversions that change
    nothing (:func:`unchanging_conversions`) and no gradient checkpointing
    (:func:`no_gradient_checkpointing`; a forward that checkpoints by itself is refused,
    :func:`checkpointing_refusal`) and no compiled submodule (:func:`no_compilation`); in the
    calling thread, no autocast (:func:`without_autocast`)."""
    with (checkpointing_refusal(), without_autocast(), one_sample_norm_gradients(model),
          unchanging_conversions(model), no_gradient_checkpointing(model), no_compilation(model)):
        yield


def tensor_version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t``.

    The fast GGN path keeps a layer's input from the forward to form the squares
    after the backward; an in-place op on that input in between (``x += ...`` in a
    residual block) would make the squares silently wrong. ``Tensor._version`` is
    the only way to detect it (autograd itself uses it for the same check).
    """
    return int(t._version)


def graph_node_name(fn: Any) -> str:
    """Name of an autograd graph node (``AddmmBackward0``), to decide batched backward.

    ``Node.name()`` is documented but the node classes are not part of the public
    API; it is used to check that every backward op of the graph has a vmap
    batching rule (``is_grads_batched=True`` otherwise falls back to a slow loop).
    """
    return str(fn.name())


def graph_leaf(fn: Any) -> Any:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into (else ``None``).

    Walking ``grad_fn.next_functions`` to the ``AccumulateGrad`` nodes is the only
    way to count how many times a weight enters the graph (a weight used twice, or
    functionally, needs the generic GGN path).
    """
    return getattr(fn, "variable", None)


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """``g · v / ‖v‖`` as torch's weight normalization computes it (both its parametrization and its
    older hook call this private function), with the same autograd graph."""
    return torch._weight_norm(v, g, dim)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP wrapper (checked by class name).

    Importing ``torch.distributed.fsdp`` just to check is slow and can fail on
    builds without distributed support.
    """
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(module).__mro__)


def compiled_original(module: nn.Module) -> nn.Module | None:
    """The eager module inside ``torch.compile``'s wrapper (``OptimizedModule``, a private class of
    ``torch._dynamo``, checked by name), or ``None`` for any other module. It holds the same
    parameters and buffers; the wrapper only routes its forward through the compiler."""
    inner = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return None


def plain_name(name: str) -> str:
    """A module or parameter name without the ``_orig_mod`` segments of ``torch.compile``'s wrappers
    inside the model (``encoder._orig_mod.layer.0`` -> ``encoder.layer.0``): the plain model's name."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


@contextlib.contextmanager
def no_compilation(model: nn.Module) -> Iterator[None]:
    """Inside the block, the compiled modules of ``model`` run their eager forward; they compile
    again after it.

    Two forms are private state of ``torch.nn.Module`` and ``torch._dynamo``: ``module.compile()``
    (in place) keeps the compiled call in ``module._compiled_call_impl``, which ``Module.__call__``
    runs when it is set; ``torch.compile(submodule)`` assigned into the model leaves an
    ``OptimizedModule`` whose instance ``forward`` is the compiled call of the eager module it
    holds (``_orig_mod``). Compiling computes the same function, but the analysis' hooks and
    ``torch.func`` transforms would make the compiler retrace (or fall back) on every forward and
    run normflat's own hooks through it. The whole model compiled by ``torch.compile(model)`` is
    unwrapped before the analysis instead (:func:`compiled_original`).
    """
    changed: list[tuple[nn.Module, str, Any]] = []
    for module in model.modules():
        state = getattr(module, "__dict__", {})
        if state.get("_compiled_call_impl") is not None:
            changed.append((module, "_compiled_call_impl", state["_compiled_call_impl"]))
            object.__setattr__(module, "_compiled_call_impl", None)
        inner = compiled_original(module)
        if inner is not None and "forward" in state:
            changed.append((module, "forward", state["forward"]))
            object.__setattr__(module, "forward", inner.__call__)
    try:
        yield
    finally:
        for module, name, value in reversed(changed):
            object.__setattr__(module, name, value)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a sharded parameter of ``fully_shard``), by class name."""
    return type(t).__name__ == "DTensor"


class FunctionalKernels(torch.overrides.TorchFunctionMode):
    """Runs attention and recurrent layers on differentiable, ``vmap``-able kernels, in this thread.

    * ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` run on the
      math kernel: torch's fused CPU attention kernel has no double backward
      (needed by ``exact`` and ``hutchinson``) and no ``vmap`` batching rule.
    * ``F.hardsigmoid`` (MobileNetV3's and other squeeze-excite gates) runs as
      ``clamp(x + 3, 0, 6) / 6``, the same function: torch has no derivative of its
      backward (``hardsigmoid_backward``), so ``exact`` and ``hutchinson`` failed inside torch.
      An in-place call returns the result without writing its input (the value is what
      its caller uses; writing it would break the backward of the clamp).
    * ``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu`` (the fused
      kernels behind ``nn.LSTM``/``nn.GRU``/``nn.RNN``) run as the same recurrence written
      in plain tensor operations (:func:`_recurrence`), which ``vmap`` batches over
      samples; packed sequences and training-mode dropout keep torch's kernel.

    The global ``torch.nn.attention.sdpa_kernel`` switch would affect every thread; a
    torch function mode is thread-local and ends with the ``with`` block. The
    replacements compute the same functions as torch's kernels (tested). The plain
    recurrence is also much faster to differentiate on CPU than the fused kernel
    (2.6 ms against 0.4 s for a forward and backward of a 32-unit LSTM over 4×20 steps,
    torch 2.14, measured), so the session uses it for every forward.

    Args:
        attention: Also replace the fused attention kernels and ``hardsigmoid`` (``False``: only
            the recurrent ones; the fused kernels are kept where one backward suffices).
    """

    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not self.attention:
            pass
        elif func is torch.nn.functional.scaled_dot_product_attention:
            return _sdpa_math(*args, **kwargs)
        elif func is torch.nn.functional.hardsigmoid:
            return _hardsigmoid(*args, **kwargs)
        elif func is torch.nn.functional.multi_head_attention_forward and len(args) <= 15:
            # A mode is off inside its own handler, so the fused call inside this function would
            # not reach it; with need_weights=True it computes the attention explicitly instead.
            wanted = kwargs.get("need_weights", True)
            kwargs["need_weights"] = True
            out, weights = func(*args, **kwargs)
            return out, (weights if wanted else None)
        mode = _RECURRENT_KERNELS.get(func)
        if mode is not None and not kwargs and _padded_call(mode, args):
            x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
            if not (train and dropout > 0):
                return _recurrence(mode, x, hx, list(params), bool(has_biases), int(num_layers),
                                   bool(bidirectional), bool(batch_first))
        return func(*args, **kwargs)


#: The name :mod:`normflat.backends.torch.hf` uses (the same mode).
MathAttention = FunctionalKernels


def _hardsigmoid(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.hardsigmoid`` written with ``clamp``, which torch differentiates twice (see :class:`FunctionalKernels`)."""
    return torch.clamp(input + 3.0, 0.0, 6.0) / 6.0


def _padded_call(mode: str, args: tuple) -> bool:
    """Whether a fused recurrent call is the padded-input overload ``(input, hx, params, ...)``
    rather than the packed one ``(data, batch_sizes, hx, params, ...)``."""
    if len(args) != 9:
        return False
    if mode == "LSTM":
        return not isinstance(args[1], torch.Tensor)  # hx is a (h0, c0) pair
    return isinstance(args[2], (list, tuple))  # the flat weights

_RECURRENT_KERNELS = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH", torch.rnn_relu: "RNN_RELU"}


#: This thread's recorder of the recurrent weights' inputs and outputs (:func:`recurrent_taps`).
_TAPS = threading.local()


@contextlib.contextmanager
def recurrent_taps(record: dict[int, Callable[[torch.Tensor, torch.Tensor, int], Any]] | None
                   ) -> Iterator[None]:
    """Let the plain recurrence (:func:`_recurrence`) show the fast GGN rule each recurrent weight's
    map, in this thread, for the ``with`` block.

    ``record`` maps ``id(weight)`` to ``callback(input, output, uses)``: ``input`` ``(B, T, in)`` is
    what the weight multiplies at every step, ``output`` ``(B, T, out)`` a tensor of the graph whose
    gradient is, at every step, the gradient of the weight's product ``W input_t`` (so that a
    sample's gradient of ``W`` is ``Σ_t output_grad_t input_tᵀ``, a dense layer over the steps),
    ``uses`` the graph edges to the weight (``T`` for a weight applied once per step). The input
    weights' product over all steps is computed at once and is that output; a weight applied
    inside the loop gets a tap: a zero tensor added to its product at every step, whose gradient is
    the product's (``x + 0`` is ``x``: the function is unchanged). Torch's fused kernels are
    opaque: the fast rule needs this recurrence (:class:`FunctionalKernels`).
    """
    before = getattr(_TAPS, "record", None)
    _TAPS.record = record
    try:
        yield
    finally:
        _TAPS.record = before


class RecurrentTanh(torch.autograd.Function):
    """``tanh`` whose backward, ``g − g·y²``, is made of operations ``vmap`` batches: torch's own
    ``tanh_backward`` has no batching rule, and one such node in a recurrence makes the batched
    backward of many signals (``is_grads_batched``) loop op by op. Differentiable again (its
    backward is plain operations) and usable under ``torch.func`` (``generate_vmap_rule``); used
    only by the recurrence the fast GGN rule records (:func:`recurrent_taps`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g - g * y * y


def _tap(record: dict | None, w: torch.Tensor | None, like: torch.Tensor, width: int) -> torch.Tensor | None:
    """A zero ``(B, T, width)`` tap for a weight applied once per step, when ``record`` wants it."""
    if record is None or w is None or id(w) not in record:
        return None
    # A view of a zero leaf: a node of the graph, as the recorded outputs of the other layers are.
    return torch.zeros((like.shape[0], like.shape[1], width), dtype=like.dtype, device=like.device,
                       requires_grad=True).view(like.shape[0], like.shape[1], width)


def _recurrence(mode: str, x: torch.Tensor, hx: Any, params: list, has_biases: bool, num_layers: int,
                bidirectional: bool, batch_first: bool) -> tuple:
    """``torch.lstm``/``gru``/``rnn_*`` (padded input) in plain tensor operations, torch's gate order.

    The input weights' products are formed for every step at once (one matrix product instead of
    ``T``); the recurrent and projection weights' step by step. Under :func:`recurrent_taps`, the
    weights it names are recorded.

    Returns what the fused kernel returns: ``(output, h_n, c_n)`` for the LSTM,
    ``(output, h_n)`` otherwise.
    """
    record = getattr(_TAPS, "record", None)
    # Recorded: the signals of the fast rule go back through the steps in one batched backward.
    tanh = torch.tanh if record is None else RecurrentTanh.apply
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)  # w_ih, w_hh[, b_ih, b_hh][, w_hr]
    seq = x if batch_first else x.transpose(0, 1)  # (B, T, features)
    steps_total = seq.shape[1]
    h0 = hx[0] if mode == "LSTM" else hx
    c0 = hx[1] if mode == "LSTM" else None
    hs, cs = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            i = layer * dirs + d
            group = params[i * per:(i + 1) * per]
            w_ih, w_hh = group[0], group[1]
            b_ih, b_hh = (group[2], group[3]) if has_biases else (None, None)
            w_hr = group[-1] if per in (3, 5) else None
            gi = torch.nn.functional.linear(seq, w_ih, b_ih)  # (B, T, gates·hidden), every step at once
            tap_hh = _tap(record, w_hh, seq, int(w_hh.shape[0]))
            tap_hr = _tap(record, w_hr, seq, int(w_hr.shape[0])) if w_hr is not None else None
            h, c = h0[i], (c0[i] if c0 is not None else None)
            steps = range(steps_total - 1, -1, -1) if d == 1 else range(steps_total)
            out: list[Any] = [None] * steps_total
            before: list[Any] = [None] * steps_total  # what w_hh multiplies at each step
            inner: list[Any] = [None] * steps_total  # what w_hr multiplies at each step
            # Unbound once: one backward node for all steps, where an index per step would add a
            # zero-padded full-size gradient per step (T² numbers).
            gi_t = gi.unbind(1)
            hh_t = tap_hh.unbind(1) if tap_hh is not None else [None] * steps_total
            hr_t = tap_hr.unbind(1) if tap_hr is not None else [None] * steps_total
            for t in steps:
                before[t] = h
                h, c, m = _cell(mode, gi_t[t], h, c, w_hh, b_hh, w_hr, hh_t[t], hr_t[t], tanh)
                out[t], inner[t] = h, m
            outs.append(torch.stack(out, 1))
            hs.append(h)
            if c is not None:
                cs.append(c)
            if record is not None:
                if id(w_ih) in record:
                    record[id(w_ih)](seq.detach(), gi, 1)
                if tap_hh is not None:
                    record[id(w_hh)](torch.stack(before, 1).detach(), tap_hh, steps_total)
                if tap_hr is not None:
                    record[id(w_hr)](torch.stack(inner, 1).detach(), tap_hr, steps_total)
        seq = torch.cat(outs, -1) if dirs == 2 else outs[0]
    output = seq if batch_first else seq.transpose(0, 1)
    if mode == "LSTM":
        return output, torch.stack(hs), torch.stack(cs)
    return output, torch.stack(hs)


def _cell(mode, gi, h, c, w_hh, b_hh, w_hr, tap_hh=None, tap_hr=None, tanh=torch.tanh):
    """One step from the input weights' product ``gi``: ``(h, c, m)``, ``m`` what the LSTM's
    projection multiplies (``None`` without one); a tap is added to its weight's product."""
    gh = torch.nn.functional.linear(h, w_hh, b_hh)
    if tap_hh is not None:
        gh = gh + tap_hh
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * tanh(g)
        h = torch.sigmoid(o) * tanh(c)
        m = None
        if w_hr is not None:
            m = h
            h = torch.nn.functional.linear(h, w_hr)
            if tap_hr is not None:
                h = h + tap_hr
        return h, c, m
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None, None
    act = tanh if mode == "RNN_TANH" else torch.relu
    return act(gi + gh), None, None


def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA's boolean mask means "attend where True"; the math kernel adds a float mask, so
        # convert it to 0 / -inf as SDPA itself does (adding 0/1 would change the function).
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
