"""Hugging Face mixture-of-experts layers in the torch backend (method §3, "Mixture-of-experts layers").

transformers stores the experts of a sparse MoE block as ``(experts, out, in)`` parameters
(``gate_up_proj`` packing each expert's gate and up projections, ``down_proj``), in four
layouts: concatenated or interleaved gate/up rows, stored as ``(out, in)`` or transposed,
with or without a gate (and Llama 4's older class, every expert on every token). normflat reports one problem per expert and linear map. Checked
here against brute force (per-sample Jacobians of the logits by ``torch.func.jacrev``,
the loss Hessian by autodiff; tests/arch/test_huggingface_models.py): each layout's
blocks, read by the test's own slicing of the parameter; a tiny Mixtral end to end
(router included); that the fused experts kernel transformers picks by default runs as
the loop over the experts and the config is restored; and a function-preserving
rescaling of every expert and of the features entering the block.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers.models.aria.modeling_aria import AriaExperts
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

import normflat
from normflat.backends.torch import hf

from .test_huggingface_models import (VOCAB, analyze_quietly, assert_close, assert_unchanged, lm_loader,
                                      reference_ggn, snapshot)

EXPERTS, TOP_K, HIDDEN, INTER, CLASSES = 4, 2, 6, 5, 3


# ============================================================================ one experts module of each layout


def _experts(kind: str) -> torch.nn.Module:
    """An experts module of transformers in each stored layout, random weights and biases."""
    common = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=2, num_key_value_heads=1,
                  experts_implementation="eager")
    if kind == "mixtral":  # (E, 2I, H): gate rows then up rows
        module = MixtralExperts(transformers.MixtralConfig(num_local_experts=EXPERTS, **common))
    elif kind == "gpt_oss":  # (E, H, 2I) transposed, gate and up interleaved, biases
        module = GptOssExperts(transformers.GptOssConfig(num_local_experts=EXPERTS, **common))
    elif kind == "aria":  # (E, H, 2I) transposed, gate rows then up rows
        module = AriaExperts(transformers.AriaTextConfig(moe_num_experts=EXPERTS, **common))
    elif kind == "llama4":  # (E, H, 2I) transposed, every expert on every token (older than the flags)
        module = Llama4TextExperts(transformers.Llama4TextConfig(num_local_experts=EXPERTS, **common))
    else:  # NemotronH: (E, I, H) up projection and an activation, no gate
        module = NemotronHExperts(transformers.NemotronHConfig(
            n_routed_experts=EXPERTS, moe_intermediate_size=INTER, hidden_size=HIDDEN,
            num_attention_heads=2, num_key_value_heads=1, experts_implementation="eager", mlp_hidden_act="relu2"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module.double()


class _RoutedClassifier(torch.nn.Module):
    """Features -> dense -> a softmax top-k routing (float64, an ``nn.Linear`` router) -> the experts
    -> mean over the tokens -> dense head."""

    def __init__(self, experts: torch.nn.Module):
        super().__init__()
        self.embed = torch.nn.Linear(4, HIDDEN)
        self.router = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = experts
        self.head = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        h = self.embed(x).reshape(n * t, HIDDEN)
        weights, index = torch.topk(torch.softmax(self.router(h), -1), TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        if isinstance(self.experts, Llama4TextExperts):  # its block scales each expert's copy of the input
            scores = torch.zeros(n * t, EXPERTS, dtype=h.dtype).scatter(1, index, weights)
            routed = h.repeat(EXPERTS, 1) * scores.T.reshape(-1, 1)
            mixed = self.experts(routed).reshape(EXPERTS, n * t, HIDDEN).sum(0)
        else:
            mixed = self.experts(h, index, weights)
        return self.head(mixed.reshape(n, t, HIDDEN).mean(1))


def _expert_blocks(kind: str, per_param: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference diagonals of ``experts.{e}.{gate,up,down}_proj``, each expert's ``(out, in)``
    matrix sliced out of the stored parameters by hand."""
    out: dict[str, np.ndarray] = {}
    first = per_param["experts.up_proj" if kind == "nemotron" else "experts.gate_up_proj"]
    down = per_param["experts.down_proj"]
    for e in range(EXPERTS):
        w = first[e].T if kind in ("gpt_oss", "aria", "llama4") else first[e]  # (rows, H)
        if kind == "nemotron":
            out[f"experts.{e}.up_proj"] = w
        elif kind == "gpt_oss":
            out[f"experts.{e}.gate_proj"], out[f"experts.{e}.up_proj"] = w[0::2], w[1::2]
        else:
            half = w.shape[0] // 2
            out[f"experts.{e}.gate_proj"], out[f"experts.{e}.up_proj"] = w[:half], w[half:]
    for e in range(EXPERTS):
        out[f"experts.{e}.down_proj"] = down[e].T if kind in ("gpt_oss", "aria", "llama4") else down[e]
    return out


def _classifier_logits(ref, values, batch, i):
    return torch.func.functional_call(ref, values, (batch["x"][i:i + 1],))[0]


def _tokens(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(5, 3, 4, generator=g, dtype=torch.float64),
            "labels": torch.randint(0, CLASSES, (5,), generator=g)}


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss", "aria", "llama4", "nemotron"])
def test_each_expert_layout_matches_the_brute_force_ggn(kind):
    """One problem per expert and map, in the canonical ``(out, in)`` layout of every stored
    layout (the test slices the parameters itself), equal to brute force at 1e-10."""
    torch.manual_seed(0)
    model = _RoutedClassifier(_experts(kind)).double()
    batch = _tokens()
    data = [(batch["x"], batch["labels"])]
    before = snapshot(model)
    report = analyze_quietly(model, data, estimator="ggn")
    assert_unchanged(model, before)
    maps = ["up_proj"] if kind == "nemotron" else ["gate_proj", "up_proj"]
    experts = [f"experts.{e}.{m}" for e in range(EXPERTS) for m in maps] + \
        [f"experts.{e}.down_proj" for e in range(EXPERTS)]
    assert [layer.name for layer in report.layers] == ["embed", "router", *experts, "head"]
    assert report.metadata["coverage"] == 1.0
    assert {layer.kind for layer in report.layers if layer.name.startswith("experts.")} == {"expert"}
    # The fast rule recomputes use_experts_implementation's classes; Llama 4's older one is generic.
    assert {layer.details["path"] for layer in report.layers if layer.name.startswith("experts.")} == \
        {"generic" if kind == "llama4" else "fast"}
    assert report.layer("experts.0.down_proj").shape == (HIDDEN, INTER)
    first = "experts.up_proj" if kind == "nemotron" else "experts.gate_up_proj"
    per_param = reference_ggn(model, [batch], [first, "experts.down_proj"], loss="nsce",
                              logits_of=_classifier_logits)
    want = _expert_blocks(kind, per_param)
    assert all(np.abs(w).max() > 0 for w in want.values())  # every expert hit by some token
    for fast in (True, False):
        got = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, fast=fast)
        assert_close({name: got[name] for name in want}, want)


def _hessian_diagonal(model, batch, name):
    """The diagonal of the autodiff Hessian of the mean ``nsce`` loss in the parameter ``name``."""
    values = {n: p.detach() for n, p in model.named_parameters()}
    x, y = batch["x"], batch["labels"]

    def loss(flat):
        z = torch.func.functional_call(model, {**values, name: flat.reshape(values[name].shape)}, (x,))
        centred = z - z.mean(-1, keepdim=True)
        u = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + 1e-12)
        return torch.nn.functional.cross_entropy(u, y)

    h = torch.autograd.functional.hessian(loss, values[name].reshape(-1), vectorize=True)
    return torch.diagonal(h).reshape(values[name].shape).numpy()


def test_exact_matches_the_autodiff_hessian():
    """``exact`` (Hessian-vector products through the experts) on GPT-OSS's layout, transposed and
    interleaved, laid out per expert and map as the GGN is: the autodiff Hessian's diagonal."""
    torch.manual_seed(0)
    model = _RoutedClassifier(_experts("gpt_oss")).double()
    batch = _tokens()
    got = normflat.hessian_diagonal(model, [(batch["x"], batch["labels"])], estimator="exact", progress=False)
    want = _expert_blocks("gpt_oss", {n: _hessian_diagonal(model, batch, n)
                                      for n in ("experts.gate_up_proj", "experts.down_proj")})
    assert all(np.abs(w).max() > 0 for w in want.values())
    assert_close({name: got[name] for name in want}, want)


# ============================================================================ a Mixtral language model


MIXTRAL_LAYERS = (["model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                   "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate"]
                  + [f"model.layers.0.mlp.experts.{e}.{m}" for e in range(EXPERTS) for m in ("gate_proj", "up_proj")]
                  + [f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(EXPERTS)] + ["lm_head"])


def tiny_mixtral(dtype=torch.float64, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=6, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=8,
        bos_token_id=1, eos_token_id=1, pad_token_id=0, **config)
    return transformers.MixtralForCausalLM(config).to(dtype)


def test_mixtral_is_covered_and_matches_the_brute_force_ggn():
    """Router and experts analyzed (coverage 1), the router as its ``(experts, features)`` matrix; the
    diagonals equal brute force (to 1e-6: Mixtral's RMSNorm and router softmax compute in float32
    also in a float64 model, and the two computations round differently)."""
    model = tiny_mixtral(experts_implementation="eager")
    before = snapshot(model)
    report = analyze_quietly(model, lm_loader(), estimator="ggn", loss="ce")
    assert_unchanged(model, before)
    assert [layer.name for layer in report.layers] == MIXTRAL_LAYERS
    assert report.metadata["coverage"] == 1.0
    gate = report.layer("model.layers.0.mlp.gate")
    assert gate.kind == "router" and gate.shape == (EXPERTS, 8)
    assert {layer.details["path"] for layer in report.layers} == {"fast"}
    mlp = "model.layers.0.mlp"
    params = [f"{mlp}.gate.weight", f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj"]
    per_param = reference_ggn(model, lm_loader(), params, loss="ce", shift=True)
    blocks = _expert_blocks("mixtral", {k.removeprefix(f"{mlp}."): v for k, v in per_param.items()})
    want = {f"{mlp}.gate": per_param[f"{mlp}.gate.weight"], **{f"{mlp}.{k}": v for k, v in blocks.items()}}
    # Chunks of one sample too: the experts' and router's rows are then all that sample's tokens.
    for options in ({}, {"chunk_size": 1}, {"fast": False}):
        got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", loss="ce", progress=False, **options)
        assert_close({name: got[name] for name in want}, want, rtol=1e-6)


def test_fused_experts_kernel_runs_as_the_expert_loop_and_is_restored():
    """transformers' default experts kernel (``grouped_mm`` where it dispatches: no ``vmap``
    batching rule, no float64) runs as the loop over the experts during the analysis only: the
    same diagonals as the model built with ``"eager"``, no warning, the config restored."""
    fused = tiny_mixtral(torch.float32)
    assert fused.config._experts_implementation == "grouped_mm"
    eager = tiny_mixtral(torch.float32, experts_implementation="eager")
    before = snapshot(fused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = {fast: normflat.hessian_diagonal(fused, lm_loader(), estimator="ggn", loss="ce", progress=False,
                                               fast=fast) for fast in (True, False)}
        trace = normflat.analyze(fused, lm_loader(), estimator="hutchinson", samples=2, seed=0, progress=False)
    assert [str(w.message) for w in caught] == []
    assert_unchanged(fused, before)
    assert fused.config._experts_implementation == "grouped_mm"
    for fast in (True, False):
        want = normflat.hessian_diagonal(eager, lm_loader(), estimator="ggn", loss="ce", progress=False, fast=fast)
        assert_close(got[fast], {name: v.numpy() for name, v in want.items()}, rtol=0)
    assert trace.hessian_trace == normflat.analyze(eager, lm_loader(), estimator="hutchinson", samples=2, seed=0,
                                                   progress=False).hessian_trace


def test_mixtral_rescaling_invariance():
    """Per expert, its up projection's rows times positive factors and its down projection's columns
    divided by them (``silu(gate) · up`` is linear in ``up``); the features entering the block (the
    RMSNorm's scale) times factors, the router's and every gate/up projection's columns divided by
    them: the function is unchanged, every normalized sharpness stays, the rescaled layers' traces
    move."""
    model = tiny_mixtral(experts_implementation="eager")
    other = copy.deepcopy(model)
    mlp = other.model.layers[0].mlp
    features = torch.exp(torch.linspace(-0.7, 0.7, 8, dtype=torch.float64))
    with torch.no_grad():
        other.model.layers[0].post_attention_layernorm.weight.mul_(features)
        mlp.gate.weight.div_(features)
        mlp.experts.gate_up_proj.div_(features)
        for e in range(EXPERTS):
            units = torch.exp(torch.linspace(0.8, -0.8, 6, dtype=torch.float64) * (e + 1) / EXPERTS)
            mlp.experts.gate_up_proj[e, 6:].mul_(units[:, None])
            mlp.experts.down_proj[e].div_(units)
    ids = next(iter(lm_loader()))["input_ids"]
    torch.testing.assert_close(other(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-7)
    before = normflat.analyze(model, lm_loader(), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, lm_loader(), loss="ce", estimator="ggn", progress=False)
    for lb, la in zip(before.layers, after.layers):
        # 1e-5: the block's RMSNorm and router compute in float32 (see above).
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-5), lb.name
    for name in ["model.layers.0.mlp.gate", *(n for n in MIXTRAL_LAYERS if ".experts." in n)]:
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-2 * abs(before.layer(name).hessian_trace), name


class _OtherGateExperts(MixtralExperts):
    """Its ``_apply_gate`` (what the fast rule recomputes) is not what its eager forward computes."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate * up


class _DownUsedOutside(_RoutedClassifier):
    """The experts' ``down_proj`` also read outside the experts module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.1 * self.experts.down_proj[0, :CLASSES, 0]


@pytest.mark.parametrize("case", ["gate", "outside"])
def test_expert_fast_rule_checks_what_it_assumes(case):
    """An experts forward that is not the gated MLP the rule recomputes (checked once against the
    module's own forward), or a stacked weight also used outside the module: the generic path with
    the reason, and still the brute-force diagonal."""
    torch.manual_seed(0)
    experts = _experts("mixtral")
    if case == "gate":
        experts.__class__ = _OtherGateExperts
        model = _RoutedClassifier(experts).double()
    else:
        model = _DownUsedOutside(experts).double()
    batch = _tokens()
    data = [(batch["x"], batch["labels"])]
    report = analyze_quietly(model, data, estimator="ggn")
    reasons = {layer.details.get("generic_reason") for layer in report.layers if layer.name.startswith("experts.")}
    if case == "gate":
        assert reasons == {"the experts' forward does not compute the routed gated MLP the fast rule assumes"}
    else:  # gate_up_proj is read only inside the module: still fast
        down = {layer.details.get("generic_reason") for layer in report.layers if "down_proj" in layer.name}
        assert len(down) == 1 and down.pop().startswith("weight used "), reasons
        assert {layer.details["path"] for layer in report.layers if "up_proj" in layer.name} == {"fast"}
    per_param = reference_ggn(model, [batch], ["experts.gate_up_proj", "experts.down_proj"], loss="nsce",
                              logits_of=_classifier_logits)
    want = _expert_blocks("mixtral", per_param)
    got = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False)
    assert_close({name: got[name] for name in want}, want)


def _gpt_oss():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=6, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                                       num_experts_per_tok=TOP_K, head_dim=4, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=1, experts_implementation="eager")
    return transformers.GptOssForCausalLM(config).double()


def _assert_fast_equals_generic(model):
    got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", loss="ce", progress=False)
    want = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", loss="ce", progress=False, fast=False)
    assert_close(got, {name: v.numpy() for name, v in want.items()}, rtol=1e-9)


def test_router_with_a_bias_is_fast():
    """GPT-OSS's router returns ``F.linear(hidden_states, weight, bias)`` first: its bias does not change
    the signals at those logits, and the first call's check accepts it; the whole model is fast, and
    equals the generic path."""
    model = _gpt_oss()
    report = analyze_quietly(model, lm_loader(), estimator="ggn", loss="ce")
    assert {layer.details["path"] for layer in report.layers} == {"fast"}, [
        (layer.name, layer.details.get("generic_reason")) for layer in report.layers]
    _assert_fast_equals_generic(model)


class _ScaledLogitsRouter(GptOssTopKRouter):
    """Returns its logits halved first (``first="scaled"``: not the linear map the router rule takes its
    signals at), or a copy of them (``"copy"``, ``"detached"``: the scores are computed from the
    original, so no signal reaches the copy)."""

    first = "scaled"

    def forward(self, hidden_states):
        if self.first in ("copy", "detached"):
            logits, scores, indices = super().forward(hidden_states)
            return (logits.clone() if self.first == "copy" else logits.detach()), scores, indices
        logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias) * 0.5
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=1), indices


@pytest.mark.parametrize("first, reason", [
    ("scaled", "the router does not return F.linear(hidden_states, weight) first"),
    ("copy", "no signal reaches the first output it returns"),
    ("detached", "no signal reaches the first output it returns"),
])
def test_router_not_returning_its_logits_first_takes_the_generic_path(first, reason):
    """A router whose first output is not its linear map, or not the tensor the model goes on with:
    the first call's checks send it to the generic path, whose diagonal the fast path of every other
    layer matches (a signal-less copy would otherwise give the router a zero diagonal)."""
    from normflat.backends.torch import register_layer
    from normflat.backends.torch.layers import REGISTRY

    model = _gpt_oss()
    router = model.model.layers[0].mlp.router
    router.__class__ = _ScaledLogitsRouter
    router.first = first
    # Registered as a router itself (a subclass overriding a known router's forward is refused earlier).
    register_layer(_ScaledLogitsRouter, kind="router", check=hf.check_router, ggn_squares=hf.router_squares)
    try:
        report = analyze_quietly(model, lm_loader(), estimator="ggn", loss="ce")
        assert reason in report.layer("model.layers.0.mlp.router").details["generic_reason"]
        assert {layer.details["path"] for layer in report.layers if ".experts." in layer.name} == {"fast"}
        _assert_fast_equals_generic(model)
    finally:
        REGISTRY.unregister(_ScaledLogitsRouter)


class _RouterLike(torch.nn.Module):
    def forward(self, hidden_states):
        return torch.nn.functional.linear(hidden_states.float(), self.weight.float()).softmax(-1)


class _RouterReadingTheWeightTwice(torch.nn.Module):
    def forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        return logits + self.weight.sum()


def test_router_is_recognized_by_how_its_forward_reads_the_weight():
    """A router's matrix is analyzed only when its forward reads it as ``F.linear(x, self.weight)``."""
    assert hf._linear_router(_RouterLike)
    assert not hf._linear_router(_RouterReadingTheWeightTwice)
    assert not hf._linear_router(torch.nn.Module)


def test_switch_transformers_router_converting_its_classifier():
    """Switch Transformers' router converts its classifier in its forward
    (``self.classifier = self.classifier.to(self.dtype)``); its experts take the generic path, whose
    ``torch.func`` transforms then failed inside torch and left the router's weight broken (the process
    crashed). Now the analysis covers every weight, on the generic path for the experts, and leaves the
    model as it was."""
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1)).double().eval()
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(3, VOCAB, (n, 6), generator=g),
             "labels": torch.randint(3, VOCAB, (n, 4), generator=g)} for n in (2, 3)]
    before = snapshot(model)
    report = analyze_quietly(model, data, loss="ce")
    assert report.metadata["coverage"] == 1.0
    assert any("experts" in layer.name and layer.details["path"] == "generic" for layer in report.layers)
    assert all(np.isfinite(layer.normalized_sharpness) for layer in report.layers)
    assert_unchanged(model, before)
    model(**data[0])  # still usable


def test_switch_transformers_chunks_agree_with_a_float64_router():
    """Chunks of one sample give the default chunks' numbers (float64). The router computes in
    ``config.router_dtype`` (float32 at most) even in a float64 model, and float32 products round
    differently for another batch shape: about 1e-7 apart with it. That is the model's own arithmetic,
    not the analysis': with the router in float64 they agree to rounding."""
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, num_experts=2, expert_capacity=64, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1)).double().eval()
    routers = [m for m in model.modules() if type(m).__name__.endswith("Top1Router")]
    assert routers
    for router in routers:
        router.dtype = torch.float64  # the config accepts float32, float16 and bfloat16 only
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(3, VOCAB, (n, 6), generator=g),
             "labels": torch.randint(3, VOCAB, (n, 4), generator=g)} for n in (2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", progress=False)
        single = normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", progress=False, chunk_size=1)
    assert whole.keys() == single.keys()
    for name in whole:
        scale = float(whole[name].abs().max())
        assert float((whole[name] - single[name]).abs().max()) <= 1e-10 * scale, name
