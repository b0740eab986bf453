"""timm and torchvision vision models end to end in the torch backend (method §3).

Tiny ResNet, ConvNeXt and ViT models (timm ``create_model`` with small keyword
arguments, ``pretrained=False``; torchvision ``resnet18`` and
``VisionTransformer``), float64, analyzed by a plain ``normflat.analyze`` with
``ggn`` on one small batch: every weight matrix is analyzed (``coverage``), the
class token and layer-scale vectors are excluded by name, the position table is
analyzed as the embedding of the positions, timm's packed ``qkv`` is split into
query / key / value. The ViTs' GGN diagonals are checked against the brute-force
reference of :mod:`tests.arch.test_huggingface_models`.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import timm
import torch
import torchvision

import normflat
from tests.arch.test_huggingface_models import (
    analyze_quietly, assert_close, assert_unchanged, reference_ggn, snapshot)


def _images(n: int, size: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64)
    return x, torch.arange(n) % classes


def timm_resnet() -> torch.nn.Module:
    return timm.create_model("resnet18", pretrained=False, num_classes=3, stem_width=8, channels=(8, 8, 16, 16),
                             layers=(1, 1, 1, 1))


def timm_convnext() -> torch.nn.Module:
    return timm.create_model("convnext_atto", pretrained=False, num_classes=3, depths=(1, 1, 1, 1),
                             dims=(8, 8, 16, 16))


def timm_vit() -> torch.nn.Module:
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=8,
                             embed_dim=8, depth=1, num_heads=2, mlp_ratio=2.0)


def torchvision_resnet18() -> torch.nn.Module:
    return torchvision.models.resnet18(num_classes=3)


def torchvision_vit() -> torch.nn.Module:
    model = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2,
                                                 hidden_dim=8, mlp_dim=16, num_classes=3)
    torch.nn.init.normal_(model.heads.head.weight)  # zero-initialized: equal logits (an untrained head)
    return model


@pytest.mark.parametrize("build, size, expect_layers, expect_excluded", [
    (timm_resnet, 16, ["conv1", "layer1.0.conv1", "layer4.0.downsample.0", "fc"], ["bn1.weight", "fc.bias"]),
    (timm_convnext, 32, ["stem.0", "stages.0.blocks.0.conv_dw", "stages.0.blocks.0.mlp.fc1", "head.fc"],
     ["stages.0.blocks.0.gamma", "stages.0.blocks.0.norm.weight"]),
    (timm_vit, 16, ["pos_embed", "patch_embed.proj", "blocks.0.attn.qkv.query", "blocks.0.attn.qkv.key",
                    "blocks.0.attn.qkv.value", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "head"],
     ["cls_token", "blocks.0.norm1.weight", "blocks.0.attn.qkv.bias"]),
    (torchvision_resnet18, 32, ["conv1", "layer1.0.conv1", "layer4.1.conv2", "fc"], ["bn1.weight", "fc.bias"]),
    (torchvision_vit, 16, ["conv_proj", "encoder.pos_embedding", "encoder.layers.encoder_layer_0.self_attention",
                           "heads.head"],
     ["class_token", "encoder.layers.encoder_layer_0.ln_1.weight"]),
], ids=["timm-resnet", "timm-convnext", "timm-vit", "torchvision-resnet18", "torchvision-vit"])
def test_vision_models_are_covered_and_run_with_ggn(build, size, expect_layers, expect_excluded):
    torch.manual_seed(0)
    model = build().double()
    # torchvision resnet18 has 11M weights: one image keeps it short.
    x, y = _images(1 if build is torchvision_resnet18 else 2, size, 3)
    before = snapshot(model)
    report = analyze_quietly(model, [(x, y)])
    assert_unchanged(model, before)
    names = [layer.name for layer in report.layers]
    for name in expect_layers:
        assert any(n == name or n.startswith(name + ".") for n in names), (name, names)
    meta = report.metadata
    assert meta["coverage"] >= 0.99, meta
    for name in expect_excluded:
        assert name in meta["excluded"], (name, sorted(meta["excluded"]))
    assert np.isfinite(report.normalized_sharpness) and report.normalized_sharpness > 0


def _position_table_canonical(table: np.ndarray) -> np.ndarray:
    return table.reshape(-1, table.shape[-1]).T  # (1, N, d) -> (d, N), method §3 "Position tables"


def _call(ref, values, batch, i):
    return torch.func.functional_call(ref, values, (batch["x"][i:i + 1],))[0]


def test_timm_vit_ggn_matches_the_brute_force_reference():
    """Position table, packed ``qkv`` blocks and the patch convolution against per-sample Jacobians."""
    torch.manual_seed(0)
    model = timm_vit().double()
    x, y = _images(3, 16, 3, seed=1)
    got = normflat.hessian_diagonal(model, [(x, y)], estimator="ggn", progress=False)
    want_params = reference_ggn(model, [{"x": x, "labels": y}],
                                ["pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight",
                                 "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight",
                                 "head.weight"], logits_of=_call)
    qkv = want_params["blocks.0.attn.qkv.weight"]
    want = {
        "pos_embed": _position_table_canonical(want_params["pos_embed"]),
        "patch_embed.proj": want_params["patch_embed.proj.weight"],
        "blocks.0.attn.qkv.query": qkv[0:8], "blocks.0.attn.qkv.key": qkv[8:16], "blocks.0.attn.qkv.value": qkv[16:24],
        "blocks.0.attn.proj": want_params["blocks.0.attn.proj.weight"],
        "blocks.0.mlp.fc1": want_params["blocks.0.mlp.fc1.weight"],
        "blocks.0.mlp.fc2": want_params["blocks.0.mlp.fc2.weight"],
        "head": want_params["head.weight"],
    }
    assert_close(got, want)


def test_timm_swin_window_attention_matches_the_brute_force_reference():
    """Swin folds each image's attention windows into the batch axis (``(n·windows, tokens, d)``):
    its ``qkv`` (packed, not split as in a ViT) and ``proj`` keep the fast rule with each image's
    gradient summed over its windows (method §6.1), here 4 windows per image in the first stage and
    one in the second; against
    per-sample Jacobians with a batch of 3, a first batch of one image and chunks of one (which
    had read the windows as images: 60-80 % off)."""
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=16,
                              patch_size=2, window_size=4, embed_dim=8, depths=(1, 1), num_heads=(1, 1)).double()
    x, y = _images(3, 16, 3, seed=2)
    names = ["layers.0.blocks.0.attn.qkv.weight", "layers.0.blocks.0.attn.proj.weight",
             "layers.1.blocks.0.attn.qkv.weight", "layers.1.blocks.0.attn.proj.weight", "head.fc.weight"]
    want_params = reference_ggn(model, [{"x": x, "labels": y}], names, loss="ce", logits_of=_call)
    want = {name.removesuffix(".weight"): want_params[name] for name in names}
    for data, kw in [([(x, y)], {}), ([(x[:1], y[:1]), (x[1:], y[1:])], {}), ([(x, y)], {"chunk_size": 1})]:
        rep = normflat.analyze(model, data, loss="ce", estimator="ggn", progress=False, **kw)
        assert all(rep.layer(name).details["path"] == "fast" for name in want), kw
        got = normflat.hessian_diagonal(model, data, loss="ce", estimator="ggn", progress=False, **kw)
        assert_close({k: got[k] for k in want}, want)


def test_timm_linear_takes_the_linear_fast_rule():
    """timm's ``Linear`` (MobileNetV3's and GhostNet's classifier) overrides ``forward`` only to cast
    its weight under TorchScript: ``nn.Linear``'s fast rule, against per-sample Jacobians (the
    classifier and the convolution before it)."""
    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=3).double()
    assert type(model.classifier).__module__ == "timm.layers.linear"
    x, y = _images(3, 32, 3, seed=3)
    rep = normflat.analyze(model, [(x, y)], loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in rep.layers} == {"fast"}
    got = normflat.hessian_diagonal(model, [(x, y)], loss="ce", estimator="ggn", progress=False)
    want = reference_ggn(model, [{"x": x, "labels": y}], ["classifier.weight", "conv_head.weight"], loss="ce",
                         logits_of=_call)
    assert_close({"classifier": got["classifier"], "conv_head": got["conv_head"]},
                 {"classifier": want["classifier.weight"], "conv_head": want["conv_head.weight"]})
    # Its squeeze-excite gates are hardsigmoids, which torch cannot differentiate twice: the
    # Hessian-vector products run them as clamps (compat.FunctionalKernels; they failed inside torch).
    hvp = normflat.analyze(model, [(x, y)], loss="ce", estimator="hutchinson", samples=2, progress=False)
    assert np.isfinite(hvp.hessian_trace) and np.isfinite(hvp.normalized_sharpness)


def _padded_and_standardized(eps: float | None = None) -> torch.nn.Module:
    """Each of timm's self-padding and weight-standardizing convolutions once: ``Conv2dSame``
    (stride 2 on an odd size: unequal "SAME" padding), a grouped ``StdConv2d`` with a bias,
    ``StdConv2dSame``, ``ScaledStdConv2dSame`` and a 1×1 ``ScaledStdConv2d`` with gains away from
    one. ``eps``: the standardizations' (their default when ``None``)."""
    from timm.layers import Conv2dSame, ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d, StdConv2dSame

    kw = {} if eps is None else {"eps": eps}
    model = torch.nn.Sequential(
        Conv2dSame(3, 4, 3, stride=2), torch.nn.ReLU(), StdConv2d(4, 4, 3, groups=2, bias=True, **kw),
        torch.nn.ReLU(), StdConv2dSame(4, 4, 3, **kw), torch.nn.ReLU(),
        ScaledStdConv2dSame(4, 6, 3, stride=2, **kw), torch.nn.ReLU(), ScaledStdConv2d(6, 4, 1, **kw),
        torch.nn.Flatten(), torch.nn.LazyLinear(3)).double()
    with torch.no_grad():
        for i in (6, 8):
            model[i].gain.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(i))
    return model


_PADDED_LAYERS = ["0", "2", "4", "6", "8", "10"]


def _padded_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    ref = reference_ggn(model, [{"x": x, "labels": y}], [f"{n}.weight" for n in _PADDED_LAYERS], logits_of=_call)
    return {n: ref[f"{n}.weight"] for n in _PADDED_LAYERS}


@pytest.mark.parametrize("by_pairs", [True, False], ids=["pairs-of-positions", "per-sample-gradients"])
def test_timm_padded_and_standardized_convolutions_match_the_brute_force_reference(by_pairs, monkeypatch):
    """``Conv2dSame`` pads its input in its forward and the ``Std``/``ScaledStd`` convolutions
    standardize their weight first (method §6.1, "Weight-standardized and self-padded
    convolutions"): each takes its own fast rule, with both ways of summing a convolution's squares,
    against per-sample Jacobians of the parameters; in chunks of one sample and over two batches
    too."""
    from normflat.backends.torch import ggn as ggn_kernels

    monkeypatch.setattr(ggn_kernels, "squares_by_pairs", lambda *shape: by_pairs)
    torch.manual_seed(0)
    model = _padded_and_standardized()
    x, y = _images(3, 11, 3, seed=4)
    model(x)  # materialize the lazy layer
    want = _padded_reference(model, x, y)
    before = snapshot(model)
    report = analyze_quietly(model, [(x, y)], estimator="ggn")
    assert_unchanged(model, before)
    assert {layer.name: layer.details["path"] for layer in report.layers} == dict.fromkeys(_PADDED_LAYERS, "fast")
    for data, kw in [([(x, y)], {}), ([(x, y)], {"chunk_size": 1}), ([(x[:1], y[:1]), (x[1:], y[1:])], {})]:
        got = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False, **kw)
        assert_close(got, want)


def test_timm_padded_and_standardized_convolutions_sampled_estimators_equal_the_generic_path():
    """``ggn-mc`` and ``ggn-topk`` draw the same signals on both paths: the fast rules give the
    generic path's diagonal (but for the head, exact on the fast path under ``ggn-topk``), and
    ``analyze`` (kernel sums per group of signals) its report."""
    torch.manual_seed(0)
    model = _padded_and_standardized()
    x, y = _images(4, 11, 3, seed=5)
    model(x)
    for estimator, extra in (("ggn-mc", {"samples": 3}), ("ggn-topk", {"top_classes": 1, "samples": 2})):
        fast = normflat.hessian_diagonal(model, [(x, y)], estimator=estimator, progress=False, seed=2, **extra)
        generic = normflat.hessian_diagonal(model, [(x, y)], estimator=estimator, progress=False, seed=2,
                                            fast=False, **extra)
        convs = _PADDED_LAYERS[:-1]
        assert_close({k: fast[k] for k in convs}, {k: generic[k].numpy() for k in convs})
    fast = analyze_quietly(model, [(x, y)], estimator="ggn-mc", samples=3, seed=2)
    generic = analyze_quietly(model, [(x, y)], estimator="ggn-mc", samples=3, seed=2, fast=False)
    for a, b in zip(fast.layers, generic.layers):
        assert a.normalized_sharpness == pytest.approx(b.normalized_sharpness, rel=1e-9), a.name
        assert a.standard_error["normalized_sharpness"] == pytest.approx(
            b.standard_error["normalized_sharpness"], rel=1e-9), a.name


def test_standardized_convolution_called_twice_sums_its_calls():
    """A weight-standardized convolution applied to two inputs per forward (a siamese pair): the
    per-sample gradients of the two calls, each through the standardization's Jacobian, are added
    before squaring (method §6.1, "Tied weights")."""
    from timm.layers import ScaledStdConv2dSame

    class Siamese(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = ScaledStdConv2dSame(3, 4, 3, stride=2)
            self.head = torch.nn.Linear(2 * 4 * 4 * 4, 3)

        def forward(self, x):
            left, right = self.conv(x), self.conv(x.flip(-1) * 0.5)
            return self.head(torch.cat([left.relu().flatten(1), right.tanh().flatten(1)], 1))

    torch.manual_seed(0)
    model = Siamese().double()
    x, y = _images(3, 7, 3, seed=6)
    report = analyze_quietly(model, [(x, y)], estimator="ggn")
    assert report.layer("conv").details["path"] == "fast", report.layer("conv").details
    got = normflat.hessian_diagonal(model, [(x, y)], estimator="ggn", progress=False)
    ref = reference_ggn(model, [{"x": x, "labels": y}], ["conv.weight", "head.weight"], logits_of=_call)
    assert_close(got, {"conv": ref["conv.weight"], "head": ref["head.weight"]})


def test_standardized_convolution_whose_forward_differs_takes_the_generic_path(monkeypatch):
    """The rule reads the forward (its padding, the standardization with the module's ``eps``)
    and checks that reading once per module against the forward itself: a forward that
    standardizes otherwise (here with another ``eps`` than the module's) takes the generic path with
    its reason, and stays exact."""
    from timm.layers import StdConv2d

    def other_eps(self, x):
        w = torch.nn.functional.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                                           momentum=0.0, eps=0.1).reshape_as(self.weight)
        return torch.nn.functional.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)

    monkeypatch.setattr(StdConv2d, "forward", other_eps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(StdConv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 5 * 5, 3)).double()  # padded: 5×5 stays 5×5
    x, y = _images(3, 5, 3, seed=7)
    report = analyze_quietly(model, [(x, y)], estimator="ggn")
    details = report.layer("0").details
    assert details["path"] == "generic" and "does not compute what StdConv2d's rule assumes" in details[
        "generic_reason"], details
    got = normflat.hessian_diagonal(model, [(x, y)], estimator="ggn", progress=False)
    ref = reference_ggn(model, [{"x": x, "labels": y}], ["0.weight"], logits_of=_call)
    assert_close({"0": got["0"]}, {"0": ref["0.weight"]})


def test_huggingface_bit_weight_standardized_convolutions_match_the_brute_force_reference():
    """Hugging Face BiT (``WeightStandardizedConv2d``, its stem padded "SAME" by a
    ``DynamicPad2d``): every convolution on its fast rule, against per-sample Jacobians."""
    import transformers

    config = transformers.BitConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_groups=2,
                                    layer_type="preactivation", global_padding="SAME", num_labels=3)
    torch.manual_seed(0)
    model = transformers.BitForImageClassification(config).double().eval()
    x, y = _images(3, 13, 3, seed=8)
    data = [{"pixel_values": x, "labels": y}]
    report = analyze_quietly(model, data, estimator="ggn")
    assert {layer.details["path"] for layer in report.layers} == {"fast"}
    assert type(model.bit.embedder.convolution).__name__ == "WeightStandardizedConv2d"
    names = ["bit.embedder.convolution", "bit.encoder.stages.1.layers.0.conv2",
             "bit.encoder.stages.1.layers.0.downsample.conv"]
    got = normflat.hessian_diagonal(model, data, estimator="ggn", progress=False)

    def logits(ref, values, batch, i):
        return torch.func.functional_call(ref, values, (), {"pixel_values": batch["x"][i:i + 1]}).logits[0]

    ref = reference_ggn(model, [{"x": x, "labels": y}], [f"{n}.weight" for n in names], logits_of=logits)
    assert_close({n: got[n] for n in names}, {n: ref[f"{n}.weight"] for n in names})


def _rescaling_keeps_normalized_sharpness(model, other, data, rescaled: list[str]) -> None:
    """``other`` computes ``model``'s function; every layer's normalized sharpness is the same, the
    traces of the ``rescaled`` layers are not (on the fast rules)."""
    x = data[0][0] if isinstance(data[0], tuple) else data[0]["pixel_values"]
    want = model(x) if isinstance(data[0], tuple) else model(pixel_values=x).logits
    got = other(x) if isinstance(data[0], tuple) else other(pixel_values=x).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    before = analyze_quietly(model, data, loss="ce", estimator="ggn")
    after = analyze_quietly(other, data, loss="ce", estimator="ggn")
    assert {layer.details["path"] for layer in before.layers + after.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
        if lb.name in rescaled:
            assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), lb.name


def test_standardized_convolution_output_channel_rescaling_invariance():
    """With a negligible ``eps`` a standardized convolution computes the same function when each output
    channel of its parameter is multiplied by a positive factor (the standardization removes it),
    and the Hessian in that channel is divided by the factor squared: the normalized sharpness of
    each ``StdConv2d``, ``StdConv2dSame``, ``ScaledStdConv2dSame`` and ``ScaledStdConv2d`` stays,
    its trace moves (method §8)."""
    torch.manual_seed(0)
    model = _padded_and_standardized(eps=1e-300)
    x, y = _images(6, 11, 3, seed=9)
    model(x)
    other = _padded_and_standardized(eps=1e-300)
    other(x)
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in (2, 4, 6, 8):
            rows = other[i].weight.shape[0]
            other[i].weight.mul_(torch.exp(torch.randn(rows, generator=g, dtype=torch.float64))[:, None, None, None])
    _rescaling_keeps_normalized_sharpness(model, other, [(x, y)], rescaled=["2", "4", "6", "8"])


def test_huggingface_weight_standardized_convolution_rescaling_invariance():
    """Hugging Face BiT's ``WeightStandardizedConv2d`` with a negligible ``eps``: each convolution's output
    channels times positive factors keep the function, its normalized sharpness, not its trace."""
    import transformers

    config = transformers.BitConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_groups=2,
                                    layer_type="preactivation", global_padding="SAME", num_labels=3)
    torch.manual_seed(0)
    model = transformers.BitForImageClassification(config).double().eval()
    convs = [n for n, m in model.named_modules() if type(m).__name__ == "WeightStandardizedConv2d"]
    for name in convs:
        model.get_submodule(name).eps = 1e-300  # batch_norm needs a positive eps; added to a variance, none
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name in convs:
            weight = other.get_submodule(name).weight
            weight.mul_(torch.exp(torch.randn(weight.shape[0], generator=g, dtype=torch.float64))[:, None, None, None])
    x, y = _images(4, 13, 3, seed=10)
    _rescaling_keeps_normalized_sharpness(model, other, [{"pixel_values": x, "labels": y}], rescaled=convs)


def test_timm_same_padded_convolution_channel_rescaling_invariance():
    """Two ``Conv2dSame`` with a relu between them: the first's output channels times positive
    factors, the second's input channels divided by them; the function is unchanged, both normalized
    sharpnesses stay, both traces move."""
    from timm.layers import Conv2dSame

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(Conv2dSame(3, 4, 3, stride=2), torch.nn.ReLU(), Conv2dSame(4, 5, 3, stride=2),
                                   torch.nn.Flatten(), torch.nn.Linear(5 * 3 * 3, 3)).double()

    torch.manual_seed(0)
    model, other = build(), build()
    other.load_state_dict(model.state_dict())
    units = torch.exp(torch.linspace(-1.0, 1.0, 4, dtype=torch.float64))
    with torch.no_grad():
        other[0].weight.mul_(units[:, None, None, None])
        other[0].bias.mul_(units)
        other[2].weight.div_(units[None, :, None, None])
    x, y = _images(5, 11, 3, seed=11)
    _rescaling_keeps_normalized_sharpness(model, other, [(x, y)], rescaled=["0", "2"])


def test_timm_condconv_is_reported_unsupported_with_its_reason():
    from timm.layers import CondConv2d

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.route = torch.nn.Linear(3, 2)
            self.conv = CondConv2d(3, 4, 3, num_experts=2)
            self.head = torch.nn.Linear(4 * 6 * 6, 3)  # timm pads CondConv2d to keep the size

        def forward(self, x):
            routing = torch.sigmoid(self.route(x.mean((2, 3))))
            return self.head(self.conv(x, routing).flatten(1))

    torch.manual_seed(0)
    model = Routed().double()
    x, y = _images(2, 6, 3)
    with pytest.warns(UserWarning, match="CondConv2d mixes several expert kernels"):
        report = normflat.analyze(model, [(x, y)], progress=False)
    assert [layer.name for layer in report.layers] == ["route", "head"]
    assert report.metadata["unsupported"] and report.metadata["coverage"] < 1


def test_timm_linear_rescaling_invariance():
    """Two timm ``Linear`` layers with a relu between them: the first's output units times positive
    factors, the second's inputs divided by them; the function is unchanged, both normalized
    sharpnesses stay, both traces move (on ``nn.Linear``'s fast rule)."""
    from timm.layers.linear import Linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(4, 6), torch.nn.ReLU(), Linear(6, 3)).double()
    other = torch.nn.Sequential(Linear(4, 6), torch.nn.ReLU(), Linear(6, 3)).double()
    other.load_state_dict(model.state_dict())
    units = torch.exp(torch.linspace(-1.0, 1.0, 6, dtype=torch.float64))
    with torch.no_grad():
        other[0].weight.mul_(units[:, None])
        other[0].bias.mul_(units)
        other[2].weight.div_(units)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)
    torch.testing.assert_close(other(x), model(x), rtol=1e-12, atol=1e-13)
    before = normflat.analyze(model, (x, y), loss="ce", estimator="ggn", progress=False)
    after = normflat.analyze(other, (x, y), loss="ce", estimator="ggn", progress=False)
    assert {layer.details["path"] for layer in before.layers} == {"fast"}
    for lb, la in zip(before.layers, after.layers):
        assert la.normalized_sharpness == pytest.approx(lb.normalized_sharpness, rel=1e-8), lb.name
        assert abs(la.hessian_trace - lb.hessian_trace) > 1e-3 * abs(lb.hessian_trace), lb.name


@pytest.mark.parametrize("build", [timm_resnet, timm_vit])
def test_gradient_checkpointing_is_off_for_the_analysis_and_switched_back_on(build):
    """A timm model trained with ``set_grad_checkpointing(True)`` (read in eval mode too): the
    Hessian-vector products, the generic path and the measures' gradients failed inside torch
    ("torch.func … don't yet support saved tensor hooks"). normflat runs the blocks directly for its
    forwards: the same numbers as the model without checkpointing, for every estimator and measure,
    and the switch is on again afterwards, the model otherwise untouched."""
    torch.manual_seed(0)
    plain = build().double()
    checkpointed = copy.deepcopy(plain)
    checkpointed.set_grad_checkpointing(True)
    x, y = _images(4, 16 if build is timm_vit else 32, 3)
    switches = {name: m.grad_checkpointing for name, m in checkpointed.named_modules()
                if "grad_checkpointing" in m.__dict__}
    assert switches and all(switches.values())
    before = snapshot(checkpointed)
    for options in (dict(estimator="hutchinson", samples=2), dict(estimator="ggn", fast=False),
                    dict(estimator="ggn")):
        got = normflat.hessian_diagonal(checkpointed, (x, y), progress=False, **options)
        want = normflat.hessian_diagonal(plain, (x, y), progress=False, **options)
        assert list(got) == list(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=0, msg=lambda m: f"{name}: {m}")
    measures = ["fisher_rao_norm", "adaptive_sharpness"]
    got = normflat.measures(checkpointed, (x, y), measures, loss="ce", progress=False)
    want = normflat.measures(plain, (x, y), measures, loss="ce", progress=False)
    assert [got[m] for m in measures] == pytest.approx([want[m] for m in measures], rel=1e-10)
    assert {name: m.grad_checkpointing for name, m in checkpointed.named_modules()
            if "grad_checkpointing" in m.__dict__} == switches
    assert_unchanged(checkpointed, before)


def test_a_forward_that_checkpoints_by_itself_is_refused_with_the_fix():
    """A forward that calls ``torch.utils.checkpoint`` itself (no switch to turn off): the Hessian-vector
    products and the measures' gradients, under ``torch.func``, raise one error naming checkpointing and
    the fix; ``ggn`` (its fast rules and its generic path, on autograd) gives the plain model's
    numbers."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
            self.head = torch.nn.Linear(6, 3)
            self.checkpointed = True

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
            return self.head(torch.tanh(h))

    torch.manual_seed(0)
    model = Checkpointed().double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.arange(5) % 3
    refused = r"recomputes activations with torch\.utils\.checkpoint .*turn it off for the analysis"
    for estimator in ("hutchinson", "exact"):
        with pytest.raises(ValueError, match=refused) as info:
            normflat.analyze(model, (x, y), estimator=estimator, progress=False)
        assert "saved tensor hooks" in str(info.value.__cause__)
    with pytest.raises(ValueError, match=refused):
        normflat.measures(model, (x, y), ["fisher_rao_norm"], loss="ce", progress=False)
    got = [normflat.hessian_diagonal(model, (x, y), estimator="ggn", fast=fast, progress=False)
           for fast in (True, False)]
    model.checkpointed = False
    want = normflat.hessian_diagonal(model, (x, y), estimator="ggn", progress=False)
    for diagonals in got:
        for name in want:
            torch.testing.assert_close(diagonals[name], want[name], rtol=1e-12, atol=1e-16)
