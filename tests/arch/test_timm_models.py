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


def test_timm_padded_and_standardized_convolutions_take_the_generic_path():
    """``Conv2dSame`` pads in its forward and ``StdConv2d`` standardizes its weight first: the
    parameter is a kernel, but the built-in fast rule would compute the wrong gradient."""
    from timm.layers import Conv2dSame, StdConv2d

    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv2dSame(3, 4, 3, stride=2), torch.nn.ReLU(), StdConv2d(4, 4, 3),
                                torch.nn.Flatten(), torch.nn.LazyLinear(3)).double()
    x, y = _images(2, 9, 3)
    model(x)  # materialize the lazy layer
    report = analyze_quietly(model, [(x, y)])
    paths = {layer.name: layer.details["path"] for layer in report.layers}
    assert paths == {"0": "generic", "2": "generic", "4": "fast"}
    got = normflat.hessian_diagonal(model, [(x, y)], estimator="ggn", progress=False)
    params = ["0.weight", "2.weight", "4.weight"]
    ref = reference_ggn(model, [{"x": x, "labels": y}], params, logits_of=_call)
    assert_close(got, dict(zip(["0", "2", "4"], (ref[p] for p in params))))


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
