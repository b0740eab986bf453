"""Every touch of a private or internal PyTorch API, in one place.

Each entry says why the public API does not suffice, so that a torch upgrade
that breaks one of them breaks it here, visibly, and nowhere else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "FunctionalKernels",
    "MathAttention",
    "NORM_BASE",
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


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP wrapper (checked by class name).

    Importing ``torch.distributed.fsdp`` just to check is slow and can fail on
    builds without distributed support.
    """
    return any(c.__name__ in ("FullyShardedDataParallel", "FSDPModule") for c in type(module).__mro__)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor`` (a sharded parameter of ``fully_shard``), by class name."""
    return type(t).__name__ == "DTensor"


class FunctionalKernels(torch.overrides.TorchFunctionMode):
    """Runs attention and recurrent layers on differentiable, ``vmap``-able kernels, in this thread.

    * ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` run on the
      math kernel: torch's fused CPU attention kernel has no double backward
      (needed by ``exact`` and ``hutchinson``) and no ``vmap`` batching rule.
    * ``torch.lstm`` / ``torch.gru`` / ``torch.rnn_tanh`` / ``torch.rnn_relu`` (the fused
      kernels behind ``nn.LSTM``/``nn.GRU``/``nn.RNN``) run as the same recurrence written
      in plain tensor operations (:func:`_recurrence`), which ``vmap`` batches over
      samples; packed sequences and training-mode dropout keep torch's kernel.

    The global ``torch.nn.attention.sdpa_kernel`` switch would affect every thread; a
    torch function mode is thread-local and ends with the ``with`` block. Both
    replacements compute the same function as torch's kernels (tested). The plain
    recurrence is also much faster to differentiate on CPU than the fused kernel
    (2.6 ms against 0.4 s for a forward and backward of a 32-unit LSTM over 4×20 steps,
    torch 2.14, measured), so the session uses it for every forward.

    Args:
        attention: Also replace the fused attention kernels (``False``: only the
            recurrent ones; the fused attention is kept where one backward suffices).
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


def _padded_call(mode: str, args: tuple) -> bool:
    """Whether a fused recurrent call is the padded-input overload ``(input, hx, params, ...)``
    rather than the packed one ``(data, batch_sizes, hx, params, ...)``."""
    if len(args) != 9:
        return False
    if mode == "LSTM":
        return not isinstance(args[1], torch.Tensor)  # hx is a (h0, c0) pair
    return isinstance(args[2], (list, tuple))  # the flat weights

_RECURRENT_KERNELS = {torch.lstm: "LSTM", torch.gru: "GRU", torch.rnn_tanh: "RNN_TANH", torch.rnn_relu: "RNN_RELU"}


def _recurrence(mode: str, x: torch.Tensor, hx: Any, params: list, has_biases: bool, num_layers: int,
                bidirectional: bool, batch_first: bool) -> tuple:
    """``torch.lstm``/``gru``/``rnn_*`` (padded input) in plain tensor operations, torch's gate order.

    Returns what the fused kernel returns: ``(output, h_n, c_n)`` for the LSTM,
    ``(output, h_n)`` otherwise.
    """
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)  # w_ih, w_hh[, b_ih, b_hh][, w_hr]
    seq = x.transpose(0, 1) if batch_first else x  # (T, B, features)
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
            h, c = h0[i], (c0[i] if c0 is not None else None)
            steps = range(seq.shape[0] - 1, -1, -1) if d == 1 else range(seq.shape[0])
            out = [None] * seq.shape[0]
            for t in steps:
                h, c = _cell(mode, seq[t], h, c, w_ih, w_hh, b_ih, b_hh, w_hr)
                out[t] = h
            outs.append(torch.stack(out))
            hs.append(h)
            if c is not None:
                cs.append(c)
        seq = torch.cat(outs, -1) if dirs == 2 else outs[0]
    output = seq.transpose(0, 1) if batch_first else seq
    if mode == "LSTM":
        return output, torch.stack(hs), torch.stack(cs)
    return output, torch.stack(hs)


def _cell(mode, x, h, c, w_ih, w_hh, b_ih, b_hh, w_hr):
    gi = torch.nn.functional.linear(x, w_ih, b_ih)
    gh = torch.nn.functional.linear(h, w_hh, b_hh)
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        if w_hr is not None:
            h = torch.nn.functional.linear(h, w_hr)
        return h, c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return act(gi + gh), None
def _sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA's boolean mask means "attend where True"; the math kernel adds a float mask, so
        # convert it to 0 / -inf as SDPA itself does (adding 0/1 would change the function).
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
