"""PEFT (LoRA) adapters on Hugging Face and timm models in the torch backend (method §3, §6.3, §8).

A LoRA projection computes ``base(x) + lora_B(lora_A(dropout(x))) · s``: PEFT keeps the
adapted projection as ``base_layer`` and adds two linear maps beside it. normflat analyzes
the three as the layers they are; a packed projection (GPT-2's ``c_attn``, timm's ``qkv``)
stays packed, so its base layer *and* its ``lora_B`` map (whose output rows are the base's)
are split into query / key / value. A ``PeftModelForCausalLM`` passes its inputs on to the
language model it adapts, so its labels are shifted as that model's are.

Checked on tiny float64 models built from configs: the GGN diagonal against the brute-force
per-sample-Jacobian reference of ``test_huggingface_models``; with fresh adapters (``lora_B``
zero: the plain model's function) the base layers' numbers equal the plain model's; the
rank rescaling ``lora_A`` rows × c, ``lora_B`` columns / c leaves the function and every
normalized sharpness unchanged and moves the traces; the model is left as it was.
"""

from __future__ import annotations

import copy

import numpy as np
import peft
import pytest
import timm
import torch

import normflat
from normflat.backends.torch import hf
from tests.arch.test_huggingface_models import (
    analyze_quietly, assert_close, assert_unchanged, canonical_reference, lm_loader, param_of, reference_ggn,
    snapshot, tiny_gpt2)
from normflat.engine.options import NSCE_EPS

PREFIX = "base_model.model."
GPT2_LORA_LAYERS = [
    "transformer.wte", "transformer.wpe",
    *(f"transformer.h.0.attn.c_attn.base_layer.{p}" for p in ("query", "key", "value")),
    "transformer.h.0.attn.c_attn.lora_A.default",
    *(f"transformer.h.0.attn.c_attn.lora_B.default.{p}" for p in ("query", "key", "value")),
    "transformer.h.0.attn.c_proj.base_layer", "transformer.h.0.attn.c_proj.lora_A.default",
    "transformer.h.0.attn.c_proj.lora_B.default",
    "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj",
]


def lora_gpt2(trained: bool = True) -> torch.nn.Module:
    """Tiny GPT-2 with rank-2 LoRA adapters on the attention's packed ``c_attn`` and its ``c_proj``;
    ``trained``: ``lora_B`` drawn at random (PEFT starts it at zero, the plain model's function)."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                             lora_dropout=0.1, task_type="CAUSAL_LM")
    config.target_modules = {"attn.c_attn", "attn.c_proj"}  # the attention's c_proj, not the MLP's
    return _drawn(peft.get_peft_model(tiny_gpt2(), config).double(), "lora_B" if trained else None, seed=1)


def _drawn(model: torch.nn.Module, part: str | None, seed: int) -> torch.nn.Module:
    """``model`` in eval mode with the parameters whose names hold ``part`` drawn (none for ``None``)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if part is not None and part in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.eval()


def test_lora_gpt2_matches_the_brute_force_ggn():
    """Every layer of a LoRA GPT-2 (packed base and ``lora_B`` split into query / key / value, the
    tied embedding once) gets the brute-force GGN diagonal with the labels shifted, as the plain
    language model's; the frozen base and the model's state are left as they were."""
    model = lora_gpt2()
    assert hf.is_causal_lm(model)
    before = snapshot(model)
    report = analyze_quietly(model, lm_loader())
    assert_unchanged(model, before)
    layers = [PREFIX + name for name in GPT2_LORA_LAYERS]
    assert [layer.name for layer in report.layers] == layers
    assert report.metadata["coverage"] >= 0.99

    got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", progress=False)
    params = list(dict.fromkeys(param_of(model, name) for name in layers))
    want = canonical_reference(model, reference_ggn(model, lm_loader(), params, shift=True), layers)
    assert_close(got, want)


def test_fresh_adapters_leave_the_base_layers_numbers():
    """With ``lora_B`` at zero the LoRA model computes the plain model's function: each base layer
    (each block of the packed ``c_attn``) has the plain layer's normalized sharpness and trace, for
    the GGN and the exact Hessian (so the blocks and the label shift are the plain model's)."""
    plain, model = tiny_gpt2(), lora_gpt2(trained=False)
    for estimator in ("ggn", "exact"):
        want = normflat.analyze(plain, lm_loader(), estimator=estimator, progress=False)
        got = normflat.analyze(model, lm_loader(), estimator=estimator, progress=False)
        assert got.metadata["loss_terms"] == want.metadata["loss_terms"]
        for layer in want.layers:
            name = PREFIX + layer.name.replace(".c_attn.", ".c_attn.base_layer.")
            if ".attn.c_proj" in name:
                name = name.replace(".c_proj", ".c_proj.base_layer")
            other = got.layer(name)
            assert other.normalized_sharpness == pytest.approx(layer.normalized_sharpness, rel=1e-10), name
            assert other.hessian_trace == pytest.approx(layer.hessian_trace, rel=1e-10), name


def test_lora_rank_rescaling_leaves_normalized_sharpness_unchanged():
    """``lora_A``'s rows times positive factors and ``lora_B``'s columns divided by them (one factor
    per rank): the logits are unchanged, every layer's normalized sharpness stays, the adapters'
    traces move (method §8)."""
    model = lora_gpt2()
    other = copy.deepcopy(model)
    factors = torch.tensor([4.0, 0.3], dtype=torch.float64)
    with torch.no_grad():
        for name, module in other.named_modules():
            if name.endswith("lora_A.default"):
                module.weight.mul_(factors[:, None])
            elif name.endswith("lora_B.default"):
                module.weight.div_(factors)
    _assert_rank_rescaled(model, other, ".lora_")


def _assert_rank_rescaled(model, other, moved: str):
    """``other`` (``model`` rescaled) computes the same logits on a batch; every layer's normalized sharpness
    is the same, the traces of the layers whose names hold ``moved`` are not (method §8). Returns the
    second report."""
    batch = next(iter(lm_loader()))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(other(**inputs).logits, model(**inputs).logits, rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, [batch], estimator="ggn", progress=False)
    after = normflat.analyze(other, [batch], estimator="ggn", progress=False)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
        if moved in lb.name:
            assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), lb.name
    return after


def test_lora_on_timm_qkv_keeps_the_query_key_value_blocks():
    """timm's packed ``qkv`` under a LoRA adapter: its base layer and its ``lora_B`` map are split into
    query / key / value, and with fresh adapters the base blocks have the plain ViT's numbers."""
    torch.manual_seed(0)
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=8,
                              embed_dim=8, depth=1, num_heads=2, mlp_ratio=2.0).double().eval()
    model = peft.get_peft_model(copy.deepcopy(plain), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv"]))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(4, 3, 16, 16, generator=g, dtype=torch.float64), torch.arange(4) % 3)
    want = normflat.analyze(plain, data, estimator="ggn", progress=False)
    got = normflat.analyze(model, data, estimator="ggn", progress=False)
    qkv = PREFIX + "blocks.0.attn.qkv."
    names = [layer.name for layer in got.layers]
    for part in ("query", "key", "value"):
        assert qkv + "base_layer." + part in names and qkv + "lora_B.default." + part in names
        base = got.layer(qkv + "base_layer." + part)
        plain_layer = want.layer("blocks.0.attn.qkv." + part)
        assert base.normalized_sharpness == pytest.approx(plain_layer.normalized_sharpness, rel=1e-10), part
    assert np.isfinite(got.normalized_sharpness)


def lora_gpt2_embedding(use_dora: bool = False) -> torch.nn.Module:
    """Tiny GPT-2 with rank-2 LoRA adapters on its token embedding (tied to the LM head) and on the packed
    ``c_attn``, every factor drawn (PEFT starts the embedding's ``A`` at zero); ``use_dora``: DoRA."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["wte", "c_attn"], fan_in_fan_out=True,
                             task_type="CAUSAL_LM", use_dora=use_dora)
    return _drawn(peft.get_peft_model(tiny_gpt2(), config).double(), "lora_", seed=2)


EMBEDDING_ADAPTERS = [PREFIX + f"transformer.wte.lora_embedding_{f}.default" for f in ("A", "B")]


@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_embedding_adapters_against_brute_force(use_dora):
    """PEFT's LoRA on a token embedding (``base(x) + F.embedding(x, Aᵀ) Bᵀ · s``, its factors raw parameters
    in ``ParameterDict`` containers, the base table tied to the LM head): ``A`` ``(r, V)`` and ``B``
    ``(d, r)`` are analyzed as they are stored (a table of ``r`` features, a dense map; method §3, "LoRA
    adapters"), on their fast rules (method §6.1), with the brute-force GGN diagonal, whole and in
    chunks, and ``ggn-mc`` equal to the generic path's. DoRA's embedding (another forward) takes the
    generic path with the reason. Before, the adapters were skipped as unsupported (coverage 0.85 on a
    small model)."""
    model = lora_gpt2_embedding(use_dora)
    before = snapshot(model)
    report = analyze_quietly(model, lm_loader())
    assert_unchanged(model, before)
    assert report.metadata["coverage"] >= 0.99
    for name in EMBEDDING_ADAPTERS:
        details = report.layer(name).details
        assert details["path"] == ("generic" if use_dora else "fast"), details
        if use_dora:
            assert "DoRA" in details["generic_reason"], details
    assert report.layer(EMBEDDING_ADAPTERS[0]).kind == "embedding"
    want = reference_ggn(model, lm_loader(), EMBEDDING_ADAPTERS + [PREFIX + "transformer.wte.base_layer.weight"],
                         shift=True)
    for chunk in (None, 2):
        got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", chunk_size=chunk, progress=False)
        assert_close({name: got[name] for name in EMBEDDING_ADAPTERS}, {name: want[name] for name in EMBEDDING_ADAPTERS})
        base = PREFIX + "transformer.wte.base_layer"
        assert_close({base: got[base]}, {base: want[base + ".weight"].T})
    mc = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn-mc", samples=3, seed=1, progress=False)
    generic = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn-mc", samples=3, seed=1, fast=False,
                                        progress=False)
    assert_close({name: mc[name] for name in EMBEDDING_ADAPTERS}, {name: generic[name].numpy() for name in
                                                                    EMBEDDING_ADAPTERS})


def test_lora_embedding_rank_rescaling():
    """The embedding adapter's ``A`` rows (one per rank) times positive factors and ``B``'s columns divided
    by them: the same logits, every normalized sharpness the same, the adapters' traces moved (method §8)."""
    model = lora_gpt2_embedding()
    other = copy.deepcopy(model)
    factors = torch.tensor([3.0, 0.4], dtype=torch.float64)
    with torch.no_grad():
        wte = other.base_model.model.transformer.wte
        wte.lora_embedding_A["default"].mul_(factors[:, None])
        wte.lora_embedding_B["default"].div_(factors)
    after = _assert_rank_rescaled(model, other, ".lora_embedding_")
    assert after.layer(EMBEDDING_ADAPTERS[0]).details["path"] == "fast"


def _looped_ggn(model: torch.nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    """The ``nsce`` GGN diagonal of the named parameters from per-sample Jacobians, one logit's gradient
    at a time with ``torch.autograd.grad`` (LoHa's own ``autograd.Function`` has no functorch rule)."""
    params = dict(model.named_parameters())
    wanted = [params[name] for name in names]
    out = {name: torch.zeros_like(params[name]) for name in names}
    for i in range(x.shape[0]):
        z = model(x[i:i + 1])[0]
        z = z - z.mean()
        u = z / torch.sqrt((z**2).mean() + NSCE_EPS)
        p = torch.softmax(u.detach(), 0)
        h = torch.diag(p) - p[:, None] * p[None, :]
        rows = [torch.autograd.grad(u[c], wanted, retain_graph=True) for c in range(u.shape[0])]
        for j, name in enumerate(names):
            jac = torch.stack([row[j].reshape(-1) for row in rows])  # (C, entries)
            out[name] += ((h @ jac) * jac).sum(0).reshape(params[name].shape)
    return {name: value / x.shape[0] for name, value in out.items()}


class TokenConvNet(torch.nn.Module):
    """Token ids -> ``Embedding`` -> ``Conv1d`` (tanh, mean over the tokens) -> ``Linear`` (tanh) -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 6)
        self.conv = torch.nn.Conv1d(6, 5, 3, padding=1)
        self.fc = torch.nn.Linear(5, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        h = torch.tanh(self.conv(self.emb(ids).transpose(1, 2))).mean(2)
        return self.head(torch.tanh(self.fc(h)))


#: PEFT's adapters whose factors their layers apply themselves: the config, and per factor pair
#: ``(scaled by c per rank, divided by it)`` the rank rescaling that leaves the function as it is.
OTHER_ADAPTERS = {
    "adalora": (lambda: peft.AdaLoraConfig(r=2, init_r=2, target_r=2, target_modules=["fc"], total_step=10),
                [("fc.lora_A", 0, "fc.lora_B", 1)]),
    "loha": (lambda: peft.LoHaConfig(r=2, target_modules=["conv", "fc"]),
             [(f"{m}.hada_w{i}_a", 1, f"{m}.hada_w{i}_b", 0) for m in ("conv", "fc") for i in (1, 2)]),
    "lokr": (lambda: peft.LoKrConfig(r=2, target_modules=["conv", "fc"]),
             [(f"{m}.lokr_w2_a", 1, f"{m}.lokr_w2_b", 0) for m in ("conv", "fc")]),
}


def _other_adapter_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return _drawn(peft.get_peft_model(TokenConvNet(), OTHER_ADAPTERS[kind][0]()).double(), "", seed=3)


@pytest.mark.parametrize("kind", list(OTHER_ADAPTERS))
def test_other_adapters_factors_are_analyzed(kind):
    """AdaLoRA's, LoHa's and LoKr's factors (raw parameters in ``ParameterDict`` containers, combined by
    their layers' forwards: ``x (A ⊙ E)ᵀ Bᵀ``, ``(W1a W1b) ⊙ (W2a W2b)``, ``W1 ⊗ (W2a W2b)``) are analyzed as
    stored on the generic path with the reason, their vectors (AdaLoRA's ``E``) excluded: coverage 1,
    the brute-force diagonal; each rank's rescaling (one factor's column × c, the other's row / c)
    leaves every normalized sharpness unchanged and moves the factors' traces (method §3, §8). Before,
    they were skipped as unsupported (coverage 0.65 for LoHa on this model)."""
    model = _other_adapter_model(kind)
    g = torch.Generator().manual_seed(4)
    ids, y = torch.randint(0, 20, (6, 7), generator=g), torch.tensor([0, 1, 2, 0, 1, 2])
    report = analyze_quietly(model, (ids, y), loss="nsce")
    assert report.metadata["coverage"] == 1.0
    factors = [PREFIX + f"{name}.default" for pair in OTHER_ADAPTERS[kind][1] for name in pair[::2]]
    for name in factors:
        details = report.layer(name).details
        assert details["path"] == "generic" and "PEFT adapter's factor" in details["generic_reason"], details
    got = normflat.hessian_diagonal(model, (ids, y), estimator="ggn", progress=False)
    want = _looped_ggn(model, ids, factors)
    for name in factors:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13)
    other = copy.deepcopy(model)
    params = dict(other.named_parameters())
    c = torch.tensor([2.5, 0.4], dtype=torch.float64)
    with torch.no_grad():
        for scaled, axis, divided, other_axis in OTHER_ADAPTERS[kind][1]:
            params[PREFIX + scaled + ".default"].mul_(c if axis == 1 else c[:, None])
            params[PREFIX + divided + ".default"].div_(c if other_axis == 1 else c[:, None])
    torch.testing.assert_close(other(ids), model(ids), rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, (ids, y), estimator="ggn", progress=False)
    after = normflat.analyze(other, (ids, y), estimator="ggn", progress=False)
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    for name in factors:
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name
