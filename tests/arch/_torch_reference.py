"""Brute-force references for the torch architecture tests (float64, tiny models).

Everything here is computed independently of normflat's kernels: full autodiff
Jacobians of each sample's logits with respect to every parameter
(``torch.func.jacrev``), the per-token loss Hessian in the logits
(``torch.autograd.functional.hessian``), and the full Hessian of the mean loss
(``torch.func.hessian``). The canonical layouts and the split into blocks are
written out here from method §3, not taken from the backend.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from normflat.engine.losses import NSCE_EPS

IGNORE = -100


def softmax_inputs(z: torch.Tensor, loss: str) -> torch.Tensor:
    """What the softmax cross-entropy sees: the logits (ce) or the normalized logits (nsce, τ = 1)."""
    if loss == "ce":
        return z
    zc = z - z.mean(-1, keepdim=True)
    return zc / torch.sqrt((zc ** 2).mean(-1, keepdim=True) + NSCE_EPS)


def _ce(u: torch.Tensor, label: int) -> torch.Tensor:
    return -torch.log_softmax(u, -1)[label]


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


def _sample(x: Any, i: int) -> tuple[tuple, dict]:
    if isinstance(x, dict):
        return (), {k: v[i:i + 1] for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(v[i:i + 1] for v in x), {}
    return (x[i:i + 1],), {}


def _token_labels(y: torch.Tensor, shift: bool) -> torch.Tensor:
    if not shift:
        return y
    return torch.cat([y[:, 1:], torch.full_like(y[:, :1], IGNORE)], 1)


def _jacobian(f, params: dict) -> dict:
    """``jacrev``; row by row with plain autograd where ``vmap`` cannot run the model
    (a ``PackedSequence`` inside the forward)."""
    try:
        return jacrev(f)(params)
    except RuntimeError:
        names = list(params)
        jac = torch.autograd.functional.jacobian(lambda *ws: f(dict(zip(names, ws))), tuple(params.values()))
        return dict(zip(names, jac))


def ggn_diagonal(model: nn.Module, data: list, loss: str, shift: bool = False) -> dict[str, torch.Tensor]:
    """``(1/terms) Σ_n Σ_t J_{n,t}ᵀ H_{n,t} J_{n,t}`` diagonal per parameter (native layout).

    ``data`` is a list of ``(x, y)`` batches; labels ``(n,)`` for ``(n, C)`` logits or
    ``(n, T)`` (with ``IGNORE``) for token logits.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    terms = 0
    for x, y in data:
        y = torch.as_tensor(y)
        n = y.shape[0]
        labels = _token_labels(y, shift) if y.dim() == 2 else y
        for i in range(n):
            args, kwargs = _sample(x, i)

            def outputs(ps, args=args, kwargs=kwargs):
                return softmax_inputs(_logits(functional_call(model, ps, args, kwargs))[0], loss)

            u = outputs(params)
            jac = _jacobian(outputs, params)
            if u.dim() == 1:  # (C,) logits: one term per sample
                u, jac, row = u[None], {k: v[None] for k, v in jac.items()}, labels[i:i + 1]
            else:
                row = labels[i]
            for t in range(u.shape[0]):
                if int(row[t]) == IGNORE:
                    continue
                terms += 1
                h = torch.autograd.functional.hessian(lambda v, lab=int(row[t]): _ce(v, lab), u[t])
                for k, j in jac.items():
                    jt = j[t].reshape(u.shape[1], -1)
                    total[k] += torch.einsum("ak,ab,bk->k", jt, h, jt).reshape(total[k].shape)
    return {k: v / terms for k, v in total.items()}


def hessian_diagonal(model: nn.Module, data: list, loss: str, names: list[str],
                     shift: bool = False) -> dict[str, torch.Tensor]:
    """Diagonal of the full Hessian of the mean loss w.r.t. the parameters ``names`` (native layout)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    sizes = [params[k].numel() for k in names]
    theta = torch.cat([params[k].reshape(-1) for k in names])

    def mean_loss(flat):
        ps = dict(params)
        start = 0
        for k, size in zip(names, sizes):
            ps[k] = flat[start:start + size].reshape(params[k].shape)
            start += size
        total, terms = 0.0, 0
        for x, y in data:
            y = torch.as_tensor(y)
            args, kwargs = (((), x) if isinstance(x, dict) else
                            ((tuple(x), {}) if isinstance(x, (tuple, list)) else ((x,), {})))
            u = softmax_inputs(_logits(functional_call(model, ps, args, kwargs)), loss)
            labels = _token_labels(y, shift) if y.dim() == 2 else y
            u, labels = u.reshape(-1, u.shape[-1]), labels.reshape(-1)
            keep = labels != IGNORE
            logp = torch.log_softmax(u[keep], -1)
            total = total - logp.gather(1, labels[keep][:, None]).sum()
            terms += int(keep.sum())
        return total / terms

    # torch's fused CPU attention has no second derivative: the reference runs the math kernel
    # (this test-only switch is global; normflat itself uses a thread-local one).
    with sdpa_kernel(SDPBackend.MATH):
        diag = torch.diagonal(hessian(mean_loss)(theta))
    out, start = {}, 0
    for k, size in zip(names, sizes):
        out[k] = diag[start:start + size].reshape(params[k].shape)
        start += size
    return out


_GATES = {"LSTM": "ifgo", "GRU": "rzn"}


def problems(model: nn.Module, native: dict[str, torch.Tensor],
             tables: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The expected problems ``{name: canonical diagonal}`` from native per-parameter diagonals.

    Method §3: an embedding is ``(features, vocabulary)`` (the table transposed); the
    packed query/key/value of ``nn.MultiheadAttention`` are three matrices; a
    recurrent weight is one matrix per gate; a position table ``(1, N, d)`` is
    ``(d, N)``. ``tables``: position tables ``{param name: features}``.
    """
    names = {id(p): k for k, p in model.named_parameters()}
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}

    def take(p):
        if id(p) in seen:
            return None
        seen.add(id(p))
        return native[names[id(p)]]

    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear,)) and not name.endswith("out_proj"):
            d = take(m.weight)
            if d is not None:
                out[name] = d
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            d = take(m.weight)
            if d is not None:
                out[name] = d  # (out, in/groups, *kernel) as is
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            d = take(m.weight)
            if d is not None:
                out[name] = d.T
        elif isinstance(m, nn.MultiheadAttention):
            e = m.embed_dim
            if m.in_proj_weight is not None:
                d = take(m.in_proj_weight)
                for j, block in enumerate(("query", "key", "value")):
                    out[f"{name}.{block}"] = d[j * e:(j + 1) * e]
            else:
                for block, p in (("query", m.q_proj_weight), ("key", m.k_proj_weight), ("value", m.v_proj_weight)):
                    out[f"{name}.{block}"] = take(p)
            out[f"{name}.out_proj"] = take(m.out_proj.weight)
        elif isinstance(m, nn.RNNBase):
            gates = _GATES.get(type(m).__name__)
            for pname, p in m.named_parameters(recurse=False):
                if not pname.startswith("weight"):
                    continue
                d = take(p)
                if gates is None or pname.startswith("weight_hr"):
                    out[f"{name}.{pname}"] = d
                else:
                    h = m.hidden_size
                    for j, g in enumerate(gates):
                        out[f"{name}.{pname}.{g}"] = d[j * h:(j + 1) * h]
    for pname, features in (tables or {}).items():
        out[pname] = native[pname].reshape(-1, features).T
    return out
