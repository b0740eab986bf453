"""Hugging Face ``transformers`` models end to end in the torch backend (method §3, §6.3).

Tiny BERT, ViT and GPT-2 models built from configs (random init, nothing is
downloaded), float64, analyzed by a plain ``normflat.analyze(model, loader)`` on
Hugging Face style batches (dict / ``BatchEncoding`` batches from the library's
data collators). Checked: the layer names and canonical matrices (GPT-2's packed
``c_attn`` split into query / key / value, ``Conv1D`` transposed, the tied
``wte`` / ``lm_head`` reported once), the coverage and ``excluded`` metadata, the
GGN diagonal against a brute-force reference (per-sample Jacobians of the
logits with respect to the analyzed weights by ``torch.func.jacrev`` and the
per-token loss Hessian by ``torch.autograd.functional.hessian``), ``exact``
against the autodiff Hessian diagonal, the per-head attention rescalings of
method §8 item 5 on GPT-2's packed projection, and that the model is unchanged.

The references run on a deep copy of the model with torch's math kernel of
``scaled_dot_product_attention`` chosen by ``torch.nn.attention.sdpa_kernel``
(transformers' ``"eager"`` attention is not used: some models' eager softmax runs
in float32), so they share no code with normflat.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers.pytorch_utils import Conv1D

import normflat
from normflat.engine.registry import STATE_DECAY_REASON
from normflat.backends.torch import hf
from normflat.backends.torch.ggn import transposed_linear_squares

NSCE_EPS = 1e-12
VOCAB = 24
HIDDEN = 8
HEADS = 2


# ============================================================================ tiny models and data


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                     num_attention_heads=HEADS, intermediate_size=16, max_position_embeddings=8,
                                     type_vocab_size=2, num_labels=3, pad_token_id=0)
    return transformers.BertForSequenceClassification(config).double()


def tiny_vit(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN,
                                    num_hidden_layers=1, num_attention_heads=HEADS, intermediate_size=16,
                                    num_labels=3)
    return transformers.ViTForImageClassification(config).double()


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=HIDDEN, n_layer=1, n_head=HEADS,
                                     n_inner=16, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied by the config's default
    return model


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """Llama-style: grouped-query attention (one key/value head), RMSNorm, gated MLP, untied head."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=8,
                                      bos_token_id=1, eos_token_id=1, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).double()


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w0 .. w21`` built in memory (id 0 is the padding)."""
    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


TEXTS = ["w1 w2 w3 w4 w5", "w6 w7 w8", "w9 w3 w1 w2", "w5 w5 w6 w7 w8", "w10 w11", "w12 w4 w20 w2"]


def bert_loader() -> torch.utils.data.DataLoader:
    """Padded sentences with token types and a class label, batched by ``DataCollatorWithPadding``."""
    tok = tiny_tokenizer()
    examples = []
    for i, text in enumerate(TEXTS):
        enc = tok(text)
        n = len(enc["input_ids"])
        enc["token_type_ids"] = [0] * (n // 2) + [1] * (n - n // 2)
        enc["label"] = i % 3
        examples.append(enc)
    collator = transformers.DataCollatorWithPadding(tok, return_tensors="pt")
    return torch.utils.data.DataLoader(examples, batch_size=3, collate_fn=collator)


def vit_loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    examples = [{"pixel_values": torch.randn(3, 8, 8, generator=g, dtype=torch.float64), "label": i % 3}
                for i in range(5)]
    return torch.utils.data.DataLoader(examples, batch_size=3, collate_fn=transformers.default_data_collator)


def lm_loader() -> torch.utils.data.DataLoader:
    """Causal LM batches: ``labels = input_ids`` with -100 at the padding (``DataCollatorForLanguageModeling``)."""
    tok = tiny_tokenizer()
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    return torch.utils.data.DataLoader([tok(t) for t in TEXTS], batch_size=3, collate_fn=collator)


# ============================================================================ brute-force reference


def _normalized(z: torch.Tensor) -> torch.Tensor:
    """The normalized logits of method §7 (τ = 1), the textbook formula."""
    centred = z - z.mean(-1, keepdim=True)
    return centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + NSCE_EPS)


def _reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).eval()


def _math_attention():
    """torch's own switch to the math attention kernel (differentiable twice and under vmap)."""
    return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)


def _token_targets(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    if not shift:
        return labels
    return torch.cat([labels[..., 1:], torch.full_like(labels[..., :1], -100)], dim=-1)


def reference_ggn(model: torch.nn.Module, loader, params: list[str], loss: str = "nsce",
                  shift: bool = False, logits_of=None) -> dict[str, np.ndarray]:
    """The GGN diagonal of the mean loss, per parameter, in the parameter's own layout.

    ``diag G = (1/N) Σ_samples Σ_counted terms diag(Jᵀ H J)`` with ``J`` the Jacobian of
    one term's outputs (the logits for ``ce``, the normalized logits for ``nsce``:
    method §7 splits after the normalization) with respect to ``params``, and ``H``
    the Hessian of the cross-entropy in those outputs; ``N`` counts the terms (the
    counted tokens for token logits, the samples otherwise).

    Args:
        logits_of: ``(model, params, batch, i) -> logits of sample i``; default: a
            Hugging Face model called with the batch's keyword inputs, ``.logits``.
    """
    ref = _reference_copy(model)
    values = {n: p.detach() for n, p in ref.named_parameters()}
    logits_of = logits_of or _hf_logits
    total = {n: torch.zeros_like(values[n]) for n in params}
    terms = 0
    with _math_attention():
        for batch in loader:
            labels = batch["labels"]
            for i in range(labels.shape[0]):

                def outputs(w: dict, i: int = i) -> torch.Tensor:
                    z = logits_of(ref, {**values, **w}, batch, i)
                    return _normalized(z) if loss == "nsce" else z

                w0 = {n: values[n] for n in params}
                jac = torch.func.jacrev(outputs)(w0)  # {param: (*out, *shape)}
                u = outputs(w0).detach()
                if u.dim() == 1:  # (C,) logits of a classifier: one term
                    rows, targets = u[None], labels[i].reshape(1)
                    jac = {n: j[None] for n, j in jac.items()}
                else:  # (T, C) token logits: one term per counted token
                    rows, targets = u, _token_targets(labels[i], shift)
                for t in range(rows.shape[0]):
                    if int(targets[t]) == -100:
                        continue
                    terms += 1
                    h = torch.autograd.functional.hessian(
                        lambda v, t=t: F.cross_entropy(v[None], targets[t:t + 1]), rows[t])
                    for n in params:
                        j = jac[n][t].reshape(rows.shape[1], -1)
                        total[n] += torch.einsum("cp,cd,dp->p", j, h, j).reshape(total[n].shape)
    return {n: (v / terms).numpy() for n, v in total.items()}


def _hf_logits(ref: torch.nn.Module, values: dict, batch: dict, i: int) -> torch.Tensor:
    one = {k: v[i:i + 1] for k, v in batch.items() if k != "labels"}
    return torch.func.functional_call(ref, values, (), one).logits[0]


def reference_hessian(model: torch.nn.Module, loader, params: list[str]) -> dict[str, np.ndarray]:
    """The diagonal of the full autodiff Hessian of the mean ``nsce`` loss, per parameter."""
    ref = _reference_copy(model)
    values = {n: p.detach() for n, p in ref.named_parameters()}
    batches = list(loader)
    count = sum(int(b["labels"].shape[0]) for b in batches)

    def mean_loss(w: dict) -> torch.Tensor:
        total = 0.0
        for b in batches:
            inputs = {k: v for k, v in b.items() if k != "labels"}
            z = torch.func.functional_call(ref, {**values, **w}, (), inputs).logits
            total = total + F.cross_entropy(_normalized(z), b["labels"], reduction="sum")
        return total / count

    out = {}
    for n in params:
        size = values[n].numel()

        def of_flat(flat: torch.Tensor, n: str = n) -> torch.Tensor:
            return mean_loss({n: flat.reshape(values[n].shape)})

        with _math_attention():
            h = torch.autograd.functional.hessian(of_flat, values[n].reshape(-1), vectorize=True)
        out[n] = torch.diagonal(h).reshape(values[n].shape).numpy()
        assert h.shape == (size, size)
    return out


# ============================================================================ canonical layout of the reference


def canonical_reference(model: torch.nn.Module, per_param: dict[str, np.ndarray],
                        names: list[str]) -> dict[str, np.ndarray]:
    """The reference diagonals laid out as normflat reports them (method §3), by layer name.

    ``Conv1D`` and embeddings are transposed (``(out, in)``, ``(features, vocabulary)``),
    a loose position table ``(1, N, d)`` becomes ``(d, N)``, a packed projection's
    ``.query``/``.key``/``.value`` are its row blocks.
    """
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        base, _, part = name.rpartition(".")
        block = None
        if part in ("query", "key", "value") and isinstance(modules.get(base), (Conv1D, torch.nn.Linear)) \
                and name not in modules:
            block, name_of_module = ("query", "key", "value").index(part), base
        else:
            name_of_module = name
        module = modules.get(name_of_module)
        if module is None:  # a loose parameter: a position table
            table = per_param[name_of_module]
            out[name] = table.reshape(-1, table.shape[-1]).T
            continue
        diag = per_param[f"{name_of_module}.weight"]
        if isinstance(module, (Conv1D, torch.nn.Embedding)):
            diag = diag.T
        if block is not None:
            width = diag.shape[0] // 3
            diag = diag[block * width:(block + 1) * width]
        out[name] = diag
    return out


def param_of(model: torch.nn.Module, layer: str) -> str:
    """The parameter behind a reported layer name (its module's weight, or a loose parameter)."""
    modules = dict(model.named_modules())
    base, _, part = layer.rpartition(".")
    if layer not in modules and part in ("query", "key", "value"):
        layer = base
    return f"{layer}.weight" if layer in modules else layer


def assert_close(got: dict, want: dict, rtol: float = 1e-10) -> None:
    assert list(got) == list(want)
    for name in want:
        g = np.asarray(got[name].detach().cpu() if isinstance(got[name], torch.Tensor) else got[name])
        w = want[name]
        assert g.shape == w.shape, name
        scale = max(float(np.abs(w).max()), 1e-300)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=name)


# ============================================================================ model snapshot


def snapshot(model: torch.nn.Module) -> dict:
    """Everything an analysis must leave as it found it."""
    configs = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in configs:
            configs[id(config)] = (name, config.to_dict(), config.__dict__.get("_attn_implementation_internal"))
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "configs": list(configs.values()),
    }


def assert_unchanged(model: torch.nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    for k in before["state"]:
        assert torch.equal(after["state"][k], before["state"][k]), k
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]
    assert all(g is None for g in after["grads"])
    assert after["configs"] == before["configs"]


def analyze_quietly(model, loader, **options):
    """``normflat.analyze`` asserting that no layer is reported unsupported (no warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = normflat.analyze(model, loader, progress=False, **options)
    skipped = [str(w.message) for w in caught if "normflat" in str(w.message)]
    assert skipped == [], skipped
    assert report.metadata["unsupported"] == []
    return report


# ============================================================================ tests


BERT_LAYERS = [
    "bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings", "bert.embeddings.token_type_embeddings",
    "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.key",
    "bert.encoder.layer.0.attention.self.value", "bert.encoder.layer.0.attention.output.dense",
    "bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.0.output.dense", "bert.pooler.dense",
    "classifier",
]
VIT_LAYERS = [
    "vit.embeddings.position_embeddings", "vit.embeddings.patch_embeddings.projection",
    "vit.layers.0.attention.q_proj", "vit.layers.0.attention.k_proj", "vit.layers.0.attention.v_proj",
    "vit.layers.0.attention.o_proj", "vit.layers.0.mlp.fc1", "vit.layers.0.mlp.fc2", "classifier",
]
LLAMA_LAYERS = [
    "model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj", "lm_head",
]
GPT2_LAYERS = [
    "transformer.wte", "transformer.wpe", "transformer.h.0.attn.c_attn.query", "transformer.h.0.attn.c_attn.key",
    "transformer.h.0.attn.c_attn.value", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
    "transformer.h.0.mlp.c_proj",
]


@pytest.mark.parametrize("build, loader, layers, excluded", [
    (tiny_bert, bert_loader, BERT_LAYERS, ["bert.embeddings.LayerNorm.weight", "bert.pooler.dense.bias",
                                           "classifier.bias"]),
    (tiny_vit, vit_loader, VIT_LAYERS, ["vit.embeddings.cls_token", "vit.layernorm.weight",
                                        "vit.embeddings.patch_embeddings.projection.bias"]),
    (tiny_gpt2, lm_loader, GPT2_LAYERS, ["transformer.h.0.attn.c_attn.bias", "transformer.ln_f.weight",
                                           "transformer.h.0.mlp.c_fc.bias"]),
], ids=["bert", "vit", "gpt2"])
def test_plain_analyze_matches_the_brute_force_ggn(build, loader, layers, excluded):
    model = build()
    before = snapshot(model)
    report = analyze_quietly(model, loader())
    assert_unchanged(model, before)

    assert [layer.name for layer in report.layers] == layers
    meta = report.metadata
    assert meta["coverage"] >= 0.99
    for name in excluded:
        assert name in meta["excluded"], name
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # Nothing matrix-shaped is excluded: biases, norm scales and the class token are vectors.
    assert all(sum(d > 1 for d in shapes[n]) < 2 for n in meta["excluded"]), meta["excluded"]
    assert np.isfinite(report.normalized_sharpness) and report.normalized_sharpness > 0

    got = normflat.hessian_diagonal(model, loader(), estimator="ggn", progress=False)
    params = list(dict.fromkeys(param_of(model, name) for name in layers))
    shift = build is tiny_gpt2
    assert hf.is_causal_lm(model) == shift
    want = canonical_reference(model, reference_ggn(model, loader(), params, shift=shift), layers)
    assert_close(got, want)


def test_gpt2_token_logits_shift_ignore_index_and_tied_weights():
    model = tiny_gpt2()
    assert hf.is_causal_lm(model) and not hf.is_causal_lm(model.transformer)
    report = analyze_quietly(model, lm_loader(), loss="ce")
    # Counted tokens: each text of k words gives k - 1 shifted labels; the padding (-100) and
    # the last position are not counted (method §6.3).
    assert report.metadata["loss_terms"] == sum(len(t.split()) - 1 for t in TEXTS)
    wte = report.layers[0]
    assert wte.name == "transformer.wte" and wte.details["shared_with"] == ["lm_head"]
    assert wte.details["path"] == "fast"  # the lookup's and the tied head's per-sample gradients, summed
    assert wte.shape == (HIDDEN, VOCAB)  # the first user's layout: an embedding, (features, vocabulary)
    assert [(layer.name, layer.shape) for layer in report.layers[2:5]] == [
        (f"transformer.h.0.attn.c_attn.{part}", (HIDDEN, HIDDEN)) for part in ("query", "key", "value")]
    # Conv1D takes nn.Linear's fast rule on the transposed layout, the packed blocks too.
    assert {layer.details["path"] for layer in report.layers[2:]} == {"fast"}

    params = list(dict.fromkeys(param_of(model, name) for name in GPT2_LAYERS))
    got = normflat.hessian_diagonal(model, lm_loader(), loss="ce", estimator="ggn", progress=False)
    want = canonical_reference(model, reference_ggn(model, lm_loader(), params, loss="ce", shift=True),
                               GPT2_LAYERS)
    assert_close(got, want)
    # Without the shift every non-padding position is counted against its own token (one
    # Monte-Carlo signal per token suffices to count them).
    unshifted = normflat.analyze(model, lm_loader(), loss="ce", shift_labels=False, estimator="ggn-mc", samples=1,
                                 progress=False)
    assert unshifted.metadata["loss_terms"] == sum(len(t.split()) for t in TEXTS)


def tiny_scaled_embedding_lm(family: str, seed: int = 0) -> torch.nn.Module:
    """A causal LM whose token embedding is a Hugging Face ``*ScaledWordEmbedding`` (the lookup times
    ``embed_scale``): Gemma (√hidden, a float32 buffer; the table tied to the head) or BART's decoder
    with ``scale_embedding=True`` (a float; an untied head)."""
    torch.manual_seed(seed)
    if family == "gemma":
        config = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16,
                                          num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=1,
                                          head_dim=HIDDEN // HEADS, max_position_embeddings=8, bos_token_id=1,
                                          eos_token_id=1, pad_token_id=0)
        return transformers.GemmaForCausalLM(config).double()
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, decoder_layers=1, decoder_attention_heads=HEADS,
                                     decoder_ffn_dim=16, max_position_embeddings=8, scale_embedding=True,
                                     bos_token_id=1, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return transformers.BartForCausalLM(config).double()


@pytest.mark.parametrize("family", ["gemma", "bart"])
def test_scaled_word_embedding_takes_the_embedding_fast_rule(family):
    """A scaled word embedding takes ``nn.Embedding``'s fast rule with the signals times its scale (its
    own ``forward``, recognized as exactly the scaled lookup, had sent it, and Gemma's tied head with
    it, to the generic path): the generic path's diagonal, and for BART per-sample Jacobians' (Gemma's
    RMSNorm computes in float32 also in a float64 model: no brute force at 1e-10)."""
    model = tiny_scaled_embedding_lm(family)
    embedding = "model.embed_tokens" if family == "gemma" else "model.decoder.embed_tokens"
    assert type(dict(model.named_modules())[embedding]).__name__.endswith("ScaledWordEmbedding")
    report = analyze_quietly(model, lm_loader(), loss="ce", estimator="ggn")
    details = report.layer(embedding).details
    assert details["path"] == "fast", details
    if family == "gemma":
        assert details["shared_with"] == ["lm_head"]
    got = normflat.hessian_diagonal(model, lm_loader(), loss="ce", estimator="ggn", progress=False)
    generic = normflat.hessian_diagonal(model, lm_loader(), loss="ce", estimator="ggn", progress=False, fast=False)
    assert_close(got, generic)
    if family == "bart":
        names = [embedding, "lm_head"]
        want = canonical_reference(model, reference_ggn(model, lm_loader(), [param_of(model, n) for n in names],
                                                        loss="ce", shift=True), names)
        assert_close({k: got[k] for k in names}, want)


def test_llama_style_model_is_covered_and_shifted():
    """Grouped-query attention, RMSNorm, gated MLP: every matrix analyzed, the norms excluded.
    (No brute-force comparison at 1e-10: Llama's RMSNorm computes in float32 also in a float64 model.)"""
    model = tiny_llama()
    before = snapshot(model)
    report = analyze_quietly(model, lm_loader(), estimator="ggn-mc", samples=1)
    assert_unchanged(model, before)
    assert [layer.name for layer in report.layers] == LLAMA_LAYERS
    assert report.layer("model.layers.0.self_attn.k_proj").shape == (HIDDEN // HEADS, HIDDEN)  # one key head
    meta = report.metadata
    assert meta["coverage"] >= 0.99 and meta["loss_terms"] == sum(len(t.split()) - 1 for t in TEXTS)
    assert {"model.layers.0.input_layernorm.weight", "model.norm.weight"} <= set(meta["excluded"])


def test_bert_exact_matches_the_autodiff_hessian_and_hutchinson_runs():
    model = tiny_bert()
    before = snapshot(model)
    got = normflat.hessian_diagonal(model, bert_loader(), estimator="exact", progress=False)
    params = [param_of(model, name) for name in BERT_LAYERS]
    want = canonical_reference(model, reference_hessian(model, bert_loader(), params), BERT_LAYERS)
    assert_close(got, want)
    report = analyze_quietly(model, bert_loader(), estimator="hutchinson", samples=4)
    assert [layer.name for layer in report.layers] == BERT_LAYERS
    assert np.isfinite(report.normalized_sharpness) and report.standard_error["normalized_sharpness"] > 0
    assert_unchanged(model, before)


def _rescale_gpt2_heads(model: torch.nn.Module, factors: list[float]) -> None:
    """Per head ``h``: query columns × c_h, key columns / c_h (scores unchanged); value columns × c_h
    and the output projection's input rows / c_h (attention output unchanged). ``Conv1D`` stores
    ``(in, out)``, so an output unit is a column (method §8 item 5)."""
    attn = model.transformer.h[0].attn
    d, hd = HIDDEN, HIDDEN // HEADS
    with torch.no_grad():
        w, b, proj = attn.c_attn.weight, attn.c_attn.bias, attn.c_proj.weight
        for h, c in enumerate(factors):
            q, k, v = (slice(off + h * hd, off + (h + 1) * hd) for off in (0, d, 2 * d))
            w[:, q] *= c
            b[q] *= c
            w[:, k] /= c
            b[k] /= c
            w[:, v] *= c
            b[v] *= c
            proj[h * hd:(h + 1) * hd, :] /= c


def test_gpt2_per_head_rescaling_leaves_normalized_sharpness_unchanged():
    model = tiny_gpt2()
    moved = tiny_gpt2()
    _rescale_gpt2_heads(moved, [3.0, 0.25])
    batch = next(iter(lm_loader()))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(moved.eval()(**inputs).logits, model.eval()(**inputs).logits,
                                   rtol=1e-12, atol=1e-12)
    a = normflat.analyze(model, [batch], estimator="exact", progress=False)
    b = normflat.analyze(moved, [batch], estimator="exact", progress=False)
    assert [layer.name for layer in a.layers] == GPT2_LAYERS
    np.testing.assert_allclose(b.normalized_sharpness, a.normalized_sharpness, rtol=1e-8)
    for la, lb in zip(a.layers, b.layers):
        np.testing.assert_allclose(lb.normalized_sharpness, la.normalized_sharpness, rtol=1e-8, err_msg=la.name)
    traces = {layer.name: layer.hessian_trace for layer in a.layers}
    moved_traces = {layer.name: layer.hessian_trace for layer in b.layers}
    for part in ("query", "key", "value"):
        name = f"transformer.h.0.attn.c_attn.{part}"
        assert abs(moved_traces[name] - traces[name]) > 1e-3 * abs(traces[name]), name
    assert abs(b.hessian_trace - a.hessian_trace) > 1e-3 * abs(a.hessian_trace)


def test_hooks_are_lazy_idempotent_and_restore_the_config():
    model = tiny_gpt2()
    hf.register_known_layers()
    hf.register_known_layers()
    entries = normflat.backends.torch.registered_layers()
    assert entries[Conv1D].kind == "dense" and entries[Conv1D].ggn_squares is transposed_linear_squares
    blocks = hf.packed_blocks(model)
    assert blocks == {id(model.transformer.h[0].attn.c_attn): [("query", 0, 8), ("key", 8, 16), ("value", 16, 24)]}
    assert not hf.is_causal_lm(tiny_bert())
    from normflat.integrations.huggingface import HFLogits

    assert hf.is_causal_lm(HFLogits(model))  # the callback's view of the model
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=1, bos_token_id=1, eos_token_id=1, pad_token_id=0))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=4, d_ff=16, num_layers=1, num_heads=HEADS))
    # Llama is a causal LM; T5's loss type maps to the causal loss, but its labels are not shifted.
    assert hf.is_causal_lm(llama) and t5.loss_type == "ForConditionalGeneration" and not hf.is_causal_lm(t5)
    # A user's own entry for a library type is never replaced.
    registry = normflat.backends.torch.layers.REGISTRY
    mine = normflat.backends.torch.LayerExtractor(kind="mine", to_canonical=lambda m, t: t.T)
    try:
        normflat.backends.torch.register_layer(Conv1D, mine)
        hf.register_known_layers()
        assert normflat.backends.torch.registered_layers()[Conv1D] is mine
    finally:
        registry.register(Conv1D, entries[Conv1D])
    # A fused implementation that does not go through F.scaled_dot_product_attention runs as
    # "sdpa" (on the math kernel) during the analysis, and is restored afterwards, also after an error.
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(RuntimeError, match="inside"):
        with hf.analysis_mode(model, None):
            assert model.config._attn_implementation == "sdpa"
            assert model.transformer.h[0].attn.config._attn_implementation == "sdpa"
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "flex_attention"


class _ExactScaledWordEmbedding(torch.nn.Embedding):
    def __init__(self, *args, embed_scale=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor):
        """The lookup times the scale."""
        return super().forward(input_ids) * self.embed_scale


class _SpecialRowScaledWordEmbedding(_ExactScaledWordEmbedding):
    def forward(self, input_ids: torch.Tensor):
        out = super().forward(input_ids) * self.embed_scale
        out[input_ids == 0] = 0.0  # a special token's rows overwritten: not the scaled lookup
        return out


def test_scaled_word_embedding_is_recognized_by_its_whole_forward():
    """Only a forward that is exactly the scaled lookup takes the scaled rule; one that also overwrites
    rows (as one Hugging Face class does for a special token) is not recognized."""
    assert hf._scaled_word_embedding(_ExactScaledWordEmbedding)
    assert not hf._scaled_word_embedding(_SpecialRowScaledWordEmbedding)
    assert not hf._scaled_word_embedding(torch.nn.Embedding)  # no forward of its own


def test_falcon_linear_takes_the_linear_fast_rule():
    """Falcon's ``FalconLinear`` writes ``nn.Linear``'s map out in its own forward (recognized from its
    source): ``nn.Linear``'s fast rule, the generic path's diagonal."""
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                       num_attention_heads=HEADS, bos_token_id=1, eos_token_id=1, pad_token_id=0)
    model = transformers.FalconForCausalLM(config).double()
    report = analyze_quietly(model, lm_loader(), loss="ce", estimator="ggn")
    assert all(layer.details["path"] == "fast" for layer in report.layers), [
        (layer.name, layer.details) for layer in report.layers if layer.details["path"] != "fast"]
    got = normflat.hessian_diagonal(model, lm_loader(), loss="ce", estimator="ggn", progress=False)
    assert_close(got, normflat.hessian_diagonal(model, lm_loader(), loss="ce", estimator="ggn", progress=False,
                                                fast=False))


def test_encoder_decoder_batch_of_input_ids_and_labels():
    """A T5 batch of ``input_ids`` and ``labels`` only (as a seq2seq data collator without the model
    makes it): the decoder gets the labels shifted right, as the model's own forward makes them when
    given ``labels`` (the batch failed inside T5's decoder before), and the report equals that of the
    batch with those ``decoder_input_ids`` given; the counted terms are the non-padding labels."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=16, num_layers=1,
                                   num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (3, 6), generator=g)
    labels = torch.randint(2, VOCAB, (3, 4), generator=g)
    labels[0, 3] = -100  # padding: not counted
    implicit = normflat.analyze(model, {"input_ids": ids, "labels": labels}, loss="ce", estimator="ggn",
                                progress=False)
    decoder = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert decoder[0, 0] == 0 and torch.equal(decoder[:, 1:], labels[:, :-1].clamp_min(0))
    explicit = normflat.analyze(model, {"input_ids": ids, "decoder_input_ids": decoder, "labels": labels}, loss="ce",
                                estimator="ggn", progress=False)
    assert implicit.metadata["loss_terms"] == explicit.metadata["loss_terms"] == 11
    assert [layer.hessian_trace for layer in implicit.layers] == [layer.hessian_trace for layer in explicit.layers]


def _assert_rescaling_invariant(model, other, data, moved):
    """``other`` computes ``model``'s function; every layer's normalized sharpness is the same, the
    traces of the layers ``moved`` are not (method §8); every layer on its fast rule."""
    x, y = data
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, data, loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in before.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    for name in moved:
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name


class _ScaledBagOfWords(torch.nn.Module):
    """BART's scaled word embedding (``embed_scale`` 2) -> mean over the tokens -> FalconLinear -> relu
    -> FalconLinear: the scaled lookup's and Falcon's dense fast rules."""

    def __init__(self):
        super().__init__()
        from transformers.models.bart.modeling_bart import BartScaledWordEmbedding
        from transformers.models.falcon.modeling_falcon import FalconLinear

        self.emb = BartScaledWordEmbedding(VOCAB, HIDDEN, padding_idx=0, embed_scale=2.0)
        self.hidden = FalconLinear(HIDDEN, 6)
        self.head = FalconLinear(6, 3)

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.emb(ids).mean(1))))


def test_scaled_embedding_and_falcon_linear_rescaling_invariance():
    """Feature j of the scaled word embedding times a positive factor and the next FalconLinear's
    input j divided by it; that layer's output units times factors (relu after it) and the head's
    inputs divided by them: the function is unchanged, every normalized sharpness stays, the
    rescaled layers' traces move."""
    torch.manual_seed(0)
    model = _ScaledBagOfWords().double()
    other = copy.deepcopy(model)
    features = torch.exp(torch.linspace(-1.0, 1.0, HIDDEN, dtype=torch.float64))
    units = torch.exp(torch.linspace(1.0, -1.0, 6, dtype=torch.float64))
    with torch.no_grad():
        other.emb.weight.mul_(features)
        other.hidden.weight.div_(features).mul_(units[:, None])
        other.hidden.bias.mul_(units)
        other.head.weight.div_(units)
    g = torch.Generator().manual_seed(2)
    data = (torch.randint(1, VOCAB, (5, 6), generator=g), torch.randint(0, 3, (5,), generator=g))
    _assert_rescaling_invariant(model, other, data, ("emb", "hidden", "head"))


# ============================================================================ attention kernels stored raw


def tiny_xlnet(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.XLNetConfig(vocab_size=VOCAB, d_model=HIDDEN, n_layer=1, n_head=HEADS, d_inner=16,
                                      num_labels=3, pad_token_id=0)
    return transformers.XLNetForSequenceClassification(config).double()


def tiny_funnel(attention_type: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.FunnelConfig(vocab_size=VOCAB, d_model=HIDDEN, n_head=HEADS, d_head=4, d_inner=16,
                                       block_sizes=[1, 1], num_decoder_layers=1, num_labels=3,
                                       attention_type=attention_type)
    model = transformers.FunnelForSequenceClassification(config).double()
    with torch.no_grad():  # Funnel starts r_kernel, seg_embed and the relative biases at zero
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("r_kernel", "seg_embed", "r_w_bias", "r_r_bias", "r_s_bias"):
                p.normal_(0.0, 0.5)
    return model


def _raw_kernels(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """Each raw attention kernel by name, with how it is applied: ``into`` the heads, ``out`` of
    them, or ``per_head`` (each head's own block)."""
    kinds = {"q": "into", "k": "into", "v": "into", "r": "into", "o": "out", "seg_embed": "per_head"}
    out = {}
    for name, p in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        if last == "r_kernel":
            out[name] = (p, "per_head" if model.config.attention_type == "factorized" else "into")
        elif last in kinds and ".rel_attn." in name or (last == "seg_embed"):
            out[name] = (p, kinds[last])
    return out


def _canonical_raw(t: np.ndarray, how: str) -> np.ndarray:
    """The canonical ``(out, in/groups)`` layout of a raw kernel, written out index by index: ``into``
    ``W[(n, d), h] = t[h, n, d]``, ``out`` ``W[h, (n, d)] = t[h, n, d]``, ``per_head``
    ``W[(n, s), d] = t[s, n, d]``."""
    a, n, d = t.shape
    out = np.empty((n * d, a) if how == "into" else (a, n * d) if how == "out" else (n * a, d))
    for i in range(a):
        for j in range(n):
            for k in range(d):
                if how == "into":
                    out[j * d + k, i] = t[i, j, k]
                elif how == "out":
                    out[i, j * d + k] = t[i, j, k]
                else:
                    out[j * a + i, k] = t[i, j, k]
    return out


def _segment_loader() -> list[dict]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, VOCAB, (5, 6), generator=g)
    types = (torch.arange(6)[None, :] >= torch.tensor([[2], [3], [4], [3], [6]])).long()  # two segments
    labels = torch.tensor([0, 1, 2, 1, 0])
    return [{"input_ids": ids[:3], "token_type_ids": types[:3], "labels": labels[:3]},
            {"input_ids": ids[3:], "token_type_ids": types[3:], "labels": labels[3:]}]


RAW_MODELS = {"xlnet": tiny_xlnet, "funnel": lambda: tiny_funnel("relative_shift"),
              "funnel-factorized": lambda: tiny_funnel("factorized")}


@pytest.mark.parametrize("family", list(RAW_MODELS))
def test_attention_kernels_stored_raw_match_the_brute_force_ggn(family):
    """XLNet's relative attention keeps its projections as raw ``(d_model, heads, d_head)``
    parameters applied by einsum, Funnel its relative-position kernel (into the heads, or per head
    out to the model width when factorized) and both their segment keys (per head): each is a
    weight matrix in its canonical layout (method §3, "Attention kernels stored raw"), on the
    generic path, every parameter covered, the model unchanged, and its GGN diagonal the
    brute-force one."""
    model = RAW_MODELS[family]()
    raw = _raw_kernels(model)
    assert len(raw) == (6 if family == "xlnet" else 4)
    before = snapshot(model)
    report = analyze_quietly(model, _segment_loader())
    assert_unchanged(model, before)
    assert report.metadata["coverage"] == 1.0
    heads = HEADS
    for name, (p, how) in raw.items():
        layer = report.layer(name)
        assert layer.details["path"] == "generic", layer.details
        assert layer.details["groups"] == (heads if how == "per_head" else 1), (name, layer.details)
        assert layer.shape == _canonical_raw(p.detach().numpy(), how).shape, name
    got = normflat.hessian_diagonal(model, _segment_loader(), estimator="ggn", progress=False)
    per_param = reference_ggn(model, _segment_loader(), list(raw))
    # Funnel casts its attention scores to float32 before the softmax ("precision safe"), in
    # normflat's derivatives and the reference's alike: they agree to float32's precision there.
    rtol = 1e-10 if family == "xlnet" else 1e-6
    for name, (p, how) in raw.items():
        want = _canonical_raw(per_param[name], how)
        np.testing.assert_allclose(np.asarray(got[name]), want, rtol=rtol, atol=rtol * np.abs(want).max(),
                                   err_msg=name)


def _rescale_raw_attention(model: torch.nn.Module, seed: int) -> list[str]:
    """Per head feature ``(n, d)``: the query times ``c``, the keys of the tokens, the relative
    positions and the segments over ``c`` (with the biases added to the query times ``c``); the
    values times ``e``, the output projection's columns over ``e``. The function is unchanged
    (method §8, item 5). Returns the raw kernels rescaled."""
    g = torch.Generator().manual_seed(seed)
    moved = []
    with torch.no_grad():
        for name, module in model.named_modules():
            kind = type(module).__name__
            if kind not in ("XLNetRelativeAttention", "FunnelRelMultiheadAttention"):
                continue
            n, d = module.r_w_bias.shape
            c = torch.exp(torch.randn(n, d, generator=g, dtype=torch.float64))
            e = torch.exp(torch.randn(n, d, generator=g, dtype=torch.float64))
            for bias in (module.r_w_bias, module.r_r_bias, module.r_s_bias):
                bias.mul_(c)
            module.seg_embed.div_(c)
            if kind == "XLNetRelativeAttention":
                module.q.mul_(c)
                module.k.div_(c)
                module.r.div_(c)
                module.v.mul_(e)
                module.o.div_(e)
                moved += [f"{name}.{p}" for p in ("q", "k", "r", "v", "o", "seg_embed")]
            else:
                module.q_head.weight.mul_(c.reshape(-1, 1))
                module.k_head.weight.div_(c.reshape(-1, 1))
                module.k_head.bias.div_(c.reshape(-1))
                module.r_kernel.div_(c)
                module.v_head.weight.mul_(e.reshape(-1, 1))
                module.v_head.bias.mul_(e.reshape(-1))
                module.post_proj.weight.div_(e.reshape(1, -1))
                moved += [f"{name}.{p}" for p in ("r_kernel", "seg_embed")]
    return moved


@pytest.mark.parametrize("family", list(RAW_MODELS))
def test_attention_kernels_stored_raw_rescaling_invariance(family):
    """The per-head-feature rescalings of the raw kernels (``_rescale_raw_attention``) leave the
    function, every layer's normalized sharpness and the total unchanged, and move the traces of
    the kernels rescaled (method §8): the canonical layouts and the per-head groups of method §3,
    "Attention kernels stored raw", are the ones the measure is invariant in."""
    model = RAW_MODELS[family]()
    other = copy.deepcopy(model)
    moved = _rescale_raw_attention(other, seed=7)
    data = _segment_loader()
    with torch.no_grad():
        for batch in data:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            torch.testing.assert_close(other.eval()(**inputs).logits, model.eval()(**inputs).logits,
                                       rtol=1e-12, atol=1e-12)
    before = normflat.analyze(model, data, progress=False)
    after = normflat.analyze(other, data, progress=False)
    assert [layer.name for layer in before.layers] == [layer.name for layer in after.layers]
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
    assert after.normalized_sharpness == pytest.approx(before.normalized_sharpness, rel=1e-8)
    # Funnel's last block reads no relative position or segment at the CLS token, the only one
    # classified (its cls_mask): those two kernels have no curvature there, before or after.
    idle = [name for name in moved if before.layer(name).hessian_trace == 0.0]
    last = "funnel.encoder.blocks.1.0.attention"
    assert idle == ([] if family == "xlnet" else [f"{last}.r_kernel", f"{last}.seg_embed"]), idle
    assert all(after.layer(name).hessian_trace == 0.0 for name in idle)
    for name in set(moved) - set(idle):
        assert abs(after.layer(name).hessian_trace - before.layer(name).hessian_trace) > \
            1e-3 * abs(before.layer(name).hessian_trace), name


def test_cvt_on_one_sample_chunks_equals_larger_chunks():
    """Hugging Face CvT normalizes its depthwise convolutions' outputs with an eval-mode BatchNorm2d and
    reads them as tokens: torch's CPU backward of the normalization is wrong on a batch of one sample
    there (the gradient at its output laid out channels-last, torch 2.14). The GGN diagonal on chunks of
    one sample, and on batches of one sample, equals the one on larger chunks (which the generic path and
    brute force confirm), per tensor."""
    torch.manual_seed(0)
    model = transformers.CvtForImageClassification(transformers.CvtConfig(
        patch_sizes=[7, 3], patch_stride=[4, 2], patch_padding=[2, 1], embed_dim=[8, 16], num_heads=[1, 2],
        depth=[1, 2], mlp_ratio=[2.0, 2.0], cls_token=[False, True], qkv_projection_method=["dw_bn", "dw_bn"],
        num_labels=3)).double().eval()
    g = torch.Generator().manual_seed(0)
    data = [{"pixel_values": torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64),
             "labels": torch.randint(0, 3, (n,), generator=g)} for n in (2, 3)]
    singles = [{k: v[i:i + 1] for k, v in b.items()} for b in data for i in range(len(b["labels"]))]
    kw = dict(loss="ce", estimator="ggn", progress=False)
    want = normflat.hessian_diagonal(model, data, **kw)
    for got in (normflat.hessian_diagonal(model, data, chunk_size=1, **kw),
                normflat.hessian_diagonal(model, singles, **kw)):
        for name, value in want.items():
            scale = float(value.abs().max())
            assert float((got[name] - value).abs().max()) <= 1e-10 * scale, name


def test_encoder_decoder_without_prepare_decoder_input_ids():
    """M2M100 (like NLLB, Whisper and Speech2Text) has no ``prepare_decoder_input_ids_from_labels``; its
    forward shifts the labels right itself from ``decoder_start_token_id`` and ``pad_token_id``. A batch
    of ``input_ids`` and ``labels`` gets those decoder inputs (it failed inside the model before, which
    was then given none) and the report of the batch with them given."""
    from transformers.models.m2m_100.modeling_m2m_100 import shift_tokens_right

    torch.manual_seed(0)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
        vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=1, decoder_layers=1, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=32)).double()
    assert not hasattr(model, "prepare_decoder_input_ids_from_labels")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    labels = torch.randint(3, VOCAB, (3, 4), generator=g)
    labels[0, 3] = -100
    implicit = normflat.analyze(model, {"input_ids": ids, "labels": labels}, loss="ce", estimator="ggn",
                                progress=False)
    decoder = shift_tokens_right(labels, model.config.pad_token_id, model.config.decoder_start_token_id)
    explicit = normflat.analyze(model, {"input_ids": ids, "decoder_input_ids": decoder, "labels": labels}, loss="ce",
                                estimator="ggn", progress=False)
    assert implicit.metadata["loss_terms"] == explicit.metadata["loss_terms"] == 11
    assert [layer.hessian_trace for layer in implicit.layers] == [layer.hessian_trace for layer in explicit.layers]


def test_models_keeping_a_cache_run_without_it():
    """RWKV updates its recurrent state (its cache) in place inside the forward, which autograd refuses
    in eval mode: a keyword batch runs with ``use_cache=False`` unless it says otherwise (the analysis
    never generates), the same report as the model configured without its cache."""
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, attention_hidden_size=HIDDEN,
        intermediate_size=16)).double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 5), generator=g)
    implicit = normflat.analyze(model, {"input_ids": ids, "labels": ids}, loss="ce", estimator="ggn", progress=False)
    plain = copy.deepcopy(model)
    plain.config.use_cache = False  # the same model without its cache
    explicit = normflat.analyze(plain, {"input_ids": ids, "labels": ids}, loss="ce", estimator="ggn", progress=False)
    assert [layer.hessian_trace for layer in implicit.layers] == [layer.hessian_trace for layer in explicit.layers]
    assert implicit.metadata["coverage"] == 1.0


@pytest.mark.parametrize("build, loader", [(tiny_gpt2, lm_loader), (tiny_bert, bert_loader)])
def test_gradient_checkpointing_enabled_model_gives_the_plain_models_numbers(build, loader):
    """A model after ``activation_checkpointing_enable()`` (the non-deprecated name of
    ``gradient_checkpointing_enable``): its ``enable_input_require_grads`` hook on the input embeddings
    (``output.requires_grad_(True)``) failed inside ``torch.func`` in eval mode too, for ``hutchinson``,
    ``exact``, the generic path and the measures. normflat suspends it and the checkpointing switches
    for its forwards: the plain model's numbers, and the hook and the switches are back afterwards."""
    plain, checkpointed = build(), build()
    checkpointed.activation_checkpointing_enable()
    handles = checkpointed._require_grads_hooks
    assert handles  # the hook this test is about
    embedding = checkpointed.get_input_embeddings()
    hooks_before = list(embedding._forward_hooks)
    switches = [m.gradient_checkpointing for m in checkpointed.modules() if "gradient_checkpointing" in m.__dict__]
    assert switches and all(switches)
    before = snapshot(checkpointed)
    for options in (dict(estimator="hutchinson", samples=2, seed=1), dict(estimator="ggn", fast=False),
                    dict(estimator="ggn")):
        got = normflat.hessian_diagonal(checkpointed, loader(), progress=False, **options)
        want = normflat.hessian_diagonal(plain, loader(), progress=False, **options)
        assert list(got) == list(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-14, msg=lambda m: f"{name}: {m}")
    measures = ["fisher_rao_norm"]
    got = normflat.measures(checkpointed, loader(), measures, loss="ce", progress=False)
    want = normflat.measures(plain, loader(), measures, loss="ce", progress=False)
    assert got["fisher_rao_norm"] == pytest.approx(want["fisher_rao_norm"], rel=1e-10)
    assert list(embedding._forward_hooks) == hooks_before and all(h.id in embedding._forward_hooks for h in handles)
    assert [m.gradient_checkpointing for m in checkpointed.modules()
            if "gradient_checkpointing" in m.__dict__] == switches
    assert_unchanged(checkpointed, before)


def _looped_lm_ggn(model: torch.nn.Module, loader, params: list[str]) -> dict[str, np.ndarray]:
    """:func:`reference_ggn` of a causal language model (``nsce``, the labels shifted) by plain autograd, one
    normalized logit's gradient at a time: transformers' reference Mamba kernels mix float32 into a float64
    model in a way ``torch.func`` transforms refuse."""
    named = dict(model.named_parameters())
    wanted = [named[n] for n in params]
    total = {n: torch.zeros_like(named[n]) for n in params}
    terms = 0
    for batch in loader:
        for i in range(batch["labels"].shape[0]):
            one = {k: v[i:i + 1] for k, v in batch.items() if k != "labels"}
            u = _normalized(model(**one).logits[0].double())  # (T, C); transformers returns float32 logits
            targets = _token_targets(batch["labels"][i], True)
            for t in range(u.shape[0]):
                if int(targets[t]) == -100:
                    continue
                terms += 1
                p = torch.softmax(u[t].detach(), 0)
                h = torch.diag(p) - p[:, None] * p[None, :]
                rows = [torch.autograd.grad(u[t, c], wanted, retain_graph=True) for c in range(u.shape[1])]
                for j, n in enumerate(params):
                    jac = torch.stack([row[j].reshape(-1) for row in rows])  # (C, entries)
                    total[n] += ((h @ jac) * jac).sum(0).reshape(total[n].shape)
    return {n: (v / terms).detach().numpy() for n, v in total.items()}


def _analyzed_against_looped_reference(model: torch.nn.Module) -> tuple:
    """``(report, ggn diagonal, brute-force diagonal)`` of a causal language model on :func:`lm_loader`,
    every reported layer against :func:`_looped_lm_ggn` in the report's layouts; transformers' notices
    that its reference kernels are slow silenced."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = analyze_quietly(model, lm_loader())
        got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", progress=False)
        layers = [layer.name for layer in report.layers]
        want = canonical_reference(model, _looped_lm_ggn(model, lm_loader(), [param_of(model, n) for n in layers]),
                                   layers)
    return report, got, want


def tiny_mamba(seed: int = 0) -> torch.nn.Module:
    """A two-layer Mamba language model (selective state-space mixers, transformers' reference kernels)."""
    torch.manual_seed(seed)
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4, num_hidden_layers=2,
                                      expand=2, conv_kernel=3, pad_token_id=0)
    return transformers.MambaForCausalLM(config).double().eval()


def test_mamba_is_covered_with_its_state_decay_rates_excluded():
    """Mamba's mixers: the projections and the causal convolution are analyzed, all on their fast rules
    (the convolution and ``dt_proj``, which transformers' reference kernels apply themselves, by
    ``F.conv1d`` on a view of the weight and ``dt_proj.weight @ x``, recorded at those calls), every
    ``A_log`` ``(channels, state)`` is excluded as the state decay rates it is (method §3, "What is not a
    weight matrix"), ``D`` as a vector; coverage 1, nothing unsupported (before, each ``A_log`` was skipped
    with a warning, coverage 0.96), and the diagonals are the brute-force ones with the labels shifted (to
    float32's accuracy: transformers returns the logits in float32)."""
    report, got, want = _analyzed_against_looped_reference(tiny_mamba())
    assert report.metadata["coverage"] == 1.0
    for i in range(2):
        assert report.metadata["excluded"][f"backbone.layers.{i}.mixer.A_log"] == STATE_DECAY_REASON
        assert "vector" in report.metadata["excluded"][f"backbone.layers.{i}.mixer.D"]
    assert {layer.details["path"] for layer in report.layers} == {"fast"}, [lr.details for lr in report.layers]
    # transformers returns Mamba's logits in float32 (``.float()``) also from a float64 model: float32's accuracy.
    assert_close(got, want, rtol=1e-6)


def _hybrid_language_model(name: str) -> torch.nn.Module:
    """Two-layer hybrid language models whose mixers convolve with their ``nn.Conv1d``'s weight
    themselves: Mamba-2 (the chunked state-space duality), Qwen3-Next (a gated delta net, then full
    attention), LFM2 (a gated short convolution, then attention)."""
    torch.manual_seed(0)
    if name == "mamba2":
        config = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4, num_hidden_layers=2,
                                           expand=2, conv_kernel=3, num_heads=4, head_dim=4, n_groups=1,
                                           chunk_size=4, pad_token_id=0)
        model = transformers.Mamba2ForCausalLM(config)
    elif name == "qwen3-next":
        config = transformers.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=4, intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
            linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=3, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
            layer_types=["linear_attention", "full_attention"], max_position_embeddings=32, pad_token_id=0,
            mlp_only_layers=[0, 1])  # dense MLPs: the experts' rules are tests/arch/test_huggingface_moe.py's
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        config = transformers.Lfm2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         conv_L_cache=3, layer_types=["conv", "full_attention"],
                                         max_position_embeddings=32, pad_token_id=0)
        model = transformers.Lfm2ForCausalLM(config)
    return model.double().eval()


@pytest.mark.parametrize("name, conv", [("mamba2", "backbone.layers.0.mixer.conv1d"),
                                        ("qwen3-next", "model.layers.0.linear_attn.conv1d"),
                                        ("lfm2", "model.layers.0.conv.conv")])
def test_hybrid_language_models_convolutions_are_recorded_where_applied(name, conv):
    """The causal convolutions of hybrid language models, applied by their mixers with ``F.conv1d`` on a
    view of the module's weight (transformers' reference kernels), take the convolution's fast rule,
    recorded at that call (method §6.1, "Weights the model applies itself"; before, the generic path):
    coverage 1, every layer fast, and the diagonals the brute-force ones with the labels shifted."""
    report, got, want = _analyzed_against_looped_reference(_hybrid_language_model(name))
    assert report.metadata["coverage"] == 1.0 and conv in [layer.name for layer in report.layers]
    assert {layer.details["path"] for layer in report.layers} == {"fast"}, [lr.details for lr in report.layers]
    # transformers computes parts of these float64 models in float32 (Mamba-2 returns its logits in
    # float32): every layer agrees to 1.5e-7 of its largest entry, float32's accuracy.
    assert_close(got, want, rtol=1e-6)


def test_recurrent_gemma_gates_are_analyzed_as_block_diagonal_maps():
    """RecurrentGemma's RG-LRU applies its input and recurrence gates itself (``torch.baddbmm`` per head,
    ``(heads, in, out)``): each is one block-diagonal matrix ``(heads·out, in)`` with one group per head
    (method §3), on the generic path with the reason; coverage 1 (before, both gates were skipped with a
    warning, coverage 0.93), the diagonals the brute-force ones."""
    import warnings

    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, lru_width=HIDDEN, attention_window_size=8, conv1d_width=3, head_dim=4,
        block_types=["recurrent", "attention"], pad_token_id=0)
    model = transformers.RecurrentGemmaForCausalLM(config).double().eval()
    gates = [f"model.layers.0.temporal_block.rg_lru.{g}_gate_weight" for g in ("input", "recurrent")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = analyze_quietly(model, lm_loader())
        got = normflat.hessian_diagonal(model, lm_loader(), estimator="ggn", progress=False)
        want = _looped_lm_ggn(model, lm_loader(), gates)
    assert report.metadata["coverage"] == 1.0
    for name in gates:
        details = report.layer(name).details
        assert details["path"] == "generic" and "baddbmm" in details["generic_reason"], details
        assert details["groups"] == 2
        heads, block, _ = want[name].shape
        assert_close({name: got[name]}, {name: want[name].transpose(0, 2, 1).reshape(heads * block, block)},
                     rtol=1e-6)  # the logits come out in float32, as Mamba's
